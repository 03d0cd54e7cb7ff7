//! TLS: the gateway's HTTPS listeners (`--tls-cert` / `--tls-key`) and mutual TLS between
//! the processes of a cluster (`--cluster-tls-cert` / `--cluster-tls-key` /
//! `--cluster-tls-ca`). rustls with ring, through tonic's `tls-ring` for gRPC.
//!
//! Cluster TLS is mutual: every gRPC server of the process requires a client certificate
//! signed by the cluster CA, and every gRPC client presents the process's certificate and
//! trusts only servers whose certificate the cluster CA signed, for the host in the URL (or
//! for `--cluster-tls-name` when every node shares one name). With it on, every gRPC URL is
//! dialled over TLS, `http://` included.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
pub use tokio_rustls::rustls;

fn read(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    std::fs::read(path).map_err(|e| format!("reading the {what} {}: {e}", path.display()))
}

/// Every certificate of a PEM file (a chain: the leaf first), at least one.
pub fn load_certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, String> {
    let pem = read(path, "certificate file")?;
    let certs = CertificateDer::pem_slice_iter(&pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{}: not a PEM certificate file: {e}", path.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "{}: holds no certificate (-----BEGIN CERTIFICATE-----)",
            path.display()
        ));
    }
    Ok(certs)
}

/// The private key of a PEM file (PKCS#8, PKCS#1 or SEC1).
pub fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, String> {
    let pem = read(path, "private key file")?;
    PrivateKeyDer::from_pem_slice(&pem).map_err(|e| {
        format!(
            "{}: no PEM private key (PKCS#8, RSA or EC) in it: {e}",
            path.display()
        )
    })
}

/// The rustls configuration of an HTTPS listener: this certificate chain and key, HTTP/1.1,
/// TLS 1.2 and 1.3.
pub fn http_server_config(cert: &Path, key: &Path) -> Result<Arc<rustls::ServerConfig>, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("TLS versions: {e}"))?
        .with_no_client_auth()
        .with_single_cert(load_certs(cert)?, load_key(key)?)
        .map_err(|e| {
            format!(
                "the key {} does not go with the certificate {}: {e}",
                key.display(),
                cert.display()
            )
        })?;
    cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(Arc::new(cfg))
}

/// The files of the cluster's mutual TLS.
#[derive(Clone, Debug)]
pub struct ClusterTlsFiles {
    pub cert: PathBuf,
    pub key: PathBuf,
    pub ca: PathBuf,
    /// The name peers' certificates are checked against, instead of the host in a URL.
    pub name: Option<String>,
}

/// The ALPN protocol of the TCP data port over TLS (both ends require it).
pub const DATA_ALPN: &[u8] = b"moelane-link/1";

/// The cluster's mutual TLS, loaded and checked.
#[derive(Clone, Debug)]
pub struct ClusterTls {
    identity: tonic::transport::Identity,
    ca: tonic::transport::Certificate,
    name: Option<String>,
    /// The sidecar's TCP data port (blocking rustls, outside tonic): client certificates of
    /// the cluster CA required
    data_server: Arc<rustls::ServerConfig>,
    /// The primary's end of that port: this certificate presented, the cluster CA trusted
    data_client: Arc<rustls::ClientConfig>,
}

impl ClusterTls {
    /// Reads and checks the files: the certificate and key parse and go together, the CA
    /// holds a certificate (a rustls configuration is built from them as a check, since tonic
    /// builds its own only at the first connection).
    pub fn load(f: &ClusterTlsFiles) -> Result<ClusterTls, String> {
        let certs = load_certs(&f.cert)?;
        let key = load_key(&f.key)?;
        let cas = load_certs(&f.ca)?;
        let mut roots = rustls::RootCertStore::empty();
        for c in &cas {
            roots
                .add(c.clone())
                .map_err(|e| format!("{}: not a CA certificate: {e}", f.ca.display()))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mismatch = |e: rustls::Error| {
            format!(
                "the key {} does not go with the certificate {}: {e}",
                f.key.display(),
                f.cert.display()
            )
        };
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| {
            format!(
                "{}: no usable CA for client certificates: {e}",
                f.ca.display()
            )
        })?;
        let mut data_server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?
            .with_client_cert_verifier(verifier)
            .with_single_cert(certs.clone(), key.clone_key())
            .map_err(mismatch)?;
        data_server.alpn_protocols = vec![DATA_ALPN.to_vec()];
        let mut data_client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("TLS versions: {e}"))?
            .with_root_certificates(roots)
            .with_client_auth_cert(certs, key)
            .map_err(mismatch)?;
        data_client.alpn_protocols = vec![DATA_ALPN.to_vec()];
        Ok(ClusterTls {
            identity: tonic::transport::Identity::from_pem(
                read(&f.cert, "certificate file")?,
                read(&f.key, "private key file")?,
            ),
            ca: tonic::transport::Certificate::from_pem(read(&f.ca, "CA file")?),
            name: f.name.clone(),
            data_server: Arc::new(data_server),
            data_client: Arc::new(data_client),
        })
    }

    /// The sidecar's TCP data port over TLS: this identity, a client certificate of the
    /// cluster CA required.
    pub fn data_server(&self) -> Arc<rustls::ServerConfig> {
        self.data_server.clone()
    }

    /// The primary's end of the TCP data port: this identity presented, the cluster CA the
    /// only root.
    pub fn data_client(&self) -> Arc<rustls::ClientConfig> {
        self.data_client.clone()
    }

    /// The name a peer's certificate is checked against: `--cluster-tls-name` when given,
    /// else `host` (the host the process dialled).
    pub fn peer_name(&self, host: &str) -> Result<rustls::pki_types::ServerName<'static>, String> {
        let n = self.name.as_deref().unwrap_or(host);
        let n = n.trim_start_matches('[').trim_end_matches(']');
        rustls::pki_types::ServerName::try_from(n.to_string()).map_err(|e| {
            format!("{n:?} is not a host name or IP address to check a certificate against: {e}")
        })
    }

    /// A gRPC server's TLS: this identity, client certificates required and checked
    /// against the cluster CA.
    pub fn server(&self) -> tonic::transport::ServerTlsConfig {
        tonic::transport::ServerTlsConfig::new()
            .identity(self.identity.clone())
            .client_ca_root(self.ca.clone())
            .client_auth_optional(false)
    }

    /// A gRPC client's TLS: the cluster CA as the only root, this identity presented.
    pub fn client(&self) -> tonic::transport::ClientTlsConfig {
        let c = tonic::transport::ClientTlsConfig::new()
            .ca_certificate(self.ca.clone())
            .identity(self.identity.clone());
        match &self.name {
            Some(n) => c.domain_name(n.clone()),
            None => c,
        }
    }
}

/// This process's cluster TLS: set once at start, like the cluster token.
static CLUSTER_TLS: std::sync::OnceLock<Option<Arc<ClusterTls>>> = std::sync::OnceLock::new();

/// Sets the cluster TLS (the first call wins; later ones return false).
pub fn set_cluster_tls(tls: Option<ClusterTls>) -> bool {
    CLUSTER_TLS.set(tls.map(Arc::new)).is_ok()
}

/// The cluster TLS, if set.
pub fn cluster_tls() -> Option<Arc<ClusterTls>> {
    CLUSTER_TLS.get().cloned().flatten()
}

/// A gRPC endpoint for `url` as this process dials its peers: over the cluster's mutual TLS
/// when it is set (an `http://` URL is dialled as `https://`), else as the URL says.
pub fn endpoint(url: &str) -> Result<tonic::transport::Endpoint, String> {
    endpoint_with(url, cluster_tls().as_deref())
}

/// [`endpoint`] with the given TLS (tests use their own).
pub fn endpoint_with(
    url: &str,
    tls: Option<&ClusterTls>,
) -> Result<tonic::transport::Endpoint, String> {
    let url = match (tls, url.strip_prefix("http://")) {
        (Some(_), Some(rest)) => format!("https://{rest}"),
        _ => url.to_string(),
    };
    let e = tonic::transport::Endpoint::from_shared(url.clone())
        .map_err(|e| format!("bad gRPC URL {url:?}: {e}"))?;
    match tls {
        Some(t) => e
            .tls_config(t.client())
            .map_err(|e| format!("TLS for {url}: {e}")),
        None => Ok(e),
    }
}

/// A gRPC server builder with this process's cluster TLS, if set.
pub fn server_builder() -> Result<tonic::transport::Server, String> {
    let b = tonic::transport::Server::builder();
    match cluster_tls() {
        Some(t) => b
            .tls_config(t.server())
            .map_err(|e| format!("cluster TLS: {e}")),
        None => Ok(b),
    }
}
