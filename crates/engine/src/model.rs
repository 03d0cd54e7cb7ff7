//! The model code: one step over a batch of sequences, layer by layer, as DESIGN.md's
//! decode step: attention on the primary's dense backend, the router's top-k, picks split
//! by the rowmap into hot (this process's bank) and cold (sent over a [`RemoteTier`]),
//! hot computed while the cold reply is in flight, then every token's k outputs combined
//! in router-rank order, so the layer's output does not depend on the map.
//!
//! The dense math sits behind [`DenseBackend`] (candle's backend seam): the CPU one is
//! here; a CUDA one implements the same trait without touching this code.

use std::time::Instant;

use rayon::prelude::*;

use crate::bank::{ExpertBank, Pick};
use crate::checkpoint::{Checkpoint, ExpertWeights};
use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::kv::{KvCache, SeqKv};
use crate::ops::{self, matmul, rmsnorm, Matrix, Rope};
use crate::rowmap::{Tier, ValidMap};
use crate::sampling::TokenPick;
use crate::tier::{ColdRequest, RemoteTier};

/// Attention and norms of one decoder layer.
#[derive(Clone)]
pub struct LayerWeights {
    pub input_norm: Vec<f32>,
    pub post_norm: Vec<f32>,
    /// q, k, v stacked: `[q_dim + 2 kv_dim, hidden]`
    pub qkv: Matrix,
    pub o: Matrix,
    pub q_norm: Vec<f32>,
    pub k_norm: Vec<f32>,
    /// `Some(router [E, H])` on MoE layers, else the dense MLP.
    pub router: Option<Matrix>,
    pub dense_mlp: Option<ExpertWeights>,
}

/// Everything but the experts.
#[derive(Clone)]
pub struct DenseWeights {
    pub embed: Matrix,
    pub layers: Vec<LayerWeights>,
    pub norm: Vec<f32>,
    /// `None` when tied to the embedding.
    pub lm_head: Option<Matrix>,
}

/// Where dense weights are read from: a checkpoint on disk, or tensors built in memory (the
/// `station` preset, whose weights never touch a file).
pub trait TensorSource {
    fn config(&self) -> &ModelConfig;
    /// A tensor as f32, checking its shape.
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>>;
    fn has(&self, name: &str) -> bool;
    fn matrix(&self, name: &str, rows: usize, cols: usize) -> Result<Matrix> {
        Ok(Matrix::new(rows, cols, self.tensor(name, &[rows, cols])?))
    }
}

impl TensorSource for Checkpoint {
    fn config(&self) -> &ModelConfig {
        &self.config
    }
    fn tensor(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        Checkpoint::tensor(self, name, shape)
    }
    fn has(&self, name: &str) -> bool {
        Checkpoint::has(self, name)
    }
}

impl DenseWeights {
    pub fn load(ckpt: &impl TensorSource) -> Result<Self> {
        let c = ckpt.config();
        let h = c.hidden_size;
        let embed = ckpt.matrix("model.embed_tokens.weight", c.vocab_size, h)?;
        let mut layers = Vec::with_capacity(c.num_hidden_layers);
        for l in 0..c.num_hidden_layers {
            let p = format!("model.layers.{l}");
            let q = ckpt.tensor(&format!("{p}.self_attn.q_proj.weight"), &[c.q_dim(), h])?;
            let k = ckpt.tensor(&format!("{p}.self_attn.k_proj.weight"), &[c.kv_dim(), h])?;
            let v = ckpt.tensor(&format!("{p}.self_attn.v_proj.weight"), &[c.kv_dim(), h])?;
            let mut qkv = q;
            qkv.extend_from_slice(&k);
            qkv.extend_from_slice(&v);
            let (router, dense_mlp) = if c.is_moe_layer(l) {
                (
                    Some(ckpt.matrix(&format!("{p}.mlp.gate.weight"), c.num_experts, h)?),
                    None,
                )
            } else {
                let i = c.intermediate_size;
                let mut gu = ckpt.tensor(&format!("{p}.mlp.gate_proj.weight"), &[i, h])?;
                gu.extend(ckpt.tensor(&format!("{p}.mlp.up_proj.weight"), &[i, h])?);
                let down = ckpt.matrix(&format!("{p}.mlp.down_proj.weight"), h, i)?;
                (
                    None,
                    Some(ExpertWeights {
                        gate_up: Matrix::new(2 * i, h, gu),
                        down,
                        checksum: 0,
                    }),
                )
            };
            layers.push(LayerWeights {
                input_norm: ckpt.tensor(&format!("{p}.input_layernorm.weight"), &[h])?,
                post_norm: ckpt.tensor(&format!("{p}.post_attention_layernorm.weight"), &[h])?,
                qkv: Matrix::new(c.q_dim() + 2 * c.kv_dim(), h, qkv),
                o: ckpt.matrix(&format!("{p}.self_attn.o_proj.weight"), h, c.q_dim())?,
                q_norm: ckpt.tensor(&format!("{p}.self_attn.q_norm.weight"), &[c.head_dim])?,
                k_norm: ckpt.tensor(&format!("{p}.self_attn.k_norm.weight"), &[c.head_dim])?,
                router,
                dense_mlp,
            });
        }
        let norm = ckpt.tensor("model.norm.weight", &[h])?;
        let lm_head = if ckpt.has("lm_head.weight") || !c.tie_word_embeddings {
            Some(ckpt.matrix("lm_head.weight", c.vocab_size, h)?)
        } else {
            None
        };
        Ok(DenseWeights {
            embed,
            layers,
            norm,
            lm_head,
        })
    }

    /// Bytes of dense weights one decode token reads (all but the embedding table: one row).
    pub fn bytes_per_token(&self) -> usize {
        let mut b = self.embed.cols * 4 + self.norm.len() * 4;
        for l in &self.layers {
            b += l.qkv.bytes() + l.o.bytes() + (l.input_norm.len() + l.post_norm.len()) * 4;
            b += l.router.as_ref().map_or(0, |r| r.bytes());
            b += l.dense_mlp.as_ref().map_or(0, |m| m.bytes());
        }
        b + self.lm_head.as_ref().unwrap_or(&self.embed).bytes()
    }
}

/// Where a batch row sits: which sequence and which position.
#[derive(Clone, Copy, Debug)]
pub struct RowPos {
    pub seq: usize,
    pub pos: usize,
}

/// The dense math of the primary. `x` is `[rows, hidden]`, on the host between calls.
pub trait DenseBackend: Send {
    fn config(&self) -> &ModelConfig;
    /// x = embedding rows of `tokens`.
    fn embed(&self, tokens: &[u32], x: &mut [f32]) -> Result<()>;
    /// x += attention(input_norm(x)) of decoder layer `layer`, writing K/V of every row.
    fn attention(
        &mut self,
        layer: usize,
        rows: &[RowPos],
        seqs: &[&SeqKv],
        kv: &mut KvCache,
        x: &mut [f32],
    ) -> Result<()>;
    /// h = post_norm(x); router probabilities `[rows, E]` (softmax of the gate logits).
    fn route(&mut self, layer: usize, x: &[f32], h: &mut [f32], probs: &mut [f32]) -> Result<()>;
    /// x += dense MLP(post_norm(x)) for non-MoE layers.
    fn dense_mlp(&mut self, layer: usize, x: &mut [f32]) -> Result<()>;
    /// logits `[rows.len(), vocab]` of final_norm(x[row]) for the given rows.
    fn logits(&mut self, x: &[f32], rows: &[usize], out: &mut [f32]) -> Result<()>;
    /// Bytes of weights one decode token reads from this backend.
    fn bytes_per_token(&self) -> usize;
}

/// The CPU dense backend.
pub struct CpuDense {
    cfg: ModelConfig,
    w: DenseWeights,
    rope: Rope,
    h: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
}

impl CpuDense {
    pub fn new(cfg: ModelConfig, w: DenseWeights) -> Self {
        let rope = Rope::new(
            cfg.head_dim,
            cfg.rope_theta,
            cfg.max_position_embeddings.min(1 << 16),
        );
        CpuDense {
            cfg,
            w,
            rope,
            h: Vec::new(),
            qkv: Vec::new(),
            att: Vec::new(),
            tmp: Vec::new(),
        }
    }
}

impl DenseBackend for CpuDense {
    fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    fn embed(&self, tokens: &[u32], x: &mut [f32]) -> Result<()> {
        let h = self.cfg.hidden_size;
        for (i, &t) in tokens.iter().enumerate() {
            if t as usize >= self.cfg.vocab_size {
                return Err(Error::BadToken {
                    id: t,
                    vocab: self.cfg.vocab_size,
                });
            }
            x[i * h..(i + 1) * h].copy_from_slice(self.w.embed.row(t as usize));
        }
        Ok(())
    }

    fn attention(
        &mut self,
        layer: usize,
        rows: &[RowPos],
        seqs: &[&SeqKv],
        kv: &mut KvCache,
        x: &mut [f32],
    ) -> Result<()> {
        let c = &self.cfg;
        let (hd, nh, nkv, hs) = (
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.hidden_size,
        );
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let n = rows.len();
        let lw = &self.w.layers[layer];
        self.h.resize(n * hs, 0.0);
        self.qkv.resize(n * (qd + 2 * kvd), 0.0);
        self.att.resize(n * qd, 0.0);
        self.tmp.resize(n * hs, 0.0);
        rmsnorm(&x[..n * hs], &lw.input_norm, c.rms_norm_eps, &mut self.h);
        matmul(&self.h, n, &lw.qkv, &mut self.qkv);
        let stride = qd + 2 * kvd;
        // q/k norm, RoPE, and K/V into the cache
        for (i, rp) in rows.iter().enumerate() {
            if rp.pos >= self.rope.max_pos {
                return Err(Error::ContextOverflow {
                    len: rp.pos + 1,
                    max: self.rope.max_pos,
                });
            }
            let row = &mut self.qkv[i * stride..(i + 1) * stride];
            let (q, rest) = row.split_at_mut(qd);
            let (k, v) = rest.split_at_mut(kvd);
            ops::rmsnorm_inplace(q, &lw.q_norm, c.rms_norm_eps);
            ops::rmsnorm_inplace(k, &lw.k_norm, c.rms_norm_eps);
            for hh in 0..nh {
                self.rope.apply(&mut q[hh * hd..(hh + 1) * hd], rp.pos);
            }
            for hh in 0..nkv {
                self.rope.apply(&mut k[hh * hd..(hh + 1) * hd], rp.pos);
            }
            let off = seqs[rp.seq].offset(rp.pos, kvd);
            kv.k[layer][off..off + kvd].copy_from_slice(k);
            kv.v[layer][off..off + kvd].copy_from_slice(v);
        }
        // attention per (row, head), in parallel; each output written once
        let scale = 1.0 / (hd as f32).sqrt();
        let group = nh / nkv;
        let (kc, vc) = (&kv.k[layer], &kv.v[layer]);
        let qkv = &self.qkv;
        self.att
            .par_chunks_mut(qd)
            .enumerate()
            .for_each(|(i, out)| {
                let rp = rows[i];
                let seq = seqs[rp.seq];
                let mut scores = vec![0f32; rp.pos + 1];
                for hh in 0..nh {
                    let g = hh / group;
                    let q = &qkv[i * stride + hh * hd..i * stride + (hh + 1) * hd];
                    for (j, s) in scores.iter_mut().enumerate() {
                        let off = seq.offset(j, kvd) + g * hd;
                        *s = ops::dot(q, &kc[off..off + hd]) * scale;
                    }
                    ops::softmax(&mut scores);
                    let o = &mut out[hh * hd..(hh + 1) * hd];
                    o.fill(0.0);
                    for (j, &p) in scores.iter().enumerate() {
                        let off = seq.offset(j, kvd) + g * hd;
                        for (od, &vd) in o.iter_mut().zip(&vc[off..off + hd]) {
                            *od += p * vd;
                        }
                    }
                }
            });
        matmul(&self.att, n, &lw.o, &mut self.tmp);
        for (xv, t) in x[..n * hs].iter_mut().zip(&self.tmp) {
            *xv += t;
        }
        Ok(())
    }

    fn route(&mut self, layer: usize, x: &[f32], h: &mut [f32], probs: &mut [f32]) -> Result<()> {
        let c = &self.cfg;
        let n = x.len() / c.hidden_size;
        let lw = &self.w.layers[layer];
        let router = lw
            .router
            .as_ref()
            .ok_or_else(|| Error::Tier(format!("layer {layer} is not a MoE layer")))?;
        rmsnorm(x, &lw.post_norm, c.rms_norm_eps, h);
        matmul(h, n, router, probs);
        for p in probs[..n * c.num_experts].chunks_exact_mut(c.num_experts) {
            ops::softmax(p);
        }
        Ok(())
    }

    fn dense_mlp(&mut self, layer: usize, x: &mut [f32]) -> Result<()> {
        let c = &self.cfg;
        let hs = c.hidden_size;
        let n = x.len() / hs;
        let lw = &self.w.layers[layer];
        let mlp = lw
            .dense_mlp
            .as_ref()
            .ok_or_else(|| Error::Tier(format!("layer {layer} has no dense MLP")))?;
        self.h.resize(n * hs, 0.0);
        self.tmp.resize(n * hs, 0.0);
        rmsnorm(x, &lw.post_norm, c.rms_norm_eps, &mut self.h);
        let (mut gu, mut act) = (Vec::new(), Vec::new());
        crate::bank::expert_forward(mlp, &self.h, n, &mut gu, &mut act, &mut self.tmp);
        for (xv, t) in x.iter_mut().zip(&self.tmp) {
            *xv += t;
        }
        Ok(())
    }

    fn logits(&mut self, x: &[f32], rows: &[usize], out: &mut [f32]) -> Result<()> {
        let hs = self.cfg.hidden_size;
        self.h.resize(rows.len() * hs, 0.0);
        for (i, &r) in rows.iter().enumerate() {
            rmsnorm(
                &x[r * hs..(r + 1) * hs],
                &self.w.norm,
                self.cfg.rms_norm_eps,
                &mut self.h[i * hs..(i + 1) * hs],
            );
        }
        let head = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
        matmul(&self.h, rows.len(), head, out);
        Ok(())
    }

    fn bytes_per_token(&self) -> usize {
        self.w.bytes_per_token()
    }
}

/// Sends MoE layer `ml`'s cold picks with the activation rows they name (`rows` of `h`).
#[allow(clippy::too_many_arguments)]
fn send_cold(
    cold: &mut Option<Box<dyn RemoteTier>>,
    step: u64,
    ml: usize,
    epoch: u64,
    picks: Vec<Pick>,
    rows: &[u32],
    h: &[f32],
    hs: usize,
) -> Result<()> {
    let cold = cold.as_mut().ok_or_else(|| {
        Error::Tier(format!(
            "layer {ml}: {} cold picks but no cold tier is attached",
            picks.len()
        ))
    })?;
    let mut acts = Vec::with_capacity(rows.len() * hs);
    for &r in rows {
        acts.extend_from_slice(&h[r as usize * hs..(r as usize + 1) * hs]);
    }
    cold.send(ColdRequest {
        step,
        layer: ml as u32,
        epoch,
        picks,
        activations: acts,
    })
}

/// Waits for the cold tier's reply to step `step`, layer `ml` (time added to `wait_ns`),
/// and checks it answers that request with one output row per pick.
fn recv_cold(
    cold: &mut Option<Box<dyn RemoteTier>>,
    wait_ns: &mut u64,
    step: u64,
    ml: usize,
    epoch: u64,
    picks: usize,
    hs: usize,
) -> Result<crate::tier::ColdReply> {
    let t0 = Instant::now();
    let cold = cold
        .as_mut()
        .ok_or_else(|| Error::Tier("cold tier vanished".into()))?;
    let reply = cold.recv()?;
    *wait_ns += t0.elapsed().as_nanos() as u64;
    check_reply(&reply, step, ml, epoch, reply.outputs.len(), picks * hs)?;
    Ok(reply)
}

/// A reply must answer the request sent (step, layer, epoch) with `want` floats.
fn check_reply(
    reply: &crate::tier::ColdReply,
    step: u64,
    ml: usize,
    epoch: u64,
    got: usize,
    want: usize,
) -> Result<()> {
    if reply.step != step || reply.layer != ml as u32 || reply.epoch != epoch {
        return Err(Error::Tier(format!(
            "cold reply for step {} layer {} epoch {}, expected step {step} layer {ml} epoch {epoch}",
            reply.step, reply.layer, reply.epoch
        )));
    }
    if got != want {
        return Err(Error::Tier(format!(
            "cold reply has {got} floats, the picks need {want}"
        )));
    }
    Ok(())
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
            steps: 0,
            tokens: 0,
            expert_loads: 0,
            step_ns: 0,
            max_step_ns: 0,
            hot_expert_loads: 0,
        }
    }
}

/// One sequence's part of a step: append `tokens` at `kv.len`.
pub struct SeqStep<'a> {
    pub kv: &'a mut SeqKv,
    pub tokens: &'a [u32],
}

/// The primary's engine: dense backend, hot bank, link to the cold tier, map, KV cache.
pub struct Engine {
    pub cfg: ModelConfig,
    pub dense: Box<dyn DenseBackend>,
    pub hot: ExpertBank,
    pub cold: Option<Box<dyn RemoteTier>>,
    pub map: ValidMap,
    pub kv: KvCache,
    pub counters: Counters,
    moe_of_layer: Vec<Option<usize>>,
    step_no: u64,
    x: Vec<f32>,
    h: Vec<f32>,
    probs: Vec<f32>,
    hot_out: Vec<f32>,
    combined: Vec<f32>,
    /// per-step scratch of the MoE layer (reused; the hot path allocates only the cold message)
    scratch: MoeScratch,
    /// When set, the hidden state `[rows, H]` after every decoder layer of each step is
    /// appended here (the GPU/CPU parity tests read it).
    pub trace: Option<Vec<Vec<f32>>>,
    /// The GPU running this engine's steps (`attach_gpu`); the CPU backend is then unused.
    #[cfg(feature = "cuda")]
    pub gpu: Option<Box<crate::cuda_model::GpuModel>>,
    #[cfg(feature = "cuda")]
    gpu_scratch: GpuScratch,
}

#[cfg(feature = "cuda")]
#[derive(Default)]
struct GpuScratch {
    idx: Vec<i32>,
    h: Vec<f32>,
    picks: Vec<i32>,
    slots: Vec<i32>,
    ids: Vec<u32>,
    x: Vec<f32>,
}

/// What a step returns: every asked row's logits, or only their argmax ids (computed where
/// the logits are, so a GPU step downloads a few ints instead of rows of the vocabulary).
pub enum StepOut {
    Logits(Vec<f32>),
    Ids(Vec<u32>),
}

#[derive(Default)]
struct MoeScratch {
    top: Vec<(usize, f32)>,
    experts: Vec<u16>,
    weights: Vec<f32>,
    seen: Vec<bool>,
    acc: Vec<f32>,
    hot_picks: Vec<Pick>,
    hot_idx: Vec<usize>,
    cold_idx: Vec<usize>,
    cold_rows: Vec<u32>,
    cold_row_of: Vec<u32>,
}

impl Engine {
    pub fn new(
        cfg: ModelConfig,
        dense: Box<dyn DenseBackend>,
        hot: ExpertBank,
        cold: Option<Box<dyn RemoteTier>>,
        map: ValidMap,
        kv_blocks: usize,
    ) -> Self {
        let moe = cfg.moe_layers();
        let mut moe_of_layer = vec![None; cfg.num_hidden_layers];
        for (i, &l) in moe.iter().enumerate() {
            moe_of_layer[l] = Some(i);
        }
        let kv = KvCache::new(cfg.num_hidden_layers, cfg.kv_dim(), kv_blocks);
        let counters = Counters::new(moe.len(), cfg.num_experts);
        Engine {
            cfg,
            dense,
            hot,
            cold,
            map,
            kv,
            counters,
            moe_of_layer,
            step_no: 0,
            x: Vec::new(),
            h: Vec::new(),
            probs: Vec::new(),
            hot_out: Vec::new(),
            combined: Vec::new(),
            scratch: MoeScratch::default(),
            trace: None,
            #[cfg(feature = "cuda")]
            gpu: None,
            #[cfg(feature = "cuda")]
            gpu_scratch: GpuScratch::default(),
        }
    }

    /// Moves this engine's steps onto `g`: its hot experts (from the bank, unless `g`
    /// generated its own), its map, and a KV cache on the GPU (this engine's must be unused:
    /// call before the first step). The CPU KV arrays are dropped.
    #[cfg(feature = "cuda")]
    pub fn attach_gpu(&mut self, mut g: crate::cuda_model::GpuModel) -> Result<()> {
        if self.kv.used_blocks() != 0 {
            return Err(Error::Tier(
                "attach_gpu: the engine has live sequences".into(),
            ));
        }
        g.sync_hot(&self.hot)?;
        g.set_map(&self.map)?;
        self.kv = KvCache::accounting(self.cfg.num_hidden_layers, self.cfg.kv_dim(), g.kv_blocks());
        self.gpu = Some(Box::new(g));
        Ok(())
    }

    /// Runs one step; returns logits `[seqs.len(), vocab]` of each sequence's last new token.
    pub fn step(&mut self, seqs: &mut [SeqStep<'_>]) -> Result<Vec<f32>> {
        self.step_with(seqs, false)
    }

    /// As [`Engine::step`]; with `all_rows`, logits of every new token (`[rows, vocab]`).
    pub fn step_with(&mut self, seqs: &mut [SeqStep<'_>], all_rows: bool) -> Result<Vec<f32>> {
        match self.step_timed(seqs, all_rows, None)? {
            StepOut::Logits(l) => Ok(l),
            StepOut::Ids(_) => Err(Error::Tier("step returned ids, not logits".into())),
        }
    }

    /// As [`Engine::step`], returning only each sequence's greedy next token.
    pub fn step_argmax(&mut self, seqs: &mut [SeqStep<'_>]) -> Result<Vec<u32>> {
        let picks = vec![TokenPick::Greedy; seqs.iter().filter(|s| !s.tokens.is_empty()).count()];
        self.step_pick(seqs, &picks)
    }

    /// As [`Engine::step`], returning each sequence's next token as `picks` says (one per
    /// sequence with new tokens): on the GPU the logits never leave it.
    pub fn step_pick(&mut self, seqs: &mut [SeqStep<'_>], picks: &[TokenPick]) -> Result<Vec<u32>> {
        match self.step_timed(seqs, false, Some(picks))? {
            StepOut::Ids(ids) => Ok(ids),
            StepOut::Logits(l) => Err(Error::Tier(format!(
                "step returned {} logits, not ids",
                l.len()
            ))),
        }
    }

    fn step_timed(
        &mut self,
        seqs: &mut [SeqStep<'_>],
        all_rows: bool,
        picks: Option<&[TokenPick]>,
    ) -> Result<StepOut> {
        let t0 = Instant::now();
        let r = self.step_inner(seqs, all_rows, picks);
        let ns = t0.elapsed().as_nanos() as u64;
        self.counters.step_ns += ns;
        self.counters.max_step_ns = self.counters.max_step_ns.max(ns);
        r
    }

    fn step_inner(
        &mut self,
        seqs: &mut [SeqStep<'_>],
        all_rows: bool,
        picks: Option<&[TokenPick]>,
    ) -> Result<StepOut> {
        let c = self.cfg.clone();
        let hs = c.hidden_size;
        let max_ctx = c.max_position_embeddings;
        // reserve KV first: all or nothing
        for s in seqs.iter_mut() {
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
        let mut rows = Vec::new();
        let mut tokens = Vec::new();
        let mut last_rows = Vec::new();
        for (si, s) in seqs.iter().enumerate() {
            for (j, &t) in s.tokens.iter().enumerate() {
                rows.push(RowPos {
                    seq: si,
                    pos: s.kv.len + j,
                });
                tokens.push(t);
            }
            if !s.tokens.is_empty() {
                last_rows.push(rows.len() - 1);
            }
        }
        let n = rows.len();
        if all_rows {
            last_rows = (0..n).collect();
        }
        if let Some(p) = picks {
            if p.len() != last_rows.len() {
                return Err(Error::Tier(format!(
                    "{} token picks for {} sequences with new tokens",
                    p.len(),
                    last_rows.len()
                )));
            }
        }
        #[cfg(feature = "cuda")]
        if self.gpu.is_some() {
            return self.step_gpu(seqs, &rows, &tokens, &last_rows, picks);
        }
        self.x.resize(n * hs, 0.0);
        self.dense.embed(&tokens, &mut self.x)?;
        let seq_refs: Vec<&SeqKv> = seqs.iter().map(|s| &*s.kv).collect();
        for l in 0..c.num_hidden_layers {
            self.dense
                .attention(l, &rows, &seq_refs, &mut self.kv, &mut self.x[..n * hs])?;
            match self.moe_of_layer[l] {
                Some(ml) => self.moe_layer(l, ml, n)?,
                None => self.dense.dense_mlp(l, &mut self.x[..n * hs])?,
            }
            if let Some(t) = self.trace.as_mut() {
                t.push(self.x[..n * hs].to_vec());
            }
        }
        drop(seq_refs);
        for s in seqs.iter_mut() {
            s.kv.len += s.tokens.len();
        }
        let mut logits = vec![0f32; last_rows.len() * c.vocab_size];
        self.dense.logits(&self.x, &last_rows, &mut logits)?;
        self.step_no += 1;
        self.counters.steps += 1;
        self.counters.tokens += n as u64;
        if let Some(picks) = picks {
            let v = c.vocab_size;
            let mut scratch = Vec::new();
            return Ok(StepOut::Ids(
                logits
                    .chunks_exact(v)
                    .zip(picks)
                    .map(|(row, &p)| crate::sampling::pick_token(row, p, &mut scratch))
                    .collect(),
            ));
        }
        Ok(StepOut::Logits(logits))
    }

    /// The step on the GPU: as `step_inner`, with the hidden state on the device.
    #[cfg(feature = "cuda")]
    fn step_gpu(
        &mut self,
        seqs: &mut [SeqStep<'_>],
        rows: &[RowPos],
        tokens: &[u32],
        last_rows: &[usize],
        picks: Option<&[TokenPick]>,
    ) -> Result<StepOut> {
        let c = self.cfg.clone();
        let (n, hs, k, ne) = (
            rows.len(),
            c.hidden_size,
            c.num_experts_per_tok,
            c.num_experts,
        );
        let mut gs = std::mem::take(&mut self.gpu_scratch);
        let Some(g) = self.gpu.as_mut() else {
            return Err(Error::Gpu("no GPU attached".into()));
        };
        {
            let seq_refs: Vec<&SeqKv> = seqs.iter().map(|s| &*s.kv).collect();
            g.begin(tokens, rows, &seq_refs, last_rows)?;
        }
        use crate::cuda_model::Op;
        // device work is gathered into runs, cut only where the host must look: a layer whose
        // map has cold experts (its picks go to the cold tier) and, when tracing, each layer
        let mut ops = vec![Op::Embed];
        for l in 0..c.num_hidden_layers {
            ops.push(Op::Attention(l));
            match self.moe_of_layer[l] {
                Some(ml) => {
                    ops.push(Op::Route(l, ml));
                    let has_cold = !self.map.map.layers[ml].cold.is_empty();
                    if !has_cold {
                        ops.push(Op::Moe(ml));
                    } else {
                        let g = self
                            .gpu
                            .as_mut()
                            .ok_or_else(|| Error::Gpu("GPU detached".into()))?;
                        g.run(&ops)?;
                        ops.clear();
                        // a link between GPUs sends the activations from here: only the
                        // picks come to the host
                        let (ord, h_dev, h_len) = g.normed_rows();
                        let on_device =
                            self.cold.as_ref().and_then(|t| t.device_ordinal()) == Some(ord);
                        if on_device {
                            g.fetch_picks(ml, &mut gs.idx)?;
                        } else {
                            g.fetch_route(ml, &mut gs.idx, &mut gs.h)?;
                        }
                        // the cold picks, rows deduplicated, in pick order (as on the CPU)
                        let mut cold_picks = Vec::new();
                        let mut cold_rows: Vec<u32> = Vec::new();
                        let mut row_of = vec![u32::MAX; n];
                        gs.slots.clear();
                        #[allow(clippy::needless_range_loop)]
                        for r in 0..n {
                            for j in 0..k {
                                let e = gs.idx[r * k + j];
                                if e < 0 || e as usize >= ne {
                                    return Err(Error::Gpu(format!("router picked expert {e}")));
                                }
                                if self.map.tier(ml, e as usize) == Tier::Cold {
                                    if row_of[r] == u32::MAX {
                                        row_of[r] = cold_rows.len() as u32;
                                        cold_rows.push(r as u32);
                                    }
                                    cold_picks.push(Pick {
                                        // all n rows travel on the device path
                                        row: if on_device { r as u32 } else { row_of[r] },
                                        expert: e as u16,
                                    });
                                    gs.slots.push((r * k + j) as i32);
                                }
                            }
                        }
                        let sent = !cold_picks.is_empty();
                        let (step, epoch) = (self.step_no, self.map.epoch());
                        if sent && on_device {
                            let cold = self
                                .cold
                                .as_mut()
                                .ok_or_else(|| Error::Tier("cold tier vanished".into()))?;
                            let req = ColdRequest {
                                step,
                                layer: ml as u32,
                                epoch,
                                picks: cold_picks,
                                activations: Vec::new(),
                            };
                            // SAFETY: h holds the step's n normed rows, complete (fetch_picks
                            // waited for the stream) and unchanged until the reply is in:
                            // the next writer is the next layer's router, queued after it.
                            unsafe { cold.send_device(req, h_dev, h_len) }?;
                        } else if sent {
                            send_cold(
                                &mut self.cold,
                                step,
                                ml,
                                epoch,
                                cold_picks,
                                &cold_rows,
                                &gs.h,
                                hs,
                            )?;
                        }
                        let g = self
                            .gpu
                            .as_mut()
                            .ok_or_else(|| Error::Gpu("GPU detached".into()))?;
                        // the hot experts run while the cold tier computes
                        g.run(&[Op::Moe(ml)])?;
                        if sent && on_device {
                            let t0 = Instant::now();
                            let cold = self
                                .cold
                                .as_mut()
                                .ok_or_else(|| Error::Tier("cold tier vanished".into()))?;
                            let (reply, out, len) = cold.recv_device()?;
                            self.counters.wait_ns[ml] += t0.elapsed().as_nanos() as u64;
                            check_reply(&reply, step, ml, epoch, len, gs.slots.len() * hs)?;
                            // SAFETY: `out` holds the reply's `len` floats on this GPU (the
                            // link waited for them); the link's buffer is not reused before
                            // this model's stream is next synchronised (the next exchange
                            // starts with fetch_picks, which waits for it).
                            unsafe { g.scatter_from(&gs.slots, out, len) }?;
                        } else if sent {
                            let wait = &mut self.counters.wait_ns[ml];
                            let picks = gs.slots.len();
                            let reply =
                                recv_cold(&mut self.cold, wait, step, ml, epoch, picks, hs)?;
                            g.scatter(&gs.slots, &reply.outputs)?;
                        }
                    }
                    ops.push(Op::Combine);
                }
                None => ops.push(Op::DenseMlp(l)),
            }
            if self.trace.is_some() {
                let g = self
                    .gpu
                    .as_mut()
                    .ok_or_else(|| Error::Gpu("GPU detached".into()))?;
                g.run(&ops)?;
                ops.clear();
                g.read_x(&mut gs.x)?;
                if let Some(t) = self.trace.as_mut() {
                    t.push(gs.x.clone());
                }
            }
        }
        for s in seqs.iter_mut() {
            s.kv.len += s.tokens.len();
        }
        let g = self
            .gpu
            .as_mut()
            .ok_or_else(|| Error::Gpu("GPU detached".into()))?;
        use crate::cuda_model::HeadOut;
        let head = match picks {
            None => HeadOut::Logits,
            Some(p) if p.iter().all(|p| *p == TokenPick::Greedy) => HeadOut::Argmax,
            Some(p) => {
                g.set_picks(p)?;
                HeadOut::Sample
            }
        };
        ops.push(Op::Head(head));
        g.run(&ops)?;
        let out = if head != HeadOut::Logits {
            g.download(None, Some(&mut gs.ids), &mut gs.picks)?;
            StepOut::Ids(gs.ids.clone())
        } else {
            let mut logits = vec![0f32; last_rows.len() * c.vocab_size];
            g.download(Some(&mut logits), None, &mut gs.picks)?;
            StepOut::Logits(logits)
        };
        // counters from the step's picks
        let moe = self.counters.hot_picks.len();
        let mut seen = std::mem::take(&mut self.scratch.seen);
        for ml in 0..moe {
            let layer = &gs.picks[ml * n * k..(ml + 1) * n * k];
            seen.clear();
            seen.resize(ne, false);
            for &e in layer {
                let e = e.clamp(0, ne as i32 - 1) as usize;
                self.counters.picks[ml][e] += 1;
                match self.map.tier(ml, e) {
                    Tier::Hot => self.counters.hot_picks[ml] += 1,
                    Tier::Cold => self.counters.cold_picks[ml] += 1,
                }
                if !seen[e] {
                    seen[e] = true;
                    self.counters.expert_loads += 1;
                    if self.map.tier(ml, e) == Tier::Hot {
                        self.counters.hot_expert_loads += 1;
                    }
                }
            }
        }
        self.scratch.seen = seen;
        self.gpu_scratch = gs;
        self.step_no += 1;
        self.counters.steps += 1;
        self.counters.tokens += n as u64;
        Ok(out)
    }

    fn moe_layer(&mut self, layer: usize, ml: usize, n: usize) -> Result<()> {
        let (hs, ne, k) = (
            self.cfg.hidden_size,
            self.cfg.num_experts,
            self.cfg.num_experts_per_tok,
        );
        self.h.resize(n * hs, 0.0);
        self.probs.resize(n * ne, 0.0);
        self.dense
            .route(layer, &self.x[..n * hs], &mut self.h, &mut self.probs)?;
        // top-k per row, in rank order
        let mut sc = std::mem::take(&mut self.scratch);
        sc.experts.clear();
        sc.experts.resize(n * k, 0);
        sc.weights.clear();
        sc.weights.resize(n * k, 0.0);
        for r in 0..n {
            ops::topk(&self.probs[r * ne..(r + 1) * ne], k, &mut sc.top);
            let mut sum = 0f32;
            for (j, &(e, p)) in sc.top.iter().enumerate() {
                sc.experts[r * k + j] = e as u16;
                sc.weights[r * k + j] = p;
                sum += p;
            }
            if self.cfg.norm_topk_prob {
                for w in &mut sc.weights[r * k..(r + 1) * k] {
                    *w /= sum;
                }
            }
        }
        // split by the map
        let experts = &sc.experts;
        sc.hot_picks.clear();
        sc.hot_idx.clear();
        sc.cold_idx.clear();
        sc.cold_rows.clear();
        sc.cold_row_of.clear();
        sc.cold_row_of.resize(n, u32::MAX);
        let mut cold_picks = Vec::new();
        for r in 0..n {
            for j in 0..k {
                let e = experts[r * k + j];
                self.counters.picks[ml][e as usize] += 1;
                match self.map.tier(ml, e as usize) {
                    Tier::Hot => {
                        sc.hot_picks.push(Pick {
                            row: r as u32,
                            expert: e,
                        });
                        sc.hot_idx.push(r * k + j);
                    }
                    Tier::Cold => {
                        if sc.cold_row_of[r] == u32::MAX {
                            sc.cold_row_of[r] = sc.cold_rows.len() as u32;
                            sc.cold_rows.push(r as u32);
                        }
                        cold_picks.push(Pick {
                            row: sc.cold_row_of[r],
                            expert: e,
                        });
                        sc.cold_idx.push(r * k + j);
                    }
                }
            }
        }
        sc.seen.clear();
        sc.seen.resize(ne, false);
        for &e in experts.iter() {
            if !sc.seen[e as usize] {
                sc.seen[e as usize] = true;
                self.counters.expert_loads += 1;
                if self.map.tier(ml, e as usize) == Tier::Hot {
                    self.counters.hot_expert_loads += 1;
                }
            }
        }
        let r = self.moe_exchange(ml, n, cold_picks, &mut sc);
        self.scratch = sc;
        r
    }

    fn moe_exchange(
        &mut self,
        ml: usize,
        n: usize,
        cold_picks: Vec<Pick>,
        sc: &mut MoeScratch,
    ) -> Result<()> {
        let (hs, k) = (self.cfg.hidden_size, self.cfg.num_experts_per_tok);
        let (hot_picks, hot_idx, cold_idx, cold_rows, weights) = (
            &sc.hot_picks,
            &sc.hot_idx,
            &sc.cold_idx,
            &sc.cold_rows,
            &sc.weights,
        );
        self.counters.hot_picks[ml] += hot_picks.len() as u64;
        self.counters.cold_picks[ml] += cold_picks.len() as u64;
        let sent = !cold_picks.is_empty();
        if sent {
            let (step, epoch) = (self.step_no, self.map.epoch());
            send_cold(
                &mut self.cold,
                step,
                ml,
                epoch,
                cold_picks,
                cold_rows,
                &self.h,
                hs,
            )?;
        }
        self.hot_out.resize(hot_picks.len() * hs, 0.0);
        self.hot
            .compute(ml, hot_picks, &self.h, &mut self.hot_out)?;
        // gather every pick's output row into rank order
        self.combined.resize(n * k * hs, 0.0);
        for (i, &slot) in hot_idx.iter().enumerate() {
            self.combined[slot * hs..(slot + 1) * hs]
                .copy_from_slice(&self.hot_out[i * hs..(i + 1) * hs]);
        }
        if sent {
            let (step, epoch) = (self.step_no, self.map.epoch());
            let wait = &mut self.counters.wait_ns[ml];
            let reply = recv_cold(&mut self.cold, wait, step, ml, epoch, cold_idx.len(), hs)?;
            for (i, &slot) in cold_idx.iter().enumerate() {
                self.combined[slot * hs..(slot + 1) * hs]
                    .copy_from_slice(&reply.outputs[i * hs..(i + 1) * hs]);
            }
        }
        // combine in router-rank order, then the residual
        sc.acc.resize(hs, 0.0);
        for r in 0..n {
            let xr = &mut self.x[r * hs..(r + 1) * hs];
            let acc = &mut sc.acc;
            acc.fill(0.0);
            for j in 0..k {
                let w = weights[r * k + j];
                let y = &self.combined[(r * k + j) * hs..(r * k + j + 1) * hs];
                for (a, &yv) in acc.iter_mut().zip(y) {
                    *a += w * yv;
                }
            }
            for (xv, a) in xr.iter_mut().zip(acc.iter()) {
                *xv += a;
            }
        }
        Ok(())
    }

    /// Stages loaded experts into the hot bank (the map does not reference them yet).
    pub fn stage(&mut self, loaded: Vec<(usize, usize, std::sync::Arc<ExpertWeights>)>) {
        crate::swap::stage(&mut self.hot, loaded);
        // upload while the swap is being prepared; a failure here surfaces at commit, which
        // refuses a map whose hot experts are not on the GPU
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            let _ = g.sync_hot(&self.hot);
        }
    }

    /// Switches to `map` (call between steps). Refused, changing nothing, if a hot expert of
    /// the new map is not resident.
    pub fn commit(&mut self, map: ValidMap) -> Result<()> {
        #[cfg(feature = "cuda")]
        if self.gpu.as_ref().is_some_and(|g| g.generated) {
            return Err(Error::Tier(
                "this engine's experts were generated on the GPU: swaps cannot move them".into(),
            ));
        }
        crate::swap::check_resident(&self.hot, &map, Tier::Hot)?;
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            g.sync_hot(&self.hot)?;
            g.set_map(&map)?;
        }
        self.map = map;
        Ok(())
    }

    /// Frees hot slots the current map does not use (after RELEASE, or ABORT).
    pub fn release_unused(&mut self) -> usize {
        let n = crate::swap::release(&mut self.hot, &self.map, Tier::Hot);
        #[cfg(feature = "cuda")]
        if let Some(g) = self.gpu.as_mut() {
            let _ = g.sync_hot(&self.hot);
        }
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
