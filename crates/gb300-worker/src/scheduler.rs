//! Continuous batching (Orca, Yu et al. OSDI'22): requests join and leave at every step.
//! The scheduler thread owns the engine. Each step it drains commands, admits waiting
//! requests while their prompt fits the KV cache and the step's prefill budget lasts, runs
//! one step over every running sequence (decodes) and the admitted ones (prefills), samples,
//! and streams a token event to each request. A request whose receiver is gone (the client
//! left) is cancelled and its KV blocks are freed at once.
//!
//! KV is taken on demand (vLLM's paged attention, Kwon et al. SOSP'23): a sequence holds the
//! blocks of the positions it has written, one more block as it crosses a block boundary,
//! never its whole `max_tokens` up front. When the cache cannot hold every running
//! sequence's next token, the latest arrivals are preempted: their blocks are freed and they
//! wait, ahead of new requests, to be admitted again with their prompt and the tokens they
//! generated recomputed in one prefill. The step is batch-invariant and the sampler keeps
//! its place, so a preempted request's stream is the one it would have produced unpreempted.
//!
//! The batch and the queue are shared fairly among clients (the gateway names each request's
//! client: its API key, or its address). The next sequence admitted is the oldest of the
//! client running the fewest; a client with nothing running gets a place even past a full
//! batch (a few such places: a place rather than a preemption, which would cost a recompute
//! each time a client's short request came); and a full queue refuses the latest request of
//! the client holding the most places in it rather than another client's. With one client
//! this is first come, first served.

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use moelane_engine::kv::{KvCache, SeqKv};
use moelane_engine::sampling::{LogitRules, Sampler, SamplingParams, TokenPick};
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
    /// Penalties, bias and log-probabilities: a request with any takes its logits on the host.
    pub rules: LogitRules,
    /// The grammar its tokens must follow (structured output), picked on the host.
    pub constraint: Option<moelane_text::grammar::Constraint>,
    pub stop_ids: Vec<u32>,
    /// The request's trace span ("generate"); queue, prefill and decode are its children.
    pub span: tracing::Span,
    /// Whom the request is accounted to: the batch and the queue are shared fairly among
    /// clients (empty: one anonymous client).
    pub client: String,
    /// Send the prompt's log-probabilities (the request's `logprobs` top count applies).
    pub prompt_logprobs: bool,
    /// The grammar's first mask, made with its compile (off the step loop), and its seconds.
    pub first_mask: Option<Box<(Result<moelane_text::grammar::Mask, String>, f64)>>,
}

/// What a request's stream carries.
#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    Token {
        token: u32,
        completion_tokens: u32,
        elapsed_ns: u64,
        /// When asked: the token's log-probability and the most likely tokens' (boxed: most
        /// requests carry none).
        logprobs: Option<Box<TokenLogprobs>>,
    },
    /// Log-probabilities of prompt tokens (each given those before it), in prompt order from
    /// the second token, a chunk at a time, all before the first token.
    Prompt(Box<Vec<(u32, TokenLogprobs)>>),
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

/// A generated token's log-probability and the `top_logprobs` most likely tokens' (id,
/// log-probability), under the logits after bias, penalties and the grammar's mask, before
/// temperature and top_p.
#[derive(Clone, Debug, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    pub top: Vec<(u32, f32)>,
}

/// What the client is told when its grammar cannot go on after `generated` tokens: the
/// first line of the parser's reason (a limit it hit, say), cut, without its trailing state.
fn grammar_failure(e: &str, generated: u32) -> String {
    let first = e.lines().next().unwrap_or_default().trim();
    let first = first.strip_prefix("parser error: ").unwrap_or(first);
    let mut reason: String = first.chars().take(200).collect();
    if reason.len() < first.len() {
        reason.push_str("...");
    }
    format!(
        "the request's grammar (response_format) could not continue the answer after \
         {generated} tokens: {reason}"
    )
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
    /// Requests ended by their own fault mid-answer (a grammar that could not go on): not
    /// the lane's failures.
    pub refused: u64,
    /// Sequences preempted because the KV cache was full.
    pub preemptions: u64,
    pub max_context: usize,
    pub model: String,
    pub epoch: u64,
    pub link: String,
}

/// What the step loop is asked, over its bounded command queue; every reply goes back on a
/// oneshot channel. A request's events use an unbounded channel: the loop must never block
/// on a slow reader, and a request's events are bounded by its `max_tokens` anyway.
pub enum Command {
    Submit(Box<ValidGen>, UnboundedSender<Event>),
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

/// Where the next sequence to admit waits (an index into that queue).
#[derive(Clone, Copy, Debug, PartialEq)]
enum Next {
    Preempted(usize),
    Waiting(usize),
}

struct Running {
    req: ValidGen,
    tx: UnboundedSender<Event>,
    kv: SeqKv,
    sampler: Sampler,
    /// The tokens the next step feeds: the prompt (and, after a preemption, the tokens
    /// generated so far) at admission, then the last generated token.
    next: Vec<u32>,
    /// Every token generated so far, for the recompute after a preemption.
    out: Vec<u32>,
    /// (token, times generated), for the penalties; kept only when the request has some.
    counts: Vec<(u32, u32)>,
    /// Arrival order: the latest arrivals are preempted first and readmitted last.
    arrival: u64,
    generated: u32,
    admitted: Instant,
    /// "prefill" until the first token, then "decode"
    phase: tracing::Span,
    /// The grammar's mask for the next pick, once made (and the seconds it took).
    mask: Option<(Result<moelane_text::grammar::Mask, String>, f64)>,
    /// The grammar's constraint is at a mask worker (`true`: the slow one).
    masking: Option<bool>,
    /// Seconds the grammar's last mask took (past [`masks::SLOW`]: the next on the slow
    /// worker).
    mask_secs: f64,
    /// A step's logits row and pick rule, kept while the row waits for its grammar's mask
    /// (it sits out the steps until the mask comes).
    held: Option<(Vec<f32>, TokenPick)>,
    /// The pick drawn for a held row that was preempted: its recomputed logits take it.
    repick: Option<TokenPick>,
    /// Prompt log-probabilities sent so far (asked for: the prompt is prefilled in chunks of
    /// [`Scheduler::prompt_chunk`] tokens, every one's logits taken, each chunk's sent), and
    /// whether the whole prompt's were.
    prompt_done: usize,
    prompt_sent: bool,
}

impl Running {
    /// Whether this step computes prompt log-probabilities for the row.
    fn wants_prompt(&self) -> bool {
        self.req.prompt_logprobs && !self.prompt_sent
    }

    /// Whether the request follows a grammar.
    fn constrained(&self) -> bool {
        self.req.constraint.is_some() || self.masking.is_some() || self.mask.is_some()
    }
}

/// Metric handles, taken once (recording through a handle is an atomic add).
struct Meters {
    step: metrics::Histogram,
    queue: metrics::Gauge,
    batch: metrics::Gauge,
    kv_used: metrics::Gauge,
    kv_free: metrics::Gauge,
    preemptions: metrics::Counter,
    fair_over: metrics::Counter,
    fair_refused: metrics::Counter,
    fair_deferred: metrics::Counter,
    grammar: metrics::Histogram,
    grammar_mask: metrics::Histogram,
    grammar_held: metrics::Counter,
    prefill_chunks: metrics::Counter,
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
            preemptions: metrics::counter!(n::KV_PREEMPTIONS),
            fair_over: metrics::counter!(n::FAIR_SHARE, "action" => "over_batch"),
            fair_refused: metrics::counter!(n::FAIR_SHARE, "action" => "refused"),
            fair_deferred: metrics::counter!(n::FAIR_SHARE, "action" => "prefill_deferred"),
            grammar: metrics::histogram!(n::GRAMMAR_STEP),
            grammar_mask: metrics::histogram!(n::GRAMMAR_MASK),
            grammar_held: metrics::counter!(n::GRAMMAR_HELD),
            prefill_chunks: metrics::counter!(n::PREFILL_CHUNKS),
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
    /// Most tokens one step feeds (0: no bound): each decoding sequence's one, and prompts
    /// (or recomputes after a preemption) share the rest, a longer prompt going in chunks
    /// over several steps, so a long prompt delays the others' next tokens by one chunk's
    /// step, not its whole prefill.
    pub step_tokens: usize,
    /// Whether clients share the steps' time: after a step in which a client's prompt took
    /// time beside another client's rows, its prompts sit out until as much time has gone
    /// to other steps; see [`Scheduler::feed`].
    pub share_time: bool,
}

impl Default for SchedulerConfig {
    fn default() -> Self {
        SchedulerConfig {
            prefill_budget: 2048,
            max_running: 64,
            max_waiting: 1024,
            step_tokens: 512,
            share_time: true,
        }
    }
}

pub struct Scheduler {
    engine: Engine,
    cfg: SchedulerConfig,
    waiting: VecDeque<(ValidGen, UnboundedSender<Event>, tracing::Span)>,
    running: Vec<Running>,
    /// Preempted sequences, oldest arrival first: admitted again before any new request.
    preempted: VecDeque<Running>,
    arrivals: u64,
    model: String,
    stats: Snapshot,
    max_iter_ns: u64,
    meters: Meters,
    /// Makes the grammars' next masks while the step runs.
    masks: masks::MaskWorker,
    /// Seconds of step time since the start (the clock of [`Self::held_until`]).
    clock: f64,
    /// Clients whose prompts sit out steps until [`Self::clock`] passes the time given.
    held_until: HashMap<String, f64>,
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
            preempted: VecDeque::new(),
            arrivals: 0,
            model,
            stats: Snapshot::default(),
            max_iter_ns: 0,
            meters: Meters::new(),
            masks: masks::MaskWorker::default(),
            clock: 0.0,
            held_until: HashMap::new(),
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
            waiting: self.waiting.len() + self.preempted.len(),
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
        // the prompt and the first generated token must fit the whole cache; past that the
        // sequence grows as it generates, and ends with "length" if alone it fills the cache
        let blocks = KvCache::blocks_for(req.prompt.len() + 1);
        if blocks > self.engine.kv.blocks {
            let _ = tx.send(Event::Error {
                category: Category::ContextOverflow,
                message: format!(
                    "a prompt of {} tokens needs {blocks} KV blocks, the lane's cache has {} in all",
                    req.prompt.len(),
                    self.engine.kv.blocks
                ),
            });
            return;
        }
        if self.waiting.len() >= self.cfg.max_waiting {
            // requests whose clients left give their places back first
            let before = self.waiting.len();
            self.waiting.retain(|(_, tx, _)| !tx.is_closed());
            self.stats.cancelled += (before - self.waiting.len()) as u64;
        }
        if self.waiting.len() >= self.cfg.max_waiting && !self.give_up_a_place(&req.client) {
            let _ = tx.send(Event::Error {
                category: Category::Overloaded,
                message: format!("{} requests already waiting", self.waiting.len()),
            });
            return;
        }
        let queue = tracing::info_span!(parent: &req.span, "queue");
        self.waiting.push_back((req, tx, queue));
    }

    /// The queue is full and `client` asks for a place: the client holding the most places,
    /// if it holds at least two more than `client`, gives up its latest (refused as
    /// Overloaded, which a gateway retries on another lane). Whether a place was freed.
    fn give_up_a_place(&mut self, client: &str) -> bool {
        let mut held: HashMap<&str, usize> = HashMap::new();
        for (r, _, _) in &self.waiting {
            *held.entry(r.client.as_str()).or_default() += 1;
        }
        let mine = held.get(client).copied().unwrap_or(0);
        let Some((hog, most)) = held.into_iter().max_by_key(|&(_, n)| n) else {
            return false;
        };
        if most < mine + 2 {
            return false;
        }
        let hog = hog.to_string();
        let Some(i) = self.waiting.iter().rposition(|(r, _, _)| r.client == hog) else {
            return false;
        };
        let Some((r, tx, _)) = self.waiting.remove(i) else {
            return false;
        };
        r.span.record("moelane.finish_reason", "error");
        let _ = tx.send(Event::Error {
            category: Category::Overloaded,
            message: format!(
                "the lane's queue is full ({} waiting) and this request's client holds {most} \
                 places in it, the most: its latest request gives its place to another client",
                self.cfg.max_waiting
            ),
        });
        self.meters.fair_refused.increment(1);
        true
    }

    /// Sequences running per client.
    fn running_per_client(&self) -> HashMap<&str, usize> {
        let mut n: HashMap<&str, usize> = HashMap::new();
        for r in &self.running {
            *n.entry(r.req.client.as_str()).or_default() += 1;
        }
        n
    }

    /// The next sequence to admit and how many its client runs now: of the clients with a
    /// sequence waiting (preempted or new), the one running the fewest (the earliest such
    /// on a tie); its oldest preempted sequence first, else its oldest request not in `skip`
    /// (request ids held back this admission).
    fn next_candidate(&self, skip: &HashSet<String>) -> Option<(Next, usize)> {
        let running = self.running_per_client();
        let mut seen: HashSet<&str> = HashSet::new();
        let mut best: Option<(Next, usize)> = None;
        let candidates = (self.preempted.iter().enumerate())
            .map(|(i, r)| (Next::Preempted(i), r.req.client.as_str()))
            .chain(
                (self.waiting.iter().enumerate())
                    .filter(|(_, (r, _, _))| !skip.contains(&r.id))
                    .map(|(i, (r, _, _))| (Next::Waiting(i), r.client.as_str())),
            );
        for (next, client) in candidates {
            if !seen.insert(client) {
                continue;
            }
            let n = running.get(client).copied().unwrap_or(0);
            if best.is_none_or(|(_, b)| n < b) {
                best = Some((next, n));
                if n == 0 {
                    break;
                }
            }
        }
        best
    }

    /// Prompt (or recompute) tokens `client`'s running sequences have still to feed.
    fn prompt_backlog(&self, client: &str) -> usize {
        self.running
            .iter()
            .filter(|r| r.req.client == client && r.next.len() > 1)
            .map(|r| r.next.len())
            .sum()
    }

    /// Prompt (or recompute) tokens of a candidate.
    fn candidate_len(&self, next: Next) -> usize {
        match next {
            Next::Preempted(i) => self.preempted.get(i).map_or(0, |r| r.next.len()),
            Next::Waiting(i) => self.waiting.get(i).map_or(0, |(r, _, _)| r.prompt.len()),
        }
    }

    /// Whether the cache takes a prefill of `len` tokens now (its first generated token and
    /// a block of growth for each running sequence included).
    fn fits(&self, len: usize) -> bool {
        KvCache::blocks_for(len + 1) + self.running.len() <= self.engine.kv.free_blocks()
    }

    /// Frees `r`'s blocks and puts it with the preempted sequences (by arrival), its prompt
    /// and generated tokens to recompute when it is admitted again.
    fn preempt(&mut self, mut r: Running) {
        r.kv = self.engine.kv.new_seq();
        // a row waiting for its mask: the recompute makes its logits again, and its pick
        // (already drawn) is kept for them
        r.repick = r.held.take().map(|(_, pick)| pick);
        r.next = r.req.prompt.iter().chain(&r.out).copied().collect();
        self.stats.preemptions += 1;
        let at = self
            .preempted
            .iter()
            .position(|p| p.arrival > r.arrival)
            .unwrap_or(self.preempted.len());
        self.preempted.insert(at, r);
    }

    fn cancel(&mut self, id: &str) -> bool {
        let before = self.running.len() + self.waiting.len() + self.preempted.len();
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
        let mut end = |r: &Running| {
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
        };
        self.running.retain(&mut end);
        self.preempted.retain(end);
        let gone = before - self.running.len() - self.waiting.len() - self.preempted.len();
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
        for r in self.running.drain(..).chain(self.preempted.drain(..)) {
            r.req.span.record("moelane.finish_reason", "error");
            let _ = r.tx.send(err());
            n += 1;
        }
        self.stats.failed += n as u64;
        n
    }

    /// Admits the next candidate ([`Self::next_candidate`]: the client running the fewest
    /// first; a client's preempted sequences before its new requests) while the batch has
    /// room, the prefill budget lasts (one prefill past it), and the cache holds the
    /// prefill, its first generated token and a block of growth for each running sequence.
    /// Past a full batch, a client with nothing running still gets one place (at most
    /// [`Self::over_batch`] such places at once): a place, not a preemption, so a client
    /// sending short requests one after another costs the others no recompute. Nothing is
    /// admitted past a candidate that does not fit, so no one starves.
    ///
    /// A client's new request longer than a step's tokens is not admitted while that
    /// client's running sequences have prompt tokens still to feed and its prompt would take
    /// them past `prefill_budget` (prefills go in chunks; with none pending, one is admitted
    /// whatever its length; short requests and preempted sequences are not held): a burst of long
    /// prompts would otherwise be admitted within a few short steps, its whole prompts' KV
    /// taken, and another client's request would wait for the cache until the burst's
    /// prefills (sharing each step) all but ended.
    fn admit(&mut self) -> usize {
        let mut budget = self.cfg.prefill_budget;
        let mut admitted = 0;
        let mut skip: HashSet<String> = HashSet::new();
        while let Some((next, n)) = self.next_candidate(&skip) {
            let len = self.candidate_len(next);
            // a long request of a client with prompt tokens pending past the budget is passed
            // over: its client's shorter requests behind it may still go
            let passed = match next {
                Next::Waiting(i) if len > self.cfg.step_tokens => self
                    .waiting
                    .get(i)
                    .filter(|(r, _, _)| {
                        let backlog = self.prompt_backlog(&r.client);
                        backlog > 0 && backlog + len > self.cfg.prefill_budget
                    })
                    .map(|(r, _, _)| r.id.clone()),
                _ => None,
            };
            if let Some(id) = passed {
                skip.insert(id);
                continue;
            }
            let over = self.running.len() >= self.cfg.max_running;
            if over && (n > 0 || self.running.len() >= self.cfg.max_running + self.over_batch()) {
                break;
            }
            if admitted > 0 && len > budget {
                break;
            }
            if !self.fits(len) {
                if self.running.is_empty() && KvCache::blocks_for(len + 1) > self.engine.kv.blocks {
                    // a preempted sequence that outgrew the whole cache: the lane's capacity
                    if let Next::Preempted(i) = next {
                        if let Some(r) = self.preempted.remove(i) {
                            self.finish(r, "length");
                            continue;
                        }
                    }
                }
                break; // waits for blocks to free up
            }
            let mut kv = self.engine.kv.new_seq();
            if self.engine.kv.reserve(&mut kv, len).is_err() {
                break;
            }
            let r = match next {
                Next::Preempted(i) => {
                    let Some(mut r) = self.preempted.remove(i) else {
                        break;
                    };
                    r.kv = kv;
                    r
                }
                Next::Waiting(i) => {
                    let Some((mut req, tx, queue)) = self.waiting.remove(i) else {
                        break;
                    };
                    let first_mask = req.first_mask.take().map(|m| *m);
                    drop(queue);
                    if tx.is_closed() {
                        self.stats.cancelled += 1;
                        continue;
                    }
                    let phase = tracing::info_span!(
                        parent: &req.span,
                        "prefill",
                        gen_ai.usage.input_tokens = req.prompt.len()
                    );
                    self.arrivals += 1;
                    Running {
                        phase,
                        sampler: Sampler::new(req.sampling.clone()),
                        next: req.prompt.clone(),
                        out: Vec::new(),
                        counts: Vec::new(),
                        arrival: self.arrivals,
                        req,
                        tx,
                        kv,
                        generated: 0,
                        admitted: Instant::now(),
                        mask_secs: first_mask.as_ref().map_or(0.0, |m| m.1),
                        mask: first_mask,
                        masking: None,
                        held: None,
                        repick: None,
                        prompt_done: 0,
                        prompt_sent: false,
                    }
                }
            };
            budget = budget.saturating_sub(len);
            self.running.push(r);
            admitted += 1;
            if over {
                self.meters.fair_over.increment(1);
            }
        }
        admitted
    }

    /// Places past `max_running` for clients with nothing running (a quarter of it, at
    /// least one).
    fn over_batch(&self) -> usize {
        (self.cfg.max_running / 4).max(1)
    }

    /// Makes room in the cache for every running sequence's next tokens: while it cannot
    /// hold them all, the latest arrival is preempted (its blocks freed, its tokens kept for
    /// the recompute). A sequence that alone fills the cache ends with "length".
    fn make_room(&mut self) {
        loop {
            let need: usize = self
                .running
                .iter()
                .map(|r| {
                    KvCache::blocks_for(r.kv.len + r.next.len()).saturating_sub(r.kv.blocks.len())
                })
                .sum();
            if need <= self.engine.kv.free_blocks() {
                return;
            }
            let Some(v) = (0..self.running.len()).max_by_key(|&i| self.running[i].arrival) else {
                return;
            };
            let r = self.running.remove(v);
            if self.running.is_empty() {
                self.finish(r, "length");
                return;
            }
            // its blocks go back now; it comes back with everything it has seen to recompute
            self.meters.preemptions.increment(1);
            self.preempt(r);
        }
    }

    /// Ends `r` with `reason` (a finish it reached: its tokens were all sent).
    fn finish(&mut self, r: Running, reason: &'static str) {
        r.phase.record("gen_ai.usage.output_tokens", r.generated);
        r.req.span.record("moelane.finish_reason", reason);
        r.req.span.record("gen_ai.usage.output_tokens", r.generated);
        let _ = r.tx.send(Event::Finish {
            reason,
            prompt_tokens: r.req.prompt.len() as u32,
            completion_tokens: r.generated,
            elapsed_ns: r.admitted.elapsed().as_nanos() as u64,
        });
        self.stats.finished += 1;
    }

    fn step(&mut self) {
        // drop requests whose client left, before spending compute on them
        let before = self.running.len() + self.preempted.len() + self.waiting.len();
        self.running.retain(|r| !r.tx.is_closed());
        self.preempted.retain(|r| !r.tx.is_closed());
        // and waiting ones: a queue of requests whose clients left holds no one's place
        self.waiting.retain(|(_, tx, _)| !tx.is_closed());
        let after = self.running.len() + self.preempted.len() + self.waiting.len();
        self.stats.cancelled += (before - after) as u64;
        self.admit();
        self.make_room();
        if self.running.is_empty() {
            return;
        }
        // masks made since the last step; rows that sat out for theirs take their token now
        // and join this step
        for d in self.masks.ready() {
            self.mask_done(d);
        }
        let mut scratch = Vec::new();
        for mut r in std::mem::take(&mut self.running) {
            if r.mask.is_none() {
                self.running.push(r);
                continue;
            }
            let Some((mut row, pick)) = r.held.take() else {
                self.running.push(r);
                continue;
            };
            let (tok, lp) = self.pick_row(&mut r, &mut row, pick, &mut scratch);
            if let Some(r) = self.take_token(r, tok, lp) {
                self.running.push(r);
            }
        }
        let rows: Vec<usize> = (0..self.running.len())
            .filter(|&i| self.running[i].held.is_none())
            .collect();
        // the tokens each row feeds this step (a row whose prompt waits for the budget sits
        // the step out)
        let (active, feed) = self.feed(&rows);
        // whether other clients' rows were in the step (a client's prompt then holds it)
        let shared = {
            let mut c = rows.iter().map(|&i| self.running[i].req.client.as_str());
            let first = c.next();
            c.any(|x| Some(x) != first)
        };
        if active.is_empty() {
            // every row waits for its grammar's mask: wait for one (bounded, so commands
            // are still answered)
            if !self.running.is_empty() {
                if let Some(d) = self.masks.wait(std::time::Duration::from_millis(20)) {
                    self.mask_done(d);
                }
            }
            return;
        }
        // each request's next token: greedy or its next draw, picked where the logits are
        // (on the GPU they never leave it)
        let whole: Vec<bool> = active
            .iter()
            .map(|&i| self.running[i].wants_prompt())
            .collect();
        // a row mid-prompt picks nothing this step: no draw for it
        let picks: Vec<TokenPick> = active
            .iter()
            .zip(&feed)
            .map(|(&i, &f)| {
                let r = &mut self.running[i];
                if f < r.next.len() {
                    TokenPick::Greedy
                } else {
                    r.repick.take().unwrap_or_else(|| r.sampler.next_pick())
                }
            })
            .collect();
        // a request with penalties, a bias, log-probabilities or a grammar takes the logits to
        // the host for the whole step, where the same rule picks every row's token
        let host = active.iter().any(|&i| {
            let r = &self.running[i];
            r.req.rules.on_host() || r.constrained()
        }) || whole.contains(&true);
        // the grammars' next masks are made on the mask workers while the step runs (they
        // depend only on the tokens already followed)
        for &i in &active {
            let r = &mut self.running[i];
            if r.mask.is_some() || r.masking.is_some() {
                continue;
            }
            let Some(c) = r.req.constraint.take() else {
                continue;
            };
            let slow = r.mask_secs > masks::SLOW;
            match self.masks.send(r.arrival, c, slow) {
                Ok(()) => r.masking = Some(slow),
                Err(c) => r.req.constraint = Some(c),
            }
        }
        let t0 = Instant::now();
        let result = {
            let mut steps: Vec<SeqStep> = Vec::with_capacity(active.len());
            let mut at = 0;
            for (i, r) in self.running.iter_mut().enumerate() {
                if active.get(at) == Some(&i) {
                    steps.push(SeqStep {
                        kv: &mut r.kv,
                        tokens: &r.next[..feed[at]],
                    });
                    at += 1;
                }
            }
            if whole.contains(&true) {
                self.engine
                    .step_whole(&mut steps, &whole)
                    .map(|l| (Some(l), Vec::new()))
            } else if host {
                self.engine.step(&mut steps).map(|l| (Some(l), Vec::new()))
            } else {
                self.engine
                    .step_pick(&mut steps, &picks)
                    .map(|ids| (None, ids))
            }
        };
        self.account_step(&active, &feed, t0.elapsed().as_secs_f64(), shared);
        let (mut logits, device_ids) = match result {
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
        // the fast worker's masks of this step: waited for (a row on the slow worker whose
        // mask is not ready sits out until it is)
        if logits.is_some() {
            self.wait_fast_masks(&active);
            // and the slow worker's that are ready
            for d in self.masks.ready() {
                self.mask_done(d);
            }
        }
        let v = self.engine.cfg.vocab_size;
        let mut next = active.iter().peekable();
        // k: the row's place among the active rows; at: its first logits row
        let (mut k, mut at) = (0, 0);
        for (i, mut r) in std::mem::take(&mut self.running).into_iter().enumerate() {
            if next.peek() != Some(&&i) {
                self.running.push(r);
                continue;
            }
            next.next();
            if whole[k] {
                // every fed token's logits row
                if let Some(l) = &logits {
                    self.prompt_logprobs(&mut r, &l[at * v..(at + feed[k]) * v], feed[k]);
                }
                at += feed[k] - 1;
            }
            if feed[k] < r.next.len() {
                // a chunk of its prompt: the rest goes in the next steps, nothing picked yet
                self.meters.prefill_chunks.increment(1);
                r.next.drain(..feed[k]);
                self.running.push(r);
                k += 1;
                at += 1;
                continue;
            }
            if whole[k] {
                r.prompt_sent = true;
            }
            let (tok, lp) = match &mut logits {
                None => (Ok(device_ids[k]), None),
                Some(l) => {
                    let row = &mut l[at * v..(at + 1) * v];
                    if r.masking.is_some() && r.mask.is_none() {
                        // its mask is still being made: the row sits out with its logits
                        r.held = Some((row.to_vec(), picks[k]));
                        r.next.clear();
                        self.meters.grammar_held.increment(1);
                        self.running.push(r);
                        k += 1;
                        at += 1;
                        continue;
                    }
                    self.pick_row(&mut r, row, picks[k], &mut scratch)
                }
            };
            k += 1;
            at += 1;
            if let Some(r) = self.take_token(r, tok, lp) {
                self.running.push(r);
            }
        }
    }

    /// The rows of `rows` (places in `running`) that this step feeds, and the tokens each
    /// feeds: a decoding row its one token; rows with a prompt (or a recompute) to go share
    /// what [`SchedulerConfig::step_tokens`] leaves (at least a quarter of it), in equal
    /// shares, a share a row does not need going to the others, so short prompts finish at
    /// once beside a long one; a prompt whose log-probabilities are asked goes at most
    /// [`Self::prompt_chunk`] a step. A row left no token sits the step out (never all).
    ///
    /// Among clients, the steps' time is shared ([`SchedulerConfig::share_time`]): after a
    /// step in which a client's prompt took time beside another client's rows, that
    /// client's prompts sit out until as much step time has gone by (its decoding rows
    /// always go). A client sending long prompts back to back beside another's streams so
    /// takes at most about half the steps' time, not nearly all of it, and its prompts always
    /// go on within their own chunk's time; alone it is never held.
    fn feed(&mut self, rows: &[usize]) -> (Vec<usize>, Vec<usize>) {
        let chunk = self.prompt_chunk();
        let want: Vec<usize> = rows
            .iter()
            .map(|&i| {
                let r = &self.running[i];
                if r.wants_prompt() {
                    r.next.len().min(chunk)
                } else {
                    r.next.len()
                }
            })
            .collect();
        let held = self.clients_held(rows);
        let mut feed = want.clone();
        for (j, &i) in rows.iter().enumerate() {
            if want[j] > 1 && held.contains(self.running[i].req.client.as_str()) {
                feed[j] = 0;
                self.meters.fair_deferred.increment(1);
            }
        }
        let limit = self.cfg.step_tokens;
        let decoding = feed.iter().filter(|&&w| w == 1).count();
        let prompt_tokens: usize = feed.iter().filter(|&&w| w > 1).sum();
        if limit > 0 && decoding + prompt_tokens > limit {
            let mut left = limit.saturating_sub(decoding).max(limit / 4).max(1);
            let mut order: Vec<usize> = (0..feed.len()).filter(|&j| feed[j] > 1).collect();
            if left >= order.len() {
                // every prompt gets a token: the shortest first, so short ones end at once
                order.sort_by_key(|&j| want[j]);
            } else {
                // fewer tokens than prompts: the earliest arrivals, so none waits forever
                order.sort_by_key(|&j| self.running[rows[j]].arrival);
            }
            let mut n = order.len();
            for j in order {
                let share = left.div_ceil(n);
                feed[j] = want[j].min(share);
                left -= feed[j];
                n -= 1;
            }
        }
        let mut active = Vec::with_capacity(rows.len());
        let mut fed = Vec::with_capacity(rows.len());
        for (&i, f) in rows.iter().zip(feed) {
            if f > 0 {
                active.push(i);
                fed.push(f);
            }
        }
        (active, fed)
    }

    /// The clients of `rows` whose prompts sit out this step (none with fewer than two
    /// clients; never all of them: the one held the shortest goes).
    fn clients_held(&mut self, rows: &[usize]) -> HashSet<String> {
        let clock = self.clock;
        self.held_until.retain(|_, t| *t > clock);
        if !self.cfg.share_time || self.held_until.is_empty() {
            return HashSet::new();
        }
        let clients: HashSet<&str> = rows
            .iter()
            .map(|&i| self.running[i].req.client.as_str())
            .collect();
        if clients.len() < 2 {
            return HashSet::new();
        }
        let mut held: Vec<(&str, f64)> = clients
            .iter()
            .filter_map(|&c| self.held_until.get(c).map(|&t| (c, t)))
            .collect();
        if held.len() == clients.len() {
            if let Some(k) = (0..held.len()).min_by(|&a, &b| held[a].1.total_cmp(&held[b].1)) {
                held.swap_remove(k);
            }
        }
        held.into_iter().map(|(c, _)| c.to_string()).collect()
    }

    /// Advances the clock by a step's `secs`; a client whose prompt tokens took part of it
    /// (split by tokens fed) beside another client's rows (`shared`) is held for that part.
    fn account_step(&mut self, active: &[usize], feed: &[usize], secs: f64, shared: bool) {
        self.clock += secs;
        let total: usize = feed.iter().sum();
        if !self.cfg.share_time || !shared || total == 0 {
            return;
        }
        let mut took: HashMap<&str, f64> = HashMap::new();
        for (&i, &f) in active.iter().zip(feed) {
            let Some(r) = self.running.get(i) else {
                continue;
            };
            if r.next.len() > 1 {
                *took.entry(r.req.client.as_str()).or_default() += secs * f as f64 / total as f64;
            }
        }
        for (c, t) in took {
            self.held_until.insert(c.to_string(), self.clock + t);
        }
    }

    /// Prompt tokens a step feeds of a request whose prompt log-probabilities are asked:
    /// its logits rows stay within ~64 MB (at least one row, at most 512).
    fn prompt_chunk(&self) -> usize {
        ((16usize << 20) / self.engine.cfg.vocab_size.max(1)).clamp(1, 512)
    }

    /// Sends the log-probabilities of the prompt tokens that `rows` (the logits of the `fed`
    /// tokens of `r` this step, before its bias and penalties) predict and that were not sent
    /// before a preemption: row j gives the prompt token after the j-th fed one.
    fn prompt_logprobs(&mut self, r: &mut Running, rows: &[f32], fed: usize) {
        let v = self.engine.cfg.vocab_size;
        let k = r.req.rules.logprobs.unwrap_or(0) as usize;
        // the first fed token's position (the step has added the fed ones)
        let p0 = r.kv.len - fed;
        let mut lps = Vec::new();
        for j in 0..fed {
            let at = p0 + j + 1;
            let Some(&t) = r.req.prompt.get(at) else {
                break;
            };
            if at - 1 < r.prompt_done {
                continue;
            }
            let (logprob, top) =
                moelane_engine::sampling::logprobs(&rows[j * v..(j + 1) * v], t, k);
            lps.push((t, TokenLogprobs { logprob, top }));
        }
        if !lps.is_empty() {
            r.prompt_done += lps.len();
            let _ = r.tx.send(Event::Prompt(Box::new(lps)));
        }
    }

    /// Puts a mask made into its request (running or preempted; a request gone drops it).
    fn mask_done(&mut self, d: masks::Done) {
        let r = match self.running.iter_mut().find(|r| r.arrival == d.key) {
            Some(r) => r,
            None => match self.preempted.iter_mut().find(|r| r.arrival == d.key) {
                Some(r) => r,
                None => return,
            },
        };
        r.req.constraint = Some(d.constraint);
        r.masking = None;
        r.mask_secs = d.secs;
        r.mask = Some((d.mask, d.secs));
    }

    /// Waits for the masks of this step's rows that are on the fast worker.
    fn wait_fast_masks(&mut self, active: &[usize]) {
        let waiting = |s: &Self| {
            active
                .iter()
                .any(|&i| s.running.get(i).is_some_and(|r| r.masking == Some(false)))
        };
        while waiting(self) {
            match self.masks.wait(std::time::Duration::from_millis(50)) {
                Some(d) => self.mask_done(d),
                None if !self.masks.alive(false) => {
                    // the worker is gone with the constraints it held: those requests end
                    for &i in active {
                        if let Some(r) = self.running.get_mut(i) {
                            if r.masking == Some(false) {
                                r.masking = None;
                                r.mask = Some((Err("the grammar worker failed".into()), 0.0));
                            }
                        }
                    }
                }
                None => {}
            }
        }
    }

    /// Row `r`'s token from its logits `row`: its bias and penalties applied, its grammar's
    /// mask (made ahead, else here), then its pick; its log-probabilities where asked.
    fn pick_row(
        &mut self,
        r: &mut Running,
        row: &mut [f32],
        pick: TokenPick,
        scratch: &mut Vec<(f32, u32)>,
    ) -> (Result<u32, String>, Option<Box<TokenLogprobs>>) {
        r.req.rules.apply(row, &r.counts);
        let t0 = Instant::now();
        let masked = match (r.mask.take(), &mut r.req.constraint) {
            (Some((mask, secs)), _) => {
                self.meters.grammar_mask.record(secs);
                mask.and_then(|m| m.apply(row))
            }
            // made here: no worker runs (or its mask was lost)
            (None, Some(c)) => {
                let m = c.next_mask();
                r.mask_secs = t0.elapsed().as_secs_f64();
                m.and_then(|m| m.apply(row))
            }
            (None, None) => Ok(()),
        };
        if let Err(e) = masked {
            return (Err(e), None);
        }
        let tok = moelane_engine::sampling::pick_token(row, pick, scratch);
        let lp = r.req.rules.logprobs.map(|k| {
            let (logprob, top) = moelane_engine::sampling::logprobs(row, tok, k as usize);
            Box::new(TokenLogprobs { logprob, top })
        });
        // a stop token ends the request: the grammar need not follow it
        let followed = match &mut r.req.constraint {
            Some(c) if !r.req.stop_ids.contains(&tok) => c.consume(tok),
            _ => Ok(()),
        };
        if r.req.constraint.is_some() {
            self.meters.grammar.record(t0.elapsed().as_secs_f64());
        }
        (followed.map(|()| tok), lp)
    }

    /// Sends row `r`'s token (or its grammar's error) to its client; the row back if it goes
    /// on (its token fed to the next step), None if it ended.
    fn take_token(
        &mut self,
        mut r: Running,
        tok: Result<u32, String>,
        lp: Option<Box<TokenLogprobs>>,
    ) -> Option<Running> {
        if r.generated == 0 {
            self.stats.prompt_tokens += r.req.prompt.len() as u64;
        }
        let tok = match tok {
            Ok(t) => t,
            Err(e) => {
                r.req.span.record("moelane.finish_reason", "error");
                let _ = r.tx.send(Event::Error {
                    category: Category::BadRequest,
                    message: grammar_failure(&e, r.generated),
                });
                self.stats.refused += 1;
                return None;
            }
        };
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
            if r.req.rules.presence_penalty != 0.0 || r.req.rules.frequency_penalty != 0.0 {
                match r.counts.iter_mut().find(|c| c.0 == tok) {
                    Some(c) => c.1 += 1,
                    None => r.counts.push((tok, 1)),
                }
            }
            if r.tx
                .send(Event::Token {
                    token: tok,
                    completion_tokens: r.generated,
                    elapsed_ns,
                    logprobs: lp,
                })
                .is_err()
            {
                self.stats.cancelled += 1;
                return None; // client gone: KV freed as `r` drops
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
                self.finish(r, reason);
                None
            }
            None => {
                r.next.clear();
                r.next.push(tok);
                r.out.push(tok);
                Some(r)
            }
        }
    }

    /// The loop: blocks on the command channel when idle, steps while there is work.
    /// Runs on its own thread (not a runtime's): it blocks on the queue only when idle, and
    /// ends on `Shutdown`, when every sender is gone, or when `stop` is set.
    pub fn run(mut self, mut rx: Receiver<Command>, stop: &AtomicBool) {
        loop {
            if stop.load(Ordering::Acquire) {
                return;
            }
            let idle =
                self.running.is_empty() && self.waiting.is_empty() && self.preempted.is_empty();
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
                    Command::Submit(req, tx) => self.submit(*req, tx),
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

mod masks;
#[cfg(test)]
mod tests;
