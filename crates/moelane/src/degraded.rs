//! Degraded, not down (`--degraded`): while the sidecar is lost, the primary computes the
//! cold experts itself, on its host, from the checkpoint, so the lane keeps serving, slower,
//! until the sidecar is back. The outputs are the same bits: each cold pick is computed by
//! the same CPU kernels in the same fixed order as a CPU sidecar would, one row per pick, and
//! the engine combines in router-rank order whoever computed them.
//!
//! [`Degradable`] wraps the supervised link: a request the link fails to send, or whose reply
//! does not come (the sidecar died or stalled mid-step), is computed here instead; no request
//! sees the failure. The experts are read on demand: a layer request loads only the experts it
//! picks that are not held yet, from the memory-mapped checkpoint, checksums verified against
//! the manifest taken at start (as a swap's loads are), and the least recently used ones are
//! dropped past `--degraded-memory`. An expert's weights do not depend on the map, so any map
//! epoch is served. Everything held is dropped once the link answers again.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use moelane_engine::bank::ExpertBank;
use moelane_engine::checkpoint::Checkpoint;
use moelane_engine::rowmap::Tier;
use moelane_engine::tier::{ColdReply, ColdRequest, RemoteTier};
use moelane_telemetry::names;

/// The cold experts read so far while degraded, least recently used first out.
struct LocalCold {
    bank: ExpertBank,
    /// (layer, expert) -> the tick of its last use
    used: HashMap<(usize, usize), u64>,
    /// tick -> (layer, expert): the order of last use
    order: BTreeMap<u64, (usize, usize)>,
    tick: u64,
    bytes: u64,
    /// A request's own experts exceeded the budget (said once).
    over_said: bool,
}

impl LocalCold {
    fn new(ckpt: &Checkpoint) -> Self {
        let c = &ckpt.config;
        LocalCold {
            bank: ExpertBank::empty(
                Tier::Cold,
                c.moe_layers().len(),
                c.num_experts,
                c.hidden_size,
                c.moe_intermediate_size,
            ),
            used: HashMap::new(),
            order: BTreeMap::new(),
            tick: 0,
            bytes: 0,
            over_said: false,
        }
    }

    /// Marks (layer, expert) as just used.
    fn touch(&mut self, key: (usize, usize)) {
        self.tick += 1;
        if let Some(old) = self.used.insert(key, self.tick) {
            self.order.remove(&old);
        }
        self.order.insert(self.tick, key);
    }

    /// Drops the least recently used experts, never one used at or after `keep_from`, until
    /// the bank holds at most `budget` bytes; returns how many went.
    fn evict(&mut self, budget: u64, keep_from: u64) -> usize {
        let mut gone = 0;
        while self.bytes > budget {
            let Some((&t, &(l, e))) = self.order.first_key_value() else {
                break;
            };
            if t >= keep_from {
                break;
            }
            self.order.remove(&t);
            self.used.remove(&(l, e));
            if let Some(w) = self.bank.remove(l, e) {
                self.bytes = self.bytes.saturating_sub(w.bytes() as u64);
            }
            gone += 1;
        }
        gone
    }
}

/// The link to the sidecar, with the primary's own computation behind it.
pub struct Degradable {
    pub link: Box<dyn RemoteTier>,
    pub ckpt: Arc<Checkpoint>,
    /// Checksums of every expert at start ([`moelane_engine::swap::manifest`]): what is read
    /// on demand must be what was there (a file rewritten since fails the step, loudly).
    pub manifest: Arc<Vec<Vec<u64>>>,
    pub state: Arc<moelane_gb300_worker::Readiness>,
    /// Most bytes of cold experts held here at once.
    pub budget: u64,
    local: Option<LocalCold>,
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
        manifest: Arc<Vec<Vec<u64>>>,
        state: Arc<moelane_gb300_worker::Readiness>,
        budget: u64,
    ) -> Self {
        Degradable {
            link,
            ckpt,
            manifest,
            state,
            budget,
            local: None,
            pending: None,
            ready: None,
            out: Vec::new(),
        }
    }

    /// Computes `req` on this host, reading the experts it picks that are not held yet.
    fn compute(&mut self, req: &ColdRequest, why: &str) -> moelane_engine::Result<ColdReply> {
        let layer = req.layer as usize;
        let experts = self.ckpt.config.num_experts;
        let Some(sums) = self.manifest.get(layer) else {
            return Err(moelane_engine::Error::Invalid(format!(
                "a cold request for MoE layer {layer}: the checkpoint has {}",
                self.manifest.len()
            )));
        };
        if let Some(p) = req.picks.iter().find(|p| p.expert as usize >= experts) {
            return Err(moelane_engine::Error::Invalid(format!(
                "a cold request picks expert {} of MoE layer {layer}: the checkpoint has {experts}",
                p.expert
            )));
        }
        let first = self.local.is_none();
        let local = self.local.get_or_insert_with(|| LocalCold::new(&self.ckpt));
        if first {
            tracing::warn!(
                reason = why,
                budget = self.budget,
                "the sidecar is lost: computing cold experts on this host from the checkpoint \
                 (degraded)"
            );
        }
        if self.state.set_degraded(Some(why.to_string())) {
            tracing::warn!(reason = why, "lane degraded");
        }
        let mut picked: Vec<usize> = req.picks.iter().map(|p| p.expert as usize).collect();
        picked.sort_unstable();
        picked.dedup();
        let keep_from = local.tick + 1;
        for &e in &picked {
            local.touch((layer, e));
        }
        let missing: Vec<moelane_engine::swap::Incoming> = picked
            .iter()
            .filter(|&&e| local.bank.get(layer, e).is_none())
            .map(|&e| (layer, e, sums.get(e).copied().unwrap_or_default()))
            .collect();
        if !missing.is_empty() {
            let loaded = moelane_engine::swap::load_verified(&self.ckpt, &missing)?;
            metrics::counter!(names::DEGRADED_LOADS).increment(loaded.len() as u64);
            for (l, e, w) in loaded {
                local.bytes += w.bytes() as u64;
                local.bank.insert(l, e, w);
            }
            let gone = local.evict(self.budget, keep_from);
            metrics::counter!(names::DEGRADED_EVICTIONS).increment(gone as u64);
            if local.bytes > self.budget && !local.over_said {
                local.over_said = true;
                tracing::warn!(
                    held = local.bytes,
                    budget = self.budget,
                    "one layer request's cold experts exceed --degraded-memory: they are held \
                     for the request, then dropped"
                );
            }
            metrics::gauge!(names::DEGRADED_BYTES).set(local.bytes as f64);
        }
        self.out.clear();
        self.out.resize(req.picks.len() * local.bank.hidden, 0.0);
        local
            .bank
            .compute(layer, &req.picks, &req.activations, &mut self.out)?;
        Ok(ColdReply {
            step: req.step,
            layer: req.layer,
            epoch: req.epoch,
            outputs: std::mem::take(&mut self.out),
        })
    }

    /// The link answered: the sidecar is back, what was read here goes.
    fn link_ok(&mut self) {
        let had = self.local.take().is_some();
        if had {
            metrics::gauge!(names::DEGRADED_BYTES).set(0.0);
        }
        if self.state.set_degraded(None) || had {
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

    // a live device link exchanges on the device; while it is down the engine comes back
    // to the host path above (computing here, degraded) until a new one is installed
    fn device_mailbox(&mut self) -> Option<moelane_engine::tier::MailboxPtrs> {
        let mb = self.link.device_mailbox();
        if mb.is_some() {
            // a new link is installed: the lane is no longer degraded
            self.link_ok();
        }
        mb
    }
    fn device_failed(&mut self) {
        self.link.device_failed()
    }
    fn reply_deadline(&self) -> Option<std::time::Duration> {
        self.link.reply_deadline()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn least_recently_used_experts_go_first_and_a_requests_own_never() {
        let dir = tempfile::tempdir().unwrap();
        let tiny = moelane_engine::synth::Preset::by_name("tiny").unwrap();
        moelane_engine::synth::generate(&tiny, 1, dir.path()).unwrap();
        let ckpt = Checkpoint::open(dir.path()).expect("tiny");
        let dl = ckpt.config.moe_layers()[0];
        let mut c = LocalCold::new(&ckpt);
        let one = ckpt.expert(dl, 0).expect("expert").bytes() as u64;
        let add = |c: &mut LocalCold, e: usize| {
            c.touch((0, e));
            c.bank.insert(0, e, Arc::new(ckpt.expert(dl, e).unwrap()));
            c.bytes += one;
        };
        for e in 0..4 {
            add(&mut c, e);
        }
        // expert 0 used again: 1 is now the least recently used
        c.touch((0, 0));
        let keep_from = c.tick + 1;
        add(&mut c, 5);
        assert_eq!(c.evict(3 * one, keep_from), 2);
        let held: Vec<usize> = c.bank.experts_of(0).map(|(e, _)| e).collect();
        assert_eq!(held, vec![0, 3, 5]);
        assert_eq!(c.bytes, 3 * one);
        // a budget below the request's own experts keeps them
        let keep_from = c.tick + 1;
        c.touch((0, 0));
        c.touch((0, 3));
        c.touch((0, 5));
        assert_eq!(c.evict(one, keep_from), 0);
        assert_eq!(c.bank.resident(0), 3);
    }
}
