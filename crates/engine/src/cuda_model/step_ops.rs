//! The ops of a step on the GPU ([`Op`]): attention, the router, the MoE layer and the
//! exchange with a cold tier (picks down, outputs scattered into their slots), the combine,
//! the dense MLP and the head; the switches the benches and tests turn; and what a step
//! leaves for the host.

use super::*;
use crate::config::Routing;

/// The MoE kernels' activation parameters (alpha, limit): limit 0 is silu(gate) * up.
pub(crate) fn glu_params(glu: crate::config::Glu) -> (f32, f32) {
    match glu {
        crate::config::Glu::Silu => (0.0, 0.0),
        crate::config::Glu::Clamped { alpha, limit } => (alpha, limit),
    }
}

impl GpuModel {
    /// How this step's head samples: one pick per logit row (set after `begin`, before
    /// the run that ends in `Op::Head(HeadOut::Sample)`). Grows the probabilities' scratch.
    pub fn set_picks(&mut self, picks: &[TokenPick]) -> Result<()> {
        if picks.len() != self.m {
            return Err(Error::Gpu(format!(
                "{} token picks for {} logit rows",
                picks.len(),
                self.m
            )));
        }
        let st = self.st.clone();
        if self.probs.grow(&st, self.m * self.cfg.vocab_size)? {
            self.generation += 1;
            self.captured.clear();
            self.seen.clear();
        }
        let spec: Vec<f64> = picks
            .iter()
            .flat_map(|p| match *p {
                TokenPick::Greedy => [0.0, 1.0, 0.0, 0.0],
                TokenPick::Sample {
                    temperature,
                    top_p,
                    top_k,
                    u,
                } => [temperature as f64, top_p as f64, top_k as f64, u],
            })
            .collect();
        self.spec.write(&st, &spec)
    }

    pub(super) fn head(&mut self, out: HeadOut) -> Result<()> {
        let c = &self.cfg;
        let (hs, v, m) = (c.hidden_size, c.vocab_size, self.m);
        if m == 0 {
            return Ok(());
        }
        self.rmsnorm(self.x.p, self.o_lrows, self.norm.p, self.h.p, m)?;
        let head = self.head.as_ref().unwrap_or(&self.embed).w();
        self.gemm(
            "gemv_rows:head",
            head,
            v,
            hs,
            self.h.p,
            m,
            self.logits.p,
            0.0,
        )?;
        let vi = v as i32;
        match out {
            HeadOut::Logits => {}
            HeadOut::Argmax => {
                let mut a = args::ArgmaxRows {
                    logits: self.logits.p,
                    out: self.amax.p,
                    vocab: vi,
                };
                // SAFETY: logits holds m rows of V; amax m ints (sized in `begin`).
                unsafe {
                    self.launch(
                        &self.f.argmax,
                        "argmax_rows",
                        &mut a.params(),
                        grid(m, 1, 256, 0),
                    )
                }?;
            }
            HeadOut::Sample => {
                if self.probs.len < m * v {
                    return Err(Error::Gpu("a sampling head without set_picks".into()));
                }
                let mut a = args::SampleRows {
                    logits: self.logits.p,
                    spec: self.spec.p,
                    probs: self.probs.p,
                    out: self.amax.p,
                    vocab: vi,
                };
                // SAFETY: logits and probs hold m rows of V, spec 3m doubles (written by
                // set_picks), amax m ints.
                unsafe {
                    self.launch(
                        &self.f.sample,
                        "sample_rows",
                        &mut a.params(),
                        grid(m, 1, 1024, 0),
                    )
                }?;
            }
        }
        Ok(())
    }

    /// x += attention(input_norm(x)) of decoder layer `l`, writing K/V of every row.
    pub fn attention(&mut self, l: usize) -> Result<()> {
        if self.cfg.mla.is_some() {
            return self.mla_attention(l);
        }
        let c = &self.cfg;
        let n = self.n;
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let lw = &self.layers[l];
        self.normed_product(
            "norm_gemv_rows:qkv",
            lw.qkv.w(),
            qd + 2 * kvd,
            self.x.p,
            lw.input_norm.p,
            0,
            n,
            self.qkv.p,
        )?;
        if let Some(b) = &lw.qkv_bias {
            // qkv holds n rows of q_dim + 2 kv_dim, the bias that many floats
            self.bias_rows(self.qkv.p, b, qd + 2 * kvd)?;
        }
        let (nh, nkv, hd) = (
            c.num_attention_heads as i32,
            c.num_key_value_heads as i32,
            c.head_dim as i32,
        );
        let eps = c.rms_norm_eps;
        let scale = c.attention_scale;
        // gpt_oss: each head's sink logit in the softmax's sum, a sliding window on some layers
        let sinks = lw.sinks.as_ref().map_or(0, |b| b.p);
        let window = c
            .windows
            .get(l)
            .copied()
            .flatten()
            .map_or(0, |w| i32::try_from(w).unwrap_or(0));
        // 16 warps take the positions in turn: a decode row's chain of dependent loads is
        // 1/16 of its context (or of its range of it) long
        let nw = ATT_WARPS;
        if self.decode_only {
            let mut a = args::AttentionDecode {
                qkv: self.qkv.p,
                qn: if c.qk_norm { lw.q_norm.p } else { 0 },
                kn: if c.qk_norm { lw.k_norm.p } else { 0 },
                cos_t: self.cos.p,
                sin_t: self.sin.p,
                kc: self.kc[l].p,
                vc: self.vc[l].p,
                row_pos: self.o_pos,
                row_tab: self.o_tab,
                blocks: self.o_blocks,
                out: self.att.p,
                nh,
                nkv,
                hd,
                eps,
                scale,
                part: self.att_part.p,
                rd: c.rotary_dim as i32,
                sinks,
                window,
            };
            let mut cfg = grid(n, c.num_attention_heads, 32 * nw, (nw + 3) * c.head_dim * 4);
            cfg.grid_dim.2 = self.splits as u32;
            // SAFETY: positions < max_pos and their blocks < kv_blocks were checked in
            // `begin`; qkv holds n rows of q_dim + 2 kv_dim, att n rows of q_dim, att_part
            // n * heads * splits partials (`begin`); every row is its own sequence's
            // (decode_only), so no two rows write one cache slot.
            unsafe {
                self.launch(
                    &self.f.attention_decode,
                    "attention_decode",
                    &mut a.params(),
                    cfg,
                )
            }?;
            if self.splits > 1 {
                let sp = self.splits as i32;
                let mut a = args::AttentionMerge {
                    part: self.att_part.p,
                    out: self.att.p,
                    nh,
                    hd,
                    splits: sp,
                    sinks,
                };
                // SAFETY: att_part holds the partials the kernel above wrote, att n rows.
                unsafe {
                    self.launch(
                        &self.f.attention_merge,
                        "attention_merge",
                        &mut a.params(),
                        grid(n, c.num_attention_heads, c.head_dim.next_multiple_of(32), 0),
                    )
                }?;
            }
            return self.out_proj(l);
        }
        let mut a = args::QkRopeKv {
            qkv: self.qkv.p,
            qn: if c.qk_norm { lw.q_norm.p } else { 0 },
            kn: if c.qk_norm { lw.k_norm.p } else { 0 },
            cos_t: self.cos.p,
            sin_t: self.sin.p,
            row_pos: self.o_pos,
            row_tab: self.o_tab,
            blocks: self.o_blocks,
            kc: self.kc[l].p,
            vc: self.vc[l].p,
            nh,
            nkv,
            hd,
            eps,
            rd: c.rotary_dim as i32,
        };
        // a warp per head, up to 16 (the kernel's warps take the heads in turn; 1024 threads
        // ask more registers than an SM has for this kernel)
        let heads = (c.num_attention_heads + c.num_key_value_heads).min(16);
        // SAFETY: positions < max_pos and their blocks < kv_blocks were checked in `begin`;
        // qkv holds n rows of q_dim + 2 kv_dim.
        unsafe {
            self.launch(
                &self.f.qk_rope_kv,
                "qk_rope_kv",
                &mut a.params(),
                grid(n, 1, 32 * heads, 0),
            )
        }?;
        // a tile of rows per block, or (tiles ignored) a block per row
        let (f, name, cfg) = if self.tiled_prefill {
            let hd = c.head_dim;
            let smem = 4 * (ATT_TILE * hd + 32 * (2 * hd + 1) + 8 * 32);
            let cfg = grid(self.tiles, c.num_attention_heads, 256, smem);
            (&self.f.attention_tiled, "attention_tiled", cfg)
        } else {
            let cfg = grid(n, c.num_attention_heads, 32 * nw, nw * c.head_dim * 4);
            (&self.f.attention, "attention", cfg)
        };
        let mut a = args::Attention {
            qkv: self.qkv.p,
            kc: self.kc[l].p,
            vc: self.vc[l].p,
            row_pos: self.o_pos,
            row_tab: self.o_tab,
            blocks: self.o_blocks,
            tiles: self.o_tiles,
            out: self.att.p,
            nh,
            nkv,
            hd,
            scale,
            sinks,
            window,
        };
        // SAFETY: as above; the tiles (first row, count <= ATT_TILE, rows of one sequence)
        // were built in `begin` from these rows; att holds n rows of q_dim.
        unsafe { self.launch(f, name, &mut a.params(), cfg) }?;
        self.out_proj(l)
    }

    /// Multi-head latent attention (deepseek_v3) of decoder layer `l`, absorbed, as the CPU
    /// backend computes it (kernels/mla.cu): q (through its bottleneck when the layer has
    /// one) and the compressed kv from the normed rows; the latent's norm and the key's RoPE
    /// into the latent cache; each head's query taken through its key rows (`head_gemv`),
    /// scored against the cached latents and rotary keys (`mla_attend`), the weighted latent
    /// taken through its value rows (`head_gemv`); then the o projection. One path for
    /// prefill and decode.
    fn mla_attention(&self, l: usize) -> Result<()> {
        let c = &self.cfg;
        let m = c
            .mla
            .ok_or_else(|| Error::Internal("MLA attention of a model without MLA".into()))?;
        let n = self.n;
        let lw = &self.layers[l];
        let w = lw
            .mla
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("layer {l} has no MLA weights")))?;
        let (nh, hs) = (c.num_attention_heads, c.hidden_size);
        let (nope, rope, r, vh) = (
            m.qk_nope_head_dim,
            m.qk_rope_head_dim,
            m.kv_lora_rank,
            m.v_head_dim,
        );
        let (qk, cd, ql) = (nope + rope, r + rope, m.q_lora_rank.unwrap_or(0));
        let f4 = |x: usize| 4 * x as u64;
        let tq = self.mla_s.p;
        let ckv = tq + f4(n * ql);
        let q_lat = ckv + f4(n * cd);
        let lat = q_lat + f4(n.min(super::MLA_ROWS) * nh * r);
        let q = self.qkv.p;
        if self.mla_s.len < super::mla_scratch_floats(c, &m, n) {
            return Err(Error::Internal(format!(
                "MLA scratch of {} floats for {n} rows",
                self.mla_s.len
            )));
        }
        // h = input_norm(x) feeds both products
        match &w.q_a {
            Some((qa, _)) => self.normed_product(
                "norm_gemv_rows:q_a",
                qa.w(),
                ql,
                self.x.p,
                lw.input_norm.p,
                self.h.p,
                n,
                tq,
            )?,
            None => self.normed_product(
                "norm_gemv_rows:q",
                w.q_b.w(),
                nh * qk,
                self.x.p,
                lw.input_norm.p,
                self.h.p,
                n,
                q,
            )?,
        }
        self.gemm("gemv_rows:kv_a", w.kv_a.w(), cd, hs, self.h.p, n, ckv, 0.0)?;
        let (ri, ropei, il) = (r as i32, rope as i32, c.rope_interleave as i32);
        let mut a = args::MlaPrep {
            tq: if w.q_a.is_some() { tq } else { 0 },
            qa_norm: w.q_a.as_ref().map_or(0, |(_, nrm)| nrm.p),
            q_lora: ql as i32,
            ckv,
            kv_norm: w.kv_a_norm.p,
            cos_t: self.cos.p,
            sin_t: self.sin.p,
            row_pos: self.o_pos,
            row_tab: self.o_tab,
            blocks: self.o_blocks,
            kc: self.kc[l].p,
            r: ri,
            rope: ropei,
            interleave: il,
        };
        // SAFETY: positions < max_pos and their blocks < kv_blocks were checked in `begin`;
        // the scratch holds n rows of q_lora and of r + rope (checked above); the cache
        // layer holds kv_blocks * 16 positions of r + rope; r + rope + 33 floats shared.
        unsafe {
            self.launch(
                &self.f.mla_prep,
                "mla_prep",
                &mut a.params(),
                grid(n, 1, 256, (cd + 33) * 4),
            )
        }?;
        if w.q_a.is_some() {
            self.gemm("gemv_rows:q_b", w.q_b.w(), nh * qk, ql, tq, n, q, 0.0)?;
        }
        // per chunk of rows: each head's query through its key rows (q_lat [rows, heads, r]),
        // attention over the latents (lat), the weighted latent through the value rows
        let mut r0 = 0;
        while r0 < n {
            let rows = super::MLA_ROWS.min(n - r0);
            let qr = q + f4(r0 * nh * qk);
            self.head_gemv(w.uk.w(), rows, qr, nope, r, nh * qk, qk, q_lat)?;
            let mut a = args::MlaAttend {
                q_lat,
                q: qr,
                cos_t: self.cos.p,
                sin_t: self.sin.p,
                kc: self.kc[l].p,
                row_pos: self.o_pos + 4 * r0 as u64,
                row_tab: self.o_tab + 4 * r0 as u64,
                blocks: self.o_blocks,
                lat,
                heads: nh as i32,
                r: ri,
                rope: ropei,
                nope: nope as i32,
                interleave: il,
                scale: c.attention_scale,
            };
            // SAFETY: as mla_prep, for rows r0..r0 + rows of the step (their positions and
            // tables at those offsets); q holds n rows of heads * (nope + rope), q_lat and lat
            // MLA_ROWS rows of heads * r (the scratch, checked above); r <= 512 and rope <= 64
            // (checked at load); r + rope + 8 (r + 2) floats shared.
            unsafe {
                self.launch(
                    &self.f.mla_attend,
                    "mla_attend",
                    &mut a.params(),
                    grid(rows, nh, 256, (cd + 8 * (r + 2)) * 4),
                )
            }?;
            let att = self.att.p + f4(r0 * nh * vh);
            self.head_gemv(w.uv.w(), rows, lat, r, vh, nh * r, r, att)?;
            r0 += rows;
        }
        self.out_proj(l)
    }

    /// y[row, head, 0..out] = w[head] . x[row * xs + head * xh ..][0..inp] for `rows` rows
    /// and every head (`w`: `[heads, out, inp]`), y's rows `heads * out` wide.
    #[allow(clippy::too_many_arguments)]
    fn head_gemv(
        &self,
        w: W,
        rows: usize,
        x: u64,
        inp: usize,
        out: usize,
        xs: usize,
        xh: usize,
        y: u64,
    ) -> Result<()> {
        let heads = self.cfg.num_attention_heads;
        let mut a = args::HeadGemv {
            w: w.p,
            x,
            y,
            inp: inp as i32,
            out: out as i32,
            xs: xs as i32,
            xh: xh as i32,
            ys: (heads * out) as i32,
        };
        let mut cfg = grid(rows, heads, 256, 0);
        cfg.grid_dim.2 = out.div_ceil(8) as u32;
        // SAFETY: w holds heads * out * inp weights (the stacked per-head matrices); x holds
        // `rows` rows of xs floats with head h's inp at h * xh; y `rows` rows of heads * out
        // (callers' scratch and offsets, sized in `begin`).
        unsafe { self.launch(self.f.head_gemv.of(w.dt), "head_gemv", &mut a.params(), cfg) }
    }

    /// x += o . att (the attention's output projection of decoder layer `l`).
    fn out_proj(&self, l: usize) -> Result<()> {
        let (hs, qd) = (self.cfg.hidden_size, self.cfg.o_dim());
        let o = self.layers[l].o.w();
        self.gemm("gemv_rows:o", o, hs, qd, self.att.p, self.n, self.x.p, 1.0)?;
        match &self.layers[l].o_bias {
            Some(b) => self.bias_rows(self.x.p, b, hs),
            None => Ok(()),
        }
    }

    /// y[r, :dim] += b for each of the step's rows.
    fn bias_rows(&self, y: u64, b: &Buf<f32>, dim: usize) -> Result<()> {
        let mut a = args::BiasRows {
            y,
            b: b.p,
            dim: dim as i32,
        };
        // SAFETY: y holds n rows of dim floats (the caller's), b dim floats.
        unsafe {
            self.launch(
                &self.f.bias_rows,
                "bias_rows",
                &mut a.params(),
                grid(self.n, 1, 256, 0),
            )
        }
    }

    /// Router of MoE layer `l` (`ml`-th MoE layer): h = post_norm(x), top-k ids and weights.
    pub fn route(&mut self, l: usize, ml: usize) -> Result<()> {
        let c = &self.cfg;
        let n = self.n;
        let (ne, k) = (c.num_experts, c.num_experts_per_tok);
        let lw = &self.layers[l];
        let router = lw
            .router
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("layer {l} is not a MoE layer")))?;
        let idx = self.idx.p + (4 * ml * n * k) as u64;
        let (e, ki, norm) = (ne as i32, k as i32, c.norm_topk_prob as i32);
        let guess = self.guess_ok(l, ml);
        if let Some(g) = &guess {
            // one row: its logits, then the guessed row of the next MoE layer's ([2E]), the
            // product's real rows bit for bit those of the router alone; no fused router,
            // logit bias or sigmoid routing (guess_ok), so the top-k below routes both rows
            self.normed_product(
                "norm_gemv_rows:router",
                *g,
                2 * ne,
                self.x.p,
                lw.post_norm.p,
                self.h.p,
                1,
                self.rlog.p,
            )?;
        } else if self.fuse
            && n <= 4
            && router.w().dt != Wdt::F8
            && lw.router_logit_bias.is_none()
            && c.routing == Routing::Softmax
            && self.register_topk
            && ne <= TOPK_REG * 32
            && k <= 32
        {
            let hs = c.hidden_size;
            let mut a = args::NormGemvRoute {
                w: router.w().p,
                x: self.x.p,
                nw: lw.post_norm.p,
                h: self.h.p,
                y: self.rlog.p,
                out: e,
                inp: hs as i32,
                n: n as i32,
                eps: c.rms_norm_eps,
                vec4: hs.is_multiple_of(4) as i32,
                prefetch: self.prefetch as i32,
                preload: self.preload as i32,
                idx,
                wts: self.wts.p,
                k: ki,
                norm,
                done: self.route_done.p,
            };
            // SAFETY: the router holds E rows of H; x and h n <= 4 rows of H, the norm
            // weights H; rlog n rows of E; idx and wts room for the ml-th layer's n*k picks
            // (k <= 32, E <= 32 * TOPK_REG: the register top-k); done one counter at 0
            // between launches (the last block sets it back).
            return unsafe {
                self.launch(
                    self.f.norm_gemv_route.of(router.w().dt),
                    "norm_gemv_route:router",
                    &mut a.params(),
                    grid(ne.div_ceil(8), 1, 256, 0),
                )
            };
        } else {
            // h (the normed rows) feeds the experts: written by the fused kernel or the norm
            self.normed_product(
                "norm_gemv_rows:router",
                router.w(),
                ne,
                self.x.p,
                lw.post_norm.p,
                self.h.p,
                n,
                self.rlog.p,
            )?;
            if let Some(b) = &lw.router_logit_bias {
                // gpt_oss's router has a bias on its logits
                self.bias_rows(self.rlog.p, b, ne)?;
            }
            if let Routing::SigmoidGrouped {
                n_group,
                topk_group,
            } = c.routing
            {
                let mut a = args::RouteSigmoid {
                    logits: self.rlog.p,
                    bias: lw.router_bias.as_ref().map_or(0, |b| b.p),
                    idx,
                    wts: self.wts.p,
                    experts: e,
                    k: ki,
                    norm,
                    n_group: n_group as i32,
                    topk_group: topk_group as i32,
                    scale: c.routed_scaling_factor,
                };
                // SAFETY: rlog holds n rows of E, the bias (when set) E floats; idx has room for
                // the ml-th layer's n*k ids; 2 E + 2 n_group floats of shared memory.
                return unsafe {
                    self.launch(
                        &self.f.route_sigmoid,
                        "route_sigmoid",
                        &mut a.params(),
                        grid(n, 1, 32, (2 * ne + 2 * n_group) * 4),
                    )
                };
            }
        }
        let regs = (self.register_topk && ne <= TOPK_REG * 32) as i32;
        // with a guess, a second row: the next layer's picks into guess_idx
        let (rows, gidx, gwts) = match guess {
            Some(_) => (
                2,
                self.guess_idx.p + (4 * (ml + 1) * k) as u64,
                self.guess_wts.p,
            ),
            None => (n, 0, 0),
        };
        let mut a = args::RouteTopk {
            logits: self.rlog.p,
            idx,
            wts: self.wts.p,
            experts: e,
            k: ki,
            norm,
            regs,
            gidx,
            gwts,
        };
        let smem = if regs != 0 { 0 } else { ne * 4 };
        // SAFETY: rlog holds `rows` rows of E (at least 2 rows, grown in `begin`); idx has
        // room for the ml-th layer's n*k ids, guess_idx for layer ml + 1's k (ml + 1 < moe,
        // guess_ok), guess_wts k; E floats of shared memory unless the row stays in registers
        // (E <= 32 * TOPK_REG).
        unsafe {
            self.launch(
                &self.f.route_topk,
                "route_topk",
                &mut a.params(),
                grid(rows, 1, 32, smem),
            )
        }?;
        Ok(())
    }

    /// The stacked router (`Layer::router_guess`) when decoder layer `l` (MoE layer `ml`)
    /// guesses the next MoE layer's picks this step: guesses on, a single row, the softmax
    /// router without a logit bias on the plain chain (no fused router, no persistent step),
    /// the top-k in registers, and a MoE layer after it.
    fn guess_ok(&self, l: usize, ml: usize) -> Option<W> {
        let c = &self.cfg;
        let lw = &self.layers[l];
        let g = lw.router_guess.as_ref()?;
        let ok = self.n == 1
            && !self.fuse
            && !self.persist
            && ml + 1 < self.moe
            && g.dt != Wdt::F8
            && lw.router_logit_bias.is_none()
            && c.routing == Routing::Softmax
            && self.register_topk
            && c.num_experts <= TOPK_REG * 32
            && c.num_experts_per_tok <= 32
            && self.hollow.is_empty();
        ok.then(|| g.w())
    }

    /// Whether MoE layer `ml`'s guess for the next layer may be compared with its picks
    /// ([`Self::guess_hits`]).
    pub fn guesses(&self) -> bool {
        self.layers.iter().any(|l| l.router_guess.is_some())
    }

    /// After a single row's step: of the MoE layers the step guessed (every one after the
    /// first, see `guess_ok`), how many of their picks the guess named, and of how many.
    pub fn guess_hits(&mut self) -> Result<(usize, usize)> {
        let (moe, k) = (self.moe, self.cfg.num_experts_per_tok);
        if self.n != 1 || moe < 2 || !self.guesses() {
            return Ok((0, 0));
        }
        let mut got = vec![0i32; moe * k];
        let mut guessed = vec![0i32; moe * k];
        self.st
            .memcpy_dtoh(&self.idx.s.slice(..moe * k), &mut got)
            .map_err(|e| gerr("reading the picks", e))?;
        self.st
            .memcpy_dtoh(&self.guess_idx.s.slice(..moe * k), &mut guessed)
            .map_err(|e| gerr("reading the guesses", e))?;
        self.st
            .synchronize()
            .map_err(|e| gerr("reading the guesses", e))?;
        let mut hits = 0;
        for m in 1..moe {
            let picks = &got[m * k..(m + 1) * k];
            hits += guessed[m * k..(m + 1) * k]
                .iter()
                .filter(|g| picks.contains(g))
                .count();
        }
        Ok((hits, (moe - 1) * k))
    }

    /// Downloads MoE layer `ml`'s picks `[n, k]` and normed activations `[n, H]` (waits).
    pub fn fetch_route(&mut self, ml: usize, idx: &mut Vec<i32>, h: &mut Vec<f32>) -> Result<()> {
        h.resize(self.n * self.cfg.hidden_size, 0.0);
        self.h.read(&self.st, &mut h[..])?;
        self.fetch_picks(ml, idx)
    }

    /// Whether MoE layer `ml`'s down-projection can also do the combine
    /// ([`Op::MoeOne`]): a single row, 16-bit or f32 experts without biases or gpt_oss's
    /// activation, at most K1_MAX picks (kernels/moe.cu), and the fusion on. The caller
    /// vouches that every pick is on this GPU and that nothing is added to the slots or
    /// the rows between the experts and the combine.
    pub fn fuses_combine(&self, ml: usize) -> bool {
        let c = &self.cfg;
        let edt = self.expert_dt.get(ml).copied().flatten();
        self.fuse
            && self.n == 1
            && matches!(edt, Some(Wdt::F32) | Some(Wdt::Bf16))
            && !c.expert_bias
            && c.expert_glu == crate::config::Glu::Silu
            && (1..=K1_MAX).contains(&c.num_experts_per_tok)
    }

    /// The hot experts' outputs of MoE layer `ml` into their pick slots; with `combined`
    /// ([`Self::fuses_combine`]) added into the rows as the combine does, in one kernel.
    pub fn moe(&mut self, ml: usize, combined: bool) -> Result<()> {
        let c = &self.cfg;
        let (n, k, hs, i, ne) = (
            self.n,
            c.num_experts_per_tok,
            c.hidden_size,
            c.moe_intermediate_size,
            c.num_experts,
        );
        let nk = n * k;
        // no expert on this GPU yet: every table entry is null, either kernel skips them all
        let edt = self
            .expert_dt
            .get(ml)
            .copied()
            .flatten()
            .unwrap_or(Wdt::F32);
        let idx = self.idx.p + (4 * ml * nk) as u64;
        let gu = self.tab_gu.p + (8 * ml * ne) as u64;
        let dn = self.tab_dn.p + (8 * ml * ne) as u64;
        let gs = self.tab_gs.p + (8 * ml * ne) as u64;
        let ds = self.tab_ds.p + (8 * ml * ne) as u64;
        let block = self.expert_block.get(ml).copied().flatten();
        let [b0, b1] = block.unwrap_or([1, 4]).map(|b| b as i32);
        let (nki, ki, hi, ii) = (nk as i32, k as i32, hs as i32, i as i32);
        let v_up = (hs % 4 == 0) as i32;
        let v_dn = (i % 4 == 0) as i32;
        // one row's picks are distinct experts: every block leads its slot
        let distinct = (n == 1) as i32;
        let (alpha, limit) = glu_params(c.expert_glu);
        // the `_x` kernels when the experts have biases or gpt_oss's activation
        let x = c.expert_bias || c.expert_glu != crate::config::Glu::Silu;
        let mut a = args::MoeUp {
            idx,
            gu_tab: gu,
            h: self.h.p,
            act: self.act.p,
            nk: nki,
            k: ki,
            hidden: hi,
            inter: ii,
            vec4: v_up,
            rows: 0,
            distinct,
            gs_tab: gs,
            b0,
            b1,
            gb_tab: self.tab_gb.p + (8 * ml * ne) as u64,
            alpha,
            limit,
        };
        let up = match (edt == Wdt::F8, x) {
            (true, false) => &self.f.moe_up_f8,
            (true, true) => &self.f.moe_up_x_f8,
            (false, false) => self.f.moe_up.of(edt),
            (false, true) => self.f.moe_up_x.of(edt),
        };
        // SAFETY: ids < E (the router's top-k), table entries are null or resident experts of
        // [2I, H] (and, in the `_x` kernels, null or [2I] / [H] biases); h holds n rows, act
        // n*k rows of I; float4 reads only when H % 4 == 0.
        unsafe {
            self.launch(
                up,
                "moe_up",
                &mut a.params(),
                grid(nk, i.div_ceil(8), 256, 0),
            )
        }?;
        if combined {
            let mut a = args::MoeDownOne {
                idx,
                dn_tab: dn,
                act: self.act.p,
                y: self.y.p,
                x: self.x.p,
                wts: self.wts.p,
                k: ki,
                hidden: hi,
                inter: ii,
                vec4: v_dn,
            };
            // SAFETY: one row: ids < E, k <= K1_MAX (fuses_combine), down [H, I] of every
            // pick resident (null entries add nothing); act holds k rows of I, y k rows of
            // H, x one row of H, wts k weights.
            return unsafe {
                self.launch(
                    self.f.moe_down_one.of(edt),
                    "moe_down_one",
                    &mut a.params(),
                    grid(hs.div_ceil(8), 1, 256, 0),
                )
            };
        }
        let mut a = args::MoeDown {
            idx,
            dn_tab: dn,
            act: self.act.p,
            y: self.y.p,
            nk: nki,
            hidden: hi,
            inter: ii,
            vec4: v_dn,
            distinct,
            ds_tab: ds,
            b0,
            b1,
            db_tab: self.tab_db.p + (8 * ml * ne) as u64,
        };
        // the preloading kernel takes more registers: fewer blocks resident, which costs
        // the bandwidth-bound large batches more than the early loads gain (measured)
        let (down, name) = if edt == Wdt::F8 {
            if x {
                (&self.f.moe_down_x_f8, "moe_down:fp8")
            } else {
                (&self.f.moe_down_f8, "moe_down:fp8")
            }
        } else if x {
            (self.f.moe_down_x.of(edt), "moe_down")
        } else if self.preload && n <= 4 {
            (self.f.moe_down_pre.of(edt), "moe_down:pre")
        } else {
            (self.f.moe_down.of(edt), "moe_down")
        };
        // SAFETY: as above, down [H, I]; y holds n*k rows of H.
        unsafe {
            self.launch(
                down,
                name,
                &mut a.params(),
                grid(nk, hs.div_ceil(8), 256, 0),
            )
        }?;
        Ok(())
    }

    /// Downloads MoE layer `ml`'s picks `[n, k]` only (waits): the activations stay here,
    /// for a link that sends from device memory ([`Self::normed_rows`]).
    pub fn fetch_picks(&mut self, ml: usize, idx: &mut Vec<i32>) -> Result<()> {
        let (n, k) = (self.n, self.cfg.num_experts_per_tok);
        idx.resize(n * k, 0);
        self.st
            .memcpy_dtoh(
                &self.idx.s.slice(ml * n * k..(ml + 1) * n * k),
                &mut idx[..],
            )
            .map_err(|e| gerr("copying picks from the GPU", e))?;
        self.sync()
    }

    /// This GPU's ordinal and the device address and length (floats) of the step's normed
    /// rows `[n, H]` (the MoE input): complete after [`Self::fetch_picks`], unchanged until
    /// the next layer's router runs.
    pub fn normed_rows(&self) -> (usize, u64, usize) {
        (self.gpu.ordinal, self.h.p, self.n * self.cfg.hidden_size)
    }

    /// As [`Self::scatter`], from `len` floats at device address `src` on this GPU (a link's
    /// receive buffer).
    ///
    /// # Safety
    /// `src` addresses `len` floats of this GPU's memory, complete (the host waited for
    /// them) and unchanged until this model's stream is next synchronised.
    pub unsafe fn scatter_from(&mut self, slots: &[i32], src: u64, len: usize) -> Result<()> {
        let hs = self.cfg.hidden_size;
        let nk = self.n * self.cfg.num_experts_per_tok;
        if slots.is_empty() {
            return Ok(());
        }
        if len != slots.len() * hs || slots.iter().any(|&s| s < 0 || s as usize >= nk) {
            return Err(Error::Internal(format!(
                "cold outputs: {len} floats for {} slots (of {nk})",
                slots.len()
            )));
        }
        let st = self.st.clone();
        self.cold_slots.write(&st, slots)?;
        let h = hs as i32;
        let mut a = args::ScatterRows {
            src,
            slots: self.cold_slots.p,
            y: self.y.p,
            h,
        };
        // SAFETY: slots were checked < n*k; src holds slots.len() rows (the caller's word).
        unsafe {
            self.launch(
                &self.f.scatter,
                "scatter_rows",
                &mut a.params(),
                grid(slots.len(), 1, 256, 0),
            )
        }
    }

    /// The cold tier's outputs (`src [slots.len(), H]`) into pick slots.
    pub fn scatter(&mut self, slots: &[i32], src: &[f32]) -> Result<()> {
        if slots.is_empty() {
            return Ok(());
        }
        if src.len() != slots.len() * self.cfg.hidden_size {
            return Err(Error::Internal(format!(
                "cold outputs: {} floats for {} slots",
                src.len(),
                slots.len()
            )));
        }
        let st = self.st.clone();
        self.cold_src.write(&st, src)?;
        // SAFETY: cold_src now holds src (stream-ordered before the kernel)
        unsafe { self.scatter_from(slots, self.cold_src.p, src.len()) }
    }

    /// Decode attention's position ranges per row and head in the last step begun.
    pub fn splits(&self) -> usize {
        self.splits
    }

    /// Turns tiled prefill attention on or off (from the next step run).
    pub fn set_tiled_prefill(&mut self, on: bool) {
        if on != self.tiled_prefill {
            self.tiled_prefill = on;
            self.drop_graphs();
        }
    }

    /// Forgets every captured graph (a scratch buffer moved, or a kernel choice changed).
    pub(super) fn drop_graphs(&mut self) {
        self.generation += 1;
        self.captured.clear();
        self.seen.clear();
    }

    /// Turns split decode attention on or off (from the next step begun).
    pub fn set_split_attention(&mut self, on: bool) {
        self.split_attention = on;
    }

    /// Turns loading weight rows into registers before the previous kernel's end on or off.
    pub fn set_preload(&mut self, on: bool) {
        if on != self.preload {
            self.preload = on;
            self.drop_graphs();
        }
    }

    /// Fuses the router's product with its top-k (up to 4 rows) and a single row's
    /// down-projection with the combine ([`Self::fuses_combine`]) where it can, or launches
    /// the kernels apart (the default): the same sums.
    pub fn set_fuse(&mut self, on: bool) {
        if on != self.fuse {
            self.fuse = on;
            self.drop_graphs();
        }
    }

    /// Runs a single decode row's MoE layers as the persistent kernel where they allow it
    /// or as the chain of kernels (the default: faster, as measured): the same sums.
    pub fn set_persist(&mut self, on: bool) {
        if on != self.persist {
            self.persist = on;
            self.drop_graphs();
        }
    }

    /// The persistent step's blocks (0: it cannot run here).
    pub fn persist_grid(&self) -> usize {
        self.one_grid
    }

    /// Runs of the step that took the persistent kernel so far.
    pub fn persist_runs(&self) -> u64 {
        self.one_runs
    }

    /// The persistent step's phase times where its kernel was built with `ONE_TRACE` (a
    /// development aid, through `MOELANE_KERNELS_DIR`): per phase (q/k/v, attention, merge,
    /// o, router, top-k + up, down + combine), block 0's mean SM cycles from the barrier
    /// before to the barrier after, and how many times it was counted; zeros otherwise.
    pub fn persist_trace(&self) -> Result<[(f64, u64); 7]> {
        let mut w = vec![0u32; super::step_one::ONE_BAR_WORDS];
        self.one_bar.read(&self.st, &mut w)?;
        let word = |i: usize| (w[2 + 2 * i] as u64) | ((w[3 + 2 * i] as u64) << 32);
        let mut out = [(0.0, 0); 7];
        for (p, o) in out.iter_mut().enumerate() {
            let n = word(8 + p);
            *o = (word(p) as f64 / n.max(1) as f64, n);
        }
        Ok(out)
    }

    /// Whether the persistent step can run this model's layers at all, and if not why.
    pub fn persist_status(&self) -> std::result::Result<(), &'static str> {
        match self.persist_unfit() {
            Some(why) => Err(why),
            None if !self.persist => Err("turned off"),
            None => Ok(()),
        }
    }

    /// Keeps the router's top-k rows in registers (the default, up to 512 experts) or in
    /// shared memory (the path of larger routers): the same picks either way.
    pub fn set_register_topk(&mut self, on: bool) {
        if on != self.register_topk {
            self.register_topk = on;
            self.drop_graphs();
        }
    }

    /// Step kernels to launch hollow (names as in the profile, a name before ':' for all
    /// its uses, or "all"; a name after '!' is kept whole: "all+!moe_up" hollows every
    /// kernel but that; empty: none). A diagnostic: the results are wrong while set.
    pub fn set_hollow(&mut self, names: Vec<String>) {
        if names != self.hollow {
            self.hollow = names;
            self.drop_graphs();
        }
    }

    /// x += the picks' outputs weighted by the router, in rank order; `at`, the (decoder,
    /// MoE) layer routed before it: where that router guessed the next layer's picks
    /// ([`Self::route`]), the combine also asks the L2 for those experts.
    pub fn combine(&mut self, at: Option<(usize, usize)>) -> Result<()> {
        let c = &self.cfg;
        let (k, h) = (c.num_experts_per_tok as i32, c.hidden_size as i32);
        let mut a = args::MoeCombine {
            x: self.x.p,
            y: self.y.p,
            wts: self.wts.p,
            k,
            h,
            gidx: 0,
            gu_tab: 0,
            dn_tab: 0,
            gk: 0,
            gu_bytes: 0,
            dn_bytes: 0,
        };
        let mut blocks = self.cfg.hidden_size.div_ceil(128);
        // the next MoE layer's guessed experts asked of the L2 (see `route`)
        if let Some((_, ml)) = at.filter(|&(l, ml)| self.guess_ok(l, ml).is_some()) {
            let g = ml + 1;
            if let Some(dt) = self.expert_dt.get(g).copied().flatten() {
                let (ne, hs, i) = (
                    c.num_experts,
                    c.hidden_size as u64,
                    c.moe_intermediate_size as u64,
                );
                let es = dt.size() as u64;
                a.gidx = self.guess_idx.p + (4 * g * c.num_experts_per_tok) as u64;
                a.gu_tab = self.tab_gu.p + (8 * g * ne) as u64;
                a.dn_tab = self.tab_dn.p + (8 * g * ne) as u64;
                a.gk = GUESS_PREFETCH.min(c.num_experts_per_tok) as i32;
                a.gu_bytes = 2 * i * hs * es;
                a.dn_bytes = hs * i * es;
                // the prefetch's pieces spread over about every SM
                blocks = blocks.max(GUESS_BLOCKS);
            }
        }
        // SAFETY: x holds n rows, y n*k rows, wts n*k; with a guess, guess_idx holds layer
        // ml + 1's k ids (< E), the tables that layer's E entries (null or experts of
        // gu_bytes and dn_bytes); blocks past H only prefetch.
        unsafe {
            self.launch(
                &self.f.combine,
                "moe_combine",
                &mut a.params(),
                grid(self.n, blocks, 128, 0),
            )
        }?;
        Ok(())
    }

    /// Whether decoder layer `l` has a shared expert.
    pub fn has_shared(&self, l: usize) -> bool {
        self.layers.get(l).is_some_and(|x| x.shared.is_some())
    }

    /// x += sigmoid(gate . h) * shared_expert(h) of MoE layer `l` (h: the route's normed
    /// rows), when it has one: the products, the gate's scale applied to the activation (an
    /// ungated one, glm4_moe, as it is), the down projection added into x.
    pub fn shared_expert(&mut self, l: usize) -> Result<()> {
        let c = &self.cfg;
        let (n, hs, si) = (self.n, c.hidden_size, c.shared_expert_intermediate_size);
        let Some((gu, dn, gate)) = self.layers[l].shared.as_ref() else {
            return Ok(());
        };
        let (gu, dn, gate) = (gu.w(), dn.w(), gate.as_ref().map(|g| W::f32(g.p)));
        if let Some(gate) = gate {
            // the gate's logit per row into rlog (the router's top-k has consumed it)
            self.gemm(
                "gemv_rows:shared_gate",
                gate,
                1,
                hs,
                self.h.p,
                n,
                self.rlog.p,
                0.0,
            )?;
        }
        self.gemm(
            "gemv_rows:shared_up",
            gu,
            2 * si,
            hs,
            self.h.p,
            n,
            self.qkv.p,
            0.0,
        )?;
        let mut a = args::SiluMul {
            gu: self.qkv.p,
            a: self.att.p,
            inter: si as i32,
        };
        // SAFETY: qkv holds n rows of 2 Is (sized in `begin`), att n rows of Is.
        unsafe {
            self.launch(
                &self.f.silu_mul,
                "silu_mul:shared",
                &mut a.params(),
                grid(n, 1, 256, 0),
            )
        }?;
        if gate.is_some() {
            let mut s = args::SigmoidScaleRows {
                a: self.att.p,
                g: self.rlog.p,
                inter: si as i32,
            };
            // SAFETY: att holds n rows of Is, rlog n logits.
            unsafe {
                self.launch(
                    &self.f.sigmoid_scale,
                    "sigmoid_scale_rows",
                    &mut s.params(),
                    grid(n, 1, 256, 0),
                )
            }?;
        }
        self.gemm(
            "gemv_rows:shared_down",
            dn,
            hs,
            si,
            self.att.p,
            n,
            self.x.p,
            1.0,
        )
    }

    /// x += dense MLP(post_norm(x)) of a non-MoE layer.
    pub fn dense_mlp(&mut self, l: usize) -> Result<()> {
        let c = &self.cfg;
        let (n, hs, i) = (self.n, c.hidden_size, c.intermediate_size);
        let lw = &self.layers[l];
        let (gu, dn) = lw
            .mlp
            .as_ref()
            .ok_or_else(|| Error::Internal(format!("layer {l} has no dense MLP")))?;
        self.rmsnorm(self.x.p, 0, lw.post_norm.p, self.h.p, n)?;
        self.gemm(
            "gemv_rows:mlp_up",
            gu.w(),
            2 * i,
            hs,
            self.h.p,
            n,
            self.qkv.p,
            0.0,
        )?;
        let ii = i as i32;
        let mut a = args::SiluMul {
            gu: self.qkv.p,
            a: self.att.p,
            inter: ii,
        };
        // SAFETY: qkv holds n rows of 2I (sized in `begin`), att n rows of I.
        unsafe {
            self.launch(
                &self.f.silu_mul,
                "silu_mul",
                &mut a.params(),
                grid(n, 1, 256, 0),
            )
        }?;
        self.gemm(
            "gemv_rows:mlp_down",
            dn.w(),
            hs,
            i,
            self.att.p,
            n,
            self.x.p,
            1.0,
        )
    }

    /// The hidden state `[n, H]` (waits).
    pub fn read_x(&self, out: &mut Vec<f32>) -> Result<()> {
        out.resize(self.n * self.cfg.hidden_size, 0.0);
        self.x.read(&self.st, &mut out[..])?;
        self.sync()
    }

    /// After a run that ended in [`Op::Head`]: the logits (`[m, vocab]`) or their argmax
    /// ids, and the step's picks `[moe layers, n, k]`. Waits for the step to finish.
    pub fn download(
        &mut self,
        logits: Option<&mut [f32]>,
        ids: Option<&mut Vec<u32>>,
        picks: &mut Vec<i32>,
    ) -> Result<()> {
        let c = &self.cfg;
        let (v, m) = (c.vocab_size, self.m);
        let st = self.st.clone();
        if let Some(out) = logits {
            if m > 0 {
                self.logits.read(&st, &mut out[..m * v])?;
            }
        }
        if let Some(ids) = ids {
            let mut tmp = vec![0i32; m];
            if m > 0 {
                self.amax.read(&st, &mut tmp)?;
            }
            ids.clear();
            ids.extend(tmp.iter().map(|&t| t.max(0) as u32));
        }
        let nk = self.moe * self.n * c.num_experts_per_tok;
        picks.resize(nk, 0);
        if nk > 0 {
            self.idx.read(&st, &mut picks[..])?;
        }
        self.sync()
    }
}
