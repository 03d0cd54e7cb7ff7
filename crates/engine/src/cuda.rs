//! The CUDA path (feature `cuda`), built on cudarc with dynamic loading: nothing of CUDA is
//! needed to build, and the driver, NVRTC and the kernels are found at run time.
//!
//! Here: the device handle and the kernels (`kernels/*.cu`) compiled by NVRTC for the
//! device's compute capability at first use, their PTX cached on disk by source hash and
//! capability. The step's model is `cuda_model`, a tier's experts `cuda_experts`.

use std::path::PathBuf;
use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaModule, CudaStream};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};
use sha2::Digest;

use crate::error::{Error, Result};

pub(crate) fn gpu_err(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Gpu(format!("{what}: {e:?}"))
}

/// The expert kernels' source, compiled at run time (after the common helpers: the
/// reductions, PDL macros and the weight loads of each dtype).
pub const EXPERTS_CU: &str = concat!(
    include_str!("../../../kernels/common.cu"),
    include_str!("../../../kernels/experts.cu"),
);

/// The source of a kernel module: `embedded` (the files of `kernels/` built in), or, where
/// `MOELANE_KERNELS_DIR` names a folder, the same `files` read from there, so kernels can
/// be changed and measured on a GPU machine without a new binary (a development aid: the
/// Rust side's launches must still match the kernels' signatures).
pub fn kernel_source(
    embedded: &'static str,
    files: &[&str],
) -> Result<std::borrow::Cow<'static, str>> {
    let Some(dir) = std::env::var_os("MOELANE_KERNELS_DIR") else {
        return Ok(std::borrow::Cow::Borrowed(embedded));
    };
    let dir = PathBuf::from(dir);
    let mut src = String::new();
    for f in files {
        let path = dir.join(f);
        let text = std::fs::read_to_string(&path).map_err(|e| Error::io(&path, e))?;
        src.push_str(&text);
    }
    Ok(std::borrow::Cow::Owned(src))
}

/// The files [`EXPERTS_CU`] is made of, in its order.
pub const EXPERTS_FILES: &[&str] = &["common.cu", "experts.cu"];

/// Compiles `src` to PTX for `arch` ("sm_90") with NVRTC; a clear error where the NVRTC
/// library cannot be loaded (cudarc would panic).
pub fn nvrtc_compile(name: &str, src: &str, arch: &str) -> Result<Ptx> {
    // SAFETY: only tries to open the library by its candidate names.
    if !unsafe { cudarc::nvrtc::sys::is_culib_present() } {
        return Err(Error::Gpu(
            "the NVRTC library (libnvrtc.so.13) was not found".into(),
        ));
    }
    let arch_static: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let opts = CompileOptions {
        arch: Some(arch_static),
        ..Default::default()
    };
    compile_ptx_with_opts(src, opts)
        .map_err(|e| gpu_err(&format!("NVRTC compiling {name} for {arch}"), e))
}

/// One CUDA device.
pub struct Gpu {
    pub ordinal: usize,
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    /// compute capability (major, minor)
    pub cc: (i32, i32),
    pub name: String,
}

impl Gpu {
    /// Opens device `ordinal` (fails with a clear error where there is no driver or device).
    pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
        // cudarc panics when it cannot load libcuda: look for it first (no panic, and no
        // swap of the process-wide panic hook, which races with other threads)
        // SAFETY: only tries to open the library by its candidate names.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::Gpu(
                "the CUDA driver library (libcuda) was not found".into(),
            ));
        }
        let n = CudaContext::device_count().map_err(|e| gpu_err("counting CUDA devices", e))?;
        if ordinal >= n as usize {
            return Err(Error::Gpu(format!(
                "cuda:{ordinal}: this machine has {n} CUDA device(s)"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(|e| gpu_err("creating a CUDA context", e))?;
        use cudarc::driver::sys::CUdevice_attribute_enum as A;
        let major = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)
            .map_err(|e| gpu_err("reading the compute capability", e))?;
        let minor = ctx
            .attribute(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)
            .map_err(|e| gpu_err("reading the compute capability", e))?;
        let cc = (major, minor);
        let name = ctx.name().unwrap_or_else(|_| "CUDA device".into());
        let stream = ctx.default_stream();
        Ok(Arc::new(Gpu {
            ordinal,
            ctx,
            stream,
            cc,
            name,
        }))
    }

    fn ptx_cache_dir() -> PathBuf {
        std::env::var_os("MOELANE_CACHE")
            .map(PathBuf::from)
            .unwrap_or_else(|| {
                std::env::var_os("HOME")
                    .map(PathBuf::from)
                    .unwrap_or_else(std::env::temp_dir)
                    .join(".cache/moelane")
            })
            .join("ptx")
    }

    /// Loads `src` as a module: PTX from the cache when this source was compiled for this
    /// capability before, else compiled by NVRTC (and cached).
    pub fn module(&self, name: &str, src: &str) -> Result<Arc<CudaModule>> {
        let hash = sha2::Sha256::digest(src.as_bytes());
        let key: String = hash[..8].iter().map(|b| format!("{b:02x}")).collect();
        let arch = format!("sm_{}{}", self.cc.0, self.cc.1);
        let path = Self::ptx_cache_dir().join(format!("{name}-{key}-{arch}.ptx"));
        let ptx = match std::fs::read_to_string(&path) {
            Ok(text) => Ptx::from_src(text),
            Err(_) => {
                let ptx = nvrtc_compile(name, src, &arch)?;
                if let Some(dir) = path.parent() {
                    let _ = std::fs::create_dir_all(dir);
                    let tmp = path.with_extension("ptx.tmp");
                    if std::fs::write(&tmp, ptx.to_src()).is_ok() {
                        let _ = std::fs::rename(&tmp, &path);
                    }
                }
                ptx
            }
        };
        self.ctx
            .load_module(ptx)
            .map_err(|e| gpu_err(&format!("loading module {name}"), e))
    }
}
