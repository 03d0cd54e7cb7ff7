//! The residency coordinator: moves experts between the primary (hot) and the sidecar
//! (cold) through DESIGN.md's two-phase, epoch-tagged protocol, per batch of moves, map
//! epoch E -> E+1:
//! 1. PREPARE(E+1) to both tiers, concurrently, with a deadline: each stages its incoming
//!    experts (read from the checkpoint, checksum verified against the manifest taken at
//!    start) while serving goes on with map E. Any error or timeout -> ABORT(E+1) to both.
//! 2. COMMIT(E+1) to the primary only after both PREPARED: it switches at its next step
//!    boundary; the sidecar serves each request with the map of its tag (it holds both).
//! 3. The map is persisted atomically with its epoch (the durable commit point: after a
//!    crash both tiers come back on the persisted map), then RELEASE to both once no step
//!    with epoch E is in flight (the primary's step loop is synchronous, so that is as soon as
//!    COMMIT is acknowledged).
//!
//! Every attempt gets a fresh epoch; what that buys against lost, duplicated and late
//! messages is in [`protocol`], the transitions the sidecar runs.

pub mod error;
pub mod failpoint;
pub mod policy;
pub mod protocol;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use futures::future::BoxFuture;
use kameo::message::{Context, Message};
use kameo::Actor;
use moelane_engine::rowmap::{Rowmap, Tier, ValidMap};
use moelane_engine::swap::Incoming;

pub use error::SwapError;

/// One tier as the coordinator drives it. Errors are messages (they end in a ledger and a reply).
pub trait Participant: Send + Sync {
    fn name(&self) -> &'static str;
    /// Stage `incoming` for map `next` (epoch `next.epoch`), built on committed epoch `base`.
    fn prepare<'a>(
        &'a self,
        base: u64,
        next: &'a Rowmap,
        incoming: Vec<Incoming>,
    ) -> BoxFuture<'a, Result<(), SwapError>>;
    /// Switch to `next` at a step boundary. Only the primary commits (the protocol sends
    /// COMMIT to it alone; a sidecar already serves both epochs once prepared).
    fn commit<'a>(&'a self, _next: &'a Rowmap) -> BoxFuture<'a, Result<(), SwapError>> {
        Box::pin(async { Ok(()) })
    }
    /// `epoch` is committed: free what only the epoch before it used.
    fn release(&self, epoch: u64) -> BoxFuture<'_, Result<(), SwapError>>;
    /// Drop what was staged for `epoch`; it is never staged afterwards.
    fn abort(&self, epoch: u64) -> BoxFuture<'_, Result<(), SwapError>>;
    /// Bring the tier onto `map` (the committed one) after it or the coordinator restarted;
    /// returns the highest epoch the tier has seen, so that new attempts go above it.
    fn resync<'a>(&'a self, map: &'a Rowmap) -> BoxFuture<'a, Result<u64, SwapError>> {
        Box::pin(async move { Ok(map.epoch) })
    }
}

/// A participant whose control messages suffer the faults armed at `sidecar.prepare`,
/// `sidecar.release` and `sidecar.abort` (see [`failpoint`]).
pub struct Faulty(pub std::sync::Arc<dyn Participant>);

impl Faulty {
    /// Runs `deliver` as the armed fault at `point` says; a duplicate's late copy runs after
    /// 300 ms, when later messages have gone by.
    fn around<'a>(
        &'a self,
        point: &'static str,
        deliver: impl Fn(std::sync::Arc<dyn Participant>) -> BoxFuture<'static, Result<(), SwapError>>
            + Send
            + Sync
            + 'a,
    ) -> BoxFuture<'a, Result<(), SwapError>> {
        Box::pin(async move {
            let p = self.0.clone();
            match failpoint::hit(point) {
                Some(failpoint::Action::LoseRequest) => Err(SwapError::new(
                    moelane_engine::error::Fault::Timeout,
                    format!("{point}: no answer (request lost)"),
                )),
                Some(failpoint::Action::LoseReply) => {
                    let _ = deliver(p).await;
                    Err(SwapError::new(
                        moelane_engine::error::Fault::Timeout,
                        format!("{point}: no answer (reply lost)"),
                    ))
                }
                Some(failpoint::Action::Duplicate) => {
                    let r = deliver(p.clone()).await;
                    let _ = deliver(p.clone()).await;
                    let late = deliver(p);
                    tokio::spawn(async move {
                        tokio::time::sleep(Duration::from_millis(300)).await;
                        let r = late.await;
                        tracing::info!("{point}: late duplicate answered {r:?}");
                    });
                    r
                }
                Some(failpoint::Action::Delay(d)) => {
                    tokio::time::sleep(d).await;
                    deliver(p).await
                }
                Some(failpoint::Action::Fail) => {
                    Err(SwapError::unavailable(format!("{point}: injected failure")))
                }
                _ => deliver(p).await,
            }
        })
    }
}

impl Participant for Faulty {
    fn name(&self) -> &'static str {
        self.0.name()
    }
    fn prepare<'a>(
        &'a self,
        base: u64,
        next: &'a Rowmap,
        incoming: Vec<Incoming>,
    ) -> BoxFuture<'a, Result<(), SwapError>> {
        let next = next.clone();
        self.around("sidecar.prepare", move |p| {
            let (next, incoming) = (next.clone(), incoming.clone());
            Box::pin(async move { p.prepare(base, &next, incoming).await })
        })
    }
    fn commit<'a>(&'a self, next: &'a Rowmap) -> BoxFuture<'a, Result<(), SwapError>> {
        self.0.commit(next)
    }
    fn release(&self, epoch: u64) -> BoxFuture<'_, Result<(), SwapError>> {
        self.around("sidecar.release", move |p| {
            Box::pin(async move { p.release(epoch).await })
        })
    }
    fn abort(&self, epoch: u64) -> BoxFuture<'_, Result<(), SwapError>> {
        self.around("sidecar.abort", move |p| {
            Box::pin(async move { p.abort(epoch).await })
        })
    }
    fn resync<'a>(&'a self, map: &'a Rowmap) -> BoxFuture<'a, Result<u64, SwapError>> {
        self.0.resync(map)
    }
}

/// Where the coordinator reads the lane's counters.
pub trait CounterSource: Send + Sync {
    fn sample(&self) -> BoxFuture<'_, Result<policy::Sample, SwapError>>;
}

/// One adaptive swap batch: what was predicted, and what the next tick measured.
#[derive(Clone, Debug, PartialEq)]
pub struct LedgerEntry {
    pub epoch: u64,
    pub moves: usize,
    pub committed: bool,
    pub cold_share_before: f64,
    pub cold_share_predicted: f64,
    /// measured over the tick after the swap (None until then)
    pub cold_share_realised: Option<f64>,
    pub wait_share_before: f64,
    pub wait_share_realised: Option<f64>,
}

/// Adaptive mode: counters, policy, and what it learnt.
pub struct Adaptive {
    pub source: Box<dyn CounterSource>,
    pub policy: policy::Policy,
    pub dry_run: bool,
    scores: policy::Scores,
    last: Option<Instant>,
    /// When the rates were last saved beside the map file.
    saved: Option<Instant>,
    pub ledger: Vec<LedgerEntry>,
}

impl Adaptive {
    pub fn new(source: Box<dyn CounterSource>, policy: policy::Policy, dry_run: bool) -> Self {
        Adaptive {
            source,
            policy,
            dry_run,
            scores: policy::Scores::default(),
            last: None,
            saved: None,
            ledger: Vec::new(),
        }
    }
}

/// A requested move.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Move {
    pub layer: usize,
    pub expert: usize,
    pub to: Tier,
}

/// The outcome of one swap batch.
#[derive(Clone, Debug, PartialEq, kameo::Reply)]
pub struct SwapOutcome {
    pub epoch: u64,
    pub committed: bool,
    pub abort_reason: String,
    pub prepare: Duration,
    pub total: Duration,
}

#[derive(Actor)]
pub struct Residency {
    map: ValidMap,
    model: String,
    /// `checksums[layer][expert]` of the checkpoint as it was at start.
    manifest: Vec<Vec<u64>>,
    primary: Box<dyn Participant>,
    sidecar: Option<Box<dyn Participant>>,
    /// Where the committed map is persisted at each RELEASE (None: not persisted).
    map_path: Option<PathBuf>,
    prepare_timeout: Duration,
    /// Most moves per layer in one batch (the tiers' spare slots).
    spare_slots: usize,
    pub swaps_done: u64,
    pub swaps_aborted: u64,
    /// The highest epoch ever proposed or heard of: each attempt takes the one above.
    attempted: u64,
    adaptive: Option<Adaptive>,
    /// The file the adaptive pick rates were taken up from, if any.
    rates_from: Option<PathBuf>,
}

/// The adaptive policy's learnt pick rates as saved beside the map file, so a restarted
/// primary (a rolling upgrade) goes on from what the previous one learnt.
#[derive(serde::Serialize, serde::Deserialize)]
pub struct SavedRates {
    pub model: String,
    /// Seconds since the Unix epoch when saved: the rates decay over the time since.
    pub saved_unix_s: f64,
    /// Decayed picks per second, `[layer][expert]`.
    pub rate: Vec<Vec<f64>>,
}

/// Where the rates of the map at `map` are kept: `NAME.rates.json` beside `NAME.json`.
pub fn rates_path(map: &std::path::Path) -> PathBuf {
    map.with_extension("rates.json")
}

fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs_f64())
        .unwrap_or(0.0)
}

impl Residency {
    /// Turns on adaptive decisions (driven by [`Tick`] messages). With a map file, the pick
    /// rates a previous process saved beside it are taken up (decayed over the time since),
    /// when they are for this model and shape.
    pub fn with_adaptive(mut self, mut a: Adaptive) -> Self {
        if let Some(p) = self.map_path.as_deref().map(rates_path) {
            match self.read_rates(&p, &a.policy) {
                Ok(Some(rate)) => {
                    a.scores.seed(rate);
                    self.rates_from = Some(p);
                }
                Ok(None) => {}
                Err(why) => tracing::warn!(path = %p.display(), "saved pick rates not used: {why}"),
            }
        }
        self.adaptive = Some(a);
        self
    }

    /// The file the adaptive policy's pick rates were taken up from at start, if any.
    pub fn rates_from(&self) -> Option<&std::path::Path> {
        self.rates_from.as_deref()
    }

    /// The rates saved at `p`, decayed to now; None when there is no file.
    fn read_rates(
        &self,
        p: &std::path::Path,
        policy: &policy::Policy,
    ) -> Result<Option<Vec<Vec<f64>>>, String> {
        let text = match std::fs::read_to_string(p) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(e) => return Err(e.to_string()),
        };
        let saved: SavedRates = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        if saved.model != self.model {
            return Err(format!(
                "they are for model {:?}, this is {:?}",
                saved.model, self.model
            ));
        }
        let (layers, experts) = (self.map.layers(), self.map.experts());
        if saved.rate.len() != layers || saved.rate.iter().any(|l| l.len() != experts) {
            return Err(format!("they are not {layers} layers of {experts} experts"));
        }
        if saved
            .rate
            .iter()
            .flatten()
            .any(|r| !r.is_finite() || *r < 0.0)
        {
            return Err("a rate is negative or not a number".into());
        }
        let age = (unix_now() - saved.saved_unix_s).max(0.0);
        let decay = 0.5f64.powf(age / policy.half_life.as_secs_f64().max(1e-3));
        Ok(Some(
            saved
                .rate
                .into_iter()
                .map(|l| l.into_iter().map(|r| r * decay).collect())
                .collect(),
        ))
    }

    /// Saves the adaptive policy's pick rates beside the map file (nothing without either);
    /// returns where.
    fn save_rates(&self) -> Result<Option<PathBuf>, String> {
        let (Some(map), Some(a)) = (&self.map_path, &self.adaptive) else {
            return Ok(None);
        };
        if a.scores.rates().is_empty() {
            return Ok(None);
        }
        let p = rates_path(map);
        let saved = SavedRates {
            model: self.model.clone(),
            saved_unix_s: unix_now(),
            rate: a.scores.rates().to_vec(),
        };
        moelane_engine::rowmap::write_json_atomic(&p, &saved).map_err(|e| e.to_string())?;
        Ok(Some(p))
    }

    pub fn new(
        map: ValidMap,
        manifest: Vec<Vec<u64>>,
        primary: Box<dyn Participant>,
        sidecar: Option<Box<dyn Participant>>,
        map_path: Option<PathBuf>,
    ) -> Self {
        let model = map.map.model.clone();
        let attempted = map.epoch();
        Residency {
            attempted,
            map,
            model,
            manifest,
            primary,
            sidecar,
            map_path,
            prepare_timeout: Duration::from_secs(30),
            spare_slots: 8,
            swaps_done: 0,
            swaps_aborted: 0,
            adaptive: None,
            rates_from: None,
        }
    }

    /// Attempts go above `epoch` (the highest a tier has heard of).
    pub fn with_seen_epoch(mut self, epoch: u64) -> Self {
        self.attempted = self.attempted.max(epoch);
        self
    }

    pub fn with_limits(mut self, prepare_timeout: Duration, spare_slots: usize) -> Self {
        self.prepare_timeout = prepare_timeout;
        self.spare_slots = spare_slots.max(1);
        self
    }

    /// The next map: `moves` applied to the current one (promoted experts take new hot slots at
    /// the end, demoted ones new cold slots at the end), a fresh epoch, validated whole.
    fn next_map(&self, moves: &[Move]) -> Result<ValidMap, SwapError> {
        let (layers, experts) = (self.map.layers(), self.map.experts());
        let mut next = self.map.map.clone();
        next.epoch = self.attempted.max(next.epoch) + 1;
        // each tier stages its incoming experts in its spare slots of the layer
        let mut incoming = vec![[0usize; 2]; layers];
        for m in moves {
            if m.layer >= layers || m.expert >= experts {
                return Err(SwapError::invalid(format!(
                    "layer {} expert {}: out of range ({layers} layers, {experts} experts)",
                    m.layer, m.expert
                )));
            }
            let n = &mut incoming[m.layer][(m.to == Tier::Cold) as usize];
            *n += 1;
            if *n > self.spare_slots {
                return Err(SwapError::invalid(format!(
                    "layer {}: more than {} experts moved {} in one batch (spare slots)",
                    m.layer,
                    self.spare_slots,
                    m.to.name()
                )));
            }
            let lm = &mut next.layers[m.layer];
            let e = m.expert as u16;
            let (from, to) = match m.to {
                Tier::Hot => (&mut lm.cold, &mut lm.hot),
                Tier::Cold => (&mut lm.hot, &mut lm.cold),
            };
            let Some(i) = from.iter().position(|&x| x == e) else {
                return Err(SwapError::invalid(format!(
                    "layer {} expert {} is already {}",
                    m.layer,
                    m.expert,
                    m.to.name()
                )));
            };
            from.remove(i);
            to.push(e);
        }
        if moves.iter().any(|m| m.to == Tier::Cold) && self.sidecar.is_none() {
            return Err(SwapError::invalid("no sidecar: nothing can be made cold"));
        }
        next.validate(&self.model, layers, experts, None)
            .map_err(|e| SwapError::internal(format!("the moved map does not validate: {e}")))
    }

    /// One swap batch, traced (span "swap" with a child per phase) and counted.
    async fn run(&mut self, moves: Vec<Move>) -> SwapOutcome {
        use moelane_telemetry::names as n;
        use tracing::Instrument as _;
        let span = tracing::info_span!(
            "swap",
            moelane.epoch_from = self.map.epoch(),
            moelane.epoch = tracing::field::Empty,
            moelane.moves = moves.len(),
            moelane.outcome = tracing::field::Empty,
            moelane.abort_reason = tracing::field::Empty,
        );
        let (to_hot, to_cold) = (
            moves.iter().filter(|m| m.to == Tier::Hot).count() as u64,
            moves.iter().filter(|m| m.to == Tier::Cold).count() as u64,
        );
        // nothing to move, or moves that cannot be made: answered at once, no epoch taken,
        // nothing sent to the tiers, and not counted as an aborted swap
        let refused = if moves.is_empty() {
            Some(format!(
                "no moves: nothing to swap (the map stays at epoch {})",
                self.map.epoch()
            ))
        } else {
            self.next_map(&moves)
                .err()
                .map(|e| format!("rejected: {e}"))
        };
        if let Some(reason) = refused {
            span.record("moelane.outcome", "rejected");
            metrics::counter!(n::SWAPS, "outcome" => "rejected").increment(1);
            return SwapOutcome {
                epoch: self.map.epoch(),
                committed: false,
                abort_reason: reason,
                prepare: Duration::ZERO,
                total: Duration::ZERO,
            };
        }
        let o = self.run_inner(moves).instrument(span.clone()).await;
        span.record("moelane.epoch", o.epoch);
        span.record(
            "moelane.outcome",
            if o.committed { "committed" } else { "aborted" },
        );
        if !o.committed {
            span.record("moelane.abort_reason", o.abort_reason.as_str());
        }
        metrics::counter!(n::SWAPS, "outcome" => if o.committed { "committed" } else { "aborted" })
            .increment(1);
        metrics::histogram!(n::SWAP_DURATION).record(o.total.as_secs_f64());
        if o.committed {
            metrics::counter!(n::EXPERTS_MOVED, "to" => "hot").increment(to_hot);
            metrics::counter!(n::EXPERTS_MOVED, "to" => "cold").increment(to_cold);
            metrics::gauge!(n::MAP_EPOCH, "tier" => "primary").set(o.epoch as f64);
        }
        o
    }

    async fn run_inner(&mut self, moves: Vec<Move>) -> SwapOutcome {
        use moelane_telemetry::names as n;
        use tracing::Instrument as _;
        let phase = |name: &'static str, ok: bool| {
            metrics::counter!(n::SWAP_PHASES, "phase" => name, "outcome" => if ok { "ok" } else { "error" })
                .increment(1)
        };
        let t0 = Instant::now();
        let old = self.map.epoch();
        let abort = |reason: String, prepare: Duration| SwapOutcome {
            epoch: old,
            committed: false,
            abort_reason: reason,
            prepare,
            total: t0.elapsed(),
        };
        let next = match self.next_map(&moves) {
            Ok(n) => n,
            Err(e) => {
                self.swaps_aborted += 1;
                return abort(e.to_string(), Duration::ZERO);
            }
        };
        let incoming = |tier: Tier| -> Vec<Incoming> {
            moves
                .iter()
                .filter(|m| m.to == tier)
                .map(|m| (m.layer, m.expert, self.manifest[m.layer][m.expert]))
                .collect()
        };
        let (hot_in, cold_in) = (incoming(Tier::Hot), incoming(Tier::Cold));
        let (hot_n, cold_n) = (hot_in.len(), cold_in.len());
        let epoch = next.epoch();
        self.attempted = epoch;
        // 1. PREPARE both, concurrently, with a deadline
        let prepare_span = tracing::info_span!("prepare", moelane.epoch = epoch);
        let p = self.primary.prepare(old, &next.map, hot_in).instrument(
            tracing::info_span!(parent: &prepare_span, "primary.prepare", moelane.experts_in = hot_n),
        );
        let s: BoxFuture<'_, Result<(), SwapError>> = match &self.sidecar {
            Some(sc) => Box::pin(sc.prepare(old, &next.map, cold_in).instrument(
                tracing::info_span!(parent: &prepare_span, "sidecar.prepare", moelane.experts_in = cold_n),
            )),
            None => Box::pin(async { Ok(()) }),
        };
        let prepared = tokio::time::timeout(self.prepare_timeout, futures::future::join(p, s))
            .instrument(prepare_span.clone())
            .await;
        drop(prepare_span);
        let prepare = t0.elapsed();
        let failure = match prepared {
            Err(_) => Some(format!(
                "PREPARE timed out after {:?}",
                self.prepare_timeout
            )),
            Ok((Err(e), _)) => Some(format!("primary PREPARE failed: {e}")),
            Ok((_, Err(e))) => Some(format!("sidecar PREPARE failed: {e}")),
            Ok((Ok(()), Ok(()))) => None,
        };
        phase("prepare", failure.is_none());
        if let Some(reason) = failure {
            self.abort_all(epoch)
                .instrument(tracing::info_span!("abort", moelane.epoch = epoch))
                .await;
            phase("abort", true);
            self.swaps_aborted += 1;
            return abort(reason, prepare);
        }
        failpoint::hit("coordinator.after-prepare");
        // 2. COMMIT to the primary
        let committed = self
            .primary
            .commit(&next.map)
            .instrument(tracing::info_span!("commit", moelane.epoch = epoch))
            .await;
        phase("commit", committed.is_ok());
        if let Err(e) = committed {
            self.abort_all(epoch)
                .instrument(tracing::info_span!("abort", moelane.epoch = epoch))
                .await;
            phase("abort", true);
            self.swaps_aborted += 1;
            return abort(format!("primary COMMIT failed: {e}"), prepare);
        }
        failpoint::hit("coordinator.after-commit");
        self.map = next;
        self.swaps_done += 1;
        // the durable commit point
        if let Some(p) = &self.map_path {
            let _g = tracing::info_span!("persist", moelane.epoch = epoch).entered();
            if let Err(e) = self.map.map.write_atomic(p) {
                tracing::warn!("persisting map epoch {epoch}: {e}");
            }
        }
        failpoint::hit("coordinator.after-persist");
        let release_span = tracing::info_span!("release", moelane.epoch = epoch);
        // 3. RELEASE: no step of the old epoch is in flight once the primary has switched. A
        // lost RELEASE costs nothing: the sidecar serves both maps until the next PREPARE,
        // which tells it the staged one was committed.
        let released = async {
            let _ = self
                .primary
                .release(epoch)
                .instrument(tracing::info_span!("primary.release"))
                .await;
            match &self.sidecar {
                Some(sc) => sc
                    .release(epoch)
                    .instrument(tracing::info_span!("sidecar.release"))
                    .await
                    .map_err(|e| tracing::warn!("sidecar RELEASE into {epoch} failed: {e}"))
                    .is_ok(),
                None => true,
            }
        }
        .instrument(release_span)
        .await;
        phase("release", released);
        failpoint::hit("coordinator.after-release");
        SwapOutcome {
            epoch,
            committed: true,
            abort_reason: String::new(),
            prepare,
            total: t0.elapsed(),
        }
    }

    async fn abort_all(&self, epoch: u64) {
        let _ = self.primary.abort(epoch).await;
        if let Some(sc) = &self.sidecar {
            let _ = sc.abort(epoch).await;
        }
    }
}

/// Moves experts (one batch, one epoch step).
pub struct Swap(pub Vec<Move>);

impl Message<Swap> for Residency {
    type Reply = SwapOutcome;
    async fn handle(
        &mut self,
        Swap(moves): Swap,
        _: &mut Context<Self, Self::Reply>,
    ) -> SwapOutcome {
        self.run(moves).await
    }
}

/// Brings the sidecar onto the committed map after it (or this coordinator) restarted.
pub struct Resync;

impl Message<Resync> for Residency {
    type Reply = Result<u64, SwapError>;
    async fn handle(&mut self, _: Resync, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        let Some(sc) = &self.sidecar else {
            return Ok(self.map.epoch());
        };
        let highest = sc.resync(&self.map.map).await?;
        self.attempted = self.attempted.max(highest);
        Ok(self.map.epoch())
    }
}

/// The committed map.
pub struct CurrentMap;

impl Message<CurrentMap> for Residency {
    type Reply = Result<Rowmap, std::convert::Infallible>;
    async fn handle(&mut self, _: CurrentMap, _: &mut Context<Self, Self::Reply>) -> Self::Reply {
        Ok(self.map.map.clone())
    }
}

/// One decision round of adaptive residency.
pub struct Tick;

/// What a tick did.
#[derive(Clone, Debug, PartialEq, kameo::Reply)]
pub struct TickReport {
    pub decision: Option<policy::Decision>,
    pub outcome: Option<SwapOutcome>,
}

impl Message<Tick> for Residency {
    type Reply = TickReport;
    async fn handle(&mut self, _: Tick, _: &mut Context<Self, Self::Reply>) -> TickReport {
        let mut report = TickReport {
            decision: None,
            outcome: None,
        };
        let Some(mut a) = self.adaptive.take() else {
            return report;
        };
        let now = Instant::now();
        if let Ok(sample) = a.source.sample().await {
            let dt = a.last.map(|t| now - t).unwrap_or(Duration::from_secs(1));
            a.last = Some(now);
            if let Some(delta) = a.scores.update(sample, dt, &a.policy) {
                let decision = a.scores.decide(&self.map, &delta, &a.policy);
                // realised effect of the previous batch
                if let Some(last) = a.ledger.last_mut() {
                    if last.cold_share_realised.is_none() && delta.iter().flatten().any(|&n| n > 0)
                    {
                        last.cold_share_realised = Some(decision.cold_share);
                        last.wait_share_realised = Some(decision.wait_share);
                    }
                }
                if !decision.moves.is_empty() {
                    if a.dry_run {
                        tracing::info!(
                            moves = decision.moves.len(),
                            cold = decision.cold_share,
                            predicted = decision.predicted_cold_share,
                            "dry run: would swap"
                        );
                    } else {
                        let moves = decision.moves.clone();
                        let o = self.run(moves).await;
                        if a.ledger.len() >= 4096 {
                            a.ledger.remove(0);
                        }
                        a.ledger.push(LedgerEntry {
                            epoch: o.epoch,
                            moves: decision.moves.len(),
                            committed: o.committed,
                            cold_share_before: decision.cold_share,
                            cold_share_predicted: decision.predicted_cold_share,
                            cold_share_realised: None,
                            wait_share_before: decision.wait_share,
                            wait_share_realised: None,
                        });
                        report.outcome = Some(o);
                    }
                }
                report.decision = Some(decision);
            }
        }
        let due = a
            .saved
            .is_none_or(|t| now.duration_since(t) >= RATES_SAVE_INTERVAL);
        self.adaptive = Some(a);
        if due {
            if let Err(e) = self.save_rates() {
                tracing::warn!("saving the adaptive pick rates: {e}");
            }
            if let Some(a) = &mut self.adaptive {
                a.saved = Some(now);
            }
        }
        report
    }
}

/// How often a tick saves the adaptive pick rates beside the map file (a stop saves too).
pub const RATES_SAVE_INTERVAL: Duration = Duration::from_secs(10);

/// Saves the adaptive pick rates beside the map file now (a stop does it, so the process that
/// replaces this one goes on from them); where, if anywhere.
pub struct SaveRates;

impl Message<SaveRates> for Residency {
    type Reply = Result<Option<PathBuf>, String>;
    async fn handle(
        &mut self,
        _: SaveRates,
        _: &mut Context<Self, Self::Reply>,
    ) -> Result<Option<PathBuf>, String> {
        self.save_rates()
    }
}

/// The adaptive ledger and swap counts.
pub struct GetLedger;

#[derive(Clone, Debug, PartialEq, kameo::Reply)]
pub struct LedgerReport {
    pub epoch: u64,
    pub swaps_done: u64,
    pub swaps_aborted: u64,
    pub adaptive: bool,
    pub dry_run: bool,
    pub ledger: Vec<LedgerEntry>,
}

impl Message<GetLedger> for Residency {
    type Reply = LedgerReport;
    async fn handle(&mut self, _: GetLedger, _: &mut Context<Self, Self::Reply>) -> LedgerReport {
        LedgerReport {
            epoch: self.map.epoch(),
            swaps_done: self.swaps_done,
            swaps_aborted: self.swaps_aborted,
            adaptive: self.adaptive.is_some(),
            dry_run: self.adaptive.as_ref().is_some_and(|a| a.dry_run),
            ledger: self
                .adaptive
                .as_ref()
                .map(|a| a.ledger.clone())
                .unwrap_or_default(),
        }
    }
}
