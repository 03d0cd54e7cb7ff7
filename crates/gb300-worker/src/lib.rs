//! The primary (the GB300 role of the reference deployment): attention, dense weights and
//! hot experts, the step loop with continuous batching, and the per-layer exchange with the
//! sidecar. A kameo actor fronts the scheduler thread (which owns the engine); a tonic
//! server exposes it to gateways (proto/lane.proto).

pub mod links;
pub mod scheduler;
pub mod sidecar_client;

use std::sync::mpsc;
use std::thread::JoinHandle;

use kameo::actor::{ActorRef, Spawn};
use kameo::message::{Context, Message};
use kameo::Actor;
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

/// The primary actor: validates requests and forwards them to the scheduler thread.
#[derive(Actor)]
pub struct PrimaryActor {
    tx: mpsc::Sender<Command>,
    vocab: usize,
    eos: Vec<u32>,
}

/// A request and its trace span.
pub struct Generate(pub GenerateRequest, pub tracing::Span);
pub struct Cancel(pub String);
pub struct GetSnapshot;

impl Message<Generate> for PrimaryActor {
    type Reply = Result<UnboundedReceiver<Event>, Status>;
    async fn handle(
        &mut self,
        Generate(r, span): Generate,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
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
        let mut stop_ids = r.stop_token_ids.clone();
        if !r.ignore_eos {
            stop_ids.extend(&self.eos);
        }
        let v = ValidGen {
            id: r.request_id,
            prompt: r.prompt,
            max_tokens: r.max_tokens as usize,
            sampling: SamplingParams {
                temperature: r.temperature,
                top_p: r.top_p,
                seed: r.seed,
            },
            stop_ids,
            span,
        };
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.tx
            .send(Command::Submit(v, tx))
            .map_err(|_| Category::Unavailable.status("scheduler stopped"))?;
        Ok(rx)
    }
}

impl Message<Cancel> for PrimaryActor {
    type Reply = Result<bool, Status>;
    async fn handle(
        &mut self,
        Cancel(id): Cancel,
        _: &mut Context<Self, Self::Reply>,
    ) -> Self::Reply {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::Cancel(id, tx))
            .map_err(|_| Category::Unavailable.status("scheduler stopped"))?;
        tokio::task::spawn_blocking(move || rx.recv().unwrap_or(false))
            .await
            .map_err(|e| Category::Internal.status(e.to_string()))
    }
}

impl Message<GetSnapshot> for PrimaryActor {
    type Reply = Result<Snapshot, Status>;
    async fn handle(&mut self, _: GetSnapshot, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let (tx, rx) = mpsc::channel();
        self.tx
            .send(Command::Snapshot(tx))
            .map_err(|_| Category::Unavailable.status("scheduler stopped"))?;
        tokio::task::spawn_blocking(move || {
            rx.recv()
                .map_err(|_| Category::Unavailable.status("scheduler stopped"))
        })
        .await
        .map_err(|e| Category::Internal.status(e.to_string()))?
    }
}

/// A running primary: the actor and the scheduler thread.
pub struct PrimaryHandle {
    pub actor: ActorRef<PrimaryActor>,
    tx: mpsc::Sender<Command>,
    thread: Option<JoinHandle<()>>,
}

impl PrimaryHandle {
    /// The scheduler's command channel (for the swap participant).
    pub fn commands(&self) -> mpsc::Sender<Command> {
        self.tx.clone()
    }

    /// Stops the scheduler (running requests end with an error event when their senders drop).
    pub fn shutdown(&mut self) {
        let _ = self.tx.send(Command::Shutdown);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for PrimaryHandle {
    fn drop(&mut self) {
        self.shutdown();
    }
}

/// Starts the scheduler thread on `engine` and the actor in front of it.
pub fn start(engine: Engine, model: String, eos: Vec<u32>, cfg: SchedulerConfig) -> PrimaryHandle {
    let (tx, rx) = mpsc::channel();
    let vocab = engine.cfg.vocab_size;
    let sched = Scheduler::new(engine, model, cfg);
    let thread = std::thread::Builder::new()
        .name("moelane-step-loop".into())
        .spawn(move || sched.run(rx))
        .ok();
    let actor = PrimaryActor::spawn(PrimaryActor {
        tx: tx.clone(),
        vocab,
        eos,
    });
    PrimaryHandle { actor, tx, thread }
}

fn flat<T, M>(r: Result<T, kameo::error::SendError<M, Status>>) -> Result<T, Status> {
    match r {
        Ok(v) => Ok(v),
        Err(kameo::error::SendError::HandlerError(s)) => Err(s),
        Err(e) => Err(Category::Unavailable.status(format!("primary actor: {e}"))),
    }
}

/// The primary as the residency coordinator drives it: loads off the step loop, stages,
/// commits and releases between steps through the scheduler's command channel.
pub struct PrimaryParticipant {
    pub tx: mpsc::Sender<Command>,
    pub ckpt_dir: std::path::PathBuf,
    pub model: String,
    pub layers: usize,
    pub experts: usize,
}

async fn call<T: Send + 'static>(
    tx: &mpsc::Sender<Command>,
    make: impl FnOnce(mpsc::Sender<T>) -> Command,
) -> Result<T, SwapError> {
    let stopped = || SwapError::unavailable("the primary's scheduler stopped");
    let (rtx, rrx) = mpsc::channel();
    tx.send(make(rtx)).map_err(|_| stopped())?;
    tokio::task::spawn_blocking(move || rrx.recv().map_err(|_| stopped()))
        .await
        .map_err(|e| SwapError::internal(format!("waiting for the scheduler: {e}")))?
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
            call(&self.tx, |r| Command::Stage(loaded, r)).await
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
            call(&self.tx, |r| Command::Commit(Box::new(valid), r))
                .await?
                .map_err(SwapError::from)
        })
    }
    fn release(&self, _epoch: u64) -> futures::future::BoxFuture<'_, Result<(), SwapError>> {
        Box::pin(async move { call(&self.tx, Command::ReleaseUnused).await.map(|_| ()) })
    }
    fn abort(&self, _epoch: u64) -> futures::future::BoxFuture<'_, Result<(), SwapError>> {
        Box::pin(async move { call(&self.tx, Command::ReleaseUnused).await.map(|_| ()) })
    }
}

impl moelane_residency_actor::CounterSource for PrimaryParticipant {
    fn sample(
        &self,
    ) -> futures::future::BoxFuture<'_, Result<moelane_residency_actor::policy::Sample, SwapError>>
    {
        Box::pin(async move {
            let s = call(&self.tx, Command::Snapshot).await?;
            Ok(moelane_residency_actor::policy::Sample {
                picks: s.picks,
                wait_ns: s.wait_ns,
                step_ns: s.step_ns,
            })
        })
    }
}

/// The tonic face of the primary.
pub struct PrimaryService {
    pub actor: ActorRef<PrimaryActor>,
    pub residency: Option<ActorRef<moelane_residency_actor::Residency>>,
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
        let rx = flat(self.actor.ask(Generate(r.into_inner(), span)).await)?;
        let s = tokio_stream::wrappers::UnboundedReceiverStream::new(rx).map(|ev| match ev {
            Event::Token {
                token,
                completion_tokens,
                elapsed_ns,
            } => Ok(GenerateEvent {
                token: Some(token),
                finish_reason: String::new(),
                prompt_tokens: 0,
                completion_tokens,
                elapsed_ns,
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
            }),
            Event::Error { category, message } => Err(category.status(message)),
        });
        Ok(Response::new(Box::pin(s)))
    }

    async fn cancel(&self, r: Request<CancelRequest>) -> Result<Response<CancelReply>, Status> {
        let found = flat(self.actor.ask(Cancel(r.into_inner().request_id)).await)?;
        Ok(Response::new(CancelReply { found }))
    }

    async fn health(&self, _: Request<HealthRequest>) -> Result<Response<HealthReply>, Status> {
        let s = flat(self.actor.ask(GetSnapshot).await)?;
        Ok(Response::new(HealthReply {
            ok: true,
            model: s.model,
            map_epoch: s.epoch,
            link: s.link,
        }))
    }

    async fn load(&self, _: Request<LoadRequest>) -> Result<Response<LoadReply>, Status> {
        let s = flat(self.actor.ask(GetSnapshot).await)?;
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
        let s = flat(self.actor.ask(GetSnapshot).await)?;
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

/// Serves the lane API on `listener` until the future is dropped.
pub async fn serve(
    listener: tokio::net::TcpListener,
    actor: ActorRef<PrimaryActor>,
    residency: Option<ActorRef<moelane_residency_actor::Residency>>,
) -> Result<(), tonic::transport::Error> {
    tonic::transport::Server::builder()
        .add_service(PrimaryServer::new(PrimaryService { actor, residency }))
        .serve_with_incoming(
            tokio_stream::wrappers::TcpListenerStream::new(listener).map(|s| {
                if let Ok(s) = &s {
                    let _ = s.set_nodelay(true);
                }
                s
            }),
        )
        .await
}

/// Publishes the lane's counters (kept by the engine as plain integers) on each scrape of the
/// Prometheus page: per-layer hot and cold picks, wait on the sidecar, the cold share since
/// the previous scrape, step time, tokens, request outcomes, and the map epoch.
pub fn register_metrics(tx: mpsc::Sender<Command>) {
    use moelane_telemetry::names as n;
    let prev = std::sync::Arc::new(std::sync::Mutex::new((
        Vec::<u64>::new(),
        Vec::<u64>::new(),
    )));
    moelane_telemetry::add_collector(Box::new(move || {
        let (tx, prev) = (tx.clone(), prev.clone());
        Box::pin(async move {
            let Ok(s) = call(&tx, Command::Snapshot).await else {
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
            ] {
                metrics::counter!(n::LANE_REQUESTS, "outcome" => outcome).absolute(v);
            }
            metrics::gauge!(n::MAP_EPOCH, "tier" => "primary").set(s.epoch as f64);
        })
    }));
}
