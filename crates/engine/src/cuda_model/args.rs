//! Every kernel's parameters as a struct: one field per parameter of its `.cu` signature, in
//! order, each of the Rust twin of the C type (`u64` for a device pointer or an `unsigned long
//! long`, `i32` for an `int`, `f32` for a `float`; a null pointer is 0). Every launch goes
//! through [`super::launch_raw`] with `args.params()`, so a call site names what it passes and
//! the compiler checks each type.

use std::ffi::c_void;

macro_rules! kernel_args {
    ($(#[$m:meta])* $name:ident { $($field:ident : $ty:ty),* $(,)? }) => {
        $(#[$m])*
        #[derive(Clone, Copy, Debug)]
        pub(crate) struct $name {
            $(pub $field: $ty),*
        }

        impl $name {
            const COUNT: usize = <[&str]>::len(&[$(stringify!($field)),*]);

            /// A pointer to each field, in the kernel's parameter order (read by the launch).
            pub(crate) fn params(&mut self) -> [*mut c_void; Self::COUNT] {
                [$(&mut self.$field as *mut $ty as *mut c_void),*]
            }
        }
    };
}

kernel_args! {
    /// `embed_rows` (norm.cu): x[r] = emb[tok[r]].
    EmbedRows { emb: u64, tok: u64, x: u64, h: i32 }
}

kernel_args! {
    /// `rmsnorm_rows` (norm.cu): y[r] = norm(x[rows ? rows[r] : r]) * w.
    RmsnormRows { x: u64, rows: u64, w: u64, y: u64, h: i32, eps: f32 }
}

kernel_args! {
    /// `gemv_rows` (gemv.cu): y[n, out] = x[n, in] . w^T (+ beta * y).
    Gemv {
        w: u64, x: u64, y: u64, out: i32, inp: i32, n: i32, beta: f32,
        vec4: i32, prefetch: i32, preload: i32,
    }
}

kernel_args! {
    /// `norm_gemv_rows` (gemv.cu): y = w . norm(x) with weight nw, the normed rows to h.
    NormGemv {
        w: u64, x: u64, nw: u64, h: u64, y: u64, out: i32, inp: i32, n: i32, eps: f32,
        vec4: i32, prefetch: i32, preload: i32,
    }
}

kernel_args! {
    /// `split_bf16` (gemv.cu): each row of x as three bf16 rows of xs summing to it.
    SplitBf16 { x: u64, xs: u64, inp: i32 }
}

kernel_args! {
    /// `gemv_rows_f8` (gemv.cu): y[n, out] = x[n, in] . w^T (+ beta * y) on FP8 weights with
    /// b0 x b1 block scales s, n <= 4.
    GemvF8 {
        w: u64, s: u64, x: u64, y: u64, out: i32, inp: i32, n: i32, beta: f32, b0: i32, b1: i32,
    }
}

kernel_args! {
    /// `dequant_f8` (gemv.cu): y = an FP8 matrix [rows, cols] widened and scaled.
    DequantF8 { w: u64, s: u64, y: u64, rows: i64, cols: i32, b0: i32, b1: i32 }
}

kernel_args! {
    /// `round_bf16` (gemv.cu): y[i] = bf16(x[i]), rounded to nearest even, i < n.
    RoundBf16 { x: u64, y: u64, n: i64 }
}

kernel_args! {
    /// `sum3_rows` (gemv.cu): y[r] = beta * y[r] + c[3r] + c[3r+1] + c[3r+2].
    Sum3Rows { c: u64, y: u64, out: i32, beta: f32 }
}

kernel_args! {
    /// `qk_rope_kv` (attention.cu): q/k norm, RoPE, K/V into the paged cache.
    QkRopeKv {
        qkv: u64, qn: u64, kn: u64, cos_t: u64, sin_t: u64, row_pos: u64, row_tab: u64,
        blocks: u64, kc: u64, vc: u64, nh: i32, nkv: i32, hd: i32, eps: f32, rd: i32,
    }
}

kernel_args! {
    /// `attention` and `attention_tiled` (attention.cu): online softmax over the paged cache
    /// (per-head sink logits when `sinks` is not 0; a sliding window when `window` > 0).
    Attention {
        qkv: u64, kc: u64, vc: u64, row_pos: u64, row_tab: u64, blocks: u64, tiles: u64,
        out: u64, nh: i32, nkv: i32, hd: i32, scale: f32, sinks: u64, window: i32,
    }
}

kernel_args! {
    /// `attention_decode` (attention.cu): norm, RoPE, K/V write and attention of decode rows.
    AttentionDecode {
        qkv: u64, qn: u64, kn: u64, cos_t: u64, sin_t: u64, kc: u64, vc: u64, row_pos: u64,
        row_tab: u64, blocks: u64, out: u64, nh: i32, nkv: i32, hd: i32, eps: f32,
        scale: f32, part: u64, rd: i32, sinks: u64, window: i32,
    }
}

kernel_args! {
    /// `attention_merge` (attention.cu): the split ranges' partials into one row.
    AttentionMerge { part: u64, out: u64, nh: i32, hd: i32, splits: i32, sinks: u64 }
}

kernel_args! {
    /// `mla_prep` (mla.cu): the q bottleneck's norm, the latent's norm and the key's RoPE into
    /// the latent cache.
    MlaPrep {
        tq: u64, qa_norm: u64, q_lora: i32, ckv: u64, kv_norm: u64, cos_t: u64, sin_t: u64,
        row_pos: u64, row_tab: u64, blocks: u64, kc: u64, r: i32, rope: i32, interleave: i32,
    }
}

kernel_args! {
    /// `head_gemv` (mla.cu): a product per head with the head's own matrix.
    HeadGemv { w: u64, x: u64, y: u64, inp: i32, out: i32, xs: i32, xh: i32, ys: i32 }
}

kernel_args! {
    /// `mla_attend` (mla.cu): absorbed attention of one (row, head) over the latent cache.
    MlaAttend {
        q_lat: u64, q: u64, cos_t: u64, sin_t: u64, kc: u64, row_pos: u64, row_tab: u64,
        blocks: u64, lat: u64, heads: i32, r: i32, rope: i32, nope: i32, interleave: i32,
        scale: f32,
    }
}

kernel_args! {
    /// `route_topk` (routing.cu): the router's softmax and top-k per row.
    RouteTopk {
        logits: u64, idx: u64, wts: u64, experts: i32, k: i32, norm: i32, regs: i32, gidx: u64,
        gwts: u64,
    }
}

kernel_args! {
    /// `route_sigmoid` (routing.cu): the sigmoid router's grouped choice and weights per row.
    RouteSigmoid {
        logits: u64, bias: u64, idx: u64, wts: u64, experts: i32, k: i32, norm: i32,
        n_group: i32, topk_group: i32, scale: f32,
    }
}

kernel_args! {
    /// `moe_up` (moe.cu): act = silu(gate . h) * (up . h) per pick; with `gb_tab` the experts'
    /// gate_up biases, with `limit` > 0 gpt_oss's clamped activation.
    MoeUp {
        idx: u64, gu_tab: u64, h: u64, act: u64, nk: i32, k: i32, hidden: i32, inter: i32,
        vec4: i32, rows: u64, distinct: i32, gs_tab: u64, b0: i32, b1: i32, gb_tab: u64,
        alpha: f32, limit: f32,
    }
}

kernel_args! {
    /// `moe_down` and `moe_down_pre` (moe.cu): y = down . act per pick (FP8: `ds_tab` the
    /// experts' block scales, blocks of b0 x b1; 0 otherwise).
    MoeDown {
        idx: u64, dn_tab: u64, act: u64, y: u64, nk: i32, hidden: i32, inter: i32, vec4: i32,
        distinct: i32, ds_tab: u64, b0: i32, b1: i32, db_tab: u64,
    }
}

kernel_args! {
    /// `norm_gemv_route` (gemv.cu): the router's product on normed rows and its softmax
    /// top-k, routed by the last block to finish.
    NormGemvRoute {
        w: u64, x: u64, nw: u64, h: u64, y: u64, out: i32, inp: i32, n: i32, eps: f32,
        vec4: i32, prefetch: i32, preload: i32, idx: u64, wts: u64, k: i32, norm: i32,
        done: u64,
    }
}

kernel_args! {
    /// `moe_down_one` (moe.cu): a single row's down-projections and combine, x += the
    /// picks' outputs weighted.
    MoeDownOne {
        idx: u64, dn_tab: u64, act: u64, y: u64, x: u64, wts: u64, k: i32, hidden: i32,
        inter: i32, vec4: i32,
    }
}

kernel_args! {
    /// `scatter_rows` (moe.cu): y[slots[i]] = src[i].
    ScatterRows { src: u64, slots: u64, y: u64, h: i32 }
}

kernel_args! {
    /// `moe_combine` (moe.cu): x += the picks' outputs weighted, in rank order.
    MoeCombine {
        x: u64, y: u64, wts: u64, k: i32, h: i32, gidx: u64, gu_tab: u64, dn_tab: u64, gk: i32,
        gu_bytes: u64, dn_bytes: u64,
    }
}

kernel_args! {
    /// `silu_mul` (moe.cu): a = silu(gate) * up of the dense MLP.
    SiluMul { gu: u64, a: u64, inter: i32 }
}

kernel_args! {
    /// `bias_rows` (moe.cu): y[r] += b.
    BiasRows { y: u64, b: u64, dim: i32 }
}

kernel_args! {
    /// `sigmoid_scale_rows` (moe.cu): a[r] *= sigmoid(g[r]).
    SigmoidScaleRows { a: u64, g: u64, inter: i32 }
}

kernel_args! {
    /// `argmax_rows` (sampling.cu): the greedy token of each row.
    ArgmaxRows { logits: u64, out: u64, vocab: i32 }
}

kernel_args! {
    /// `sample_rows` (sampling.cu): temperature, top-k and top-p sampling per row.
    SampleRows { logits: u64, spec: u64, probs: u64, out: u64, vocab: i32 }
}

kernel_args! {
    /// `gen_weights` (generator.cu): a hashed weight tensor, generated on the device.
    GenWeights { w: u64, n: u64, cols: i32, zero_cols: i32, zero_rows: i32, key: u64, scale: f32 }
}

kernel_args! {
    /// `read_probe` (generator.cu): reads n4 float4s (the bandwidth probe).
    ReadProbe { a: u64, n4: u64, out: u64 }
}

kernel_args! {
    /// `expert_swiglu` (experts.cu): one block per pick, the whole expert.
    ExpertSwiglu { acts: u64, rows: u64, gate_up: u64, down: u64, out: u64, hidden: i32, inter: i32 }
}

kernel_args! {
    /// `hollow_step` (norm.cu): no parameters, no work (the diagnostics' empty kernel).
    Hollow {}
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn params_point_at_each_field_in_order() {
        let mut a = ScatterRows {
            src: 1,
            slots: 2,
            y: 3,
            h: 4,
        };
        let p = a.params();
        assert_eq!(p.len(), 4);
        // SAFETY: each pointer addresses the field of its type, in declaration order.
        unsafe {
            assert_eq!(*(p[0] as *const u64), 1);
            assert_eq!(*(p[2] as *const u64), 3);
            assert_eq!(*(p[3] as *const i32), 4);
        }
        assert_eq!(Hollow {}.params().len(), 0);
    }
}

kernel_args! {
    /// `step_one` (step_one.cu): decoder layers of one decode row as one persistent kernel.
    StepOne {
        lay: u64, nl: i32, x: u64, qkv: u64, att: u64, part: u64, h: u64, rlog: u64, act: u64,
        idx: u64, wts: u64, cos_t: u64, sin_t: u64, row_pos: u64, row_tab: u64, blocks: u64,
        bar: u64, hid: i32, nh: i32, nkv: i32, hd: i32, rd: i32, experts: i32, k: i32,
        inter: i32, eps: f32, scale: f32, norm: i32, splits: i32,
    }
}
