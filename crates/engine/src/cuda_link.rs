//! The device mailbox of the `ipc` link (feature `cuda`): buffers allocated by each process
//! with `cuMemAlloc`, exported with CUDA IPC handles, opened by the other process (on the
//! same GPU, or on a peer over NVLink), and the kernels of `kernels/link.cu` that post a
//! layer's picks and rows into the sidecar's box, wait on flags with acquire semantics at
//! system scope, and copy replies into pick slots. The layouts are written out in
//! `kernels/link.cu`; [`BoxLayout`] computes their offsets, the same on both sides.

use std::sync::Arc;

use cudarc::driver::{sys, CudaFunction, CudaStream, LaunchConfig};

use crate::cuda::{gpu_err, Gpu};
use crate::cuda_model::launch_raw;
use crate::error::{Error, Result};
pub use crate::tier::{BoxLayout, MailboxPtrs};

/// Whether the link's kernels and the sidecar's experts are launched as programmatic
/// dependents of the kernel before them, so each one's launch overlaps the previous one's
/// run (`MOELANE_IPC_PDL=0` turns it off; compute capability 9.0 and later).
pub fn ipc_pdl() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var("MOELANE_IPC_PDL").map_or(true, |v| v != "0"))
}

/// The link's kernels' source, compiled at run time.
pub const LINK_CU: &str = include_str!("../../../kernels/link.cu");
/// The files [`LINK_CU`] is made of.
pub const LINK_FILES: &[&str] = &["link.cu"];

/// Words of the primary's meta before the per-layer wait counters.
pub const META_HEAD_WORDS: usize = 8;
/// The reply's code when the primary's wait ran past its bound.
pub const CODE_TIMED_OUT: u64 = 0xFF;
/// The reply's code when the sidecar's own wait failed (its primary stopped posting).
pub const CODE_PEER_FAILED: u64 = 0xFE;
/// The sidecar's status when its host cancelled the program (nothing more is written to
/// the primary's memory).
pub const CODE_CANCELLED: u64 = 0xFC;
/// The reply's code when a pick slot the primary left to the sidecar was not computed
/// there (the two maps disagree).
pub const CODE_NOT_COMPUTED: u64 = 0xFD;
/// The reply's code when the sidecar does not serve the step's map epoch.
pub const CODE_EPOCH: u64 = 0x01;
/// The reply's code when the sidecar failed otherwise (its log says how).
pub const CODE_FAILED: u64 = 0x02;

/// A buffer of device memory shared between two processes: allocated here and exported,
/// or opened from the other process's handle.
pub struct IpcMem {
    gpu: Arc<Gpu>,
    pub ptr: u64,
    pub bytes: usize,
    owned: bool,
}

impl IpcMem {
    /// Allocates `bytes` (zeroed) to export (`cuMemAlloc`: stream-ordered pool memory
    /// cannot be exported).
    pub fn alloc(gpu: &Arc<Gpu>, bytes: usize) -> Result<Self> {
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| gpu_err("binding the CUDA context", e))?;
        // SAFETY: a plain allocation of `bytes` on the bound context; freed on drop.
        let ptr = unsafe { cudarc::driver::result::malloc_sync(bytes.max(256)) }
            .map_err(|e| gpu_err(&format!("allocating {bytes} bytes to share"), e))?;
        let m = IpcMem {
            gpu: gpu.clone(),
            ptr,
            bytes,
            owned: true,
        };
        // SAFETY: ptr addresses bytes.max(256) bytes just allocated.
        unsafe { cudarc::driver::result::memset_d8_sync(ptr, 0, bytes.max(256)) }
            .map_err(|e| gpu_err("clearing a shared buffer", e))?;
        Ok(m)
    }

    /// The handle another process opens this buffer with (64 bytes).
    pub fn handle(&self) -> Result<[u8; 64]> {
        if !self.owned {
            return Err(Error::Internal(
                "an opened buffer is not exported again".into(),
            ));
        }
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| gpu_err("binding the CUDA context", e))?;
        let mut h = sys::CUipcMemHandle_st { reserved: [0; 64] };
        // SAFETY: `ptr` is a cuMemAlloc allocation of this context; `h` is written.
        unsafe { sys::cuIpcGetMemHandle(&mut h, self.ptr) }
            .result()
            .map_err(|e| gpu_err("exporting a buffer (cuIpcGetMemHandle)", e))?;
        Ok(h.reserved.map(|c| c as u8))
    }

    /// Opens another process's buffer of `bytes` from its handle (peer access enabled when
    /// it lives on another GPU).
    pub fn open(gpu: &Arc<Gpu>, handle: &[u8; 64], bytes: usize) -> Result<Self> {
        gpu.ctx
            .bind_to_thread()
            .map_err(|e| gpu_err("binding the CUDA context", e))?;
        let h = sys::CUipcMemHandle_st {
            reserved: handle.map(|b| b as std::ffi::c_char),
        };
        let mut ptr: sys::CUdeviceptr = 0;
        // SAFETY: `h` is a handle's 64 bytes; the driver checks it and fails on a bad one.
        unsafe {
            sys::cuIpcOpenMemHandle_v2(
                &mut ptr,
                h,
                sys::CUipcMem_flags::CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS as u32,
            )
        }
        .result()
        .map_err(|e| {
            gpu_err(
                "opening the other process's buffer (cuIpcOpenMemHandle; the process must be alive and its GPU reachable)",
                e,
            )
        })?;
        Ok(IpcMem {
            gpu: gpu.clone(),
            ptr,
            bytes,
            owned: false,
        })
    }
}

impl Drop for IpcMem {
    fn drop(&mut self) {
        if self.gpu.ctx.bind_to_thread().is_err() {
            return;
        }
        // SAFETY: `ptr` came from cuMemAlloc (owned) or cuIpcOpenMemHandle (opened) here,
        // and nothing uses it after the drop.
        unsafe {
            if self.owned {
                let _ = cudarc::driver::result::free_sync(self.ptr);
            } else {
                let _ = sys::cuIpcCloseMemHandle(self.ptr);
            }
        }
    }
}

/// The link kernels, loaded on one GPU.
pub struct LinkKernels {
    post_step: CudaFunction,
    post: CudaFunction,
    join: CudaFunction,
    wait: CudaFunction,
    reply: CudaFunction,
}

fn cfg(blocks: usize, threads: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks.max(1) as u32, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

macro_rules! params {
    ($($a:expr),* $(,)?) => {
        [$(std::ptr::addr_of_mut!($a) as *mut std::ffi::c_void),*]
    };
}

impl LinkKernels {
    pub fn load(gpu: &Gpu) -> Result<Self> {
        let src = crate::cuda::kernel_source(LINK_CU, LINK_FILES)?;
        let m = gpu.module("link", &src)?;
        let f = |n: &str| {
            m.load_function(n)
                .map_err(|e| gpu_err(&format!("loading kernel {n}"), e))
        };
        Ok(LinkKernels {
            post_step: f("link_post_step")?,
            post: f("link_post")?,
            join: f("link_join")?,
            wait: f("link_wait")?,
            reply: f("link_reply")?,
        })
    }

    /// The step's head into the request box at `req_box` from `meta`.
    ///
    /// # Safety
    /// `req_box` and `meta` address a request box and a primary meta of the link's layout.
    pub unsafe fn post_step(&self, st: &Arc<CudaStream>, req_box: u64, meta: u64) -> Result<()> {
        let (mut b, mut m) = (req_box, meta);
        let mut p = params!(b, m);
        unsafe { launch_raw(st, &self.post_step, &mut p, false, cfg(1, 32)) }
            .map_err(|e| gpu_err("launching link_post_step", e))
    }

    /// Layer `ml`'s `nk` picks at `idx` and `nh` floats of rows at `h` into the box; its flag.
    ///
    /// # Safety
    /// The pointers address buffers of those sizes; `nk` and `nh` fit the box's layout;
    /// `done` is a counter at 0.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn post(
        &self,
        st: &Arc<CudaStream>,
        lay: &BoxLayout,
        req_box: u64,
        ml: usize,
        idx: u64,
        nk: usize,
        h: u64,
        nh: usize,
        meta: u64,
        done: u64,
        round: usize,
        pdl: bool,
    ) -> Result<()> {
        let (mut b, mut l, mut i, mut n, mut hh, mut nhh) =
            (req_box, ml as i32, idx, nk as i32, h, nh as i32);
        let (mut io, mut ho, mut m, mut d) = (lay.idx_off() as i64, lay.h_off() as i64, meta, done);
        let mut r = round as i32;
        let mut p = params!(b, l, i, n, hh, nhh, io, ho, m, d, r);
        let blocks = (nh / 4).div_ceil(256).clamp(1, 32);
        unsafe { launch_raw(st, &self.post, &mut p, pdl, cfg(blocks, 256)) }
            .map_err(|e| gpu_err("launching link_post", e))
    }

    /// Waits for layer `ml`'s reply and copies its rows into the slots this GPU's table
    /// leaves null.
    ///
    /// # Safety
    /// The pointers address the reply box, the meta, the step's `nk` slots of H floats,
    /// the layer's picks and its expert table (E entries).
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn join(
        &self,
        st: &Arc<CudaStream>,
        lay: &BoxLayout,
        reply_box: u64,
        ml: usize,
        meta: u64,
        y: u64,
        idx: u64,
        gu_tab: u64,
        nk: usize,
        round: usize,
    ) -> Result<()> {
        let (mut r, mut l, mut m, mut cy, mut yy) = (
            reply_box,
            ml as i32,
            meta,
            reply_box + lay.y_off() as u64,
            y,
        );
        let (mut i, mut g, mut h, mut mk) = (
            idx,
            gu_tab,
            lay.hidden as i32,
            reply_box + lay.mark_off() as u64,
        );
        let (mut n, mut rd) = (nk as i32, round as i32);
        let mut p = params!(r, l, m, cy, yy, i, g, h, mk, n, rd);
        unsafe { launch_raw(st, &self.join, &mut p, false, cfg(nk.min(32), 256)) }
            .map_err(|e| gpu_err("launching link_join", e))
    }

    /// The sidecar's wait for layer `ml`'s flag.
    ///
    /// # Safety
    /// `req_box` and `smeta` address a request box and a sidecar meta.
    pub unsafe fn wait(
        &self,
        st: &Arc<CudaStream>,
        req_box: u64,
        ml: usize,
        smeta: u64,
        round: usize,
    ) -> Result<()> {
        let (mut b, mut l, mut m, mut r) = (req_box, ml as i32, smeta, round as i32);
        let mut p = params!(b, l, m, r);
        unsafe { launch_raw(st, &self.wait, &mut p, false, cfg(1, 32)) }
            .map_err(|e| gpu_err("launching link_wait", e))
    }

    /// The sidecar's reply for layer `ml`: its computed slots' rows (`y`, nk rows of H
    /// here) into the primary's reply box, then the reply word.
    ///
    /// # Safety
    /// The pointers address those buffers; `done` is a counter at 0.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn reply(
        &self,
        st: &Arc<CudaStream>,
        lay: &BoxLayout,
        reply_box: u64,
        ml: usize,
        smeta: u64,
        y: u64,
        idx: u64,
        gu_tab: u64,
        nk: usize,
        done: u64,
        round: usize,
        pdl: bool,
    ) -> Result<()> {
        let (mut r, mut l, mut m, mut yy, mut py) = (
            reply_box,
            ml as i32,
            smeta,
            y,
            reply_box + lay.y_off() as u64,
        );
        let (mut i, mut g, mut h, mut d, mut mk) = (
            idx,
            gu_tab,
            lay.hidden as i32,
            done,
            reply_box + lay.mark_off() as u64,
        );
        let mut rd = round as i32;
        let mut p = params!(r, l, m, yy, py, i, g, h, d, mk, rd);
        unsafe { launch_raw(st, &self.reply, &mut p, pdl, cfg(nk, 256)) }
            .map_err(|e| gpu_err("launching link_reply", e))
    }
}
