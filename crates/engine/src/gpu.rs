//! The GPU as the rest of the workspace sees it, in either build: with the `cuda` feature the
//! real device ([`crate::cuda::Gpu`]), a tier's experts on it ([`crate::cuda_experts`]) and
//! the primary's step on it; without it, types of the same names that cannot be made (their
//! constructors answer [`Error::NotCompiledWithCuda`]), so callers need no `cfg` of their own.
//! The benchmark and test fixtures (`cuda_station`) and the model (`cuda_model`) stay behind
//! the feature.

use crate::checkpoint::Checkpoint;
use crate::error::Result;
use crate::step::Engine;

#[cfg(feature = "cuda")]
pub use crate::cuda::Gpu;
#[cfg(feature = "cuda")]
pub use crate::cuda_experts::GpuExperts;
#[cfg(not(feature = "cuda"))]
pub use stub::{Gpu, GpuExperts};

/// Whether this build has the CUDA path.
pub const COMPILED: bool = cfg!(feature = "cuda");

/// Moves `engine`'s steps onto GPU `ordinal` (dense weights, K/V and hot experts there; the
/// CPU copies are dropped); returns the device's description.
#[cfg(feature = "cuda")]
pub fn attach_primary(engine: &mut Engine, ckpt: &Checkpoint, ordinal: usize) -> Result<String> {
    let gpu = Gpu::open(ordinal)?;
    let dense = crate::model::DenseWeights::load(ckpt)?;
    let mut g = crate::cuda_model::GpuModel::new(gpu, &ckpt.config, &dense, engine.kv.blocks)?;
    g.sync_hot(&engine.hot)?;
    let h = crate::placement::human_bytes;
    let desc = format!(
        "{}: {} weights, {} dense + {} of {} hot experts + {} KV cache on the device",
        g.describe(),
        g.weight_dtype(),
        h(g.dense_bytes() as u64),
        h(g.expert_bytes() as u64),
        g.resident(),
        h(g.kv_bytes() as u64)
    );
    crate::cuda_model::attach_gpu(engine, g)?;
    Ok(desc)
}

/// Moves `engine`'s steps onto GPU `ordinal`: this build has no CUDA path.
#[cfg(not(feature = "cuda"))]
pub fn attach_primary(engine: &mut Engine, ckpt: &Checkpoint, ordinal: usize) -> Result<String> {
    let _ = (engine, ckpt, ordinal);
    Err(crate::Error::NotCompiledWithCuda)
}

#[cfg(not(feature = "cuda"))]
mod stub {
    use std::sync::Arc;

    use crate::bank::{ExpertBank, Pick};
    use crate::error::{Error, Result};

    /// No value of it exists: every method is unreachable.
    #[derive(Debug)]
    enum Never {}

    /// A GPU: never opened in this build.
    #[derive(Debug)]
    pub struct Gpu(Never);

    impl Gpu {
        pub fn open(ordinal: usize) -> Result<Arc<Gpu>> {
            let _ = ordinal;
            Err(Error::NotCompiledWithCuda)
        }
    }

    /// A tier's experts on a GPU: never made in this build.
    #[derive(Debug)]
    pub struct GpuExperts(Never);

    impl GpuExperts {
        pub fn new(gpu: Arc<Gpu>, hidden: usize, inter: usize) -> Result<Self> {
            let _ = (hidden, inter);
            match gpu.0 {}
        }
        pub fn ordinal(&self) -> usize {
            match self.0 {}
        }
        pub fn describe(&self) -> String {
            match self.0 {}
        }
        pub fn hidden(&self) -> usize {
            match self.0 {}
        }
        pub fn inter(&self) -> usize {
            match self.0 {}
        }
        pub fn generate(&mut self, seed: u64, which: &[(usize, usize)]) -> Result<()> {
            let _ = (seed, which);
            match self.0 {}
        }
        pub fn sync(&mut self, bank: &ExpertBank) -> Result<()> {
            let _ = bank;
            match self.0 {}
        }
        pub fn compute(
            &mut self,
            layer: usize,
            picks: &[Pick],
            acts: &[f32],
            out: &mut [f32],
        ) -> Result<()> {
            let _ = (layer, picks, acts, out);
            match self.0 {}
        }
        /// # Safety
        /// None needed: it cannot be called.
        pub unsafe fn compute_device(
            &mut self,
            layer: usize,
            picks: &[Pick],
            acts: u64,
            rows: usize,
            out: u64,
        ) -> Result<()> {
            let _ = (layer, picks, acts, rows, out);
            match self.0 {}
        }
        /// # Safety
        /// None needed: it cannot be called.
        #[allow(clippy::too_many_arguments)]
        pub unsafe fn compute_slots(
            &mut self,
            layer: usize,
            experts: usize,
            idx: u64,
            h: u64,
            rows: usize,
            k: usize,
            y: u64,
            pdl: bool,
        ) -> Result<u64> {
            let _ = (layer, experts, idx, h, rows, k, y, pdl);
            match self.0 {}
        }
    }
}

#[cfg(all(test, not(feature = "cuda")))]
mod tests {
    use crate::error::Fault;

    #[test]
    fn a_build_without_cuda_refuses_a_gpu_as_the_callers_error() {
        let e = super::Gpu::open(0).expect_err("no GPU in this build");
        assert!(matches!(e, crate::Error::NotCompiledWithCuda), "{e}");
        assert_eq!(e.fault(), Fault::BadRequest);
        assert!(e.to_string().contains("--features cuda"), "{e}");
        const { assert!(!super::COMPILED) };
    }
}
