//! Requests from web browsers: which pages may call the API (their `Origin`), the CORS
//! answers those pages need, and the names the listeners answer to (their `Host`).
//!
//! A browser sends a page's cross-site `POST` of `text/plain` without asking the server first,
//! so without this any page a user of an open (key-less) gateway visits could run generations
//! on it or drain lanes on the admin listener. A browser puts `Origin` on every request but a
//! `GET` or `HEAD`, a page whose DNS name is rebound to 127.0.0.1 included. The rules:
//! - a request carrying an `Origin` (a browser's) is refused with a 403 naming it unless the
//!   page is on this host (`localhost`, `*.localhost`, a loopback address: a local web UI) or
//!   `--allowed-origin` lists that origin (or `*`); clients that are not browsers (SDKs, curl,
//!   servers) send no `Origin` and are not affected;
//! - the allowed ones get CORS headers, and their preflight (`OPTIONS` with
//!   `Access-Control-Request-Method`) is answered;
//! - with `--allowed-host`, the listeners answer only to those names, `localhost` and IP
//!   addresses as their `Host` (a rebound name's `GET`s of `/metrics` or `/v1/models` are then
//!   refused too); without it any `Host` is answered (raw clients send all sorts).

use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::response::{IntoResponse, Response};
use serde_json::json;
use std::sync::Arc;

use crate::server::AppState;

/// Which browser pages may call the API, and the names the listeners answer to.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Browsers {
    /// Origins (`https://app.example.com`, compared without case; `*`: any) whose pages may
    /// call the API (`--allowed-origin`).
    pub origins: Vec<String>,
    /// Host names the listeners answer to besides `localhost` and IP addresses
    /// (`--allowed-host`); when empty, any name.
    pub hosts: Vec<String>,
}

impl Browsers {
    /// The policy from the flags' values: entries trimmed, empty ones dropped; an origin's
    /// trailing `/` dropped (`https://a.example/` is the origin `https://a.example`).
    pub fn new(origins: &[String], hosts: &[String]) -> Result<Browsers, String> {
        let mut b = Browsers::default();
        for o in origins.iter().map(|o| o.trim()).filter(|o| !o.is_empty()) {
            let o = o.trim_end_matches('/');
            let path = o
                .split_once("://")
                .is_some_and(|(_, rest)| rest.contains('/'));
            if o != "*" && o != "null" && (!o.contains("://") || path) {
                return Err(format!(
                    "--allowed-origin `{o}` is not an origin: give the scheme and the host \
                     (and port), no path, e.g. https://app.example.com (or * for any page)"
                ));
            }
            b.origins.push(o.to_ascii_lowercase());
        }
        for h in hosts.iter().map(|h| h.trim()).filter(|h| !h.is_empty()) {
            if h.contains('/') || h.contains(char::is_whitespace) {
                return Err(format!(
                    "--allowed-host `{h}` is not a host name (give the name alone, e.g. \
                     api.example.com)"
                ));
            }
            b.hosts.push(host_name(h));
        }
        Ok(b)
    }

    fn origin_allowed(&self, origin: &str) -> bool {
        let o = origin.trim_end_matches('/').to_ascii_lowercase();
        if self.origins.iter().any(|a| a == "*" || *a == o) {
            return true;
        }
        // a page of this host (a local web UI): its name is a loopback one
        o.split_once("://")
            .is_some_and(|(_, authority)| loopback_name(&host_name(authority)))
    }

    fn host_allowed(&self, host: &str) -> bool {
        if self.hosts.is_empty() {
            return true;
        }
        let name = host_name(host);
        name == "localhost"
            || name.ends_with(".localhost")
            || name.parse::<std::net::IpAddr>().is_ok()
            || self.hosts.contains(&name)
    }
}

/// `localhost`, a name under it, or a loopback address.
fn loopback_name(name: &str) -> bool {
    name == "localhost"
        || name.ends_with(".localhost")
        || name
            .parse::<std::net::IpAddr>()
            .is_ok_and(|a| a.to_canonical().is_loopback())
}

/// A `Host` value's name: the port and a trailing dot dropped, brackets of an IPv6 literal
/// taken off, lower case.
fn host_name(host: &str) -> String {
    let h = host.trim();
    let name = if let Some(rest) = h.strip_prefix('[') {
        rest.split(']').next().unwrap_or(rest)
    } else {
        match h.rsplit_once(':') {
            Some((n, port)) if port.bytes().all(|b| b.is_ascii_digit()) => n,
            _ => h,
        }
    };
    name.trim_end_matches('.').to_ascii_lowercase()
}

fn refused(code: &'static str, message: String) -> Response {
    let body = json!({"error": {"message": message, "type": "invalid_request_error",
                                "param": null, "code": code}});
    (StatusCode::FORBIDDEN, axum::Json(body)).into_response()
}

/// The request's host: its `Host` header, else its URI's authority (HTTP/2 style).
fn request_host(req: &Request) -> Option<String> {
    req.headers()
        .get(header::HOST)
        .and_then(|v| v.to_str().ok())
        .map(String::from)
        .or_else(|| req.uri().authority().map(|a| a.to_string()))
}

/// The middleware: the rules of the module docs.
pub(crate) async fn guard(
    State(st): State<Arc<AppState>>,
    req: Request,
    next: axum::middleware::Next,
) -> Response {
    let policy = &st.auth.browsers;
    if let Some(h) = request_host(&req) {
        if !policy.host_allowed(&h) {
            let name: String = host_name(&h).chars().take(256).collect();
            return refused(
                "host_not_allowed",
                format!(
                    "this server does not answer to the name `{name}` (Host header): it \
                     answers to localhost, IP addresses and the names --allowed-host gives"
                ),
            );
        }
    }
    let Some(origin) = req.headers().get(header::ORIGIN) else {
        return next.run(req).await;
    };
    let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
    if !policy.origin_allowed(&origin) {
        let shown: String = origin.chars().take(256).collect();
        return refused(
            "origin_not_allowed",
            format!(
                "requests from web pages of origin `{shown}` are refused: the API answers \
                 browser pages of this host (localhost) and of the origins --allowed-origin \
                 names"
            ),
        );
    }
    let origin = HeaderValue::from_str(&origin).unwrap_or(HeaderValue::from_static("null"));
    let preflight = req.method() == Method::OPTIONS
        && req
            .headers()
            .contains_key(header::ACCESS_CONTROL_REQUEST_METHOD);
    if preflight {
        let mut h = HeaderMap::new();
        h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
        h.insert(
            header::ACCESS_CONTROL_ALLOW_METHODS,
            HeaderValue::from_static("GET, POST, DELETE, OPTIONS"),
        );
        if let Some(asked) = req
            .headers()
            .get(header::ACCESS_CONTROL_REQUEST_HEADERS)
            .filter(|v| v.len() <= 4096)
        {
            h.insert(header::ACCESS_CONTROL_ALLOW_HEADERS, asked.clone());
        }
        h.insert(
            header::ACCESS_CONTROL_MAX_AGE,
            HeaderValue::from_static("600"),
        );
        h.insert(header::VARY, HeaderValue::from_static("Origin"));
        return (StatusCode::NO_CONTENT, h).into_response();
    }
    let mut r = next.run(req).await;
    let h = r.headers_mut();
    h.insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, origin);
    h.insert(
        header::ACCESS_CONTROL_EXPOSE_HEADERS,
        HeaderValue::from_static("retry-after, x-request-id"),
    );
    h.append(header::VARY, HeaderValue::from_static("Origin"));
    r
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn host_names_are_read_without_port_brackets_or_case() {
        assert_eq!(host_name("LocalHost:8000"), "localhost");
        assert_eq!(host_name("[::1]:8000"), "::1");
        assert_eq!(host_name("api.example.com."), "api.example.com");
        assert_eq!(host_name("evil.example"), "evil.example");
    }

    #[test]
    fn names_are_checked_only_where_names_are_given() {
        let open = Browsers::default();
        assert!(open.host_allowed("x"));
        assert!(open.host_allowed("evil.example:8000"));
        let named = Browsers::new(&[], &["API.example.com".into()]).expect("policy");
        for ok in [
            "api.example.com:443",
            "localhost:8000",
            "127.0.0.1",
            "[::1]:80",
            "10.0.0.7",
        ] {
            assert!(named.host_allowed(ok), "{ok}");
        }
        assert!(!named.host_allowed("evil.example"));
    }

    #[test]
    fn origins_are_allowed_by_name_wildcard_or_as_pages_of_this_host() {
        let b = Browsers::new(&["https://App.example.com/".into()], &[]).expect("policy");
        assert!(b.origin_allowed("https://app.example.com"));
        assert!(!b.origin_allowed("http://app.example.com"));
        assert!(!b.origin_allowed("https://evil.example"));
        assert!(!b.origin_allowed("null"));
        for local in [
            "http://localhost:3000",
            "http://127.0.0.1:8000",
            "http://[::1]:5173",
            "http://ui.localhost",
        ] {
            assert!(b.origin_allowed(local), "{local}");
        }
        // a rebound name is not a loopback one, whatever it resolves to
        assert!(!b.origin_allowed("http://evil.example:8000"));
        let any = Browsers::new(&["*".into()], &[]).expect("policy");
        assert!(any.origin_allowed("https://evil.example"));
        assert!(Browsers::new(&["app.example.com".into()], &[]).is_err());
        assert!(Browsers::new(&["https://a.example/app".into()], &[]).is_err());
        assert!(Browsers::new(&["chrome-extension://abcdef".into()], &[]).is_ok());
        assert!(Browsers::new(&[], &["a/b".into()]).is_err());
    }
}
