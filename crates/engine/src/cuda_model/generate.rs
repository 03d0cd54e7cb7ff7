//! Generated weights and probes on the device: the `station` preset's experts made from
//! their seed on the GPU (the same bits as the CPU's [`crate::synth::hashed_expert`]), the
//! read-bandwidth probe that sets a decode step's roofline, and the kernels a sidecar's
//! [`crate::cuda_experts::GpuExperts`] borrows from the step module.

use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaStream};

use super::*;

/// Generates expert `e` of MoE layer `layer` of a hashed model on `gpu` (bit-identical to
/// [`crate::synth::hashed_expert`]): `(gate_up [2I, H], down [H, I])`.
#[allow(clippy::too_many_arguments)]
pub fn gen_expert(
    st: &Arc<CudaStream>,
    f: &CudaFunction,
    seed: u64,
    layer: usize,
    e: usize,
    hidden: usize,
    inter: usize,
) -> Result<(Buf<f32>, Buf<f32>)> {
    let (gs, ds) = crate::synth::hashed_scales(hidden, inter);
    let gu = Buf::<f32>::zeros(st, 2 * inter * hidden)?;
    let dn = Buf::<f32>::zeros(st, hidden * inter)?;
    let z = crate::synth::HASHED_ZERO as i32;
    for (b, cols, zc, zr, key, scale) in [
        (
            &gu,
            hidden,
            z,
            0,
            crate::synth::hashed_key(seed, layer, e, 0),
            gs,
        ),
        (
            &dn,
            inter,
            0,
            z,
            crate::synth::hashed_key(seed, layer, e, 1),
            ds,
        ),
    ] {
        let n = (b.len) as u64;
        let cols = cols as i32;
        let mut a = args::GenWeights {
            w: b.p,
            n,
            cols,
            zero_cols: zc,
            zero_rows: zr,
            key,
            scale,
        };
        // SAFETY: `b` holds exactly n floats; the kernel writes w[0..n).
        unsafe { launch_raw(st, f, &mut a.params(), false, grid(1024, 1, 256, 0)) }
            .map_err(|e| gerr("launching gen_weights", e))?;
    }
    Ok((gu, dn))
}

/// Memory bandwidth of `gpu` measured two ways over `bytes`-sized buffers, medians of
/// `reps`: (device-to-device copy, bytes read + written per second; a read-only kernel,
/// bytes read per second). The second is the roofline of a decode step, which reads weights.
pub fn bandwidth(gpu: &Gpu, bytes: usize, reps: usize) -> Result<(f64, f64)> {
    let st = &gpu.stream;
    let n = (bytes / 16).max(1) * 4;
    let a = Buf::<f32>::zeros(st, n)?;
    let mut b = st
        .alloc_zeros::<f32>(n)
        .map_err(|e| gerr("allocating the bandwidth probe", e))?;
    let out = Buf::<f32>::zeros(st, 132 * 8)?;
    let f = funcs(gpu)?.read_probe;
    let sync = || st.synchronize().map_err(|e| gerr("synchronising", e));
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    let (mut copy, mut read) = (Vec::new(), Vec::new());
    for r in 0..reps.max(1) + 1 {
        let t0 = std::time::Instant::now();
        st.memcpy_dtod(&a.s, &mut b)
            .map_err(|e| gerr("copying on the GPU", e))?;
        sync()?;
        let tc = t0.elapsed().as_secs_f64();
        let n4 = (n / 4) as u64;
        let t0 = std::time::Instant::now();
        let mut probe = args::ReadProbe {
            a: a.p,
            n4,
            out: out.p,
        };
        // SAFETY: a holds n4 float4s; out 132*8 floats, one per block.
        unsafe { launch_raw(st, &f, &mut probe.params(), false, grid(132 * 8, 1, 256, 0)) }
            .map_err(|e| gerr("launching read_probe", e))?;
        sync()?;
        let tr = t0.elapsed().as_secs_f64();
        if r > 0 {
            copy.push(2.0 * (n * 4) as f64 / tc);
            read.push((n * 4) as f64 / tr);
        }
    }
    Ok((median(copy), median(read)))
}

/// The grouped MoE kernels (`moe_up`, `moe_down`) of the dense module on `gpu`, for a
/// sidecar's [`crate::cuda_experts::GpuExperts`]: (up, down) on f32, bf16 and FP8 weights,
/// then the same with the experts' biases and gpt_oss's activation (`moe_up_x`, ...).
pub fn moe_kernels(gpu: &Gpu) -> Result<[(CudaFunction, CudaFunction); 6]> {
    let f = funcs(gpu)?;
    Ok([
        (f.moe_up.f32, f.moe_down.f32),
        (f.moe_up.bf16, f.moe_down.bf16),
        (f.moe_up_f8, f.moe_down_f8),
        (f.moe_up_x.f32, f.moe_down_x.f32),
        (f.moe_up_x.bf16, f.moe_down_x.bf16),
        (f.moe_up_x_f8, f.moe_down_x_f8),
    ])
}

/// Loads the dense kernels' module on `gpu` and returns the generator kernel (for a sidecar
/// that generates its experts).
pub fn gen_kernel(gpu: &Gpu) -> Result<CudaFunction> {
    Ok(funcs(gpu)?.gen)
}
