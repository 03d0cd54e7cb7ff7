//! The sidecar's compute and its swap transitions, on real checkpoint files (the `tiny`
//! synthetic checkpoint, experts 48..64 of every layer cold): serving (one row per pick, the
//! expert's SwiGLU as the engine computes it), the epoch check, PREPARE / RELEASE / ABORT,
//! and requests refused with the fault their cause sets.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::OnceLock;

use moelane_engine::bank::{expert_forward, Pick};
use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::error::Fault;
use moelane_engine::rng::Rng;
use moelane_engine::rowmap::{Rowmap, ValidMap};
use moelane_engine::synth::{fit_map, generate, Preset};
use moelane_engine::tier::{ColdRequest, InProcessTier, RemoteTier};
use moelane_link::ColdService;
use moelane_rtx_worker::SidecarCore;

/// Hot experts per layer in the fixture map: 0..HOT hot, HOT..64 cold.
const HOT: usize = 48;

/// The tiny checkpoint (seed 1), generated once per test binary.
fn tiny() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("moelane-sidecar-test-{}", std::process::id()));
        generate(&Preset::by_name("tiny").expect("tiny preset"), 1, &d).expect("generate tiny");
        d
    })
}

struct Fixture {
    ckpt: Checkpoint,
    map: Rowmap,
    core: SidecarCore,
}

fn fixture() -> Fixture {
    let ckpt = Checkpoint::open(tiny()).expect("open tiny");
    let layers = ckpt.config.moe_layers().len();
    let counts = vec![vec![0u64; ckpt.config.num_experts]; layers];
    let map = fit_map(&ckpt.id, &counts, HOT);
    let core = SidecarCore::load(&ckpt, &valid(&ckpt, map.clone())).expect("load sidecar");
    Fixture { ckpt, map, core }
}

fn valid(ckpt: &Checkpoint, map: Rowmap) -> ValidMap {
    let c = &ckpt.config;
    map.validate(&ckpt.id, c.moe_layers().len(), c.num_experts, None)
        .expect("valid map")
}

fn hidden(f: &Fixture) -> usize {
    f.ckpt.config.hidden_size
}

/// A request for `picks` (row, expert) of MoE layer `layer` over `rows` seeded activation rows.
fn request(f: &Fixture, layer: u32, epoch: u64, rows: usize, picks: &[(u32, u16)]) -> ColdRequest {
    let mut rng = Rng::new(layer as u64 * 1000 + rows as u64);
    ColdRequest {
        step: 1,
        layer,
        epoch,
        picks: picks
            .iter()
            .map(|&(row, expert)| Pick { row, expert })
            .collect(),
        activations: (0..rows * hidden(f)).map(|_| rng.normal()).collect(),
    }
}

/// Expert `expert` of MoE layer `layer` on one activation row, straight from the checkpoint.
fn expected(f: &Fixture, layer: usize, expert: usize, x: &[f32]) -> Vec<f32> {
    let dl = f.ckpt.config.moe_layers()[layer];
    let w = f.ckpt.expert(dl, expert).expect("expert");
    let (mut gu, mut act) = (Vec::new(), Vec::new());
    let mut y = vec![0f32; hidden(f)];
    expert_forward(&w, x, 1, &mut gu, &mut act, &mut y);
    y
}

/// Checks each output row against the expert it picked.
fn check_rows(f: &Fixture, req: &ColdRequest, out: &[f32]) {
    let h = hidden(f);
    assert_eq!(out.len(), req.picks.len() * h, "one row per pick");
    for (i, p) in req.picks.iter().enumerate() {
        let x = &req.activations[p.row as usize * h..(p.row as usize + 1) * h];
        let want = expected(f, req.layer as usize, p.expert as usize, x);
        let got = &out[i * h..(i + 1) * h];
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs())).max(1e-6);
        for (j, (a, b)) in got.iter().zip(&want).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * scale,
                "pick {i} (row {}, expert {}), element {j}: {a} vs {b}",
                p.row,
                p.expert
            );
        }
    }
}

fn serve(f: &Fixture, req: &ColdRequest) -> moelane_engine::Result<Vec<f32>> {
    let mut out = Vec::new();
    ColdService::serve(&f.core, req, &mut out).map(|()| out)
}

fn fault(r: moelane_engine::Result<Vec<f32>>) -> Fault {
    match r {
        Ok(_) => panic!("expected a failure"),
        Err(e) => e.fault(),
    }
}

/// The map of epoch `epoch`: `hot_in` moves from hot to cold in layer 0, `cold_out` from cold to hot.
fn moved(f: &Fixture, epoch: u64, hot_in: u16, cold_out: u16) -> Rowmap {
    let mut m = f.map.clone();
    m.epoch = epoch;
    let l = &mut m.layers[0];
    l.hot.retain(|&e| e != hot_in);
    l.cold.retain(|&e| e != cold_out);
    l.hot.push(cold_out);
    l.cold.push(hot_in);
    l.hot.sort_unstable();
    l.cold.sort_unstable();
    m
}

/// What PREPARE must load for `hot_in` of layer 0: (layer, expert, checksum as stored).
fn incoming(f: &Fixture, hot_in: u16) -> Vec<(usize, usize, u64)> {
    let dl = f.ckpt.config.moe_layers()[0];
    let sum = f.ckpt.expert(dl, hot_in as usize).expect("expert").checksum;
    vec![(0, hot_in as usize, sum)]
}

#[test]
fn serves_one_row_per_pick_equal_to_the_expert_on_the_cpu() {
    let f = fixture();
    assert_eq!(f.core.epoch(), 0);
    let mut rng = Rng::new(5);
    let mut weight_bytes = 0u64;
    for layer in 0..2u32 {
        // repeated experts, repeated rows, picks out of row order
        let rows = 5;
        let picks: Vec<(u32, u16)> = (0..12)
            .map(|_| (rng.below(rows) as u32, (HOT + rng.below(64 - HOT)) as u16))
            .collect();
        // each distinct expert's weights are read once per request
        let mut distinct: Vec<u16> = picks.iter().map(|p| p.1).collect();
        distinct.sort_unstable();
        distinct.dedup();
        assert!(
            distinct.len() < picks.len(),
            "the test wants a repeated expert"
        );
        let st = f.core.state.read().expect("state");
        weight_bytes += distinct
            .iter()
            .map(|&e| {
                st.bank
                    .get(layer as usize, e as usize)
                    .expect("resident")
                    .bytes() as u64
            })
            .sum::<u64>();
        drop(st);
        let req = request(&f, layer, 0, rows, &picks);
        let out = serve(&f, &req).expect("serve");
        check_rows(&f, &req, &out);
        // the engine's in-process link reaches the same compute
        let mut link = InProcessTier::spawn(std::sync::Arc::new(fixture().core));
        link.send(req.clone()).expect("send in process");
        let rep = link.recv().expect("serve in process");
        assert_eq!(
            (rep.step, rep.layer, rep.epoch),
            (req.step, req.layer, req.epoch)
        );
        assert_eq!(out, rep.outputs);
    }
    assert_eq!(f.core.requests.load(Ordering::Relaxed), 2);
    assert_eq!(f.core.picks.load(Ordering::Relaxed), 24);
    assert_eq!(f.core.weight_bytes.load(Ordering::Relaxed), weight_bytes);
    assert_eq!(
        f.core.bytes_out.load(Ordering::Relaxed),
        (24 * hidden(&f) * 4) as u64
    );
}

#[test]
fn an_epoch_the_sidecar_does_not_hold_is_refused() {
    let f = fixture();
    let req = request(&f, 0, 7, 1, &[(0, HOT as u16)]);
    let r = serve(&f, &req);
    assert!(
        matches!(r, Err(moelane_engine::Error::EpochMismatch { got: 7, .. })),
        "{r:?}"
    );
    assert_eq!(fault(r), Fault::EpochMismatch);
    assert_eq!(f.core.requests.load(Ordering::Relaxed), 0, "nothing served");
}

#[test]
fn a_bad_pick_row_is_a_bad_request() {
    let f = fixture();
    // two activation rows; the pick names row 2
    let req = request(&f, 0, 0, 2, &[(0, HOT as u16), (2, HOT as u16)]);
    let r = serve(&f, &req);
    assert!(matches!(r, Err(moelane_engine::Error::Invalid(_))), "{r:?}");
    assert_eq!(fault(r), Fault::BadRequest);
    assert_eq!(f.core.requests.load(Ordering::Relaxed), 0);
}

#[test]
fn many_bogus_picks_are_refused_before_any_room_is_made_for_their_outputs() {
    let f = fixture();
    // a million picks over one row: the last names an expert this sidecar does not hold,
    // or a row that is not there; neither may cost a million rows of output first
    for last in [(0u32, 3u16), (1, HOT as u16)] {
        let mut picks = vec![(0u32, HOT as u16); 1 << 20];
        *picks.last_mut().unwrap() = last;
        let req = request(&f, 0, 0, 1, &picks);
        let mut out = Vec::new();
        assert!(f.core.serve(&req, &mut out).is_err());
        assert!(
            out.capacity() < 1 << 16,
            "{} floats reserved",
            out.capacity()
        );
    }
}

#[test]
fn a_hot_expert_is_not_resident_on_the_sidecar() {
    let f = fixture();
    let req = request(&f, 1, 0, 1, &[(0, 3)]);
    assert_eq!(fault(serve(&f, &req)), Fault::NotResident);
}

#[test]
fn prepare_serves_both_epochs_then_release_commits_the_new_one() {
    let f = fixture();
    let (hot_in, cold_out) = (5u16, HOT as u16);
    let next = moved(&f, 1, hot_in, cold_out);
    assert_eq!(
        f.core
            .prepare(0, 0, next.clone(), &incoming(&f, hot_in))
            .unwrap(),
        1
    );
    assert_eq!((f.core.epoch(), f.core.staged()), (0, Some(1)));
    // while staged: the old epoch is served, and the new one with the incoming expert
    let old = request(&f, 0, 0, 2, &[(1, cold_out), (0, 60)]);
    check_rows(&f, &old, &serve(&f, &old).expect("epoch 0 while staged"));
    let new = request(&f, 0, 1, 2, &[(0, hot_in), (1, 60)]);
    check_rows(&f, &new, &serve(&f, &new).expect("epoch 1 while staged"));
    // a duplicate PREPARE answers again without restaging
    assert_eq!(
        f.core.prepare(0, 0, next, &incoming(&f, hot_in)).unwrap(),
        1
    );

    assert_eq!(f.core.release(0, 1).unwrap(), 1);
    assert_eq!((f.core.epoch(), f.core.staged()), (1, None));
    assert_eq!(fault(serve(&f, &old)), Fault::EpochMismatch);
    check_rows(&f, &new, &serve(&f, &new).expect("epoch 1 committed"));
    // the expert that moved hot is freed here
    let gone = request(&f, 0, 1, 1, &[(0, cold_out)]);
    assert_eq!(fault(serve(&f, &gone)), Fault::NotResident);
    // a repeated RELEASE changes nothing
    assert_eq!(f.core.release(0, 1).unwrap(), 1);
    assert_eq!(f.core.epoch(), 1);
}

#[test]
fn abort_drops_the_staged_epoch_for_good() {
    let f = fixture();
    let (hot_in, cold_out) = (7u16, (HOT + 1) as u16);
    let next = moved(&f, 1, hot_in, cold_out);
    f.core
        .prepare(0, 0, next.clone(), &incoming(&f, hot_in))
        .unwrap();
    assert_eq!(f.core.staged(), Some(1));
    f.core.abort(0, 1).unwrap();
    assert_eq!((f.core.epoch(), f.core.staged()), (0, None));
    // epoch 1 is no longer served; the staged expert was dropped; the committed map stands
    let new = request(&f, 0, 1, 1, &[(0, hot_in)]);
    assert_eq!(fault(serve(&f, &new)), Fault::EpochMismatch);
    let staged_expert = request(&f, 0, 0, 1, &[(0, hot_in)]);
    assert_eq!(fault(serve(&f, &staged_expert)), Fault::NotResident);
    let kept = request(&f, 0, 0, 1, &[(0, cold_out)]);
    check_rows(&f, &kept, &serve(&f, &kept).expect("epoch 0 after abort"));
    // the aborted epoch is never staged again; a newer one is
    assert!(f.core.prepare(0, 0, next, &incoming(&f, hot_in)).is_err());
    assert_eq!(f.core.staged(), None);
    let newer = moved(&f, 2, hot_in, cold_out);
    assert_eq!(
        f.core.prepare(0, 0, newer, &incoming(&f, hot_in)).unwrap(),
        2
    );
    assert_eq!(f.core.staged(), Some(2));
    // RELEASE of an epoch that is not staged is refused
    assert!(f.core.release(0, 1).is_err());
}

#[test]
fn prepare_refuses_a_wrong_checksum_and_another_incarnation() {
    let f = fixture();
    let (hot_in, cold_out) = (9u16, (HOT + 2) as u16);
    let next = moved(&f, 1, hot_in, cold_out);
    let mut bad = incoming(&f, hot_in);
    bad[0].2 ^= 1;
    assert!(f.core.prepare(0, 0, next.clone(), &bad).is_err());
    assert_eq!(f.core.staged(), None, "nothing staged");
    let new = request(&f, 0, 1, 1, &[(0, hot_in)]);
    assert_eq!(fault(serve(&f, &new)), Fault::EpochMismatch);
    // a coordinator this sidecar does not obey is fenced off
    assert!(f
        .core
        .prepare(3, 0, next.clone(), &incoming(&f, hot_in))
        .is_err());
    assert!(f.core.abort(3, 1).is_err());
    assert_eq!(f.core.staged(), None);
    // and a PREPARE that builds on an epoch the sidecar does not hold
    assert!(f
        .core
        .prepare(0, 4, moved(&f, 5, hot_in, cold_out), &incoming(&f, hot_in))
        .is_err());
    assert_eq!((f.core.epoch(), f.core.staged()), (0, None));
    // the right one still goes through
    assert_eq!(
        f.core.prepare(0, 0, next, &incoming(&f, hot_in)).unwrap(),
        1
    );
}

/// LoadMap: the map it serves is a no-op; a new map needs an epoch above every one heard of
/// (it once rolled the epoch back from 1 to 0).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_map_never_moves_the_epoch_backwards_or_names_two_maps_one_epoch() {
    use moelane_rtx_worker::{LoadMapMsg, SidecarOptions};
    let s = moelane_rtx_worker::start(&SidecarOptions {
        model: tiny().to_path_buf(),
        map: None,
        data: None,
        shm_dir: std::env::temp_dir(),
        shm_cap: 1 << 16,
        device: "cpu".into(),
        probe_bandwidth: false,
    })
    .expect("start the sidecar");
    let now = s.core.state.read().unwrap().map.map.clone();
    let e0 = now.epoch;
    let ask = |m: &Rowmap| s.actor.ask(LoadMapMsg(m.to_json().unwrap()));
    // the map it serves already
    assert_eq!(ask(&now).await.expect("same map").map_epoch, e0);
    // a different map at a new epoch
    let mut next = now.clone();
    next.epoch = e0 + 1;
    // one expert of layer 0 changes tier (whichever way the current map allows)
    let l = &mut next.layers[0];
    if let Some(e) = l.hot.pop() {
        l.cold.push(e);
    } else if let Some(e) = l.cold.pop() {
        l.hot.push(e);
    }
    l.hot.sort_unstable();
    l.cold.sort_unstable();
    assert_eq!(ask(&next).await.expect("newer map").map_epoch, e0 + 1);
    assert_eq!(s.core.epoch(), e0 + 1);
    // the old map again, at its old epoch: refused, nothing moves
    for (m, what) in [
        (&now, "older"),
        (
            &{
                let mut same = now.clone();
                same.epoch = e0 + 1;
                same
            },
            "same epoch, other map",
        ),
    ] {
        let e = ask(m).await.expect_err(what);
        assert!(e.to_string().contains("never go backwards"), "{what}: {e}");
        assert_eq!(s.core.epoch(), e0 + 1, "{what}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn register_is_rate_limited_duplicates_change_nothing_and_segments_are_bounded() {
    use moelane_proto::control::RegisterRequest;
    use moelane_rtx_worker::{RegisterMsg, SidecarOptions, MAX_SHM_SEGMENTS, REGISTER_PER_SECOND};
    let shm = tempfile::tempdir().unwrap();
    let s = moelane_rtx_worker::start(&SidecarOptions {
        model: tiny().to_path_buf(),
        map: None,
        data: None,
        shm_dir: shm.path().to_path_buf(),
        shm_cap: 1 << 16,
        device: "cpu".into(),
        probe_bandwidth: false,
    })
    .expect("start the sidecar");
    let reg = |link: &str, incarnation: u64| {
        s.actor.ask(RegisterMsg(RegisterRequest {
            model: s.core.model.clone(),
            link: link.into(),
            map_epoch: s.core.epoch(),
            incarnation,
            protocol: moelane_proto::PROTOCOL,
            build: moelane_proto::BUILD.into(),
            ..Default::default()
        }))
    };
    // a burst past the limit: the first REGISTER_PER_SECOND pass, the rest are refused
    let mut refused = 0;
    for i in 0..REGISTER_PER_SECOND + 5 {
        match reg("", 1 + i as u64).await {
            Ok(_) => assert!(i < REGISTER_PER_SECOND, "call {i} passed the limit"),
            Err(e) => {
                assert!(
                    e.to_string().contains("Register calls in the last second"),
                    "{e}"
                );
                refused += 1;
            }
        }
    }
    assert_eq!(refused, 5);
    tokio::time::sleep(std::time::Duration::from_millis(1100)).await;
    // a repeated Register of one primary is refused and makes no second segment
    let a = reg("shm", 70).await.expect("shm").endpoint;
    let e = reg("shm", 70).await.expect_err("a duplicate");
    assert!(e.to_string().contains("duplicated"), "{e}");
    let files = || std::fs::read_dir(shm.path()).unwrap().count();
    assert_eq!(files(), 1);
    let b = reg("shm", 80).await.expect("shm").endpoint;
    assert_ne!(a, b);
    // at most MAX_SHM_SEGMENTS at once, whoever asks
    let mut made = 2;
    let mut err = None;
    for inc in 100..100 + MAX_SHM_SEGMENTS as u64 {
        match reg("shm", inc).await {
            Ok(_) => made += 1,
            Err(e) => {
                err = Some(e);
                break;
            }
        }
    }
    assert_eq!(made, MAX_SHM_SEGMENTS);
    let e = err.expect("the cap held");
    assert!(e.to_string().contains("shared-memory links"), "{e}");
    assert_eq!(
        files(),
        MAX_SHM_SEGMENTS,
        "segments beyond the cap were made"
    );
}
