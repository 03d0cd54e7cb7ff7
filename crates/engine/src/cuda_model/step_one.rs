//! The persistent decode step of one row ([`Op::StepOne`], kernels/step_one.cu): a run of
//! whole MoE layers (attention, router, experts, combine, every pick on this GPU) as one
//! cooperative kernel with grid barriers between the phases, in place of the chain of
//! eight kernels a layer. The sums are the chain's, in its order: the logits agree bit for
//! bit with the chain's (`gpu_dense one_row_persistent_step_matches_the_chain`).
//!
//! Taken when every row of the step is one sequence's only new token and there is one row,
//! the layers have nothing the kernel does not do (no biases, no shared expert, softmax
//! routing, SiLU experts, no MLA) and their dense matrices and experts share one dtype (f32
//! or bf16); `MOELANE_CUDA_PERSIST=1` turns it on. Off by default: measured at 0.59-0.62x the
//! chain's tok/s at batch 1 on station (docs/PERFORMANCE.md).

use super::*;

/// Warps of a persistent-step block (ONE_WARPS of kernels/step_one.cu): decode attention's,
/// whose sums' order depends on its warp count.
const ONE_WARPS: usize = 16;
const _: () = assert!(ONE_WARPS == ATT_WARPS);

/// Words of a layer's entry in the kernel's layer table (OneLayer of kernels/step_one.cu).
const ONE_FIELDS: usize = 13;

/// Blocks of the persistent step: one per SM (`MOELANE_CUDA_PERSIST_BLOCKS=N`: N per SM, a
/// measuring aid, fewer where fewer fit), when one block of each of its kernels (`fs`: the
/// f32 and bf16 ones) fits an SM (else 0: the step takes the chain).
pub(super) fn one_grid(gpu: &Gpu, fs: [&CudaFunction; 2], head_dim: usize) -> Result<usize> {
    use cudarc::driver::sys::CUdevice_attribute_enum as A;
    let sms = gpu
        .ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| gerr("reading the SM count", e))? as usize;
    let mut blocks = std::env::var("MOELANE_CUDA_PERSIST_BLOCKS")
        .ok()
        .and_then(|v| v.parse::<usize>().ok())
        .unwrap_or(1)
        .clamp(1, 8);
    let smem = one_smem(head_dim);
    for f in fs {
        if smem > 48 * 1024 {
            // more than the default opt-in (MOELANE_CUDA_PERSIST_SMEM): a launch asking
            // for more than the device holds fails, and the chain runs instead
            f.set_attribute(
                cudarc::driver::sys::CUfunction_attribute_enum::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                smem as i32,
            )
            .map_err(|e| gerr("asking for the persistent step's shared memory", e))?;
        }
        let per = f
            .occupancy_max_active_blocks_per_multiprocessor(
                32 * ONE_WARPS as u32,
                smem as usize,
                None,
            )
            .map_err(|e| gerr("reading the persistent step's occupancy", e))?;
        if per < 1 {
            return Ok(0);
        }
        blocks = blocks.min(per as usize);
    }
    Ok(sms * blocks)
}

/// The persistent step's dynamic shared memory: decode attention's, then
/// `MOELANE_CUDA_PERSIST_SMEM` bytes more (a measuring aid: the kernel stages the picked
/// experts' rows there, as far as they fit, and reads its size from `%dynamic_smem_size`;
/// measured slower than without, docs/PERFORMANCE.md). At most 227 KiB in all.
fn one_smem(head_dim: usize) -> u32 {
    let base = (ONE_WARPS + 3) * head_dim * 4;
    static EXTRA: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let extra = *EXTRA.get_or_init(|| {
        std::env::var("MOELANE_CUDA_PERSIST_SMEM")
            .ok()
            .and_then(|v| v.parse::<usize>().ok())
            .unwrap_or(0)
    });
    (base + extra).min(227 * 1024) as u32
}

impl GpuModel {
    /// Why this model's layers can never take the persistent step (None: they can, layer by
    /// layer as [`Self::persist_layer`] says).
    pub(super) fn persist_unfit(&self) -> Option<&'static str> {
        let c = &self.cfg;
        if c.mla.is_some() {
            Some("multi-head latent attention")
        } else if c.routing != Routing::Softmax {
            Some("sigmoid routing")
        } else if c.expert_bias || c.expert_glu != crate::config::Glu::Silu {
            Some("expert biases or a clamped activation")
        } else if c.num_experts > TOPK_REG * 32 || c.num_experts_per_tok > 32 {
            Some("more experts than the register top-k holds")
        } else if c.head_dim > 128
            || c.num_key_value_heads == 0
            || !c.num_attention_heads.is_multiple_of(c.num_key_value_heads)
        {
            Some("a head shape decode attention does not take")
        } else if !c.hidden_size.is_multiple_of(8)
            || !c.moe_intermediate_size.is_multiple_of(8)
            || !c.q_dim().is_multiple_of(4)
            || c.o_dim() != c.q_dim()
        {
            Some("widths that are not multiples of 8")
        } else if self.one_grid == 0 {
            Some("no SM holds one of its blocks")
        } else {
            None
        }
    }

    /// Whether decoder layer `l` (MoE layer `ml`) can run inside the persistent step.
    fn persist_layer(&self, l: usize, ml: usize) -> bool {
        let Some(lw) = self.layers.get(l) else {
            return false;
        };
        let Some(router) = &lw.router else {
            return false;
        };
        let Some(edt) = self.expert_dt.get(ml).copied().flatten() else {
            return false;
        };
        matches!(edt, Wdt::F32 | Wdt::Bf16)
            && lw.qkv.dt == edt
            && lw.o.dt == edt
            && router.dt == edt
            && lw.mla.is_none()
            && lw.qkv_bias.is_none()
            && lw.o_bias.is_none()
            && lw.router_logit_bias.is_none()
            && lw.router_bias.is_none()
            && lw.shared.is_none()
            && lw.mlp.is_none()
    }

    /// `ops` with every run of whole MoE layers the persistent step can take folded into
    /// one [`Op::StepOne`], when this step can take it at all (one decode row, the switch
    /// on, no hollow diagnostic, the layer table built: the model fit at load); None: run
    /// `ops` as they are.
    pub(super) fn fold_persistent(&self, ops: &[Op]) -> Option<Vec<Op>> {
        if !self.persist
            || self.n != 1
            || !self.decode_only
            || !self.hollow.is_empty()
            || !self.register_topk
            || self.one_lay.is_none()
        {
            return None;
        }
        // one layer at ops[i..]: (decoder layer, MoE layer, ops it takes)
        let layer_at = |i: usize| -> Option<(usize, usize, usize)> {
            match ops.get(i..i + 3)? {
                [Op::Attention(l), Op::Route(l2, ml), Op::MoeOne(ml2)]
                    if l == l2 && ml == ml2 && self.persist_layer(*l, *ml) =>
                {
                    Some((*l, *ml, 3))
                }
                [Op::Attention(l), Op::Route(l2, ml), Op::Moe(ml2)]
                    if l == l2
                        && ml == ml2
                        && matches!(ops.get(i + 3), Some(Op::Combine(_)))
                        && self.persist_layer(*l, *ml) =>
                {
                    Some((*l, *ml, 4))
                }
                _ => None,
            }
        };
        let mut out = Vec::with_capacity(ops.len());
        let mut folded = false;
        let mut i = 0;
        while i < ops.len() {
            let Some((l0, ml0, mut take)) = layer_at(i) else {
                out.push(ops[i].clone());
                i += 1;
                continue;
            };
            let mut count = 1;
            while let Some((l, ml, t)) = layer_at(i + take) {
                if l != l0 + count || ml != ml0 + count {
                    break;
                }
                take += t;
                count += 1;
            }
            out.push(Op::StepOne(l0, count, ml0));
            folded = true;
            i += take;
        }
        folded.then_some(out)
    }

    /// The kernel's layer table: per decoder layer its weights, norms, cache and expert
    /// tables (zeros for a layer the step never takes). Built once: none of these move.
    pub(super) fn one_layers(&self) -> Result<Buf<u64>> {
        let c = &self.cfg;
        let ne = c.num_experts;
        let moe_of: HashMap<usize, usize> = c
            .moe_layers()
            .into_iter()
            .enumerate()
            .map(|(ml, l)| (l, ml))
            .collect();
        let mut t = vec![0u64; self.layers.len() * ONE_FIELDS];
        for (l, lw) in self.layers.iter().enumerate() {
            let (Some(&ml), Some(router)) = (moe_of.get(&l), &lw.router) else {
                continue;
            };
            let e = &mut t[l * ONE_FIELDS..(l + 1) * ONE_FIELDS];
            let window = c.windows.get(l).copied().flatten().unwrap_or(0);
            e.copy_from_slice(&[
                lw.qkv.p,
                lw.input_norm.p,
                if lw.qk_norm { lw.q_norm.p } else { 0 },
                if lw.qk_norm { lw.k_norm.p } else { 0 },
                self.kc[l].p,
                self.vc[l].p,
                lw.o.p,
                lw.post_norm.p,
                router.p,
                self.tab_gu.p + (8 * ml * ne) as u64,
                self.tab_dn.p + (8 * ml * ne) as u64,
                lw.sinks.as_ref().map_or(0, |b| b.p),
                window as u64,
            ]);
        }
        Buf::from_host(&self.st, &t)
    }

    /// Decoder layers `l0..l0 + count` (MoE layers from `ml0`) of the step's one row as the
    /// persistent kernel.
    pub(super) fn step_one(&mut self, l0: usize, count: usize, ml0: usize) -> Result<()> {
        let c = &self.cfg;
        let lay = self
            .one_lay
            .as_ref()
            .ok_or_else(|| Error::Internal("the persistent step has no layer table".into()))?;
        let edt = self
            .expert_dt
            .get(ml0)
            .copied()
            .flatten()
            .ok_or_else(|| Error::Internal(format!("MoE layer {ml0} has no expert dtype")))?;
        let k = c.num_experts_per_tok;
        let mut a = args::StepOne {
            lay: lay.p + (8 * ONE_FIELDS * l0) as u64,
            nl: count as i32,
            x: self.x.p,
            qkv: self.qkv.p,
            att: self.att.p,
            part: self.att_part.p,
            h: self.h.p,
            rlog: self.rlog.p,
            act: self.act.p,
            idx: self.idx.p + (4 * ml0 * k) as u64,
            wts: self.wts.p,
            cos_t: self.cos.p,
            sin_t: self.sin.p,
            row_pos: self.o_pos,
            row_tab: self.o_tab,
            blocks: self.o_blocks,
            bar: self.one_bar.p,
            hid: c.hidden_size as i32,
            nh: c.num_attention_heads as i32,
            nkv: c.num_key_value_heads as i32,
            hd: c.head_dim as i32,
            rd: c.rotary_dim as i32,
            experts: c.num_experts as i32,
            k: k as i32,
            inter: c.moe_intermediate_size as i32,
            eps: c.rms_norm_eps,
            scale: c.attention_scale,
            norm: c.norm_topk_prob as i32,
            splits: self.splits as i32,
        };
        let cfg = LaunchConfig {
            grid_dim: (self.one_grid as u32, 1, 1),
            block_dim: (32 * ONE_WARPS as u32, 1, 1),
            shared_mem_bytes: one_smem(c.head_dim),
        };
        let f = self.f.step_one.of(edt);
        // SAFETY: the layer table holds ONE_FIELDS words for every decoder layer, built from
        // this model's buffers (`one_layers`), and layers l0..l0+count are MoE layers
        // `persist_layer` accepted (their dense matrices and experts of edt, the experts'
        // tables E entries each; null entries add nothing); the scratch is sized for this
        // step's one row (`begin`): qkv, att and att_part (splits partials per head), h,
        // rlog E floats, act k * I, idx the MoE layers' k picks each from ml0, wts k; the
        // position and block table were checked in `begin`; bar is ONE_BAR_WORDS words, its
        // two counters at 0 between launches (the kernel's last block sets them back); the
        // grid is as many blocks an SM as occupancy allows (`one_grid`), launched
        // cooperatively, so every block is resident at once.
        if let Err(e) = unsafe { launch_coop(&self.st, f, &mut a.params(), cfg) } {
            // a device that will not hold the whole grid at once (an MPS share of its SMs,
            // say): the chain from now on, this span included
            eprintln!(
                "moelane: the persistent step could not be launched ({e:?}); the chain of \
                 kernels runs from now on"
            );
            self.persist = false;
            self.one_grid = 0;
            self.drop_graphs();
            for i in 0..count {
                self.attention(l0 + i)?;
                self.route(l0 + i, ml0 + i)?;
                self.moe(ml0 + i, false)?;
                self.combine(Some((l0 + i, ml0 + i)))?;
            }
            return Ok(());
        }
        self.mark("step_one")
    }
}

/// The persistent step's counter words: the barrier's two, then (kernels built with
/// `ONE_TRACE`) 16 u64 of phase times and counts.
pub(super) const ONE_BAR_WORDS: usize = 2 + 2 * 16;

/// A cooperative launch (every block resident at once, or the launch fails): the grid
/// barriers of kernels/step_one.cu need it.
///
/// # Safety
/// As [`launch_raw`]: `params` must match `f`'s signature.
unsafe fn launch_coop(
    st: &Arc<CudaStream>,
    f: &CudaFunction,
    params: &mut [*mut std::ffi::c_void],
    cfg: LaunchConfig,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    // SAFETY: a zeroed launch attribute is a valid value of the C struct
    let mut attr: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_COOPERATIVE;
    attr.value.cooperative = 1;
    // SAFETY: the caller's (params match f)
    unsafe { launch_ex(st, f, params, std::slice::from_mut(&mut attr), cfg) }
}
