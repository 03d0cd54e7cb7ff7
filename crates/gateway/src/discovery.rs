//! Where lanes come from and whether they answer: `--lane` URLs, DNS names resolved again
//! every round (a Kubernetes headless Service gives one address per pod), and a file of lane
//! specs re-read every round; plus the active health checker. Lanes come and go without a
//! gateway restart. A round that cannot read the file or resolve a name keeps what that
//! source gave before (a DNS hiccup must not empty the gateway).

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use kameo::actor::ActorRef;

use crate::lane::{GrpcLane, Lane};
use crate::registry::{AddLane, Checked, ListLanes, Registry, SyncLanes};

/// One lane spec: a primary's URL, or a DNS name whose every address is a lane.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Spec {
    /// `http://host:port` (or https): one lane, dialled by that URL.
    Url(String),
    /// `dns://host:port`: one lane per address the name resolves to, resolved each round.
    Dns { host: String, port: u16 },
}

impl Spec {
    /// Parses `http(s)://...` or `dns://host:port` (also `dns:///host:port`, gRPC's form).
    pub fn parse(s: &str) -> Result<Spec, String> {
        let s = s.trim();
        if let Some(rest) = s.strip_prefix("dns://") {
            let rest = rest.trim_start_matches('/');
            let (host, port) = rest
                .rsplit_once(':')
                .ok_or_else(|| format!("lane {s:?}: a dns lane needs a port (dns://NAME:PORT)"))?;
            let port: u16 = port
                .parse()
                .map_err(|_| format!("lane {s:?}: port {port:?} is not a number in 1-65535"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']');
            if host.is_empty() || port == 0 {
                return Err(format!("lane {s:?}: expected dns://NAME:PORT"));
            }
            return Ok(Spec::Dns {
                host: host.to_string(),
                port,
            });
        }
        if s.starts_with("http://") || s.starts_with("https://") {
            // tonic refuses what it cannot dial: ask it now, so a typo fails at start
            moelane_proto::tls::endpoint(s).map_err(|e| format!("lane url {s:?}: {e}"))?;
            return Ok(Spec::Url(s.to_string()));
        }
        Err(format!(
            "lane {s:?}: expected http://HOST:PORT (a primary's gRPC URL) or dns://NAME:PORT"
        ))
    }

    /// The source label of a DNS spec.
    fn source(&self) -> String {
        match self {
            Spec::Url(u) => u.clone(),
            Spec::Dns { host, port } => format!("dns://{host}:{port}"),
        }
    }
}

/// The lanes a DNS name gives now, as (name, url) pairs sorted by address.
pub async fn resolve(host: &str, port: u16) -> Result<Vec<(String, String)>, String> {
    let addrs: BTreeSet<std::net::SocketAddr> = tokio::time::timeout(
        Duration::from_secs(5),
        tokio::net::lookup_host((host, port)),
    )
    .await
    .map_err(|_| format!("resolving {host}: no answer in 5 s"))?
    .map_err(|e| format!("resolving {host}: {e}"))?
    .collect();
    if addrs.is_empty() {
        return Err(format!("resolving {host}: no addresses"));
    }
    Ok(addrs
        .into_iter()
        .map(|a| {
            let url = format!("http://{a}");
            (url.clone(), url)
        })
        .collect())
}

/// Reads a lanes file: one spec per line; blank lines and `#` comments skipped.
pub fn read_file(path: &Path) -> Result<Vec<Spec>, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("reading the lanes file {}: {e}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let l = line.split('#').next().unwrap_or("").trim();
        if l.is_empty() {
            continue;
        }
        out.push(Spec::parse(l).map_err(|e| format!("{}:{}: {e}", path.display(), i + 1))?);
    }
    Ok(out)
}

fn lanes_of(pairs: &[(String, String)]) -> Vec<Arc<dyn Lane>> {
    pairs
        .iter()
        .filter_map(|(name, url)| {
            GrpcLane::named(name, url)
                .ok()
                .map(|l| Arc::new(l) as Arc<dyn Lane>)
        })
        .collect()
}

/// What finds lanes: the specs given as flags and an optional file, re-read every `interval`.
#[derive(Clone, Debug)]
pub struct Discovery {
    pub specs: Vec<Spec>,
    pub file: Option<PathBuf>,
    pub interval: Duration,
}

impl Discovery {
    /// One round: flags' URLs added once, flags' names resolved, the file read.
    /// Returns the errors of this round (each source that failed kept what it had).
    pub async fn round(&self, registry: &ActorRef<Registry>) -> Vec<String> {
        let mut errors = Vec::new();
        for s in &self.specs {
            match s {
                Spec::Url(u) => {
                    if let Ok(l) = GrpcLane::new(u) {
                        let _ = registry.ask(AddLane(Arc::new(l))).await;
                    }
                }
                Spec::Dns { host, port } => match resolve(host, *port).await {
                    Ok(pairs) => {
                        let _ = registry
                            .ask(SyncLanes {
                                source: s.source(),
                                lanes: lanes_of(&pairs),
                            })
                            .await;
                    }
                    Err(e) => errors.push(e),
                },
            }
        }
        if let Some(path) = &self.file {
            match self.file_lanes(path).await {
                Ok(pairs) => {
                    let _ = registry
                        .ask(SyncLanes {
                            source: format!("file:{}", path.display()),
                            lanes: lanes_of(&pairs),
                        })
                        .await;
                }
                Err(e) => errors.push(e),
            }
        }
        errors
    }

    /// The (name, url) pairs the file gives now; an error keeps the previous set.
    async fn file_lanes(&self, path: &Path) -> Result<Vec<(String, String)>, String> {
        let mut pairs = Vec::new();
        for s in read_file(path)? {
            match s {
                Spec::Url(u) => pairs.push((u.clone(), u)),
                Spec::Dns { host, port } => pairs.extend(resolve(&host, port).await?),
            }
        }
        Ok(pairs)
    }

    /// Runs a round every `interval`, logging what failed (once per change of message).
    pub fn spawn(self, registry: ActorRef<Registry>) {
        tokio::spawn(async move {
            let mut last = Vec::new();
            loop {
                tokio::time::sleep(self.interval).await;
                if !registry.is_alive() {
                    return;
                }
                let errors = self.round(&registry).await;
                if errors != last {
                    for e in &errors {
                        tracing::warn!(error = %e, "lane discovery: keeping this source's lanes");
                    }
                    last = errors;
                }
            }
        });
    }
}

/// Checks every lane's health every `interval`, each call bounded by `timeout`; a lane that
/// does not answer in time is down.
pub fn spawn_health_checks(registry: ActorRef<Registry>, interval: Duration, timeout: Duration) {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        loop {
            tick.tick().await;
            let Ok(list) = registry.ask(ListLanes).await else {
                return;
            };
            check_all(&registry, list.into_iter().map(|(_, l)| l), timeout).await;
        }
    });
}

/// One round of health checks, all lanes at once.
pub async fn check_all(
    registry: &ActorRef<Registry>,
    lanes: impl Iterator<Item = Arc<dyn Lane>>,
    timeout: Duration,
) {
    let checks = lanes.map(|lane| async move {
        let (result, timed_out) = match tokio::time::timeout(timeout, lane.health()).await {
            Ok(Ok(h)) => (Ok(h), false),
            Ok(Err(e)) => (Err(e.message), false),
            Err(_) => (
                Err(format!(
                    "no health answer within {} ms (twice in a row)",
                    timeout.as_millis()
                )),
                true,
            ),
        };
        let _ = registry
            .ask(Checked {
                lane: lane.name().to_string(),
                result,
                timed_out,
            })
            .await;
    });
    futures::future::join_all(checks).await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse_or_say_what_is_wrong() {
        assert_eq!(
            Spec::parse("http://10.0.0.1:50051"),
            Ok(Spec::Url("http://10.0.0.1:50051".into()))
        );
        assert_eq!(
            Spec::parse("dns:///lanes.moelane.svc:50051"),
            Ok(Spec::Dns {
                host: "lanes.moelane.svc".into(),
                port: 50051
            })
        );
        assert_eq!(
            Spec::parse("dns://localhost:7"),
            Ok(Spec::Dns {
                host: "localhost".into(),
                port: 7
            })
        );
        for bad in [
            "dns://name",
            "dns://name:x",
            "dns://:5",
            "10.0.0.1:50051",
            "",
        ] {
            let e = Spec::parse(bad).expect_err(bad);
            assert!(e.contains("lane"), "{bad}: {e}");
        }
    }

    #[test]
    fn a_lanes_file_names_its_bad_line() {
        let d = std::env::temp_dir().join(format!("moelane-lanes-{}", std::process::id()));
        std::fs::create_dir_all(&d).expect("dir");
        let p = d.join("lanes");
        std::fs::write(
            &p,
            "# lanes\nhttp://127.0.0.1:1\n\ndns://localhost:2 # local\n",
        )
        .expect("write");
        assert_eq!(read_file(&p).expect("read").len(), 2);
        std::fs::write(&p, "http://127.0.0.1:1\nnot a lane\n").expect("write");
        let e = read_file(&p).expect_err("bad line");
        assert!(e.contains(":2:"), "{e}");
        let e = read_file(&d.join("missing")).expect_err("missing");
        assert!(e.contains("missing"), "{e}");
    }

    #[tokio::test]
    async fn localhost_resolves_to_lanes() {
        let pairs = resolve("localhost", 50051)
            .await
            .expect("resolve localhost");
        assert!(pairs.iter().any(|(n, _)| n.contains(":50051")), "{pairs:?}");
    }
}
