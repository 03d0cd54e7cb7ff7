//! Lanes across hosts: the Compose topology of deploy/compose (a gateway, two lanes, every
//! primary and sidecar in its own container over the TCP link on a private network), built
//! from the test's binary `FROM scratch` by deploy/container/build-image.sh. Under steady
//! load: a sidecar killed and restarted, a sidecar partitioned from its primary and
//! reconnected, SIGTERM to a primary, a rolling upgrade of both lanes with `moelane rollout`
//! (the committed map carried over), SIGTERM to the gateway mid-stream. Every container,
//! network and image is named after this run and removed at the end, even on failure; traffic
//! goes only to the gateway's port published on 127.0.0.1.
//!
//! Docker is required (scripts/test.sh checks for it; `MOELANE_SKIP_DOCKER=1` skips this
//! test, saying so).

mod common;

use std::process::{Command, Output};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

fn repo() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../..")
}

fn out_text(o: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

fn docker(args: &[&str]) -> Output {
    Command::new("docker")
        .args(args)
        .output()
        .expect("run docker")
}

/// The Compose command this machine has: `docker compose` or `docker-compose`.
fn compose_cmd() -> Option<Vec<String>> {
    if docker(&["compose", "version"]).status.success() {
        return Some(vec!["docker".into(), "compose".into()]);
    }
    let ok = Command::new("docker-compose")
        .arg("version")
        .output()
        .is_ok_and(|o| o.status.success());
    ok.then(|| vec!["docker-compose".into()])
}

/// A Compose project of this run; brought down (containers, networks, images) when dropped.
struct Cluster {
    project: String,
    compose: Vec<String>,
    env: Vec<(String, String)>,
    images: Vec<String>,
    gw: String,
    /// The gateway's admin listener (published on 127.0.0.1).
    admin: String,
}

/// The admin token the test's gateway requires.
const ADMIN_TOKEN: &str = "test-admin-token-0123456789abcdef";

impl Cluster {
    fn compose(&self, args: &[&str]) -> Output {
        let file = repo().join("deploy/compose/docker-compose.yml");
        Command::new(&self.compose[0])
            .args(&self.compose[1..])
            .args(["-p", &self.project, "-f", file.to_str().unwrap()])
            .args(args)
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .output()
            .expect("run compose")
    }

    /// The shell line of a compose command (for `moelane rollout --restart`).
    fn compose_line(&self, args: &str) -> String {
        let file = repo().join("deploy/compose/docker-compose.yml");
        format!(
            "{} -p {} -f {} {args}",
            self.compose.join(" "),
            self.project,
            file.display()
        )
    }

    /// The container id of `service`.
    fn container(&self, service: &str) -> String {
        let o = self.compose(&["ps", "-q", service]);
        let id = String::from_utf8_lossy(&o.stdout).trim().to_string();
        assert!(
            !id.is_empty(),
            "no container for {service}: {}",
            out_text(&o)
        );
        id
    }

    fn exit_code(&self, id: &str) -> Option<i32> {
        let o = docker(&[
            "inspect",
            "-f",
            "{{.State.Running}} {{.State.ExitCode}}",
            id,
        ]);
        let t = String::from_utf8_lossy(&o.stdout).trim().to_string();
        match t.split_once(' ') {
            Some(("false", c)) => c.parse().ok(),
            _ => None,
        }
    }

    /// `moelane ARGS` inside `service`'s container (the image has no shell).
    fn exec(&self, service: &str, args: &[&str]) -> String {
        let id = self.container(service);
        let mut a = vec!["exec", id.as_str(), "/moelane"];
        a.extend_from_slice(args);
        let o = docker(&a);
        assert!(
            o.status.success(),
            "moelane {args:?} in {service}: {}",
            out_text(&o)
        );
        String::from_utf8_lossy(&o.stdout).to_string()
    }

    fn epoch(&self, service: &str) -> u64 {
        let s = self.exec(service, &["status", "--primary", "http://127.0.0.1:50051"]);
        s.split("map epoch ")
            .nth(1)
            .and_then(|r| r.split_whitespace().next())
            .and_then(|e| e.parse().ok())
            .unwrap_or_else(|| panic!("no epoch in {s}"))
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        let _ = self.compose(&["down", "-v", "--remove-orphans", "-t", "2"]);
        for i in &self.images {
            let _ = docker(&["rmi", "-f", i]);
        }
    }
}

fn ask(max_tokens: usize, stream: bool) -> serde_json::Value {
    json!({"model": "tiny", "prompt": "Lanes on many hosts", "max_tokens": max_tokens,
           "temperature": 0, "stream": stream})
}

fn whole(gw: &str, max_tokens: usize) -> (u16, String) {
    let (st, v) = post(gw, "/v1/completions", &ask(max_tokens, false));
    (
        st,
        v["choices"][0]["text"].as_str().unwrap_or("").to_string(),
    )
}

/// Clients sending requests (streamed and whole in turn) until stopped; each result is
/// checked against the reference text.
struct Load {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
    /// (requests, whole answers failed, streams failed before a token, streams cut honestly,
    /// wrong answers)
    tally: Arc<Mutex<[usize; 5]>>,
}

impl Load {
    fn start(gw: &str, reference: &str, clients: usize) -> Load {
        let stop = Arc::new(AtomicBool::new(false));
        let tally = Arc::new(Mutex::new([0usize; 5]));
        let threads = (0..clients)
            .map(|c| {
                let (gw, r, stop, tally) = (
                    gw.to_string(),
                    reference.to_string(),
                    stop.clone(),
                    tally.clone(),
                );
                std::thread::spawn(move || {
                    let mut i = c;
                    while !stop.load(Ordering::SeqCst) && i < 100_000 {
                        i += 1;
                        let slot = if i % 2 == 0 {
                            let s = stream_completion(&gw, &ask(16, true), |_| {});
                            if s.ok() {
                                if s.text == r {
                                    None
                                } else {
                                    Some(4)
                                }
                            } else if s.chunks == 0 {
                                Some(2)
                            } else if s.cut_honestly() {
                                Some(3)
                            } else {
                                Some(4)
                            }
                        } else {
                            match whole(&gw, 16) {
                                (200, t) if t == r => None,
                                (200, _) => Some(4),
                                _ => Some(1),
                            }
                        };
                        let mut t = tally.lock().expect("tally");
                        t[0] += 1;
                        if let Some(k) = slot {
                            t[k] += 1;
                        }
                    }
                })
            })
            .collect();
        Load {
            stop,
            threads,
            tally,
        }
    }

    fn finish(self) -> [usize; 5] {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads {
            t.join().expect("client");
        }
        let t = *self.tally.lock().expect("tally");
        t
    }
}

fn cluster() -> Option<Cluster> {
    if std::env::var("MOELANE_SKIP_DOCKER").is_ok_and(|v| v == "1") {
        println!("SKIPPED: the container test (MOELANE_SKIP_DOCKER=1)");
        return None;
    }
    let info = Command::new("docker").arg("info").output();
    assert!(
        info.as_ref().is_ok_and(|o| o.status.success()),
        "the container test needs a Docker daemon (`docker info` failed: {}); set \
         MOELANE_SKIP_DOCKER=1 to skip it",
        info.map(|o| out_text(&o)).unwrap_or_else(|e| e.to_string())
    );
    let compose = compose_cmd().expect("neither `docker compose` nor `docker-compose` runs");
    let run = format!("moelane-it-{}", std::process::id());
    let state = std::env::temp_dir().join(format!("{run}-state"));
    let _ = std::fs::remove_dir_all(&state);
    for lane in ["lane1", "lane2"] {
        std::fs::create_dir_all(state.join(lane)).expect("state dir");
        std::fs::copy(
            tiny().join("rowmap.json"),
            state.join(lane).join("rowmap.json"),
        )
        .expect("map");
    }
    let build = repo().join("deploy/container/build-image.sh");
    let mut images = Vec::new();
    for tag in ["a", "b"] {
        let image = format!("{run}:{tag}");
        let o = Command::new("bash")
            .arg(&build)
            .args([bin(), image.as_str()])
            .output()
            .expect("build image");
        assert!(o.status.success(), "building {image}: {}", out_text(&o));
        images.push(image);
    }
    let mut c = Cluster {
        project: run.replace('-', ""),
        compose,
        env: vec![
            ("MOELANE_IMAGE".into(), images[0].clone()),
            ("MOELANE_MODEL_DIR".into(), tiny().display().to_string()),
            ("MOELANE_STATE_DIR".into(), state.display().to_string()),
            ("MOELANE_SERVED_MODEL_NAME".into(), "tiny".into()),
            ("MOELANE_ADMIN_TOKEN".into(), ADMIN_TOKEN.into()),
            (
                "MOELANE_CLUSTER_TOKEN".into(),
                "test-cluster-token-0123456789abcdef".into(),
            ),
            ("MOELANE_STEP_PACE_MS".into(), "3".into()),
        ],
        images,
        gw: String::new(),
        admin: String::new(),
    };
    let o = c.compose(&["up", "-d"]);
    assert!(o.status.success(), "compose up: {}", out_text(&o));
    let o = c.compose(&["port", "gateway", "8000"]);
    c.gw = String::from_utf8_lossy(&o.stdout).trim().to_string();
    let o = c.compose(&["port", "gateway", "8001"]);
    c.admin = String::from_utf8_lossy(&o.stdout).trim().to_string();
    assert!(
        c.gw.starts_with("127.0.0.1:"),
        "gateway port: {}",
        out_text(&o)
    );
    Some(c)
}

#[test]
fn lanes_on_separate_hosts_survive_kills_partitions_stops_and_a_rolling_upgrade() {
    let Some(c) = cluster() else { return };
    let gw = c.gw.clone();
    let (l1, l2) = ("http://primary1:50051", "http://primary2:50051");
    until(Duration::from_secs(120), "both lanes up", || {
        lane_state(&gw, l1) == "up" && lane_state(&gw, l2) == "up"
    });
    let (st, reference) = whole(&gw, 16);
    assert_eq!(st, 200);
    let mut report = Vec::new();

    // 1. a sidecar killed, then restarted
    let load = Load::start(&gw, &reference, 4);
    std::thread::sleep(Duration::from_millis(500));
    let side1 = c.container("sidecar1");
    assert!(docker(&["kill", "-s", "KILL", &side1]).status.success());
    let t = Instant::now();
    until(Duration::from_secs(10), "lane 1 down", || {
        lane_state(&gw, l1) != "up"
    });
    let down = t.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    assert!(docker(&["start", &side1]).status.success());
    let t = Instant::now();
    until(Duration::from_secs(30), "lane 1 back", || {
        lane_state(&gw, l1) == "up"
    });
    let back = t.elapsed();
    let r = load.finish();
    report.push(format!(
        "sidecar killed: {} requests, {} whole failed, {} streams failed before a token, {} cut after tokens, lane down after {:.2} s, back {:.2} s after the restart",
        r[0], r[1], r[2], r[3], down.as_secs_f64(), back.as_secs_f64()
    ));
    assert_eq!((r[1], r[2], r[4]), (0, 0, 0), "{}", report.last().unwrap());
    assert!(r[3] <= 4, "{}", report.last().unwrap());

    // 2. a sidecar cut off from its primary, then reconnected
    let load = Load::start(&gw, &reference, 4);
    std::thread::sleep(Duration::from_millis(500));
    let side2 = c.container("sidecar2");
    let net = format!("{}_lanes", c.project);
    assert!(docker(&["network", "disconnect", &net, &side2])
        .status
        .success());
    let t = Instant::now();
    until(Duration::from_secs(10), "lane 2 down", || {
        lane_state(&gw, l2) != "up"
    });
    let down = t.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    // back under its service name (a plain connect registers only the container's name)
    assert!(
        docker(&["network", "connect", "--alias", "sidecar2", &net, &side2])
            .status
            .success()
    );
    let t = Instant::now();
    until(Duration::from_secs(30), "lane 2 back", || {
        lane_state(&gw, l2) == "up"
    });
    let back = t.elapsed();
    let r = load.finish();
    report.push(format!(
        "partition: {} requests, {} whole failed, {} streams failed before a token, {} cut after tokens, lane down after {:.2} s, back {:.2} s after the reconnect",
        r[0], r[1], r[2], r[3], down.as_secs_f64(), back.as_secs_f64()
    ));
    assert_eq!((r[1], r[2], r[4]), (0, 0, 0), "{}", report.last().unwrap());
    assert!(r[3] <= 4, "{}", report.last().unwrap());

    // 3. SIGTERM to a primary under load: it drains and exits 0
    let load = Load::start(&gw, &reference, 4);
    std::thread::sleep(Duration::from_millis(500));
    let p1 = c.container("primary1");
    assert!(docker(&["kill", "-s", "TERM", &p1]).status.success());
    let code = {
        let t = Instant::now();
        loop {
            if let Some(code) = c.exit_code(&p1) {
                break code;
            }
            assert!(
                t.elapsed() < Duration::from_secs(40),
                "primary1 did not exit"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
    };
    assert!(docker(&["start", &p1]).status.success());
    until(Duration::from_secs(60), "lane 1 back", || {
        lane_state(&gw, l1) == "up"
    });
    let r = load.finish();
    report.push(format!(
        "SIGTERM to a primary: exit code {code}, {} requests, {} failed, {} cut",
        r[0],
        r[1] + r[2],
        r[3]
    ));
    assert_eq!(code, 0);
    assert_eq!(
        (r[1], r[2], r[3], r[4]),
        (0, 0, 0, 0),
        "{}",
        report.last().unwrap()
    );

    // 4. a committed swap on lane 1, then a rolling upgrade of both lanes to image b
    let map: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("rowmap.json")).expect("map"))
            .expect("json");
    let cold = map["layers"][0]["cold"][0].as_u64().expect("cold");
    let hot = map["layers"][0]["hot"][0].as_u64().expect("hot");
    c.exec(
        "primary1",
        &[
            "swap",
            "--primary",
            "http://127.0.0.1:50051",
            "--move",
            &format!("0:{cold}:hot"),
            "--move",
            &format!("0:{hot}:cold"),
        ],
    );
    let epoch = c.epoch("primary1");
    let load = Load::start(&gw, &reference, 4);
    std::thread::sleep(Duration::from_millis(500));
    let restart = c.compose_line(
        "up -d --no-deps --force-recreate $(echo {lane} | sed 's#http://##; s#:.*##')",
    );
    let t = Instant::now();
    let o = Command::new(bin())
        .args([
            "rollout",
            "--admin",
            &format!("http://{}", c.admin),
            "--restart",
            &restart,
            "--ready-timeout",
            "120",
        ])
        .envs(c.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("MOELANE_IMAGE", &c.images[1])
        .output()
        .expect("rollout");
    let took = t.elapsed();
    let r = load.finish();
    report.push(format!(
        "rolling upgrade of 2 lanes: {} requests, {} failed, {} cut, {:.1} s",
        r[0],
        r[1] + r[2],
        r[3],
        took.as_secs_f64()
    ));
    assert!(o.status.success(), "rollout: {}", out_text(&o));
    assert_eq!(
        (r[1], r[2], r[3], r[4]),
        (0, 0, 0, 0),
        "{}",
        report.last().unwrap()
    );
    for svc in ["primary1", "primary2"] {
        let id = c.container(svc);
        let o = docker(&["inspect", "-f", "{{.Config.Image}}", &id]);
        assert_eq!(
            String::from_utf8_lossy(&o.stdout).trim(),
            c.images[1],
            "{svc}"
        );
    }
    assert_eq!(c.epoch("primary1"), epoch, "the committed map carried over");
    assert_eq!(
        whole(&gw, 16),
        (200, reference.clone()),
        "greedy output unchanged"
    );

    // 5. degraded mode: primary1 recreated with MOELANE_DEGRADED=true (and a budget of a few
    // experts, so they are read from the checkpoint on demand and dropped), its sidecar killed
    // under load (0 failed, the same answers), then restarted (no longer degraded)
    let o = Command::new(&c.compose[0])
        .args(&c.compose[1..])
        .args([
            "-p",
            &c.project,
            "-f",
            repo()
                .join("deploy/compose/docker-compose.yml")
                .to_str()
                .unwrap(),
            "up",
            "-d",
            "--no-deps",
            "--force-recreate",
            "primary1",
        ])
        .envs(c.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
        .env("MOELANE_IMAGE", &c.images[1])
        .env("MOELANE_DEGRADED", "true")
        // a few experts' worth: read on demand, dropped, read again
        .env("MOELANE_DEGRADED_MEMORY", "64KiB")
        .output()
        .expect("compose");
    assert!(o.status.success(), "recreate primary1: {}", out_text(&o));
    until(Duration::from_secs(60), "lane 1 back", || {
        lane_state(&gw, l1) == "up"
    });
    let degraded = |gw: &str| -> String {
        let (_, v) = get(gw, "/v1/stats");
        v["lanes"]
            .as_array()
            .and_then(|ls| ls.iter().find(|l| l["lane"] == l1))
            .and_then(|l| l["degraded"].as_str())
            .unwrap_or("")
            .to_string()
    };
    // lane 2 drained: the load runs on lane 1 only
    let (st, _) = post_as(
        &c.admin,
        "/admin/drain",
        &json!({"lane": l2, "drain": true}),
        ADMIN_TOKEN,
    );
    assert_eq!(st, 200);
    let load = Load::start(&gw, &reference, 4);
    std::thread::sleep(Duration::from_millis(500));
    let side1 = c.container("sidecar1");
    assert!(docker(&["kill", "-s", "KILL", &side1]).status.success());
    let t = Instant::now();
    until(Duration::from_secs(10), "lane 1 degraded", || {
        !degraded(&gw).is_empty()
    });
    let said = t.elapsed();
    std::thread::sleep(Duration::from_millis(1000));
    assert_eq!(lane_state(&gw, l1), "up", "a degraded lane serves");
    assert!(docker(&["start", &side1]).status.success());
    let t = Instant::now();
    until(Duration::from_secs(30), "lane 1 no longer degraded", || {
        degraded(&gw).is_empty()
    });
    let back = t.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let r = load.finish();
    let (st, _) = post_as(
        &c.admin,
        "/admin/drain",
        &json!({"lane": l2, "drain": false}),
        ADMIN_TOKEN,
    );
    assert_eq!(st, 200);
    report.push(format!(
        "degraded mode, sidecar killed: {} requests, {} failed, {} cut, {} different; degraded after {:.2} s, back {:.2} s after the restart",
        r[0],
        r[1] + r[2],
        r[3],
        r[4],
        said.as_secs_f64(),
        back.as_secs_f64()
    ));
    assert_eq!(
        (r[1], r[2], r[3], r[4]),
        (0, 0, 0, 0),
        "{}",
        report.last().unwrap()
    );

    // 6. SIGTERM to the gateway mid-stream: the stream finishes, exit 0
    let g = c.container("gateway");
    let s = stream_completion(&gw, &ask(48, true), |n| {
        if n == 3 {
            assert!(docker(&["kill", "-s", "TERM", &g]).status.success());
        }
    });
    let t = Instant::now();
    let code = loop {
        if let Some(code) = c.exit_code(&g) {
            break code;
        }
        assert!(
            t.elapsed() < Duration::from_secs(40),
            "the gateway did not exit"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    report.push(format!(
        "SIGTERM to the gateway mid-stream: the stream {}, exit code {code}",
        if s.ok() { "finished" } else { "was cut" }
    ));
    assert!(s.ok(), "{s:?}");
    assert_eq!(code, 0);
    for l in &report {
        println!("containers: {l}");
    }
}
