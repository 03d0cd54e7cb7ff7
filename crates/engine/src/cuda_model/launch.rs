//! How the step's kernels are launched: the dense products (cuBLAS for larger batches, the
//! small-batch GEMV kernels up to 4 rows), the fused norm + product, RMSNorm of rows, and
//! the launch helper every step kernel goes through (programmatic dependent launch, hollow
//! diagnostics, the per-kernel profile's marks).

use super::*;

impl GpuModel {
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
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
            let v4 = in_dim.is_multiple_of(4) as i32;
            let (pf, pre) = (self.prefetch as i32, self.preload as i32);
            let mut a = args::Gemv {
                w,
                x,
                y,
                out: o,
                inp: i,
                n: ni,
                beta,
                vec4: v4,
                prefetch: pf,
                preload: pre,
            };
            // SAFETY: as below; n <= 4 rows.
            return unsafe {
                self.launch(
                    &self.f.gemv,
                    what,
                    &mut a.params(),
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
    pub(super) unsafe fn launch(
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
            launch_raw(
                &self.st,
                &self.f.hollow,
                &mut args::Hollow {}.params(),
                self.pdl,
                cfg,
            )
        } else {
            launch_raw(&self.st, f, params, self.pdl, cfg)
        }
        .map_err(|e| gerr(&format!("launching {name}"), e))?;
        self.mark(name)
    }

    /// y[n, out] = w . norm(x) with RMSNorm weight `nw`, writing the normed rows to `h`
    /// when `h` is non-zero: one fused kernel for n <= 4, else the norm then cuBLAS.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn normed_product(
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
        let v4 = in_dim.is_multiple_of(4) as i32;
        let (pf, pre) = (self.prefetch as i32, self.preload as i32);
        let mut a = args::NormGemv {
            w,
            x,
            nw,
            h,
            y,
            out: o,
            inp: i,
            n: ni,
            eps,
            vec4: v4,
            prefetch: pf,
            preload: pre,
        };
        // SAFETY: w holds out*in floats, x and h n rows of in, nw in, y n rows of out.
        unsafe {
            self.launch(
                &self.f.norm_gemv,
                what,
                &mut a.params(),
                grid(out_dim.div_ceil(8), 1, 256, 0),
            )
        }
    }

    /// With profiling on: records a timing event after the work launched since the last
    /// mark, charged to `what` (the GPU's own clock: no host wait between kernels).
    pub(super) fn mark(&self, what: &'static str) -> Result<()> {
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

    pub(super) fn rmsnorm(&self, x: u64, rows: u64, w: u64, y: u64, n: usize) -> Result<()> {
        let h = self.cfg.hidden_size as i32;
        let eps = self.cfg.rms_norm_eps;
        let mut a = args::RmsnormRows {
            x,
            rows,
            w,
            y,
            h,
            eps,
        };
        // SAFETY: x holds the source rows (rows[i] < its row count when given), y n rows,
        // w h floats.
        unsafe {
            self.launch(
                &self.f.rmsnorm,
                "rmsnorm_rows",
                &mut a.params(),
                grid(n, 1, 256, 0),
            )
        }?;
        Ok(())
    }
}
