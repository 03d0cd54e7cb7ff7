//! A small streaming HTTP/1.1 client for OpenAI-compatible servers (any of them: moelane,
//! vLLM, llama.cpp's server): posts a streaming completion and yields the SSE `data:`
//! payloads as they arrive, with their arrival times.

use std::time::Instant;

use anyhow::{Context, Result};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Splits "http://host:port/prefix" into ("host:port", "/prefix").
pub fn split_url(url: &str) -> Result<(String, String)> {
    let rest = url
        .strip_prefix("http://")
        .context("only http:// URLs are supported")?;
    let (host, path) = match rest.find('/') {
        Some(i) => (&rest[..i], &rest[i..]),
        None => (rest, ""),
    };
    Ok((host.to_string(), path.trim_end_matches('/').to_string()))
}

/// Decodes `Transfer-Encoding: chunked` incrementally.
#[derive(Default)]
struct Chunked {
    buf: Vec<u8>,
    left: usize,
    done: bool,
}

impl Chunked {
    fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) {
        self.buf.extend_from_slice(data);
        loop {
            if self.left > 0 {
                let n = self.left.min(self.buf.len());
                out.extend_from_slice(&self.buf[..n]);
                self.buf.drain(..n);
                self.left -= n;
                if self.left > 0 {
                    return;
                }
                continue;
            }
            // the CRLF that ends each chunk's data
            while self.buf.starts_with(b"\r\n") {
                self.buf.drain(..2);
            }
            let Some(p) = self.buf.windows(2).position(|w| w == b"\r\n") else {
                return;
            };
            let line = String::from_utf8_lossy(&self.buf[..p]).to_string();
            let size =
                usize::from_str_radix(line.split(';').next().unwrap_or("").trim(), 16).unwrap_or(0);
            self.buf.drain(..p + 2);
            if size == 0 {
                self.done = true;
                return;
            }
            self.left = size;
        }
    }
}

/// A request answered with a status other than 200 (the body as far as it was read), so
/// callers can tell it from a connection that failed (an `std::io::Error` in the chain).
#[derive(Debug)]
pub struct HttpStatus {
    pub status: u16,
    pub body: String,
}

impl std::fmt::Display for HttpStatus {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HTTP {}: {}", self.status, self.body)
    }
}

impl std::error::Error for HttpStatus {}

fn closed(what: &str) -> std::io::Error {
    std::io::Error::new(std::io::ErrorKind::UnexpectedEof, what.to_string())
}

/// One streamed request: every `data:` payload with the instant it arrived. A status other
/// than 200 is an [`HttpStatus`] error; a connection that closes before the response's head,
/// or inside a chunked body, is an `UnexpectedEof` I/O error.
pub async fn stream_post(host: &str, path: &str, body: &str) -> Result<Vec<(Instant, String)>> {
    let mut s = TcpStream::connect(host)
        .await
        .with_context(|| format!("connecting to {host}"))?;
    s.set_nodelay(true)?;
    let req = format!("POST {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nAccept: text/event-stream\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}", body.len());
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    let mut buf = vec![0u8; 16384];
    let mut header: Option<(u16, bool)> = None;
    let mut dec = Chunked::default();
    let mut text = Vec::new();
    let mut events = Vec::new();
    loop {
        let n = s.read(&mut buf).await?;
        if n == 0 {
            match header {
                None => return Err(closed("connection closed before a response").into()),
                Some((_, true)) => return Err(closed("connection closed inside the stream").into()),
                Some((_, false)) => break,
            }
        }
        let now = Instant::now();
        let mut data = &buf[..n];
        if header.is_none() {
            raw.extend_from_slice(data);
            let Some(p) = raw.windows(4).position(|w| w == b"\r\n\r\n") else {
                continue;
            };
            let head = String::from_utf8_lossy(&raw[..p]).to_ascii_lowercase();
            let status = head
                .split_whitespace()
                .nth(1)
                .and_then(|x| x.parse().ok())
                .unwrap_or(0);
            header = Some((status, head.contains("transfer-encoding: chunked")));
            let body_start = raw[p + 4..].to_vec();
            raw = body_start;
            data = &raw;
            if status != 200 {
                let mut rest = data.to_vec();
                let mut more = Vec::new();
                let _ = s.read_to_end(&mut more).await;
                rest.extend(more);
                return Err(HttpStatus {
                    status,
                    body: String::from_utf8_lossy(&rest).into_owned(),
                }
                .into());
            }
        }
        let chunked = header.map(|h| h.1).unwrap_or(false);
        if chunked {
            let copy = data.to_vec();
            dec.feed(&copy, &mut text);
        } else {
            text.extend_from_slice(data);
        }
        while let Some(p) = text.windows(2).position(|w| w == b"\n\n") {
            let ev = String::from_utf8_lossy(&text[..p]).to_string();
            text.drain(..p + 2);
            for line in ev.lines() {
                if let Some(d) = line.strip_prefix("data:") {
                    events.push((now, d.trim().to_string()));
                }
            }
        }
        if dec.done {
            break;
        }
    }
    Ok(events)
}

/// GET a path; returns the body (Content-Length or chunked).
pub async fn stream_get(host: &str, path: &str) -> Result<String> {
    Ok(request(host, "GET", path, None).await?.1)
}

/// One request (a JSON body or none) on its own connection: the status and the body
/// (Content-Length or chunked).
pub async fn request(
    host: &str,
    method: &str,
    path: &str,
    json: Option<&str>,
) -> Result<(u16, String)> {
    request_as(host, method, path, json, None).await
}

/// [`request`] presenting `bearer` (Authorization: Bearer) when given.
pub async fn request_as(
    host: &str,
    method: &str,
    path: &str,
    json: Option<&str>,
    bearer: Option<&str>,
) -> Result<(u16, String)> {
    let mut s = TcpStream::connect(host)
        .await
        .with_context(|| format!("connecting to {host}"))?;
    let body = json.unwrap_or("");
    let auth = bearer
        .map(|t| format!("Authorization: Bearer {t}\r\n"))
        .unwrap_or_default();
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n\
         {auth}Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    s.write_all(req.as_bytes()).await?;
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).await?;
    let p = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .context("no HTTP header")?;
    let head = String::from_utf8_lossy(&raw[..p]).to_ascii_lowercase();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|x| x.parse().ok())
        .context("no HTTP status")?;
    let body = &raw[p + 4..];
    if head.contains("transfer-encoding: chunked") {
        let mut d = Chunked::default();
        let mut out = Vec::new();
        d.feed(body, &mut out);
        return Ok((status, String::from_utf8_lossy(&out).into_owned()));
    }
    Ok((status, String::from_utf8_lossy(body).into_owned()))
}

/// A gRPC client of the primary at `url` that presents this process's cluster token.
pub async fn primary(
    url: &str,
) -> Result<moelane_proto::lane::primary_client::PrimaryClient<moelane_proto::auth::AuthChannel>> {
    let ch = moelane_proto::tls::endpoint(url)
        .map_err(anyhow::Error::msg)
        .with_context(|| format!("{url:?} is not a URL"))?
        .connect()
        .await
        .with_context(|| format!("connecting to the primary at {url}"))?;
    Ok(moelane_proto::lane::primary_client::PrimaryClient::new(
        moelane_proto::auth::attach(ch),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chunked_decoding_survives_any_split() {
        let body = b"5\r\nhello\r\n7\r\n, world\r\n0\r\n\r\n";
        for cut in 0..body.len() {
            let mut d = Chunked::default();
            let mut out = Vec::new();
            d.feed(&body[..cut], &mut out);
            d.feed(&body[cut..], &mut out);
            assert_eq!(out, b"hello, world", "cut {cut}");
            assert!(d.done);
        }
    }
}
