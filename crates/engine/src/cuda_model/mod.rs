//! The primary's decode step on the GPU (feature `cuda`): dense weights, the KV cache, the
//! hidden state, the router's top-k and the hot experts all live on the device; a step
//! uploads one small table (tokens, positions, block tables) and downloads the logits (or
//! only the argmax ids) and the step's picks for the counters. Nothing allocates in a warm
//! step: scratch buffers only grow.
//!
//! Dense products go through cuBLAS (f32, no TF32, so the GPU agrees with the CPU backend to
//! rounding); everything else is `kernels/dense.cu`, compiled by NVRTC at start. The MoE
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
    CudaFunction, CudaSlice, CudaStream, DevicePtr, DeviceRepr, LaunchConfig, PushKernelArg,
    ValidAsZeroBits,
};

use crate::bank::ExpertBank;
use crate::checkpoint::ExpertWeights;
use crate::config::ModelConfig;
use crate::cuda::Gpu;
use crate::error::{Error, Result};
use crate::kv::{SeqKv, BLOCK};
use crate::model::DenseWeights;
use crate::ops::Rope;
use crate::rowmap::{Tier, ValidMap};
use crate::sampling::TokenPick;
use crate::step::RowPos;

mod station;
mod step;
pub use station::*;
pub use step::{attach_gpu, GpuStep};

/// The dense kernels' source, compiled at run time.
pub const DENSE_CU: &str = include_str!("../../../../kernels/dense.cu");

/// Kernel parameters for [`launch_raw`]: a pointer to each argument's value, in order.
macro_rules! kargs {
    ($($a:expr),* $(,)?) => {
        [$($a as *const _ as *mut std::ffi::c_void),*]
    };
}

/// Launches `f` on `st` with `params` (pointers to the arguments' values, which must match
/// the kernel's parameters). With `pdl`, as a programmatic dependent launch (Hopper and
/// later): the kernel may be scheduled while its predecessor drains; every kernel of
/// dense.cu waits for its predecessor (`griddepcontrol.wait`) before touching memory, so the
/// order of effects is the stream's.
///
/// # Safety
/// The parameters must match the kernel's signature and every pointer they carry must be
/// valid for what the kernel reads and writes.
unsafe fn launch_raw(
    st: &Arc<CudaStream>,
    f: &CudaFunction,
    params: &mut [*mut std::ffi::c_void],
    pdl: bool,
    cfg: LaunchConfig,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    use cudarc::driver::sys;
    st.context().bind_to_thread()?;
    let mut attr: sys::CUlaunchAttribute = std::mem::zeroed();
    attr.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attr.value.programmaticStreamSerializationAllowed = 1;
    let lc = sys::CUlaunchConfig {
        gridDimX: cfg.grid_dim.0,
        gridDimY: cfg.grid_dim.1,
        gridDimZ: cfg.grid_dim.2,
        blockDimX: cfg.block_dim.0,
        blockDimY: cfg.block_dim.1,
        blockDimZ: cfg.block_dim.2,
        sharedMemBytes: cfg.shared_mem_bytes,
        hStream: st.cu_stream(),
        attrs: if pdl { &mut attr } else { std::ptr::null_mut() },
        numAttrs: pdl as u32,
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

struct Funcs {
    embed: CudaFunction,
    rmsnorm: CudaFunction,
    qk_rope_kv: CudaFunction,
    attention: CudaFunction,
    attention_decode: CudaFunction,
    attention_merge: CudaFunction,
    attention_tiled: CudaFunction,
    route_topk: CudaFunction,
    moe_up: CudaFunction,
    moe_down: CudaFunction,
    moe_down_pre: CudaFunction,
    scatter: CudaFunction,
    combine: CudaFunction,
    silu_mul: CudaFunction,
    argmax: CudaFunction,
    sample: CudaFunction,
    gen: CudaFunction,
    read_probe: CudaFunction,
    gemv: CudaFunction,
    norm_gemv: CudaFunction,
    hollow: CudaFunction,
}

fn funcs(gpu: &Gpu) -> Result<Funcs> {
    let m = gpu.module("dense", DENSE_CU)?;
    let f = |n: &str| {
        m.load_function(n)
            .map_err(|e| gerr(&format!("loading kernel {n}"), e))
    };
    Ok(Funcs {
        embed: f("embed_rows")?,
        rmsnorm: f("rmsnorm_rows")?,
        qk_rope_kv: f("qk_rope_kv")?,
        attention: f("attention")?,
        attention_decode: f("attention_decode")?,
        attention_merge: f("attention_merge")?,
        attention_tiled: f("attention_tiled")?,
        route_topk: f("route_topk")?,
        moe_up: f("moe_up")?,
        moe_down: f("moe_down")?,
        moe_down_pre: f("moe_down_pre")?,
        scatter: f("scatter_rows")?,
        combine: f("moe_combine")?,
        silu_mul: f("silu_mul")?,
        argmax: f("argmax_rows")?,
        sample: f("sample_rows")?,
        gen: f("gen_weights")?,
        read_probe: f("read_probe")?,
        gemv: f("gemv_rows")?,
        norm_gemv: f("norm_gemv_rows")?,
        hollow: f("hollow_step")?,
    })
}

struct Layer {
    input_norm: Buf<f32>,
    post_norm: Buf<f32>,
    qkv: Buf<f32>,
    o: Buf<f32>,
    q_norm: Buf<f32>,
    k_norm: Buf<f32>,
    router: Option<Buf<f32>>,
    mlp: Option<(Buf<f32>, Buf<f32>)>,
}

fn grid(x: usize, y: usize, threads: usize, shared: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (x as u32, y as u32, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: shared as u32,
    }
}

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
        let mut l = st.launch_builder(f);
        l.arg(&b.p)
            .arg(&n)
            .arg(&cols)
            .arg(&zc)
            .arg(&zr)
            .arg(&key)
            .arg(&scale);
        // SAFETY: `b` holds exactly n floats; the kernel writes w[0..n).
        unsafe { l.launch(grid(1024, 1, 256, 0)) }.map_err(|e| gerr("launching gen_weights", e))?;
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
        let mut l = kargs![&a.p, &n4, &out.p];
        // SAFETY: a holds n4 float4s; out 132*8 floats, one per block.
        unsafe { launch_raw(st, &f, &mut l, false, grid(132 * 8, 1, 256, 0)) }
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
/// sidecar's [`crate::cuda::GpuExperts`].
pub fn moe_kernels(gpu: &Gpu) -> Result<(CudaFunction, CudaFunction)> {
    let f = funcs(gpu)?;
    Ok((f.moe_up, f.moe_down))
}

/// Loads the dense kernels' module on `gpu` and returns the generator kernel (for a sidecar
/// that generates its experts).
pub fn gen_kernel(gpu: &Gpu) -> Result<CudaFunction> {
    Ok(funcs(gpu)?.gen)
}

/// The model on one GPU. See the module comment.
pub struct GpuModel {
    pub gpu: Arc<Gpu>,
    st: Arc<CudaStream>,
    blas: CudaBlas,
    f: Funcs,
    cfg: ModelConfig,
    layers: Vec<Layer>,
    embed: Buf<f32>,
    norm: Buf<f32>,
    head: Option<Buf<f32>>,
    cos: Buf<f32>,
    sin: Buf<f32>,
    max_pos: usize,
    kc: Vec<Buf<f32>>,
    vc: Vec<Buf<f32>>,
    kv_blocks: usize,
    experts: HashMap<(usize, usize), (Buf<f32>, Buf<f32>)>,
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
    rlog: Buf<f32>,
    idx: Buf<i32>,
    wts: Buf<f32>,
    act: Buf<f32>,
    y: Buf<f32>,
    meta: Buf<i32>,
    logits: Buf<f32>,
    amax: Buf<i32>,
    /// per logit row (temperature, top_p, u) of a sampling head, and its probabilities
    spec: Buf<f64>,
    probs: Buf<f32>,
    cold_src: Buf<f32>,
    cold_slots: Buf<i32>,
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
    /// the router's top-k keeps a row in registers when it has at most 32 * TOPK_REG
    /// experts (`set_register_topk(false)`: in shared memory, the same picks; for tests)
    register_topk: bool,
    /// step kernels launched hollow (`MOELANE_CUDA_HOLLOW`: names or "all"; a diagnostic,
    /// the results are wrong), to time what each one costs in the chain
    hollow: Vec<String>,
}

/// Warps of a decode attention block.
const ATT_WARPS: usize = 16;

/// Router logits per lane the top-k keeps in registers (TOPK_REG of kernels/dense.cu).
const TOPK_REG: usize = 16;

/// A captured run: (rows, logit rows, decode only, attention splits, prefill tiles, scratch
/// generation, the ops).
type GraphKey = (usize, usize, bool, usize, usize, u64, Vec<Op>);

/// Rows per block of prefill attention (ATT_TILE of kernels/dense.cu).
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
    Combine,
    DenseMlp(usize),
    /// final norm and the LM head for the step's logit rows, then what the step returns
    Head(HeadOut),
}

pub use crate::step::HeadOut;

impl GpuModel {
    /// Uploads the dense weights of `cfg` and makes a KV cache of `kv_blocks` blocks on `gpu`.
    pub fn new(
        gpu: Arc<Gpu>,
        cfg: &ModelConfig,
        w: &DenseWeights,
        kv_blocks: usize,
    ) -> Result<Self> {
        if cfg.head_dim > 128 || cfg.head_dim % 2 != 0 {
            return Err(Error::Gpu(format!(
                "head_dim {} is not supported on the GPU (even, at most 128)",
                cfg.head_dim
            )));
        }
        if cfg.num_attention_heads + cfg.num_key_value_heads > 32 {
            return Err(Error::Gpu(format!(
                "{} query + {} key/value heads: the GPU kernel takes at most 32 together",
                cfg.num_attention_heads, cfg.num_key_value_heads
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
        let graphs = env_on("MOELANE_CUDA_GRAPHS");
        let pdl = gpu.cc.0 >= 9 && env_on("MOELANE_CUDA_PDL");
        let prefetch = env_on("MOELANE_CUDA_PREFETCH");
        let att_wave = {
            use cudarc::driver::sys::CUdevice_attribute_enum as A;
            let sms = gpu
                .ctx
                .attribute(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
                .map_err(|e| gerr("reading the SM count", e))? as usize;
            let per = f
                .attention_decode
                .occupancy_max_active_blocks_per_multiprocessor(
                    32 * ATT_WARPS as u32,
                    (ATT_WARPS + 3) * cfg.head_dim * 4,
                    None,
                )
                .map_err(|e| gerr("reading decode attention's occupancy", e))?
                as usize;
            sms * per.max(1)
        };
        let up = |v: &[f32]| Buf::from_host(&st, v);
        let mut layers = Vec::with_capacity(w.layers.len());
        for l in &w.layers {
            layers.push(Layer {
                input_norm: up(&l.input_norm)?,
                post_norm: up(&l.post_norm)?,
                qkv: up(&l.qkv.data)?,
                o: up(&l.o.data)?,
                q_norm: up(&l.q_norm)?,
                k_norm: up(&l.k_norm)?,
                router: l.router.as_ref().map(|r| up(&r.data)).transpose()?,
                mlp: match &l.dense_mlp {
                    Some(m) => Some((up(&m.gate_up.data)?, up(&m.down.data)?)),
                    None => None,
                },
            });
        }
        let max_pos = cfg.max_position_embeddings.min(1 << 16);
        let rope = Rope::new(cfg.head_dim, cfg.rope_theta, max_pos);
        let per_layer = kv_blocks * BLOCK * cfg.kv_dim();
        let mut kc = Vec::new();
        let mut vc = Vec::new();
        for _ in 0..cfg.num_hidden_layers {
            kc.push(Buf::zeros(&st, per_layer)?);
            vc.push(Buf::zeros(&st, per_layer)?);
        }
        let moe = cfg.moe_layers().len();
        let e = cfg.num_experts;
        let m = GpuModel {
            embed: up(&w.embed.data)?,
            norm: up(&w.norm)?,
            head: w.lm_head.as_ref().map(|h| up(&h.data)).transpose()?,
            cos: up(&rope.cos)?,
            sin: up(&rope.sin)?,
            max_pos,
            kc,
            vc,
            kv_blocks,
            experts: HashMap::new(),
            generated: false,
            tab_gu: Buf::zeros(&st, moe * e)?,
            tab_dn: Buf::zeros(&st, moe * e)?,
            moe,
            x: Buf::zeros(&st, 1)?,
            h: Buf::zeros(&st, 1)?,
            qkv: Buf::zeros(&st, 1)?,
            att: Buf::zeros(&st, 1)?,
            rlog: Buf::zeros(&st, 1)?,
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
            tiled_prefill: env_on("MOELANE_CUDA_TILED_PREFILL"),
            _workspace: workspace,
            graphs,
            pdl,
            prefetch,
            generation: 0,
            captured: HashMap::new(),
            profile: None,
            seen: HashMap::new(),
            splits: 1,
            split_attention: env_on("MOELANE_CUDA_ATTN_SPLIT"),
            att_part: Buf::zeros(&st, 1)?,
            att_wave,
            preload: env_on("MOELANE_CUDA_PRELOAD"),
            register_topk: true,
            hollow: std::env::var("MOELANE_CUDA_HOLLOW")
                .map(|v| hollow_list(&v))
                .unwrap_or_default(),
            layers,
            cfg: cfg.clone(),
            f,
            blas,
            st,
            gpu,
        };
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
        self.experts.len() * 3 * self.cfg.hidden_size * self.cfg.moe_intermediate_size * 4
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
        Ok(())
    }

    fn put_expert(&mut self, l: usize, e: usize, w: &ExpertWeights) -> Result<()> {
        let gu = Buf::from_host(&self.st, &w.gate_up.data)?;
        let dn = Buf::from_host(&self.st, &w.down.data)?;
        self.experts.insert((l, e), (gu, dn));
        Ok(())
    }

    /// Generates the given experts of a hashed model (the `station` preset) on the device.
    pub fn generate(&mut self, seed: u64, which: &[(usize, usize)]) -> Result<()> {
        self.generated = true;
        let (h, i) = (self.cfg.hidden_size, self.cfg.moe_intermediate_size);
        for &(l, e) in which {
            let w = gen_expert(&self.st, &self.f.gen, seed, l, e, h, i)?;
            self.experts.insert((l, e), w);
        }
        self.sync()
    }

    /// Points every MoE layer's expert table at the experts `map` puts hot; cold ones get a
    /// null entry (their slots are filled from the cold tier's reply). Fails, changing
    /// nothing, when a hot expert is not on this GPU.
    pub fn set_map(&mut self, map: &ValidMap) -> Result<()> {
        let e = self.cfg.num_experts;
        let mut gu = vec![0u64; self.moe * e];
        let mut dn = vec![0u64; self.moe * e];
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
                }
            }
        }
        self.tab_gu.write(&self.st, &gu)?;
        self.tab_dn.write(&self.st, &dn)?;
        self.sync()
    }

    #[allow(clippy::too_many_arguments)]
    fn gemm(
        &self,
        what: &'static str,
        w: u64,
        out_dim: usize,
        in_dim: usize,
        x: u64,
        n: usize,
        y: u64,
        beta: f32,
    ) -> Result<()> {
        if n <= 4 {
            let (o, i, ni) = (out_dim as i32, in_dim as i32, n as i32);
            let v4 = (in_dim % 4 == 0) as i32;
            let (pf, pre) = (self.prefetch as i32, self.preload as i32);
            let mut b = kargs![&w, &x, &y, &o, &i, &ni, &beta, &v4, &pf, &pre];
            // SAFETY: as below; n <= 4 rows.
            return unsafe {
                self.launch(
                    &self.f.gemv,
                    what,
                    &mut b,
                    grid(out_dim.div_ceil(8), 1, 256, 0),
                )
            };
        }
        let alpha = 1f32;
        // y[n, out] (row-major) = x[n, in] . w[out, in]^T, i.e. column-major
        // y^T[out, n] = w^T' [out, in] x^T [in, n] with w read transposed.
        // SAFETY: w holds out*in floats, x n*in, y n*out (the callers size them), all on the
        // handle's stream.
        unsafe {
            cudarc::cublas::result::sgemm(
                *self.blas.handle(),
                blas::cublasOperation_t::CUBLAS_OP_T,
                blas::cublasOperation_t::CUBLAS_OP_N,
                out_dim as i32,
                n as i32,
                in_dim as i32,
                &alpha,
                w as *const f32,
                in_dim as i32,
                x as *const f32,
                in_dim as i32,
                &beta,
                y as *mut f32,
                out_dim as i32,
            )
        }
        .map_err(|e| gerr("cuBLAS sgemm", e))?;
        self.mark("cublas sgemm")
    }

    /// Launches a step kernel on this model's stream (a programmatic dependent launch when
    /// `pdl`), naming it in errors and in the profile.
    ///
    /// # Safety
    /// As [`launch_raw`]: `params` match `f`'s signature and every pointer is valid for it.
    unsafe fn launch(
        &self,
        f: &CudaFunction,
        name: &'static str,
        params: &mut [*mut std::ffi::c_void],
        cfg: LaunchConfig,
    ) -> Result<()> {
        let names = |h: &str| h == "all" || h == name || name.split(':').next() == Some(h);
        let hollow = self.hollow.iter().any(|h| !h.starts_with('!') && names(h))
            && !self
                .hollow
                .iter()
                .any(|h| h.strip_prefix('!').is_some_and(names));
        if hollow {
            let cfg = LaunchConfig {
                shared_mem_bytes: 0,
                ..cfg
            };
            launch_raw(&self.st, &self.f.hollow, &mut [], self.pdl, cfg)
        } else {
            launch_raw(&self.st, f, params, self.pdl, cfg)
        }
        .map_err(|e| gerr(&format!("launching {name}"), e))?;
        self.mark(name)
    }

    /// y[n, out] = w . norm(x) with RMSNorm weight `nw`, writing the normed rows to `h`
    /// when `h` is non-zero: one fused kernel for n <= 4, else the norm then cuBLAS.
    #[allow(clippy::too_many_arguments)]
    fn normed_product(
        &self,
        what: &'static str,
        w: u64,
        out_dim: usize,
        x: u64,
        nw: u64,
        h: u64,
        n: usize,
        y: u64,
    ) -> Result<()> {
        let in_dim = self.cfg.hidden_size;
        if n > 4 {
            self.rmsnorm(x, 0, nw, self.h.p, n)?;
            return self.gemm(what, w, out_dim, in_dim, self.h.p, n, y, 0.0);
        }
        let (o, i, ni) = (out_dim as i32, in_dim as i32, n as i32);
        let eps = self.cfg.rms_norm_eps;
        let v4 = (in_dim % 4 == 0) as i32;
        let (pf, pre) = (self.prefetch as i32, self.preload as i32);
        let mut b = kargs![&w, &x, &nw, &h, &y, &o, &i, &ni, &eps, &v4, &pf, &pre];
        // SAFETY: w holds out*in floats, x and h n rows of in, nw in, y n rows of out.
        unsafe {
            self.launch(
                &self.f.norm_gemv,
                what,
                &mut b,
                grid(out_dim.div_ceil(8), 1, 256, 0),
            )
        }
    }

    /// With profiling on: records a timing event after the work launched since the last
    /// mark, charged to `what` (the GPU's own clock: no host wait between kernels).
    fn mark(&self, what: &'static str) -> Result<()> {
        if let Some(p) = &self.profile {
            use cudarc::driver::sys::CUevent_flags;
            let ev = self
                .st
                .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(|e| gerr("recording a CUDA event", e))?;
            p.lock()
                .map_err(|_| Error::Gpu("profile poisoned".into()))?
                .events
                .push((what, ev));
        }
        Ok(())
    }

    /// Turns the per-kernel profile on (kernels launched one by one, each followed by a
    /// timing event) or off; returns what was gathered: (kernel, total ns, launches),
    /// largest first. A kernel's time runs from the previous kernel's end to its own end.
    pub fn set_profile(&mut self, on: bool) -> Vec<(&'static str, u64, u64)> {
        use cudarc::driver::sys::CUevent_flags;
        let old = self.profile.take();
        if on {
            if let Ok(start) = self.st.record_event(Some(CUevent_flags::CU_EVENT_DEFAULT)) {
                self.profile = Some(std::sync::Mutex::new(Profile {
                    start,
                    events: Vec::new(),
                }));
            }
        }
        let mut by: HashMap<&'static str, (u64, u64)> = HashMap::new();
        if let Some(p) = old.and_then(|p| p.into_inner().ok()) {
            let _ = self.sync();
            let mut prev = &p.start;
            for (what, ev) in &p.events {
                let ms = prev.elapsed_ms(ev).unwrap_or(0.0);
                let e = by.entry(what).or_insert((0, 0));
                e.0 += (ms as f64 * 1e6) as u64;
                e.1 += 1;
                prev = ev;
            }
        }
        let mut v: Vec<(&'static str, u64, u64)> =
            by.into_iter().map(|(k, (a, b))| (k, a, b)).collect();
        v.sort_by_key(|x| std::cmp::Reverse(x.1));
        v
    }

    fn rmsnorm(&self, x: u64, rows: u64, w: u64, y: u64, n: usize) -> Result<()> {
        let h = self.cfg.hidden_size as i32;
        let eps = self.cfg.rms_norm_eps;
        let mut b = kargs![&x, &rows, &w, &y, &h, &eps];
        // SAFETY: x holds the source rows (rows[i] < its row count when given), y n rows,
        // w h floats.
        unsafe { self.launch(&self.f.rmsnorm, "rmsnorm_rows", &mut b, grid(n, 1, 256, 0)) }?;
        Ok(())
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
        let dense_i = c.intermediate_size;
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
        let wide = (c.q_dim() + 2 * c.kv_dim()).max(2 * dense_i);
        moved |= self.x.grow(&st, n * hs)?;
        moved |= self.h.grow(&st, n * hs)?;
        moved |= self.qkv.grow(&st, n * wide)?;
        moved |= self.att.grow(&st, n * c.q_dim().max(dense_i))?;
        moved |= self.rlog.grow(&st, n * ne)?;
        moved |= self.idx.grow(&st, self.moe.max(1) * n * k)?;
        moved |= self.wts.grow(&st, n * k)?;
        moved |= self.act.grow(&st, n * k * c.moe_intermediate_size)?;
        moved |= self.y.grow(&st, n * k * hs)?;
        moved |= self.logits.grow(&st, m * c.vocab_size)?;
        moved |= self.amax.grow(&st, m)?;
        moved |= self.spec.grow(&st, 3 * m)?;
        let decode_only = n == seqs.len();
        let longest = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        self.splits = if decode_only && self.split_attention {
            attention_splits(longest, n, c.num_attention_heads, self.att_wave)
        } else {
            1
        };
        let part = n * c.num_attention_heads * self.splits * (c.head_dim + 2);
        moved |= self.att_part.grow(&st, part)?;
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
                let mut b = kargs![&self.embed.p, &self.meta.p, &self.x.p, &h];
                // SAFETY: every token id was checked < vocab in `begin`; x holds n rows.
                unsafe {
                    self.launch(&self.f.embed, "embed_rows", &mut b, grid(self.n, 1, 256, 0))
                }?;
                Ok(())
            }
            Op::Attention(l) => self.attention(l),
            Op::Route(l, ml) => self.route(l, ml),
            Op::Moe(ml) => self.moe(ml),
            Op::Combine => self.combine(),
            Op::DenseMlp(l) => self.dense_mlp(l),
            Op::Head(out) => self.head(out),
        }
    }

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
                TokenPick::Greedy => [0.0, 1.0, 0.0],
                TokenPick::Sample {
                    temperature,
                    top_p,
                    u,
                } => [temperature as f64, top_p as f64, u],
            })
            .collect();
        self.spec.write(&st, &spec)
    }

    fn head(&mut self, out: HeadOut) -> Result<()> {
        let c = &self.cfg;
        let (hs, v, m) = (c.hidden_size, c.vocab_size, self.m);
        if m == 0 {
            return Ok(());
        }
        self.rmsnorm(self.x.p, self.o_lrows, self.norm.p, self.h.p, m)?;
        let head = self.head.as_ref().unwrap_or(&self.embed).p;
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
                let mut b = kargs![&self.logits.p, &self.amax.p, &vi];
                // SAFETY: logits holds m rows of V; amax m ints (sized in `begin`).
                unsafe { self.launch(&self.f.argmax, "argmax_rows", &mut b, grid(m, 1, 256, 0)) }?;
            }
            HeadOut::Sample => {
                if self.probs.len < m * v {
                    return Err(Error::Gpu("a sampling head without set_picks".into()));
                }
                let mut b = kargs![
                    &self.logits.p,
                    &self.spec.p,
                    &self.probs.p,
                    &self.amax.p,
                    &vi
                ];
                // SAFETY: logits and probs hold m rows of V, spec 3m doubles (written by
                // set_picks), amax m ints.
                unsafe { self.launch(&self.f.sample, "sample_rows", &mut b, grid(m, 1, 1024, 0)) }?;
            }
        }
        Ok(())
    }

    /// x += attention(input_norm(x)) of decoder layer `l`, writing K/V of every row.
    pub fn attention(&mut self, l: usize) -> Result<()> {
        let c = &self.cfg;
        let n = self.n;
        let (qd, kvd, hs) = (c.q_dim(), c.kv_dim(), c.hidden_size);
        let lw = &self.layers[l];
        self.normed_product(
            "norm_gemv_rows:qkv",
            lw.qkv.p,
            qd + 2 * kvd,
            self.x.p,
            lw.input_norm.p,
            0,
            n,
            self.qkv.p,
        )?;
        let (nh, nkv, hd) = (
            c.num_attention_heads as i32,
            c.num_key_value_heads as i32,
            c.head_dim as i32,
        );
        let eps = c.rms_norm_eps;
        let scale = 1.0 / (c.head_dim as f32).sqrt();
        // 16 warps take the positions in turn: a decode row's chain of dependent loads is
        // 1/16 of its context (or of its range of it) long
        let nw = ATT_WARPS;
        if self.decode_only {
            let mut b = kargs![
                &self.qkv.p,
                &lw.q_norm.p,
                &lw.k_norm.p,
                &self.cos.p,
                &self.sin.p,
                &self.kc[l].p,
                &self.vc[l].p,
                &self.o_pos,
                &self.o_tab,
                &self.o_blocks,
                &self.att.p,
                &nh,
                &nkv,
                &hd,
                &eps,
                &scale,
                &self.att_part.p
            ];
            let mut cfg = grid(n, c.num_attention_heads, 32 * nw, (nw + 3) * c.head_dim * 4);
            cfg.grid_dim.2 = self.splits as u32;
            // SAFETY: positions < max_pos and their blocks < kv_blocks were checked in
            // `begin`; qkv holds n rows of q_dim + 2 kv_dim, att n rows of q_dim, att_part
            // n * heads * splits partials (`begin`); every row is its own sequence's
            // (decode_only), so no two rows write one cache slot.
            unsafe { self.launch(&self.f.attention_decode, "attention_decode", &mut b, cfg) }?;
            if self.splits > 1 {
                let sp = self.splits as i32;
                let mut b = kargs![&self.att_part.p, &self.att.p, &nh, &hd, &sp];
                // SAFETY: att_part holds the partials the kernel above wrote, att n rows.
                unsafe {
                    self.launch(
                        &self.f.attention_merge,
                        "attention_merge",
                        &mut b,
                        grid(n, c.num_attention_heads, c.head_dim.next_multiple_of(32), 0),
                    )
                }?;
            }
            return self.gemm("gemv_rows:o", lw.o.p, hs, qd, self.att.p, n, self.x.p, 1.0);
        }
        let mut b = kargs![
            &self.qkv.p,
            &lw.q_norm.p,
            &lw.k_norm.p,
            &self.cos.p,
            &self.sin.p,
            &self.o_pos,
            &self.o_tab,
            &self.o_blocks,
            &self.kc[l].p,
            &self.vc[l].p,
            &nh,
            &nkv,
            &hd,
            &eps
        ];
        let heads = c.num_attention_heads + c.num_key_value_heads;
        // SAFETY: positions < max_pos and their blocks < kv_blocks were checked in `begin`;
        // qkv holds n rows of q_dim + 2 kv_dim.
        unsafe {
            self.launch(
                &self.f.qk_rope_kv,
                "qk_rope_kv",
                &mut b,
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
        let mut b = kargs![
            &self.qkv.p,
            &self.kc[l].p,
            &self.vc[l].p,
            &self.o_pos,
            &self.o_tab,
            &self.o_blocks,
            &self.o_tiles,
            &self.att.p,
            &nh,
            &nkv,
            &hd,
            &scale
        ];
        // SAFETY: as above; the tiles (first row, count <= ATT_TILE, rows of one sequence)
        // were built in `begin` from these rows; att holds n rows of q_dim.
        unsafe { self.launch(f, name, &mut b, cfg) }?;
        self.gemm("gemv_rows:o", lw.o.p, hs, qd, self.att.p, n, self.x.p, 1.0)
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
        // h (the normed rows) feeds the experts: written by the fused kernel or the norm
        self.normed_product(
            "norm_gemv_rows:router",
            router.p,
            ne,
            self.x.p,
            lw.post_norm.p,
            self.h.p,
            n,
            self.rlog.p,
        )?;
        let regs = (self.register_topk && ne <= TOPK_REG * 32) as i32;
        let mut b = kargs![&self.rlog.p, &idx, &self.wts.p, &e, &ki, &norm, &regs];
        let smem = if regs != 0 { 0 } else { ne * 4 };
        // SAFETY: rlog holds n rows of E; idx has room for the ml-th layer's n*k ids; E
        // floats of shared memory unless the row stays in registers (E <= 32 * TOPK_REG).
        unsafe {
            self.launch(
                &self.f.route_topk,
                "route_topk",
                &mut b,
                grid(n, 1, 32, smem),
            )
        }?;
        Ok(())
    }

    /// Downloads MoE layer `ml`'s picks `[n, k]` and normed activations `[n, H]` (waits).
    pub fn fetch_route(&mut self, ml: usize, idx: &mut Vec<i32>, h: &mut Vec<f32>) -> Result<()> {
        h.resize(self.n * self.cfg.hidden_size, 0.0);
        self.h.read(&self.st, &mut h[..])?;
        self.fetch_picks(ml, idx)
    }

    /// The hot experts' outputs of MoE layer `ml` into their pick slots.
    pub fn moe(&mut self, ml: usize) -> Result<()> {
        let c = &self.cfg;
        let (n, k, hs, i, ne) = (
            self.n,
            c.num_experts_per_tok,
            c.hidden_size,
            c.moe_intermediate_size,
            c.num_experts,
        );
        let nk = n * k;
        let idx = self.idx.p + (4 * ml * nk) as u64;
        let gu = self.tab_gu.p + (8 * ml * ne) as u64;
        let dn = self.tab_dn.p + (8 * ml * ne) as u64;
        let (nki, ki, hi, ii) = (nk as i32, k as i32, hs as i32, i as i32);
        let v_up = (hs % 4 == 0) as i32;
        let v_dn = (i % 4 == 0) as i32;
        // one row's picks are distinct experts: every block leads its slot
        let distinct = (n == 1) as i32;
        let mut b = kargs![
            &idx,
            &gu,
            &self.h.p,
            &self.act.p,
            &nki,
            &ki,
            &hi,
            &ii,
            &v_up,
            &0u64,
            &distinct
        ];
        // SAFETY: ids < E (the router's top-k), table entries are null or resident experts of
        // [2I, H]; h holds n rows, act n*k rows of I; float4 reads only when H % 4 == 0.
        unsafe {
            self.launch(
                &self.f.moe_up,
                "moe_up",
                &mut b,
                grid(nk, i.div_ceil(8), 256, 0),
            )
        }?;
        let mut b = kargs![
            &idx,
            &dn,
            &self.act.p,
            &self.y.p,
            &nki,
            &hi,
            &ii,
            &v_dn,
            &distinct
        ];
        // the preloading kernel takes more registers: fewer blocks resident, which costs
        // the bandwidth-bound large batches more than the early loads gain (measured)
        let (down, name) = if self.preload && n <= 4 {
            (&self.f.moe_down_pre, "moe_down:pre")
        } else {
            (&self.f.moe_down, "moe_down")
        };
        // SAFETY: as above, down [H, I]; y holds n*k rows of H.
        unsafe { self.launch(down, name, &mut b, grid(nk, hs.div_ceil(8), 256, 0)) }?;
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
        let mut b = kargs![&src, &self.cold_slots.p, &self.y.p, &h];
        // SAFETY: slots were checked < n*k; src holds slots.len() rows (the caller's word).
        unsafe {
            self.launch(
                &self.f.scatter,
                "scatter_rows",
                &mut b,
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
    fn drop_graphs(&mut self) {
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

    /// x += the picks' outputs weighted by the router, in rank order.
    pub fn combine(&mut self) -> Result<()> {
        let c = &self.cfg;
        let (k, h) = (c.num_experts_per_tok as i32, c.hidden_size as i32);
        let mut b = kargs![&self.x.p, &self.y.p, &self.wts.p, &k, &h];
        // SAFETY: x holds n rows, y n*k rows, wts n*k.
        unsafe {
            self.launch(
                &self.f.combine,
                "moe_combine",
                &mut b,
                grid(self.n, self.cfg.hidden_size.div_ceil(128), 128, 0),
            )
        }?;
        Ok(())
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
            gu.p,
            2 * i,
            hs,
            self.h.p,
            n,
            self.qkv.p,
            0.0,
        )?;
        let ii = i as i32;
        let mut b = kargs![&self.qkv.p, &self.att.p, &ii];
        // SAFETY: qkv holds n rows of 2I (sized in `begin`), att n rows of I.
        unsafe { self.launch(&self.f.silu_mul, "silu_mul", &mut b, grid(n, 1, 256, 0)) }?;
        self.gemm(
            "gemv_rows:mlp_down",
            dn.p,
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
