//! Degraded, not down (`--degraded`): while the sidecar is lost, the primary computes the
//! cold experts itself, on its host, from the checkpoint, so the lane keeps serving, slower,
//! until the sidecar is back. The outputs are the same bits: each cold pick is computed by
//! the same CPU kernels in the same fixed order as a CPU sidecar would, one row per pick, and
//! the engine combines in router-rank order whoever computed them.
//!
//! [`Degradable`] wraps the supervised link: a request the link fails to send, or whose reply
//! does not come (the sidecar died or stalled mid-step), is computed here instead; no request
//! sees the failure. The local bank is loaded at the first need for the committed map (the
//! [`Committed`] participant keeps it current at each swap) and dropped once the link answers
//! again. It holds the cold experts in this process while degraded: the host needs that
//! memory free (the checkpoint's pages are mapped; the bank copies them).

use std::sync::{Arc, Mutex};

use futures::future::BoxFuture;
use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::rowmap::{Rowmap, ValidMap};
use moelane_engine::tier::{ColdReply, ColdRequest, RemoteTier};
use moelane_link::ColdService;
use moelane_residency_actor::{Participant, SwapError};
use moelane_rtx_worker::SidecarCore;

/// The map the engine routes with, kept current at every commit.
pub type CommittedMap = Arc<Mutex<ValidMap>>;

/// A participant that records each map it commits into a [`CommittedMap`].
pub struct Committed {
    pub inner: Box<dyn Participant>,
    pub map: CommittedMap,
    pub model: String,
    pub layers: usize,
    pub experts: usize,
}

impl Participant for Committed {
    fn name(&self) -> &'static str {
        self.inner.name()
    }
    fn prepare<'a>(
        &'a self,
        base: u64,
        next: &'a Rowmap,
        incoming: Vec<moelane_engine::swap::Incoming>,
    ) -> BoxFuture<'a, Result<(), SwapError>> {
        self.inner.prepare(base, next, incoming)
    }
    fn commit<'a>(&'a self, next: &'a Rowmap) -> BoxFuture<'a, Result<(), SwapError>> {
        Box::pin(async move {
            self.inner.commit(next).await?;
            if let Ok(v) = next
                .clone()
                .validate(&self.model, self.layers, self.experts, None)
            {
                *self.map.lock().unwrap_or_else(|p| p.into_inner()) = v;
            }
            Ok(())
        })
    }
    fn release(&self, epoch: u64) -> BoxFuture<'_, Result<(), SwapError>> {
        self.inner.release(epoch)
    }
    fn abort(&self, epoch: u64) -> BoxFuture<'_, Result<(), SwapError>> {
        self.inner.abort(epoch)
    }
    fn resync<'a>(&'a self, map: &'a Rowmap) -> BoxFuture<'a, Result<u64, SwapError>> {
        self.inner.resync(map)
    }
}

/// The link to the sidecar, with the primary's own computation behind it.
pub struct Degradable {
    pub link: Box<dyn RemoteTier>,
    pub ckpt: Arc<Checkpoint>,
    pub committed: CommittedMap,
    pub state: Arc<moelane_gb300_worker::Readiness>,
    /// The bank of the epoch it was loaded for.
    local: Option<(u64, Arc<SidecarCore>)>,
    /// A copy of the request in flight on the link (to compute it here if its reply fails).
    pending: Option<ColdRequest>,
    /// A reply computed here, for the next `recv`.
    ready: Option<moelane_engine::Result<ColdReply>>,
    out: Vec<f32>,
}

impl Degradable {
    pub fn new(
        link: Box<dyn RemoteTier>,
        ckpt: Arc<Checkpoint>,
        committed: CommittedMap,
        state: Arc<moelane_gb300_worker::Readiness>,
    ) -> Self {
        Degradable {
            link,
            ckpt,
            committed,
            state,
            local: None,
            pending: None,
            ready: None,
            out: Vec::new(),
        }
    }

    /// Computes `req` on this host (loading the committed map's cold bank when needed).
    fn compute(&mut self, req: &ColdRequest, why: &str) -> moelane_engine::Result<ColdReply> {
        let fresh = !matches!(&self.local, Some((e, _)) if *e == req.epoch);
        if fresh {
            let map = self
                .committed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone();
            if map.epoch() != req.epoch {
                return Err(moelane_engine::Error::EpochMismatch {
                    got: req.epoch,
                    serves: format!("the local fallback has map epoch {}", map.epoch()),
                });
            }
            let t0 = std::time::Instant::now();
            let core = SidecarCore::load(&self.ckpt, &map)?;
            tracing::warn!(
                epoch = req.epoch,
                load_s = t0.elapsed().as_secs_f64(),
                reason = why,
                "the sidecar is lost: computing cold experts on this host (degraded)"
            );
            self.local = Some((req.epoch, Arc::new(core)));
        }
        if self.state.set_degraded(Some(why.to_string())) {
            tracing::warn!(reason = why, "lane degraded");
        }
        let Some((_, core)) = &self.local else {
            return Err(moelane_engine::Error::Internal(
                "the local fallback has no bank".into(),
            ));
        };
        core.serve(req, &mut self.out)?;
        Ok(ColdReply {
            step: req.step,
            layer: req.layer,
            epoch: req.epoch,
            outputs: std::mem::take(&mut self.out),
        })
    }

    /// The link answered: the sidecar is back, the local bank goes.
    fn link_ok(&mut self) {
        let had_bank = self.local.take().is_some();
        if self.state.set_degraded(None) || had_bank {
            tracing::info!("the sidecar answers again: the lane is no longer degraded");
        }
    }
}

impl RemoteTier for Degradable {
    fn send(&mut self, req: ColdRequest) -> moelane_engine::Result<()> {
        self.ready = None;
        // a link that is down fails at once (its supervisor re-registers meanwhile): every
        // layer tries it first, so the first one after the sidecar is back goes to it
        let copy = req.clone();
        match self.link.send(req) {
            Ok(()) => {
                self.pending = Some(copy);
                Ok(())
            }
            Err(e) => {
                let r = self.compute(&copy, &format!("sending to the sidecar failed: {e}"));
                self.ready = Some(r);
                Ok(())
            }
        }
    }

    fn recv(&mut self) -> moelane_engine::Result<ColdReply> {
        if let Some(r) = self.ready.take() {
            return r;
        }
        let pending = self.pending.take();
        match self.link.recv() {
            Ok(r) => {
                self.link_ok();
                Ok(r)
            }
            Err(e) => match pending {
                Some(req) => self.compute(&req, &format!("the sidecar's reply failed: {e}")),
                None => Err(e),
            },
        }
    }

    fn kind(&self) -> &'static str {
        self.link.kind()
    }

    fn set_reply_deadline(&mut self, deadline: std::time::Duration) {
        self.link.set_reply_deadline(deadline)
    }
}
