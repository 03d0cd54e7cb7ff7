//! Never half-moved: a two-process lane (sidecar process + primary process over shared memory)
//! driven through swaps with faults injected at named points (`MOELANE_FAILPOINTS`): slow and
//! failed loads, lost and duplicated control messages, and a crash of each party between each
//! pair of phases (the crashed process exits as a kill would leave it and is started again).
//! Every case must end with both tiers on one committed epoch, nothing staged, the persisted
//! map on that epoch, greedy outputs equal to those before the fault, and a further swap
//! committing.

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use common::*;
use moelane_engine::rowmap::Rowmap;
use moelane_proto::control::sidecar_client::SidecarClient;
use moelane_proto::control::{SidecarHealthRequest, SidecarStatsRequest};
use moelane_proto::lane::primary_client::PrimaryClient;
use moelane_proto::lane::{GenerateRequest, Move, StatsRequest, SwapReply, SwapRequest};

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap()
}

struct Lane {
    dir: PathBuf,
    side: Option<Proc>,
    prim: Option<Proc>,
    side_listen: String,
    prim_url: String,
    prim_args: Vec<String>,
}

impl Lane {
    fn primary_map(&self) -> PathBuf {
        self.dir.join("primary-map.json")
    }
    fn sidecar_map(&self) -> PathBuf {
        self.dir.join("sidecar-map.json")
    }

    fn new(name: &str, side_env: &str, prim_env: &str, prim_extra: &[&str]) -> Lane {
        let dir =
            std::env::temp_dir().join(format!("moelane-faults-{}-{name}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        // each tier has its own copy of the starting map, as on two hosts
        let m0 = tiny().join("rowmap.json");
        std::fs::copy(&m0, dir.join("primary-map.json")).unwrap();
        std::fs::copy(&m0, dir.join("sidecar-map.json")).unwrap();
        let mut lane = Lane {
            dir,
            side: None,
            prim: None,
            side_listen: "127.0.0.1:0".into(),
            prim_url: String::new(),
            prim_args: prim_extra.iter().map(|s| s.to_string()).collect(),
        };
        lane.start_sidecar(side_env);
        lane.start_primary(prim_env);
        lane
    }

    fn start_sidecar(&mut self, env: &str) {
        let (m, model) = (
            self.sidecar_map().display().to_string(),
            tiny().display().to_string(),
        );
        let (p, v) = start_env(
            &[
                "lane",
                "--role",
                "sidecar",
                "--model",
                &model,
                "--map",
                &m,
                "--listen",
                &self.side_listen,
            ],
            &["sidecar control "],
            &[("MOELANE_FAILPOINTS", env)],
        );
        // a restarted sidecar comes back on the same address
        self.side_listen = hostport(&v[0]);
        self.side = Some(p);
    }

    fn start_primary(&mut self, env: &str) {
        let (m, model, side) = (
            self.primary_map().display().to_string(),
            tiny().display().to_string(),
            format!("http://{}", self.side_listen),
        );
        let mut args = vec![
            "lane",
            "--role",
            "primary",
            "--model",
            &model,
            "--map",
            &m,
            "--listen",
            "127.0.0.1:0",
            "--sidecar",
            &side,
            "--link",
            "shm",
        ];
        args.extend(self.prim_args.iter().map(String::as_str));
        let (p, v) = start_env(&args, &["primary grpc "], &[("MOELANE_FAILPOINTS", env)]);
        self.prim_url = v[0].split(',').next().unwrap_or_default().to_string();
        self.prim = Some(p);
    }

    fn side_url(&self) -> String {
        format!("http://{}", self.side_listen)
    }

    /// Waits for a process that a failpoint crashed; checks it exited with the crash status.
    fn reap(p: &mut Option<Proc>, who: &str) {
        let mut p = p.take().unwrap_or_else(|| panic!("{who} not running"));
        let deadline = Instant::now() + Duration::from_secs(20);
        loop {
            if let Some(st) = p.child.try_wait().unwrap() {
                assert_eq!(
                    st.code(),
                    Some(86),
                    "{who} exited with {st:?}, not the failpoint crash"
                );
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{who} did not crash at its failpoint"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// One hot->cold and one cold->hot move in `layer`, from the primary's persisted map.
    fn swap(&self, layer: usize) -> Result<SwapReply, String> {
        let map = Rowmap::read(&self.primary_map()).unwrap();
        let layer = layer % map.layers.len();
        let lm = &map.layers[layer];
        let (h, c) = (lm.hot[0], lm.cold[0]);
        let url = self.prim_url.clone();
        rt().block_on(async move {
            let mut cl = PrimaryClient::connect(url)
                .await
                .map_err(|e| e.to_string())?;
            cl.swap(SwapRequest {
                moves: vec![
                    Move {
                        layer: layer as u32,
                        expert: h as u32,
                        to_hot: false,
                    },
                    Move {
                        layer: layer as u32,
                        expert: c as u32,
                        to_hot: true,
                    },
                ],
            })
            .await
            .map(|r| r.into_inner())
            .map_err(|s| s.message().to_string())
        })
    }

    fn committed(&self, layer: usize) -> u64 {
        let r = self.swap(layer).expect("swap rpc");
        assert!(r.committed, "swap aborted: {}", r.abort_reason);
        r.map_epoch
    }

    fn aborted(&self, layer: usize) -> String {
        let r = self.swap(layer).expect("swap rpc");
        assert!(!r.committed, "swap committed, an abort was expected");
        r.abort_reason
    }

    /// Greedy token ids for a few prompts of three languages.
    fn outputs(&self) -> Vec<Vec<u32>> {
        let tok = moelane_engine::tokenizer::Tokenizer::from_file(&tiny().join("tokenizer.json"))
            .unwrap();
        let prompts: Vec<Vec<u32>> = [0usize, 2, 3]
            .iter()
            .map(|&l| {
                let p = &moelane_engine::synth::prompts(l)[1];
                tok.encode(&p.chars().take(40).collect::<String>()).unwrap()
            })
            .collect();
        let url = self.prim_url.clone();
        rt().block_on(async move {
            let mut out = Vec::new();
            let mut cl = PrimaryClient::connect(url).await.unwrap();
            for (i, p) in prompts.into_iter().enumerate() {
                let mut s = cl
                    .generate(GenerateRequest {
                        request_id: format!("f{i}"),
                        prompt: p,
                        max_tokens: 24,
                        top_p: 1.0,
                        ignore_eos: true,
                        ..Default::default()
                    })
                    .await
                    .expect("generate")
                    .into_inner();
                let mut ids = Vec::new();
                while let Some(ev) = s.message().await.expect("generate stream") {
                    ids.extend(ev.token);
                }
                out.push(ids);
            }
            out
        })
    }

    /// (primary epoch, sidecar epoch, sidecar staged epoch, sidecar's coordinator incarnation)
    fn epochs(&self) -> Option<(u64, u64, Option<u64>, u64)> {
        let (pu, su) = (self.prim_url.clone(), self.side_url());
        rt().block_on(async move {
            let mut p = PrimaryClient::connect(pu).await.ok()?;
            let pe = p.stats(StatsRequest {}).await.ok()?.into_inner().map_epoch;
            let mut s = SidecarClient::connect(su).await.ok()?;
            let h = s
                .health(SidecarHealthRequest::default())
                .await
                .ok()?
                .into_inner();
            Some((
                pe,
                h.map_epoch,
                h.staged.then_some(h.staged_epoch),
                h.incarnation,
            ))
        })
    }

    /// Waits until the sidecar has answered at least this many (PREPARE, RELEASE, ABORT)
    /// messages, late and duplicated copies included: the condition that a message still in
    /// flight has been dealt with.
    fn answered(&self, want: (u64, u64, u64)) {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = None;
        loop {
            let su = self.side_url();
            last = rt()
                .block_on(async move {
                    let mut s = SidecarClient::connect(su).await.ok()?;
                    let r = s.stats(SidecarStatsRequest {}).await.ok()?.into_inner();
                    Some((r.prepares_answered, r.releases_answered, r.aborts_answered))
                })
                .or(last);
            if let Some(got) = last {
                if got.0 >= want.0 && got.1 >= want.1 && got.2 >= want.2 {
                    return;
                }
            }
            assert!(
                Instant::now() < deadline,
                "the sidecar answered {last:?} (PREPARE, RELEASE, ABORT), {want:?} expected"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until both tiers are on one committed epoch with nothing staged; checks the
    /// persisted map agrees; returns the epoch.
    fn converged(&self) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = None;
        loop {
            last = self.epochs().or(last);
            if let Some((p, s, None, inc)) = last {
                if p == s && inc != 0 {
                    let file = Rowmap::read(&self.primary_map()).unwrap().epoch;
                    assert_eq!(file, p, "persisted map on epoch {file}, tiers on {p}");
                    return p;
                }
            }
            assert!(
                Instant::now() < deadline,
                "tiers did not converge: (primary, sidecar, staged, incarnation) = {last:?}"
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    }
}

impl Drop for Lane {
    fn drop(&mut self) {
        self.prim.take();
        self.side.take();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A case whose first swap aborts (or, with `commits`, commits despite the fault): both tiers
/// end on one epoch with outputs unchanged, and the next swap commits.
fn survives(name: &str, side_env: &str, prim_env: &str, extra: &[&str], commits: bool) -> Lane {
    let lane = Lane::new(name, side_env, prim_env, extra);
    let before = lane.outputs();
    let e0 = lane.converged();
    if commits {
        let e = lane.committed(0);
        assert!(e > e0);
    } else {
        let why = lane.aborted(0);
        eprintln!("{name}: aborted as expected: {why}");
        assert_eq!(
            lane.converged(),
            e0,
            "{name}: an aborted swap moved the epoch"
        );
    }
    assert_eq!(lane.outputs(), before, "{name}: outputs changed");
    let e = lane.committed(1);
    assert_eq!(
        lane.converged(),
        e,
        "{name}: tiers apart after the next swap"
    );
    assert_eq!(
        lane.outputs(),
        before,
        "{name}: outputs changed after the next swap"
    );
    lane
}

#[test]
fn slow_sidecar_load_times_out_and_its_late_staging_is_refused() {
    let lane = Lane::new(
        "slow-side",
        "sidecar.load=delay:2500",
        "",
        &["--prepare-timeout-s", "1"],
    );
    let before = lane.outputs();
    let e0 = lane.converged();
    assert!(lane.aborted(0).contains("timed out"));
    // the load finishes after its ABORT (its PREPARE is then answered): it must stage nothing
    lane.answered((1, 0, 1));
    assert_eq!(
        lane.epochs().unwrap().2,
        None,
        "a late PREPARE staged after its ABORT"
    );
    assert_eq!(lane.converged(), e0);
    let e = lane.committed(1);
    assert_eq!(lane.converged(), e);
    assert_eq!(lane.outputs(), before);
}

#[test]
fn slow_primary_load_times_out() {
    survives(
        "slow-prim",
        "",
        "primary.load=delay:2500",
        &["--prepare-timeout-s", "1"],
        false,
    );
}

#[test]
fn failed_loads_abort() {
    survives("fail-side", "sidecar.load=fail", "", &[], false);
    survives("fail-prim", "", "primary.load=fail", &[], false);
}

#[test]
fn lost_prepare_and_lost_prepared_abort() {
    survives("lose-prep", "", "sidecar.prepare=lose-request", &[], false);
    survives("lose-prepd", "", "sidecar.prepare=lose-reply", &[], false);
}

#[test]
fn lost_prepared_and_lost_abort_leave_a_stale_staging_the_next_prepare_drops() {
    let lane = Lane::new(
        "lose-abort",
        "",
        "sidecar.prepare=lose-reply;sidecar.abort=lose-request",
        &[],
    );
    let before = lane.outputs();
    let e0 = lane.converged();
    lane.aborted(0);
    let (p, s, staged, _) = lane.epochs().unwrap();
    assert_eq!((p, s), (e0, e0));
    assert!(
        staged.is_some_and(|n| n > e0),
        "nothing stale staged: {staged:?}"
    );
    assert_eq!(lane.outputs(), before);
    let e = lane.committed(1);
    assert!(e > staged.unwrap_or(0), "the abandoned epoch was reused");
    assert_eq!(lane.converged(), e);
    assert_eq!(lane.outputs(), before);
}

#[test]
fn lost_release_is_recovered_by_the_next_prepare() {
    let lane = Lane::new("lose-release", "", "sidecar.release=lose-request", &[]);
    let before = lane.outputs();
    let e1 = lane.committed(0);
    // the sidecar still holds both maps, serving the committed one's tags
    let (p, s, staged, _) = lane.epochs().unwrap();
    assert_eq!((p, staged), (e1, Some(e1)), "sidecar on {s}");
    assert_eq!(lane.outputs(), before);
    let e2 = lane.committed(1);
    assert_eq!(lane.converged(), e2);
    assert_eq!(lane.outputs(), before);
}

#[test]
fn duplicated_and_late_control_messages_are_harmless() {
    // duplicates of PREPARE and RELEASE (a late copy of each arrives after later messages),
    // then a failed load whose duplicated ABORT arrives late too
    let lane = Lane::new(
        "dup",
        "sidecar.load=fail@3",
        "sidecar.prepare=duplicate;sidecar.release=duplicate;sidecar.abort=duplicate",
        &[],
    );
    let before = lane.outputs();
    // the first message of each duplicated kind reaches the sidecar three times (twice at
    // once, once late), later ones once
    let e1 = lane.committed(0);
    lane.answered((3, 3, 0));
    assert_eq!(lane.converged(), e1);
    let e2 = lane.committed(1);
    lane.answered((4, 4, 0));
    assert_eq!(lane.converged(), e2);
    lane.aborted(2);
    lane.answered((5, 4, 3));
    assert_eq!(lane.converged(), e2);
    let e3 = lane.committed(3);
    assert_eq!(lane.converged(), e3);
    assert_eq!(lane.outputs(), before);
}

/// The coordinator (in the primary process) crashes at `point` during the first swap; the
/// primary is started again on its persisted map. `moved`: whether that swap survives.
fn coordinator_crash(point: &str, moved: bool) {
    let mut lane = Lane::new(point, "", &format!("{point}=crash"), &[]);
    let before = lane.outputs();
    let e0 = lane.converged();
    assert!(
        lane.swap(0).is_err(),
        "the swap call should fail with its primary"
    );
    Lane::reap(&mut lane.prim, "primary");
    lane.start_primary("");
    let e = lane.converged();
    if moved {
        assert!(e > e0, "{point}: committed swap lost");
    } else {
        assert_eq!(e, e0, "{point}: uncommitted swap survived the crash");
    }
    assert_eq!(lane.outputs(), before, "{point}: outputs changed");
    let e2 = lane.committed(1);
    assert_eq!(lane.converged(), e2);
    assert_eq!(lane.outputs(), before);
}

#[test]
fn coordinator_crash_between_prepare_and_commit() {
    coordinator_crash("coordinator.after-prepare", false);
}

#[test]
fn coordinator_crash_between_commit_and_persist() {
    coordinator_crash("coordinator.after-commit", false);
}

#[test]
fn coordinator_crash_between_persist_and_release() {
    coordinator_crash("coordinator.after-persist", true);
}

#[test]
fn coordinator_crash_after_release() {
    coordinator_crash("coordinator.after-release", true);
}

/// The sidecar crashes at `point` (or is killed after a committed swap, with None) and is
/// started again on its own stale map file; the primary re-registers it onto the committed map.
fn sidecar_crash(name: &str, point: Option<&str>, committed: bool) {
    let env = point.map(|p| format!("{p}=crash")).unwrap_or_default();
    let mut lane = Lane::new(name, &env, "", &[]);
    let before = lane.outputs();
    let e0 = lane.converged();
    let r = lane.swap(0).expect("swap rpc");
    assert_eq!(r.committed, committed, "{name}: {}", r.abort_reason);
    if point.is_none() {
        let p = lane.side.as_mut().unwrap();
        let _ = p.child.kill();
        let _ = p.child.wait();
        lane.side = None;
    } else {
        Lane::reap(&mut lane.side, "sidecar");
    }
    lane.start_sidecar("");
    let e = lane.converged();
    assert_eq!(e > e0, committed, "{name}: on epoch {e} after the restart");
    assert_eq!(lane.outputs(), before, "{name}: outputs changed");
    let e2 = lane.committed(1);
    assert_eq!(lane.converged(), e2);
    assert_eq!(lane.outputs(), before);
}

#[test]
fn sidecar_crash_during_prepare() {
    sidecar_crash("side-prep", Some("sidecar.on-prepare"), false);
}

#[test]
fn sidecar_crash_between_commit_and_release() {
    sidecar_crash("side-release", Some("sidecar.on-release"), true);
}

#[test]
fn sidecar_killed_after_a_committed_swap() {
    sidecar_crash("side-kill", None, true);
}
