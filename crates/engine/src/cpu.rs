//! The CPU step backend: the primary's math on the host (the worker team across rows), the
//! hot experts from the bank, and the combine in router-rank order. Every sum runs in a
//! fixed order, so a step's output does not depend on the map or the thread count.

use std::any::Any;

use crate::bank::{ExpertBank, Pick};
use crate::config::{ModelConfig, Routing};
use crate::error::{Error, Result};
use crate::kv::{KvCache, KvDtype, SeqKv};
use crate::model::DenseWeights;
use crate::ops::{self, matmul, rmsnorm, Bf16, KvElem, Rope};
use crate::sampling::TokenPick;
use crate::step::{HeadOut, RowPos, Split, StepBackend, StepOut};

/// The CPU backend: dense weights, and the step's state between calls.
pub struct CpuBackend {
    cfg: ModelConfig,
    w: DenseWeights,
    rope: Rope,
    rows: Vec<RowPos>,
    tokens: Vec<u32>,
    logit_rows: Vec<usize>,
    /// hidden state `[n, H]`
    x: Vec<f32>,
    /// normed rows `[n, H]` (the router's and the experts' input)
    h: Vec<f32>,
    qkv: Vec<f32>,
    att: Vec<f32>,
    tmp: Vec<f32>,
    probs: Vec<f32>,
    top: Vec<(usize, f32)>,
    /// the current MoE layer's router weights `[n, k]`, rank order
    weights: Vec<f32>,
    /// the step's picks `[moe layers, n, k]`
    picks: Vec<i32>,
    /// the current MoE layer's pick outputs `[n * k, H]`, by slot
    outs: Vec<f32>,
    hot_out: Vec<f32>,
    all_hot: Vec<Pick>,
    all_slots: Vec<u32>,
    acc: Vec<f32>,
    /// `MOELANE_PREDICT_PICKS=1` ([`crate::predict`]): the pre-attention guesses of this
    /// step's picks `[moe layers, n, k]`, the last step's picks and its rows' sequences
    guess: Vec<i32>,
    prev_picks: Vec<i32>,
    prev_seqs: Vec<usize>,
}

impl CpuBackend {
    pub fn new(cfg: ModelConfig, w: DenseWeights) -> Self {
        let rope = Rope::scaled(
            cfg.rotary_dim,
            cfg.rope_theta,
            cfg.max_position_embeddings
                .min(crate::ops::MAX_ROPE_POSITIONS),
            cfg.yarn.as_ref(),
        );
        CpuBackend {
            cfg,
            w,
            rope,
            rows: Vec::new(),
            tokens: Vec::new(),
            logit_rows: Vec::new(),
            x: Vec::new(),
            h: Vec::new(),
            qkv: Vec::new(),
            att: Vec::new(),
            tmp: Vec::new(),
            probs: Vec::new(),
            top: Vec::new(),
            weights: Vec::new(),
            picks: Vec::new(),
            outs: Vec::new(),
            hot_out: Vec::new(),
            all_hot: Vec::new(),
            all_slots: Vec::new(),
            acc: Vec::new(),
            guess: Vec::new(),
            prev_picks: Vec::new(),
            prev_seqs: Vec::new(),
        }
    }

    fn n(&self) -> usize {
        self.rows.len()
    }

    /// The picks of MoE layer `ml` in this step, `[n, k]`.
    fn layer_picks(&self, ml: usize) -> &[i32] {
        let nk = self.n() * self.cfg.num_experts_per_tok;
        &self.picks[ml * nk..(ml + 1) * nk]
    }
}

/// Places `out` rows (one per entry of `slots`) into a layer's pick outputs `outs`.
fn place(outs: &mut [f32], hs: usize, slots: &[u32], out: &[f32]) -> Result<()> {
    let nk = outs.len() / hs.max(1);
    if out.len() != slots.len() * hs {
        return Err(Error::Internal(format!(
            "{} output floats for {} pick slots",
            out.len(),
            slots.len()
        )));
    }
    for (i, &s) in slots.iter().enumerate() {
        let s = s as usize;
        if s >= nk {
            return Err(Error::Internal(format!("pick slot {s} of {nk}")));
        }
        outs[s * hs..(s + 1) * hs].copy_from_slice(&out[i * hs..(i + 1) * hs]);
    }
    Ok(())
}

impl CpuBackend {
    /// Multi-head latent attention (deepseek_v3) of decoder layer `layer`, absorbed: the
    /// cache keeps each position's normed latent and rotated key (`kv_lora + rope` floats);
    /// a head scores the latent with its query's nope part taken through its key rows
    /// (`q_nope . W_uk`), adds the rotary parts' product, and reads its value from the
    /// weighted latent through its value rows. The same sums as the expanded heads of
    /// transformers, in another order.
    fn mla_attention(&mut self, layer: usize, seqs: &[&SeqKv], kv: &mut KvCache) -> Result<()> {
        let c = &self.cfg;
        let m = c
            .mla
            .ok_or_else(|| Error::Internal("MLA attention of a model without MLA".into()))?;
        let lw = &self.w.layers[layer];
        let w = lw
            .mla
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("layer {layer} has no MLA weights")))?;
        let (nh, hs, n) = (c.num_attention_heads, c.hidden_size, self.rows.len());
        let (nope, rope, r, vh) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.kv_lora_rank,
            m.v_head_dim,
        );
        let (qk, cd) = (nope + rope, r + rope);
        if kv.k.len() <= layer || kv.kv_dim != cd {
            return Err(Error::Internal(format!(
                "the KV cache holds {} layers of {} floats, layer {layer} needs {cd}",
                kv.k.len(),
                kv.kv_dim
            )));
        }
        // the latents' norms use transformers' fixed eps
        const LATENT_EPS: f32 = 1e-6;
        rmsnorm(
            &self.x[..n * hs],
            &lw.input_norm,
            c.rms_norm_eps,
            &mut self.h,
        );
        // the step's scratch: q in qkv, q's bottleneck in probs (the router's, free here),
        // the compressed kv in tmp (free again before the o projection)
        self.qkv.resize(n * nh * qk, 0.0);
        let q = &mut self.qkv[..n * nh * qk];
        match &w.q_a {
            Some((qa, qn)) => {
                self.probs.resize(n * qa.rows, 0.0);
                let t = &mut self.probs[..n * qa.rows];
                matmul(&self.h, n, qa, t);
                ops::rmsnorm_inplace(t, qn, LATENT_EPS);
                matmul(t, n, &w.q_b, q);
            }
            None => matmul(&self.h, n, &w.q_b, q),
        }
        self.tmp.resize(n * cd.max(hs), 0.0);
        let ckv = &mut self.tmp[..n * cd];
        matmul(&self.h, n, &w.kv_a, ckv);
        let interleave = c.rope_interleave;
        let rotate = |rope_t: &Rope, v: &mut [f32], pos: usize| {
            if interleave {
                rope_t.apply_interleaved(v, pos)
            } else {
                rope_t.apply(v, pos)
            }
        };
        for (i, rp) in self.rows.iter().enumerate() {
            let row = &mut ckv[i * cd..(i + 1) * cd];
            ops::rmsnorm_inplace(&mut row[..r], &w.kv_a_norm, LATENT_EPS);
            rotate(&self.rope, &mut row[r..], rp.pos);
            let off = seqs[rp.seq].offset(rp.pos, cd);
            kv.k[layer][off..off + cd].copy_from_slice(row);
            for hh in 0..nh {
                let h0 = i * nh * qk + hh * qk;
                rotate(&self.rope, &mut q[h0 + nope..h0 + qk], rp.pos);
            }
        }
        let scale = c.attention_scale;
        let kc = &kv.k[layer];
        let (rows, q) = (&self.rows, &self.qkv[..n * nh * qk]);
        self.att.resize(n * nh * vh, 0.0);
        crate::team::team().for_each_chunk(&mut self.att, nh * vh, &|i, out| {
            let rp = rows[i];
            let seq = seqs[rp.seq];
            let mut scores = vec![0f32; rp.pos + 1];
            let (mut q_lat, mut lat) = (vec![0f32; r], vec![0f32; r]);
            for hh in 0..nh {
                let h0 = i * nh * qk + hh * qk;
                let (q_nope, q_rot) = (&q[h0..h0 + nope], &q[h0 + nope..h0 + qk]);
                matmul(q_nope, 1, &w.uk_t[hh], &mut q_lat);
                for (j, s) in scores.iter_mut().enumerate() {
                    let off = seq.offset(j, cd);
                    let cj = &kc[off..off + cd];
                    *s = (ops::dot(&q_lat, &cj[..r]) + ops::dot(q_rot, &cj[r..])) * scale;
                }
                ops::softmax(&mut scores);
                lat.fill(0.0);
                for (j, &p) in scores.iter().enumerate() {
                    let off = seq.offset(j, cd);
                    for (l, &cv) in lat.iter_mut().zip(&kc[off..off + r]) {
                        *l += p * cv;
                    }
                }
                matmul(&lat, 1, &w.uv[hh], &mut out[hh * vh..(hh + 1) * vh]);
            }
        });
        self.tmp.resize(n * hs, 0.0);
        matmul(&self.att, n, &lw.o, &mut self.tmp);
        for (xv, t) in self.x[..n * hs].iter_mut().zip(&self.tmp) {
            *xv += t;
        }
        Ok(())
    }

    /// [`crate::predict`]'s pre-attention guess of decoder layer `layer`'s picks (a MoE
    /// layer with a softmax router; others are not guessed): the layer's router on the
    /// hidden state before its attention, normed with its post-attention norm.
    fn guess_picks(&mut self, layer: usize) {
        let c = &self.cfg;
        let lw = &self.w.layers[layer];
        let Some(router) = lw.router.as_ref() else {
            return;
        };
        if c.routing != Routing::Softmax {
            return;
        }
        let ml = self.w.layers[..layer]
            .iter()
            .filter(|l| l.router.is_some())
            .count();
        let (n, hs, ne, k) = (
            self.rows.len(),
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
        );
        let mut h = vec![0.0; n * hs];
        rmsnorm(&self.x[..n * hs], &lw.post_norm, c.rms_norm_eps, &mut h);
        let mut logits = vec![0.0; n * ne];
        matmul(&h, n, router, &mut logits);
        for (r, p) in logits.chunks_exact_mut(ne).enumerate() {
            for (v, b) in p.iter_mut().zip(&lw.router_logit_bias) {
                *v += b;
            }
            ops::softmax(p);
            ops::topk(p, k, &mut self.top);
            let at = (ml * n + r) * k;
            for (g, &(e, _)) in self.guess[at..at + k].iter_mut().zip(&self.top) {
                *g = e as i32;
            }
        }
    }
}

impl StepBackend for CpuBackend {
    fn describe(&self) -> String {
        "cpu".into()
    }

    fn begin(
        &mut self,
        tokens: &[u32],
        rows: &[RowPos],
        seqs: &[&SeqKv],
        logit_rows: &[usize],
    ) -> Result<()> {
        let c = &self.cfg;
        if tokens.len() != rows.len() || rows.iter().any(|r| r.seq >= seqs.len()) {
            return Err(Error::Internal(format!(
                "a step of {} tokens over {} rows of {} sequences",
                tokens.len(),
                rows.len(),
                seqs.len()
            )));
        }
        if let Some(&t) = tokens.iter().find(|&&t| t as usize >= c.vocab_size) {
            return Err(Error::BadToken {
                id: t,
                vocab: c.vocab_size,
            });
        }
        if let Some(r) = rows.iter().find(|r| r.pos >= self.rope.max_pos) {
            return Err(Error::ContextOverflow {
                len: r.pos + 1,
                max: self.rope.max_pos,
            });
        }
        if let Some(&r) = logit_rows.iter().find(|&&r| r >= rows.len()) {
            return Err(Error::Internal(format!(
                "logits of row {r} of {}",
                rows.len()
            )));
        }
        let (n, hs, k) = (rows.len(), c.hidden_size, c.num_experts_per_tok);
        if crate::predict::enabled() {
            // the last step's picks and its rows' sequences, for the previous-step guess
            self.prev_picks.clone_from(&self.picks);
            self.prev_seqs.clear();
            self.prev_seqs.extend(self.rows.iter().map(|r| r.seq));
        }
        self.rows.clear();
        self.rows.extend_from_slice(rows);
        self.tokens.clear();
        self.tokens.extend_from_slice(tokens);
        self.logit_rows.clear();
        self.logit_rows.extend_from_slice(logit_rows);
        self.x.resize(n * hs, 0.0);
        self.h.resize(n * hs, 0.0);
        if crate::predict::enabled() {
            self.guess.clear();
            self.guess.resize(c.moe_layers().len() * n * k, -1);
        }
        self.picks.clear();
        self.picks.resize(c.moe_layers().len() * n * k, 0);
        Ok(())
    }

    fn embed(&mut self) -> Result<()> {
        let h = self.cfg.hidden_size;
        for (i, &t) in self.tokens.iter().enumerate() {
            self.w
                .embed
                .row_into(t as usize, &mut self.x[i * h..(i + 1) * h]);
        }
        Ok(())
    }

    fn attention(&mut self, layer: usize, seqs: &[&SeqKv], kv: &mut KvCache) -> Result<()> {
        if crate::predict::enabled() {
            self.guess_picks(layer);
        }
        if self.cfg.mla.is_some() {
            return self.mla_attention(layer, seqs, kv);
        }
        let c = &self.cfg;
        let (hd, nh, nkv, hs) = (
            c.head_dim,
            c.num_attention_heads,
            c.num_key_value_heads,
            c.hidden_size,
        );
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let n = self.rows.len();
        let lw = &self.w.layers[layer];
        if kv.host_layers() <= layer || kv.kv_dim != kvd {
            return Err(Error::Internal(format!(
                "the KV cache holds {} layers of {} floats, layer {layer} needs {kvd}",
                kv.host_layers(),
                kv.kv_dim
            )));
        }
        self.qkv.resize(n * (qd + 2 * kvd), 0.0);
        self.att.resize(n * qd, 0.0);
        self.tmp.resize(n * hs, 0.0);
        rmsnorm(
            &self.x[..n * hs],
            &lw.input_norm,
            c.rms_norm_eps,
            &mut self.h,
        );
        matmul(&self.h, n, &lw.qkv, &mut self.qkv);
        let stride = qd + 2 * kvd;
        if !lw.qkv_bias.is_empty() {
            for row in self.qkv[..n * stride].chunks_exact_mut(stride) {
                for (v, b) in row.iter_mut().zip(&lw.qkv_bias) {
                    *v += b;
                }
            }
        }
        // q/k norm, RoPE, and K/V into the cache
        for (i, rp) in self.rows.iter().enumerate() {
            let row = &mut self.qkv[i * stride..(i + 1) * stride];
            let (q, rest) = row.split_at_mut(qd);
            let (k, v) = rest.split_at_mut(kvd);
            if c.qk_norm {
                ops::rmsnorm_inplace(q, &lw.q_norm, c.rms_norm_eps);
                ops::rmsnorm_inplace(k, &lw.k_norm, c.rms_norm_eps);
            }
            // the first rotary_dim dimensions of each head (all of them but in glm4_moe)
            let rd = c.rotary_dim;
            for hh in 0..nh {
                self.rope.apply(&mut q[hh * hd..hh * hd + rd], rp.pos);
            }
            for hh in 0..nkv {
                self.rope.apply(&mut k[hh * hd..hh * hd + rd], rp.pos);
            }
            let off = seqs[rp.seq].offset(rp.pos, kvd);
            match kv.dtype {
                KvDtype::F32 => {
                    kv.k[layer][off..off + kvd].copy_from_slice(k);
                    kv.v[layer][off..off + kvd].copy_from_slice(v);
                }
                KvDtype::Bf16 => {
                    let put = |dst: &mut [Bf16], src: &[f32]| {
                        for (d, &x) in dst.iter_mut().zip(src) {
                            *d = Bf16::from_f32(x);
                        }
                    };
                    put(&mut kv.k16[layer][off..off + kvd], k);
                    put(&mut kv.v16[layer][off..off + kvd], v);
                }
            }
        }
        // attention per (row, head), in parallel; each output written once. A sliding layer
        // sees the last `window` positions; a sink logit (gpt_oss) joins the softmax.
        let scale = c.attention_scale;
        let group = nh / nkv;
        let window = c.windows[layer];
        let (qkv, rows, sinks) = (&self.qkv, &self.rows, &lw.sinks);
        // Per row (each position's offset found once for all heads), or, with fewer rows
        // than threads, per (row, head) so the heads spread over the team. Either way each
        // head is the same `attend` call, so the split changes no bit.
        let offsets = |i: usize| -> Vec<usize> {
            let rp = rows[i];
            let first = window.map_or(0, |w| (rp.pos + 1).saturating_sub(w));
            (first..=rp.pos)
                .map(|p| seqs[rp.seq].offset(p, kvd))
                .collect()
        };
        let att = &mut self.att[..n * qd];
        // the same heads over the cache's f32 or bf16 rows
        macro_rules! attend_all {
            ($kc:expr, $vc:expr) => {{
                let (kc, vc) = ($kc, $vc);
                let head = |i: usize,
                            hh: usize,
                            offs: &[usize],
                            scores: &mut Vec<f32>,
                            out: &mut [f32]| {
                    scores.resize(offs.len(), 0.0);
                    let a = ops::Attend {
                        q: &qkv[i * stride + hh * hd..i * stride + (hh + 1) * hd],
                        kc,
                        vc,
                        offs,
                        base: (hh / group) * hd,
                        scale,
                        sink: sinks.get(hh).copied(),
                    };
                    ops::attend(&a, scores, out);
                };
                let team = crate::team::team();
                if n >= team.threads() {
                    team.for_each_chunk(att, qd, &|i, out| {
                        let offs = offsets(i);
                        let mut scores = Vec::new();
                        for (hh, o) in out.chunks_exact_mut(hd).enumerate() {
                            head(i, hh, &offs, &mut scores, o);
                        }
                    });
                } else {
                    team.for_each_chunk(att, hd, &|t, out| {
                        let (i, hh) = (t / nh, t % nh);
                        head(i, hh, &offsets(i), &mut Vec::new(), out);
                    });
                }
            }};
        }
        match kv.dtype {
            KvDtype::F32 => attend_all!(&kv.k[layer][..], &kv.v[layer][..]),
            KvDtype::Bf16 => attend_all!(&kv.k16[layer][..], &kv.v16[layer][..]),
        }
        matmul(&self.att, n, &lw.o, &mut self.tmp);
        for (xv, t) in self.x[..n * hs].iter_mut().zip(&self.tmp) {
            *xv += t;
        }
        if !lw.o_bias.is_empty() {
            for row in self.x[..n * hs].chunks_exact_mut(hs) {
                for (xv, b) in row.iter_mut().zip(&lw.o_bias) {
                    *xv += b;
                }
            }
        }
        Ok(())
    }

    fn route(&mut self, layer: usize, ml: usize) -> Result<()> {
        let c = &self.cfg;
        let (n, hs, ne, k) = (
            self.rows.len(),
            c.hidden_size,
            c.num_experts,
            c.num_experts_per_tok,
        );
        let lw = &self.w.layers[layer];
        let router = lw
            .router
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("layer {layer} is not a MoE layer")))?;
        self.probs.resize(n * ne, 0.0);
        rmsnorm(
            &self.x[..n * hs],
            &lw.post_norm,
            c.rms_norm_eps,
            &mut self.h,
        );
        matmul(&self.h, n, router, &mut self.probs);
        if !lw.router_logit_bias.is_empty() {
            for row in self.probs[..n * ne].chunks_exact_mut(ne) {
                for (v, b) in row.iter_mut().zip(&lw.router_logit_bias) {
                    *v += b;
                }
            }
        }
        self.weights.clear();
        self.weights.resize(n * k, 0.0);
        let picks = &mut self.picks[ml * n * k..(ml + 1) * n * k];
        let scoring = crate::predict::enabled();
        // the scores, then the top-k per row in rank order
        for (r, p) in self.probs[..n * ne].chunks_exact_mut(ne).enumerate() {
            let w = &mut self.weights[r * k..(r + 1) * k];
            match c.routing {
                Routing::Softmax => {
                    ops::softmax(p);
                    ops::topk(p, k, &mut self.top);
                    for (j, &(e, pw)) in self.top.iter().enumerate() {
                        w[j] = pw;
                        picks[r * k + j] = e as i32;
                    }
                }
                Routing::SigmoidGrouped {
                    n_group,
                    topk_group,
                } => {
                    ops::sigmoid_grouped_topk(
                        p,
                        &lw.router_bias,
                        n_group,
                        topk_group,
                        k,
                        &mut self.tmp,
                        &mut self.top,
                    );
                    for (j, &(e, _)) in self.top.iter().enumerate() {
                        w[j] = p[e];
                        picks[r * k + j] = e as i32;
                    }
                }
            }
            if scoring {
                let row = &picks[r * k..(r + 1) * k];
                let at = (ml * n + r) * k;
                let g = &self.guess[at..at + k];
                if g[0] >= 0 {
                    crate::predict::score(0, g, row);
                }
                // this row's sequence one step earlier, when that step had it in one row
                let pn = self.prev_seqs.len();
                if let Some(pr) = self.prev_seqs.iter().position(|&s| s == self.rows[r].seq) {
                    let at = (ml * pn + pr) * k;
                    if let Some(p) = self.prev_picks.get(at..at + k) {
                        crate::predict::score(1, p, row);
                    }
                }
            }
            if c.norm_topk_prob {
                let sum: f32 = w.iter().sum();
                let sum = match c.routing {
                    Routing::Softmax => sum,
                    Routing::SigmoidGrouped { .. } => sum + 1e-20,
                };
                for x in w.iter_mut() {
                    *x /= sum;
                }
            }
            if c.routed_scaling_factor != 1.0 {
                for x in w.iter_mut() {
                    *x *= c.routed_scaling_factor;
                }
            }
        }
        Ok(())
    }

    fn host_routes(&self) -> bool {
        true
    }

    fn picks(&mut self, ml: usize, _rows: bool, out: &mut Vec<i32>) -> Result<()> {
        out.clear();
        out.extend_from_slice(self.layer_picks(ml));
        Ok(())
    }

    fn normed_rows(&self) -> &[f32] {
        &self.h[..self.rows.len() * self.cfg.hidden_size]
    }

    fn experts(&mut self, ml: usize, bank: &ExpertBank, split: Option<&Split>) -> Result<()> {
        let (hs, k) = (self.cfg.hidden_size, self.cfg.num_experts_per_tok);
        let n = self.n();
        self.outs.resize(n * k * hs, 0.0);
        if split.is_none() {
            // every pick of the layer is hot, in slot order
            let picks = &self.picks[ml * n * k..(ml + 1) * n * k];
            self.all_hot.clear();
            self.all_hot
                .extend(picks.iter().enumerate().map(|(s, &e)| Pick {
                    row: (s / k) as u32,
                    expert: e as u16,
                }));
            self.all_slots.clear();
            self.all_slots.extend(0..(n * k) as u32);
        }
        let (hot, slots) = match split {
            Some(s) => (&s.hot[..], &s.hot_slots[..]),
            None => (&self.all_hot[..], &self.all_slots[..]),
        };
        self.hot_out.resize(hot.len() * hs, 0.0);
        bank.compute(ml, hot, &self.h, &mut self.hot_out)?;
        place(&mut self.outs, hs, slots, &self.hot_out)
    }

    fn scatter(&mut self, slots: &[u32], outputs: &[f32]) -> Result<()> {
        place(&mut self.outs, self.cfg.hidden_size, slots, outputs)
    }

    fn combine(&mut self) -> Result<()> {
        let (hs, k) = (self.cfg.hidden_size, self.cfg.num_experts_per_tok);
        self.acc.resize(hs, 0.0);
        for r in 0..self.n() {
            let acc = &mut self.acc;
            acc.fill(0.0);
            for j in 0..k {
                let w = self.weights[r * k + j];
                let y = &self.outs[(r * k + j) * hs..(r * k + j + 1) * hs];
                for (a, &yv) in acc.iter_mut().zip(y) {
                    *a += w * yv;
                }
            }
            for (xv, a) in self.x[r * hs..(r + 1) * hs].iter_mut().zip(acc.iter()) {
                *xv += a;
            }
        }
        Ok(())
    }

    fn shared_expert(&mut self, layer: usize) -> Result<()> {
        let hs = self.cfg.hidden_size;
        let n = self.n();
        let Some((mlp, gate)) = self.w.layers[layer].shared.as_ref() else {
            return Ok(());
        };
        self.tmp.resize(n * hs, 0.0);
        let (mut gu, mut act) = (Vec::new(), Vec::new());
        crate::bank::expert_forward(mlp, &self.h, n, &mut gu, &mut act, &mut self.tmp);
        for r in 0..n {
            // an ungated shared expert (glm4_moe) is added as it is
            let s = if gate.is_empty() {
                1.0
            } else {
                let g = ops::dot(gate, &self.h[r * hs..(r + 1) * hs]);
                1.0 / (1.0 + (-g).exp())
            };
            for (xv, t) in self.x[r * hs..(r + 1) * hs]
                .iter_mut()
                .zip(&self.tmp[r * hs..(r + 1) * hs])
            {
                *xv += s * t;
            }
        }
        Ok(())
    }

    fn dense_mlp(&mut self, layer: usize) -> Result<()> {
        let c = &self.cfg;
        let hs = c.hidden_size;
        let n = self.n();
        let lw = &self.w.layers[layer];
        let mlp = lw
            .dense_mlp
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("layer {layer} has no dense MLP")))?;
        self.tmp.resize(n * hs, 0.0);
        rmsnorm(
            &self.x[..n * hs],
            &lw.post_norm,
            c.rms_norm_eps,
            &mut self.h,
        );
        let (mut gu, mut act) = (Vec::new(), Vec::new());
        crate::bank::expert_forward(mlp, &self.h, n, &mut gu, &mut act, &mut self.tmp);
        for (xv, t) in self.x[..n * hs].iter_mut().zip(&self.tmp) {
            *xv += t;
        }
        Ok(())
    }

    fn hidden(&mut self, out: &mut Vec<f32>) -> Result<()> {
        out.clear();
        out.extend_from_slice(&self.x[..self.n() * self.cfg.hidden_size]);
        Ok(())
    }

    fn head(&mut self, out: HeadOut, picks: &[TokenPick]) -> Result<StepOut> {
        let (hs, v) = (self.cfg.hidden_size, self.cfg.vocab_size);
        let m = self.logit_rows.len();
        self.h.resize(m.max(self.n()) * hs, 0.0);
        for (i, &r) in self.logit_rows.iter().enumerate() {
            rmsnorm(
                &self.x[r * hs..(r + 1) * hs],
                &self.w.norm,
                self.cfg.rms_norm_eps,
                &mut self.h[i * hs..(i + 1) * hs],
            );
        }
        let head = self.w.lm_head.as_ref().unwrap_or(&self.w.embed);
        let mut logits = vec![0f32; m * v];
        matmul(&self.h[..m * hs], m, head, &mut logits);
        if out == HeadOut::Logits {
            return Ok(StepOut::Logits(logits));
        }
        if out == HeadOut::Sample && picks.len() != m {
            return Err(Error::Invalid(format!(
                "{} token picks for {m} logit rows",
                picks.len()
            )));
        }
        let mut scratch = Vec::new();
        Ok(StepOut::Ids(
            logits
                .chunks_exact(v)
                .enumerate()
                .map(|(i, row)| {
                    let p = picks.get(i).copied().unwrap_or(TokenPick::Greedy);
                    crate::sampling::pick_token(row, p, &mut scratch)
                })
                .collect(),
        ))
    }

    fn step_picks(&self) -> &[i32] {
        &self.picks
    }

    fn bytes_per_token(&self) -> usize {
        self.w.bytes_per_token()
    }

    fn as_any_mut(&mut self) -> &mut dyn Any {
        self
    }
}
