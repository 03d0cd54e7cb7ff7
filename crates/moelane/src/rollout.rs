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

/// The gateway's admin listener and the token it requires, if any.
pub struct Admin {
    pub url: String,
    pub token: Option<String>,
}

impl std::fmt::Display for Admin {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.url)
    }
}

pub struct RolloutOptions {
    pub gateway: Admin,
    pub lanes: Vec<String>,
    pub restart: String,
    pub rollback: Option<String>,
    pub drain_timeout: Duration,
    pub ready_timeout: Duration,
    pub canary_tokens: u32,
}

/// One HTTP/1.1 exchange with the gateway (JSON in, JSON out), bounded by 60 s.
async fn http(
    gateway: &Admin,
    method: &str,
    path: &str,
    body: Option<&Value>,
) -> Result<(u16, Value)> {
    let (host, prefix) =
        crate::client::split_url(&gateway.url).with_context(|| format!("--admin {gateway}"))?;
    let body = body.map(|b| b.to_string());
    let (status, text) = tokio::time::timeout(
        Duration::from_secs(60),
        crate::client::request_as(
            &host,
            method,
            &format!("{prefix}{path}"),
            body.as_deref(),
            gateway.token.as_deref(),
        ),
    )
    .await
    .with_context(|| format!("{method} {path}: no answer from the gateway within 60 s"))??;
    if status == 401 {
        bail!("{method} {path}: the gateway's admin listener wants its admin token (--admin-token-file or MOELANE_ADMIN_TOKEN): {text}");
    }
    let v = serde_json::from_str(&text).unwrap_or(Value::String(text));
    Ok((status, v))
}

/// The gateway's view of every lane.
async fn lanes(gateway: &Admin) -> Result<Vec<Value>> {
    let (st, v) = http(gateway, "GET", "/v1/stats", None).await?;
    if st != 200 {
        bail!("GET /v1/stats answered {st}: {v}");
    }
    Ok(v["lanes"].as_array().cloned().unwrap_or_default())
}

async fn lane(gateway: &Admin, name: &str) -> Result<Value> {
    lanes(gateway)
        .await?
        .into_iter()
        .find(|l| l["lane"] == name)
        .with_context(|| format!("the gateway no longer lists lane {name}"))
}

async fn set_drain(gateway: &Admin, name: &str, drain: bool) -> Result<()> {
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
async fn wait_back(gateway: &Admin, name: &str, old: u64, limit: Duration) -> Result<String> {
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

async fn canary(gateway: &Admin, name: &str, tokens: u32) -> Result<f64> {
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
