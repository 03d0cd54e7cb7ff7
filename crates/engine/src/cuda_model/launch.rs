//! How the step's kernels are launched: the dense products (cuBLAS for larger batches, the
//! small-batch GEMV kernels up to 4 rows), the fused norm + product, RMSNorm of rows, and
//! the launch helper every step kernel goes through (programmatic dependent launch, hollow
//! diagnostics, the per-kernel profile's marks).

use super::*;

impl GpuModel {
    /// y[n, out] = x[n, in] . w^T (+ beta * y, beta 0 or 1): the small-batch kernel up to 4
    /// rows, else cuBLAS (f32 weights: SGEMM, no TF32; bf16: [`Self::split_gemm`]).
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gemm(
        &self,
        what: &'static str,
        w: W,
        out_dim: usize,
        in_dim: usize,
        x: u64,
        n: usize,
        y: u64,
        beta: f32,
    ) -> Result<()> {
        let w = if w.dt == Wdt::F8 {
            if w.len != out_dim * in_dim || w.s == 0 {
                return Err(Error::Internal(format!(
                    "{what}: an FP8 matrix of {} weights for {out_dim} x {in_dim}",
                    w.len
                )));
            }
            if n <= 4 {
                let mut a = args::GemvF8 {
                    w: w.p,
                    s: w.s,
                    x,
                    y,
                    out: out_dim as i32,
                    inp: in_dim as i32,
                    n: n as i32,
                    beta,
                    b0: w.b[0],
                    b1: w.b[1],
                };
                // SAFETY: w holds out*in bytes and its block scales (checked above: a DevMat
                // of that many weights), x n rows of in, y n rows of out; n <= 4.
                return unsafe {
                    self.launch(
                        &self.f.gemv_f8,
                        what,
                        &mut a.params(),
                        grid(out_dim.div_ceil(8), 1, 256, 0),
                    )
                };
            }
            // more rows: widened (exactly) into the scratch, then the f32 product
            if self.f8_wide.len < w.len {
                return Err(Error::Internal(format!(
                    "{what}: an FP8 matrix of {} weights, scratch for {}",
                    w.len, self.f8_wide.len
                )));
            }
            let mut a = args::DequantF8 {
                w: w.p,
                s: w.s,
                y: self.f8_wide.p,
                rows: out_dim as i64,
                cols: in_dim as i32,
                b0: w.b[0],
                b1: w.b[1],
            };
            // SAFETY: w holds out*in bytes and its scales; the scratch at least as many floats
            // (checked above).
            unsafe {
                self.launch(
                    &self.f.dequant_f8,
                    "dequant_f8",
                    &mut a.params(),
                    grid(w.len.div_ceil(256).min(65535), 1, 256, 0),
                )
            }?;
            W::f32(self.f8_wide.p)
        } else {
            w
        };
        if n <= 4 {
            let (o, i, ni) = (out_dim as i32, in_dim as i32, n as i32);
            let v4 = in_dim.is_multiple_of(4) as i32;
            let (pf, pre) = (self.prefetch as i32, self.preload as i32);
            let mut a = args::Gemv {
                w: w.p,
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
                    self.f.gemv.of(w.dt),
                    what,
                    &mut a.params(),
                    grid(out_dim.div_ceil(8), 1, 256, 0),
                )
            };
        }
        if w.dt == Wdt::Bf16 {
            return self.split_gemm(w.p, out_dim, in_dim, x, n, y, beta);
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
                w.p as *const f32,
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

    /// A product on bf16 weights `w` of more than 4 rows, on the tensor cores without
    /// rounding the activations: each row of x split into three bf16 rows that sum to it
    /// exactly (`split_bf16`), one bf16 x bf16 GEMM with f32 accumulation over the 3n rows
    /// (every product is exact in f32; the tensor cores' sums are not IEEE round-to-nearest),
    /// then the three partial rows summed into y (`sum3_rows`, with beta): the f32 product
    /// on the widened weights to f32 rounding. The weights are read once per chunk of
    /// `split_rows` rows.
    #[allow(clippy::too_many_arguments)]
    fn split_gemm(
        &self,
        w: u64,
        out_dim: usize,
        in_dim: usize,
        x: u64,
        n: usize,
        y: u64,
        beta: f32,
    ) -> Result<()> {
        let per = self
            .split_rows
            .min(self.c3.len / (3 * out_dim).max(1))
            .min(self.xs.len / (3 * in_dim).max(1));
        if per == 0 {
            return Err(Error::Internal(format!(
                "a bf16 product of {n} rows of {in_dim} -> {out_dim} without its scratch"
            )));
        }
        let (zero, one) = (0f32, 1f32);
        let mut r0 = 0;
        while r0 < n {
            let rows = per.min(n - r0);
            let xr = x + (4 * r0 * in_dim) as u64;
            let yr = y + (4 * r0 * out_dim) as u64;
            let mut a = args::SplitBf16 {
                x: xr,
                xs: self.xs.p,
                inp: in_dim as i32,
            };
            // SAFETY: x holds n rows of in (rows r0.. of them read), xs 3 * per rows of in.
            unsafe {
                self.launch(
                    &self.f.split_bf16,
                    "split_bf16",
                    &mut a.params(),
                    grid(rows, 1, 256, 0),
                )
            }?;
            // column-major as in `gemm`: c3^T[out, 3 rows] = w^T' [out, in] xs^T [in, 3 rows]
            // SAFETY: w holds out*in bf16s, xs 3*rows*in bf16s, c3 3*rows*out floats (sized
            // in `begin`, checked above), all on the handle's stream.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *self.blas.handle(),
                    blas::cublasOperation_t::CUBLAS_OP_T,
                    blas::cublasOperation_t::CUBLAS_OP_N,
                    out_dim as i32,
                    (3 * rows) as i32,
                    in_dim as i32,
                    &one as *const f32 as *const std::ffi::c_void,
                    w as *const std::ffi::c_void,
                    blas::cudaDataType::CUDA_R_16BF,
                    in_dim as i32,
                    self.xs.p as *const std::ffi::c_void,
                    blas::cudaDataType::CUDA_R_16BF,
                    in_dim as i32,
                    &zero as *const f32 as *const std::ffi::c_void,
                    self.c3.p as *mut std::ffi::c_void,
                    blas::cudaDataType::CUDA_R_32F,
                    out_dim as i32,
                    blas::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    blas::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| gerr("cuBLAS bf16 GEMM", e))?;
            self.mark("cublas bf16 gemm")?;
            let mut a = args::Sum3Rows {
                c: self.c3.p,
                y: yr,
                out: out_dim as i32,
                beta,
            };
            // SAFETY: c3 holds 3 * rows rows of out, y n rows of out (rows r0.. written).
            unsafe {
                self.launch(
                    &self.f.sum3,
                    "sum3_rows",
                    &mut a.params(),
                    grid(rows, out_dim.div_ceil(256), 256, 0),
                )
            }?;
            r0 += rows;
        }
        Ok(())
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
        w: W,
        out_dim: usize,
        x: u64,
        nw: u64,
        h: u64,
        n: usize,
        y: u64,
    ) -> Result<()> {
        let in_dim = self.cfg.hidden_size;
        if n > 4 || w.dt == Wdt::F8 {
            // FP8: the norm, then its product (no fused FP8 kernel)
            self.rmsnorm(x, 0, nw, self.h.p, n)?;
            return self.gemm(what, w, out_dim, in_dim, self.h.p, n, y, 0.0);
        }
        let (o, i, ni) = (out_dim as i32, in_dim as i32, n as i32);
        let eps = self.cfg.rms_norm_eps;
        let v4 = in_dim.is_multiple_of(4) as i32;
        let (pf, pre) = (self.prefetch as i32, self.preload as i32);
        let mut a = args::NormGemv {
            w: w.p,
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
                self.f.norm_gemv.of(w.dt),
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
