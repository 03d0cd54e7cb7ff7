//! Requests from web browsers: which pages may call the API (their `Origin`), the CORS
//! answers those pages need, and the names a listener answers to (its `Host`).
//!
//! A browser sends a page's cross-site `POST` of `text/plain` without asking first, and a
//! page whose DNS name is rebound to 127.0.0.1 is "same origin" with a loopback gateway. So
//! without this, any page a user of an open (key-less) gateway visits could run generations on
//! it, and a rebound one could read the answers, `/metrics` and drain lanes on the admin
//! listener. The rules:
//! - a request carrying an `Origin` (a browser's) is refused with a 403 naming it unless
//!   `--allowed-origin` lists that origin (or `*`), or the origin is the request's own host
//!   (a page served through the same name, behind a proxy); clients that are not browsers
//!   (SDKs, curl, servers) send no `Origin` and are not affected;
//! - the allowed ones get CORS headers, and their preflight (`OPTIONS` with
//!   `Access-Control-Request-Method`) is answered;
//! - a listener bound to a loopback address answers only to the names `localhost`
//!   (`*.localhost`), IP addresses and `--allowed-host`: a rebound name gets a 403 naming it.
//!   Any listener answers only to those when `--allowed-host` is given.

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
    /// (`--allowed-host`); when empty, only loopback listeners check the name.
    pub hosts: Vec<String>,
}

impl Browsers {
    /// The policy from the flags' values: entries trimmed, empty ones dropped; an origin's
    /// trailing `/` dropped (`https://a.example/` is the origin `https://a.example`).
    pub fn new(origins: &[String], hosts: &[String]) -> Result<Browsers, String> {
        let mut b = Browsers::default();
        for o in origins.iter().map(|o| o.trim()).filter(|o| !o.is_empty()) {
            let o = o.trim_end_matches('/');
            if o != "*" && o != "null" && !o.contains("://") {
                return Err(format!(
                    "--allowed-origin `{o}` is not an origin: give the scheme and the host, \
                     e.g. https://app.example.com (or * for any page)"
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

    fn origin_allowed(&self, origin: &str, host: Option<&str>) -> bool {
        let o = origin.trim_end_matches('/').to_ascii_lowercase();
        if self.origins.iter().any(|a| a == "*" || *a == o) {
            return true;
        }
        // the page's own host (same origin): a page served through the gateway's name
        let authority = o.split_once("://").map(|(_, a)| a);
        matches!((authority, host), (Some(a), Some(h)) if a == h.to_ascii_lowercase())
    }

    fn host_allowed(&self, host: &str, loopback: bool) -> bool {
        if !loopback && self.hosts.is_empty() {
            return true;
        }
        let name = host_name(host);
        name == "localhost"
            || name.ends_with(".localhost")
            || name.parse::<std::net::IpAddr>().is_ok()
            || self.hosts.contains(&name)
    }
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

/// What the accept loop knows of the listener a request came in on
/// ([`crate::listen::serve`]): whether it is bound to a loopback address.
#[derive(Clone, Copy, Debug)]
pub struct Bound {
    pub loopback: bool,
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
    let loopback = req.extensions().get::<Bound>().is_some_and(|b| b.loopback);
    let host = request_host(&req);
    if let Some(h) = &host {
        if !policy.host_allowed(h, loopback) {
            let name: String = host_name(h).chars().take(256).collect();
            return refused(
                "host_not_allowed",
                format!(
                    "this server does not answer to the name `{name}` (Host header){}: name \
                     it with --allowed-host to allow it (a proxy in front of it that forwards \
                     its own name)",
                    if loopback {
                        " on a loopback listener, which answers to localhost and IP addresses"
                    } else {
                        ""
                    }
                ),
            );
        }
    }
    let Some(origin) = req.headers().get(header::ORIGIN) else {
        return next.run(req).await;
    };
    let origin = String::from_utf8_lossy(origin.as_bytes()).into_owned();
    if !policy.origin_allowed(&origin, host.as_deref()) {
        let shown: String = origin.chars().take(256).collect();
        return refused(
            "origin_not_allowed",
            format!(
                "requests from web pages of origin `{shown}` are refused: the API answers \
                 browser pages only of the origins --allowed-origin names"
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
    fn a_loopback_listener_answers_to_loopback_names_and_ip_addresses_only() {
        let open = Browsers::default();
        for ok in [
            "localhost:8000",
            "127.0.0.1:8000",
            "[::1]:80",
            "a.localhost",
            "10.0.0.7",
        ] {
            assert!(open.host_allowed(ok, true), "{ok}");
        }
        assert!(!open.host_allowed("evil.example:8000", true));
        // any name on another listener, unless names are given
        assert!(open.host_allowed("evil.example:8000", false));
        let named = Browsers::new(&[], &["API.example.com".into()]).expect("policy");
        assert!(named.host_allowed("api.example.com:443", true));
        assert!(named.host_allowed("api.example.com", false));
        assert!(!named.host_allowed("evil.example", false));
    }

    #[test]
    fn origins_are_allowed_by_name_wildcard_or_as_the_requests_own_host() {
        let b = Browsers::new(&["https://App.example.com/".into()], &[]).expect("policy");
        assert!(b.origin_allowed("https://app.example.com", None));
        assert!(!b.origin_allowed("http://app.example.com", None));
        assert!(!b.origin_allowed("https://evil.example", Some("127.0.0.1:8000")));
        assert!(b.origin_allowed("http://127.0.0.1:8000", Some("127.0.0.1:8000")));
        let any = Browsers::new(&["*".into()], &[]).expect("policy");
        assert!(any.origin_allowed("https://evil.example", None));
        assert!(Browsers::new(&["app.example.com".into()], &[]).is_err());
        assert!(Browsers::new(&[], &["a/b".into()]).is_err());
    }
}
