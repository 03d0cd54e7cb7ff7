//! Failover, drain and stall detection with real processes on loopback: lanes killed,
//! stopped (SIGSTOP) and asked to stop (SIGTERM) under streaming load; the gateway's listening
//! socket handed to a successor; lanes found through a file and DNS. Every wait is bounded.
//! `MOELANE_STEP_PACE_MS` paces the step loop so a signal lands mid-stream.

mod common;

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use serde_json::json;

/// A primary process on the tiny checkpoint with its sidecar in-process; its gRPC URL.
fn primary(extra: &[&str], env: &[(&str, &str)]) -> (Proc, String) {
    let dir = tiny().to_str().unwrap().to_string();
    let mut args = vec![
        "lane",
        "--role",
        "primary",
        "--model",
        dir.as_str(),
        "--listen",
        "127.0.0.1:0",
    ];
    args.extend_from_slice(extra);
    let mut wants = vec!["primary grpc "];
    if extra.contains(&"--metrics-listen") {
        wants.push("moelane: metrics ");
    }
    let (p, v) = start_env(&args, &wants, env);
    let url = v[0].split(',').next().unwrap_or_default().to_string();
    (p, url)
}

/// The arguments of a gateway process over `lanes` on the tiny checkpoint.
fn gateway_args(lanes: &[&str], extra: &[&str]) -> Vec<String> {
    let mut args: Vec<String> = ["lane", "--role", "gateway", "--model"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    args.push(tiny().to_str().unwrap().into());
    args.extend(["--listen".into(), "127.0.0.1:0".into()]);
    for l in lanes {
        args.extend(["--lane".into(), l.to_string()]);
    }
    args.extend(extra.iter().map(|s| s.to_string()));
    args
}

/// A gateway process over `lanes`; its host:port.
fn gateway(lanes: &[&str], extra: &[&str]) -> (Proc, String) {
    gateway_with(lanes, extra, &["gateway listening on "]).1
}

/// A gateway process; the process, its host:port and the text after each of `wants`.
fn gateway_with(lanes: &[&str], extra: &[&str], wants: &[&str]) -> (Vec<String>, (Proc, String)) {
    let args = gateway_args(lanes, extra);
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let mut all = wants.to_vec();
    all.push("gateway listening on ");
    let (p, v) = start(&args, &all);
    let addr = hostport(&v[v.len() - 1]);
    (v, (p, addr))
}

fn ask(max_tokens: usize, stream: bool) -> serde_json::Value {
    json!({"model": "tiny", "prompt": "The lane keeps serving", "max_tokens": max_tokens,
           "temperature": 0, "stream": stream})
}

/// The whole answer's (status, text, finish reason).
fn whole(addr: &str, max_tokens: usize) -> (u16, String, String) {
    let (st, v) = post(addr, "/v1/completions", &ask(max_tokens, false));
    (
        st,
        v["choices"][0]["text"].as_str().unwrap_or_default().into(),
        v["choices"][0]["finish_reason"]
            .as_str()
            .unwrap_or_default()
            .into(),
    )
}

fn ready(addr: &str) -> u16 {
    request(addr, "GET", "/ready", b"").status
}

fn lane_count(gw: &str) -> usize {
    let (_, v) = get(gw, "/v1/stats");
    v["lanes"].as_array().map_or(0, |l| l.len())
}

fn dead_url() -> String {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    format!("http://{}", l.local_addr().expect("addr"))
}

#[test]
fn a_lane_killed_under_load_costs_no_request_that_had_not_started_streaming() {
    let pace = [("MOELANE_STEP_PACE_MS", "3")];
    let (mut a, a_url) = primary(&[], &pace);
    let (mut b, b_url) = primary(&[], &pace);
    let dead = dead_url();
    // the dead lane is listed first: it must cost nothing
    let (_gw, gw) = gateway(&[&dead, &a_url, &b_url], &["--health-interval", "0.2"]);
    let (st, reference, fin) = whole(&gw, 24);
    assert_eq!(st, 200);
    for _ in 0..10 {
        assert_eq!(whole(&gw, 24), (200, reference.clone(), fin.clone()));
    }
    // 4 clients, 25 requests each, streamed and whole in turn; lane a is killed mid-way
    let done = Arc::new(AtomicUsize::new(0));
    let results = Arc::new(Mutex::new(Vec::new()));
    let clients: Vec<_> = (0..4)
        .map(|c| {
            let (gw, reference, fin, done, results) = (
                gw.clone(),
                reference.clone(),
                fin.clone(),
                done.clone(),
                results.clone(),
            );
            std::thread::spawn(move || {
                for i in 0..25 {
                    let stream = (i + c) % 2 == 0;
                    let r = if stream {
                        let s = stream_completion(&gw, &ask(24, true), |_| {});
                        if s.ok() {
                            assert_eq!(s.text, reference, "a finished stream is the whole text");
                            "ok"
                        } else {
                            assert!(s.cut_honestly(), "a failed stream says so: {s:?}");
                            "cut"
                        }
                    } else {
                        let (st, text, f) = whole(&gw, 24);
                        if st == 200 {
                            assert_eq!((&text, &f), (&reference, &fin));
                            "ok"
                        } else {
                            "failed"
                        }
                    };
                    results.lock().expect("results").push((stream, r));
                    done.fetch_add(1, Ordering::SeqCst);
                }
            })
        })
        .collect();
    until(Duration::from_secs(60), "20 requests done", || {
        done.load(Ordering::SeqCst) >= 20
    });
    signal(&a, "KILL");
    let killed = Instant::now();
    let _ = wait_exit(&mut a, Duration::from_secs(5));
    until(Duration::from_secs(5), "lane a marked down", || {
        lane_state(&gw, &a_url) == "down"
    });
    let detected = killed.elapsed();
    for c in clients {
        c.join().expect("client");
    }
    let r = results.lock().expect("results").clone();
    let failed_whole = r.iter().filter(|(s, o)| !s && *o != "ok").count();
    let cut = r.iter().filter(|(s, o)| *s && *o == "cut").count();
    println!(
        "lane killed under load: {} requests, whole answers failed {failed_whole}, streams cut {cut}; \
         the gateway saw the lane down {:.2} s after the kill",
        r.len(),
        detected.as_secs_f64()
    );
    assert_eq!(r.len(), 100);
    assert_eq!(failed_whole, 0, "whole answers are retried: none fails");
    assert!(
        cut <= 4,
        "only streams running on the killed lane may be cut: {cut}"
    );
    assert_eq!(ready(&gw), 200, "lane b serves");
    // the last lane killed: not ready, and requests fail at once
    signal(&b, "KILL");
    let _ = wait_exit(&mut b, Duration::from_secs(5));
    until(Duration::from_secs(3), "/ready says 503", || {
        ready(&gw) == 503
    });
    let t = Instant::now();
    let (st, _, _) = whole(&gw, 4);
    assert_eq!(st, 503);
    assert!(t.elapsed() < Duration::from_secs(2), "{:?}", t.elapsed());
}

#[test]
fn sigterm_to_a_primary_finishes_its_streams_refuses_new_ones_and_exits_0() {
    let pace = [("MOELANE_STEP_PACE_MS", "10")];
    let (mut p, url) = primary(&[], &pace);
    let (_gw, gw) = gateway(&[&url], &["--health-interval", "0.2"]);
    let undisturbed = stream_completion(&gw, &ask(60, true), |_| {});
    assert!(undisturbed.ok(), "{undisturbed:?}");
    let mut refused = None;
    let mut health = None;
    let s = stream_completion(&gw, &ask(60, true), |n| {
        if n == 5 {
            signal(&p, "TERM");
            // new requests are refused while the stream runs on (the only lane drains)
            std::thread::sleep(Duration::from_millis(100));
            refused = Some(whole(&gw, 4).0);
            health = Some(grpc_health(&url));
        }
    });
    assert!(s.ok(), "the stream finishes: {s:?}");
    assert_eq!(s.text, undisturbed.text, "as it would have undisturbed");
    assert_eq!(refused, Some(503), "a new request during the drain");
    assert_eq!(
        health,
        Some(2),
        "grpc.health.v1 says NOT_SERVING while draining"
    );
    assert_eq!(wait_exit(&mut p, Duration::from_secs(10)), Some(0));
}

/// The primary's grpc.health.v1 status for "" (1 SERVING, 2 NOT_SERVING; 0 on no answer).
fn grpc_health(url: &str) -> i32 {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async {
        let Ok(ch) = tonic::transport::Endpoint::from_shared(url.to_string()) else {
            return 0;
        };
        let Ok(ch) = ch.connect().await else {
            return 0;
        };
        let mut c = tonic_health::pb::health_client::HealthClient::new(ch);
        c.check(tonic_health::pb::HealthCheckRequest {
            service: String::new(),
        })
        .await
        .map(|r| r.into_inner().status)
        .unwrap_or(0)
    })
}

#[test]
fn a_grace_period_too_short_cuts_with_an_error_never_a_finish() {
    let pace = [("MOELANE_STEP_PACE_MS", "20")];
    let (mut p, url) = primary(&["--grace", "0.3"], &pace);
    let (_gw, gw) = gateway(&[&url], &[]);
    let gw2 = gw.clone();
    let whole_req = std::thread::spawn(move || whole(&gw2, 200));
    let s = stream_completion(&gw, &ask(200, true), |n| {
        if n == 5 {
            signal(&p, "TERM");
        }
    });
    assert!(s.cut_honestly(), "{s:?}");
    let msg = s.error.as_ref().map(|e| e.to_string()).unwrap_or_default();
    assert!(msg.contains("grace period"), "the error says why: {msg}");
    let (st, _, fin) = whole_req.join().expect("whole");
    assert_eq!(st, 503, "a cut whole answer is an error, not a {fin:?}");
    assert_eq!(wait_exit(&mut p, Duration::from_secs(10)), Some(0));
}

#[test]
fn sigterm_to_a_gateway_or_serve_finishes_streams_and_exits_0() {
    let pace = [("MOELANE_STEP_PACE_MS", "10")];
    let (_p, url) = primary(&[], &pace);
    let (mut g, gw) = gateway(&[&url], &[]);
    let undisturbed = stream_completion(&gw, &ask(40, true), |_| {});
    let mut refused = false;
    let s = stream_completion(&gw, &ask(40, true), |n| {
        if n == 5 {
            signal(&g, "TERM");
            std::thread::sleep(Duration::from_millis(100));
            // it accepts no new connection
            refused = std::net::TcpStream::connect(&gw).is_err();
        }
    });
    assert!(s.ok(), "{s:?}");
    assert_eq!(s.text, undisturbed.text);
    assert!(refused, "a stopping gateway takes no new connection");
    assert_eq!(wait_exit(&mut g, Duration::from_secs(10)), Some(0));

    // moelane serve: gateway, primary and sidecar in one process
    let dir = tiny().to_str().unwrap().to_string();
    let (mut serve, v) = start_env(
        &["serve", "--model", &dir, "--listen", "127.0.0.1:0"],
        &["gateway listening on "],
        &pace,
    );
    let addr = hostport(&v[0]);
    let s = stream_completion(&addr, &ask(40, true), |n| {
        if n == 5 {
            signal(&serve, "TERM");
        }
    });
    assert!(s.ok(), "{s:?}");
    assert_eq!(s.text, undisturbed.text);
    assert_eq!(wait_exit(&mut serve, Duration::from_secs(10)), Some(0));
}

#[test]
fn sigterm_to_a_sidecar_finishes_what_runs_turns_the_lane_unready_and_exits_0() {
    let pace = [("MOELANE_STEP_PACE_MS", "10")];
    let (mut procs, gw, _purl) = two_process_lane_env("tcp", &[], &pace);
    let undisturbed = stream_completion(&gw, &ask(60, true), |_| {});
    assert!(undisturbed.ok(), "{undisturbed:?}");
    let s = stream_completion(&gw, &ask(60, true), |n| {
        if n == 5 {
            signal(&procs[0], "TERM");
        }
    });
    assert!(s.ok(), "{s:?}");
    assert_eq!(s.text, undisturbed.text);
    let t = until(Duration::from_secs(4), "the lane turns unready", || {
        ready(&gw) == 503
    });
    println!(
        "sidecar draining: the lane unready after {:.2} s",
        t.as_secs_f64()
    );
    assert_eq!(wait_exit(&mut procs[0], Duration::from_secs(15)), Some(0));
}

#[test]
fn a_stalled_sidecar_is_detected_in_seconds_and_the_lane_comes_back() {
    let (procs, gw, _purl) = two_process_lane("tcp", &["--stall-timeout", "1.5"]);
    let (st, reference, _) = whole(&gw, 16);
    assert_eq!(st, 200);
    for _ in 0..3 {
        assert_eq!(whole(&gw, 16).1, reference);
    }
    signal(&procs[0], "STOP");
    let stopped = Instant::now();
    // a request sent into the stall fails in seconds (not the 30 s link timeout)
    let (st, _, _) = whole(&gw, 16);
    let failed_in = stopped.elapsed();
    assert_eq!(st, 503);
    until(Duration::from_secs(6), "the lane turns unready", || {
        ready(&gw) == 503
    });
    let unready = stopped.elapsed();
    signal(&procs[0], "CONT");
    let resumed = Instant::now();
    until(Duration::from_secs(20), "the lane serves again", || {
        let (st, text, _) = whole(&gw, 16);
        st == 200 && text == reference
    });
    let back = resumed.elapsed();
    println!(
        "sidecar stalled: a request failed after {:.2} s, the lane unready within {:.2} s, \
         serving again {:.2} s after SIGCONT",
        failed_in.as_secs_f64(),
        unready.as_secs_f64(),
        back.as_secs_f64()
    );
    assert!(failed_in < Duration::from_secs(8), "{failed_in:?}");
}

#[test]
fn a_gateway_hands_its_socket_to_a_successor_and_no_request_fails() {
    let pace = [("MOELANE_STEP_PACE_MS", "2")];
    let (_p, url) = primary(&[], &pace);
    let dir = std::env::temp_dir().join(format!("moelane-handoff-it-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let sock = dir.join("gw.sock");
    let sock_s = sock.to_str().unwrap().to_string();
    let (mut g1, gw) = gateway(&[&url], &["--handoff", &sock_s]);
    let stop = Arc::new(AtomicBool::new(false));
    let (ok, failed) = (Arc::new(AtomicUsize::new(0)), Arc::new(AtomicUsize::new(0)));
    let clients: Vec<_> = (0..3)
        .map(|c| {
            let (gw, stop, ok, failed) = (gw.clone(), stop.clone(), ok.clone(), failed.clone());
            std::thread::spawn(move || {
                let mut i = c;
                let mut errors = Vec::new();
                while !stop.load(Ordering::SeqCst) && i < 2000 {
                    i += 1;
                    let good = if i % 2 == 0 {
                        stream_completion(&gw, &ask(12, true), |_| {}).ok()
                    } else {
                        whole(&gw, 12).0 == 200
                    };
                    if good {
                        ok.fetch_add(1, Ordering::SeqCst);
                    } else {
                        failed.fetch_add(1, Ordering::SeqCst);
                        errors.push(i);
                    }
                }
                errors
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(800));
    let before = ok.load(Ordering::SeqCst);
    let (_, (_g2, addr2)) = gateway_with(
        &[&url],
        &["--handoff", &sock_s],
        &["took the listening socket "],
    );
    assert_eq!(addr2, gw, "the successor serves the same address");
    assert_eq!(wait_exit(&mut g1, Duration::from_secs(20)), Some(0));
    let at_exit = ok.load(Ordering::SeqCst);
    std::thread::sleep(Duration::from_millis(800));
    stop.store(true, Ordering::SeqCst);
    for c in clients {
        let errors = c.join().expect("client");
        assert!(errors.is_empty(), "failed requests: {errors:?}");
    }
    let after = ok.load(Ordering::SeqCst);
    println!(
        "gateway handoff: {after} requests, {} failed ({before} before the successor started, {} after the old one exited)",
        failed.load(Ordering::SeqCst),
        after - at_exit
    );
    assert_eq!(failed.load(Ordering::SeqCst), 0);
    assert!(after > at_exit, "the successor served");
}

#[test]
fn lanes_come_and_go_through_a_file_and_dns() {
    let (_a, a_url) = primary(&[], &[]);
    let (_b, b_url) = primary(&[], &[]);
    let dir = std::env::temp_dir().join(format!("moelane-lanesfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("lanes");
    std::fs::write(&file, format!("# the lanes\n{a_url}\n")).expect("write");
    let (_g, gw) = gateway(
        &[],
        &[
            "--lanes-file",
            file.to_str().unwrap(),
            "--discovery-interval",
            "0.2",
            "--health-interval",
            "0.2",
        ],
    );
    assert_eq!(lane_count(&gw), 1);
    assert_eq!(whole(&gw, 4).0, 200);
    std::fs::write(&file, format!("{a_url}\n{b_url}\n")).expect("write");
    until(Duration::from_secs(5), "lane b added", || {
        lane_state(&gw, &b_url) == "up"
    });
    std::fs::write(&file, format!("{b_url}\n")).expect("write");
    until(Duration::from_secs(5), "lane a removed", || {
        lane_count(&gw) == 1
    });
    assert_eq!(lane_state(&gw, &b_url), "up");
    // a file that goes bad keeps the lanes it gave
    std::fs::write(&file, "this is not a lane\n").expect("write");
    std::thread::sleep(Duration::from_millis(600));
    assert_eq!(lane_state(&gw, &b_url), "up");
    assert_eq!(whole(&gw, 4).0, 200);
    // a DNS name: every address it resolves to is a lane
    let port = b_url.rsplit(':').next().unwrap_or_default();
    let (_g2, gw2) = gateway(&[&format!("dns://localhost:{port}")], &[]);
    let (_, v) = get(&gw2, "/v1/stats");
    let lanes = v["lanes"].as_array().cloned().unwrap_or_default();
    assert!(
        lanes
            .iter()
            .any(|l| l["lane"] == format!("http://127.0.0.1:{port}")
                && l["source"] == format!("dns://localhost:{port}")),
        "{v}"
    );
    assert_eq!(whole(&gw2, 4).0, 200);
    // a spec that is wrong at start is refused, naming it
    let out = std::process::Command::new(bin())
        .args(gateway_args(&["dns://nameonly"], &[]))
        .output()
        .expect("run");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("dns://nameonly"), "{err}");
}

/// A sidecar process on the tiny checkpoint with a TCP data port; its control URL.
fn tcp_sidecar() -> (Proc, String) {
    let dir = tiny().to_str().unwrap().to_string();
    let (side, v) = start(
        &[
            "lane",
            "--role",
            "sidecar",
            "--model",
            &dir,
            "--listen",
            "127.0.0.1:0",
            "--data",
            "127.0.0.1:0",
        ],
        &["sidecar control "],
    );
    (side, v[0].clone())
}

#[test]
fn a_primary_started_while_its_sidecar_is_stopped_waits_and_registers_once_it_resumes() {
    // the sidecar's port accepts connections (the kernel does) but nothing answers the
    // registration: the primary asks again within --sidecar-wait instead of exiting
    let (side, url) = tcp_sidecar();
    signal(&side, "STOP");
    let pid = side.child.id().to_string();
    let resume = std::thread::spawn(move || {
        std::thread::sleep(Duration::from_secs(12));
        let st = std::process::Command::new("kill")
            .args(["-CONT", &pid])
            .status()
            .expect("run kill");
        assert!(st.success(), "kill -CONT failed");
    });
    let t0 = Instant::now();
    let (p, purl) = primary(
        &["--sidecar", &url, "--link", "tcp", "--sidecar-wait", "60"],
        &[],
    );
    let took = t0.elapsed();
    resume.join().expect("the resuming thread");
    assert!(
        p.lines
            .iter()
            .any(|l| l.contains("to answer its registration")),
        "the primary did not say it waited: {:?}",
        p.lines
    );
    assert!(
        took >= Duration::from_secs(11),
        "registered in {took:?} with its sidecar stopped"
    );
    // and the lane serves
    let (_gw, gw) = gateway(&[&purl], &[]);
    let (st, _, _) = whole(&gw, 8);
    assert_eq!(st, 200);
}

#[test]
fn a_second_primary_on_one_sidecar_replaces_the_first_which_stays_out_while_it_lives() {
    let (_side, url) = tcp_sidecar();
    let link = ["--sidecar", url.as_str(), "--link", "tcp"];
    let (_a, a_url) = primary(&link, &[]);
    let (_ga, ga) = gateway(&[&a_url], &["--health-interval", "0.2"]);
    until(Duration::from_secs(20), "the first lane serves", || {
        whole(&ga, 4).0 == 200
    });
    let (mut b, b_url) = primary(&link, &[]);
    let (_gb, gb) = gateway(&[&b_url], &["--health-interval", "0.2"]);
    let lane = |gw: &str| {
        let (_, v) = get(gw, "/v1/stats");
        v["lanes"][0].clone()
    };
    // the first is out, saying why, once it noticed (a step or a heartbeat)
    let _ = whole(&ga, 4);
    until(
        Duration::from_secs(15),
        "the replaced lane is down, saying why",
        || {
            lane(&ga)["down_reason"]
                .as_str()
                .is_some_and(|r| r.contains("replaced this one"))
        },
    );
    // the second keeps the sidecar: no flapping between the two
    for i in 0..12 {
        assert_eq!(whole(&gb, 4).0, 200, "request {i} on the second lane");
        std::thread::sleep(Duration::from_millis(250));
    }
    assert_eq!(lane(&ga)["state"], "down", "{}", lane(&ga));
    // the second goes away: the first may have the sidecar back
    signal(&b, "KILL");
    let _ = wait_exit(&mut b, Duration::from_secs(5));
    let back = until(
        Duration::from_secs(30),
        "the first lane serves again",
        || whole(&ga, 4).0 == 200,
    );
    println!("the replaced primary registered again {back:?} after the other was killed");
}

#[test]
fn a_sidecar_refuses_a_primary_of_another_protocol_naming_both_builds() {
    let (_side, url) = tcp_sidecar();
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let register = |protocol: u32, build: &str| {
        rt.block_on(async {
            let mut c = moelane_proto::control::sidecar_client::SidecarClient::connect(url.clone())
                .await
                .expect("connect");
            c.register(moelane_proto::control::RegisterRequest {
                model: "tiny".into(),
                link: String::new(),
                map_epoch: 0,
                rowmap_json: String::new(),
                incarnation: 1,
                protocol,
                build: build.into(),
                link_params: String::new(),
                primary: String::new(),
            })
            .await
        })
    };
    for (p, b, says) in [
        (0, "", "unversioned"),
        (moelane_proto::PROTOCOL + 1, "9.9.9", "9.9.9"),
    ] {
        let e = register(p, b).expect_err("refused");
        assert_eq!(e.code(), tonic::Code::InvalidArgument, "{e:?}");
        assert!(
            e.message().contains(says) && e.message().contains(&format!("protocol {p}")),
            "{}",
            e.message()
        );
    }
    // the sidecar is unharmed: a primary of this build pairs with it
    let (_p, _) = primary(&["--sidecar", &url, "--link", "tcp"], &[]);
}

/// Four clients sending greedy completions of `max_tokens` (streamed and whole in turn)
/// until `stop`; each returns (requests, answers that failed or differ from `reference`).
fn steady_load(
    gw: &str,
    reference: &str,
    max_tokens: usize,
    stop: &Arc<AtomicBool>,
) -> Vec<std::thread::JoinHandle<(usize, Vec<String>)>> {
    (0..4)
        .map(|c| {
            let (gw, stop, reference) = (gw.to_string(), stop.clone(), reference.to_string());
            std::thread::spawn(move || {
                let (mut n, mut bad) = (0usize, Vec::new());
                while !stop.load(Ordering::SeqCst) && n < 5000 {
                    n += 1;
                    if (n + c) % 2 == 0 {
                        let s = stream_completion(&gw, &ask(max_tokens, true), |_| {});
                        if !s.ok() || s.text != reference {
                            bad.push(format!("{s:?}"));
                        }
                    } else {
                        let (st, text, _) = whole(&gw, max_tokens);
                        if st != 200 || text != reference {
                            bad.push(format!("{st} {text:?}"));
                        }
                    }
                }
                (n, bad)
            })
        })
        .collect()
}

/// Stops `steady_load`'s clients: (requests, bad answers).
fn stop_load(
    stop: &Arc<AtomicBool>,
    clients: Vec<std::thread::JoinHandle<(usize, Vec<String>)>>,
) -> (usize, Vec<String>) {
    stop.store(true, Ordering::SeqCst);
    let (mut total, mut bad) = (0, Vec::new());
    for c in clients {
        let (n, b) = c.join().expect("client");
        total += n;
        bad.extend(b);
    }
    (total, bad)
}

/// Primaries started by the rollout's restart script (pid files): killed when dropped.
struct Pidfiles(Vec<std::path::PathBuf>);

impl Drop for Pidfiles {
    fn drop(&mut self) {
        for p in &self.0 {
            if let Ok(pid) = std::fs::read_to_string(p) {
                let _ = std::process::Command::new("kill")
                    .args(["-KILL", pid.trim()])
                    .status();
            }
        }
    }
}

/// The arguments of a sidecar process on the tiny checkpoint, its control port `port`.
fn sidecar_args(port: u16, extra: &[&str]) -> Vec<String> {
    let mut a: Vec<String> = ["lane", "--role", "sidecar", "--model"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    a.push(tiny().to_str().unwrap().into());
    a.extend(["--listen".into(), format!("127.0.0.1:{port}")]);
    a.extend(extra.iter().map(|s| s.to_string()));
    a
}

/// A free port on 127.0.0.1 (bound and released).
fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("free port")
}

fn map_epoch(primary: &str) -> u64 {
    let out = std::process::Command::new(bin())
        .args(["status", "--primary", primary])
        .output()
        .expect("status");
    let text = String::from_utf8_lossy(&out.stdout);
    text.split("map epoch ")
        .nth(1)
        .and_then(|r| r.split_whitespace().next())
        .and_then(|e| e.parse().ok())
        .unwrap_or_else(|| panic!("no epoch in {text}"))
}

#[test]
fn a_rollout_upgrades_lanes_one_at_a_time_under_load_and_stops_on_a_failed_canary() {
    let root = std::env::temp_dir().join(format!("moelane-rollout-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&root);
    std::fs::create_dir_all(&root).expect("dir");
    let model = tiny().to_str().unwrap().to_string();
    // two lanes on fixed ports (a lane is named by its URL), each persisting its map
    let mut lanes = Vec::new();
    for i in 0..2 {
        let state = root.join(format!("lane{i}"));
        std::fs::create_dir_all(&state).expect("state");
        // lane 0's map file does not exist yet: it serves the checkpoint's map and its first
        // committed swap writes the file
        if i == 1 {
            std::fs::copy(tiny().join("rowmap.json"), state.join("rowmap.json")).expect("map");
        }
        lanes.push((format!("127.0.0.1:{}", free_port()), state));
    }
    // the restart script: SIGTERM the lane's primary (it drains), wait for it, start the
    // "new build" on the same address with the same map file
    let script = root.join("restart.sh");
    let mut case = String::new();
    for (addr, state) in &lanes {
        case.push_str(&format!(
            "  http://{addr}) ADDR={addr}; STATE={} ;;\n",
            state.display()
        ));
    }
    std::fs::write(
        &script,
        format!(
            "#!/bin/sh\nset -e\ncase \"$MOELANE_LANE\" in\n{case}  *) echo \"unknown lane $MOELANE_LANE\"; exit 2 ;;\nesac\n\
             if [ -f \"$STATE/pid\" ]; then PID=$(cat \"$STATE/pid\"); kill -TERM \"$PID\" 2>/dev/null || true;\n\
               while kill -0 \"$PID\" 2>/dev/null; do sleep 0.05; done; fi\n\
             MOELANE_STEP_PACE_MS=2 {bin} lane --role primary --model {model} --listen \"$ADDR\" --map \"$STATE/rowmap.json\" >>\"$STATE/log\" 2>&1 &\n\
             echo $! > \"$STATE/pid\"\n",
            bin = bin()
        ),
    )
    .expect("script");
    let _pids = Pidfiles(lanes.iter().map(|(_, s)| s.join("pid")).collect());
    let run_script = |lane: &str| {
        let st = std::process::Command::new("sh")
            .arg(&script)
            .env("MOELANE_LANE", lane)
            .status()
            .expect("script");
        assert!(st.success());
    };
    let urls: Vec<String> = lanes.iter().map(|(a, _)| format!("http://{a}")).collect();
    for u in &urls {
        run_script(u);
    }
    // each lane listening before the gateway asks (a lane not yet checked counts as up)
    for (_, state) in &lanes {
        until(Duration::from_secs(60), "the lane listening", || {
            std::fs::read_to_string(state.join("log")).is_ok_and(|l| l.contains("primary grpc"))
        });
    }
    let (v, (_g, gw)) = gateway_with(
        &[&urls[0], &urls[1]],
        &["--health-interval", "0.2"],
        &["gateway admin "],
    );
    let gw_admin = hostport(&v[0]);
    until(Duration::from_secs(60), "both lanes up", || {
        urls.iter().all(|u| lane_state(&gw, u) == "up")
    });
    let (st, reference, _) = whole(&gw, 16);
    assert_eq!(st, 200);
    // a committed swap on lane 0: the upgraded lane must come back on it
    assert!(!lanes[0].1.join("rowmap.json").exists());
    let map: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("rowmap.json")).expect("map"))
            .expect("json");
    let cold = map["layers"][0]["cold"][0].as_u64().expect("a cold expert");
    let hot = map["layers"][0]["hot"][0].as_u64().expect("a hot expert");
    let out = std::process::Command::new(bin())
        .args([
            "swap",
            "--primary",
            &urls[0],
            "--move",
            &format!("0:{cold}:hot"),
            "--move",
            &format!("0:{hot}:cold"),
        ])
        .output()
        .expect("swap");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let epoch = map_epoch(&urls[0]);
    assert!(epoch > 0);
    assert!(
        lanes[0].1.join("rowmap.json").exists(),
        "the commit wrote the map file"
    );
    // steady load while the rollout runs
    let stop = Arc::new(AtomicBool::new(false));
    let clients = steady_load(&gw, &reference, 16, &stop);
    std::thread::sleep(Duration::from_millis(300));
    let t0 = Instant::now();
    let out = std::process::Command::new(bin())
        .args([
            "rollout",
            "--admin",
            &format!("http://{gw_admin}"),
            "--restart",
            &format!("sh {}", script.display()),
            "--ready-timeout",
            "60",
        ])
        .output()
        .expect("rollout");
    let took = t0.elapsed();
    std::thread::sleep(Duration::from_millis(300));
    let (total, bad) = stop_load(&stop, clients);
    let log = String::from_utf8_lossy(&out.stdout).to_string();
    println!(
        "{log}rolling upgrade of 2 lanes under load: {total} requests, {} failed, {:.1} s",
        bad.len(),
        took.as_secs_f64()
    );
    assert!(
        out.status.success(),
        "{log}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(log.contains("2 lane(s) upgraded"), "{log}");
    assert!(bad.is_empty(), "failed or different: {bad:?}");
    assert_eq!(map_epoch(&urls[0]), epoch, "the committed map carried over");
    assert_eq!(whole(&gw, 16).1, reference, "greedy output unchanged");
    // a restart that brings nothing back fails the canary's wait: the rollout stops and the
    // rollback (the good script) puts the lane back, undrained
    let out = std::process::Command::new(bin())
        .args([
            "rollout",
            "--admin",
            &format!("http://{gw_admin}"),
            "--lane",
            &urls[1],
            "--restart",
            "true",
            "--rollback",
            &format!("sh {}", script.display()),
            "--ready-timeout",
            "2",
        ])
        .output()
        .expect("rollout");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(err.contains("rolled back"), "{err}");
    until(Duration::from_secs(10), "lane 1 serves again", || {
        lane_state(&gw, &urls[1]) == "up"
    });
}

#[test]
fn a_primary_started_before_its_sidecar_waits_for_it() {
    let dir = tiny().to_str().unwrap().to_string();
    let (sport, pport) = (free_port(), free_port());
    let side_url = format!("http://127.0.0.1:{sport}");
    let (_p, _) = start(
        &[
            "lane",
            "--role",
            "primary",
            "--model",
            &dir,
            "--listen",
            &format!("127.0.0.1:{pport}"),
            "--sidecar",
            &side_url,
            "--link",
            "tcp",
        ],
        &["waiting for the sidecar"],
    );
    std::thread::sleep(Duration::from_millis(700));
    let (_s, _) = start(
        &[
            "lane",
            "--role",
            "sidecar",
            "--model",
            &dir,
            "--listen",
            &format!("127.0.0.1:{sport}"),
            "--data",
            "127.0.0.1:0",
        ],
        &["sidecar control "],
    );
    let purl = format!("http://127.0.0.1:{pport}");
    let (_g, gw) = gateway(&[&purl], &["--health-interval", "0.2"]);
    until(Duration::from_secs(30), "the lane serves", || {
        whole(&gw, 4).0 == 200
    });
}

/// Why the gateway's first lane serves degraded ("": it does not).
fn degraded(gw: &str) -> String {
    let (_, v) = get(gw, "/v1/stats");
    v["lanes"][0]["degraded"]
        .as_str()
        .unwrap_or_default()
        .to_string()
}

#[test]
fn with_degraded_a_lost_sidecar_costs_no_request_and_changes_no_output() {
    let (sport, dport) = (free_port(), free_port());
    let side_args = sidecar_args(sport, &["--data", &format!("127.0.0.1:{dport}")]);
    let side_args: Vec<&str> = side_args.iter().map(|s| s.as_str()).collect();
    let (mut side, _) = start(&side_args, &["sidecar control "]);
    let pace = [("MOELANE_STEP_PACE_MS", "3")];
    let (prim, purl) = primary(
        &[
            "--sidecar",
            &format!("http://127.0.0.1:{sport}"),
            "--link",
            "tcp",
            "--degraded",
            // a few experts' worth: the cold experts are read, dropped and read again
            "--degraded-memory",
            "64KiB",
            "--metrics-listen",
            "127.0.0.1:0",
        ],
        &pace,
    );
    let (_g, gw) = gateway(&[&purl], &["--health-interval", "0.2"]);
    let (st, reference, fin) = whole(&gw, 24);
    assert_eq!(st, 200);
    assert_eq!(degraded(&gw), "");
    let stop = Arc::new(AtomicBool::new(false));
    let clients = steady_load(&gw, &reference, 24, &stop);
    std::thread::sleep(Duration::from_millis(500));
    signal(&side, "KILL");
    let _ = wait_exit(&mut side, Duration::from_secs(5));
    let lost = Instant::now();
    until(Duration::from_secs(5), "the lane says degraded", || {
        !degraded(&gw).is_empty()
    });
    let said = lost.elapsed();
    std::thread::sleep(Duration::from_millis(800));
    assert_eq!(ready(&gw), 200, "a degraded lane still serves");
    // read on demand within the budget: loads, evictions, and never more than the budget
    // beyond one layer request's own experts (tiny: 12 KiB each, 16 cold per layer)
    let page = request(&metrics_addr(&prim), "GET", "/metrics", b"").body;
    let value = |name: &str| -> f64 {
        page.lines()
            .find_map(|l| l.strip_prefix(name).and_then(|r| r.trim().parse().ok()))
            .unwrap_or(-1.0)
    };
    let (loads, evictions, held) = (
        value("moelane_degraded_expert_loads_total"),
        value("moelane_degraded_expert_evictions_total"),
        value("moelane_degraded_resident_bytes"),
    );
    assert!(
        loads > 0.0 && evictions > 0.0,
        "{loads} loads, {evictions} evictions"
    );
    assert!(
        held > 0.0 && held <= (16 * 12 * 1024) as f64,
        "{held} bytes held"
    );
    let (_side2, _) = start(&side_args, &["sidecar control "]);
    let back = Instant::now();
    until(
        Duration::from_secs(20),
        "the lane is no longer degraded",
        || degraded(&gw).is_empty(),
    );
    let back = back.elapsed();
    std::thread::sleep(Duration::from_millis(500));
    let (total, bad) = stop_load(&stop, clients);
    println!(
        "degraded mode: {total} requests, {} failed or different; degraded {:.2} s after the kill, \
         back {:.2} s after the restart; {loads} experts read on demand, {evictions} dropped, \
         {held} bytes held",
        bad.len(),
        said.as_secs_f64(),
        back.as_secs_f64()
    );
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(whole(&gw, 24), (200, reference, fin));
}

#[test]
fn with_degraded_a_stalled_sidecar_of_an_idle_lane_clears_when_it_answers_again() {
    // no request runs while the sidecar is stopped and after: only its heartbeats can say
    // it is back (an idle lane left degraded would stay so, and get no traffic)
    let (sport, dport) = (free_port(), free_port());
    let side_args = sidecar_args(sport, &["--data", &format!("127.0.0.1:{dport}")]);
    let side_args: Vec<&str> = side_args.iter().map(|s| s.as_str()).collect();
    let (side, _) = start(&side_args, &["sidecar control "]);
    let (_prim, purl) = primary(
        &[
            "--sidecar",
            &format!("http://127.0.0.1:{sport}"),
            "--link",
            "tcp",
            "--degraded",
        ],
        &[],
    );
    let (_g, gw) = gateway(&[&purl], &["--health-interval", "0.2"]);
    until(Duration::from_secs(10), "the lane is up", || {
        ready(&gw) == 200
    });
    signal(&side, "STOP");
    until(Duration::from_secs(10), "the lane says degraded", || {
        !degraded(&gw).is_empty()
    });
    signal(&side, "CONT");
    let back = until(
        Duration::from_secs(5),
        "the lane is no longer degraded",
        || degraded(&gw).is_empty(),
    );
    println!("degraded cleared {back:?} after the sidecar was continued");
    assert_eq!(whole(&gw, 4).0, 200);
}

#[test]
fn a_lane_of_another_checkpoint_is_down_naming_both() {
    // a lane serving another checkpoint (seed 2: another config, another vocabulary) beside
    // one serving the gateway's own: the first is down, saying why, and takes no request
    let other = tempfile::tempdir().expect("tempdir");
    let out = std::process::Command::new(bin())
        .args(["gen", "--preset", "tiny", "--seed", "2", "--out"])
        .arg(other.path())
        .output()
        .expect("gen");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let (_o, other_url, other_gw) = serve_lane(other.path(), &[]);
    let (_p, purl) = primary(&[], &[]);
    let (_g, gw) = gateway(&[&other_url, &purl], &["--health-interval", "0.2"]);
    let lane = |url: &str| {
        let (_, v) = get(&gw, "/v1/stats");
        v["lanes"]
            .as_array()
            .and_then(|l| l.iter().find(|x| x["lane"] == url).cloned())
            .unwrap_or_default()
    };
    until(
        Duration::from_secs(10),
        "the gateway's own lane is up",
        || lane(&purl)["state"] == "up",
    );
    let o = lane(&other_url);
    assert_eq!(o["state"], "down", "{o}");
    let why = o["down_reason"].as_str().unwrap_or_default();
    assert!(
        why.contains("serves checkpoint") && why.matches("qwen3_moe-").count() == 2,
        "{why}"
    );
    for _ in 0..4 {
        assert_eq!(whole(&gw, 4).0, 200);
    }
    // the other lane's own gateway (serve) sees none of them
    let (_, v) = get(&other_gw, "/v1/stats");
    let finished = &v["lanes"][0]["stats"]["requests_finished"];
    assert_eq!(finished, 0, "{v}");
}

#[test]
fn a_stop_while_the_primary_waits_for_its_sidecar_exits_0() {
    // nothing listens at the sidecar's address: the primary waits (up to a minute)
    let url = format!("http://127.0.0.1:{}", free_port());
    let dir = tiny().to_str().unwrap().to_string();
    let (mut p, _) = start(
        &[
            "lane",
            "--role",
            "primary",
            "--model",
            &dir,
            "--listen",
            "127.0.0.1:0",
            "--sidecar",
            &url,
            "--link",
            "tcp",
            "--sidecar-wait",
            "60",
        ],
        &["moelane: waiting for the sidecar"],
    );
    signal(&p, "TERM");
    assert_eq!(
        wait_exit(&mut p, Duration::from_secs(10)),
        Some(0),
        "a SIGTERM while starting is a stop"
    );
}

#[test]
fn a_cluster_token_keeps_the_grpc_surfaces_to_the_deployment() {
    const TOKEN: &str = "cluster-token-0123456789abcdef";
    let token = [("MOELANE_CLUSTER_TOKEN", TOKEN)];
    let (sport, dport) = (free_port(), free_port());
    let side_args = sidecar_args(sport, &["--data", &format!("127.0.0.1:{dport}")]);
    let side_args: Vec<&str> = side_args.iter().map(|s| s.as_str()).collect();
    let (_side, _) = start_env(&side_args, &["sidecar control "], &token);
    let sidecar = format!("http://127.0.0.1:{sport}");
    // every process of the deployment holds the token: the lane serves through a gateway,
    // its activations over the TCP link (which opens with the token)
    let (_p, purl) = primary(&["--sidecar", &sidecar, "--link", "tcp"], &token);
    let args = gateway_args(&[&purl], &["--health-interval", "0.2"]);
    let args: Vec<&str> = args.iter().map(|s| s.as_str()).collect();
    let (_g, v) = start_env(&args, &["gateway listening on "], &token);
    let gw = hostport(&v[0]);
    until(Duration::from_secs(20), "the lane serves", || {
        whole(&gw, 4).0 == 200
    });
    // a gateway without it: the lane's Health is refused, so the lane is down and nothing
    // reaches it
    let (_g2, gw2) = gateway(&[&purl], &["--health-interval", "0.2"]);
    until(Duration::from_secs(10), "the lane is down for it", || {
        let (_, v) = get(&gw2, "/v1/stats");
        v["lanes"][0]["state"] == "down"
            && v["lanes"][0]["down_reason"]
                .as_str()
                .is_some_and(|r| r.contains("cluster token"))
    });
    assert_eq!(whole(&gw2, 4).0, 503);
    // the CLI: refused without it, served with it
    let status = |env: &[(&str, &str)]| {
        std::process::Command::new(bin())
            .args(["status", "--primary", &purl])
            .env_remove("MOELANE_CLUSTER_TOKEN")
            .envs(env.iter().copied())
            .output()
            .expect("status")
    };
    let out = status(&[]);
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cluster token"), "{err}");
    let out = status(&token);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    // a primary without it cannot register with the sidecar: it says why and exits
    let dir2 = tiny().to_str().unwrap().to_string();
    let out = std::process::Command::new(bin())
        .args([
            "lane",
            "--role",
            "primary",
            "--model",
            &dir2,
            "--listen",
            "127.0.0.1:0",
            "--sidecar",
            &sidecar,
            "--link",
            "shm",
            "--sidecar-wait",
            "2",
        ])
        .output()
        .expect("primary");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("cluster token"), "{err}");
    // the standard health service stays open for probes
    assert_eq!(grpc_health(&purl), 1);
    // the data port closes a connection that does not open with the token, unanswered
    {
        use std::io::{Read, Write};
        let mut c = std::net::TcpStream::connect(("127.0.0.1", dport)).unwrap();
        c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
        c.write_all(&3u32.to_le_bytes()).unwrap();
        c.write_all(&[1, 2, 3]).unwrap();
        let mut b = [0u8; 8];
        assert!(
            matches!(c.read(&mut b), Ok(0) | Err(_)),
            "answered without a token"
        );
    }
    // a token file shorter than a secret is refused at start, naming the line
    let bad = std::env::temp_dir().join(format!("moelane-short-token-{}", std::process::id()));
    std::fs::write(&bad, "# ops\nshort\n").unwrap();
    let out = std::process::Command::new(bin())
        .args(["status", "--primary", &purl, "--cluster-token-file"])
        .arg(&bad)
        .output()
        .expect("status");
    let _ = std::fs::remove_file(&bad);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("line 2"), "{err}");
}

/// `moelane serve` on tiny with API keys `keys` and `extra` flags, each step paced to 20
/// ms: the process, the gateway's host:port, and the directory holding the keys' file.
fn serve_keyed(keys: &[&str], extra: &[&str]) -> (Proc, String, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("tempdir");
    let file = dir.path().join("keys");
    std::fs::write(&file, keys.join("\n")).expect("keys");
    let model = tiny().to_str().unwrap().to_string();
    let mut args = vec![
        "serve",
        "--model",
        &model,
        "--listen",
        "127.0.0.1:0",
        "--api-key-file",
    ];
    args.push(file.to_str().unwrap());
    args.extend_from_slice(extra);
    let (p, v) = start_env(
        &args,
        &["gateway listening on "],
        &[("MOELANE_STEP_PACE_MS", "20")],
    );
    (p, hostport(&v[0]), dir)
}

/// A streamed greedy completion of `max_tokens` that never meets the end of sequence (its
/// logit biased away): it runs them all, with usage in the stream.
fn long_answer(max_tokens: usize) -> serde_json::Value {
    let config: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(tiny().join("config.json")).expect("config"))
            .expect("config json");
    let eos = config["eos_token_id"].as_u64().expect("eos id");
    json!({"model": "tiny", "prompt": "The lane keeps serving", "max_tokens": max_tokens,
           "temperature": 0, "stream": true, "stream_options": {"include_usage": true},
           "logit_bias": {eos.to_string(): -100}})
}

/// One POST presenting `key`; the whole raw response (head and body).
fn raw_post_as(addr: &str, path: &str, body: &serde_json::Value, key: &str) -> String {
    use std::io::{Read, Write};
    let mut s = std::net::TcpStream::connect(addr).expect("connect");
    s.set_read_timeout(Some(Duration::from_secs(30))).ok();
    let body = body.to_string();
    let head = format!(
        "POST {path} HTTP/1.1\r\nHost: {addr}\r\nAuthorization: Bearer {key}\r\n\
         Content-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    s.write_all(head.as_bytes()).expect("write");
    s.write_all(body.as_bytes()).expect("write");
    let mut raw = String::new();
    let _ = s.read_to_string(&mut raw);
    raw
}

#[test]
fn clients_share_a_full_lane_and_a_client_past_its_bound_gets_a_429() {
    // a lane of two places, paced: client a (one API key) keeps four long answers going (its
    // bound); client b (another key) asks for a short one, which must get a place at once
    // and finish while all of a's still run; a's fifth is a 429 with Retry-After
    let (ka, kb) = ("client-a-key-0123456789", "client-b-key-0123456789");
    let (_p, gw, _dir) = serve_keyed(
        &[ka, kb],
        &["--max-running", "2", "--max-client-requests", "4"],
    );
    // a's answers run their 150 tokens (3 s at the pace)
    let long = long_answer(150);
    let ended = Arc::new(AtomicUsize::new(0));
    let a: Vec<_> = (0..4)
        .map(|_| {
            let (gw, long, ended) = (gw.clone(), long.clone(), ended.clone());
            std::thread::spawn(move || {
                let mut s = Sse::open_with(
                    &gw,
                    "/v1/completions",
                    &long,
                    &format!("Authorization: Bearer {ka}\r\n"),
                )
                .expect("open");
                assert_eq!(s.status, 200);
                let mut tokens = 0;
                let mut finish = None;
                while let Some(d) = s.next_data() {
                    if d == "[DONE]" {
                        break;
                    }
                    let v: serde_json::Value = serde_json::from_str(&d).expect("chunk");
                    assert!(v.get("error").is_none(), "a's stream was cut: {v}");
                    if let Some(n) = v["usage"]["completion_tokens"].as_u64() {
                        tokens = n;
                    }
                    if let Some(f) = v["choices"][0]["finish_reason"].as_str() {
                        finish = Some(f.to_string());
                    }
                }
                ended.fetch_add(1, Ordering::SeqCst);
                (tokens, finish)
            })
        })
        .collect();
    // a holds its four: two running, two waiting
    until(
        Duration::from_secs(20),
        "a's four answers under way",
        || {
            let (_, v) = get_as(&gw, "/v1/stats", ka);
            let load = &v["lanes"][0]["stats"];
            load["running"].as_u64() == Some(2) && load["waiting"].as_u64() == Some(2)
        },
    );
    let fifth = raw_post_as(&gw, "/v1/completions", &long, ka);
    let head = fifth
        .split("\r\n\r\n")
        .next()
        .unwrap_or_default()
        .to_lowercase();
    assert!(head.starts_with("http/1.1 429"), "{fifth}");
    assert!(head.contains("retry-after: 1"), "{fifth}");
    assert!(fifth.contains("rate_limit_exceeded"), "{fifth}");
    let t = Instant::now();
    let (st, v) = post_as(
        &gw,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "b asks", "max_tokens": 8, "temperature": 0}),
        kb,
    );
    let b_took = t.elapsed();
    assert_eq!(st, 200, "{v}");
    assert_eq!(
        ended.load(Ordering::SeqCst),
        0,
        "b waited for one of a's answers to end ({b_took:?})"
    );
    println!("client b's answer took {b_took:?} while client a held the lane");
    for h in a {
        let (tokens, finish) = h.join().expect("a's stream");
        assert_eq!((tokens, finish.as_deref()), (150, Some("length")));
    }
    let (_, page) = get_text_as(&gw, "/metrics", ka);
    assert!(
        page.lines()
            .any(|l| l.starts_with("moelane_fair_share_actions_total{action=\"over_batch\"}")),
        "the fair share's preemption is counted"
    );
}

/// GET `path` presenting `key`: status and JSON body.
fn get_as(addr: &str, path: &str, key: &str) -> (u16, serde_json::Value) {
    let (st, body) = get_text_as(addr, path, key);
    (st, serde_json::from_str(&body).unwrap_or_default())
}

/// GET `path` presenting `key`: status and body text.
fn get_text_as(addr: &str, path: &str, key: &str) -> (u16, String) {
    let r = request_with(
        addr,
        "GET",
        path,
        b"",
        &format!("Authorization: Bearer {key}\r\n"),
    );
    (r.status, r.body)
}

#[test]
fn a_stream_cut_mid_answer_is_counted_as_cut_on_the_anthropic_route_too() {
    // the 200 went out with the stream's head: the cut is counted apart, by its reason
    let pace = [("MOELANE_STEP_PACE_MS", "50")];
    let (p, url) = primary(&[], &pace);
    let (_gw, gw) = gateway(&[&url], &[]);
    let body = json!({"model": "tiny", "max_tokens": 200, "stream": true,
                      "messages": [{"role": "user", "content": "The lane keeps serving"}]});
    let mut s = Sse::open(&gw, "/v1/messages", &body).expect("open");
    assert_eq!(s.status, 200);
    let (mut events, mut error, mut stopped) = (0, None, false);
    while let Some(d) = s.next_data() {
        events += 1;
        if events == 1 {
            signal(&p, "KILL");
        }
        let v: serde_json::Value = serde_json::from_str(&d).unwrap_or_default();
        match v["type"].as_str() {
            Some("error") => error = Some(v),
            Some("message_stop") => stopped = true,
            _ => {}
        }
    }
    let error = error.expect("the cut stream ends with an error event");
    assert!(!stopped, "a cut answer has no message_stop: {error}");
    let page = request(&gw, "GET", "/metrics", b"").body;
    let cut = page
        .lines()
        .find(|l| l.starts_with("moelane_streams_cut_total{reason=\"unavailable\"}"))
        .unwrap_or_else(|| panic!("no cut counted: {page}"));
    assert!(cut.ends_with(" 1"), "{cut}");
}

#[test]
fn a_stream_queued_past_the_head_start_is_answered_alive_then_whole_or_with_an_error_event() {
    // one place on the lane, a long answer in it (400 tokens at 20 ms a step: 8 s); a second
    // stream waits for the place past the gateway's 5 s head start
    let model = tiny().to_str().unwrap().to_string();
    for stop in [false, true] {
        let mut args = vec!["serve", "--model", &model, "--listen", "127.0.0.1:0"];
        args.extend_from_slice(&["--max-running", "1", "--grace", "1"]);
        let (p, v) = start_env(
            &args,
            &["gateway listening on "],
            &[("MOELANE_STEP_PACE_MS", "20")],
        );
        let gw = hostport(&v[0]);
        let mut first = Sse::open(&gw, "/v1/completions", &long_answer(400)).expect("open");
        assert!(first.next_data().is_some());
        let t = Instant::now();
        let chat = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 3, "stream": true});
        let msgs = json!({"model": "tiny", "messages": [{"role": "user", "content": "hi"}],
                          "max_tokens": 3, "stream": true});
        let resp = json!({"model": "tiny", "input": "hi", "max_output_tokens": 3, "stream": true});
        let opened: Vec<(&str, std::thread::JoinHandle<(Duration, Sse)>)> = [
            ("/v1/chat/completions", chat),
            ("/v1/messages", msgs),
            ("/v1/responses", resp),
        ]
        .into_iter()
        .map(|(path, body)| {
            let gw = gw.clone();
            (
                path,
                std::thread::spawn(move || {
                    let s = Sse::open(&gw, path, &body).expect("open");
                    (t.elapsed(), s)
                }),
            )
        })
        .collect();
        let mut streams = Vec::new();
        for (path, h) in opened {
            let (head_at, mut s) = h.join().expect("opened");
            // the head comes at the head start, long before the place frees (8 s)
            assert_eq!(s.status, 200, "{path}");
            assert!(
                head_at >= Duration::from_secs(4) && head_at < Duration::from_secs(7),
                "{path}: the head came after {head_at:?}"
            );
            let comment = s.next_raw().expect("a first event");
            assert!(
                comment.starts_with(": waiting for a place"),
                "{path}: {comment}"
            );
            streams.push((path, s));
        }
        if stop {
            // the gateway stops (1 s of grace): the waiting ones end with their API's error
            signal(&p, "TERM");
            for (path, mut s) in streams {
                let rest: Vec<String> = std::iter::from_fn(|| s.next_raw()).collect();
                let error = rest.iter().any(|ev| match path {
                    // chat: an error object as data, as OpenAI sends one mid-stream
                    "/v1/chat/completions" => ev.strip_prefix("data: ").is_some_and(|d| {
                        serde_json::from_str::<serde_json::Value>(d)
                            .is_ok_and(|v| v["error"]["message"].is_string())
                    }),
                    // Anthropic's and the Responses API's `error` event
                    _ => ev.starts_with("event: error\n"),
                });
                let rest = rest.join("\n\n");
                assert!(error, "{path}: {rest}");
                assert!(
                    !rest.contains("message_stop") && !rest.contains("response.completed"),
                    "{path}: {rest}"
                );
            }
        } else {
            // a client that leaves while its stream waits (past the head start) is taken
            // off the lane's queue at once
            let waiting = || {
                let (_, v) = get(&gw, "/v1/stats");
                v["lanes"][0]["stats"]["waiting"].as_u64().unwrap_or(0)
            };
            let before = waiting();
            let (last, s) = streams.pop().expect("a stream");
            drop(s);
            until(
                Duration::from_secs(3),
                "the queue lost the client that left",
                || waiting() < before,
            );
            let _ = last;
            for (path, mut s) in streams {
                let rest: Vec<String> = std::iter::from_fn(|| s.next_raw()).collect();
                let rest = rest.join("\n\n");
                let whole = match path {
                    "/v1/chat/completions" => {
                        rest.contains("\"finish_reason\":\"") && rest.ends_with("data: [DONE]")
                    }
                    "/v1/messages" => rest.contains("message_stop"),
                    _ => {
                        rest.contains("response.incomplete") || rest.contains("response.completed")
                    }
                };
                assert!(whole, "{path}: {rest}");
            }
            while first.next_data().is_some() {}
        }
        drop(p);
    }
}

#[test]
fn a_client_that_leaves_while_queued_frees_its_places_at_once() {
    // one place on the lane, a's long answer in it; a's second request waits in the queue,
    // then a leaves it: the lane's queue empties and a's bound of two counts it no longer
    let ka = "client-a-key-0123456789";
    let (_p, gw, _dir) = serve_keyed(&[ka], &["--max-running", "1", "--max-client-requests", "2"]);
    // 400 tokens at the pace: 8 s, past the waits below
    let long = long_answer(400);
    let mut first = Sse::open_with(
        &gw,
        "/v1/completions",
        &long,
        &format!("Authorization: Bearer {ka}\r\n"),
    )
    .expect("open");
    assert_eq!(first.status, 200);
    assert!(first.next_data().is_some());
    let waiting = || {
        let (_, v) = get_as(&gw, "/v1/stats", ka);
        v["lanes"][0]["stats"]["waiting"].as_u64()
    };
    let queued = std::thread::spawn({
        let (gw, long) = (gw.clone(), long.clone());
        move || {
            use std::io::Write;
            let mut s = std::net::TcpStream::connect(&gw).expect("connect");
            let body = long.to_string();
            let head = format!(
                "POST /v1/completions HTTP/1.1\r\nHost: {gw}\r\nAuthorization: Bearer {ka}\r\n\
                 Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                body.len()
            );
            s.write_all(head.as_bytes()).expect("write");
            s.write_all(body.as_bytes()).expect("write");
            s
        }
    })
    .join()
    .expect("queued");
    until(Duration::from_secs(10), "a's second request queued", || {
        waiting() == Some(1)
    });
    drop(queued);
    let left = until(Duration::from_secs(3), "the queue emptied", || {
        waiting() == Some(0)
    });
    println!("the lane's queue emptied {left:?} after the client left");
    // a's bound counts its one answer running: a second is taken (it waits for the place)
    let t = Instant::now();
    let (st, v) = post_as(
        &gw,
        "/v1/completions",
        &json!({"model": "tiny", "prompt": "again", "max_tokens": 2, "temperature": 0}),
        ka,
    );
    assert_eq!(st, 200, "{v} after {:?}", t.elapsed());
    while first.next_data().is_some() {}
}
