//! The primary's decode step on the GPU (feature `cuda`): dense weights, the KV cache, the
//! hidden state, the router's top-k and the hot experts all live on the device; a step
//! uploads one small table (tokens, positions, block tables) and downloads the logits (or
//! only the argmax ids) and the step's picks for the counters. Nothing allocates in a warm
//! step: scratch buffers only grow.
//!
//! Dense products go through cuBLAS (f32, no TF32, so the GPU agrees with the CPU backend to
//! rounding); everything else is the step kernels of `kernels/` ([`DENSE_CU`]), compiled by NVRTC at start. The MoE
//! layer reads each picked expert's weights once per step however many rows picked it
//! (one block per (expert, chunk of rows)). Where the map puts experts on a cold tier, the
//! primary downloads the router's picks and the normed activations of that layer (the only
//! synchronisation inside a step), sends the cold picks, computes the hot ones meanwhile,
//! and scatters the reply into the pick slots; a layer whose map has no cold expert never
//! synchronises.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::cublas::{sys as blas, CudaBlas};
use cudarc::driver::{
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, ValidAsZeroBits,
};

use crate::bank::ExpertBank;
use crate::checkpoint::ExpertWeights;
use crate::config::{Glu, ModelConfig, Routing};
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::kv::{SeqKv, BLOCK};
use crate::model::DenseWeights;
use crate::ops::Rope;
use crate::rowmap::{Tier, ValidMap};
use crate::sampling::TokenPick;
use crate::step::RowPos;

/// The step kernels' source, compiled at run time as one NVRTC module: the files of
/// `kernels/` by family, in this order (later files use the common reductions and PDL macros).
pub const DENSE_CU: &str = concat!(
    include_str!("../../../../kernels/common.cu"),
    include_str!("../../../../kernels/norm.cu"),
    include_str!("../../../../kernels/attention.cu"),
    include_str!("../../../../kernels/mla.cu"),
    include_str!("../../../../kernels/routing.cu"),
    include_str!("../../../../kernels/gemv.cu"),
    include_str!("../../../../kernels/moe.cu"),
    include_str!("../../../../kernels/sampling.cu"),
    include_str!("../../../../kernels/generator.cu"),
    include_str!("../../../../kernels/step_one.cu"),
);

/// The files [`DENSE_CU`] is made of, in its order.
const DENSE_FILES: &[&str] = &[
    "common.cu",
    "norm.cu",
    "attention.cu",
    "mla.cu",
    "routing.cu",
    "gemv.cu",
    "moe.cu",
    "sampling.cu",
    "generator.cu",
    "step_one.cu",
];

pub(crate) mod args;
mod generate;
mod launch;
mod link_ops;

mod step;
mod step_one;
mod step_ops;
pub use generate::*;

pub use step::{attach_gpu, GpuStep};
pub(crate) use step_ops::glu_params;

/// Launches `f` on `st` with `params` (pointers to the arguments' values, which must match
/// the kernel's parameters). With `pdl`, as a programmatic dependent launch (Hopper and
/// later): the kernel may be scheduled while its predecessor drains; every kernel of
/// every step kernel waits for its predecessor (`griddepcontrol.wait`) before touching memory, so the
/// order of effects is the stream's.
///
/// # Safety
/// The parameters must match the kernel's signature and every pointer they carry must be
/// valid for what the kernel reads and writes.
pub(crate) unsafe fn launch_raw(
    st: &Arc<CudaStream>,
    f: &CudaFunction,
    params: &mut [*mut std::ffi::c_void],
    pdl: bool,
    cfg: LaunchConfig,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let attrs: &mut [sys::CUlaunchAttribute] = if pdl {
        std::slice::from_mut(&mut attr)
    } else {
        &mut []
    };
    launch_ex(st, f, params, attrs, cfg)
}

/// As [`launch_raw`], with the launch attributes `attrs`.
///
/// # Safety
/// As [`launch_raw`].
pub(crate) unsafe fn launch_ex(
    st: &Arc<CudaStream>,
    f: &CudaFunction,
    params: &mut [*mut std::ffi::c_void],
    attrs: &mut [cudarc::driver::sys::CUlaunchAttribute],
    cfg: LaunchConfig,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    st.context().bind_to_thread()?;
    let lc = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: st.cu_stream(),
        attrs: if attrs.is_empty() {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        numAttrs: attrs.len() as u32,
    };
    sys::cuLaunchKernelEx(
        &lc,
        f.cu_function(),
        params.as_mut_ptr(),
        std::ptr::null_mut(),
    )
    .result()
}

/// A switch that is on unless the environment sets it to "0".
fn env_on(name: &str) -> bool {
    std::env::var(name).map_or(true, |v| v != "0")
}

/// How a [`GpuModel`] runs its steps: every switch on by default. The `MOELANE_CUDA_*`
/// environment variables override them, read once, here ([`GpuOptions::from_env`]).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GpuOptions {
    /// Replay runs of kernels as CUDA graphs (`MOELANE_CUDA_GRAPHS=0`: launch each kernel).
    pub graphs: bool,
    /// Programmatic dependent launches on compute capability 9.0 and later
    /// (`MOELANE_CUDA_PDL=0`).
    pub pdl: bool,
    /// Small-batch products ask the L2 for their weights before their wait
    /// (`MOELANE_CUDA_PREFETCH=0`).
    pub prefetch: bool,
    /// Prefill attention a tile of rows per block (`MOELANE_CUDA_TILED_PREFILL=0`).
    pub tiled_prefill: bool,
    /// Decode attention split into position ranges on long contexts
    /// (`MOELANE_CUDA_ATTN_SPLIT=0`).
    pub split_attention: bool,
    /// Weight rows loaded into registers before the wait, up to 4 rows
    /// (`MOELANE_CUDA_PRELOAD=0`).
    pub preload: bool,
    /// Kernels fused at small batches (`MOELANE_CUDA_FUSE=1`; off by default until they
    /// are measured on a GPU; the same sums either way): up to 4 rows, the router's product
    /// and its top-k in one; a single row, the MoE down-projection and the combine when
    /// every pick is on this GPU.
    pub fuse: bool,
    /// A single decode row's MoE layers as one persistent kernel (`step_one`) where the
    /// layers allow it (`MOELANE_CUDA_PERSIST=1`; off by default: the chain of kernels, the
    /// same sums, measured faster).
    pub persist: bool,
    /// A single decode row's router also guesses the next MoE layer's picks (that layer's
    /// router on this layer's normed row), and the combine asks the L2 for the most probable
    /// guessed expert's bytes, so they move while the next layer's attention runs
    /// (`MOELANE_CUDA_GUESS=1`; off by default: measured no faster, see `GUESS_PREFETCH`).
    /// The picks and the sums are the same either way.
    pub guess: bool,
    /// Step kernels launched hollow, a diagnostic (`MOELANE_CUDA_HOLLOW`, see
    /// [`GpuModel::set_hollow`]); empty in serving.
    pub hollow: Vec<String>,
    /// The dtype weight matrices are kept in on the device (`MOELANE_CUDA_WEIGHTS`):
    /// the checkpoint's own by default; the other two are for benchmarks.
    pub weights: WeightMode,
}

/// How a [`GpuModel`] keeps weight matrices (`MOELANE_CUDA_WEIGHTS=stored|f32|bf16`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WeightMode {
    /// bf16 as stored, every other dtype widened to f32 (the default)
    Stored,
    /// everything widened to f32 (twice the memory of bf16: the comparison benches make)
    F32,
    /// f32 matrices rounded to bf16 at upload, generated experts too: a generated model
    /// (`station`) read at bf16's bytes; its outputs differ from the f32 model's
    Bf16,
}

impl WeightMode {
    fn from_env() -> WeightMode {
        match std::env::var("MOELANE_CUDA_WEIGHTS").as_deref() {
            Ok("f32") => WeightMode::F32,
            Ok("bf16") => WeightMode::Bf16,
            Ok("stored") | Err(_) => WeightMode::Stored,
            Ok(other) => {
                eprintln!(
                    "moelane: MOELANE_CUDA_WEIGHTS={other:?} is not stored, f32 or bf16: \
                     weights kept as stored"
                );
                WeightMode::Stored
            }
        }
    }
}

impl Default for GpuOptions {
    fn default() -> Self {
        GpuOptions {
            graphs: true,
            pdl: true,
            prefetch: true,
            tiled_prefill: true,
            split_attention: true,
            preload: true,
            fuse: false,
            persist: false,
            guess: false,
            hollow: Vec::new(),
            weights: WeightMode::Stored,
        }
    }
}

impl GpuOptions {
    /// The defaults with the environment's overrides.
    pub fn from_env() -> Self {
        GpuOptions {
            graphs: env_on("MOELANE_CUDA_GRAPHS"),
            pdl: env_on("MOELANE_CUDA_PDL"),
            prefetch: env_on("MOELANE_CUDA_PREFETCH"),
            tiled_prefill: env_on("MOELANE_CUDA_TILED_PREFILL"),
            split_attention: env_on("MOELANE_CUDA_ATTN_SPLIT"),
            preload: env_on("MOELANE_CUDA_PRELOAD"),
            fuse: std::env::var("MOELANE_CUDA_FUSE").is_ok_and(|v| v == "1"),
            persist: std::env::var("MOELANE_CUDA_PERSIST").is_ok_and(|v| v == "1"),
            guess: std::env::var("MOELANE_CUDA_GUESS").is_ok_and(|v| v == "1"),
            hollow: std::env::var("MOELANE_CUDA_HOLLOW")
                .map(|v| hollow_list(&v))
                .unwrap_or_default(),
            weights: WeightMode::from_env(),
        }
    }
}

fn gerr(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Gpu(format!("{what}: {e:?}"))
}

/// A device buffer and its address (event tracking is off: one stream orders everything).
pub struct Buf<T> {
    s: CudaSlice<T>,
    pub p: u64,
    pub len: usize,
}

impl<T: DeviceRepr + ValidAsZeroBits> Buf<T> {
    pub fn zeros(st: &Arc<CudaStream>, n: usize) -> Result<Self> {
        let s = st
            .alloc_zeros::<T>(n.max(1))
            .map_err(|e| gerr(&format!("allocating {n} elements on the GPU"), e))?;
        let p = {
            let (p, _g) = s.device_ptr(st);
            p
        };
        Ok(Buf {
            p,
            len: n.max(1),
            s,
        })
    }

    pub fn from_host(st: &Arc<CudaStream>, data: &[T]) -> Result<Self> {
        let s = st
            .clone_htod(data)
            .map_err(|e| gerr("uploading to the GPU", e))?;
        let p = {
            let (p, _g) = s.device_ptr(st);
            p
        };
        Ok(Buf {
            p,
            len: data.len().max(1),
            s,
        })
    }

    /// At least `n` elements (contents not kept); true when it moved.
    pub fn grow(&mut self, st: &Arc<CudaStream>, n: usize) -> Result<bool> {
        if self.len < n {
            *self = Buf::zeros(st, n.next_power_of_two())?;
            return Ok(true);
        }
        Ok(false)
    }

    pub fn write(&mut self, st: &Arc<CudaStream>, data: &[T]) -> Result<()> {
        if data.is_empty() {
            return Ok(());
        }
        self.grow(st, data.len())?;
        st.memcpy_htod(data, &mut self.s.slice_mut(..data.len()))
            .map_err(|e| gerr("copying to the GPU", e))
    }

    pub fn into_slice(self) -> CudaSlice<T> {
        self.s
    }

    pub fn read(&self, st: &Arc<CudaStream>, out: &mut [T]) -> Result<()> {
        st.memcpy_dtoh(&self.s.slice(..out.len()), out)
            .map_err(|e| gerr("copying from the GPU", e))
    }
}

/// The dtype a weight matrix is kept in on the device: bf16 checkpoints keep their 16 bits
/// (the kernels widen each weight as they read it, exactly); FP8 matrices keep their bytes
/// and block scales where four weights share a scale (the grouped MoE kernels and the dense
/// products dequantise them as they read; MLA's per-head stacks and the embedding are
/// widened); every other matrix (f16, f32) is widened to f32 at upload.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Wdt {
    F32,
    Bf16,
    /// FP8 e4m3 with one f32 scale per block
    F8,
}

impl Wdt {
    pub fn size(self) -> usize {
        match self {
            Wdt::F32 => 4,
            Wdt::Bf16 => 2,
            Wdt::F8 => 1,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Wdt::F32 => "f32",
            Wdt::Bf16 => "bf16",
            Wdt::F8 => "fp8",
        }
    }
}

/// A weight matrix's device address and dtype (what a product needs of it); FP8: its block
/// scales' address, the block shape and the element count (0 otherwise).
#[derive(Clone, Copy, Debug)]
pub(crate) struct W {
    pub p: u64,
    pub dt: Wdt,
    pub s: u64,
    pub b: [i32; 2],
    pub len: usize,
}

impl W {
    /// An f32 vector or matrix (a gate row, generated weights).
    pub fn f32(p: u64) -> W {
        W {
            p,
            dt: Wdt::F32,
            s: 0,
            b: [0, 0],
            len: 0,
        }
    }
}

/// A weight matrix on the device in the dtype it is kept in (see [`Wdt`]).
pub struct DevMat {
    store: DevStore,
    pub p: u64,
    pub dt: Wdt,
    pub len: usize,
}

enum DevStore {
    F32(#[allow(dead_code)] Buf<f32>),
    Bf16(#[allow(dead_code)] Buf<u16>),
    /// the bytes, the block scales (`scales.p` is what the kernels get), the block shape and
    /// the matrix's columns
    F8(Buf<u8>, Buf<f32>, [usize; 2], usize),
}

impl DevMat {
    /// Uploads `m` as `mode` says: bf16 as stored (unless F32), f32 rounded to bf16 (Bf16),
    /// anything else widened to f32.
    pub fn upload(
        st: &Arc<CudaStream>,
        m: &crate::ops::Matrix,
        mode: WeightMode,
    ) -> Result<DevMat> {
        match (&m.data, mode) {
            (crate::ops::Elems::Bf16(v), WeightMode::Stored | WeightMode::Bf16) => {
                let bits: Vec<u16> = v.iter().map(|b| b.0).collect();
                Ok(DevMat::of_bf16(Buf::from_host(st, &bits)?, v.len()))
            }
            (crate::ops::Elems::F32(v), WeightMode::Bf16) => {
                let bits: Vec<u16> = v
                    .iter()
                    .map(|&x| half::bf16::from_f32(x).to_bits())
                    .collect();
                Ok(DevMat::of_bf16(Buf::from_host(st, &bits)?, v.len()))
            }
            _ => Ok(DevMat::of_f32(
                Buf::from_host(st, &m.to_f32())?,
                m.data.len(),
            )),
        }
    }

    /// As [`DevMat::upload`], with `want` the dtype the caller's kernels take: f32 widens
    /// anything; bf16 takes only bf16 (narrowing would round the checkpoint's weights).
    pub fn upload_as(st: &Arc<CudaStream>, m: &crate::ops::Matrix, want: Wdt) -> Result<DevMat> {
        match (want, &m.data) {
            (Wdt::Bf16, crate::ops::Elems::Bf16(_)) => DevMat::upload(st, m, WeightMode::Stored),
            (Wdt::F8, crate::ops::Elems::F8(q)) => {
                let bytes: Vec<u8> = q.v.iter().map(|b| b.0).collect();
                let b = Buf::from_host(st, &bytes)?;
                let sc = Buf::from_host(st, &q.scales)?;
                Ok(DevMat {
                    p: b.p,
                    dt: Wdt::F8,
                    len: q.v.len(),
                    store: DevStore::F8(b, sc, q.block, q.cols),
                })
            }
            (want @ (Wdt::Bf16 | Wdt::F8), other) => Err(Error::Gpu(format!(
                "a {} matrix where this layer's experts on the GPU are {} (converting it would \
                 change its weights)",
                other.dtype(),
                want.name()
            ))),
            (Wdt::F32, _) => Ok(DevMat::of_f32(
                Buf::from_host(st, &m.to_f32())?,
                m.data.len(),
            )),
        }
    }

    pub fn of_f32(b: Buf<f32>, len: usize) -> DevMat {
        DevMat {
            p: b.p,
            dt: Wdt::F32,
            len,
            store: DevStore::F32(b),
        }
    }

    fn of_bf16(b: Buf<u16>, len: usize) -> DevMat {
        DevMat {
            p: b.p,
            dt: Wdt::Bf16,
            len,
            store: DevStore::Bf16(b),
        }
    }

    pub(crate) fn w(&self) -> W {
        let (s, b) = self
            .scales()
            .map_or((0, [0, 0]), |(s, b)| (s.p, [b[0] as i32, b[1] as i32]));
        W {
            p: self.p,
            dt: self.dt,
            s,
            b,
            len: self.len,
        }
    }

    /// As [`DevMat::upload`] for a dense matrix of the step's products: FP8 kept as stored
    /// with its block scales when four weights share a scale (block columns a multiple of 4;
    /// the products read it through `gemv_rows_f8` or `dequant_f8`), unless `mode` widens.
    pub fn upload_dense(
        st: &Arc<CudaStream>,
        m: &crate::ops::Matrix,
        mode: WeightMode,
    ) -> Result<DevMat> {
        match &m.data {
            crate::ops::Elems::F8(q)
                if mode == WeightMode::Stored && q.block[0] > 0 && q.block[1] % 4 == 0 =>
            {
                DevMat::upload_as(st, m, Wdt::F8)
            }
            _ => DevMat::upload(st, m, mode),
        }
    }

    /// Bytes on the device (FP8: with its scales).
    pub fn bytes(&self) -> usize {
        self.len * self.dt.size() + self.scales().map_or(0, |(s, _)| s.len * 4)
    }

    /// FP8's block scales and block shape.
    pub fn scales(&self) -> Option<(&Buf<f32>, [usize; 2])> {
        match &self.store {
            DevStore::F8(_, s, b, _) => Some((s, *b)),
            _ => None,
        }
    }

    /// The weights copied back, widened to f32.
    pub fn to_host(&self, st: &Arc<CudaStream>) -> Result<Vec<f32>> {
        match &self.store {
            DevStore::F32(b) => {
                let mut v = vec![0f32; self.len];
                b.read(st, &mut v)?;
                Ok(v)
            }
            DevStore::Bf16(b) => {
                let mut v = vec![0u16; self.len];
                b.read(st, &mut v)?;
                Ok(v.iter()
                    .map(|&x| f32::from_bits((x as u32) << 16))
                    .collect())
            }
            DevStore::F8(b, s, block, cols) => {
                let mut v = vec![0u8; self.len];
                b.read(st, &mut v)?;
                let mut scales = vec![0f32; s.len];
                s.read(st, &mut scales)?;
                let q = crate::ops::BlockScaled {
                    v: v.into_iter().map(crate::ops::F8).collect(),
                    scales,
                    cols: *cols,
                    block: *block,
                };
                Ok(crate::ops::Elems::F8(q).into_f32())
            }
        }
    }
}

/// A kernel in the two weight dtypes of the dense products.
struct ByDt {
    f32: CudaFunction,
    bf16: CudaFunction,
}

impl ByDt {
    /// FP8 matrices have their own kernels (`gemv_f8`, `dequant_f8`, the MoE layer's
    /// `moe_*_f8`), taken from `Funcs` directly, so F8 never asks here.
    fn of(&self, dt: Wdt) -> &CudaFunction {
        match dt {
            Wdt::F32 | Wdt::F8 => &self.f32,
            Wdt::Bf16 => &self.bf16,
        }
    }
}

struct Funcs {
    embed: ByDt,
    rmsnorm: CudaFunction,
    qk_rope_kv: CudaFunction,
    attention: CudaFunction,
    attention_decode: CudaFunction,
    attention_merge: CudaFunction,
    attention_tiled: CudaFunction,
    mla_prep: CudaFunction,
    mla_attend: CudaFunction,
    head_gemv: ByDt,
    route_topk: CudaFunction,
    route_sigmoid: CudaFunction,
    moe_up: ByDt,
    moe_down: ByDt,
    moe_down_pre: ByDt,
    moe_down_one: ByDt,
    scatter: CudaFunction,
    combine: CudaFunction,
    silu_mul: CudaFunction,
    bias_rows: CudaFunction,
    sigmoid_scale: CudaFunction,
    argmax: CudaFunction,
    sample: CudaFunction,
    gen: CudaFunction,
    read_probe: CudaFunction,
    gemv: ByDt,
    norm_gemv: ByDt,
    norm_gemv_route: ByDt,
    step_one: ByDt,
    hollow: CudaFunction,
    moe_up_f8: CudaFunction,
    moe_down_f8: CudaFunction,
    /// the MoE kernels with the experts' biases and gpt_oss's activation
    moe_up_x: ByDt,
    moe_down_x: ByDt,
    moe_up_x_f8: CudaFunction,
    moe_down_x_f8: CudaFunction,
    split_bf16: CudaFunction,
    gemv_f8: CudaFunction,
    dequant_f8: CudaFunction,
    round_bf16: CudaFunction,
    sum3: CudaFunction,
}

fn funcs(gpu: &Gpu) -> Result<Funcs> {
    let src = crate::cuda::kernel_source(DENSE_CU, DENSE_FILES)?;
    let m = gpu.module("dense", &src)?;
    let f = |n: &str| {
        m.load_function(n)
            .map_err(|e| gerr(&format!("loading kernel {n}"), e))
    };
    let both = |n: &str| -> Result<ByDt> {
        Ok(ByDt {
            f32: f(n)?,
            bf16: f(&format!("{n}_bf16"))?,
        })
    };
    Ok(Funcs {
        embed: both("embed_rows")?,
        rmsnorm: f("rmsnorm_rows")?,
        qk_rope_kv: f("qk_rope_kv")?,
        attention: f("attention")?,
        attention_decode: f("attention_decode")?,
        attention_merge: f("attention_merge")?,
        attention_tiled: f("attention_tiled")?,
        mla_prep: f("mla_prep")?,
        mla_attend: f("mla_attend")?,
        head_gemv: both("head_gemv")?,
        route_topk: f("route_topk")?,
        route_sigmoid: f("route_sigmoid")?,
        moe_up: both("moe_up")?,
        moe_down: both("moe_down")?,
        moe_down_pre: both("moe_down_pre")?,
        moe_down_one: both("moe_down_one")?,
        scatter: f("scatter_rows")?,
        combine: f("moe_combine")?,
        silu_mul: f("silu_mul")?,
        bias_rows: f("bias_rows")?,
        sigmoid_scale: f("sigmoid_scale_rows")?,
        argmax: f("argmax_rows")?,
        sample: f("sample_rows")?,
        gen: f("gen_weights")?,
        read_probe: f("read_probe")?,
        gemv: both("gemv_rows")?,
        norm_gemv: both("norm_gemv_rows")?,
        norm_gemv_route: both("norm_gemv_route")?,
        step_one: both("step_one")?,
        hollow: f("hollow_step")?,
        moe_up_f8: f("moe_up_f8")?,
        moe_down_f8: f("moe_down_f8")?,
        moe_up_x: both("moe_up_x")?,
        moe_down_x: both("moe_down_x")?,
        moe_up_x_f8: f("moe_up_x_f8")?,
        moe_down_x_f8: f("moe_down_x_f8")?,
        split_bf16: f("split_bf16")?,
        gemv_f8: f("gemv_rows_f8")?,
        dequant_f8: f("dequant_f8")?,
        round_bf16: f("round_bf16")?,
        sum3: f("sum3_rows")?,
    })
}

/// One layer's multi-head latent attention on the device (deepseek_v3): the products of
/// [`crate::model::MlaWeights`], each head's key and value rows of `kv_b_proj` stacked
/// (`uk`: `[heads, kv_lora, nope]`, `uv`: `[heads, v_head, kv_lora]`).
struct GpuMla {
    q_a: Option<(DevMat, Buf<f32>)>,
    q_b: DevMat,
    kv_a: DevMat,
    kv_a_norm: Buf<f32>,
    uk: DevMat,
    uv: DevMat,
}

impl GpuMla {
    fn upload(
        st: &Arc<CudaStream>,
        w: &crate::model::MlaWeights,
        mode: WeightMode,
    ) -> Result<Self> {
        let mat = |m: &crate::ops::Matrix| DevMat::upload_dense(st, m, mode);
        // the per-head stacks are read by `head_gemv`, which takes f32 or bf16: FP8 widened
        let stack =
            |ms: &[crate::ops::Matrix]| DevMat::upload(st, &crate::ops::Matrix::stack(ms), mode);
        Ok(GpuMla {
            q_a: match &w.q_a {
                Some((m, nrm)) => Some((mat(m)?, Buf::from_host(st, nrm)?)),
                None => None,
            },
            q_b: mat(&w.q_b)?,
            kv_a: mat(&w.kv_a)?,
            kv_a_norm: Buf::from_host(st, &w.kv_a_norm)?,
            uk: stack(&w.uk_t)?,
            uv: stack(&w.uv)?,
        })
    }

    fn mats(&self) -> impl Iterator<Item = &DevMat> {
        [
            self.q_a.as_ref().map(|(m, _)| m),
            Some(&self.q_b),
            Some(&self.kv_a),
        ]
        .into_iter()
        .flatten()
        .chain([&self.uk, &self.uv])
    }

    fn vector_bytes(&self) -> usize {
        4 * (self.kv_a_norm.len + self.q_a.as_ref().map_or(0, |(_, n)| n.len))
    }
}

/// A shared expert on the device: gate|up, down and the gate's row (none: ungated, glm4_moe).
type SharedExpert = (DevMat, DevMat, Option<Buf<f32>>);

struct Layer {
    input_norm: Buf<f32>,
    post_norm: Buf<f32>,
    qkv: DevMat,
    o: DevMat,
    q_norm: Buf<f32>,
    k_norm: Buf<f32>,
    /// false: q_norm and k_norm are one-float placeholders (the family has none)
    qk_norm: bool,
    router: Option<DevMat>,
    /// with guesses on: `[2E, H]`, this router's rows, then the next MoE layer's with each
    /// column scaled by that layer's norm weight over this one's (so that the product on
    /// this layer's normed row is the next router on the row normed as that layer would)
    router_guess: Option<DevMat>,
    /// the sigmoid router's correction bias (`[E]`)
    router_bias: Option<Buf<f32>>,
    mlp: Option<(DevMat, DevMat)>,
    qkv_bias: Option<Buf<f32>>,
    /// the shared expert's gate_up, down and gate row (qwen2_moe)
    shared: Option<SharedExpert>,
    /// multi-head latent attention's weights, in place of `qkv` (deepseek_v3)
    mla: Option<GpuMla>,
    /// each head's sink logit, the o projection's bias, the router's logit bias (gpt_oss)
    sinks: Option<Buf<f32>>,
    o_bias: Option<Buf<f32>>,
    router_logit_bias: Option<Buf<f32>>,
}

fn grid(x: usize, y: usize, threads: usize, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

/// The model on one GPU. See the module comment.
pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    st: Arc<CudaStream>,
    blas: CudaBlas,
    f: Funcs,
    cfg: ModelConfig,
    layers: Vec<Layer>,
    embed: DevMat,
    norm: Buf<f32>,
    head: Option<DevMat>,
    cos: Buf<f32>,
    sin: Buf<f32>,
    max_pos: usize,
    kc: Vec<Buf<f32>>,
    vc: Vec<Buf<f32>>,
    kv_blocks: usize,
    experts: HashMap<(usize, usize), (DevMat, DevMat)>,
    /// the hot experts' gate_up and down biases (gpt_oss), f32
    expert_biases: HashMap<(usize, usize), ExpertBias>,
    /// per MoE layer, the dtype its experts on this GPU are kept in (set by the first one
    /// put: bf16 for bf16 experts, FP8 for FP8 ones, else f32; `MOELANE_CUDA_WEIGHTS` may
    /// force one); the MoE kernels take one per launch
    expert_dt: Vec<Option<Wdt>>,
    /// per MoE layer, its FP8 experts' block shape (rows, columns)
    expert_block: Vec<Option<[usize; 2]>>,
    /// per MoE layer and expert, the FP8 block scales of the hot experts' gate_up and down
    /// (null otherwise)
    tab_gs: Buf<u64>,
    tab_ds: Buf<u64>,
    /// per MoE layer and expert, the hot experts' gate_up and down biases (null: none)
    tab_gb: Buf<u64>,
    tab_db: Buf<u64>,
    /// experts generated on the device (no host copy): swaps cannot move them
    pub generated: bool,
    tab_gu: Buf<u64>,
    tab_dn: Buf<u64>,
    moe: usize,
    // scratch (grow-only)
    x: Buf<f32>,
    h: Buf<f32>,
    qkv: Buf<f32>,
    att: Buf<f32>,
    /// multi-head latent attention's scratch: per row the q bottleneck, the compressed kv,
    /// each head's absorbed query and weighted latent
    mla_s: Buf<f32>,
    rlog: Buf<f32>,
    idx: Buf<i32>,
    wts: Buf<f32>,
    act: Buf<f32>,
    y: Buf<f32>,
    meta: Buf<i32>,
    logits: Buf<f32>,
    amax: Buf<i32>,
    /// per logit row (temperature, top_p, top_k, u) of a sampling head, and its probabilities
    spec: Buf<f64>,
    probs: Buf<f32>,
    cold_src: Buf<f32>,
    cold_slots: Buf<i32>,
    /// a bf16 product of more than 4 rows: its activations split into three bf16 rows each
    /// (`split_bf16`) and cuBLAS's three partial outputs per row, summed by `sum3_rows`
    xs: Buf<u16>,
    c3: Buf<f32>,
    /// an FP8 dense matrix widened for a product of more than 4 rows (cuBLAS): the size of
    /// the largest one, allocated at load
    f8_wide: Buf<f32>,
    /// rows of a split product per cuBLAS call (the scratch above holds that many)
    split_rows: usize,
    /// some dense matrix is bf16 (the split scratch is needed)
    any_bf16: bool,
    weights: WeightMode,
    host_meta: Vec<i32>,
    /// rows of the current step, and rows whose logits it computes
    n: usize,
    /// every row of this step is its sequence's only new token (decode): attention takes
    /// the fused kernel
    decode_only: bool,
    m: usize,
    o_pos: u64,
    o_tab: u64,
    o_lrows: u64,
    o_tiles: u64,
    o_blocks: u64,
    /// prefill attention's tiles this step
    tiles: usize,
    /// prefill attention a tile of rows per block (`MOELANE_CUDA_TILED_PREFILL=0` or
    /// `set_tiled_prefill` turns it off: a block per row)
    tiled_prefill: bool,
    /// cuBLAS's workspace (declared after `blas`, so dropped after the handle)
    _workspace: Buf<u8>,
    /// Replay whole runs of kernels as CUDA graphs (on by default; `MOELANE_CUDA_GRAPHS=0`
    /// or `graphs = false` launches every kernel from the host instead).
    pub graphs: bool,
    /// Launch kernels as programmatic dependent launches (compute capability 9.0 and later;
    /// `MOELANE_CUDA_PDL=0` turns it off).
    pub pdl: bool,
    /// The small-batch GEMVs ask the L2 for their weights before waiting on the previous
    /// kernel (`MOELANE_CUDA_PREFETCH=0` turns it off).
    pub prefetch: bool,
    /// bumped whenever a scratch buffer moves: graphs captured before hold stale addresses
    generation: u64,
    captured: HashMap<GraphKey, Graph>,
    profile: Option<std::sync::Mutex<Profile>>,
    seen: HashMap<GraphKey, u32>,
    /// decode attention's position ranges per (row, head) this step (1: one block reads the
    /// whole context; see [`attention_splits`])
    splits: usize,
    /// split decode attention on (`MOELANE_CUDA_ATTN_SPLIT=0` or `set_split_attention`
    /// turns it off)
    split_attention: bool,
    /// the ranges' partials, [n, heads, splits, head_dim + 2]
    att_part: Buf<f32>,
    /// blocks of decode attention the device holds at once (SMs times blocks per SM)
    att_wave: usize,
    /// up to 4 rows, the dense products (with their norm weights) and the down-projection
    /// load the first 4 KiB of each weight row into registers before waiting for the
    /// previous kernel, and rows that fit there stay in registers through the product
    /// (`MOELANE_CUDA_PRELOAD=0` or `set_preload` turns it off)
    preload: bool,
    /// the router's product and top-k in one kernel (`norm_gemv_route`, up to 4 rows), a
    /// single row's down-projection and combine in one (`moe_down_one`) when the layer's
    /// picks are all on this GPU (`MOELANE_CUDA_FUSE=1` turns both on)
    fuse: bool,
    /// the fused router's count of blocks done (its last block routes and sets it to 0)
    route_done: Buf<i32>,
    /// the router's top-k keeps a row in registers when it has at most 32 * TOPK_REG
    /// experts (`set_register_topk(false)`: in shared memory, the same picks; for tests)
    register_topk: bool,
    /// step kernels launched hollow (`MOELANE_CUDA_HOLLOW`: names or "all"; a diagnostic,
    /// the results are wrong), to time what each one costs in the chain
    hollow: Vec<String>,
    /// the `ipc` link's device mailbox, when one is attached ([`Self::attach_link`])
    link: Option<link_ops::LinkState>,
    /// a single decode row's MoE layers as the persistent kernel ([`Op::StepOne`]) where
    /// they allow it (`MOELANE_CUDA_PERSIST=1` or `set_persist` turns it on)
    persist: bool,
    /// the persistent step's blocks (one per SM; 0: it does not fit, the chain runs)
    one_grid: usize,
    /// its table of every layer's buffers (built once at load)
    one_lay: Option<Buf<u64>>,
    /// its grid barrier's two counters (0 between launches)
    one_bar: Buf<u32>,
    /// runs that took it (a diagnostic: tests check it ran)
    one_runs: u64,
    /// the guessed picks of each MoE layer (`[moe, k]`, from the layer before's router;
    /// [`GpuOptions::guess`]) and their weights (`[k]`, unused)
    guess_idx: Buf<i32>,
    guess_wts: Buf<f32>,
}

impl Drop for GpuModel {
    fn drop(&mut self) {
        // the fields' device memory is freed on this thread after this returns: cudarc's
        // free needs the context current here
        let _ = self.gpu.ctx.bind_to_thread();
    }
}

/// Rows of MLA's per-head attention (each head's absorbed query and weighted latent, about
/// half a MiB a row at DeepSeek-V3's shape) per launch: a long prefill runs in chunks over
/// one bounded scratch.
pub(super) const MLA_ROWS: usize = 256;

/// Floats of MLA scratch for a step of `n` rows: per row the q bottleneck and the compressed
/// kv (latent and rotary key); per row of a chunk of [`MLA_ROWS`], each head's absorbed query
/// and weighted latent.
pub(super) fn mla_scratch_floats(c: &ModelConfig, m: &crate::config::Mla, n: usize) -> usize {
    n * (m.q_lora_rank.unwrap_or(0) + m.kv_lora_rank + m.qk_rope_head_dim)
        + n.min(MLA_ROWS) * 2 * c.num_attention_heads * m.kv_lora_rank
}

/// Rows of a bf16 product of more than 4 rows per cuBLAS call (each split in three, see
/// `split_bf16`): bounds the scratch whatever the prefill's length.
const SPLIT_ROWS: usize = 256;

/// Logit rows of the LM head's split product per cuBLAS call (its outputs are
/// vocabulary-wide).
const HEAD_SPLIT_ROWS: usize = 32;

/// Warps of a decode attention block.
const ATT_WARPS: usize = 16;

/// Router logits per lane the top-k keeps in registers (TOPK_REG of kernels/routing.cu).
const TOPK_REG: usize = 16;
/// Blocks of the combine that asks the L2 for the next layer's guessed experts (about one
/// per SM on an H100 or H200: the prefetch's pieces spread over their copy engines' queues).
const GUESS_BLOCKS: usize = 128;
/// The guessed experts whose bytes the combine asks the L2 for: the most probable alone.
/// Measured on an H100 (station bf16, batch 1, docs/PERFORMANCE.md): all six guesses 0.88x
/// of no guess, the gate half of each 0.99x, two 1.00x, one 1.005x; the guess alone (no
/// prefetch) 0.99x. The prefetched bytes queue ahead of the small kernels' own loads.
const GUESS_PREFETCH: usize = 1;
/// Picks a row's fused down-projection and combine takes at most (K1_MAX of kernels/moe.cu).
const K1_MAX: usize = 8;

/// A captured run: (rows, logit rows, decode only, attention splits, prefill tiles, scratch
/// generation, the ops).
type GraphKey = (usize, usize, bool, usize, usize, u64, Vec<Op>);

/// Rows per block of prefill attention (ATT_TILE of kernels/attention.cu).
const ATT_TILE: usize = 16;

/// Prefill attention's tiles for a step whose rows belong to the sequences `seq_of_rows` (in
/// row order): (first row, row count), each up to 16 consecutive rows of one sequence
/// (a tile shares one block table), covering every row once, in order.
pub fn prefill_tiles(seq_of_rows: impl IntoIterator<Item = usize>) -> Vec<(usize, usize)> {
    let mut tiles: Vec<(usize, usize)> = Vec::new();
    let mut last = None;
    for (row, seq) in seq_of_rows.into_iter().enumerate() {
        match tiles.last_mut() {
            Some(t) if last == Some(seq) && t.1 < ATT_TILE => t.1 += 1,
            _ => tiles.push((row, 1)),
        }
        last = Some(seq);
    }
    tiles
}

/// Position ranges of each decode row's attention for `rows` rows of `heads` heads, the
/// longest context `len` positions, on a device that holds `wave` attention blocks at once:
/// a power of two, each range at least 32 and (up to 64 ranges) at most 64 positions long,
/// and no more ranges than keep every block in one wave (more only repeat each block's
/// q/k norm for less work: measured slower at 16 rows). The count changes only at powers
/// of two, so a captured step graph stays valid for many steps.
pub fn attention_splits(len: usize, rows: usize, heads: usize, wave: usize) -> usize {
    let by_len = len.div_ceil(64).next_power_of_two().clamp(1, 64);
    let fit = (wave / (rows * heads).max(1)).max(1);
    // the largest power of two <= fit
    let by_wave = 1usize << (usize::BITS - 1 - fit.leading_zeros());
    by_len.min(by_wave)
}

/// The kernel names of a `MOELANE_CUDA_HOLLOW` value ("all" or a list split by ',' or '+').
pub fn hollow_list(v: &str) -> Vec<String> {
    v.split([',', '+'])
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
        .collect()
}

struct Profile {
    start: cudarc::driver::CudaEvent,
    events: Vec<(&'static str, cudarc::driver::CudaEvent)>,
}

/// A captured graph. CUDA graph objects are not internally synchronised; this one is only
/// touched through `&mut GpuModel`, so never from two threads at once.
struct Graph(cudarc::driver::CudaGraph);

// SAFETY: see above: access is serialised by the owning model's `&mut`; the graph's handles
// are plain driver handles, valid from any thread of the process.
unsafe impl Send for Graph {}

/// One device-only piece of a step. A step is runs of these between the points where the
/// host must look (the cold tier's picks); each run is captured once as a CUDA graph per
/// batch shape and replayed after.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    Embed,
    Attention(usize),
    /// decoder layer, MoE layer
    Route(usize, usize),
    Moe(usize),
    /// MoE layer `ml`'s experts and the combine in one (a single row, every pick on this
    /// GPU: [`GpuModel::fuses_combine`])
    MoeOne(usize),
    /// x += the picks' outputs; the (decoder, MoE) layer of the route it follows, whose
    /// guess of the next layer's picks it may ask the L2 for ([`GpuModel::combine`])
    Combine(Option<(usize, usize)>),
    DenseMlp(usize),
    /// the shared expert of decoder layer l (qwen2_moe gated, glm4_moe not)
    Shared(usize),
    /// final norm and the LM head for the step's logit rows, then what the step returns
    Head(HeadOut),
    /// the `ipc` link: the step's head into the sidecar's box
    LinkStep,
    /// the `ipc` link: MoE layer ml's picks and normed rows of round r into the sidecar's
    /// box
    LinkPost(usize, usize),
    /// the `ipc` link: wait for MoE layer ml's reply of round r, its rows into the cold pick
    /// slots
    LinkJoin(usize, usize),
    /// decoder layers l0..l0 + count (MoE layers from ml0), each an Attention, Route and
    /// Moe + Combine (or MoeOne) of a single decode row with every pick on this GPU, as
    /// one persistent kernel ([`GpuModel::fold_persistent`])
    StepOne(usize, usize, usize),
}

pub use crate::step::HeadOut;

/// Blocks of decode attention the device holds at once (SMs times resident blocks).
fn decode_wave(gpu: &Gpu, f: &Funcs, head_dim: usize) -> Result<usize> {
    use cudarc::driver::sys::CUdevice_attribute_enum as A;
    let sms = gpu
        .ctx
        .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
        .map_err(|e| gerr("reading the SM count", e))? as usize;
    let per = f
        .attention_decode
        .occupancy_max_active_blocks_per_multiprocessor(
            32 * ATT_WARPS as u32,
            (ATT_WARPS + 3) * head_dim * 4,
            None,
        )
        .map_err(|e| gerr("reading decode attention's occupancy", e))? as usize;
    Ok(sms * per.max(1))
}

/// Every decoder layer's dense weights on the device.
fn upload_layers(
    st: &Arc<CudaStream>,
    w: &DenseWeights,
    mode: WeightMode,
    guess: bool,
) -> Result<Vec<Layer>> {
    let up = |v: &[f32]| Buf::from_host(st, v);
    let mat = |m: &crate::ops::Matrix| DevMat::upload_dense(st, m, mode);
    let mut layers = Vec::with_capacity(w.layers.len());
    for (i, l) in w.layers.iter().enumerate() {
        layers.push(Layer {
            input_norm: up(&l.input_norm)?,
            post_norm: up(&l.post_norm)?,
            // MLA layers have no qkv (an empty matrix)
            qkv: if l.qkv.data.is_empty() {
                DevMat::of_f32(Buf::zeros(st, 1)?, 0)
            } else {
                mat(&l.qkv)?
            },
            o: mat(&l.o)?,
            qk_norm: !l.q_norm.is_empty(),
            // a family without q/k norm keeps a placeholder (the kernels get a null pointer)
            q_norm: up(if l.q_norm.is_empty() {
                &[0.0]
            } else {
                &l.q_norm
            })?,
            k_norm: up(if l.k_norm.is_empty() {
                &[0.0]
            } else {
                &l.k_norm
            })?,
            router: l.router.as_ref().map(mat).transpose()?,
            router_guess: match guess.then(|| guess_router(&w.layers, i)).flatten() {
                Some(m) => Some(mat(&m)?),
                None => None,
            },
            router_bias: (!l.router_bias.is_empty())
                .then(|| up(&l.router_bias))
                .transpose()?,
            mlp: match &l.dense_mlp {
                Some(m) => Some((mat(&m.gate_up)?, mat(&m.down)?)),
                None => None,
            },
            qkv_bias: (!l.qkv_bias.is_empty())
                .then(|| up(&l.qkv_bias))
                .transpose()?,
            shared: match &l.shared {
                Some((m, g)) => Some((
                    mat(&m.gate_up)?,
                    mat(&m.down)?,
                    (!g.is_empty()).then(|| up(g)).transpose()?,
                )),
                None => None,
            },
            mla: l
                .mla
                .as_ref()
                .map(|m| GpuMla::upload(st, m, mode))
                .transpose()?,
            sinks: (!l.sinks.is_empty()).then(|| up(&l.sinks)).transpose()?,
            o_bias: (!l.o_bias.is_empty()).then(|| up(&l.o_bias)).transpose()?,
            router_logit_bias: (!l.router_logit_bias.is_empty())
                .then(|| up(&l.router_logit_bias))
                .transpose()?,
        });
    }
    Ok(layers)
}

/// Decoder layer `i`'s router stacked over the next MoE layer's (`[2E, H]`, see
/// `Layer::router_guess`), in the routers' own dtype, f32 or bf16 (this router's rows bit
/// for bit); None for the last MoE layer, routers of other shapes or dtypes.
fn guess_router(layers: &[crate::model::LayerWeights], i: usize) -> Option<crate::ops::Matrix> {
    use crate::ops::{Bf16, Elem, Elems, Matrix};
    let l = &layers[i];
    let cur = l.router.as_ref()?;
    let nl = layers.get(i + 1..)?.iter().find(|n| n.router.is_some())?;
    let next = nl.router.as_ref()?;
    let h = cur.cols;
    if next.rows != cur.rows || next.cols != h || l.post_norm.len() != h || nl.post_norm.len() != h
    {
        return None;
    }
    let ratio: Vec<f32> = nl
        .post_norm
        .iter()
        .zip(&l.post_norm)
        .map(|(&a, &b)| {
            let r = a / b;
            if r.is_finite() {
                r
            } else {
                0.0
            }
        })
        .collect();
    let data = match (&cur.data, &next.data) {
        (Elems::F32(c), Elems::F32(nx)) => {
            let mut v = c.clone();
            for row in nx.chunks(h) {
                v.extend(row.iter().zip(&ratio).map(|(w, r)| w * r));
            }
            Elems::F32(v)
        }
        (Elems::Bf16(c), Elems::Bf16(nx)) => {
            let mut v = c.clone();
            for row in nx.chunks(h) {
                v.extend(
                    row.iter()
                        .zip(&ratio)
                        .map(|(w, r)| Bf16(half::bf16::from_f32(w.f32() * r).to_bits())),
                );
            }
            Elems::Bf16(v)
        }
        _ => return None,
    };
    Some(Matrix::of(2 * cur.rows, h, data))
}

/// The dtype a GPU keeps an expert's weights in: bf16 when both of its matrices are bf16,
/// else f32.
pub(crate) fn expert_dtype(w: &ExpertWeights) -> Wdt {
    use crate::ops::Elems;
    match (&w.gate_up.data, &w.down.data) {
        (Elems::Bf16(_), Elems::Bf16(_)) => Wdt::Bf16,
        // the kernels read four weights at a time under one scale
        (Elems::F8(a), Elems::F8(b))
            if a.block == b.block && a.block[0] > 0 && a.block[1].is_multiple_of(4) =>
        {
            Wdt::F8
        }
        _ => Wdt::F32,
    }
}

/// An expert's biases on the device (gpt_oss): gate_up's (`[2I]`, the gate's then the up's)
/// and down's (`[H]`), f32 as the CPU holds them.
pub(crate) struct ExpertBias {
    pub gate_up: Buf<f32>,
    pub down: Buf<f32>,
}

impl ExpertBias {
    /// The biases of `w`, checked against `cfg`'s shapes; None when it has none. Refused
    /// when its activation is not `cfg`'s (the kernels take one per model).
    pub fn upload(
        st: &Arc<CudaStream>,
        w: &ExpertWeights,
        cfg: &ModelConfig,
    ) -> Result<Option<ExpertBias>> {
        ExpertBias::upload_for(
            st,
            w,
            cfg.hidden_size,
            cfg.moe_intermediate_size,
            cfg.expert_glu,
        )
    }

    /// As [`ExpertBias::upload`] for experts of width `inter` over `hidden`, activation `glu`.
    pub fn upload_for(
        st: &Arc<CudaStream>,
        w: &ExpertWeights,
        hidden: usize,
        inter: usize,
        glu: Glu,
    ) -> Result<Option<ExpertBias>> {
        if w.glu != glu {
            return Err(Error::Gpu(format!(
                "an expert with activation {:?} where this GPU's experts use {glu:?}",
                w.glu
            )));
        }
        if w.gate_up_bias.is_empty() && w.down_bias.is_empty() {
            return Ok(None);
        }
        let fill = |v: &[f32], n: usize, what: &str| -> Result<Vec<f32>> {
            match v.len() {
                0 => Ok(vec![0.0; n]),
                x if x == n => Ok(v.to_vec()),
                x => Err(Error::Gpu(format!(
                    "an expert's {what} bias of {x} floats, its shape needs {n}"
                ))),
            }
        };
        Ok(Some(ExpertBias {
            gate_up: Buf::from_host(st, &fill(&w.gate_up_bias, 2 * inter, "gate_up")?)?,
            down: Buf::from_host(st, &fill(&w.down_bias, hidden, "down")?)?,
        }))
    }

    pub fn bytes(&self) -> usize {
        4 * (self.gate_up.len + self.down.len)
    }
}

/// Uploads expert (l, e) as `dt`, the dtype a GPU keeps its experts in; FP8 experts must
/// also share one block shape (`block`, set by the first): the kernels take one per launch.
pub(crate) fn upload_expert(
    st: &Arc<CudaStream>,
    w: &ExpertWeights,
    (l, e): (usize, usize),
    dt: Wdt,
    block: &mut Option<[usize; 2]>,
) -> Result<(DevMat, DevMat)> {
    let named = |err: Error| Error::Gpu(format!("expert ({l},{e}): {err}"));
    let gu = DevMat::upload_as(st, &w.gate_up, dt).map_err(named)?;
    let dn = DevMat::upload_as(st, &w.down, dt).map_err(named)?;
    for m in [&gu, &dn] {
        if let Some((_, b)) = m.scales() {
            let want = *block.get_or_insert(b);
            if b != want {
                return Err(Error::Gpu(format!(
                    "expert ({l},{e}): FP8 blocks of {}x{} where this GPU's experts have {}x{}",
                    b[0], b[1], want[0], want[1]
                )));
            }
        }
    }
    Ok((gu, dn))
}

impl GpuModel {
    /// Uploads the dense weights of `cfg` and makes a KV cache of `kv_blocks` blocks on `gpu`,
    /// with the default options and the environment's overrides.
    pub fn new(
        gpu: Arc<Gpu>,
        cfg: &ModelConfig,
        w: &DenseWeights,
        kv_blocks: usize,
    ) -> Result<Self> {
        Self::with_options(gpu, cfg, w, kv_blocks, GpuOptions::from_env())
    }

    /// As [`GpuModel::new`], with `opts`.
    pub fn with_options(
        gpu: Arc<Gpu>,
        cfg: &ModelConfig,
        w: &DenseWeights,
        kv_blocks: usize,
        opts: GpuOptions,
    ) -> Result<Self> {
        if let Some(m) = &cfg.mla {
            // the latent a lane keeps in registers, the rotary dims two lanes take (mla.cu)
            if m.kv_lora_rank > 512 || m.qk_rope_head_dim > 64 {
                return Err(Error::Gpu(format!(
                    "kv_lora_rank {} and qk_rope_head_dim {}: the GPU's latent attention takes \
                     at most 512 and 64",
                    m.kv_lora_rank, m.qk_rope_head_dim
                )));
            }
        }
        let mla = cfg.mla.is_some();
        if !cfg.head_dim.is_multiple_of(2) || (!mla && cfg.head_dim > 128) {
            return Err(Error::Gpu(format!(
                "head_dim {} is not supported on the GPU (even, at most 128)",
                cfg.head_dim
            )));
        }
        // SAFETY: this model uses one stream, which orders every use of every buffer.
        unsafe { gpu.ctx.disable_event_tracking() };
        // its own stream: the legacy default stream cannot be captured into a graph
        let st = gpu
            .ctx
            .new_stream()
            .map_err(|e| gerr("creating a CUDA stream", e))?;
        let f = funcs(&gpu)?;
        let blas = CudaBlas::new(st.clone()).map_err(|e| gerr("creating a cuBLAS handle", e))?;
        // a fixed cuBLAS workspace, so that no product allocates while a graph is captured
        let workspace = Buf::<u8>::zeros(&st, 32 << 20)?;
        // SAFETY: the workspace outlives the handle (both are fields of this model; the
        // handle is dropped first, see the field order).
        unsafe {
            blas::cublasSetWorkspace_v2(
                *blas.handle(),
                workspace.p as *mut std::ffi::c_void,
                workspace.len,
            )
        }
        .result()
        .map_err(|e| gerr("setting the cuBLAS workspace", e))?;
        let pdl = gpu.cc.0 >= 9 && opts.pdl;
        let att_wave = decode_wave(&gpu, &f, cfg.head_dim)?;
        let one_grid = step_one::one_grid(&gpu, [&f.step_one.f32, &f.step_one.bf16], cfg.head_dim)?;
        let up = |v: &[f32]| Buf::from_host(&st, v);
        let mode = opts.weights;
        let layers = upload_layers(&st, w, mode, opts.guess)?;
        let embed = DevMat::upload(&st, &w.embed, mode)?;
        let head = w
            .lm_head
            .as_ref()
            .map(|h| DevMat::upload(&st, h, mode))
            .transpose()?;
        let max_pos = cfg
            .max_position_embeddings
            .min(crate::ops::MAX_ROPE_POSITIONS);
        let rope = Rope::scaled(cfg.rotary_dim, cfg.rope_theta, max_pos, cfg.yarn.as_ref());
        // K and V per position and layer; MLA keeps its latent and rotary key in K, no V
        let (kd, vd) = cfg.cache_dims();
        let mut kc = Vec::new();
        let mut vc = Vec::new();
        for _ in 0..cfg.num_hidden_layers {
            kc.push(Buf::zeros(&st, kv_blocks * BLOCK * kd)?);
            vc.push(Buf::zeros(&st, kv_blocks * BLOCK * vd)?);
        }
        let moe = cfg.moe_layers().len();
        let e = cfg.num_experts;
        let mut m = GpuModel {
            embed,
            norm: up(&w.norm)?,
            head,
            cos: up(&rope.cos)?,
            sin: up(&rope.sin)?,
            max_pos,
            kc,
            vc,
            kv_blocks,
            experts: HashMap::new(),
            expert_biases: HashMap::new(),
            expert_dt: vec![
                match mode {
                    WeightMode::Stored => None,
                    WeightMode::F32 => Some(Wdt::F32),
                    WeightMode::Bf16 => Some(Wdt::Bf16),
                };
                moe
            ],
            weights: mode,
            generated: false,
            tab_gu: Buf::zeros(&st, moe * e)?,
            tab_dn: Buf::zeros(&st, moe * e)?,
            tab_gs: Buf::zeros(&st, moe * e)?,
            tab_ds: Buf::zeros(&st, moe * e)?,
            tab_gb: Buf::zeros(&st, moe * e)?,
            tab_db: Buf::zeros(&st, moe * e)?,
            expert_block: vec![None; moe],
            moe,
            x: Buf::zeros(&st, 1)?,
            h: Buf::zeros(&st, 1)?,
            qkv: Buf::zeros(&st, 1)?,
            att: Buf::zeros(&st, 1)?,
            mla_s: Buf::zeros(&st, 1)?,
            rlog: Buf::zeros(&st, 1)?,
            route_done: Buf::zeros(&st, 1)?,
            idx: Buf::zeros(&st, 1)?,
            wts: Buf::zeros(&st, 1)?,
            act: Buf::zeros(&st, 1)?,
            y: Buf::zeros(&st, 1)?,
            meta: Buf::zeros(&st, 1)?,
            logits: Buf::zeros(&st, 1)?,
            amax: Buf::zeros(&st, 1)?,
            spec: Buf::zeros(&st, 1)?,
            probs: Buf::zeros(&st, 1)?,
            cold_src: Buf::zeros(&st, 1)?,
            cold_slots: Buf::zeros(&st, 1)?,
            xs: Buf::zeros(&st, 1)?,
            c3: Buf::zeros(&st, 1)?,
            f8_wide: Buf::zeros(&st, 1)?,
            split_rows: 0,
            any_bf16: false,
            host_meta: Vec::new(),
            n: 0,
            decode_only: false,
            m: 0,
            o_pos: 0,
            o_tab: 0,
            o_lrows: 0,
            o_tiles: 0,
            o_blocks: 0,
            tiles: 0,
            tiled_prefill: opts.tiled_prefill,
            _workspace: workspace,
            graphs: opts.graphs,
            pdl,
            prefetch: opts.prefetch,
            generation: 0,
            captured: HashMap::new(),
            profile: None,
            seen: HashMap::new(),
            splits: 1,
            split_attention: opts.split_attention,
            att_part: Buf::zeros(&st, 1)?,
            att_wave,
            preload: opts.preload,
            fuse: opts.fuse,
            register_topk: true,
            hollow: opts.hollow,
            link: None,
            persist: opts.persist,
            one_grid,
            one_lay: None,
            one_bar: Buf::zeros(&st, step_one::ONE_BAR_WORDS)?,
            one_runs: 0,
            guess_idx: Buf::zeros(&st, moe.max(1) * cfg.num_experts_per_tok)?,
            guess_wts: Buf::zeros(&st, cfg.num_experts_per_tok.max(1))?,
            layers,
            cfg: cfg.clone(),
            f,
            blas,
            st,
            gpu,
        };
        // decided from what was uploaded (the mode may have widened or rounded)
        let any_bf16 = m.dense_mats().any(|x| x.dt == Wdt::Bf16);
        m.any_bf16 = any_bf16;
        let widest_f8 = m
            .dense_mats()
            .filter(|x| x.dt == Wdt::F8)
            .map(|x| x.len)
            .max()
            .unwrap_or(0);
        if widest_f8 > 0 {
            m.f8_wide = Buf::zeros(&m.st, widest_f8)?;
        }
        if m.persist_unfit().is_none() {
            m.one_lay = Some(m.one_layers()?);
        }
        m.sync()?;
        Ok(m)
    }

    /// "cuda:N (name, sm_XY)"
    pub fn describe(&self) -> String {
        format!(
            "cuda:{} ({}, sm_{}{})",
            self.gpu.ordinal, self.gpu.name, self.gpu.cc.0, self.gpu.cc.1
        )
    }

    /// Rows whose logits the step begun last computes.
    pub fn logit_rows(&self) -> usize {
        self.m
    }

    /// The vocabulary size.
    pub fn vocab(&self) -> usize {
        self.cfg.vocab_size
    }

    pub fn kv_blocks(&self) -> usize {
        self.kv_blocks
    }

    /// Experts resident on this GPU.
    pub fn resident(&self) -> usize {
        self.experts.len()
    }

    /// Bytes of expert weights on this GPU.
    pub fn expert_bytes(&self) -> usize {
        let biases: usize = self.expert_biases.values().map(ExpertBias::bytes).sum();
        self.experts
            .values()
            .map(|(g, d)| g.bytes() + d.bytes())
            .sum::<usize>()
            + biases
    }

    /// Bytes of dense weights on this GPU (every matrix and vector of the layers, the
    /// embedding, the final norm and the LM head; not the KV cache, the RoPE tables or scratch).
    pub fn dense_bytes(&self) -> usize {
        let v = |b: &Buf<f32>| b.len * 4;
        let ov = |b: &Option<Buf<f32>>| b.as_ref().map_or(0, v);
        let mut vectors = v(&self.norm);
        for l in &self.layers {
            vectors += v(&l.input_norm) + v(&l.post_norm) + ov(&l.router_bias) + ov(&l.qkv_bias);
            if l.qk_norm {
                vectors += v(&l.q_norm) + v(&l.k_norm);
            }
            vectors += l.mla.as_ref().map_or(0, GpuMla::vector_bytes);
            vectors += ov(&l.sinks) + ov(&l.o_bias) + ov(&l.router_logit_bias);
            vectors += l.shared.as_ref().map_or(0, |(_, _, g)| ov(g));
        }
        self.dense_mats().map(DevMat::bytes).sum::<usize>() + vectors
    }

    /// Bytes of dense weights a decode token reads on this GPU: every layer's, one row of
    /// the embedding and the LM head (the embedding again when they are tied).
    pub fn dense_bytes_per_token(&self) -> usize {
        let row = self.cfg.hidden_size * self.embed.dt.size();
        let head = self.head.as_ref().unwrap_or(&self.embed).bytes();
        let untied = self.head.as_ref().map_or(0, DevMat::bytes);
        self.dense_bytes() - self.embed.bytes() - untied + row + head
    }

    /// Bytes of one resident expert (0 when none is).
    pub fn bytes_per_expert(&self) -> usize {
        let bias = self
            .expert_biases
            .values()
            .next()
            .map_or(0, ExpertBias::bytes);
        self.experts
            .values()
            .next()
            .map_or(0, |(g, d)| g.bytes() + d.bytes() + bias)
    }

    /// Bytes of the KV cache on this GPU.
    pub fn kv_bytes(&self) -> usize {
        let (kd, vd) = self.cfg.cache_dims();
        self.cfg.num_hidden_layers * self.kv_blocks * BLOCK * (kd + vd) * 4
    }

    /// The dtypes the weights are kept in, for the start line: "bf16" when every matrix is
    /// bf16, else the dense matrices' and the experts' ("bf16+f32 dense, fp8 experts").
    pub fn weight_dtype(&self) -> String {
        let names = |it: &mut dyn Iterator<Item = Wdt>| {
            let mut v: Vec<&str> = it.map(Wdt::name).collect();
            v.sort_unstable();
            v.dedup();
            v.join("+")
        };
        let dense = names(&mut self.dense_mats().map(|m| m.dt));
        let experts = names(&mut self.expert_dt.iter().flatten().copied());
        if experts.is_empty() || experts == dense {
            dense
        } else {
            format!("{dense} dense, {experts} experts")
        }
    }

    /// Every dense weight matrix on the device.
    fn dense_mats(&self) -> impl Iterator<Item = &DevMat> {
        [Some(&self.embed), self.head.as_ref()]
            .into_iter()
            .flatten()
            .chain(self.layers.iter().flat_map(|l| {
                // an MLA layer's qkv is an empty placeholder
                [
                    (l.qkv.len > 0).then_some(&l.qkv),
                    Some(&l.o),
                    l.router.as_ref(),
                ]
                .into_iter()
                .flatten()
                .chain(l.mlp.iter().flat_map(|(a, b)| [a, b]))
                .chain(l.shared.iter().flat_map(|(a, b, _)| [a, b]))
                .chain(l.mla.iter().flat_map(GpuMla::mats))
            }))
    }

    pub fn sync(&self) -> Result<()> {
        self.st
            .synchronize()
            .map_err(|e| gerr("synchronising the GPU", e))
    }

    /// Makes this GPU hold exactly the experts `bank` holds (uploads missing ones, frees the
    /// rest). A no-op on a model whose experts were generated on the device.
    pub fn sync_hot(&mut self, bank: &ExpertBank) -> Result<()> {
        if self.generated {
            return Ok(());
        }
        // experts dropped below are freed on this thread (see GpuExperts::sync)
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| gerr("binding the CUDA context", e))?;
        let mut keep = std::collections::HashSet::new();
        for l in 0..bank.layers() {
            for (e, w) in bank.experts_of(l) {
                keep.insert((l, e));
                if !self.experts.contains_key(&(l, e)) {
                    self.put_expert(l, e, w)?;
                }
            }
        }
        self.experts.retain(|k, _| keep.contains(k));
        self.expert_biases.retain(|k, _| keep.contains(k));
        Ok(())
    }

    fn put_expert(&mut self, l: usize, e: usize, w: &ExpertWeights) -> Result<()> {
        let (Some(dt_slot), Some(block)) =
            (self.expert_dt.get_mut(l), self.expert_block.get_mut(l))
        else {
            return Err(Error::Internal(format!(
                "expert ({l},{e}) of a model with {} MoE layers",
                self.moe
            )));
        };
        let was = (*dt_slot, *block);
        let dt = *dt_slot.get_or_insert(expert_dtype(w));
        let pair = if self.weights == WeightMode::Bf16 {
            // a benchmark's rounding: f32 and bf16 experts as bf16
            let gu = DevMat::upload(&self.st, &w.gate_up, WeightMode::Bf16)?;
            let dn = DevMat::upload(&self.st, &w.down, WeightMode::Bf16)?;
            if gu.dt != Wdt::Bf16 || dn.dt != Wdt::Bf16 {
                return Err(Error::Gpu(format!(
                    "expert ({l},{e}): MOELANE_CUDA_WEIGHTS=bf16 takes f32 or bf16 experts"
                )));
            }
            (gu, dn)
        } else {
            upload_expert(&self.st, w, (l, e), dt, block)?
        };
        // the layer's kernel (or FP8 block) is part of every captured step that ran it
        if (Some(dt), *block) != was {
            self.drop_graphs();
        }
        if let Some(b) = ExpertBias::upload(&self.st, w, &self.cfg)? {
            self.expert_biases.insert((l, e), b);
        }
        self.experts.insert((l, e), pair);
        Ok(())
    }

    /// Generates the given experts of a hashed model (the `station` preset) on the device.
    pub fn generate(&mut self, seed: u64, which: &[(usize, usize)]) -> Result<()> {
        self.generated = true;
        let (h, i) = (self.cfg.hidden_size, self.cfg.moe_intermediate_size);
        let dt = if self.weights == WeightMode::Bf16 {
            Wdt::Bf16
        } else {
            Wdt::F32
        };
        if self
            .experts
            .keys()
            .any(|&(l, _)| self.expert_dt[l] != Some(dt))
        {
            return Err(Error::Gpu(
                "generating experts beside experts of another dtype".into(),
            ));
        }
        self.expert_dt = vec![Some(dt); self.moe];
        self.drop_graphs();
        for &(l, e) in which {
            let (gu, dn) = gen_expert(&self.st, &self.f.gen, seed, l, e, h, i)?;
            let (gu, dn) = (DevMat::of_f32(gu, 2 * i * h), DevMat::of_f32(dn, h * i));
            let pair = if dt == Wdt::Bf16 {
                (self.rounded(&gu)?, self.rounded(&dn)?)
            } else {
                (gu, dn)
            };
            self.experts.insert((l, e), pair);
        }
        self.sync()
    }

    /// An f32 matrix on the device rounded to bf16 (generated weights, `WeightMode::Bf16`).
    fn rounded(&self, m: &DevMat) -> Result<DevMat> {
        let out = Buf::<u16>::zeros(&self.st, m.len)?;
        let mut a = args::RoundBf16 {
            x: m.p,
            y: out.p,
            n: m.len as i64,
        };
        // SAFETY: x holds m.len floats, y as many bf16s.
        unsafe {
            launch_raw(
                &self.st,
                &self.f.round_bf16,
                &mut a.params(),
                false,
                grid(m.len.div_ceil(256).min(65535), 1, 256, 0),
            )
        }
        .map_err(|e| gerr("launching round_bf16", e))?;
        Ok(DevMat::of_bf16(out, m.len))
    }

    /// Points every MoE layer's expert table at the experts `map` puts hot; cold ones get a
    /// null entry (their slots are filled from the cold tier's reply). Fails, changing
    /// nothing, when a hot expert is not on this GPU.
    pub fn set_map(&mut self, map: &ValidMap) -> Result<()> {
        let e = self.cfg.num_experts;
        let mut gu = vec![0u64; self.moe * e];
        let mut dn = vec![0u64; self.moe * e];
        let mut gs = vec![0u64; self.moe * e];
        let mut ds = vec![0u64; self.moe * e];
        let mut gb = vec![0u64; self.moe * e];
        let mut db = vec![0u64; self.moe * e];
        for ml in 0..self.moe {
            for x in 0..e {
                if map.tier(ml, x) == Tier::Hot {
                    let Some((g, d)) = self.experts.get(&(ml, x)) else {
                        return Err(Error::NotResident {
                            layer: ml,
                            expert: x,
                            tier: "gpu",
                        });
                    };
                    gu[ml * e + x] = g.p;
                    dn[ml * e + x] = d.p;
                    gs[ml * e + x] = g.scales().map_or(0, |(s, _)| s.p);
                    ds[ml * e + x] = d.scales().map_or(0, |(s, _)| s.p);
                    if let Some(b) = self.expert_biases.get(&(ml, x)) {
                        gb[ml * e + x] = b.gate_up.p;
                        db[ml * e + x] = b.down.p;
                    }
                }
            }
        }
        self.tab_gu.write(&self.st, &gu)?;
        self.tab_dn.write(&self.st, &dn)?;
        self.tab_gs.write(&self.st, &gs)?;
        self.tab_ds.write(&self.st, &ds)?;
        self.tab_gb.write(&self.st, &gb)?;
        self.tab_db.write(&self.st, &db)?;
        self.sync()
    }

    /// Starts a step: checks and uploads the tokens, positions, block tables and logit rows
    /// (one copy) and sizes the scratch. Nothing runs until [`Self::run`].
    pub fn begin(
        &mut self,
        tokens: &[u32],
        rows: &[RowPos],
        seqs: &[&SeqKv],
        logit_rows: &[usize],
    ) -> Result<()> {
        let c = &self.cfg;
        let n = rows.len();
        let m = logit_rows.len();
        let (hs, ne, k) = (c.hidden_size, c.num_experts, c.num_experts_per_tok);
        let dense_i = c.intermediate_size.max(c.shared_expert_intermediate_size);
        self.host_meta.clear();
        for &t in tokens {
            if t as usize >= c.vocab_size {
                return Err(Error::BadToken {
                    id: t,
                    vocab: c.vocab_size,
                });
            }
            self.host_meta.push(t as i32);
        }
        let mut tab_of = Vec::with_capacity(seqs.len());
        let mut blocks = Vec::new();
        for s in seqs {
            tab_of.push(blocks.len() as i32);
            for &b in &s.blocks {
                if b as usize >= self.kv_blocks {
                    return Err(Error::Gpu(format!(
                        "KV block {b} but the GPU cache has {}",
                        self.kv_blocks
                    )));
                }
                blocks.push(b as i32);
            }
        }
        for rp in rows {
            if rp.pos >= self.max_pos {
                return Err(Error::ContextOverflow {
                    len: rp.pos + 1,
                    max: self.max_pos,
                });
            }
            if rp.pos / BLOCK >= seqs[rp.seq].blocks.len() {
                return Err(Error::Gpu(format!(
                    "position {} has no KV block reserved",
                    rp.pos
                )));
            }
            self.host_meta.push(rp.pos as i32);
        }
        for rp in rows {
            self.host_meta.push(tab_of[rp.seq]);
        }
        for &r in logit_rows {
            if r >= n {
                return Err(Error::Gpu(format!("logits of row {r} of {n}")));
            }
            self.host_meta.push(r as i32);
        }
        let tiles = prefill_tiles(rows.iter().map(|r| r.seq));
        self.tiles = tiles.len();
        for (first, count) in tiles {
            self.host_meta
                .extend_from_slice(&[first as i32, count as i32]);
        }
        self.host_meta.extend_from_slice(&blocks);
        let st = self.st.clone();
        // sized for any block table, so the table's address is the same every step
        let mut moved = self.meta.grow(&st, 5 * n + m + self.kv_blocks)?;
        self.meta.write(&st, &self.host_meta)?;
        self.o_pos = self.meta.p + 4 * n as u64;
        self.o_tab = self.o_pos + 4 * n as u64;
        self.o_lrows = self.o_tab + 4 * n as u64;
        self.o_tiles = self.o_lrows + 4 * m as u64;
        self.o_blocks = self.o_tiles + 8 * self.tiles as u64;
        // q, k and v of a row (MLA: q alone)
        let qkv_w = if c.mla.is_some() {
            c.q_dim()
        } else {
            c.q_dim() + 2 * c.kv_dim()
        };
        let wide = qkv_w.max(2 * dense_i);
        moved |= self.x.grow(&st, n * hs)?;
        moved |= self.h.grow(&st, n * hs)?;
        moved |= self.qkv.grow(&st, n * wide)?;
        moved |= self
            .att
            .grow(&st, n * c.q_dim().max(c.o_dim()).max(dense_i))?;
        if let Some(ml) = &c.mla {
            moved |= self.mla_s.grow(&st, mla_scratch_floats(c, ml, n))?;
        }
        // a single row's router may add a guessed row (`route`)
        moved |= self.rlog.grow(&st, n.max(2) * ne)?;
        moved |= self.idx.grow(&st, self.moe.max(1) * n * k)?;
        moved |= self.wts.grow(&st, n * k)?;
        moved |= self.act.grow(&st, n * k * c.moe_intermediate_size)?;
        moved |= self.y.grow(&st, n * k * hs)?;
        moved |= self.logits.grow(&st, m * c.vocab_size)?;
        moved |= self.amax.grow(&st, m)?;
        moved |= self.spec.grow(&st, 4 * m)?;
        let decode_only = n == seqs.len();
        let longest = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        // MLA's attention has one path (no position ranges): no partials to hold
        self.splits = if decode_only && self.split_attention && c.mla.is_none() {
            attention_splits(longest, n, c.num_attention_heads, self.att_wave)
        } else {
            1
        };
        let part = n * c.num_attention_heads * self.splits * (c.head_dim + 2);
        moved |= self.att_part.grow(&st, part)?;
        if self.any_bf16 && n > 4 {
            // a split product's scratch: up to SPLIT_ROWS rows per cuBLAS call, and up to
            // HEAD_SPLIT_ROWS rows of the head's (vocabulary-wide) outputs
            let widest_in = hs.max(c.q_dim()).max(c.o_dim()).max(dense_i);
            let widest_out = wide.max(hs).max(ne);
            let rows = n.min(SPLIT_ROWS);
            let outs = (rows * widest_out).max(m.min(HEAD_SPLIT_ROWS) * c.vocab_size);
            moved |= self.xs.grow(&st, 3 * rows * widest_in)?;
            moved |= self.c3.grow(&st, 3 * outs)?;
            self.split_rows = rows;
        }
        if moved {
            self.drop_graphs();
        }
        self.n = n;
        self.m = m;
        self.decode_only = decode_only;
        Ok(())
    }

    /// Runs `ops` on the device: replays the CUDA graph of this run and batch shape when
    /// one was captured, captures it the second time the same run is seen (decode shapes
    /// repeat; prefill shapes mostly do not), else launches kernel by kernel.
    pub fn run(&mut self, ops: &[Op]) -> Result<()> {
        if ops.is_empty() {
            return Ok(());
        }
        let folded = self.fold_persistent(ops);
        self.one_runs += folded.is_some() as u64;
        let ops = folded.as_deref().unwrap_or(ops);
        if !self.graphs || self.profile.is_some() {
            return ops.iter().try_for_each(|op| self.exec(op));
        }
        let key = (
            self.n,
            self.m,
            self.decode_only,
            self.splits,
            self.tiles,
            self.generation,
            ops.to_vec(),
        );
        if let Some(g) = self.captured.get(&key) {
            return g.0.launch().map_err(|e| gerr("launching a CUDA graph", e));
        }
        // bounded: a server sees many prefill shapes over its life
        if self.seen.len() > 4096 {
            self.seen.clear();
        }
        if self.captured.len() > 512 {
            self.captured.clear();
        }
        let seen = self.seen.entry(key.clone()).or_insert(0);
        *seen += 1;
        if *seen < 2 {
            return ops.iter().try_for_each(|op| self.exec(op));
        }
        use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
        self.st
            .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
            .map_err(|e| gerr("starting a CUDA graph capture", e))?;
        let r = ops.iter().try_for_each(|op| self.exec(op));
        let g = self.st.end_capture(CUgraphInstantiate_flags(0));
        match (r, g) {
            (Ok(()), Ok(Some(g))) => {
                g.launch().map_err(|e| gerr("launching a CUDA graph", e))?;
                self.captured.insert(key, Graph(g));
                Ok(())
            }
            (r, g) => {
                // capture is not available here (or a launch failed while capturing):
                // launch kernel by kernel from now on
                eprintln!(
                    "moelane: CUDA graph capture failed ({:?} / {:?}); launching kernels one by one",
                    r.as_ref().err(),
                    g.as_ref().err()
                );
                self.graphs = false;
                r?;
                ops.iter().try_for_each(|op| self.exec(op))
            }
        }
    }

    fn exec(&mut self, op: &Op) -> Result<()> {
        match *op {
            Op::Embed => {
                let h = self.cfg.hidden_size as i32;
                let mut a = args::EmbedRows {
                    emb: self.embed.p,
                    tok: self.meta.p,
                    x: self.x.p,
                    h,
                };
                // SAFETY: every token id was checked < vocab in `begin`; x holds n rows.
                unsafe {
                    self.launch(
                        self.f.embed.of(self.embed.dt),
                        "embed_rows",
                        &mut a.params(),
                        grid(self.n, 1, 256, 0),
                    )
                }?;
                Ok(())
            }
            Op::Attention(l) => self.attention(l),
            Op::Route(l, ml) => self.route(l, ml),
            Op::Moe(ml) => self.moe(ml, false),
            Op::MoeOne(ml) => self.moe(ml, true),
            Op::Combine(at) => self.combine(at),
            Op::DenseMlp(l) => self.dense_mlp(l),
            Op::Shared(l) => self.shared_expert(l),
            Op::Head(out) => self.head(out),
            Op::LinkStep | Op::LinkPost(..) | Op::LinkJoin(..) => self.link_op(op),
            Op::StepOne(l0, count, ml0) => self.step_one(l0, count, ml0),
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::model::LayerWeights;
    use crate::ops::{Bf16, Elems, Matrix};

    fn layer(router: Option<Matrix>, post_norm: Vec<f32>) -> LayerWeights {
        LayerWeights {
            input_norm: vec![1.0; 4],
            post_norm,
            qkv: Matrix::zeros(0, 4),
            mla: None,
            o: Matrix::zeros(4, 4),
            q_norm: Vec::new(),
            k_norm: Vec::new(),
            qkv_bias: Vec::new(),
            shared: None,
            router_bias: Vec::new(),
            router,
            dense_mlp: None,
            router_logit_bias: Vec::new(),
            o_bias: Vec::new(),
            sinks: Vec::new(),
        }
    }

    /// The stacked router of a guessing layer: its own rows bit for bit, then the next MoE
    /// layer's (a dense layer between skipped) with each column times that layer's norm
    /// weight over this one's (0 where this one's is 0); none for the last MoE layer or
    /// routers of different dtypes.
    #[test]
    fn the_stacked_router_is_this_one_then_the_next_rescaled() {
        let bf = |v: &[f32]| {
            Elems::Bf16(
                v.iter()
                    .map(|&x| Bf16(half::bf16::from_f32(x).to_bits()))
                    .collect(),
            )
        };
        let r0 = [1.0, 2.0, 3.0, 4.0, -1.0, -2.0, -3.0, -4.0];
        let r2 = [0.5, 0.25, 1.0, 2.0, 8.0, -8.0, 4.0, -4.0];
        let layers = vec![
            layer(Some(Matrix::of(2, 4, bf(&r0))), vec![1.0, 2.0, 0.0, 4.0]),
            layer(None, vec![1.0; 4]),
            layer(Some(Matrix::of(2, 4, bf(&r2))), vec![2.0, 2.0, 5.0, 1.0]),
            layer(Some(Matrix::new(2, 4, r0.to_vec())), vec![1.0; 4]),
        ];
        let g = super::guess_router(&layers, 0).expect("layer 0 guesses layer 2");
        assert_eq!((g.rows, g.cols), (4, 4));
        let got = g.to_f32();
        assert_eq!(&got[..8], &r0[..], "this router's rows");
        let ratio = [2.0, 1.0, 0.0, 0.25];
        let want: Vec<f32> = r2
            .iter()
            .enumerate()
            .map(|(i, w)| w * ratio[i % 4])
            .collect();
        assert_eq!(&got[8..], &want[..], "the next router's rows, rescaled");
        // a bf16 router followed by an f32 one, and the last MoE layer: no guess
        assert!(super::guess_router(&layers, 2).is_none());
        assert!(super::guess_router(&layers, 3).is_none());
        assert!(
            super::guess_router(&layers, 1).is_none(),
            "a dense layer has no router"
        );
    }

    /// The file lists that `MOELANE_KERNELS_DIR` reads make the embedded sources exactly.
    #[test]
    fn kernel_file_lists_match_the_embedded_sources() {
        let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../../kernels");
        let read = |files: &[&str]| -> String {
            files
                .iter()
                .map(|f| std::fs::read_to_string(dir.join(f)).expect("kernel file"))
                .collect()
        };
        assert_eq!(read(super::DENSE_FILES), super::DENSE_CU);
        assert_eq!(read(crate::cuda::EXPERTS_FILES), crate::cuda::EXPERTS_CU);
    }
}
