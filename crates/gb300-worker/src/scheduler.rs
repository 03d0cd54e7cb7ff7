//! Continuous batching (Orca, Yu et al. OSDI'22): requests join and leave at every step.
//! The scheduler thread owns the engine. Each step it drains commands, admits waiting
//! requests while their whole KV budget (prompt + max_tokens) fits and the step's prefill
//! budget lasts, runs one step over every running sequence (decodes) and the admitted ones
//! (prefills), samples, and streams a token event to each request. A request whose
//! receiver is gone (the client left) is cancelled and its KV blocks are freed at once.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use moelane_engine::kv::{KvCache, SeqKv};
use moelane_engine::sampling::{Sampler, SamplingParams, TokenPick};
use moelane_engine::step::{Engine, SeqStep};
use moelane_proto::Category;
use tokio::sync::mpsc::{Receiver, UnboundedSender};
use tokio::sync::oneshot;

/// A validated generation request.
#[derive(Clone, Debug)]
pub struct ValidGen {
    pub id: String,
    pub prompt: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop_ids: Vec<u32>,
    /// The request's trace span ("generate"); queue, prefill and decode are its children.
    pub span: tracing::Span,
}

/// What a request's stream carries.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token {
        token: u32,
        completion_tokens: u32,
        elapsed_ns: u64,
    },
    Finish {
        reason: &'static str,
        prompt_tokens: u32,
        completion_tokens: u32,
        elapsed_ns: u64,
    },
    Error {
        category: Category,
        message: String,
    },
}

/// A snapshot of the scheduler for stats endpoints.
#[derive(Clone, Debug, Default)]
pub struct Snapshot {
    pub running: usize,
    pub waiting: usize,
    pub kv_used: usize,
    pub kv_total: usize,
    pub steps: u64,
    pub tokens_generated: u64,
    pub prompt_tokens: u64,
    pub hot_picks: Vec<u64>,
    pub cold_picks: Vec<u64>,
    pub wait_ns: Vec<u64>,
    pub picks: Vec<Vec<u64>>,
    pub step_ns: u64,
    pub max_step_ns: u64,
    pub finished: u64,
    pub cancelled: u64,
    pub failed: u64,
    pub max_context: usize,
    pub model: String,
    pub epoch: u64,
    pub link: String,
}

/// What the step loop is asked, over its bounded command queue; every reply goes back on a
/// oneshot channel. A request's events use an unbounded channel: the loop must never block
/// on a slow reader, and a request's events are bounded by its `max_tokens` anyway.
pub enum Command {
    Submit(ValidGen, UnboundedSender<Event>),
    Cancel(String, oneshot::Sender<bool>),
    Snapshot(oneshot::Sender<Snapshot>),
    /// Swap PREPARE: put loaded, verified experts into free hot slots.
    Stage(
        Vec<(
            usize,
            usize,
            std::sync::Arc<moelane_engine::checkpoint::ExpertWeights>,
        )>,
        oneshot::Sender<()>,
    ),
    /// Swap COMMIT: route with this map from the next step on.
    Commit(
        Box<moelane_engine::rowmap::ValidMap>,
        oneshot::Sender<moelane_engine::Result<()>>,
    ),
    /// Swap RELEASE or ABORT: free hot slots the current map does not use.
    ReleaseUnused(oneshot::Sender<usize>),
    /// Ends every running and waiting request with an Unavailable error saying why (a drain
    /// whose grace period is over); replies how many it ended.
    EndAll(String, oneshot::Sender<usize>),
    Shutdown,
}

struct Running {
    req: ValidGen,
    tx: UnboundedSender<Event>,
    kv: SeqKv,
    sampler: Sampler,
    next: Vec<u32>,
    generated: u32,
    admitted: Instant,
    /// "prefill" until the first token, then "decode"
    phase: tracing::Span,
}

/// Metric handles, taken once (recording through a handle is an atomic add).
struct Meters {
    step: metrics::Histogram,
    queue: metrics::Gauge,
    batch: metrics::Gauge,
    kv_used: metrics::Gauge,
    kv_free: metrics::Gauge,
}

impl Meters {
    fn new() -> Self {
        use moelane_telemetry::names as n;
        Meters {
            step: metrics::histogram!(n::STEP_DURATION),
            queue: metrics::gauge!(n::QUEUE_DEPTH),
            batch: metrics::gauge!(n::BATCH_SIZE),
            kv_used: metrics::gauge!(n::KV_BLOCKS_USED),
            kv_free: metrics::gauge!(n::KV_BLOCKS_FREE),
        }
    }
}

/// Limits of the scheduler.
#[derive(Clone, Debug)]
pub struct SchedulerConfig {
    /// Most prompt tokens prefilled in one step (at least one whole prompt is admitted).
    pub prefill_budget: usize,
    /// Most sequences running at once.
    pub max_running: usize,
    /// Most requests waiting; beyond, new ones are refused as Overloaded.
    pub max_waiting: usize,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            prefill_budget: 2048,
            max_running: 64,
            max_waiting: 1024,
        }
    }
}

pub struct Scheduler {
    engine: Engine,
    cfg: SchedulerConfig,
    waiting: VecDeque<(ValidGen, UnboundedSender<Event>, tracing::Span)>,
    running: Vec<Running>,
    model: String,
    stats: Snapshot,
    max_iter_ns: u64,
    meters: Meters,
    /// `MOELANE_STEP_PACE_MS`: a sleep after each step that ran requests, for drills and
    /// tests that must land a signal or a fault mid-stream (off unless set).
    pace: Option<std::time::Duration>,
}

impl Scheduler {
    pub fn new(engine: Engine, model: String, cfg: SchedulerConfig) -> Self {
        Scheduler {
            engine,
            cfg,
            waiting: VecDeque::new(),
            running: Vec::new(),
            model,
            stats: Snapshot::default(),
            max_iter_ns: 0,
            meters: Meters::new(),
            pace: std::env::var("MOELANE_STEP_PACE_MS")
                .ok()
                .and_then(|v| v.parse::<u64>().ok())
                .filter(|&ms| ms > 0)
                .map(|ms| std::time::Duration::from_millis(ms.min(10_000))),
        }
    }

    fn snapshot(&self) -> Snapshot {
        let c = &self.engine.counters;
        Snapshot {
            running: self.running.len(),
            waiting: self.waiting.len(),
            kv_used: self.engine.kv.used_blocks(),
            kv_total: self.engine.kv.blocks,
            steps: c.steps,
            hot_picks: c.hot_picks.clone(),
            cold_picks: c.cold_picks.clone(),
            wait_ns: c.wait_ns.clone(),
            picks: c.picks.clone(),
            step_ns: c.step_ns,
            // the longest loop iteration while serving: swap commands handled between steps
            // included, so a stall a swap causes shows here
            max_step_ns: self.max_iter_ns.max(c.max_step_ns),
            max_context: self.engine.cfg.max_position_embeddings,
            model: self.model.clone(),
            epoch: self.engine.map.epoch(),
            link: self
                .engine
                .cold
                .as_ref()
                .map_or("none", |c| c.kind())
                .to_string(),
            ..self.stats.clone()
        }
    }

    fn submit(&mut self, req: ValidGen, tx: UnboundedSender<Event>) {
        let max_ctx = self.engine.cfg.max_position_embeddings;
        let need = req.prompt.len() + req.max_tokens;
        if need > max_ctx {
            let _ = tx.send(Event::Error { category: Category::ContextOverflow, message: format!("prompt of {} tokens plus max_tokens {} exceeds the context of {max_ctx} tokens", req.prompt.len(), req.max_tokens) });
            return;
        }
        let blocks = KvCache::blocks_for(need);
        if blocks > self.engine.kv.blocks {
            let _ = tx.send(Event::Error {
                category: Category::ContextOverflow,
                message: format!(
                    "request needs {blocks} KV blocks ({need} tokens), the cache has {} in all",
                    self.engine.kv.blocks
                ),
            });
            return;
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            let _ = tx.send(Event::Error {
                category: Category::Overloaded,
                message: format!("{} requests already waiting", self.waiting.len()),
            });
            return;
        }
        let queue = tracing::info_span!(parent: &req.span, "queue");
        self.waiting.push_back((req, tx, queue));
    }

    fn cancel(&mut self, id: &str) -> bool {
        let before = self.running.len() + self.waiting.len();
        self.waiting.retain(|(r, tx, _)| {
            let keep = r.id != id;
            if !keep {
                let _ = tx.send(Event::Finish {
                    reason: "cancelled",
                    prompt_tokens: r.prompt.len() as u32,
                    completion_tokens: 0,
                    elapsed_ns: 0,
                });
            }
            keep
        });
        let mut found = false;
        self.running.retain(|r| {
            let keep = r.req.id != id;
            if !keep {
                found = true;
                let _ = r.tx.send(Event::Finish {
                    reason: "cancelled",
                    prompt_tokens: r.req.prompt.len() as u32,
                    completion_tokens: r.generated,
                    elapsed_ns: r.admitted.elapsed().as_nanos() as u64,
                });
            }
            keep
        });
        let gone = before - self.running.len() - self.waiting.len();
        self.stats.cancelled += gone as u64;
        found || gone > 0
    }

    /// Ends every request with an error naming `why`: never a finish it did not reach.
    fn end_all(&mut self, why: &str) -> usize {
        let mut n = 0;
        let err = || Event::Error {
            category: Category::Unavailable,
            message: why.to_string(),
        };
        for (r, tx, _) in self.waiting.drain(..) {
            r.span.record("moelane.finish_reason", "error");
            let _ = tx.send(err());
            n += 1;
        }
        for r in self.running.drain(..) {
            r.req.span.record("moelane.finish_reason", "error");
            let _ = r.tx.send(err());
            n += 1;
        }
        self.stats.failed += n as u64;
        n
    }

    /// Admits waiting requests: FIFO, while KV and the prefill budget allow.
    fn admit(&mut self) -> usize {
        let mut budget = self.cfg.prefill_budget;
        let mut admitted = 0;
        while let Some((req, _, _)) = self.waiting.front() {
            if self.running.len() >= self.cfg.max_running {
                break;
            }
            if admitted > 0 && req.prompt.len() > budget {
                break;
            }
            let need = req.prompt.len() + req.max_tokens;
            let mut kv = self.engine.kv.new_seq();
            if self.engine.kv.reserve(&mut kv, need).is_err() {
                break; // waits for blocks to free up
            }
            let Some((req, tx, queue)) = self.waiting.pop_front() else {
                break;
            };
            drop(queue);
            if tx.is_closed() {
                self.stats.cancelled += 1;
                continue;
            }
            budget = budget.saturating_sub(req.prompt.len());
            let sampler = Sampler::new(req.sampling.clone());
            let next = req.prompt.clone();
            let phase = tracing::info_span!(
                parent: &req.span,
                "prefill",
                gen_ai.usage.input_tokens = req.prompt.len()
            );
            self.running.push(Running {
                phase,
                req,
                tx,
                kv,
                sampler,
                next,
                generated: 0,
                admitted: Instant::now(),
            });
            admitted += 1;
        }
        admitted
    }

    fn step(&mut self) {
        // drop requests whose client left, before spending compute on them
        let before = self.running.len();
        self.running.retain(|r| !r.tx.is_closed());
        self.stats.cancelled += (before - self.running.len()) as u64;
        self.admit();
        if self.running.is_empty() {
            return;
        }
        // each request's next token: greedy or its next draw, picked where the logits are
        // (on the GPU they never leave it)
        let picks: Vec<TokenPick> = self
            .running
            .iter_mut()
            .map(|r| r.sampler.next_pick())
            .collect();
        let result = {
            let mut steps: Vec<SeqStep> = self
                .running
                .iter_mut()
                .map(|r| SeqStep {
                    kv: &mut r.kv,
                    tokens: &r.next,
                })
                .collect();
            self.engine.step_pick(&mut steps, &picks)
        };
        let ids = match result {
            Ok(l) => l,
            Err(e) => {
                let category = crate::category(&e);
                for r in self.running.drain(..) {
                    let _ = r.tx.send(Event::Error {
                        category,
                        message: format!("step failed: {e}"),
                    });
                    self.stats.failed += 1;
                }
                return;
            }
        };
        let mut keep = Vec::with_capacity(self.running.len());
        for (i, mut r) in self.running.drain(..).enumerate() {
            if r.generated == 0 {
                self.stats.prompt_tokens += r.req.prompt.len() as u64;
            }
            let tok = ids[i];
            if r.generated == 0 {
                r.phase = tracing::info_span!(
                    parent: &r.req.span,
                    "decode",
                    gen_ai.usage.output_tokens = tracing::field::Empty
                );
            }
            let elapsed_ns = r.admitted.elapsed().as_nanos() as u64;
            let stop = r.req.stop_ids.contains(&tok);
            if !stop {
                r.generated += 1;
                self.stats.tokens_generated += 1;
                if r.tx
                    .send(Event::Token {
                        token: tok,
                        completion_tokens: r.generated,
                        elapsed_ns,
                    })
                    .is_err()
                {
                    self.stats.cancelled += 1;
                    continue; // client gone: KV freed as `r` drops
                }
            }
            let done = if stop {
                Some("stop")
            } else if r.generated as usize >= r.req.max_tokens {
                Some("length")
            } else {
                None
            };
            match done {
                Some(reason) => {
                    r.phase.record("gen_ai.usage.output_tokens", r.generated);
                    r.req.span.record("moelane.finish_reason", reason);
                    r.req.span.record("gen_ai.usage.output_tokens", r.generated);
                    let _ = r.tx.send(Event::Finish {
                        reason,
                        prompt_tokens: r.req.prompt.len() as u32,
                        completion_tokens: r.generated,
                        elapsed_ns,
                    });
                    self.stats.finished += 1;
                }
                None => {
                    r.next = vec![tok];
                    keep.push(r);
                }
            }
        }
        self.running = keep;
    }

    /// The loop: blocks on the command channel when idle, steps while there is work.
    /// Runs on its own thread (not a runtime's): it blocks on the queue only when idle, and
    /// ends on `Shutdown`, when every sender is gone, or when `stop` is set.
    pub fn run(mut self, mut rx: Receiver<Command>, stop: &AtomicBool) {
        loop {
            if stop.load(Ordering::Acquire) {
                return;
            }
            let idle = self.running.is_empty() && self.waiting.is_empty();
            let first = if idle {
                match rx.blocking_recv() {
                    Some(c) => Some(c),
                    None => return,
                }
            } else {
                None
            };
            let iter_start = (!idle).then(Instant::now);
            for cmd in first
                .into_iter()
                .chain(std::iter::from_fn(|| rx.try_recv().ok()))
            {
                match cmd {
                    Command::Submit(req, tx) => self.submit(req, tx),
                    Command::Cancel(id, reply) => {
                        let _ = reply.send(self.cancel(&id));
                    }
                    Command::Snapshot(reply) => {
                        let _ = reply.send(self.snapshot());
                    }
                    Command::Stage(loaded, reply) => {
                        self.engine.stage(loaded);
                        let _ = reply.send(());
                    }
                    Command::Commit(map, reply) => {
                        let _ = reply.send(self.engine.commit(*map));
                    }
                    Command::ReleaseUnused(reply) => {
                        let _ = reply.send(self.engine.release_unused());
                    }
                    Command::EndAll(why, reply) => {
                        let _ = reply.send(self.end_all(&why));
                    }
                    Command::Shutdown => return,
                }
            }
            self.step();
            if let Some(p) = self.pace.filter(|_| !self.running.is_empty()) {
                std::thread::sleep(p);
            }
            let m = &self.meters;
            if let Some(t) = iter_start {
                let ns = t.elapsed().as_nanos() as u64;
                self.max_iter_ns = self.max_iter_ns.max(ns);
                m.step.record(ns as f64 * 1e-9);
            }
            {
                m.queue.set(self.waiting.len() as f64);
                m.batch.set(self.running.len() as f64);
                let used = self.engine.kv.used_blocks();
                m.kv_used.set(used as f64);
                m.kv_free
                    .set(self.engine.kv.blocks.saturating_sub(used) as f64);
            }
        }
    }
}

#[cfg(test)]
mod tests;
