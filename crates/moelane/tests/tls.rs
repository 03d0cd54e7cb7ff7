//! TLS on real processes: the gateway's API over HTTPS (`--tls-cert`, `--tls-key`), and the
//! cluster's mutual TLS on every gRPC hop (gateway to primary, primary to sidecar, the CLI
//! to the primary). Certificates are made here with rcgen: a cluster CA, a node certificate
//! for 127.0.0.1 it signed, and a rogue CA with its own node certificate.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use common::*;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio_rustls::rustls;

struct Pki {
    _dir: tempfile::TempDir,
    ca: PathBuf,
    cert: PathBuf,
    key: PathBuf,
    rogue_ca: PathBuf,
    rogue_cert: PathBuf,
    rogue_key: PathBuf,
}

/// A CA and a leaf for 127.0.0.1 and localhost it signed, written as PEM files under `dir`
/// with the prefix `name`: (ca, cert, key).
fn ca_and_leaf(dir: &Path, name: &str) -> (PathBuf, PathBuf, PathBuf) {
    let mut p = CertificateParams::new(Vec::<String>::new()).unwrap();
    p.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    p.distinguished_name
        .push(rcgen::DnType::CommonName, format!("{name} CA"));
    let ca_key = KeyPair::generate().unwrap();
    let ca = p.self_signed(&ca_key).unwrap();
    let issuer = Issuer::new(p, ca_key);
    let leaf_params =
        CertificateParams::new(vec!["127.0.0.1".to_string(), "localhost".to_string()]).unwrap();
    let leaf_key = KeyPair::generate().unwrap();
    let leaf = leaf_params.signed_by(&leaf_key, &issuer).unwrap();
    let w = |f: &str, s: String| {
        let path = dir.join(format!("{name}-{f}"));
        std::fs::write(&path, s).unwrap();
        path
    };
    (
        w("ca.pem", ca.pem()),
        w("cert.pem", leaf.pem()),
        w("key.pem", leaf_key.serialize_pem()),
    )
}

fn pki() -> Pki {
    let dir = tempfile::tempdir().unwrap();
    let (ca, cert, key) = ca_and_leaf(dir.path(), "cluster");
    let (rogue_ca, rogue_cert, rogue_key) = ca_and_leaf(dir.path(), "rogue");
    Pki {
        _dir: dir,
        ca,
        cert,
        key,
        rogue_ca,
        rogue_cert,
        rogue_key,
    }
}

/// The environment that gives a process the cluster's mutual TLS of `k`.
fn cluster_env(k: &Pki) -> Vec<(&'static str, String)> {
    let s = |p: &PathBuf| p.to_str().unwrap().to_string();
    vec![
        ("MOELANE_CLUSTER_TLS_CERT", s(&k.cert)),
        ("MOELANE_CLUSTER_TLS_KEY", s(&k.key)),
        ("MOELANE_CLUSTER_TLS_CA", s(&k.ca)),
    ]
}

fn pairs<'a>(env: &'a [(&'static str, String)]) -> Vec<(&'static str, &'a str)> {
    env.iter().map(|(k, v)| (*k, v.as_str())).collect()
}

/// A sidecar of `tiny` with the cluster TLS of `env`: it and (control URL, data address).
fn tls_sidecar(env: &[(&'static str, String)]) -> (Proc, Vec<String>) {
    let tiny = tiny().to_str().unwrap().to_string();
    start_env(
        &[
            "lane",
            "--role",
            "sidecar",
            "--model",
            &tiny,
            "--listen",
            "127.0.0.1:0",
            "--data",
            "127.0.0.1:0",
        ],
        &["sidecar control ", "sidecar data tcp "],
        &pairs(env),
    )
}

/// One HTTPS POST to `addr` trusting only `ca`: (status, body), or the error of the TLS
/// handshake.
fn https_post(addr: &str, ca: &Path, path: &str, body: &str) -> Result<(u16, String), String> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async {
        let mut roots = rustls::RootCertStore::empty();
        for c in moelane_proto::tls::load_certs(ca).unwrap() {
            roots.add(c).unwrap();
        }
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let cfg = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let tcp = tokio::net::TcpStream::connect(addr)
            .await
            .map_err(|e| e.to_string())?;
        let name = rustls::pki_types::ServerName::try_from("127.0.0.1").unwrap();
        let mut s = tokio::time::timeout(
            Duration::from_secs(10),
            tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp),
        )
        .await
        .map_err(|_| "handshake timed out".to_string())?
        .map_err(|e| e.to_string())?;
        let req = format!(
            "POST {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
            body.len()
        );
        s.write_all(req.as_bytes())
            .await
            .map_err(|e| e.to_string())?;
        let mut raw = Vec::new();
        let _ = tokio::time::timeout(Duration::from_secs(20), s.read_to_end(&mut raw)).await;
        let raw = String::from_utf8_lossy(&raw).into_owned();
        let (head, body) = raw
            .split_once("\r\n\r\n")
            .ok_or(format!("no head: {raw}"))?;
        let status = head
            .split_whitespace()
            .nth(1)
            .and_then(|s| s.parse().ok())
            .ok_or(format!("no status: {head}"))?;
        Ok((status, body.to_string()))
    })
}

/// `moelane status --primary URL` with `tls` (cluster TLS flags); its exit status and output.
fn status(url: &str, tls: &[&str]) -> (bool, String) {
    let out = std::process::Command::new(bin())
        .args(["status", "--primary", url])
        .args(tls)
        .output()
        .unwrap();
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

#[test]
fn https_api_and_mutual_tls_on_every_grpc_hop() {
    let k = pki();
    let s = |p: &PathBuf| p.to_str().unwrap().to_string();
    let (ca, cert, key) = (s(&k.ca), s(&k.cert), s(&k.key));
    // every process of the lane: the cluster's mutual TLS; the gateway also serves HTTPS
    // with the same certificate
    let mut env = cluster_env(&k);
    env.push(("MOELANE_TLS_CERT", cert.clone()));
    env.push(("MOELANE_TLS_KEY", key.clone()));
    let (_procs, gw, purl) = two_process_lane_env("tcp", &[], &pairs(&env));
    let body = serde_json::json!({"model": "tiny", "prompt": "The agent", "max_tokens": 8, "temperature": 0})
        .to_string();
    // a completion over HTTPS crossed gateway -> primary -> sidecar, each hop over mTLS
    let (st, answer) = https_post(&gw, &k.ca, "/v1/completions", &body).expect("HTTPS");
    assert_eq!(st, 200, "{answer}");
    let v: serde_json::Value = serde_json::from_str(&answer).unwrap();
    assert_eq!(v["usage"]["completion_tokens"], 8, "{v}");
    // a client that trusts another CA does not accept the gateway's certificate
    let e = https_post(&gw, &k.rogue_ca, "/v1/completions", &body).unwrap_err();
    assert!(e.to_lowercase().contains("certificate"), "{e}");
    // plain HTTP on the HTTPS port gets no answer
    {
        use std::io::{Read, Write};
        let mut t = std::net::TcpStream::connect(&gw).unwrap();
        t.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        write!(
            t,
            "POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
        .ok(); // the server may close on the first bytes, before the rest is written
        let mut got = Vec::new();
        let _ = t.read_to_end(&mut got);
        assert!(
            !String::from_utf8_lossy(&got).contains("HTTP/1.1 200"),
            "plain HTTP was answered on the HTTPS port"
        );
    }
    // the primary's gRPC: the cluster's certificate gets in; none, or a rogue CA's, does not
    let tls = |c: &str, k: &str, a: &str| {
        vec![
            "--cluster-tls-cert".to_string(),
            c.to_string(),
            "--cluster-tls-key".to_string(),
            k.to_string(),
            "--cluster-tls-ca".to_string(),
            a.to_string(),
        ]
    };
    let good = tls(&cert, &key, &ca);
    let good: Vec<&str> = good.iter().map(String::as_str).collect();
    let (ok, out) = status(&purl, &good);
    assert!(ok, "status with the cluster's certificate: {out}");
    assert!(out.contains("map epoch"), "{out}");
    let (ok, out) = status(&purl, &[]);
    assert!(!ok, "status without TLS got in: {out}");
    let rogue = tls(&s(&k.rogue_cert), &s(&k.rogue_key), &ca);
    let rogue: Vec<&str> = rogue.iter().map(String::as_str).collect();
    let (ok, out) = status(&purl, &rogue);
    assert!(!ok, "a certificate of another CA got in: {out}");
    // and a client that trusts only the rogue CA refuses the primary
    let wrong_root = tls(&cert, &key, &s(&k.rogue_ca));
    let wrong_root: Vec<&str> = wrong_root.iter().map(String::as_str).collect();
    let (ok, out) = status(&purl, &wrong_root);
    assert!(
        !ok,
        "the primary's certificate passed a foreign root: {out}"
    );
}

#[test]
fn bad_tls_files_are_refused_at_start_naming_the_file() {
    let k = pki();
    let dir = tempfile::tempdir().unwrap();
    let junk = dir.path().join("junk.pem");
    std::fs::write(&junk, "not a certificate").unwrap();
    let tiny = tiny().to_str().unwrap().to_string();
    let run = |extra: &[&str]| {
        let out = std::process::Command::new(bin())
            .args(["serve", "--model", &tiny, "--listen", "127.0.0.1:0"])
            .args(extra)
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stderr).into_owned(),
        )
    };
    let s = |p: &Path| p.to_str().unwrap().to_string();
    let (junk_s, cert, key, rogue_key) = (s(&junk), s(&k.cert), s(&k.key), s(&k.rogue_key));
    for (extra, says) in [
        (vec!["--tls-cert", &junk_s, "--tls-key", &key], "junk.pem"),
        (
            vec!["--tls-cert", &cert, "--tls-key", &rogue_key],
            "does not go with",
        ),
        (vec!["--tls-cert", &cert], "--tls-key"),
        (
            vec!["--cluster-tls-cert", &cert, "--cluster-tls-key", &key],
            "--cluster-tls-ca",
        ),
        (
            vec![
                "--cluster-tls-cert",
                &cert,
                "--cluster-tls-key",
                &key,
                "--cluster-tls-ca",
                &junk_s,
            ],
            "junk.pem",
        ),
    ] {
        let (ok, err) = run(&extra);
        assert!(!ok, "{extra:?} started");
        assert!(err.contains(says), "{extra:?}: {err}");
    }
}

#[test]
fn with_cluster_tls_the_sidecars_data_port_speaks_only_tls_to_the_cluster() {
    use moelane_link::tcp::{Credentials, TcpTier};
    use moelane_proto::tls::{ClusterTls, ClusterTlsFiles};
    let k = pki();
    let env = cluster_env(&k);
    let (_side, v) = tls_sidecar(&env);
    let data = v[1].clone();
    let load = |cert: &PathBuf, key: &PathBuf, ca: &PathBuf| {
        ClusterTls::load(&ClusterTlsFiles {
            cert: cert.clone(),
            key: key.clone(),
            ca: ca.clone(),
            name: None,
        })
        .unwrap()
    };
    let cred = |t: &ClusterTls| Credentials {
        token: None,
        tls: Some((t.data_client(), t.peer_name("127.0.0.1").unwrap())),
    };
    let to = Duration::from_secs(10);
    // the cluster's certificate: a TLS connection that the sidecar answers
    let good = load(&k.cert, &k.key, &k.ca);
    let mut t = TcpTier::connect_with(&data, to, cred(&good)).expect("the cluster's client");
    assert!(t.encrypted());
    use moelane_engine::tier::RemoteTier;
    t.send(Default::default()).unwrap();
    // an empty request: answered (an error reply is an answer too), not a dropped connection
    match t.recv() {
        Ok(_) => {}
        Err(e) => assert!(e.to_string().contains("the sidecar answered"), "{e}"),
    }
    // a certificate of another CA: refused
    let rogue = load(&k.rogue_cert, &k.rogue_key, &k.ca);
    assert!(TcpTier::connect_with(&data, to, cred(&rogue)).is_err());
    // in the clear: an opening frame (which a port without TLS and token would answer, as a
    // malformed request) gets nothing back, the connection is closed
    {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(&data).unwrap();
        c.set_read_timeout(Some(to)).unwrap();
        let mut f = moelane_link::tcp::AUTH_MAGIC.to_vec();
        f.extend_from_slice(b"anything");
        c.write_all(&(f.len() as u32).to_le_bytes()).unwrap();
        c.write_all(&f).unwrap();
        let mut got = Vec::new();
        let r = c.read_to_end(&mut got);
        // nothing, or one TLS alert record (type 21, 7 bytes) before the close: never a frame
        assert!(
            got.is_empty() || (got[0] == 21 && got.len() == 7),
            "the data port answered in the clear: {r:?} {got:?}"
        );
    }
}

#[test]
fn over_cluster_tls_a_stalled_sidecar_is_relinked_and_answers_the_same() {
    // the primary drops a TLS data link whose reply is late and opens a new one (a new
    // handshake on a new connection) once the sidecar runs again
    let k = pki();
    let env = cluster_env(&k);
    let (procs, gw, _purl) = two_process_lane_env("tcp", &["--stall-timeout", "1.5"], &pairs(&env));
    let ask = |n: usize| {
        post(
            &gw,
            "/v1/completions",
            &serde_json::json!({"model": "tiny", "prompt": "The relinked lane", "max_tokens": n, "temperature": 0}),
        )
    };
    let (st, reference) = ask(16);
    assert_eq!(st, 200, "{reference}");
    // (the link's reply deadline is the link timeout until it has seen a few round trips)
    for _ in 0..3 {
        assert_eq!(
            ask(16).1["choices"][0]["text"],
            reference["choices"][0]["text"]
        );
    }
    signal(&procs[0], "STOP");
    let stopped = std::time::Instant::now();
    let (st, v) = ask(16);
    assert_eq!(st, 503, "{v}");
    assert!(
        stopped.elapsed() < Duration::from_secs(8),
        "{:?}",
        stopped.elapsed()
    );
    signal(&procs[0], "CONT");
    until(Duration::from_secs(20), "the lane serves again", || {
        let (st, v) = ask(16);
        st == 200 && v["choices"][0]["text"] == reference["choices"][0]["text"]
    });
}

#[test]
fn connections_held_open_on_the_data_port_do_not_keep_a_primary_out() {
    // two silent connections from the primary's own address (its cap of openers): the
    // primary's own opening closes the oldest for itself rather than being refused
    let k = pki();
    let env = cluster_env(&k);
    let tiny = tiny().to_str().unwrap().to_string();
    let (_side, v) = tls_sidecar(&env);
    let held: Vec<std::net::TcpStream> = (0..2)
        .map(|_| std::net::TcpStream::connect(&v[1]).unwrap())
        .collect();
    let control = format!("http://{}", hostport(&v[0]));
    let (_prim, pv) = start_env(
        &[
            "lane",
            "--role",
            "primary",
            "--model",
            &tiny,
            "--listen",
            "127.0.0.1:0",
            "--sidecar",
            &control,
            "--link",
            "tcp",
        ],
        &["primary grpc "],
        &pairs(&env),
    );
    assert!(!pv[0].is_empty());
    drop(held);
}
