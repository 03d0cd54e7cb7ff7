//! The one step of the primary, for every backend: DESIGN.md's decode step written once.
//! Per decoder layer: attention, then on a MoE layer the router's top-k, the picks split by
//! the rowmap into hot and cold, the cold picks sent over the [`RemoteTier`] with the rows
//! they name, the hot experts computed while the reply is in flight, the reply scattered
//! into its pick slots, and every token's k outputs combined in router-rank order, so the
//! layer's output does not depend on the map. The counters the residency actor reads are
//! taken here too, from the step's picks.
//!
//! The math sits behind [`StepBackend`] (candle's backend seam, cut at the ops of a step):
//! the CPU backend (`cpu.rs`) on the host, and the GPU model behind the `cuda` feature.
//! A backend may queue its ops and run them when the host must look (the GPU runs a step as
//! a few CUDA graphs cut only at the layers whose map has cold experts); the order of the
//! calls here is the order of the math.

use std::any::Any;
use std::time::Instant;

use crate::bank::{ExpertBank, Pick};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv::{KvCache, KvDtype, SeqKv};
use crate::rowmap::{Tier, ValidMap};
use crate::sampling::TokenPick;
use crate::tier::{ColdReply, ColdRequest, MailboxPtrs, RemoteTier};

/// The longest a step waits on the device for a layer's reply when the link names no bound
/// ([`RemoteTier::reply_deadline`]).
const MAILBOX_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

/// Where a batch row sits: which sequence and which position.
#[derive(Clone, Copy, Debug)]
pub struct RowPos {
    pub seq: usize,
    pub pos: usize,
}

/// What a step's head leaves for the host: the logits, or one token per logit row (the
/// argmax, or drawn as each row's [`TokenPick`] says).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HeadOut {
    Logits,
    Argmax,
    Sample,
}

/// What a step returns: every asked row's logits, or only their next tokens (computed where
/// the logits are, so a GPU step downloads a few ints instead of rows of the vocabulary).
pub enum StepOut {
    Logits(Vec<f32>),
    Ids(Vec<u32>),
}

/// The device address of the step's normed rows, for a link that sends from device memory.
#[derive(Clone, Copy, Debug)]
pub struct DeviceRows {
    pub ordinal: usize,
    pub ptr: u64,
    pub len: usize,
}

/// MoE layer `ml`'s picks split by the map: the hot ones for this process's bank, the cold
/// ones for the cold tier with the distinct rows they read, and each pick's slot
/// (`row * k + rank`) so outputs land in router-rank order whichever tier computed them.
#[derive(Default, Debug)]
pub struct Split {
    /// Hot picks; `row` is the batch row.
    pub hot: Vec<Pick>,
    pub hot_slots: Vec<u32>,
    /// Cold picks; `row` indexes `cold_rows` (or is the batch row when the link sends all
    /// rows from device memory).
    pub cold: Vec<Pick>,
    /// The batch rows the cold picks read, deduplicated, in pick order.
    pub cold_rows: Vec<u32>,
    pub cold_slots: Vec<u32>,
    row_of: Vec<u32>,
}

impl Split {
    /// Splits `picks` (`[rows, k]` expert ids in rank order) of MoE layer `ml` by `map`.
    /// With `all_rows`, a cold pick names its batch row (every row travels).
    pub fn build(
        &mut self,
        map: &ValidMap,
        ml: usize,
        picks: &[i32],
        k: usize,
        experts: usize,
        all_rows: bool,
    ) -> Result<()> {
        let n = picks.len() / k.max(1);
        self.hot.clear();
        self.hot_slots.clear();
        self.cold.clear();
        self.cold_rows.clear();
        self.cold_slots.clear();
        self.row_of.clear();
        self.row_of.resize(n, u32::MAX);
        for (slot, &e) in picks.iter().enumerate() {
            let r = slot / k;
            let expert = checked_expert(e, experts, ml)?;
            match map.tier(ml, expert as usize) {
                Tier::Hot => {
                    self.hot.push(Pick {
                        row: r as u32,
                        expert,
                    });
                    self.hot_slots.push(slot as u32);
                }
                Tier::Cold => {
                    if self.row_of[r] == u32::MAX {
                        self.row_of[r] = self.cold_rows.len() as u32;
                        self.cold_rows.push(r as u32);
                    }
                    let row = if all_rows { r as u32 } else { self.row_of[r] };
                    self.cold.push(Pick { row, expert });
                    self.cold_slots.push(slot as u32);
                }
            }
        }
        Ok(())
    }
}

/// A pick read back from a backend must name an expert of the layer.
fn checked_expert(e: i32, experts: usize, ml: usize) -> Result<u16> {
    if e < 0 || e as usize >= experts || e > u16::MAX as i32 {
        return Err(Error::Internal(format!(
            "MoE layer {ml}: the router picked expert {e} of {experts}"
        )));
    }
    Ok(e as u16)
}

/// The math of one step on one device. Calls come in the order of [`Engine`]'s step:
/// `begin`, `embed`, per layer `attention` then (`route`, [`StepBackend::picks`] where the
/// host must look, `experts`, `scatter`, `combine`) or `dense_mlp`, then `head`.
pub trait StepBackend: Send {
    /// For logs: "cpu", "cuda:0".
    fn describe(&self) -> String;
    /// Starts a step over `rows` (`tokens` one per row); the head reads `logit_rows`.
    fn begin(
        &mut self,
        tokens: &[u32],
        rows: &[RowPos],
        seqs: &[&SeqKv],
        logit_rows: &[usize],
    ) -> Result<()>;
    /// x = the embedding rows of the step's tokens.
    fn embed(&mut self) -> Result<()>;
    /// x += attention(input_norm(x)) of decoder layer `layer`, writing K/V of every row.
    fn attention(&mut self, layer: usize, seqs: &[&SeqKv], kv: &mut KvCache) -> Result<()>;
    /// h = post_norm(x); the router's top-k of MoE layer `ml` (decoder layer `layer`).
    fn route(&mut self, layer: usize, ml: usize) -> Result<()>;
    /// Whether the picks are on the host after `route` at no cost (the step then splits
    /// every MoE layer; else only layers whose map has cold experts).
    fn host_routes(&self) -> bool;
    /// MoE layer `ml`'s picks `[rows, k]` on the host (a device waits for them); with
    /// `rows`, the normed rows `[rows, H]` too ([`StepBackend::normed_rows`]).
    fn picks(&mut self, ml: usize, rows: bool, out: &mut Vec<i32>) -> Result<()>;
    /// The step's normed rows `[rows, H]` on the host (after `picks` with `rows`).
    fn normed_rows(&self) -> &[f32];
    /// The normed rows in device memory, for a link on that device (none on the host).
    fn device_rows(&self) -> Option<DeviceRows> {
        None
    }
    /// The hot experts of MoE layer `ml` into their pick slots: `split`'s hot picks, or
    /// every pick when `split` is None (the map has no cold expert on this layer).
    fn experts(&mut self, ml: usize, bank: &ExpertBank, split: Option<&Split>) -> Result<()>;
    /// The cold tier's outputs (one row of H per slot) into their pick slots.
    fn scatter(&mut self, slots: &[u32], outputs: &[f32]) -> Result<()>;
    /// As `scatter`, from `len` floats at `src` in the memory of [`Self::device_rows`]'s
    /// device.
    ///
    /// # Safety
    /// `src` addresses `len` floats of that device's memory, complete, and unchanged until
    /// the backend next waits for its device.
    unsafe fn scatter_device(&mut self, slots: &[u32], src: u64, len: usize) -> Result<()> {
        let _ = (slots, src, len);
        Err(Error::Internal(format!(
            "the {} backend has no device memory",
            self.describe()
        )))
    }
    /// Exchanges through `mb`'s device mailbox from now on (None: no longer); false when
    /// this backend cannot (the step then exchanges through the link's host calls).
    fn attach_mailbox(&mut self, mb: Option<MailboxPtrs>) -> Result<bool> {
        let _ = mb;
        Ok(false)
    }
    /// With a mailbox attached, after `begin`: the step's map epoch, engine step and the
    /// longest a layer may wait for its reply.
    fn link_begin(&mut self, epoch: u64, step: u64, limit_ns: u64) -> Result<()> {
        let _ = (epoch, step, limit_ns);
        Err(Error::Internal("this backend has no device mailbox".into()))
    }
    /// With a mailbox attached: MoE layer `ml`'s picks and rows to the sidecar (after
    /// `route`), and its reply into the cold slots (after `experts`).
    fn link_layer(&mut self, ml: usize, join: bool) -> Result<()> {
        let _ = (ml, join);
        Err(Error::Internal("this backend has no device mailbox".into()))
    }
    /// With a mailbox attached, after `head`: the link's status (a failure is the step's
    /// error) and each MoE layer's wait added to `wait_ns`.
    fn link_end(&mut self, wait_ns: &mut [u64]) -> Result<()> {
        let _ = wait_ns;
        Err(Error::Internal("this backend has no device mailbox".into()))
    }
    /// x += the layer's pick outputs weighted by the router, in rank order.
    fn combine(&mut self) -> Result<()>;
    /// x += sigmoid(gate . h) * shared_expert(h) on a MoE layer that has a shared expert
    /// (qwen2_moe; `h` the route's normed rows); nothing elsewhere. Always on the primary.
    fn shared_expert(&mut self, layer: usize) -> Result<()>;
    /// x += dense MLP(post_norm(x)) of non-MoE layer `layer`.
    fn dense_mlp(&mut self, layer: usize) -> Result<()>;
    /// The hidden state `[rows, H]` (the parity tests' trace).
    fn hidden(&mut self, out: &mut Vec<f32>) -> Result<()>;
    /// final_norm and the LM head for the logit rows, then what the step returns; `picks`
    /// holds one pick per logit row when `out` is not [`HeadOut::Logits`].
    fn head(&mut self, out: HeadOut, picks: &[TokenPick]) -> Result<StepOut>;
    /// After `head`: the step's picks `[moe layers, rows, k]`, for the counters.
    fn step_picks(&self) -> &[i32];
    /// The bank's experts changed (a swap staged or released some).
    fn sync_hot(&mut self, bank: &ExpertBank) -> Result<()> {
        let _ = bank;
        Ok(())
    }
    /// The step routes with `map` from now on.
    fn set_map(&mut self, map: &ValidMap) -> Result<()> {
        let _ = map;
        Ok(())
    }
    /// Refuses swaps when this backend cannot move experts.
    fn swappable(&self) -> Result<()> {
        Ok(())
    }
    /// Bytes of weights one decode token reads from this backend (experts aside).
    fn bytes_per_token(&self) -> usize;
    /// This backend as `Any`, for the tests and benches that tune a concrete one.
    fn as_any_mut(&mut self) -> &mut dyn Any;
}

/// Per-layer counters the residency actor consumes.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Counters {
    /// `picks[layer][expert]`: all picks (hot + cold).
    pub picks: Vec<Vec<u64>>,
    pub hot_picks: Vec<u64>,
    pub cold_picks: Vec<u64>,
    /// Nanoseconds the primary waited for the cold reply, per layer.
    pub wait_ns: Vec<u64>,
    pub steps: u64,
    pub tokens: u64,
    /// Expert weight loads: distinct experts computed per layer per step, summed.
    pub expert_loads: u64,
    /// Nanoseconds spent inside `step`.
    pub step_ns: u64,
    /// The longest single step, ns.
    pub max_step_ns: u64,
    /// Of `expert_loads`, those of experts the map puts hot (read from the primary's memory).
    pub hot_expert_loads: u64,
}

impl Counters {
    pub fn new(layers: usize, experts: usize) -> Self {
        Counters {
            picks: vec![vec![0; experts]; layers],
            hot_picks: vec![0; layers],
            cold_picks: vec![0; layers],
            wait_ns: vec![0; layers],
            ..Counters::default()
        }
    }

    /// Adds one step's picks (`[layers, rows, k]`) routed with `map` (`seen`: scratch).
    fn add_picks(
        &mut self,
        map: &ValidMap,
        picks: &[i32],
        rows: usize,
        k: usize,
        seen: &mut Vec<bool>,
    ) -> Result<()> {
        let experts = self.picks.first().map_or(0, Vec::len);
        let per_layer = rows * k;
        if picks.len() != per_layer * self.picks.len() {
            return Err(Error::Internal(format!(
                "the step left {} picks, {} MoE layers of {rows} rows x {k} need {}",
                picks.len(),
                self.picks.len(),
                per_layer * self.picks.len()
            )));
        }
        for (ml, layer) in picks.chunks(per_layer.max(1)).enumerate() {
            seen.clear();
            seen.resize(experts, false);
            for &e in layer {
                let e = checked_expert(e, experts, ml)? as usize;
                self.picks[ml][e] += 1;
                let hot = map.tier(ml, e) == Tier::Hot;
                if hot {
                    self.hot_picks[ml] += 1;
                } else {
                    self.cold_picks[ml] += 1;
                }
                if !seen[e] {
                    seen[e] = true;
                    self.expert_loads += 1;
                    self.hot_expert_loads += hot as u64;
                }
            }
        }
        Ok(())
    }
}

/// One sequence's part of a step: append `tokens` at `kv.len`.
/// Which new tokens of a step give logits.
#[derive(Clone, Copy)]
enum Rows<'a> {
    /// Each sequence's last.
    Last,
    /// Every one.
    All,
    /// Every one of the sequences flagged, the last of the others.
    Whole(&'a [bool]),
}

pub struct SeqStep<'a> {
    pub kv: &'a mut SeqKv,
    pub tokens: &'a [u32],
}

/// The primary's engine: a step backend, the hot bank, the link to the cold tier, the map
/// and the KV cache's block accounting.
pub struct Engine {
    pub cfg: ModelConfig,
    backend: Box<dyn StepBackend>,
    pub hot: ExpertBank,
    pub cold: Option<Box<dyn RemoteTier>>,
    pub map: ValidMap,
    pub kv: KvCache,
    pub counters: Counters,
    moe_of_layer: Vec<Option<usize>>,
    step_no: u64,
    /// the generation of the device mailbox the backend exchanges through (the cold
    /// tier's [`RemoteTier::device_mailbox`]), when it does
    mailbox: Option<u64>,
    split: Split,
    picks: Vec<i32>,
    acts: Vec<f32>,
    seen: Vec<bool>,
    /// When set, the hidden state `[rows, H]` after every decoder layer of each step is
    /// appended here (the GPU/CPU parity tests read it).
    pub trace: Option<Vec<Vec<f32>>>,
}

/// The rows, tokens and logit rows of one step.
struct Batch {
    rows: Vec<RowPos>,
    tokens: Vec<u32>,
    logit_rows: Vec<usize>,
}

impl Engine {
    pub fn new(
        cfg: ModelConfig,
        backend: Box<dyn StepBackend>,
        hot: ExpertBank,
        cold: Option<Box<dyn RemoteTier>>,
        map: ValidMap,
        kv_blocks: usize,
    ) -> Self {
        let kv = KvCache::for_model(&cfg, kv_blocks);
        Self::with_kv(cfg, backend, hot, cold, map, kv)
    }

    /// As [`Engine::new`], with the KV cache given (a device backend keeps its K/V itself
    /// and gives an accounting-only cache).
    pub fn with_kv(
        cfg: ModelConfig,
        backend: Box<dyn StepBackend>,
        hot: ExpertBank,
        cold: Option<Box<dyn RemoteTier>>,
        map: ValidMap,
        kv: KvCache,
    ) -> Self {
        let moe = cfg.moe_layers();
        let mut moe_of_layer = vec![None; cfg.num_hidden_layers];
        for (i, &l) in moe.iter().enumerate() {
            moe_of_layer[l] = Some(i);
        }
        let counters = Counters::new(moe.len(), cfg.num_experts);
        Engine {
            cfg,
            backend,
            hot,
            cold,
            map,
            kv,
            counters,
            moe_of_layer,
            step_no: 0,
            mailbox: None,
            split: Split::default(),
            picks: Vec::new(),
            acts: Vec::new(),
            seen: Vec::new(),
            trace: None,
        }
    }

    /// Runs this engine's steps on `backend` from now on, with `kv` as the KV accounting
    /// (call before the first step: the engine must hold no live sequence). The backend is
    /// given this engine's hot experts and map.
    pub fn set_backend(&mut self, mut backend: Box<dyn StepBackend>, kv: KvCache) -> Result<()> {
        if self.kv.used_blocks() != 0 {
            return Err(Error::Invalid(
                "the step backend cannot change while sequences are live".into(),
            ));
        }
        backend.sync_hot(&self.hot)?;
        backend.set_map(&self.map)?;
        self.backend = backend;
        self.kv = kv;
        Ok(())
    }

    /// Stores the host KV cache as `dtype` from now on (call before the first step: the
    /// engine must hold no live sequence; the cache keeps its size in positions). An engine
    /// whose K/V live on a GPU keeps them there as they are: refused.
    pub fn set_kv_dtype(&mut self, dtype: KvDtype) -> Result<()> {
        if self.kv.dtype == dtype {
            return Ok(());
        }
        if self.kv.used_blocks() != 0 {
            return Err(Error::Invalid(
                "the KV cache's dtype cannot change while sequences are live".into(),
            ));
        }
        if self.kv.host_layers() == 0 {
            return Err(Error::Invalid(format!(
                "a {} KV cache is for the CPU backend: this engine's cache is on a GPU (f32)",
                dtype.name()
            )));
        }
        self.kv = KvCache::for_model_as(&self.cfg, self.kv.blocks, dtype)?;
        Ok(())
    }

    /// Gives the backend this engine's hot experts and map.
    pub fn sync_backend(&mut self) -> Result<()> {
        self.backend.sync_hot(&self.hot)?;
        self.backend.set_map(&self.map)
    }

    /// The concrete step backend, when it is a `B`.
    pub fn backend_as<B: StepBackend + 'static>(&mut self) -> Option<&mut B> {
        self.backend.as_any_mut().downcast_mut::<B>()
    }

    /// Bytes of dense weights one decode token reads.
    pub fn dense_bytes_per_token(&self) -> usize {
        self.backend.bytes_per_token()
    }

    /// Runs one step; returns logits `[seqs.len(), vocab]` of each sequence's last new token.
    pub fn step(&mut self, seqs: &mut [SeqStep<'_>]) -> Result<Vec<f32>> {
        self.step_with(seqs, false)
    }

    /// As [`Engine::step`]; with `all_rows`, logits of every new token (`[rows, vocab]`).
    pub fn step_with(&mut self, seqs: &mut [SeqStep<'_>], all_rows: bool) -> Result<Vec<f32>> {
        let rows = if all_rows { Rows::All } else { Rows::Last };
        match self.step_timed(seqs, rows, None)? {
            StepOut::Logits(l) => Ok(l),
            StepOut::Ids(_) => Err(Error::Internal("a logits step returned ids".into())),
        }
    }

    /// As [`Engine::step`], with the logits of every new token of each sequence `whole`
    /// names (a prompt's log-probabilities), of the last new token of the others: in
    /// sequence order, `[rows, vocab]`.
    pub fn step_whole(&mut self, seqs: &mut [SeqStep<'_>], whole: &[bool]) -> Result<Vec<f32>> {
        if whole.len() != seqs.len() {
            return Err(Error::Invalid(format!(
                "{} whole-logits flags for {} sequences",
                whole.len(),
                seqs.len()
            )));
        }
        match self.step_timed(seqs, Rows::Whole(whole), None)? {
            StepOut::Logits(l) => Ok(l),
            StepOut::Ids(_) => Err(Error::Internal("a logits step returned ids".into())),
        }
    }

    /// As [`Engine::step`], returning only each sequence's greedy next token.
    pub fn step_argmax(&mut self, seqs: &mut [SeqStep<'_>]) -> Result<Vec<u32>> {
        let picks = vec![TokenPick::Greedy; seqs.iter().filter(|s| !s.tokens.is_empty()).count()];
        self.step_pick(seqs, &picks)
    }

    /// As [`Engine::step`], returning each sequence's next token as `picks` says (one per
    /// sequence with new tokens): on a GPU the logits never leave it.
    pub fn step_pick(&mut self, seqs: &mut [SeqStep<'_>], picks: &[TokenPick]) -> Result<Vec<u32>> {
        match self.step_timed(seqs, Rows::Last, Some(picks))? {
            StepOut::Ids(ids) => Ok(ids),
            StepOut::Logits(l) => Err(Error::Internal(format!(
                "a token step returned {} logits",
                l.len()
            ))),
        }
    }

    fn step_timed(
        &mut self,
        seqs: &mut [SeqStep<'_>],
        rows: Rows<'_>,
        picks: Option<&[TokenPick]>,
    ) -> Result<StepOut> {
        let t0 = Instant::now();
        let r = self.step_inner(seqs, rows, picks);
        let ns = t0.elapsed().as_nanos() as u64;
        self.counters.step_ns += ns;
        self.counters.max_step_ns = self.counters.max_step_ns.max(ns);
        r
    }

    /// Checks the step, reserves KV for every sequence (all or nothing) and lists its rows.
    fn batch(
        &mut self,
        seqs: &mut [SeqStep<'_>],
        logit_rows: Rows<'_>,
        picks: Option<&[TokenPick]>,
    ) -> Result<Batch> {
        if let Some(p) = picks {
            let want = seqs.iter().filter(|s| !s.tokens.is_empty()).count();
            if p.len() != want {
                return Err(Error::Invalid(format!(
                    "{} token picks for {want} sequences with new tokens",
                    p.len()
                )));
            }
        }
        let max_ctx = self.cfg.max_position_embeddings;
        for s in seqs.iter() {
            let new_len = s.kv.len + s.tokens.len();
            if new_len > max_ctx {
                return Err(Error::ContextOverflow {
                    len: new_len,
                    max: max_ctx,
                });
            }
        }
        for s in seqs.iter_mut() {
            let new_len = s.kv.len + s.tokens.len();
            self.kv.reserve(s.kv, new_len)?;
        }
        let mut b = Batch {
            rows: Vec::new(),
            tokens: Vec::new(),
            logit_rows: Vec::new(),
        };
        for (si, s) in seqs.iter().enumerate() {
            let first = b.rows.len();
            for (j, &t) in s.tokens.iter().enumerate() {
                b.rows.push(RowPos {
                    seq: si,
                    pos: s.kv.len + j,
                });
                b.tokens.push(t);
            }
            let whole = match logit_rows {
                Rows::Last => false,
                Rows::All => true,
                Rows::Whole(w) => w.get(si).copied().unwrap_or(false),
            };
            if whole {
                b.logit_rows.extend(first..b.rows.len());
            } else if !s.tokens.is_empty() {
                b.logit_rows.push(b.rows.len() - 1);
            }
        }
        Ok(b)
    }

    fn step_inner(
        &mut self,
        seqs: &mut [SeqStep<'_>],
        rows: Rows<'_>,
        picks: Option<&[TokenPick]>,
    ) -> Result<StepOut> {
        let batch = self.batch(seqs, rows, picks)?;
        let n = batch.rows.len();
        {
            let seq_refs: Vec<&SeqKv> = seqs.iter().map(|s| &*s.kv).collect();
            self.backend
                .begin(&batch.tokens, &batch.rows, &seq_refs, &batch.logit_rows)?;
            if let Err(e) = self.link_begin() {
                self.device_failed();
                return Err(e);
            }
            self.backend.embed()?;
            for l in 0..self.cfg.num_hidden_layers {
                self.backend.attention(l, &seq_refs, &mut self.kv)?;
                match self.moe_of_layer[l] {
                    Some(ml) => self.moe_layer(l, ml, n)?,
                    None => self.backend.dense_mlp(l)?,
                }
                if let Some(t) = self.trace.as_mut() {
                    let mut x = Vec::new();
                    self.backend.hidden(&mut x)?;
                    t.push(x);
                }
            }
        }
        for s in seqs.iter_mut() {
            s.kv.len += s.tokens.len();
        }
        let head = match picks {
            None => HeadOut::Logits,
            Some(p) if p.iter().all(|p| *p == TokenPick::Greedy) => HeadOut::Argmax,
            Some(_) => HeadOut::Sample,
        };
        let out = self.backend.head(head, picks.unwrap_or(&[]));
        let out = match (out, self.mailbox.is_some()) {
            (Ok(o), true) => self
                .backend
                .link_end(&mut self.counters.wait_ns)
                .map(|()| o),
            (r, _) => r,
        };
        let out = match out {
            Ok(o) => o,
            Err(e) => {
                // the step did not happen: its tokens are not in the sequences
                for s in seqs.iter_mut() {
                    s.kv.len -= s.tokens.len();
                }
                if self.mailbox.is_some() {
                    self.device_failed();
                }
                return Err(e);
            }
        };
        let k = self.cfg.num_experts_per_tok;
        self.counters
            .add_picks(&self.map, self.backend.step_picks(), n, k, &mut self.seen)?;
        self.step_no += 1;
        self.counters.steps += 1;
        self.counters.tokens += n as u64;
        Ok(out)
    }

    /// The device mailbox failed: the link is told (a supervised one is replaced).
    fn device_failed(&mut self) {
        if let Some(c) = self.cold.as_mut() {
            c.device_failed();
        }
    }

    /// Attaches the cold tier's device mailbox to the backend when it has a new one (or
    /// detaches it), then starts the step on it.
    fn link_begin(&mut self) -> Result<()> {
        let mb = self.cold.as_mut().and_then(|c| c.device_mailbox());
        let generation = mb.map(|m| m.generation);
        if generation != self.mailbox {
            self.mailbox = None;
            if self.backend.attach_mailbox(mb)? {
                self.mailbox = generation;
            }
        }
        if self.mailbox.is_none() {
            return Ok(());
        }
        let limit = self
            .cold
            .as_ref()
            .map_or(MAILBOX_WAIT, |c| c.reply_deadline().unwrap_or(MAILBOX_WAIT));
        self.backend.link_begin(
            self.map.epoch(),
            self.step_no,
            limit.as_nanos().min(u64::MAX as u128) as u64,
        )
    }

    /// One MoE layer: route, split by the map, cold picks out, hot experts, cold outputs
    /// in, combine.
    fn moe_layer(&mut self, layer: usize, ml: usize, n: usize) -> Result<()> {
        let (k, ne) = (self.cfg.num_experts_per_tok, self.cfg.num_experts);
        self.backend.route(layer, ml)?;
        if self.mailbox.is_some() {
            // the device posts the picks and rows, computes the hot ones, and waits for the
            // cold ones: the host does not look
            self.backend.link_layer(ml, false)?;
            self.backend.experts(ml, &self.hot, None)?;
            self.backend.link_layer(ml, true)?;
            self.backend.shared_expert(layer)?;
            return self.backend.combine();
        }
        let has_cold = !self.map.map.layers[ml].cold.is_empty();
        if !has_cold && !self.backend.host_routes() {
            // every pick is hot: the backend's own map decides, the host need not look
            self.backend.experts(ml, &self.hot, None)?;
            self.backend.shared_expert(layer)?;
            return self.backend.combine();
        }
        // a link on the backend's device sends the rows from there: only picks come here
        let device = self
            .backend
            .device_rows()
            .filter(|d| self.cold.as_ref().and_then(|t| t.device_ordinal()) == Some(d.ordinal));
        self.backend.picks(ml, device.is_none(), &mut self.picks)?;
        let mut split = std::mem::take(&mut self.split);
        let r = split
            .build(&self.map, ml, &self.picks, k, ne, device.is_some())
            .and_then(|()| self.exchange(ml, n, &split, device));
        self.split = split;
        r?;
        self.backend.shared_expert(layer)?;
        self.backend.combine()
    }

    /// Sends the split's cold picks, computes the hot ones meanwhile, and scatters the cold
    /// tier's outputs into their slots (the wait added to the layer's counter).
    fn exchange(
        &mut self,
        ml: usize,
        n: usize,
        split: &Split,
        device: Option<DeviceRows>,
    ) -> Result<()> {
        let hs = self.cfg.hidden_size;
        if split.cold.is_empty() {
            return self.backend.experts(ml, &self.hot, Some(split));
        }
        let (step, epoch) = (self.step_no, self.map.epoch());
        let cold = self.cold.as_mut().ok_or(Error::NoColdTier {
            layer: ml,
            picks: split.cold.len(),
        })?;
        let mut req = ColdRequest {
            step,
            layer: ml as u32,
            epoch,
            picks: split.cold.clone(),
            activations: Vec::new(),
        };
        match device {
            // SAFETY: the rows are the step's n normed rows, complete (`picks` waited for the
            // device) and unchanged until the reply is in: their next writer is the next
            // layer's router, queued after the scatter.
            Some(d) => unsafe { cold.send_device(req, d.ptr, d.len) }?,
            None => {
                let h = self.backend.normed_rows();
                if h.len() < n * hs {
                    return Err(Error::Internal(format!(
                        "the backend left {} normed floats for {n} rows",
                        h.len()
                    )));
                }
                self.acts.clear();
                for &r in &split.cold_rows {
                    let r = r as usize;
                    self.acts.extend_from_slice(&h[r * hs..(r + 1) * hs]);
                }
                req.activations = std::mem::take(&mut self.acts);
                cold.send(req)?;
            }
        }
        // the hot experts run while the cold tier computes
        self.backend.experts(ml, &self.hot, Some(split))?;
        let t0 = Instant::now();
        let want = split.cold.len() * hs;
        if device.is_some() {
            let (reply, out, len) = cold.recv_device()?;
            self.counters.wait_ns[ml] += t0.elapsed().as_nanos() as u64;
            check_reply(&reply, step, ml, epoch, len, want)?;
            // SAFETY: `out` holds the reply's `len` floats on the backend's device (the link
            // waited for them) and the link's buffer is not reused before the backend next
            // waits for its device (the next exchange starts with `picks`, which does).
            unsafe { self.backend.scatter_device(&split.cold_slots, out, len) }
        } else {
            let mut reply = cold.recv()?;
            self.counters.wait_ns[ml] += t0.elapsed().as_nanos() as u64;
            check_reply(&reply, step, ml, epoch, reply.outputs.len(), want)?;
            let r = self.backend.scatter(&split.cold_slots, &reply.outputs);
            // the reply's buffer carries the next request's activations
            self.acts = std::mem::take(&mut reply.outputs);
            r
        }
    }

    /// Stages loaded experts into the hot bank (the map does not reference them yet).
    pub fn stage(
        &mut self,
        loaded: Vec<(
            usize,
            usize,
            std::sync::Arc<crate::checkpoint::ExpertWeights>,
        )>,
    ) {
        crate::swap::stage(&mut self.hot, loaded);
        // upload while the swap is being prepared; a failure here surfaces at commit, which
        // refuses a map whose hot experts are not on the device
        let _ = self.backend.sync_hot(&self.hot);
    }

    /// Switches to `map` (call between steps). Refused, changing nothing, if a hot expert of
    /// the new map is not resident.
    pub fn commit(&mut self, map: ValidMap) -> Result<()> {
        self.backend.swappable()?;
        crate::swap::check_resident(&self.hot, &map, Tier::Hot)?;
        self.backend.sync_hot(&self.hot)?;
        self.backend.set_map(&map)?;
        self.map = map;
        Ok(())
    }

    /// Frees hot slots the current map does not use (after RELEASE, or ABORT).
    pub fn release_unused(&mut self) -> usize {
        let n = crate::swap::release(&mut self.hot, &self.map, Tier::Hot);
        let _ = self.backend.sync_hot(&self.hot);
        n
    }

    /// Greedy continuation of `prompt` for `max_new` tokens (a test and benchmark helper).
    pub fn greedy(&mut self, prompt: &[u32], max_new: usize) -> Result<Vec<u32>> {
        let mut seq = self.kv.new_seq();
        let mut out = Vec::with_capacity(max_new);
        let mut logits = self.step(&mut [SeqStep {
            kv: &mut seq,
            tokens: prompt,
        }])?;
        for _ in 0..max_new {
            let t = crate::sampling::argmax(&logits) as u32;
            out.push(t);
            if out.len() == max_new {
                break;
            }
            logits = self.step(&mut [SeqStep {
                kv: &mut seq,
                tokens: &[t],
            }])?;
        }
        Ok(out)
    }
}

/// A reply must answer the request sent (step, layer, epoch) with `want` floats.
fn check_reply(
    reply: &ColdReply,
    step: u64,
    ml: usize,
    epoch: u64,
    got: usize,
    want: usize,
) -> Result<()> {
    if reply.step != step || reply.layer != ml as u32 || reply.epoch != epoch {
        return Err(Error::ColdReply(format!(
            "reply for step {} layer {} epoch {}, expected step {step} layer {ml} epoch {epoch}",
            reply.step, reply.layer, reply.epoch
        )));
    }
    if got != want {
        return Err(Error::ColdReply(format!(
            "reply has {got} floats, the picks need {want}"
        )));
    }
    Ok(())
}
