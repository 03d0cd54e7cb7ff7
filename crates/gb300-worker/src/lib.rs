//! The primary (the GB300 role of the reference deployment): attention, dense weights and
//! hot experts, the step loop with continuous batching, and the per-layer exchange with the
//! sidecar. The scheduler thread owns the engine; `PrimaryClient` validates requests and
//! reaches it over a bounded command queue with oneshot replies; a tonic server exposes it
//! to gateways (proto/lane.proto).

pub mod links;
pub mod scheduler;
pub mod sidecar_client;

use std::thread::JoinHandle;

use kameo::actor::ActorRef;
use moelane_engine::step::Engine;

use moelane_engine::sampling::SamplingParams;
use moelane_proto::lane::primary_server::{Primary, PrimaryServer};
use moelane_proto::lane::*;
use moelane_proto::Category;
use moelane_residency_actor::SwapError;
use scheduler::{Command, Event, Scheduler, SchedulerConfig, Snapshot, ValidGen};
use tokio::sync::mpsc::UnboundedReceiver;
use tokio_stream::StreamExt;
use tonic::{Request, Response, Status};

/// The most bytes of a request's `client` (a gateway sends a short digest or an address).
pub const MAX_CLIENT_BYTES: usize = 128;

/// The category that crosses gRPC (and from there an HTTP status at the gateway) of an
/// engine failure: its fault, set where it happened, under the protocol's shared name.
pub fn category(e: &moelane_engine::Error) -> Category {
    Category::parse(e.fault().name())
}

#[cfg(test)]
mod fault_tests {
    use moelane_engine::error::Fault;
    use moelane_proto::Category;

    #[test]
    fn every_fault_has_the_category_of_its_name() {
        for f in Fault::ALL {
            let c = Category::parse(f.name());
            assert_eq!(c.as_str(), f.name(), "{f:?}");
            // and the category survives a gRPC status
            assert_eq!(Category::of(&c.status("x")), c);
        }
    }
}

/// The primary's front, shared by the gRPC service, the swap participant and the metrics
/// collector: it validates requests and hands them to the step loop over a bounded command
/// queue, each reply on a oneshot channel. Cloning it is cheap.
#[derive(Clone)]
pub struct PrimaryClient {
    tx: tokio::sync::mpsc::Sender<Command>,
    vocab: usize,
    eos: std::sync::Arc<[u32]>,
    /// The grammar compiler of the checkpoint's tokenizer (none: a request with a grammar is
    /// refused, saying why).
    grammars: Option<std::sync::Arc<moelane_text::grammar::Grammars>>,
}

/// The command queue's depth: the waiting requests the scheduler may hold, and room for the
/// control and stats commands of one step beside them.
fn queue_depth(cfg: &SchedulerConfig) -> usize {
    cfg.max_waiting.min(1 << 20).saturating_add(256)
}

impl PrimaryClient {
    /// Validates `r` and queues it; its events arrive on the returned stream. A full queue
    /// answers Overloaded at once (the step loop is behind; the client may retry).
    pub fn generate(
        &self,
        r: GenerateRequest,
        span: tracing::Span,
    ) -> Result<UnboundedReceiver<Event>, Status> {
        let v = self.validate(r, span)?;
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        match self.tx.try_send(Command::Submit(Box::new(v), tx)) {
            Ok(()) => Ok(rx),
            Err(tokio::sync::mpsc::error::TrySendError::Full(_)) => Err(Category::Overloaded
                .status(format!(
                    "the primary's command queue is full ({} commands)",
                    self.tx.max_capacity()
                ))),
            Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) => {
                Err(Category::Unavailable.status("the primary's scheduler stopped"))
            }
        }
    }

    fn validate(&self, r: GenerateRequest, span: tracing::Span) -> Result<ValidGen, Status> {
        let bad = |m: String| Err(Category::BadRequest.status(m));
        if r.prompt.is_empty() {
            return bad("prompt is empty".into());
        }
        if let Some(t) = r.prompt.iter().find(|&&t| t as usize >= self.vocab) {
            return bad(format!(
                "prompt token {t} is outside the vocabulary of {}",
                self.vocab
            ));
        }
        if r.max_tokens == 0 {
            return bad("max_tokens must be at least 1".into());
        }
        if !r.temperature.is_finite() || r.temperature < 0.0 {
            return bad(format!(
                "temperature {} must be finite and >= 0",
                r.temperature
            ));
        }
        if !(r.top_p > 0.0 && r.top_p <= 1.0) {
            return bad(format!("top_p {} must be in (0, 1]", r.top_p));
        }
        for (k, p) in [
            ("presence_penalty", r.presence_penalty),
            ("frequency_penalty", r.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&p) {
                return bad(format!("{k} {p} is outside [-2, 2]"));
            }
        }
        if r.top_logprobs > 20 {
            return bad(format!("top_logprobs {} is above 20", r.top_logprobs));
        }
        if r.top_logprobs > 0 && !r.logprobs {
            return bad("top_logprobs needs logprobs".into());
        }
        if r.prompt_logprobs && !r.logprobs {
            return bad("prompt_logprobs needs logprobs".into());
        }
        if r.logit_bias.len() > 1024 {
            return bad(format!(
                "logit_bias has {} entries, at most 1024",
                r.logit_bias.len()
            ));
        }
        let mut logit_bias: Vec<(u32, f32)> = r.logit_bias.into_iter().collect();
        logit_bias.sort_by_key(|b| b.0);
        if let Some((t, b)) = logit_bias
            .iter()
            .find(|(t, b)| *t as usize >= self.vocab || !(-100.0..=100.0).contains(b))
        {
            return bad(format!(
                "logit_bias {t}: {b} needs a token id below {} and a bias in [-100, 100]",
                self.vocab
            ));
        }
        let rules = moelane_engine::sampling::LogitRules {
            presence_penalty: r.presence_penalty,
            frequency_penalty: r.frequency_penalty,
            logit_bias,
            logprobs: r.logprobs.then_some(r.top_logprobs),
        };
        let mut constraint = match (r.grammar.is_empty(), &self.grammars) {
            (true, _) => None,
            (false, None) => {
                return bad(
                    "this lane has no tokenizer to compile a grammar with (its checkpoint has \
                     no tokenizer.json or tiktoken.model)"
                        .into(),
                )
            }
            (false, Some(g)) => Some(
                g.compile(&r.grammar)
                    .map_err(|e| Category::BadRequest.status(format!("the grammar: {e}")))?,
            ),
        };
        if r.client.len() > MAX_CLIENT_BYTES {
            return bad(format!(
                "client is {} bytes, at most {MAX_CLIENT_BYTES}",
                r.client.len()
            ));
        }
        // the first mask, made here (off the step loop, where the grammar was compiled): its
        // time says which mask worker the next ones go to
        let first_mask = constraint.as_mut().map(|c| {
            let t0 = std::time::Instant::now();
            let m = c.next_mask();
            Box::new((m, t0.elapsed().as_secs_f64()))
        });
        let mut stop_ids = r.stop_token_ids;
        if !r.ignore_eos {
            stop_ids.extend(self.eos.iter());
        }
        Ok(ValidGen {
            constraint,
            rules,
            id: r.request_id,
            prompt: r.prompt,
            max_tokens: r.max_tokens as usize,
            sampling: SamplingParams {
                temperature: r.temperature,
                top_p: r.top_p,
                top_k: r.top_k,
                seed: r.seed,
            },
            stop_ids,
            span,
            client: r.client,
            prompt_logprobs: r.prompt_logprobs,
            first_mask,
        })
    }

    /// Sends the command `make` builds and waits for its reply (waiting for room in the
    /// queue: control commands are not refused for load).
    pub async fn call<T>(
        &self,
        make: impl FnOnce(tokio::sync::oneshot::Sender<T>) -> Command,
    ) -> Result<T, SwapError> {
        let stopped = || SwapError::unavailable("the primary's scheduler stopped");
        let (rtx, rrx) = tokio::sync::oneshot::channel();
        self.tx.send(make(rtx)).await.map_err(|_| stopped())?;
        rrx.await.map_err(|_| stopped())
    }

    /// Cancels request `id`; whether it was running or waiting.
    pub async fn cancel(&self, id: String) -> Result<bool, Status> {
        self.call(|r| Command::Cancel(id, r)).await.map_err(status)
    }

    /// The scheduler's counters and load.
    pub async fn snapshot(&self) -> Result<Snapshot, Status> {
        self.call(Command::Snapshot).await.map_err(status)
    }

    /// Waits until no request runs or waits, at most `grace`; returns how many still do
    /// (0: drained). Polls the scheduler every 20 ms.
    pub async fn wait_idle(&self, grace: std::time::Duration) -> usize {
        let until = tokio::time::Instant::now() + grace;
        loop {
            let left = match self.snapshot().await {
                Ok(s) => s.running + s.waiting,
                Err(_) => return 0, // the loop is gone: nothing runs
            };
            if left == 0 || tokio::time::Instant::now() >= until {
                return left;
            }
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Ends every request still running or waiting with an Unavailable error naming `why`.
    pub async fn end_all(&self, why: &str) -> usize {
        self.call(|r| Command::EndAll(why.to_string(), r))
            .await
            .unwrap_or(0)
    }
}

fn status(e: SwapError) -> Status {
    Category::parse(e.fault.name()).status(e.what)
}

/// A running primary: its front and the scheduler thread.
pub struct PrimaryHandle {
    pub client: PrimaryClient,
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl PrimaryHandle {
    /// Compiles requests' grammars (structured output) with `g`, the checkpoint's tokenizer.
    pub fn with_grammars(mut self, g: std::sync::Arc<moelane_text::grammar::Grammars>) -> Self {
        self.client.grammars = Some(g);
        self
    }

    /// Stops the scheduler (running requests end with an error event when their senders drop).
    pub fn shutdown(&mut self) {
        if let Some(t) = self.thread.take() {
            // the flag stops a busy loop (whose queue may be full); the command wakes an
            // idle one (whose queue is empty, so it finds room)
            self.stop.store(true, std::sync::atomic::Ordering::Release);
            let _ = self.client.tx.try_send(Command::Shutdown);
            let _ = t.join();
        }
    }
}

impl Drop for PrimaryHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts the scheduler thread on `engine` and the front before it.
pub fn start(
    engine: Engine,
    model: String,
    eos: Vec<u32>,
    cfg: SchedulerConfig,
) -> std::io::Result<PrimaryHandle> {
    let (tx, rx) = tokio::sync::mpsc::channel(queue_depth(&cfg));
    let vocab = engine.cfg.vocab_size;
    let sched = Scheduler::new(engine, model, cfg);
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let flag = stop.clone();
    let thread = std::thread::Builder::new()
        .name("moelane-step-loop".into())
        .spawn(move || sched.run(rx, &flag))?;
    Ok(PrimaryHandle {
        stop,
        client: PrimaryClient {
            tx,
            vocab,
            eos: eos.into(),
            grammars: None,
        },
        thread: Some(thread),
    })
}

/// The primary as the residency coordinator drives it: loads off the step loop, stages,
/// commits and releases between steps through the scheduler's command channel.
pub struct PrimaryParticipant {
    pub client: PrimaryClient,
    pub ckpt_dir: std::path::PathBuf,
    pub model: String,
    pub layers: usize,
    pub experts: usize,
}

impl moelane_residency_actor::Participant for PrimaryParticipant {
    fn name(&self) -> &'static str {
        "primary"
    }
    fn prepare<'a>(
        &'a self,
        _base: u64,
        _next: &'a moelane_engine::rowmap::Rowmap,
        incoming: Vec<moelane_engine::swap::Incoming>,
    ) -> futures::future::BoxFuture<'a, Result<(), SwapError>> {
        let dir = self.ckpt_dir.clone();
        Box::pin(async move {
            let loaded = tokio::task::spawn_blocking(move || {
                moelane_residency_actor::failpoint::load_point("primary.load")
                    .map_err(SwapError::unavailable)?;
                let ckpt = moelane_engine::checkpoint::Checkpoint::open(&dir)?;
                Ok::<_, SwapError>(moelane_engine::swap::load_verified(&ckpt, &incoming)?)
            })
            .await
            .map_err(|e| SwapError::internal(format!("the PREPARE load: {e}")))??;
            self.client.call(|r| Command::Stage(loaded, r)).await
        })
    }
    fn commit<'a>(
        &'a self,
        next: &'a moelane_engine::rowmap::Rowmap,
    ) -> futures::future::BoxFuture<'a, Result<(), SwapError>> {
        Box::pin(async move {
            let valid = next
                .clone()
                .validate(&self.model, self.layers, self.experts, None)
                .map_err(|e| SwapError::invalid(e.to_string()))?;
            self.client
                .call(|r| Command::Commit(Box::new(valid), r))
                .await?
                .map_err(SwapError::from)
        })
    }
    fn release(&self, _epoch: u64) -> futures::future::BoxFuture<'_, Result<(), SwapError>> {
        Box::pin(async move { self.client.call(Command::ReleaseUnused).await.map(|_| ()) })
    }
    fn abort(&self, _epoch: u64) -> futures::future::BoxFuture<'_, Result<(), SwapError>> {
        Box::pin(async move { self.client.call(Command::ReleaseUnused).await.map(|_| ()) })
    }
}

impl moelane_residency_actor::CounterSource for PrimaryParticipant {
    fn sample(
        &self,
    ) -> futures::future::BoxFuture<'_, Result<moelane_residency_actor::policy::Sample, SwapError>>
    {
        Box::pin(async move {
            let s = self.client.call(Command::Snapshot).await?;
            Ok(moelane_residency_actor::policy::Sample {
                picks: s.picks,
                wait_ns: s.wait_ns,
                step_ns: s.step_ns,
            })
        })
    }
}

/// Whether the primary takes new requests: it is not draining and nothing is wrong with its
/// sidecar (each supervisor sets or clears its own problem: the link down, heartbeats
/// missed, the sidecar draining). Health, Generate and the gRPC health service read it.
pub struct Readiness {
    draining: std::sync::atomic::AtomicBool,
    problems: std::sync::Mutex<std::collections::BTreeMap<&'static str, String>>,
    /// This process's start time in ns (Health carries it: a restarted lane is told apart).
    pub incarnation: u64,
    /// The step loop's last answered (model, map epoch, link), for a Health asked mid-step.
    figures: std::sync::Mutex<Option<(String, u64, String)>>,
    /// Why the lane computes its cold experts itself now (`--degraded`: the sidecar is
    /// lost); None while the sidecar serves them.
    degraded: std::sync::Mutex<Option<String>>,
}

impl Default for Readiness {
    fn default() -> Self {
        Readiness {
            draining: Default::default(),
            problems: Default::default(),
            figures: Default::default(),
            degraded: Default::default(),
            incarnation: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0),
        }
    }
}

impl Readiness {
    /// From now on new requests are refused (Unavailable) and Health says draining.
    pub fn start_drain(&self) {
        self.draining
            .store(true, std::sync::atomic::Ordering::SeqCst);
        metrics::gauge!(moelane_telemetry::names::DRAINING).set(1.0);
    }
    pub fn draining(&self) -> bool {
        self.draining.load(std::sync::atomic::Ordering::SeqCst)
    }
    /// Sets (`Some(why)`) or clears (`None`) the problem `key`; returns whether it was set
    /// before.
    pub fn set_problem(&self, key: &'static str, why: Option<String>) -> bool {
        let mut g = self.problems.lock().unwrap_or_else(|p| p.into_inner());
        match why {
            Some(w) => g.insert(key, w).is_some(),
            None => g.remove(key).is_some(),
        }
    }
    /// Marks the lane degraded (`Some(why)`: it computes cold experts itself) or not;
    /// returns whether that changed.
    pub fn set_degraded(&self, why: Option<String>) -> bool {
        let mut g = self.degraded.lock().unwrap_or_else(|p| p.into_inner());
        let changed = g.is_some() != why.is_some();
        *g = why;
        if changed {
            metrics::gauge!(moelane_telemetry::names::LANE_DEGRADED).set(g.is_some() as u8 as f64);
        }
        changed
    }
    /// Why the lane is degraded, if it is.
    pub fn degraded(&self) -> Option<String> {
        self.degraded
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
    /// Why the primary does not take new requests, if it does not.
    pub fn not_ready(&self) -> Option<String> {
        if self.draining() {
            return Some("the primary is draining (stopping)".into());
        }
        let g = self.problems.lock().unwrap_or_else(|p| p.into_inner());
        (!g.is_empty()).then(|| g.values().cloned().collect::<Vec<_>>().join("; "))
    }
}

/// The tonic face of the primary.
pub struct PrimaryService {
    pub client: PrimaryClient,
    pub residency: Option<ActorRef<moelane_residency_actor::Residency>>,
    pub readiness: std::sync::Arc<Readiness>,
}

fn load_of(s: &Snapshot) -> LoadReply {
    LoadReply {
        running: s.running as u32,
        waiting: s.waiting as u32,
        kv_blocks_used: s.kv_used as u32,
        kv_blocks_total: s.kv_total as u32,
    }
}

type EventStream =
    std::pin::Pin<Box<dyn futures::Stream<Item = Result<GenerateEvent, Status>> + Send>>;

#[tonic::async_trait]
impl Primary for PrimaryService {
    type GenerateStream = EventStream;

    async fn generate(
        &self,
        r: Request<GenerateRequest>,
    ) -> Result<Response<Self::GenerateStream>, Status> {
        let span = tracing::info_span!(
            "generate",
            otel.kind = "server",
            moelane.request_id = tracing::field::Empty,
            gen_ai.usage.input_tokens = r.get_ref().prompt.len(),
            gen_ai.usage.output_tokens = tracing::field::Empty,
            moelane.finish_reason = tracing::field::Empty,
        );
        moelane_telemetry::adopt(&span, r.metadata());
        span.record("moelane.request_id", r.get_ref().request_id.as_str());
        if self.readiness.draining() {
            return Err(Category::Unavailable.status(
                "the primary is draining (stopping): it takes no new requests; send this one to another lane",
            ));
        }
        let req = r.into_inner();
        let rx = if req.grammar.is_empty() {
            self.client.generate(req, span)?
        } else {
            // compiling a grammar takes CPU (and memory) in proportion to it: off the async
            // runtime, at most one per core at a time
            static COMPILING: std::sync::OnceLock<tokio::sync::Semaphore> =
                std::sync::OnceLock::new();
            let turns = COMPILING.get_or_init(|| {
                tokio::sync::Semaphore::new(
                    std::thread::available_parallelism().map_or(2, |n| n.get()),
                )
            });
            let _turn = turns
                .acquire()
                .await
                .map_err(|_| Category::Unavailable.status("the primary is stopping"))?;
            let client = self.client.clone();
            tokio::task::spawn_blocking(move || client.generate(req, span))
                .await
                .map_err(|e| Category::Internal.status(format!("compiling the grammar: {e}")))??
        };
        let s = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|ev| match ev {
            Event::Token {
                token,
                completion_tokens,
                elapsed_ns,
                logprobs,
            } => Ok(GenerateEvent {
                token: Some(token),
                finish_reason: String::new(),
                prompt_tokens: 0,
                completion_tokens,
                elapsed_ns,
                logprob: logprobs.as_ref().map(|l| l.logprob),
                top_logprobs: logprobs
                    .map(|l| {
                        l.top
                            .iter()
                            .map(|&(token, logprob)| moelane_proto::lane::TokenLogprob {
                                token,
                                logprob,
                            })
                            .collect()
                    })
                    .unwrap_or_default(),
                prompt_logprobs: Vec::new(),
            }),
            Event::Prompt(lps) => Ok(GenerateEvent {
                prompt_logprobs: lps
                    .iter()
                    .map(|(token, l)| moelane_proto::lane::PromptLogprob {
                        token: *token,
                        logprob: l.logprob,
                        top_logprobs: l
                            .top
                            .iter()
                            .map(|&(token, logprob)| moelane_proto::lane::TokenLogprob {
                                token,
                                logprob,
                            })
                            .collect(),
                    })
                    .collect(),
                ..Default::default()
            }),
            Event::Finish {
                reason,
                prompt_tokens,
                completion_tokens,
                elapsed_ns,
            } => Ok(GenerateEvent {
                token: None,
                finish_reason: reason.into(),
                prompt_tokens,
                completion_tokens,
                elapsed_ns,
                ..Default::default()
            }),
            Event::Error { category, message } => Err(category.status(message)),
        });
        Ok(Response::new(Box::pin(s)))
    }

    async fn cancel(&self, r: Request<CancelRequest>) -> Result<Response<CancelReply>, Status> {
        let found = self.client.cancel(r.into_inner().request_id).await?;
        Ok(Response::new(CancelReply { found }))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthReply>, Status> {
        // a step may run for seconds (a long prefill): a busy lane is healthy, so the loop's
        // figures are waited for briefly and the last ones answered otherwise; a loop that is
        // gone fails at once
        let (model, map_epoch, link) = match tokio::time::timeout(
            std::time::Duration::from_millis(200),
            self.client.snapshot(),
        )
        .await
        {
            Ok(s) => {
                let s = s?;
                let fig = (s.model, s.epoch, s.link);
                *self
                    .readiness
                    .figures
                    .lock()
                    .unwrap_or_else(|p| p.into_inner()) = Some(fig.clone());
                fig
            }
            Err(_) => self
                .readiness
                .figures
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone()
                .unwrap_or_default(),
        };
        let why = self.readiness.not_ready();
        Ok(Response::new(HealthReply {
            ok: why.is_none(),
            model,
            map_epoch,
            link,
            draining: self.readiness.draining(),
            reason: why.unwrap_or_default(),
            build: moelane_proto::BUILD.into(),
            protocol: moelane_proto::PROTOCOL,
            incarnation: self.readiness.incarnation,
            degraded: self.readiness.degraded().unwrap_or_default(),
        }))
    }

    async fn load(&self, _: Request<LoadRequest>) -> Result<Response<LoadReply>, Status> {
        let s = self.client.snapshot().await?;
        Ok(Response::new(load_of(&s)))
    }

    async fn swap(&self, r: Request<SwapRequest>) -> Result<Response<SwapReply>, Status> {
        let res = self.residency.as_ref().ok_or_else(|| {
            Category::Unavailable.status("this primary has no residency coordinator")
        })?;
        let moves = r
            .into_inner()
            .moves
            .iter()
            .map(|m| moelane_residency_actor::Move {
                layer: m.layer as usize,
                expert: m.expert as usize,
                to: if m.to_hot {
                    moelane_engine::rowmap::Tier::Hot
                } else {
                    moelane_engine::rowmap::Tier::Cold
                },
            })
            .collect();
        let o = res
            .ask(moelane_residency_actor::Swap(moves))
            .await
            .map_err(|e| Category::Unavailable.status(format!("residency actor: {e}")))?;
        Ok(Response::new(SwapReply {
            map_epoch: o.epoch,
            committed: o.committed,
            abort_reason: o.abort_reason,
            prepare_ns: o.prepare.as_nanos() as u64,
            total_ns: o.total.as_nanos() as u64,
        }))
    }

    async fn residency(
        &self,
        _: Request<ResidencyRequest>,
    ) -> Result<Response<ResidencyReply>, Status> {
        let res = self.residency.as_ref().ok_or_else(|| {
            Category::Unavailable.status("this primary has no residency coordinator")
        })?;
        let r = res
            .ask(moelane_residency_actor::GetLedger)
            .await
            .map_err(|e| Category::Unavailable.status(format!("residency actor: {e}")))?;
        let skip = r.ledger.len().saturating_sub(256);
        Ok(Response::new(ResidencyReply {
            map_epoch: r.epoch,
            swaps_done: r.swaps_done,
            swaps_aborted: r.swaps_aborted,
            adaptive: r.adaptive,
            dry_run: r.dry_run,
            ledger: r.ledger[skip..]
                .iter()
                .map(|e| LedgerEntry {
                    epoch: e.epoch,
                    moves: e.moves as u32,
                    committed: e.committed,
                    cold_share_before: e.cold_share_before,
                    cold_share_predicted: e.cold_share_predicted,
                    cold_share_realised: e.cold_share_realised.unwrap_or(-1.0),
                    wait_share_before: e.wait_share_before,
                    wait_share_realised: e.wait_share_realised.unwrap_or(-1.0),
                })
                .collect(),
        }))
    }

    async fn stats(&self, _: Request<StatsRequest>) -> Result<Response<StatsReply>, Status> {
        let s = self.client.snapshot().await?;
        let layers = (0..s.hot_picks.len())
            .map(|l| LayerStats {
                hot_picks: s.hot_picks[l],
                cold_picks: s.cold_picks[l],
                wait_ns: s.wait_ns[l],
                expert_picks: s.picks[l].clone(),
            })
            .collect();
        Ok(Response::new(StatsReply {
            load: Some(load_of(&s)),
            steps: s.steps,
            tokens_generated: s.tokens_generated,
            prompt_tokens: s.prompt_tokens,
            layers,
            requests_finished: s.finished,
            requests_cancelled: s.cancelled,
            requests_failed: s.failed,
            kv_block_tokens: moelane_engine::kv::BLOCK as u32,
            max_context: s.max_context as u32,
            step_ns: s.step_ns,
            model: s.model.clone(),
            map_epoch: s.epoch,
            max_step_ns: s.max_step_ns,
        }))
    }
}

/// The standard gRPC health service (`grpc.health.v1.Health`, for Kubernetes gRPC probes
/// and load balancers): the overall status ("") and `moelane.lane.v1.Primary` are SERVING
/// while the step loop runs and [`Readiness`] says ready, NOT_SERVING otherwise; `liveness`
/// is SERVING while the step loop runs (busy or not, whatever the sidecar does: a liveness
/// probe must not restart a primary whose sidecar is away). Re-evaluated every 250 ms.
pub fn health_service(
    readiness: std::sync::Arc<Readiness>,
    client: PrimaryClient,
) -> tonic_health::pb::health_server::HealthServer<impl tonic_health::pb::health_server::Health> {
    let (r, service) = tonic_health::server::health_reporter();
    tokio::spawn(async move {
        let mut last = None;
        loop {
            // a busy loop (a step of seconds) is alive; a loop that is gone is not
            let answers = !client.tx.is_closed();
            let serving = answers && readiness.not_ready().is_none();
            if last != Some((serving, answers)) {
                let status = |on: bool| {
                    if on {
                        tonic_health::ServingStatus::Serving
                    } else {
                        tonic_health::ServingStatus::NotServing
                    }
                };
                for name in ["", "moelane.lane.v1.Primary"] {
                    r.set_service_status(name, status(serving)).await;
                }
                r.set_service_status("liveness", status(answers)).await;
                last = Some((serving, answers));
            }
            // the service ends when its server is dropped: stop with it
            if std::sync::Arc::strong_count(&readiness) <= 1 {
                return;
            }
            tokio::time::sleep(std::time::Duration::from_millis(250)).await;
        }
    });
    service
}

/// Serves the lane API on `listener` until the future is dropped or `stop` resolves (then
/// it stops accepting and returns once the calls in progress end).
pub async fn serve(
    listener: tokio::net::TcpListener,
    client: PrimaryClient,
    residency: Option<ActorRef<moelane_residency_actor::Residency>>,
    readiness: std::sync::Arc<Readiness>,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<(), tonic::transport::Error> {
    let health_service = health_service(readiness.clone(), client.clone());
    let mut server = match moelane_proto::tls::cluster_tls() {
        // with the cluster's mutual TLS, a peer without a certificate of the cluster CA does
        // not get past the handshake
        Some(t) => tonic::transport::Server::builder().tls_config(t.server())?,
        None => tonic::transport::Server::builder(),
    };
    server
        .add_service(health_service)
        // the lane API needs the cluster token when one is set; the standard health service
        // stays open for probes (it tells only serving or not)
        .add_service(PrimaryServer::with_interceptor(
            PrimaryService {
                client,
                residency,
                readiness,
            },
            moelane_proto::auth::Check::cluster(),
        ))
        .serve_with_incoming_shutdown(
            tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
                if let Ok(s) = &s {
                    let _ = s.set_nodelay(true);
                }
                s
            }),
            stop,
        )
        .await
}

/// Publishes the lane's counters (kept by the engine as plain integers) on each scrape of the
/// Prometheus page: per-layer hot and cold picks, wait on the sidecar, the cold share since
/// the previous scrape, step time, tokens, request outcomes, and the map epoch.
pub fn register_metrics(client: PrimaryClient) {
    use moelane_telemetry::names as n;
    let prev = std::sync::Arc::new(std::sync::Mutex::new((
        Vec::<u64>::new(),
        Vec::<u64>::new(),
    )));
    moelane_telemetry::add_collector(Box::new(move || {
        let (client, prev) = (client.clone(), prev.clone());
        Box::pin(async move {
            let Ok(s) = client.call(Command::Snapshot).await else {
                return;
            };
            let Ok(mut p) = prev.lock() else {
                return;
            };
            let (ph, pc) = &mut *p;
            ph.resize(s.hot_picks.len(), 0);
            pc.resize(s.cold_picks.len(), 0);
            for l in 0..s.hot_picks.len() {
                let layer = l.to_string();
                metrics::counter!(n::HOT_PICKS, "layer" => layer.clone()).absolute(s.hot_picks[l]);
                metrics::counter!(n::COLD_PICKS, "layer" => layer.clone())
                    .absolute(s.cold_picks[l]);
                moelane_telemetry::set_seconds_total(
                    n::SIDECAR_WAIT,
                    &[("layer", &layer)],
                    s.wait_ns[l] as f64 * 1e-9,
                );
                let dh = s.hot_picks[l].saturating_sub(ph[l]);
                let dc = s.cold_picks[l].saturating_sub(pc[l]);
                if dh + dc > 0 {
                    metrics::gauge!(n::COLD_SHARE, "layer" => layer)
                        .set(dc as f64 / (dh + dc) as f64);
                }
                ph[l] = s.hot_picks[l];
                pc[l] = s.cold_picks[l];
            }
            moelane_telemetry::set_seconds_total(n::STEP_TIME, &[], s.step_ns as f64 * 1e-9);
            metrics::counter!(n::LANE_TOKENS).absolute(s.tokens_generated);
            for (outcome, v) in [
                ("finished", s.finished),
                ("cancelled", s.cancelled),
                ("failed", s.failed),
                ("refused", s.refused),
            ] {
                metrics::counter!(n::LANE_REQUESTS, "outcome" => outcome).absolute(v);
            }
            metrics::gauge!(n::MAP_EPOCH, "tier" => "primary").set(s.epoch as f64);
        })
    }));
}
