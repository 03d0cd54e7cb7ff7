//! Shared secrets: API keys, the admin token, the cluster token. A surface holds the SHA-256
//! digest of each secret it accepts and compares a presented one against every digest
//! without an early exit, so neither the answer's time nor the code path tells which key (or
//! how much of one) matched. A file holds one secret per line (`#` comments, blank lines
//! skipped); a secret shorter than 16 characters is refused as guessable.

use std::path::Path;
use std::sync::Arc;

use sha2::{Digest, Sha256};

/// The shortest secret accepted.
pub const MIN_SECRET: usize = 16;

/// The secrets one surface accepts.
#[derive(Clone)]
pub struct Keys {
    digests: Vec<[u8; 32]>,
    /// The first secret, for a client of this surface (the cluster token a process presents).
    first: String,
}

impl std::fmt::Debug for Keys {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Keys({} secret(s))", self.digests.len())
    }
}

impl Keys {
    /// Parses secrets, one per line; `what` names the source in errors.
    pub fn parse(text: &str, what: &str) -> Result<Keys, String> {
        let mut digests = Vec::new();
        let mut first = None;
        for (i, line) in text.lines().enumerate() {
            let k = line.trim();
            if k.is_empty() || k.starts_with('#') {
                continue;
            }
            if k.chars().count() < MIN_SECRET {
                return Err(format!(
                    "{what}, line {}: a secret of {} characters is too short to stay secret \
                     (use {MIN_SECRET} or more, e.g. `openssl rand -hex 32`)",
                    i + 1,
                    k.chars().count()
                ));
            }
            if k.chars().any(|c| c.is_whitespace() || c.is_control()) {
                return Err(format!(
                    "{what}, line {}: a secret may not hold spaces or control characters",
                    i + 1
                ));
            }
            digests.push(Sha256::digest(k.as_bytes()).into());
            first.get_or_insert_with(|| k.to_string());
        }
        let Some(first) = first else {
            return Err(format!("{what} holds no secret (one per line)"));
        };
        Ok(Keys { digests, first })
    }

    /// Reads secrets from a file.
    pub fn from_file(path: &Path) -> Result<Keys, String> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("reading {}: {e}", path.display()))?;
        Keys::parse(&text, &path.display().to_string())
    }

    /// Secrets from a file if given, else from an environment variable's value.
    pub fn load(file: Option<&Path>, env: &str) -> Result<Option<Keys>, String> {
        if let Some(f) = file {
            return Keys::from_file(f).map(Some);
        }
        match std::env::var(env) {
            Ok(v) if !v.trim().is_empty() => Keys::parse(&v, env).map(Some),
            _ => Ok(None),
        }
    }

    /// Whether `presented` is one of the secrets (constant time in which one, and in how
    /// much of it, matches).
    pub fn accepts(&self, presented: &[u8]) -> bool {
        self.which(presented).is_some()
    }

    /// Which secret `presented` is (its place among the secrets), if one: every digest is
    /// compared, without an early exit.
    pub fn which(&self, presented: &[u8]) -> Option<usize> {
        let d: [u8; 32] = Sha256::digest(presented).into();
        let mut found = usize::MAX;
        for (i, k) in self.digests.iter().enumerate() {
            let diff = k.iter().zip(&d).fold(0u8, |a, (x, y)| a | (x ^ y));
            // branch-free: keeps `i` where the digest matched
            let hit = ((diff == 0) as usize).wrapping_neg();
            found = (found & !hit) | (i & hit);
        }
        (found != usize::MAX).then_some(found)
    }

    /// The secret a client of this surface presents.
    pub fn token(&self) -> &str {
        &self.first
    }
}

/// The credential in an `Authorization: Bearer X` value (the scheme in any case).
pub fn bearer(value: &str) -> Option<&str> {
    let (scheme, rest) = value.trim().split_once(' ')?;
    scheme
        .eq_ignore_ascii_case("bearer")
        .then(|| rest.trim())
        .filter(|t| !t.is_empty())
}

/// The cluster token of this process (`--cluster-token-file` / `MOELANE_CLUSTER_TOKEN`): what
/// its gRPC servers require and its gRPC clients present. Set once at start, before any
/// server or client is made; unset, gRPC is open (bind it to loopback or a private network).
static CLUSTER: std::sync::OnceLock<Option<Arc<Keys>>> = std::sync::OnceLock::new();

/// Sets the cluster token (the first call wins; later ones are ignored and return false).
pub fn set_cluster(keys: Option<Keys>) -> bool {
    CLUSTER.set(keys.map(Arc::new)).is_ok()
}

/// The cluster token, if one was set.
pub fn cluster() -> Option<Arc<Keys>> {
    CLUSTER.get().cloned().flatten()
}

/// A gRPC server's check: every call carries `authorization: Bearer <cluster token>`;
/// with no keys configured, everything passes.
#[derive(Clone)]
pub struct Check(pub Option<Arc<Keys>>);

impl Check {
    /// The check of this process's cluster token.
    pub fn cluster() -> Check {
        Check(cluster())
    }
}

impl tonic::service::Interceptor for Check {
    fn call(&mut self, req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        let Some(keys) = &self.0 else {
            return Ok(req);
        };
        let presented = req
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .and_then(bearer);
        match presented {
            Some(t) if keys.accepts(t.as_bytes()) => Ok(req),
            Some(_) => Err(tonic::Status::unauthenticated(
                "the cluster token presented is not this process's (--cluster-token-file)",
            )),
            None => Err(tonic::Status::unauthenticated(
                "this process requires the cluster token: send authorization: Bearer <token> \
                 (--cluster-token-file)",
            )),
        }
    }
}

/// A gRPC client's credential: adds `authorization: Bearer <token>` to every call (nothing
/// without a token).
#[derive(Clone, Default)]
pub struct Attach(Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>);

impl Attach {
    pub fn new(keys: Option<&Keys>) -> Attach {
        Attach(keys.and_then(|k| format!("Bearer {}", k.token()).parse().ok()))
    }

    /// Presents this process's cluster token.
    pub fn cluster() -> Attach {
        Attach::new(cluster().as_deref())
    }
}

/// A channel that presents this process's cluster token.
pub fn attach(ch: tonic::transport::Channel) -> AuthChannel {
    tonic::service::interceptor::InterceptedService::new(ch, Attach::cluster())
}

impl tonic::service::Interceptor for Attach {
    fn call(&mut self, mut req: tonic::Request<()>) -> Result<tonic::Request<()>, tonic::Status> {
        if let Some(v) = &self.0 {
            req.metadata_mut().insert("authorization", v.clone());
        }
        Ok(req)
    }
}

/// A channel that presents the cluster token.
pub type AuthChannel =
    tonic::service::interceptor::InterceptedService<tonic::transport::Channel, Attach>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_accept_their_own_and_nothing_else() {
        let k = Keys::parse(
            "# ops\n0123456789abcdef0123\n\n  fedcba9876543210fedc  \n",
            "t",
        )
        .unwrap();
        assert!(k.accepts(b"0123456789abcdef0123"));
        assert!(k.accepts(b"fedcba9876543210fedc"));
        assert!(!k.accepts(b"0123456789abcdef012"));
        assert!(!k.accepts(b""));
        assert_eq!(k.which(b"0123456789abcdef0123"), Some(0));
        assert_eq!(k.which(b"fedcba9876543210fedc"), Some(1));
        assert_eq!(k.which(b"fedcba9876543210fedd"), None);
        assert_eq!(k.token(), "0123456789abcdef0123");
        assert!(Keys::parse("short", "f").unwrap_err().contains("line 1"));
        assert!(Keys::parse("# nothing\n\n", "f")
            .unwrap_err()
            .contains("no secret"));
        assert!(Keys::parse("0123456789abcdef\u{7}x", "f").is_err());
        assert_eq!(bearer("Bearer abc"), Some("abc"));
        assert_eq!(bearer("bearer  abc "), Some("abc"));
        assert_eq!(bearer("Basic abc"), None);
        assert_eq!(bearer("Bearer "), None);
    }
}
