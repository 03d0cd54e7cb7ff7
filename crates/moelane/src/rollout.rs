//! `moelane rollout`: upgrades the lanes behind a gateway one at a time through its admin API.
//! For each lane: drain it at the gateway, wait until its requests end, run the operator's
//! restart command (which stops the old process, SIGTERM: it drains too, and starts the new
//! version), wait until the gateway sees a new primary process answering healthy, send a
//! canary generation through that lane only (gateway, primary, sidecar), undrain it. A lane
//! that does not come back or fails its canary stops the rollout; with `--rollback` it is
//! restarted on the old version, checked the same way and undrained.

use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

pub struct RolloutOptions {
    pub gateway: String,
    pub lanes: Vec<String>,
    pub restart: String,
    pub rollback: Option<String>,
    pub drain_timeout: Duration,
    pub ready_timeout: Duration,
    pub canary_tokens: u32,
}

/// One HTTP/1.1 exchange with the gateway (JSON in, JSON out), bounded by 60 s.
async fn http(
    gateway: &str,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value)> {
    let hostport = gateway
        .trim_start_matches("http://")
        .split('/')
        .next()
        .unwrap_or_default()
        .to_string();
    if gateway.starts_with("https://") {
        bail!("--gateway {gateway}: this client speaks plain HTTP (reach the gateway directly)");
    }
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(&hostport)
            .await
            .with_context(|| format!("connecting to the gateway at {hostport}"))?;
        let body = body.map(|b| b.to_string()).unwrap_or_default();
        let head = format!(
            "{method} {path} HTTP/1.1\r\nHost: {hostport}\r\nContent-Type: application/json\r\n\
             Content-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        );
        s.write_all(head.as_bytes()).await?;
        s.write_all(body.as_bytes()).await?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await?;
        Ok::<_, anyhow::Error>(raw)
    };
    let raw = tokio::time::timeout(Duration::from_secs(60), exchange)
        .await
        .with_context(|| format!("{method} {path}: no answer from the gateway within 60 s"))??;
    let split = raw
        .windows(4)
        .position(|w| w == b"\r\n\r\n")
        .with_context(|| format!("{method} {path}: the gateway's answer has no head"))?;
    let head = String::from_utf8_lossy(&raw[..split]).to_string();
    let status: u16 = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .with_context(|| format!("{method} {path}: no status in {head:?}"))?;
    let mut body = raw[split + 4..].to_vec();
    if head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        body = dechunk(&body);
    }
    let v = serde_json::from_slice(&body)
        .unwrap_or_else(|_| Value::String(String::from_utf8_lossy(&body).into_owned()));
    Ok((status, v))
}

/// The body of a chunked transfer (a malformed one ends where it breaks).
fn dechunk(b: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    let mut i = 0;
    while let Some(p) = b[i..].windows(2).position(|w| w == b"\r\n") {
        let Ok(n) = usize::from_str_radix(String::from_utf8_lossy(&b[i..i + p]).trim(), 16) else {
            break;
        };
        i += p + 2;
        if n == 0 || i + n > b.len() {
            break;
        }
        out.extend_from_slice(&b[i..i + n]);
        i += n + 2;
        if i > b.len() {
            break;
        }
    }
    out
}

/// The gateway's view of every lane.
async fn lanes(gateway: &str) -> Result<Vec<Value>> {
    let (st, v) = http(gateway, "GET", "/v1/stats", None).await?;
    if st != 200 {
        bail!("GET /v1/stats answered {st}: {v}");
    }
    Ok(v["lanes"].as_array().cloned().unwrap_or_default())
}

async fn lane(gateway: &str, name: &str) -> Result<Value> {
    lanes(gateway)
        .await?
        .into_iter()
        .find(|l| l["lane"] == name)
        .with_context(|| format!("the gateway no longer lists lane {name}"))
}

async fn set_drain(gateway: &str, name: &str, drain: bool) -> Result<()> {
    let (st, v) = http(
        gateway,
        "POST",
        "/admin/drain",
        Some(&json!({"lane": name, "drain": drain})),
    )
    .await?;
    if st != 200 {
        bail!("POST /admin/drain for {name} answered {st}: {v}");
    }
    Ok(())
}

/// Runs `cmd` through `sh -c` with `{lane}` replaced and MOELANE_LANE set; its output goes to
/// ours.
async fn run(cmd: &str, name: &str) -> Result<()> {
    let line = cmd.replace("{lane}", name);
    let st = tokio::process::Command::new("sh")
        .arg("-c")
        .arg(&line)
        .env("MOELANE_LANE", name)
        .status()
        .await
        .with_context(|| format!("running {line:?}"))?;
    if !st.success() {
        bail!("{line:?} exited with {st}");
    }
    Ok(())
}

/// Waits until the lane answers healthy from another process than `old` (an incarnation);
/// returns its build.
async fn wait_back(gateway: &str, name: &str, old: u64, limit: Duration) -> Result<String> {
    let t0 = Instant::now();
    loop {
        if let Ok(l) = lane(gateway, name).await {
            let inc = l["incarnation"].as_u64().unwrap_or(0);
            if l["healthy"] == true && inc != 0 && inc != old {
                return Ok(l["build"].as_str().unwrap_or("").to_string());
            }
        }
        if t0.elapsed() > limit {
            bail!(
                "lane {name} did not answer healthy from a new process within {:.0} s",
                limit.as_secs_f64()
            );
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

async fn canary(gateway: &str, name: &str, tokens: u32) -> Result<f64> {
    let (st, v) = http(
        gateway,
        "POST",
        "/admin/canary",
        Some(&json!({"lane": name, "max_tokens": tokens})),
    )
    .await?;
    if st != 200 || v["ok"] != true {
        bail!("canary on lane {name} failed ({st}): {v}");
    }
    Ok(v["seconds"].as_f64().unwrap_or(0.0))
}

/// Restarts `name` with `cmd` and checks it: back healthy from a new process, canary.
async fn restart_and_check(o: &RolloutOptions, name: &str, cmd: &str) -> Result<String> {
    let old = lane(&o.gateway, name).await?["incarnation"]
        .as_u64()
        .unwrap_or(0);
    let t0 = Instant::now();
    run(cmd, name).await?;
    let build = wait_back(&o.gateway, name, old, o.ready_timeout).await?;
    let back = t0.elapsed();
    let c = canary(&o.gateway, name, o.canary_tokens).await?;
    println!(
        "moelane rollout: lane {name}: back healthy {:.1} s after the restart began (build {build}), canary {} token(s) in {:.3} s",
        back.as_secs_f64(),
        o.canary_tokens,
        c
    );
    Ok(build)
}

pub async fn rollout(o: &RolloutOptions) -> Result<()> {
    let names: Vec<String> = if o.lanes.is_empty() {
        lanes(&o.gateway)
            .await?
            .iter()
            .filter_map(|l| l["lane"].as_str().map(String::from))
            .collect()
    } else {
        o.lanes.clone()
    };
    if names.is_empty() {
        bail!("the gateway at {} lists no lane", o.gateway);
    }
    for name in &names {
        // lanes the rollout does not touch must carry the traffic
        let others_up = lanes(&o.gateway)
            .await?
            .iter()
            .filter(|l| l["lane"] != name.as_str() && l["state"] == "up")
            .count();
        if others_up == 0 {
            println!("moelane rollout: warning: lane {name} is the only one up: requests fail while it restarts");
        }
        let t0 = Instant::now();
        set_drain(&o.gateway, name, true).await?;
        loop {
            let l = lane(&o.gateway, name).await?;
            let inflight = l["inflight"].as_u64().unwrap_or(0);
            if inflight == 0 {
                break;
            }
            if t0.elapsed() > o.drain_timeout {
                set_drain(&o.gateway, name, false).await?;
                bail!(
                    "lane {name} still had {inflight} requests {:.0} s after it was drained: stopped (the lane is undrained, nothing restarted)",
                    o.drain_timeout.as_secs_f64()
                );
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        println!(
            "moelane rollout: lane {name}: drained in {:.2} s; restarting",
            t0.elapsed().as_secs_f64()
        );
        match restart_and_check(o, name, &o.restart).await {
            Ok(_) => {
                set_drain(&o.gateway, name, false).await?;
                println!("moelane rollout: lane {name}: serving again");
            }
            Err(e) => {
                let Some(rb) = &o.rollback else {
                    bail!(
                        "lane {name}: {e:#}; stopped with the lane drained (no --rollback given)"
                    );
                };
                println!("moelane rollout: lane {name}: {e:#}; rolling back");
                match restart_and_check(o, name, rb).await {
                    Ok(_) => {
                        set_drain(&o.gateway, name, false).await?;
                        bail!("lane {name}: {e:#}; rolled back, serving on the old version; the rollout stopped");
                    }
                    Err(e2) => bail!(
                        "lane {name}: {e:#}; the rollback failed too ({e2:#}): the lane stays drained"
                    ),
                }
            }
        }
    }
    println!("moelane rollout: {} lane(s) upgraded", names.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn chunked_bodies_are_joined_and_broken_ones_stop() {
        assert_eq!(
            super::dechunk(b"3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"),
            b"abcde"
        );
        assert_eq!(super::dechunk(b"ff\r\nabc"), b"");
        assert_eq!(super::dechunk(b"zz\r\nabc"), b"");
    }
}
