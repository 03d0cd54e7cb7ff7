//! Fixtures for tests that run real `moelane` processes: the tiny checkpoint, child
//! processes that print the address they bound (port 0, no race), and a small HTTP/1.1
//! client over a plain socket.
#![allow(dead_code)]

pub mod swaps;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

pub fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_moelane")
}

/// The tiny checkpoint, generated once per test binary by `moelane gen`.
pub fn tiny() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir()
            .join(format!("moelane-it-{}", std::process::id()))
            .join("tiny");
        let st = Command::new(bin())
            .args([
                "gen",
                "--preset",
                "tiny",
                "--seed",
                "1",
                "--answer-len",
                "64",
                "--out",
            ])
            .arg(&d)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .expect("run moelane gen");
        assert!(st.success(), "moelane gen failed");
        d
    })
}

/// A child process, killed on drop.
pub struct Proc {
    pub child: Child,
    pub lines: Vec<String>,
}

impl Drop for Proc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Starts `moelane args...` and waits until it has printed a line containing each of `wants`;
/// returns the process and, per want, the text after it on its line.
pub fn start(args: &[&str], wants: &[&str]) -> (Proc, Vec<String>) {
    start_env(args, wants, &[])
}

/// [`start`] with extra environment variables.
pub fn start_env(args: &[&str], wants: &[&str], env: &[(&str, &str)]) -> (Proc, Vec<String>) {
    let mut child = Command::new(bin())
        .args(args)
        .envs(env.iter().copied())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawn moelane");
    let out = child.stdout.take().expect("stdout");
    let mut rd = BufReader::new(out);
    let mut found: Vec<Option<String>> = vec![None; wants.len()];
    let mut lines = Vec::new();
    let deadline = Instant::now() + Duration::from_secs(120);
    while found.iter().any(|f| f.is_none()) {
        assert!(
            Instant::now() < deadline,
            "moelane {args:?} did not start: {lines:?}"
        );
        let mut l = String::new();
        if rd.read_line(&mut l).unwrap_or(0) == 0 {
            panic!("moelane {args:?} exited early: {lines:?}");
        }
        for (i, w) in wants.iter().enumerate() {
            if let Some(p) = l.find(w) {
                found[i] = Some(l[p + w.len()..].trim().to_string());
            }
        }
        lines.push(l);
    }
    // keep draining stdout so the child never blocks on a full pipe
    std::thread::spawn(move || {
        let mut sink = String::new();
        while rd.read_line(&mut sink).unwrap_or(0) > 0 {
            sink.clear();
        }
    });
    (
        Proc { child, lines },
        found.into_iter().map(|f| f.unwrap_or_default()).collect(),
    )
}

/// "http://127.0.0.1:1234/v1" (or https://, grpc://) -> "127.0.0.1:1234"
pub fn hostport(url: &str) -> String {
    url.trim_start_matches("http://")
        .trim_start_matches("https://")
        .trim_start_matches("grpc://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string()
}

/// Starts `moelane serve --model DIR --listen 127.0.0.1:0 EXTRA...`; returns the process, the
/// primary's gRPC URL and the gateway's host:port.
pub fn serve_lane(dir: &Path, extra: &[&str]) -> (Proc, String, String) {
    let d = dir.to_str().unwrap();
    let mut args = vec!["serve", "--model", d, "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let (p, v) = start(&args, &["primary grpc://", "gateway listening on "]);
    let purl = format!("http://{}", v[0].split(',').next().unwrap_or_default());
    (p, purl, hostport(&v[1]))
}

/// Starts the embedded lane on the tiny checkpoint; returns (process, gateway host:port).
pub fn serve_tiny(extra: &[&str]) -> (Proc, String) {
    let dir = tiny().to_str().unwrap().to_string();
    let mut args = vec!["serve", "--model", dir.as_str(), "--listen", "127.0.0.1:0"];
    args.extend_from_slice(extra);
    let (p, v) = start(&args, &["gateway listening on "]);
    (p, hostport(&v[0]))
}

pub struct HttpResponse {
    pub status: u16,
    pub body: String,
}

fn read_response(s: &mut TcpStream) -> HttpResponse {
    let mut raw = Vec::new();
    s.read_to_end(&mut raw).expect("read response");
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .expect("header end");
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let mut body = raw[split + 4..].to_vec();
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        let mut out = Vec::new();
        let mut i = 0;
        while let Some(p) = body[i..].windows(2).position(|w| w == b"\r\n") {
            let n = usize::from_str_radix(String::from_utf8_lossy(&body[i..i + p]).trim(), 16)
                .unwrap_or(0);
            i += p + 2;
            if n == 0 {
                break;
            }
            out.extend_from_slice(&body[i..i + n]);
            i += n + 2;
        }
        body = out;
    }
    HttpResponse {
        status,
        body: String::from_utf8_lossy(&body).into_owned(),
    }
}

pub fn request(addr: &str, method: &str, path: &str, body: &[u8]) -> HttpResponse {
    request_with(addr, method, path, body, "")
}

/// [`request`] with extra header lines (each ending in \r\n).
pub fn request_with(
    addr: &str,
    method: &str,
    path: &str,
    body: &[u8],
    headers: &str,
) -> HttpResponse {
    let mut s = TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(60))).ok();
    let head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n", body.len());
    s.write_all(head.as_bytes()).expect("write");
    let _ = s.write_all(body);
    read_response(&mut s)
}

pub fn post(addr: &str, path: &str, json: &serde_json::Value) -> (u16, serde_json::Value) {
    let r = request(addr, "POST", path, json.to_string().as_bytes());
    let v = serde_json::from_str(&r.body).unwrap_or(serde_json::Value::String(r.body.clone()));
    (r.status, v)
}

/// [`post`] presenting `token` (Authorization: Bearer).
pub fn post_as(
    addr: &str,
    path: &str,
    json: &serde_json::Value,
    token: &str,
) -> (u16, serde_json::Value) {
    let r = request_with(
        addr,
        "POST",
        path,
        json.to_string().as_bytes(),
        &format!("Authorization: Bearer {token}\r\n"),
    );
    let v = serde_json::from_str(&r.body).unwrap_or(serde_json::Value::String(r.body.clone()));
    (r.status, v)
}

pub fn get(addr: &str, path: &str) -> (u16, serde_json::Value) {
    let r = request(addr, "GET", path, b"");
    let v = serde_json::from_str(&r.body).unwrap_or(serde_json::Value::String(r.body.clone()));
    (r.status, v)
}

/// Greedy text of a completion.
pub fn complete(addr: &str, prompt: &str, max_tokens: usize) -> String {
    let (st, v) = post(
        addr,
        "/v1/completions",
        &serde_json::json!({"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}),
    );
    assert_eq!(st, 200, "{v}");
    v["choices"][0]["text"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

/// The gateway's view of `lane` in /v1/stats: up, down, ejected, draining (absent when not
/// listed).
pub fn lane_state(gw: &str, lane: &str) -> String {
    let (_, v) = get(gw, "/v1/stats");
    v["lanes"]
        .as_array()
        .and_then(|ls| ls.iter().find(|l| l["lane"] == lane))
        .and_then(|l| l["state"].as_str())
        .unwrap_or("absent")
        .to_string()
}

/// KV blocks used on the first lane, per /v1/stats.
pub fn kv_used(addr: &str) -> (u64, u64) {
    let (_, v) = get(addr, "/v1/stats");
    let s = &v["lanes"][0]["stats"];
    (
        s["kv_blocks_used"].as_u64().unwrap_or(u64::MAX),
        s["requests_cancelled"].as_u64().unwrap_or(0),
    )
}

/// A two-process lane on the tiny checkpoint: sidecar process, primary process over `link`,
/// gateway process. Returns the processes (killed on drop), the gateway's host:port and the
/// primary's URL.
pub fn two_process_lane(link: &str, primary_extra: &[&str]) -> (Vec<Proc>, String, String) {
    two_process_lane_env(link, primary_extra, &[])
}

/// [`two_process_lane`] with extra environment variables for all three processes.
pub fn two_process_lane_env(
    link: &str,
    primary_extra: &[&str],
    env: &[(&str, &str)],
) -> (Vec<Proc>, String, String) {
    two_process_lane_with(link, &[], primary_extra, env)
}

/// [`two_process_lane_env`] with extra arguments for the sidecar too.
pub fn two_process_lane_with(
    link: &str,
    sidecar_extra: &[&str],
    primary_extra: &[&str],
    env: &[(&str, &str)],
) -> (Vec<Proc>, String, String) {
    let dir = tiny().to_str().unwrap().to_string();
    let mut sargs = vec![
        "lane",
        "--role",
        "sidecar",
        "--model",
        dir.as_str(),
        "--listen",
        "127.0.0.1:0",
        "--data",
        "127.0.0.1:0",
    ];
    sargs.extend_from_slice(sidecar_extra);
    let (side, v) = start_env(
        &sargs,
        &["sidecar control ", "moelane: metrics http://"],
        env,
    );
    let mut args = vec![
        "lane",
        "--role",
        "primary",
        "--model",
        dir.as_str(),
        "--listen",
        "127.0.0.1:0",
        "--sidecar",
        v[0].as_str(),
        "--link",
        link,
    ];
    args.extend_from_slice(primary_extra);
    let (prim, pv) = start_env(&args, &["primary grpc ", "moelane: metrics http://"], env);
    let purl = pv[0].split(',').next().unwrap_or_default().to_string();
    let (gw, gv) = start_env(
        &[
            "lane",
            "--role",
            "gateway",
            "--model",
            &dir,
            "--listen",
            "127.0.0.1:0",
            "--lane",
            &purl,
        ],
        &["gateway listening on "],
        env,
    );
    (vec![side, prim, gw], hostport(&gv[0]), purl)
}

/// 50 prompts: the first 10 of each of the five languages, 40 characters each.
pub fn prompts50() -> Vec<String> {
    (0..5)
        .flat_map(|l| {
            moelane_engine::synth::prompts(l)
                .into_iter()
                .take(10)
                .map(|p| p.chars().take(40).collect::<String>())
        })
        .collect()
}

/// The host:port of the Prometheus page a process printed at start (primary, sidecar).
pub fn metrics_addr(p: &Proc) -> String {
    p.lines
        .iter()
        .find_map(|l| l.split("moelane: metrics http://").nth(1))
        .map(|r| r.trim().trim_end_matches("/metrics").to_string())
        .expect("the process printed no metrics address")
}

/// A streamed (server-sent events) response read as it arrives: the status, then each
/// `data:` payload in order.
pub struct Sse {
    rd: BufReader<TcpStream>,
    pub status: u16,
    chunked: bool,
    buf: String,
    eof: bool,
}

impl Sse {
    /// POSTs `json` to `path` and reads the response's head.
    pub fn open(addr: &str, path: &str, json: &serde_json::Value) -> std::io::Result<Sse> {
        Sse::open_with(addr, path, json, "")
    }

    /// [`Sse::open`] with extra header lines (each ending in \r\n).
    pub fn open_with(
        addr: &str,
        path: &str,
        json: &serde_json::Value,
        headers: &str,
    ) -> std::io::Result<Sse> {
        let mut s = TcpStream::connect(addr)?;
        s.set_read_timeout(Some(Duration::from_secs(60)))?;
        let body = json.to_string();
        let head = format!("POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n{headers}Content-Length: {}\r\nConnection: close\r\n\r\n", body.len());
        s.write_all(head.as_bytes())?;
        s.write_all(body.as_bytes())?;
        let mut rd = BufReader::new(s);
        let mut status = 0;
        let mut chunked = false;
        loop {
            let mut l = String::new();
            if rd.read_line(&mut l)? == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "the connection closed before the response's head ended",
                ));
            }
            let t = l.trim_end();
            if status == 0 {
                status = t
                    .split_whitespace()
                    .nth(1)
                    .and_then(|x| x.parse().ok())
                    .unwrap_or(0);
            } else if t.is_empty() {
                break;
            } else if t.to_ascii_lowercase().starts_with("transfer-encoding:")
                && t.to_ascii_lowercase().contains("chunked")
            {
                chunked = true;
            }
        }
        Ok(Sse {
            rd,
            status,
            chunked,
            buf: String::new(),
            eof: false,
        })
    }

    /// Reads more of the body into the buffer; false at its end.
    fn fill(&mut self) -> bool {
        if self.eof {
            return false;
        }
        if !self.chunked {
            let mut l = String::new();
            match self.rd.read_line(&mut l) {
                Ok(0) | Err(_) => {
                    self.eof = true;
                    return false;
                }
                Ok(_) => self.buf.push_str(&l),
            }
            return true;
        }
        let mut size = String::new();
        if self.rd.read_line(&mut size).unwrap_or(0) == 0 {
            self.eof = true;
            return false;
        }
        let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
        if n == 0 {
            self.eof = true;
            return false;
        }
        let mut chunk = vec![0u8; n + 2];
        if self.rd.read_exact(&mut chunk).is_err() {
            self.eof = true;
            return false;
        }
        self.buf.push_str(&String::from_utf8_lossy(&chunk[..n]));
        true
    }

    /// The next `data:` payload; None at the end of the body (or a cut connection).
    pub fn next_data(&mut self) -> Option<String> {
        loop {
            if let Some(p) = self.buf.find("\n\n") {
                let ev: String = self.buf[..p].to_string();
                self.buf.drain(..p + 2);
                let data: Vec<&str> = ev
                    .lines()
                    .filter_map(|l| l.strip_prefix("data:"))
                    .map(|d| d.strip_prefix(' ').unwrap_or(d))
                    .collect();
                if data.is_empty() {
                    continue; // a comment (keep-alive)
                }
                return Some(data.join("\n"));
            }
            if !self.fill() {
                return None;
            }
        }
    }

    /// The next event as sent, comments included (`: text`); None at the end of the body.
    pub fn next_raw(&mut self) -> Option<String> {
        loop {
            if let Some(p) = self.buf.find("\n\n") {
                let ev: String = self.buf[..p].to_string();
                self.buf.drain(..p + 2);
                return Some(ev);
            }
            if !self.fill() {
                return None;
            }
        }
    }

    /// The rest of the body as text (for an error answered without streaming).
    pub fn rest(&mut self) -> String {
        while self.fill() {}
        std::mem::take(&mut self.buf)
    }
}

/// How a streamed completion ended, as a client sees it.
#[derive(Debug, Default, Clone)]
pub struct Streamed {
    pub status: u16,
    pub text: String,
    pub chunks: usize,
    pub finish: Option<String>,
    /// The error object, if one came (mid-stream, or as the answer's body).
    pub error: Option<serde_json::Value>,
    pub done: bool,
}

impl Streamed {
    /// Whole and finished: 200, a finish reason, [DONE], no error.
    pub fn ok(&self) -> bool {
        self.status == 200 && self.finish.is_some() && self.done && self.error.is_none()
    }
    /// Cut honestly: an error object and no finish reason.
    pub fn cut_honestly(&self) -> bool {
        self.error.is_some() && self.finish.is_none()
    }
}

/// Reads a streamed completion to its end; `after(n)` is called after the n-th chunk.
pub fn stream_completion(
    addr: &str,
    body: &serde_json::Value,
    mut after: impl FnMut(usize),
) -> Streamed {
    let mut out = Streamed::default();
    let mut s = match Sse::open(addr, "/v1/completions", body) {
        Ok(s) => s,
        Err(e) => {
            out.error = Some(serde_json::json!({"connect": e.to_string()}));
            return out;
        }
    };
    out.status = s.status;
    if s.status != 200 {
        let b = s.rest();
        out.error = Some(serde_json::from_str(&b).unwrap_or(serde_json::Value::String(b)));
        return out;
    }
    while let Some(d) = s.next_data() {
        if d == "[DONE]" {
            out.done = true;
            break;
        }
        let v: serde_json::Value = serde_json::from_str(&d).unwrap_or(serde_json::Value::Null);
        if v.get("error").is_some() {
            out.error = Some(v);
            continue;
        }
        let c = &v["choices"][0];
        out.text.push_str(c["text"].as_str().unwrap_or(""));
        if let Some(f) = c["finish_reason"].as_str() {
            out.finish = Some(f.to_string());
        }
        out.chunks += 1;
        after(out.chunks);
    }
    out
}

/// Sends `sig` (TERM, INT, KILL, STOP, CONT) to a child.
pub fn signal(p: &Proc, sig: &str) {
    let st = Command::new("kill")
        .args([format!("-{sig}"), p.child.id().to_string()])
        .status()
        .expect("run kill");
    assert!(st.success(), "kill -{sig} failed");
}

/// Waits at most `limit` for a child to exit; its exit code (None: a signal ended it).
pub fn wait_exit(p: &mut Proc, limit: Duration) -> Option<i32> {
    let until = Instant::now() + limit;
    loop {
        if let Some(st) = p.child.try_wait().expect("try_wait") {
            return st.code();
        }
        assert!(
            Instant::now() < until,
            "the process did not exit within {limit:?}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Polls `f` every 20 ms until it is true, at most `limit`; the time it took.
pub fn until(limit: Duration, what: &str, mut f: impl FnMut() -> bool) -> Duration {
    let t0 = Instant::now();
    while !f() {
        assert!(t0.elapsed() < limit, "{what}: not within {limit:?}");
        std::thread::sleep(Duration::from_millis(20));
    }
    t0.elapsed()
}
