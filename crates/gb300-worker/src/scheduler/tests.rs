//! Seeded tests of the scheduler on a real engine (the `tiny` synthetic checkpoint, with a
//! map that puts 16 experts per layer on an in-process cold tier): admission, KV
//! reservation, cancellation, fairness, and batch-invariant greedy output. Most drive the
//! scheduler step by step (no thread, no clock); one drives the real loop over its channel.

use std::path::{Path, PathBuf};
use std::sync::OnceLock;
use std::time::Instant;

use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::kv::{KvCache, BLOCK};
use moelane_engine::load::{load_engine, EngineOptions};
use moelane_engine::rng::Rng;
use moelane_engine::sampling::SamplingParams;
use moelane_engine::synth::{fit_map, generate, Preset};
use moelane_proto::Category;
use tokio::sync::mpsc::{unbounded_channel, UnboundedReceiver};

use super::{Command, Event, Scheduler, SchedulerConfig, ValidGen};

/// The tiny checkpoint (seed 1), generated once per test binary under the temp dir.
fn tiny() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let d = std::env::temp_dir().join(format!("moelane-sched-test-{}", std::process::id()));
        let p = Preset::by_name("tiny").expect("tiny preset");
        generate(&p, 1, &d).expect("generate tiny");
        // experts 0..48 hot, 48..64 cold in every layer: steps cross the in-process link
        let ckpt = Checkpoint::open(&d).expect("open tiny");
        let layers = ckpt.config.moe_layers().len();
        let counts = vec![vec![0u64; ckpt.config.num_experts]; layers];
        fit_map(&ckpt.id, &counts, p.hot)
            .write_atomic(&d.join("rowmap.json"))
            .expect("write rowmap");
        d
    })
}

/// A scheduler over a fresh engine whose KV cache holds `kv_tokens` positions.
fn sched(kv_tokens: usize, cfg: SchedulerConfig) -> Scheduler {
    let engine = load_engine(
        tiny(),
        None,
        &EngineOptions {
            kv_tokens,
            progress: false,
        },
    )
    .expect("load tiny");
    assert!(engine.cold.is_some(), "the fixture map has cold experts");
    assert!(engine.cfg.vocab_size > 600, "prompts draw ids below 600");
    Scheduler::new(engine, "tiny".into(), cfg)
}

fn cfg(max_running: usize, max_waiting: usize) -> SchedulerConfig {
    SchedulerConfig {
        max_running,
        max_waiting,
        ..SchedulerConfig::default()
    }
}

/// A greedy request with no stop tokens (it always runs to `max_tokens`).
fn req(id: &str, prompt: Vec<u32>, max_tokens: usize) -> ValidGen {
    ValidGen {
        id: id.into(),
        prompt,
        max_tokens,
        sampling: SamplingParams::default(),
        rules: Default::default(),
        constraint: None,
        stop_ids: vec![],
        span: tracing::Span::none(),
        client: String::new(),
        prompt_logprobs: false,
        first_mask: None,
    }
}

/// A prompt of `len` tokens drawn from `rng` (ids below 600: inside tiny's vocabulary).
fn prompt(rng: &mut Rng, len: usize) -> Vec<u32> {
    (0..len).map(|_| rng.below(600) as u32).collect()
}

/// Submits `r`; returns the request's event stream.
fn submit(s: &mut Scheduler, r: ValidGen) -> UnboundedReceiver<Event> {
    let (tx, rx) = unbounded_channel();
    s.submit(r, tx);
    rx
}

/// Everything the stream holds now.
fn drain(rx: &mut UnboundedReceiver<Event>) -> Vec<Event> {
    std::iter::from_fn(|| rx.try_recv().ok()).collect()
}

/// What a request's stream said: its tokens and how it ended, if it did.
#[derive(Debug, Default)]
struct Seen {
    tokens: Vec<u32>,
    finish: Option<&'static str>,
    error: Option<Category>,
    /// The prompt's (token, log-probability), when asked.
    prompt: Option<Vec<(u32, f32)>>,
}

impl Seen {
    fn take(&mut self, rx: &mut UnboundedReceiver<Event>) {
        for ev in drain(rx) {
            self.push(ev);
        }
    }
    fn push(&mut self, ev: Event) {
        assert!(!self.ended(), "event after the end: {ev:?}");
        match ev {
            Event::Token {
                token,
                completion_tokens,
                ..
            } => {
                self.tokens.push(token);
                assert_eq!(completion_tokens as usize, self.tokens.len());
            }
            Event::Finish {
                reason,
                completion_tokens,
                ..
            } => {
                assert_eq!(completion_tokens as usize, self.tokens.len());
                self.finish = Some(reason);
            }
            Event::Error { category, .. } => self.error = Some(category),
            Event::Prompt(lps) => {
                assert!(
                    self.tokens.is_empty(),
                    "the prompt's log-probabilities come first"
                );
                let p = self.prompt.get_or_insert_with(Vec::new);
                p.extend(lps.iter().map(|(t, l)| (*t, l.logprob)));
            }
        }
    }
    fn ended(&self) -> bool {
        self.finish.is_some() || self.error.is_some()
    }
}

/// KV blocks the running requests hold, checking that none holds more than its positions
/// so far and its next tokens need (KV is taken on demand), and that preempted ones hold none.
fn reserved(s: &Scheduler) -> usize {
    for r in &s.running {
        let most = KvCache::blocks_for(r.kv.len + r.next.len());
        assert!(
            r.kv.blocks.len() <= most,
            "{} holds {} blocks for {} + {} positions",
            r.req.id,
            r.kv.blocks.len(),
            r.kv.len,
            r.next.len()
        );
    }
    assert!(s.preempted.iter().all(|r| r.kv.blocks.is_empty()));
    s.running.iter().map(|r| r.kv.blocks.len()).sum()
}

/// Steps until nothing runs or waits (at most `limit` steps), checking the KV invariant.
fn run_idle(s: &mut Scheduler, limit: usize) -> usize {
    for n in 0..limit {
        if s.running.is_empty() && s.waiting.is_empty() && s.preempted.is_empty() {
            return n;
        }
        s.step();
        assert_eq!(s.engine.kv.used_blocks(), reserved(s), "KV blocks leaked");
    }
    panic!("still busy after {limit} steps");
}

#[test]
fn admission_keeps_max_running_and_refuses_beyond_max_waiting() {
    let mut s = sched(4096, cfg(2, 3));
    let mut rng = Rng::new(11);
    let mut rxs: Vec<_> = (0..5)
        .map(|i| submit(&mut s, req(&format!("r{i}"), prompt(&mut rng, 5), 6)))
        .collect();
    // three wait; the queue is full for the other two, refused at once as Overloaded
    assert_eq!(s.waiting.len(), 3);
    for rx in &mut rxs[3..] {
        match drain(rx).as_slice() {
            [Event::Error { category, .. }] => assert_eq!(*category, Category::Overloaded),
            other => panic!("expected Overloaded, got {other:?}"),
        }
    }
    let mut seen: Vec<Seen> = (0..3).map(|_| Seen::default()).collect();
    let mut most = 0;
    for _ in 0..100 {
        if s.running.is_empty() && s.waiting.is_empty() {
            break;
        }
        s.step();
        most = most.max(s.running.len());
        assert!(s.running.len() <= 2, "{} running", s.running.len());
        for (v, rx) in seen.iter_mut().zip(&mut rxs) {
            v.take(rx);
        }
    }
    assert_eq!(most, 2, "the batch should fill up to max_running");
    for v in &seen {
        assert_eq!(v.finish, Some("length"), "{v:?}");
        assert_eq!(v.tokens.len(), 6);
    }
    assert_eq!(s.snapshot().finished, 3);
}

#[test]
fn prefill_budget_admits_one_prompt_past_it_per_step() {
    let mut s = sched(
        4096,
        SchedulerConfig {
            prefill_budget: 10,
            max_running: 8,
            max_waiting: 8,
            step_tokens: 0,
            ..SchedulerConfig::default()
        },
    );
    let mut rng = Rng::new(12);
    let _rxs: Vec<_> = (0..3)
        .map(|i| submit(&mut s, req(&format!("p{i}"), prompt(&mut rng, 8), 20)))
        .collect();
    // 8 + 8 > 10: one new prompt per step, though the batch has room
    for n in 1..=3 {
        s.step();
        assert_eq!(s.running.len(), n);
        assert_eq!(s.waiting.len(), 3 - n);
    }
}

#[test]
fn oversized_requests_are_refused_as_context_overflow() {
    let mut s = sched(256, cfg(4, 4));
    let mut rng = Rng::new(13);
    let max_ctx = s.engine.cfg.max_position_embeddings;
    // longer than the model's context
    let mut a = submit(&mut s, req("ctx", prompt(&mut rng, 10), max_ctx));
    // a prompt that fits the context but not the whole KV cache (256 positions)
    assert!(max_ctx > 300);
    let mut b = submit(&mut s, req("kv", prompt(&mut rng, 256), 10));
    for rx in [&mut a, &mut b] {
        match drain(rx).as_slice() {
            [Event::Error { category, .. }] => assert_eq!(*category, Category::ContextOverflow),
            other => panic!("expected ContextOverflow, got {other:?}"),
        }
    }
    assert!(s.waiting.is_empty());
}

#[test]
fn a_full_cache_preempts_the_latest_arrival_and_its_stream_is_unchanged() {
    // 20 blocks; each request grows to 12 (10 prompt + 182 tokens = 192 positions): both
    // start, b is preempted when the cache fills, and resumes once a is done
    let mut rng = Rng::new(14);
    let (pa, pb) = (prompt(&mut rng, 10), prompt(&mut rng, 10));
    let alone = |p: &[u32]| {
        let mut s = sched(4096, cfg(8, 8));
        let mut rx = submit(&mut s, req("alone", p.to_vec(), 182));
        run_idle(&mut s, 400);
        let mut v = Seen::default();
        v.take(&mut rx);
        v.tokens
    };
    let mut s = sched(20 * BLOCK, cfg(8, 8));
    let total = s.engine.kv.blocks;
    assert_eq!(total, 20);
    let mut a = submit(&mut s, req("a", pa.clone(), 182));
    let mut b = submit(&mut s, req("b", pb.clone(), 182));
    s.step();
    assert_eq!(s.running.len(), 2, "both start: KV is taken as they grow");
    assert_eq!(s.engine.kv.used_blocks(), 2);
    let (mut sa, mut sb) = (Seen::default(), Seen::default());
    let mut preempted_at = None;
    for n in 0..600 {
        if s.running.is_empty() && s.waiting.is_empty() && s.preempted.is_empty() {
            break;
        }
        s.step();
        sa.take(&mut a);
        sb.take(&mut b);
        if preempted_at.is_none() && !s.preempted.is_empty() {
            preempted_at = Some(n);
            assert_eq!(s.preempted[0].req.id, "b", "the latest arrival goes first");
            assert!(sa.finish.is_none());
        }
        assert_eq!(s.engine.kv.used_blocks(), reserved(&s));
    }
    assert!(preempted_at.is_some(), "the cache never filled");
    assert_eq!(s.snapshot().preemptions, 1);
    assert_eq!((sa.finish, sb.finish), (Some("length"), Some("length")));
    assert_eq!(sa.tokens, alone(&pa), "a changed");
    assert_eq!(
        sb.tokens,
        alone(&pb),
        "b's stream changed by its preemption"
    );
    assert_eq!(s.engine.kv.free_blocks(), total, "every block back");
}

#[test]
fn chats_without_max_tokens_all_run_and_preemption_keeps_every_stream() {
    // the gateway gives a chat without max_tokens the whole context: with KV reserved up
    // front one such request filled this cache; now all 12 run at once, and as they grow
    // the cache fills, sequences are preempted and readmitted, and every stream (greedy and
    // seeded) is the one it produces with a cache that never fills
    let ctx = {
        let s = sched(BLOCK, cfg(1, 1));
        s.engine.cfg.max_position_embeddings
    };
    let mut rng = Rng::new(21);
    let reqs: Vec<ValidGen> = (0..12)
        .map(|i| {
            let len = 1 + rng.below(30);
            let mut r = req(&format!("c{i}"), prompt(&mut rng, len), ctx - len);
            if i % 2 == 1 {
                r.sampling = SamplingParams {
                    temperature: 0.8,
                    top_p: 0.95,
                    seed: 100 + i as u64,
                    top_k: 0,
                };
            }
            r
        })
        .collect();
    let steps = 60;
    let run = |kv_tokens: usize| {
        let mut s = sched(kv_tokens, cfg(16, 64));
        let mut rxs: Vec<_> = reqs.iter().map(|r| submit(&mut s, r.clone())).collect();
        let mut seen: Vec<Seen> = (0..reqs.len()).map(|_| Seen::default()).collect();
        s.step();
        let first = s.running.len();
        for _ in 0..steps {
            s.step();
            assert_eq!(s.engine.kv.used_blocks(), reserved(&s));
            assert!(s.engine.kv.used_blocks() <= s.engine.kv.blocks);
        }
        for (v, rx) in seen.iter_mut().zip(&mut rxs) {
            v.take(rx);
            assert!(v.error.is_none(), "{v:?}");
        }
        (first, s.snapshot().preemptions, seen)
    };
    let (first, preempted, small) = run(32 * BLOCK);
    let (_, none, big) = run(4096 * BLOCK);
    assert_eq!(first, 12, "every chat runs from the first step");
    assert!(preempted > 0, "the small cache never filled");
    assert_eq!(none, 0);
    let mut behind = 0;
    for (i, (a, b)) in small.iter().zip(&big).enumerate() {
        assert!(!a.tokens.is_empty(), "c{i} got no token");
        assert_eq!(
            a.tokens,
            b.tokens[..a.tokens.len()],
            "c{i} differs after preemption"
        );
        behind += b.tokens.len() - a.tokens.len();
    }
    assert!(
        behind > 0,
        "preemption cost no steps: the cache was not full"
    );
}

#[test]
fn a_sequence_alone_that_fills_the_cache_ends_with_length() {
    let mut s = sched(4 * BLOCK, cfg(4, 4));
    let mut rng = Rng::new(22);
    let mut rx = submit(&mut s, req("big", prompt(&mut rng, 10), 500));
    run_idle(&mut s, 200);
    let mut v = Seen::default();
    v.take(&mut rx);
    assert_eq!(v.finish, Some("length"));
    // 64 positions: the prompt's 10 and 54 generated (the last one never written)
    assert_eq!(v.tokens.len(), 4 * BLOCK - 10 + 1);
    assert_eq!(s.engine.kv.free_blocks(), 4);
}

#[test]
fn seeded_mix_never_overcommits_kv_and_frees_all() {
    for seed in [1u64, 2, 3] {
        let mut rng = Rng::new(seed);
        let mut s = sched(48 * BLOCK, cfg(6, 64));
        let total = s.engine.kv.blocks;
        let mut streams = Vec::new();
        let mut seen = Vec::new();
        for i in 0..24 {
            let len = 1 + rng.below(40);
            let max = 1 + rng.below(60);
            streams.push(submit(
                &mut s,
                req(&format!("m{i}"), prompt(&mut rng, len), max),
            ));
            seen.push((Seen::default(), max));
            // a few steps between arrivals, as clients arrive while the batch runs
            for _ in 0..rng.below(3) {
                s.step();
                assert!(s.engine.kv.used_blocks() <= total);
                assert_eq!(s.engine.kv.used_blocks(), reserved(&s), "seed {seed}");
            }
        }
        run_idle(&mut s, 2000);
        for ((v, max), rx) in seen.iter_mut().zip(&mut streams) {
            v.take(rx);
            assert_eq!(v.finish, Some("length"), "seed {seed}: {v:?}");
            assert_eq!(v.tokens.len(), *max);
        }
        assert_eq!(s.engine.kv.free_blocks(), total, "seed {seed}");
        assert_eq!(s.snapshot().finished, 24);
    }
}

#[test]
fn cancel_stops_a_running_request_and_frees_its_kv() {
    // one runs at a time: the second request waits behind the first
    let mut s = sched(4096, cfg(1, 4));
    let total = s.engine.kv.blocks;
    let mut rng = Rng::new(15);
    let mut long = submit(&mut s, req("long", prompt(&mut rng, 12), 500));
    let mut queued = submit(&mut s, req("queued", prompt(&mut rng, 12), 10));
    for _ in 0..3 {
        s.step();
    }
    assert_eq!((s.running.len(), s.waiting.len()), (1, 1));
    assert_eq!(s.engine.kv.used_blocks(), KvCache::blocks_for(12 + 3));
    assert!(s.cancel("long"));
    let mut v = Seen::default();
    v.take(&mut long);
    assert_eq!(v.finish, Some("cancelled"));
    assert_eq!(v.tokens.len(), 3);
    assert!(s.running.is_empty());
    assert_eq!(
        s.engine.kv.free_blocks(),
        total,
        "the cancelled request's KV freed"
    );
    // a waiting request is cancelled before it ever runs
    assert!(s.cancel("queued"));
    assert!(s.waiting.is_empty());
    let mut q = Seen::default();
    q.take(&mut queued);
    assert_eq!((q.finish, q.tokens.len()), (Some("cancelled"), 0));
    assert!(!s.cancel("nobody"), "an unknown id is not found");
    // nothing more arrives on a cancelled stream, and nothing is stepped
    s.step();
    assert!(drain(&mut long).is_empty());
    assert!(drain(&mut queued).is_empty());
    assert_eq!(s.engine.kv.free_blocks(), total);
    assert_eq!(s.snapshot().cancelled, 2);
}

#[test]
fn a_client_that_leaves_is_dropped_and_its_kv_freed() {
    let mut s = sched(4096, cfg(4, 4));
    let total = s.engine.kv.blocks;
    let mut rng = Rng::new(16);
    let gone = submit(&mut s, req("gone", prompt(&mut rng, 12), 500));
    let mut stays = submit(&mut s, req("stays", prompt(&mut rng, 12), 4));
    s.step();
    assert_eq!(s.running.len(), 2);
    drop(gone);
    s.step();
    assert_eq!(s.running.len(), 1, "the left request is no longer stepped");
    assert_eq!(s.snapshot().cancelled, 1);
    run_idle(&mut s, 50);
    let mut v = Seen::default();
    v.take(&mut stays);
    assert_eq!(v.finish, Some("length"));
    assert_eq!(s.engine.kv.free_blocks(), total);
}

#[test]
fn short_requests_finish_while_a_long_one_runs() {
    let mut rng = Rng::new(17);
    let mut s = sched(4096, cfg(8, 64));
    let long_max = 150;
    let mut long = submit(&mut s, req("long", prompt(&mut rng, 30), long_max));
    let mut lv = Seen::default();
    for _ in 0..5 {
        s.step();
    }
    // short requests arrive at seeded times while the long one decodes
    let mut shorts: Vec<(UnboundedReceiver<Event>, Seen)> = Vec::new();
    let mut steps = 0;
    while shorts.len() < 6 || shorts.iter().any(|(_, v)| !v.ended()) {
        if shorts.len() < 6 && rng.below(3) == 0 {
            let len = 1 + rng.below(10);
            let r = req(
                &format!("s{}", shorts.len()),
                prompt(&mut rng, len),
                1 + rng.below(5),
            );
            shorts.push((submit(&mut s, r), Seen::default()));
        }
        s.step();
        steps += 1;
        assert!(steps < 100, "short requests starved");
        for (rx, v) in &mut shorts {
            v.take(rx);
        }
        lv.take(&mut long);
    }
    for (_, v) in &shorts {
        assert_eq!(v.finish, Some("length"), "{v:?}");
    }
    assert!(
        lv.finish.is_none(),
        "the long request ended before the short ones"
    );
    assert!(lv.tokens.len() < long_max);
    run_idle(&mut s, 300);
    lv.take(&mut long);
    assert_eq!(lv.finish, Some("length"));
    assert_eq!(lv.tokens.len(), long_max);
}

#[test]
fn greedy_output_is_the_same_alone_and_in_a_batch() {
    let mut rng = Rng::new(18);
    let reqs: Vec<(Vec<u32>, usize)> = (0..6)
        .map(|_| {
            let len = 1 + rng.below(30);
            (prompt(&mut rng, len), 8 + rng.below(12))
        })
        .collect();
    let mut s = sched(4096, cfg(8, 64));
    let alone: Vec<Vec<u32>> = reqs
        .iter()
        .enumerate()
        .map(|(i, (p, m))| {
            let mut rx = submit(&mut s, req(&format!("alone{i}"), p.clone(), *m));
            run_idle(&mut s, 100);
            let mut v = Seen::default();
            v.take(&mut rx);
            assert_eq!(v.finish, Some("length"));
            v.tokens
        })
        .collect();
    // the same engine's plain greedy loop agrees with the scheduler on one request
    let (p, m) = &reqs[0];
    assert_eq!(&s.engine.greedy(p, *m).expect("greedy"), &alone[0]);
    // now together, arriving at seeded steps so prefills join running decodes
    let mut rxs = Vec::new();
    for (i, (p, m)) in reqs.iter().enumerate() {
        rxs.push(submit(&mut s, req(&format!("batch{i}"), p.clone(), *m)));
        for _ in 0..rng.below(3) {
            s.step();
        }
    }
    run_idle(&mut s, 200);
    for (i, rx) in rxs.iter_mut().enumerate() {
        let mut v = Seen::default();
        v.take(rx);
        assert_eq!(v.tokens, alone[i], "request {i} differs in a batch");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_loop_serves_submit_cancel_and_snapshot_over_its_channel() {
    let s = sched(4096, cfg(4, 4));
    let total = s.engine.kv.blocks;
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let thread = std::thread::spawn(move || s.run(rx, &flag));
    let deadline = std::time::Duration::from_secs(20);
    let mut rng = Rng::new(19);
    let (etx, mut short) = unbounded_channel();
    tx.send(Command::Submit(
        Box::new(req("short", prompt(&mut rng, 6), 5)),
        etx,
    ))
    .await
    .expect("send");
    let (etx, mut long) = unbounded_channel();
    tx.send(Command::Submit(
        Box::new(req("long", prompt(&mut rng, 6), 1500)),
        etx,
    ))
    .await
    .expect("send");
    // the short one ends on its own
    let mut v = Seen::default();
    within(
        "short request finished",
        tokio::time::timeout(deadline, async {
            while !v.ended() {
                v.push(short.recv().await.expect("stream open"));
            }
        })
        .await,
    );
    assert_eq!(v.finish, Some("length"));
    // the long one is cancelled once it has produced a token
    let first = within("a token", tokio::time::timeout(deadline, long.recv()).await);
    assert!(matches!(first, Some(Event::Token { .. })), "{first:?}");
    let (ctx, crx) = tokio::sync::oneshot::channel();
    tx.send(Command::Cancel("long".into(), ctx))
        .await
        .expect("send");
    assert!(within("cancel reply", tokio::time::timeout(deadline, crx).await).expect("reply"));
    let last = tokio::time::timeout(deadline, async {
        let mut last = None;
        while let Some(ev) = long.recv().await {
            last = Some(ev);
        }
        last
    });
    let (rtx, rrx) = tokio::sync::oneshot::channel();
    tx.send(Command::Snapshot(rtx)).await.expect("send");
    let snap = within("snapshot", tokio::time::timeout(deadline, rrx).await).expect("reply");
    assert_eq!((snap.running, snap.waiting), (0, 0));
    assert_eq!(snap.kv_used, 0, "cancelled request's KV freed");
    assert_eq!(snap.kv_total, total);
    assert_eq!((snap.finished, snap.cancelled), (1, 1));
    tx.send(Command::Shutdown).await.expect("send");
    // the loop ends and drops the stream's sender: the stream closes
    assert!(matches!(
        last.await.expect("stream closed in time"),
        Some(Event::Finish {
            reason: "cancelled",
            ..
        })
    ));
    thread.join().expect("loop thread");
    assert!(!stop.load(std::sync::atomic::Ordering::Acquire));
}

/// A busy loop (a long request decoding) stops on the flag alone, and a queued request then
/// gets an Unavailable when the queue is closed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_stop_flag_ends_a_busy_loop() {
    let s = sched(4096, cfg(4, 4));
    let (tx, rx) = tokio::sync::mpsc::channel(8);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let thread = std::thread::spawn(move || s.run(rx, &flag));
    let mut rng = Rng::new(23);
    let (etx, mut long) = unbounded_channel();
    tx.send(Command::Submit(
        Box::new(req("long", prompt(&mut rng, 6), 1500)),
        etx,
    ))
    .await
    .expect("send");
    let first = tokio::time::timeout(std::time::Duration::from_secs(20), long.recv())
        .await
        .expect("a token in time");
    assert!(matches!(first, Some(Event::Token { .. })), "{first:?}");
    stop.store(true, std::sync::atomic::Ordering::Release);
    let joined = tokio::task::spawn_blocking(move || thread.join().expect("loop thread"));
    tokio::time::timeout(std::time::Duration::from_secs(20), joined)
        .await
        .expect("the loop stopped in time")
        .expect("join");
    // the loop is gone: its queue is closed
    let (etx, _rx) = unbounded_channel();
    assert!(tx
        .send(Command::Submit(
            Box::new(req("late", prompt(&mut rng, 6), 4)),
            etx
        ))
        .await
        .is_err());
}

fn within<T>(what: &str, r: Result<T, tokio::time::error::Elapsed>) -> T {
    r.unwrap_or_else(|_| panic!("{what} in time"))
}

#[test]
fn logits_taken_to_the_host_change_no_token_of_any_request() {
    // one request asks for log-probabilities, so every step of the batch picks on the host:
    // greedy and seeded neighbours get the tokens they get when the device picks
    let mut rng = Rng::new(23);
    let reqs: Vec<ValidGen> = (0..4)
        .map(|i| {
            let len = 1 + rng.below(20);
            let mut r = req(&format!("h{i}"), prompt(&mut rng, len), 10 + i);
            if i % 2 == 1 {
                r.sampling = SamplingParams {
                    temperature: 0.9,
                    top_p: 0.9,
                    seed: 40 + i as u64,
                    top_k: 0,
                };
            }
            r
        })
        .collect();
    let run = |reqs: &[ValidGen]| {
        let mut s = sched(4096, cfg(8, 64));
        let mut rxs: Vec<_> = reqs.iter().map(|r| submit(&mut s, r.clone())).collect();
        run_idle(&mut s, 100);
        rxs.iter_mut().map(drain).collect::<Vec<_>>()
    };
    let device = run(&reqs);
    let mut with = reqs.clone();
    with[0].rules.logprobs = Some(2);
    let host = run(&with);
    let tokens = |evs: &[Event]| {
        evs.iter()
            .filter_map(|e| match e {
                Event::Token { token, .. } => Some(*token),
                _ => None,
            })
            .collect::<Vec<_>>()
    };
    for i in 0..reqs.len() {
        assert_eq!(tokens(&host[i]), tokens(&device[i]), "request {i}");
        for e in &host[i] {
            if let Event::Token { logprobs, .. } = e {
                assert_eq!(logprobs.is_some(), i == 0, "request {i}: {e:?}");
                if let Some(l) = logprobs {
                    assert_eq!(l.top.len(), 2);
                    assert!(l.logprob <= 0.0 && l.logprob == l.top[0].1, "greedy: {l:?}");
                }
            }
        }
    }
}

#[test]
fn a_grammar_the_free_answer_satisfies_leaves_greedy_output_bitwise_unchanged() {
    // a grammar of any text: every token the model picks unconstrained is allowed (special
    // tokens aside, which a text grammar never produces), so the masked step picks the same
    use moelane_text::grammar::{lark_grammar, Grammars};
    let tok = moelane_text::tokenizer::Tokenizer::from_dir(tiny()).expect("tokenizer");
    let eos = tok.eos_ids[0];
    let special: Vec<bool> = (0..tok.vocab_size() as u32)
        .map(|i| tok.is_special(i))
        .collect();
    let g_tok = std::sync::Arc::new(tok);
    let g = Grammars::new(g_tok.clone(), eos);
    let any = lark_grammar("start: /(.|\\n)*/");
    let mut rng = Rng::new(24);
    let mut compared = 0;
    for i in 0..12 {
        let len = 1 + rng.below(20);
        let p = prompt(&mut rng, len);
        let run = |constrained: bool| {
            let mut s = sched(4096, cfg(4, 4));
            let mut r = req(&format!("g{i}"), p.clone(), 24);
            if constrained {
                r.constraint = Some(g.compile(&any).expect("compile"));
            }
            let mut rx = submit(&mut s, r);
            run_idle(&mut s, 100);
            let mut v = Seen::default();
            v.take(&mut rx);
            assert!(v.error.is_none(), "{v:?}");
            v.tokens
        };
        let free = run(false);
        let bytes: Vec<u8> = free
            .iter()
            .flat_map(|&t| g_tok.token_bytes(t).to_vec())
            .collect();
        if free
            .iter()
            .any(|&t| special.get(t as usize).copied().unwrap_or(false))
            || std::str::from_utf8(&bytes).is_err()
        {
            // a control token, or bytes that are not UTF-8 (random weights write both): not
            // in the language of a text grammar
            continue;
        }
        assert_eq!(
            run(true),
            free,
            "prompt {i}: the mask changed a greedy answer"
        );
        compared += 1;
    }
    assert!(compared >= 4, "only {compared} answers were text");
}

#[test]
fn a_json_schema_grammar_makes_random_weights_answer_valid_json() {
    use moelane_text::grammar::{json_schema_grammar, Grammars};
    let tok = moelane_text::tokenizer::Tokenizer::from_dir(tiny()).expect("tokenizer");
    let eos = tok.eos_ids[0];
    let tok = std::sync::Arc::new(tok);
    let g = Grammars::new(tok.clone(), eos);
    let schema = serde_json::json!({"type": "object", "properties": {
        "city": {"type": "string", "maxLength": 10},
        "count": {"type": "integer", "minimum": 0, "maximum": 99},
        "ok": {"type": "boolean"}},
        "required": ["city", "count", "ok"], "additionalProperties": false});
    let grammar = json_schema_grammar(&schema);
    let mut rng = Rng::new(25);
    let mut s = sched(4096, cfg(8, 64));
    let mut rxs = Vec::new();
    for i in 0..6 {
        let mut r = req(&format!("j{i}"), prompt(&mut rng, 8), 200);
        r.stop_ids = vec![eos];
        r.constraint = Some(g.compile(&grammar).expect("compile"));
        if i % 2 == 1 {
            r.sampling = SamplingParams {
                temperature: 1.0,
                top_p: 1.0,
                seed: 7 + i as u64,
                top_k: 0,
            };
        }
        rxs.push(submit(&mut s, r));
    }
    run_idle(&mut s, 400);
    for (i, rx) in rxs.iter_mut().enumerate() {
        let mut v = Seen::default();
        v.take(rx);
        assert_eq!(v.finish, Some("stop"), "answer {i} did not complete: {v:?}");
        let text = tok.decode_lossy(&v.tokens);
        let j: serde_json::Value =
            serde_json::from_str(&text).unwrap_or_else(|e| panic!("answer {i} {text:?}: {e}"));
        let o = j.as_object().expect("an object");
        assert_eq!(o.len(), 3, "{text}");
        assert!(
            o["city"].as_str().is_some_and(|c| c.chars().count() <= 10),
            "{text}"
        );
        assert!(o["count"].as_u64().is_some_and(|c| c <= 99), "{text}");
        assert!(o["ok"].is_boolean(), "{text}");
    }
}

#[test]
fn the_mask_worker_gives_each_constraint_the_mask_made_inline_and_gives_them_back() {
    // constrained and unconstrained slots mixed, over several steps: every mask the worker
    // makes masks a row as the same grammar followed inline does, the constraints come back
    // where they were, and the worker stays in step with the loop
    use moelane_text::grammar::{json_schema_grammar, Grammars};
    let tok = moelane_text::tokenizer::Tokenizer::from_dir(tiny()).expect("tokenizer");
    let (eos, v) = (tok.eos_ids[0], tok.vocab_size());
    let g = Grammars::new(std::sync::Arc::new(tok), eos);
    // the trie built on its own thread; the first compile waits for it
    g.warm();
    let grammar = json_schema_grammar(&serde_json::json!({"type": "array",
        "items": {"type": "integer"}, "minItems": 50}));
    let mut slots: Vec<Option<moelane_text::grammar::Constraint>> = (0..5)
        .map(|i| (i % 2 == 0).then(|| g.compile(&grammar).expect("compile")))
        .collect();
    let mut inline = slots.clone();
    let mut w = super::masks::MaskWorker::default();
    let mut rng = Rng::new(3);
    for step in 0..12 {
        // even slots to the fast worker, odd steps' to the slow one
        for (i, c) in slots.iter_mut().enumerate() {
            if let Some(c) = c.take() {
                assert!(
                    w.send(i as u64, c, step % 2 == 1).is_ok(),
                    "step {step}: not sent"
                );
            }
        }
        let mut masks: Vec<Option<(Result<moelane_text::grammar::Mask, String>, f64)>> =
            (0..slots.len()).map(|_| None).collect();
        while masks
            .iter()
            .zip(&inline)
            .any(|(m, c)| c.is_some() && m.is_none())
        {
            let d = w
                .wait(std::time::Duration::from_secs(10))
                .expect("a mask within 10 s");
            let i = d.key as usize;
            slots[i] = Some(d.constraint);
            masks[i] = Some((d.mask, d.secs));
        }
        for (i, (m, c)) in masks.into_iter().zip(inline.iter_mut()).enumerate() {
            let Some(c) = c else {
                assert!(m.is_none() && slots[i].is_none(), "slot {i}");
                continue;
            };
            let (m, _) = m.expect("a constrained slot's mask");
            let m = m.expect("mask");
            // a padded head: ids past the vocabulary are never allowed
            let row: Vec<f32> = (0..v + 37).map(|_| rng.uniform()).collect();
            let want: Vec<f32> = (0..row.len())
                .map(|t| {
                    if m.allows(t as u32) {
                        row[t]
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let (mut a, mut b) = (row.clone(), row);
            m.apply(&mut a).expect("apply");
            c.mask(&mut b).expect("inline");
            assert!(a == b, "step {step} slot {i}: the masks differ");
            assert!(a == want, "step {step} slot {i}: applied unlike allows()");
            // both follow the lowest allowed token
            let t = a.iter().position(|x| x.is_finite()).expect("a token") as u32;
            c.consume(t).expect("inline follows");
            slots[i]
                .as_mut()
                .expect("given back")
                .consume(t)
                .expect("follows");
        }
    }
}

/// [`req`] accounted to `client`.
fn req_of(client: &str, id: &str, prompt: Vec<u32>, max_tokens: usize) -> ValidGen {
    ValidGen {
        client: client.into(),
        ..req(id, prompt, max_tokens)
    }
}

#[test]
fn a_client_with_nothing_running_gets_a_place_past_a_full_batch() {
    // a fills the batch (2) and queues two more; b's one request then runs at once, past
    // the full batch (no preemption: nobody recomputes), and finishes while a's run; a
    // client sending one short request after another never costs a any recompute; every
    // stream is the one it makes alone
    let mut rng = Rng::new(31);
    let pa: Vec<Vec<u32>> = (0..4).map(|_| prompt(&mut rng, 12)).collect();
    let pb = prompt(&mut rng, 9);
    let mut s = sched(4096, cfg(2, 64));
    let alone: Vec<Vec<u32>> = pa
        .iter()
        .chain([&pb])
        .enumerate()
        .map(|(i, p)| {
            let m = if i < 4 { 40 } else { 6 };
            let mut rx = submit(&mut s, req(&format!("alone{i}"), p.clone(), m));
            run_idle(&mut s, 100);
            let mut v = Seen::default();
            v.take(&mut rx);
            v.tokens
        })
        .collect();
    let mut rxa: Vec<_> = (pa.iter().enumerate())
        .map(|(i, p)| submit(&mut s, req_of("a", &format!("a{i}"), p.clone(), 40)))
        .collect();
    for _ in 0..3 {
        s.step();
    }
    assert_eq!(s.running.len(), 2);
    let mut rxb = submit(&mut s, req_of("b", "b", pb.clone(), 6));
    s.step();
    let ids: Vec<&str> = s.running.iter().map(|r| r.req.id.as_str()).collect();
    assert_eq!(
        ids,
        ["a0", "a1", "b"],
        "b runs at once, past the full batch"
    );
    let mut sa: Vec<Seen> = (0..4).map(|_| Seen::default()).collect();
    let mut sb = Seen::default();
    let mut trickle = Vec::new();
    for n in 0..600 {
        if s.running.is_empty() && s.waiting.is_empty() && s.preempted.is_empty() {
            break;
        }
        // c: a one-token request after another, each as the previous ends
        if n < 200 && s.running.iter().all(|r| r.req.client != "c") {
            let id = format!("c{n}");
            trickle.push(submit(&mut s, req_of("c", &id, prompt(&mut rng, 3), 1)));
        }
        s.step();
        assert!(
            s.running.len() <= 3,
            "at most one place past the batch of 2"
        );
        assert_eq!(s.engine.kv.used_blocks(), reserved(&s), "KV blocks leaked");
        for (v, rx) in sa.iter_mut().zip(&mut rxa) {
            v.take(rx);
        }
        let was = sb.finish.is_some();
        sb.take(&mut rxb);
        if sb.finish.is_some() && !was {
            assert!(
                sa.iter().all(|v| v.finish.is_none()),
                "b waited for one of a's to end"
            );
        }
    }
    assert_eq!(sb.finish, Some("length"));
    assert_eq!(sb.tokens, alone[4], "b's stream");
    for (i, v) in sa.iter().enumerate() {
        assert_eq!(v.finish, Some("length"), "a{i}");
        assert_eq!(v.tokens, alone[i], "a{i}'s stream changed");
    }
    assert!(trickle.len() > 20, "c sent {} requests", trickle.len());
    for rx in &mut trickle {
        let mut v = Seen::default();
        v.take(rx);
        assert_eq!(v.finish, Some("length"), "{v:?}");
    }
    assert_eq!(s.snapshot().preemptions, 0, "nobody was preempted");
}

#[test]
fn admission_takes_the_client_running_the_fewest_and_one_client_keeps_its_order() {
    let mut rng = Rng::new(32);
    let mut s = sched(4096, cfg(3, 64));
    // one client: first come, first served
    let _solo: Vec<_> = (0..4)
        .map(|i| {
            submit(
                &mut s,
                req_of("a", &format!("a{i}"), prompt(&mut rng, 5), 30),
            )
        })
        .collect();
    s.step();
    let ids: Vec<&str> = s.running.iter().map(|r| r.req.id.as_str()).collect();
    assert_eq!(ids, ["a0", "a1", "a2"]);
    run_idle(&mut s, 200);
    // a queues 3 while b and c queue one each behind them: a batch of 3 takes one of each
    let _rx: Vec<_> = ["a0", "a1", "a2", "b0", "c0"]
        .iter()
        .map(|id| submit(&mut s, req_of(&id[..1], id, prompt(&mut rng, 5), 30)))
        .collect();
    s.step();
    let mut ids: Vec<&str> = s.running.iter().map(|r| r.req.id.as_str()).collect();
    ids.sort();
    assert_eq!(ids, ["a0", "b0", "c0"]);
    assert_eq!(s.snapshot().preemptions, 0, "nothing ran: nobody preempted");
}

#[test]
fn a_full_queue_refuses_the_latest_request_of_the_client_holding_the_most_places() {
    let mut rng = Rng::new(33);
    let mut s = sched(4096, cfg(1, 4));
    let mut rxa: Vec<_> = (0..5)
        .map(|i| {
            submit(
                &mut s,
                req_of("a", &format!("a{i}"), prompt(&mut rng, 5), 8),
            )
        })
        .collect();
    // a's fifth is refused (a client gives up a place only for another client)
    assert_eq!(s.waiting.len(), 4);
    assert!(matches!(
        drain(&mut rxa[4]).as_slice(),
        [Event::Error {
            category: Category::Overloaded,
            ..
        }]
    ));
    let mut rxb = submit(&mut s, req_of("b", "b0", prompt(&mut rng, 5), 8));
    assert_eq!(s.waiting.len(), 4, "b took a's latest place");
    match drain(&mut rxa[3]).as_slice() {
        [Event::Error { category, message }] => {
            assert_eq!(*category, Category::Overloaded);
            assert!(message.contains("places"), "{message}");
        }
        other => panic!("a3 expected an Overloaded error, got {other:?}"),
    }
    assert!(drain(&mut rxb).is_empty(), "b waits");
    // b and c hold one place each, a two: a third client takes a's latest again, and a
    // client holding one less than a (c, asking for its second) does not
    let _rxc = submit(&mut s, req_of("c", "c0", prompt(&mut rng, 5), 8));
    assert!(matches!(
        drain(&mut rxa[2]).as_slice(),
        [Event::Error { .. }]
    ));
    let mut rxc1 = submit(&mut s, req_of("c", "c1", prompt(&mut rng, 5), 8));
    assert!(matches!(
        drain(&mut rxc1).as_slice(),
        [Event::Error {
            category: Category::Overloaded,
            ..
        }]
    ));
    let held: Vec<&str> = s.waiting.iter().map(|(r, _, _)| r.id.as_str()).collect();
    assert_eq!(held, ["a0", "a1", "b0", "c0"]);
}

#[test]
fn a_grammar_with_costly_masks_slows_only_its_own_request() {
    // a schema whose pattern repeats 100,000 times: each mask takes milliseconds, past the
    // fast worker's bound. Its request's masks move to the slow worker and its row sits out
    // the steps its mask is not ready for, so a free request beside it runs at its own pace;
    // both answers are the ones each makes alone
    use moelane_text::grammar::{json_schema_grammar, Grammars};
    let tok = moelane_text::tokenizer::Tokenizer::from_dir(tiny()).expect("tokenizer");
    let eos = tok.eos_ids[0];
    let g = Grammars::new(std::sync::Arc::new(tok), eos);
    g.warm();
    let costly = json_schema_grammar(&serde_json::json!({"type": "string",
        "pattern": "^a{100000}$"}));
    let mut c = g.compile(&costly).expect("compile");
    let t0 = Instant::now();
    c.next_mask().expect("a mask");
    let secs = t0.elapsed().as_secs_f64();
    assert!(
        secs > 2.0 * super::masks::SLOW,
        "a mask of the costly grammar took {secs} s: not costly enough to show anything"
    );
    let mut rng = Rng::new(41);
    let (pf, pc) = (prompt(&mut rng, 8), prompt(&mut rng, 8));
    // as the lane validates it: compiled, its first mask made off the step loop
    let costly_req = |id: &str| {
        let mut r = req(id, pc.clone(), 8);
        let mut c = g.compile(&costly).expect("compile");
        let t0 = Instant::now();
        let m = c.next_mask();
        r.first_mask = Some(Box::new((m, t0.elapsed().as_secs_f64())));
        r.constraint = Some(c);
        r
    };
    let alone = |r: ValidGen| {
        let mut s = sched(4096, cfg(4, 4));
        let mut rx = submit(&mut s, r);
        run_idle(&mut s, 400);
        let mut v = Seen::default();
        v.take(&mut rx);
        assert_eq!(v.finish, Some("length"), "{v:?}");
        v.tokens
    };
    let (free_alone, costly_alone) = (alone(req("f", pf.clone(), 48)), alone(costly_req("c")));
    let mut s = sched(4096, cfg(4, 4));
    let mut rc = submit(&mut s, costly_req("c"));
    let mut rf = submit(&mut s, req("f", pf.clone(), 48));
    let (mut sc, mut sf) = (Seen::default(), Seen::default());
    let mut costly_at_free_end = None;
    let t0 = Instant::now();
    let mut longest = 0f64;
    while !(sc.ended() && sf.ended()) {
        assert!(t0.elapsed().as_secs() < 60, "not done in 60 s");
        let t = Instant::now();
        s.step();
        longest = longest.max(t.elapsed().as_secs_f64());
        sc.take(&mut rc);
        sf.take(&mut rf);
        if sf.ended() && costly_at_free_end.is_none() {
            costly_at_free_end = Some(sc.tokens.len());
        }
    }
    let at = costly_at_free_end.expect("the free request ended");
    println!(
        "a mask of the costly grammar: {:.1} ms; the free request's 48 tokens were done when \
         the costly one had {at} of its 8; the longest step {:.1} ms",
        secs * 1e3,
        longest * 1e3
    );
    assert!(at < 8, "the free request went at the costly one's pace");
    // no step waited for a costly mask (the first one was made with the compile)
    assert!(
        longest < secs / 2.0,
        "a step took {longest} s, a costly mask {secs} s"
    );
    assert_eq!(sf.tokens, free_alone, "the free answer changed");
    assert_eq!(sc.tokens, costly_alone, "the costly answer changed");
    assert_eq!(sc.finish, Some("length"));

    // sampled, and preempted each time it sits out for its mask: the recompute makes the
    // held logits again and takes the pick already drawn, so the seeded answer is the one it
    // makes alone (this grammar leaves one token at most places, so a pick drawn anew would
    // mostly agree: the held row's preemption and readmission are what this checks)
    let sampled = |id: &str| {
        let mut r = costly_req(id);
        r.sampling = SamplingParams {
            temperature: 0.9,
            top_p: 1.0,
            seed: 77,
            top_k: 0,
        };
        r
    };
    let want = alone(sampled("c"));
    let mut s = sched(4096, cfg(4, 4));
    let mut rc = submit(&mut s, sampled("c"));
    let _rf = submit(&mut s, req("f", pf, 48));
    let mut sc = Seen::default();
    let mut preempted = 0;
    let t0 = Instant::now();
    while !sc.ended() {
        assert!(t0.elapsed().as_secs() < 60, "not done in 60 s");
        s.step();
        sc.take(&mut rc);
        if let Some(i) = s.running.iter().position(|r| r.held.is_some()) {
            let r = s.running.remove(i);
            s.preempt(r);
            preempted += 1;
        }
    }
    assert!(preempted > 0, "the costly row never sat out");
    assert_eq!(
        sc.tokens, want,
        "the sampled answer changed by its preemptions"
    );
}

#[test]
fn prompt_logprobs_are_each_prompt_tokens_and_leave_the_answer_unchanged() {
    // a prompt longer than a chunk (512 tokens): prefilled in two steps beside another
    // request; every prompt token's log-probability equals one whole prefill's, and the
    // answer is the one made without them
    let mut rng = Rng::new(51);
    let p = prompt(&mut rng, 700);
    let other = prompt(&mut rng, 20);
    let want: Vec<f32> = {
        let mut s = sched(4096, cfg(4, 8));
        assert_eq!(
            s.prompt_chunk(),
            512,
            "tiny's vocabulary gives the largest chunk"
        );
        let v = s.engine.cfg.vocab_size;
        let mut kv = s.engine.kv.new_seq();
        let logits = s
            .engine
            .step_with(
                &mut [moelane_engine::step::SeqStep {
                    kv: &mut kv,
                    tokens: &p,
                }],
                true,
            )
            .expect("prefill");
        (0..p.len() - 1)
            .map(|j| moelane_engine::sampling::logprobs(&logits[j * v..(j + 1) * v], p[j + 1], 0).0)
            .collect()
    };
    let run = |asked: bool| {
        let mut s = sched(4096, cfg(4, 8));
        let mut o = submit(&mut s, req("o", other.clone(), 30));
        s.step();
        let mut r = req("p", p.clone(), 8);
        if asked {
            r.rules.logprobs = Some(3);
            r.prompt_logprobs = true;
        }
        let mut rx = submit(&mut s, r);
        let steps = run_idle(&mut s, 200);
        let (mut v, mut vo) = (Seen::default(), Seen::default());
        v.take(&mut rx);
        vo.take(&mut o);
        assert_eq!(v.finish, Some("length"));
        (v, vo.tokens, steps)
    };
    let (plain, other_plain, _) = run(false);
    let (asked, other_asked, _) = run(true);
    assert_eq!(asked.tokens, plain.tokens, "the answer changed");
    assert_eq!(
        other_asked, other_plain,
        "the other request's answer changed"
    );
    assert!(plain.prompt.is_none());
    let check = |got: Vec<(u32, f32)>, what: &str| {
        assert_eq!(got.len(), p.len() - 1, "{what}");
        for (j, ((t, lp), w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(*t, p[j + 1], "{what}: token {j}");
            assert_eq!(lp, w, "{what}: position {}", j + 1);
        }
    };
    check(
        asked.prompt.expect("the prompt's log-probabilities"),
        "chunked",
    );
    // preempted after its first chunk: recomputed, and no position sent twice
    let mut s = sched(4096, cfg(4, 8));
    let mut r = req("p", p.clone(), 8);
    r.rules.logprobs = Some(3);
    r.prompt_logprobs = true;
    let mut rx = submit(&mut s, r);
    s.step();
    let r = s.running.remove(0);
    assert!(!r.prompt_sent && r.prompt_done == 512, "{}", r.prompt_done);
    s.preempt(r);
    run_idle(&mut s, 200);
    let mut v = Seen::default();
    v.take(&mut rx);
    assert_eq!(v.tokens, plain.tokens, "the preempted answer changed");
    check(
        v.prompt.expect("the prompt's log-probabilities"),
        "preempted",
    );
}

#[test]
fn requests_whose_clients_left_hold_no_place_in_the_queue() {
    let mut rng = Rng::new(34);
    let mut s = sched(4096, cfg(1, 3));
    let _running = submit(&mut s, req_of("a", "a0", prompt(&mut rng, 5), 50));
    s.step();
    // three queued, then their clients leave: a full queue takes a new request at once
    let gone: Vec<_> = (1..4)
        .map(|i| {
            submit(
                &mut s,
                req_of("b", &format!("b{i}"), prompt(&mut rng, 5), 8),
            )
        })
        .collect();
    assert_eq!(s.waiting.len(), 3);
    drop(gone);
    let mut rx = submit(&mut s, req_of("b", "b4", prompt(&mut rng, 5), 8));
    assert!(drain(&mut rx).is_empty(), "b4 was refused");
    assert_eq!(s.waiting.len(), 1);
    // and a step drops a waiting request whose client left (alive, c0 would wait: b4 takes
    // the one place past the batch)
    let gone = submit(&mut s, req_of("c", "c0", prompt(&mut rng, 1), 8));
    drop(gone);
    s.step();
    assert!(s.waiting.is_empty());
    let ids: Vec<&str> = s.running.iter().map(|r| r.req.id.as_str()).collect();
    assert_eq!(ids, ["a0", "b4"]);
    assert_eq!(s.snapshot().cancelled, 4);
}

/// [`cfg`] of 8 places and 64 waiting, with a step of at most `step_tokens`.
fn chunked(step_tokens: usize) -> SchedulerConfig {
    SchedulerConfig {
        step_tokens,
        ..cfg(8, 64)
    }
}

/// Runs `reqs` (prompt, max_tokens) arriving one step apart under `step_tokens`; each one's
/// tokens, and the steps from its arrival to its first token.
fn run_arriving(step_tokens: usize, reqs: &[(Vec<u32>, usize)]) -> Vec<(Vec<u32>, usize)> {
    let mut s = sched(
        8192,
        SchedulerConfig {
            step_tokens,
            ..cfg(8, 64)
        },
    );
    let mut rxs: Vec<(UnboundedReceiver<Event>, Seen, usize, Option<usize>)> = Vec::new();
    let mut steps = 0;
    while rxs.len() < reqs.len() || rxs.iter().any(|(_, v, _, _)| !v.ended()) {
        if let Some((p, m)) = reqs.get(rxs.len()) {
            let rx = submit(&mut s, req(&format!("r{}", rxs.len()), p.clone(), *m));
            rxs.push((rx, Seen::default(), steps, None));
        }
        s.step();
        steps += 1;
        assert!(steps < 2000, "still busy after {steps} steps");
        assert_eq!(s.engine.kv.used_blocks(), reserved(&s), "KV blocks leaked");
        for (rx, v, at, first) in &mut rxs {
            v.take(rx);
            if first.is_none() && !v.tokens.is_empty() {
                *first = Some(steps - *at);
            }
        }
    }
    rxs.into_iter()
        .map(|(_, v, _, first)| {
            assert_eq!(v.finish, Some("length"), "{v:?}");
            (v.tokens, first.unwrap_or(0))
        })
        .collect()
}

#[test]
fn a_long_prompt_goes_in_chunks_and_every_stream_is_the_unchunked_one() {
    // two short requests decode while a 700-token prompt arrives, then a short prompt
    // arrives behind it: with 64 tokens a step the decoding requests take a token every
    // step, the short prompt answers at once beside the long one, and every stream is
    // bitwise what it is with no bound (the step is batch-invariant)
    let mut rng = Rng::new(31);
    let reqs = vec![
        (prompt(&mut rng, 5), 40),
        (prompt(&mut rng, 7), 40),
        (prompt(&mut rng, 700), 6),
        (prompt(&mut rng, 9), 4),
    ];
    let whole = run_arriving(0, &reqs);
    let chunked = run_arriving(64, &reqs);
    for (i, (w, c)) in whole.iter().zip(&chunked).enumerate() {
        assert_eq!(w.0, c.0, "request {i}: chunked prefill changed its tokens");
    }
    // unbounded: the long prompt's first token comes with its one prefill step
    assert_eq!(whole[2].1, 1);
    // 700 tokens at most 64 a step: at least 11 steps
    assert!(
        chunked[2].1 >= 11,
        "the long prompt answered after {} steps",
        chunked[2].1
    );
    // the short prompt behind it is answered in its first step
    assert_eq!(chunked[3].1, 1, "the short prompt waited for the long one");
}

#[test]
fn decoding_rows_take_a_token_every_step_while_a_long_prompt_is_prefilled() {
    let mut rng = Rng::new(32);
    let mut s = sched(8192, chunked(32));
    let mut a = submit(&mut s, req("a", prompt(&mut rng, 4), 60));
    s.step();
    let mut av = Seen::default();
    av.take(&mut a);
    assert_eq!(av.tokens.len(), 1);
    let mut long = submit(&mut s, req("long", prompt(&mut rng, 300), 2));
    let mut lv = Seen::default();
    let mut steps = 0;
    let at = |s: &Scheduler| {
        s.running
            .iter()
            .find(|r| r.req.id == "long")
            .map_or(0, |r| r.kv.len)
    };
    while lv.tokens.is_empty() {
        let before = at(&s);
        s.step();
        steps += 1;
        av.take(&mut a);
        lv.take(&mut long);
        // the step feeds at most 32 tokens: the decoding row's one and 31 of the prompt
        assert!(
            at(&s) - before <= 31,
            "{} tokens in a step",
            at(&s) - before
        );
        assert_eq!(
            av.tokens.len(),
            1 + steps,
            "the decoding row skipped a step"
        );
        assert!(
            steps <= 12,
            "300 tokens at 31 a step take 10 steps, not {steps}"
        );
    }
    assert_eq!(steps, 10, "300 tokens at 31 a step");
    run_idle(&mut s, 100);
}

/// Client "a" streams while client "b"'s 700-token prompt is prefilled 63 tokens a step
/// (the steps' time shared or not): a's tokens and b's chunk steps until b's first token,
/// and a's whole answer.
fn beside_a_long_prompt(share_time: bool) -> (usize, usize, Vec<u32>) {
    let mut rng = Rng::new(33);
    let mut s = sched(
        8192,
        SchedulerConfig {
            share_time,
            ..chunked(64)
        },
    );
    let mut a = submit(&mut s, req_of("a", "a", prompt(&mut rng, 4), 200));
    s.step();
    let mut av = Seen::default();
    av.take(&mut a);
    let mut b = submit(&mut s, req_of("b", "b", prompt(&mut rng, 700), 2));
    let mut bv = Seen::default();
    let at = |s: &Scheduler| {
        s.running
            .iter()
            .find(|r| r.req.id == "b")
            .map_or(0, |r| r.kv.len)
    };
    let (before, mut chunks) = (av.tokens.len(), 0);
    for _ in 0..1000 {
        let fed = at(&s);
        s.step();
        chunks += (at(&s) > fed) as usize;
        av.take(&mut a);
        bv.take(&mut b);
        if !bv.tokens.is_empty() {
            break;
        }
    }
    assert!(!bv.tokens.is_empty(), "b's prompt starved");
    let during = av.tokens.len() - before;
    run_idle(&mut s, 400);
    av.take(&mut a);
    assert_eq!(av.finish, Some("length"));
    (during, chunks, av.tokens)
}

#[test]
fn a_client_sending_a_long_prompt_shares_the_steps_time_with_another_clients_stream() {
    // without the share a takes one token per chunk step of b's; with it, after each chunk
    // (63 tokens against a's one) b's prompt sits out for as long as the chunk took, so a
    // takes several tokens per chunk; a's answer is the same
    let (alone_during, alone_chunks, alone_tokens) = beside_a_long_prompt(false);
    assert_eq!(alone_chunks, 12, "700 tokens at 63 a step");
    assert_eq!(
        alone_during, alone_chunks,
        "no share: one token of a per chunk"
    );
    let (during, chunks, tokens) = beside_a_long_prompt(true);
    assert_eq!(chunks, 12);
    eprintln!("a took {during} tokens beside b's {chunks} chunk steps (no share: {alone_during})");
    assert!(
        during >= 2 * chunks,
        "a took {during} tokens beside b's {chunks} chunk steps"
    );
    assert_eq!(tokens, alone_tokens, "the share changed a's answer");
}

#[test]
fn a_burst_of_long_prompts_does_not_take_the_cache_from_another_clients_request() {
    // b sends six 700-token prompts at once into a cache that holds all six (44 blocks
    // each, 268 in all); a short request of a's comes 3 steps later. Prefills go 64 tokens a
    // step, so admitted together the six would hold the cache for ~70 steps; b has only
    // 2,048 prompt tokens admitted at a time, and a is answered at once
    let mut rng = Rng::new(34);
    let mut s = sched(268 * BLOCK, chunked(64));
    let mut bs: Vec<_> = (0..6)
        .map(|i| {
            let r = req_of("b", &format!("b{i}"), prompt(&mut rng, 700), 4);
            (submit(&mut s, r), Seen::default())
        })
        .collect();
    for _ in 0..3 {
        s.step();
    }
    let admitted = s.running.len();
    assert!(admitted <= 3, "{admitted} of b's prompts admitted at once");
    let mut a = submit(&mut s, req_of("a", "a", prompt(&mut rng, 5), 3));
    let mut av = Seen::default();
    let mut steps = 0;
    while av.tokens.is_empty() {
        s.step();
        steps += 1;
        av.take(&mut a);
        assert!(steps <= 3, "a waited {steps} steps behind b's burst");
    }
    run_idle(&mut s, 1000);
    av.take(&mut a);
    assert_eq!(av.finish, Some("length"));
    for (rx, v) in &mut bs {
        v.take(rx);
        assert_eq!(v.finish, Some("length"), "{v:?}");
    }
}

#[test]
fn a_clients_prompt_goes_on_beside_its_own_and_another_clients_streams() {
    // a and c each stream; a then sends a 700-token prompt. Its chunks sit out for their
    // own time after each (the share), but go on: it is answered long before c's stream
    // ends (an earlier share counted decoding time too, and held the prompt until then)
    let mut rng = Rng::new(35);
    let mut s = sched(8192, chunked(64));
    let _a = submit(&mut s, req_of("a", "a0", prompt(&mut rng, 4), 1500));
    let mut c = submit(&mut s, req_of("c", "c0", prompt(&mut rng, 4), 1500));
    for _ in 0..3 {
        s.step();
    }
    let mut p = submit(&mut s, req_of("a", "a1", prompt(&mut rng, 700), 2));
    let (mut pv, mut cv) = (Seen::default(), Seen::default());
    for _ in 0..1400 {
        s.step();
        pv.take(&mut p);
        cv.take(&mut c);
        if !pv.tokens.is_empty() {
            break;
        }
    }
    assert!(!pv.tokens.is_empty(), "a's prompt never answered");
    assert!(
        !cv.ended(),
        "a's prompt waited for c's stream to end ({} tokens)",
        cv.tokens.len()
    );
}

#[test]
fn a_short_request_is_admitted_beside_its_own_clients_long_prompt() {
    // one client (one key, one proxy): a 1,500-token prompt past the 512-token budget of
    // pending prompt tokens, another waiting behind it, then a 9-token request, which is
    // held behind neither
    let mut rng = Rng::new(36);
    let mut s = sched(
        8192,
        SchedulerConfig {
            prefill_budget: 512,
            ..chunked(64)
        },
    );
    let _long = submit(&mut s, req("long", prompt(&mut rng, 1500), 2));
    s.step();
    let _long2 = submit(&mut s, req("long2", prompt(&mut rng, 1500), 2));
    s.step();
    assert_eq!(s.waiting.len(), 1, "the second long prompt waits");
    let mut short = submit(&mut s, req("short", prompt(&mut rng, 9), 2));
    let mut v = Seen::default();
    let mut steps = 0;
    while v.tokens.is_empty() {
        s.step();
        steps += 1;
        v.take(&mut short);
        assert!(steps <= 2, "the short request waited {steps} steps");
    }
    run_idle(&mut s, 200);
}
