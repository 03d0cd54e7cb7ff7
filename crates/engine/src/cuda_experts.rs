//! A tier's experts on a GPU (feature `cuda`): the sidecar's cold experts (or a bench's
//! generated ones) resident in device memory, computed for a list of picks by the step
//! module's grouped MoE kernels, one output row per pick.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, DevicePtr, LaunchConfig};

use crate::bank::{ExpertBank, Pick};
use crate::config::Glu;
use crate::cuda::{gpu_err, Gpu, EXPERTS_CU};
use crate::cuda_model::args::{ExpertSwiglu, MoeDown, MoeUp};
use crate::cuda_model::{expert_dtype, launch_raw, upload_expert, DevMat, ExpertBias, Wdt};
use crate::error::{Error, Result};

/// An expert resident on a GPU: its gate_up `[2I, H]` and down `[H, I]` weights.
type ExpertPair = (DevMat, DevMat);

/// How a call's inputs travel to the GPU. Both are kept so that `moelane bench experts` can
/// measure the difference side by side.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upload {
    /// activations, pick rows and weight pointers in one buffer, one copy (the default)
    Packed,
    /// one copy each
    Separate,
}

/// A tier's experts on the GPU: `gate_up [2I, H]` and `down [H, I]` per resident expert.
pub struct GpuExperts {
    pub upload: Upload,
    /// grouped kernels (`kernels/moe.cu`): one block per (expert, 8 weight rows), on f32,
    /// bf16 and FP8 weights, then the same with the experts' biases and gpt_oss's activation
    k_up: [CudaFunction; 6],
    k_down: [CudaFunction; 6],
    /// per layer, the dtype its experts here are kept in (the first one uploaded sets it;
    /// see [`crate::cuda_model::Wdt`]), and FP8's block shape
    dt: HashMap<usize, Wdt>,
    block: HashMap<usize, Option<[usize; 2]>>,
    /// per layer, the device addresses of each resident expert's gate_up and down, of their
    /// FP8 scales, and of their biases, indexed by expert id (0 where not resident, not FP8,
    /// without biases); rebuilt after the resident set changes
    tables: HashMap<usize, [CudaSlice<u64>; 6]>,
    /// the resident experts' biases (gpt_oss)
    biases: HashMap<(usize, usize), ExpertBias>,
    /// the experts' activation (set by the first one uploaded; every expert shares it)
    glu: Option<Glu>,
    tables_dirty: bool,
    /// entries of every layer's table at least (the ipc link's picks index the tables by
    /// any of the model's experts, not only resident ones)
    min_width: usize,
    act: CudaSlice<f32>,
    packed: CudaSlice<u8>,
    staging: Vec<u8>,
    /// the last packed call's device pointers (acts, rows, ids, layer tables) and pick
    /// count (for [`Self::relaunch`])
    last: Option<([u64; 4], usize)>,
    gpu: Arc<Gpu>,
    /// `expert_swiglu` on f32 and on bf16 weights
    f: [CudaFunction; 2],
    hidden: usize,
    inter: usize,
    w: HashMap<(usize, usize), ExpertPair>,
    acts: CudaSlice<f32>,
    rows: CudaSlice<i32>,
    gate_up: CudaSlice<u64>,
    down: CudaSlice<u64>,
    out: CudaSlice<f32>,
    host_rows: Vec<i32>,
    host_gu: Vec<u64>,
    host_dn: Vec<u64>,
}

fn grow<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    stream: &Arc<CudaStream>,
    buf: &mut CudaSlice<T>,
    n: usize,
) -> Result<()> {
    if buf.len() < n {
        *buf = stream
            .alloc_zeros::<T>(n.next_power_of_two())
            .map_err(|e| gpu_err("allocating GPU scratch", e))?;
    }
    Ok(())
}

impl Drop for GpuExperts {
    fn drop(&mut self) {
        // the fields' device memory is freed on this thread after this returns
        let _ = self.gpu.ctx.bind_to_thread();
    }
}

/// A layer's six tables on the device.
fn upload_tables(s: &Arc<CudaStream>, host: &[Vec<u64>; 6]) -> Result<[CudaSlice<u64>; 6]> {
    let mut up = Vec::with_capacity(6);
    for v in host {
        up.push(
            s.clone_htod(v)
                .map_err(|e| gpu_err("uploading tables", e))?,
        );
    }
    <[CudaSlice<u64>; 6]>::try_from(up).map_err(|_| Error::Internal("six expert tables".into()))
}

impl GpuExperts {
    pub fn new(gpu: Arc<Gpu>, hidden: usize, inter: usize) -> Result<Self> {
        let src = crate::cuda::kernel_source(EXPERTS_CU, crate::cuda::EXPERTS_FILES)?;
        let m = gpu.module("experts", &src)?;
        let load = |n: &str| {
            m.load_function(n)
                .map_err(|e| gpu_err(&format!("loading {n}"), e))
        };
        let f = [load("expert_swiglu")?, load("expert_swiglu_bf16")?];
        let [(up, down), (up16, down16), (up8, down8), (xu, xd), (xu16, xd16), (xu8, xd8)] =
            crate::cuda_model::moe_kernels(&gpu)?;
        let s = gpu.stream.clone();
        let z = |n| {
            s.alloc_zeros::<f32>(n)
                .map_err(|e| gpu_err("allocating", e))
        };
        Ok(GpuExperts {
            upload: Upload::Packed,
            k_up: [up, up16, up8, xu, xu16, xu8],
            k_down: [down, down16, down8, xd, xd16, xd8],
            dt: HashMap::new(),
            block: HashMap::new(),
            tables: HashMap::new(),
            biases: HashMap::new(),
            glu: None,
            tables_dirty: true,
            min_width: 0,
            act: z(inter)?,
            packed: s.alloc_zeros(1).map_err(|e| gpu_err("allocating", e))?,
            staging: Vec::new(),
            last: None,
            f,
            hidden,
            inter,
            w: HashMap::new(),
            acts: z(hidden)?,
            rows: s.alloc_zeros(1).map_err(|e| gpu_err("allocating", e))?,
            gate_up: s.alloc_zeros(1).map_err(|e| gpu_err("allocating", e))?,
            down: s.alloc_zeros(1).map_err(|e| gpu_err("allocating", e))?,
            out: z(hidden)?,
            host_rows: Vec::new(),
            host_gu: Vec::new(),
            host_dn: Vec::new(),
            gpu,
        })
    }

    /// The device these experts live on (its stream orders every launch here).
    pub fn gpu(&self) -> &Arc<Gpu> {
        &self.gpu
    }

    /// The ipc link's path: MoE layer `layer`'s picks `[rows, k]` (expert ids below
    /// `experts`) at `idx` and its normed rows `[rows, H]` at `h`, both device memory here;
    /// the picks whose experts are resident here computed into `y` (slot s's row at
    /// `y + 4 H s`), queued on the stream and not waited for. Returns the layer's gate_up
    /// table (`experts` entries, null where not resident) for the reply kernel to tell
    /// which slots were computed. `pdl`: the kernels are launched as programmatic
    /// dependents of the kernel before them (they wait for it on the device).
    ///
    /// # Safety
    /// `idx` addresses `rows * k` ids below `experts`, `h` `rows * H` floats, `y`
    /// `rows * k * H` floats, all on this GPU, unchanged until the stream's work is done.
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
        if experts > self.min_width {
            self.min_width = experts;
            self.tables_dirty = true;
        }
        self.ensure_tables()?;
        let s = self.gpu.stream.clone();
        let nk = rows * k;
        grow(&s, &mut self.act, nk * self.inter)?;
        if !self.tables.contains_key(&layer) {
            // nothing resident on this layer: a null table, every slot skipped
            let zero: [Vec<u64>; 6] = std::array::from_fn(|_| vec![0; self.min_width.max(1)]);
            self.tables.insert(layer, upload_tables(&s, &zero)?);
        }
        // as the primary's step: one row's picks are distinct experts
        self.launch_moe(&s, [h, 0, idx, layer as u64], nk, k, rows == 1, y, pdl)
    }

    /// "cuda:N (name, sm_XY)"
    /// The device's ordinal (cuda:N).
    pub fn ordinal(&self) -> usize {
        self.gpu.ordinal
    }

    pub fn describe(&self) -> String {
        format!(
            "cuda:{} ({}, sm_{}{})",
            self.gpu.ordinal, self.gpu.name, self.gpu.cc.0, self.gpu.cc.1
        )
    }

    pub fn hidden(&self) -> usize {
        self.hidden
    }

    /// An expert's intermediate size.
    pub fn inter(&self) -> usize {
        self.inter
    }

    /// Generates the given experts of a hashed model (the `station` preset) on this GPU,
    /// bit-identical to [`crate::synth::hashed_expert`]; `sync` would drop them (no bank
    /// holds them), so a tier built this way serves a fixed map.
    pub fn generate(&mut self, seed: u64, which: &[(usize, usize)]) -> Result<()> {
        let f = crate::cuda_model::gen_kernel(&self.gpu)?;
        if self
            .w
            .keys()
            .any(|(l, _)| self.dt.get(l) != Some(&Wdt::F32))
        {
            return Err(Error::Gpu(
                "generating experts beside experts of another dtype".into(),
            ));
        }
        for &(l, _) in which {
            self.dt.insert(l, Wdt::F32);
        }
        for &(l, e) in which {
            let (gu, dn) = crate::cuda_model::gen_expert(
                &self.gpu.stream,
                &f,
                seed,
                l,
                e,
                self.hidden,
                self.inter,
            )?;
            let (a, b) = (2 * self.inter * self.hidden, self.hidden * self.inter);
            self.w
                .insert((l, e), (DevMat::of_f32(gu, a), DevMat::of_f32(dn, b)));
        }
        self.last = None;
        self.tables_dirty = true;
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| gpu_err("synchronising generation", e))
    }

    /// A resident expert's weights copied back: (gate_up, down), or None.
    pub fn download(&self, layer: usize, e: usize) -> Result<Option<(Vec<f32>, Vec<f32>)>> {
        let Some((gu, dn)) = self.w.get(&(layer, e)) else {
            return Ok(None);
        };
        let s = &self.gpu.stream;
        let a = gu.to_host(s)?;
        let b = dn.to_host(s)?;
        s.synchronize().map_err(|e| gpu_err("synchronising", e))?;
        Ok(Some((a, b)))
    }

    /// Experts resident on the GPU.
    pub fn resident(&self) -> usize {
        self.w.len()
    }

    /// Bytes of expert weights on the GPU (their dtype's: bf16 checkpoints keep 2 per weight).
    pub fn bytes(&self) -> usize {
        let biases: usize = self.biases.values().map(ExpertBias::bytes).sum();
        self.w
            .values()
            .map(|(g, d)| g.bytes() + d.bytes())
            .sum::<usize>()
            + biases
    }

    /// The dtype layer `layer`'s experts here are kept in (f32 before any is uploaded).
    pub fn dtype(&self, layer: usize) -> Wdt {
        self.dt.get(&layer).copied().unwrap_or(Wdt::F32)
    }

    /// Makes the GPU hold exactly the experts `bank` holds: uploads the missing ones, frees
    /// the ones it no longer has.
    pub fn sync(&mut self, bank: &ExpertBank) -> Result<()> {
        // the experts dropped below are freed on this thread: cudarc's free needs the
        // context current here (a swap's RELEASE runs on any runtime thread), or it fails
        // and leaves the error for the next call to find
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(|e| gpu_err("binding the CUDA context", e))?;
        let mut want = Vec::new();
        for l in 0..bank.layers() {
            for (e, w) in bank.experts_of(l) {
                want.push(((l, e), w));
            }
        }
        let keep: std::collections::HashSet<(usize, usize)> =
            want.iter().map(|(k, _)| *k).collect();
        self.w.retain(|k, _| keep.contains(k));
        self.biases.retain(|k, _| keep.contains(k));
        self.last = None;
        self.tables_dirty = true;
        for (k, w) in want {
            if self.w.contains_key(&k) {
                continue;
            }
            let s = &self.gpu.stream;
            let dt = *self.dt.entry(k.0).or_insert(expert_dtype(w));
            let pair = upload_expert(s, w, k, dt, self.block.entry(k.0).or_default())?;
            let glu = *self.glu.get_or_insert(w.glu);
            let named = |e: Error| Error::Gpu(format!("expert ({},{}): {e}", k.0, k.1));
            if let Some(b) =
                ExpertBias::upload_for(s, w, self.hidden, self.inter, glu).map_err(named)?
            {
                self.biases.insert(k, b);
            }
            self.w.insert(k, pair);
        }
        self.gpu
            .stream
            .synchronize()
            .map_err(|e| gpu_err("synchronising uploads", e))
    }

    fn cfg(&self, n: usize) -> LaunchConfig {
        LaunchConfig {
            grid_dim: (n as u32, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: ((self.hidden + self.inter) * 4) as u32,
        }
    }

    /// Launches the kernels again on the last packed call's inputs and waits: the kernels
    /// and launches alone, without copies (for `moelane bench experts`).
    pub fn relaunch(&mut self) -> Result<()> {
        let Some((ptrs, n)) = self.last else {
            return Err(Error::Gpu("relaunch before a packed call".into()));
        };
        // `packed` still holds that call's inputs (nothing was copied over them since) and
        // its experts are still resident (`sync` and `generate` clear `last`)
        let s = self.gpu.stream.clone();
        let out = self.out.device_ptr(&s).0;
        self.launch_grouped(&s, ptrs, n, out)?;
        s.synchronize().map_err(|e| gpu_err("synchronising", e))
    }

    /// Rebuilds the per-layer expert tables after the resident set changed.
    fn ensure_tables(&mut self) -> Result<()> {
        if !self.tables_dirty {
            return Ok(());
        }
        let s = self.gpu.stream.clone();
        let width = self
            .w
            .keys()
            .map(|k| k.1 + 1)
            .max()
            .unwrap_or(1)
            .max(self.min_width);
        let mut host: HashMap<usize, [Vec<u64>; 6]> = HashMap::new();
        for (&(l, e), (gu, dn)) in &self.w {
            let t = host
                .entry(l)
                .or_insert_with(|| std::array::from_fn(|_| vec![0; width]));
            t[0][e] = gu.p;
            t[1][e] = dn.p;
            t[2][e] = gu.scales().map_or(0, |(x, _)| x.p);
            t[3][e] = dn.scales().map_or(0, |(x, _)| x.p);
            if let Some(b) = self.biases.get(&(l, e)) {
                t[4][e] = b.gate_up.p;
                t[5][e] = b.down.p;
            }
        }
        self.tables.clear();
        for (l, t) in host {
            self.tables.insert(l, upload_tables(&s, &t)?);
        }
        self.tables_dirty = false;
        Ok(())
    }

    /// Launches the grouped up and down kernels on inputs at `ptrs` (acts, rows, expert ids,
    /// the layer's table pair as [gu table, dn table] in `ptrs[3]`'s slot) for `n` picks,
    /// writing `out`. The caller vouches for the pointers.
    fn launch_grouped(
        &mut self,
        s: &Arc<CudaStream>,
        ptrs: [u64; 4],
        n: usize,
        out: u64,
    ) -> Result<()> {
        // the picks of several rows may share an expert: each block checks that it leads
        self.launch_moe(s, ptrs, n, 1, false, out, false)
            .map(|_| ())
    }

    /// The grouped up and down kernels over `n` pick slots: `ptrs` as
    /// [`Self::launch_grouped`]'s (rows null: slot s reads activation row s / k);
    /// `distinct`: every slot's expert differs (one row's picks). Returns the layer's
    /// gate_up table.
    #[allow(clippy::too_many_arguments)]
    fn launch_moe(
        &mut self,
        s: &Arc<CudaStream>,
        ptrs: [u64; 4],
        n: usize,
        k: usize,
        distinct: bool,
        out: u64,
        pdl: bool,
    ) -> Result<u64> {
        let (hi, ii, ni, ki) = (self.hidden as i32, self.inter as i32, n as i32, k as i32);
        let dist = distinct as i32;
        let (v_up, v_dn) = (
            self.hidden.is_multiple_of(4) as i32,
            self.inter.is_multiple_of(4) as i32,
        );
        let (acts, rows, ids, layer) = (ptrs[0], ptrs[1], ptrs[2], ptrs[3] as usize);
        let Some([gt, dt, gst, dst, gbt, dbt]) = self.tables.get(&layer) else {
            return Err(Error::Gpu(format!(
                "no experts of layer {layer} on the GPU"
            )));
        };
        let (gt, dt) = (gt.device_ptr(s).0, dt.device_ptr(s).0);
        let (gst, dst) = (gst.device_ptr(s).0, dst.device_ptr(s).0);
        let (gbt, dbt) = (gbt.device_ptr(s).0, dbt.device_ptr(s).0);
        let (alpha, limit) = crate::cuda_model::glu_params(self.glu.unwrap_or(Glu::Silu));
        let block = self.block.get(&layer).copied().flatten();
        let [b0, b1] = block.unwrap_or([1, 4]).map(|b| b as i32);
        // the `_x` kernels when the experts have biases or gpt_oss's activation
        let x = !self.biases.is_empty() || self.glu.is_some_and(|g| g != Glu::Silu);
        let d = match self.dtype(layer) {
            Wdt::F32 => 0,
            Wdt::Bf16 => 1,
            Wdt::F8 => 2,
        } + 3 * x as usize;
        let act = self.act.device_ptr(s).0;
        let mut up = MoeUp {
            idx: ids,
            gu_tab: gt,
            h: acts,
            act,
            nk: ni,
            k: ki,
            hidden: hi,
            inter: ii,
            vec4: v_up,
            rows,
            distinct: dist,
            gs_tab: gst,
            b0,
            b1,
            gb_tab: gbt,
            alpha,
            limit,
        };
        let cfg = |rows_out: usize| LaunchConfig {
            grid_dim: (n as u32, rows_out.div_ceil(8) as u32, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: ids are experts resident on this GPU (checked by the caller), so their
        // table entries address [2I, H] and [H, I] weights; rows < activation rows; act
        // holds n rows of I and `out` n rows of H (the caller's guarantee).
        unsafe { launch_raw(s, &self.k_up[d], &mut up.params(), pdl, cfg(self.inter)) }
            .map_err(|e| gpu_err("launching moe_up", e))?;
        let mut down = MoeDown {
            idx: ids,
            dn_tab: dt,
            act,
            y: out,
            nk: ni,
            hidden: hi,
            inter: ii,
            vec4: v_dn,
            distinct: dist,
            ds_tab: dst,
            b0,
            b1,
            db_tab: dbt,
        };
        // SAFETY: as above.
        unsafe {
            launch_raw(
                s,
                &self.k_down[d],
                &mut down.params(),
                pdl,
                cfg(self.hidden),
            )
        }
        .map_err(|e| gpu_err("launching moe_down", e))?;
        Ok(gt)
    }

    /// The resident weights (gate_up, down) pick `p` of `layer` uses, checking its row is
    /// one of `rows` activation rows.
    fn weights_of<'a>(
        w: &'a HashMap<(usize, usize), ExpertPair>,
        layer: usize,
        p: &Pick,
        rows: usize,
    ) -> Result<&'a ExpertPair> {
        if p.row as usize >= rows {
            return Err(Error::Invalid(format!(
                "pick row {} but {rows} activation rows",
                p.row
            )));
        }
        w.get(&(layer, p.expert as usize))
            .ok_or(Error::NotResident {
                layer,
                expert: p.expert as usize,
                tier: "gpu",
            })
    }

    /// As [`Self::compute`], with the activations (`rows` rows of H) and the outputs (one
    /// row of H per pick) in device memory of this GPU: nothing but the picks crosses the
    /// host (the NCCL link's sidecar computes from the received buffer into the reply).
    ///
    /// # Safety
    /// `acts` addresses `rows * H` floats and `out` `picks.len() * H` floats of this GPU's
    /// memory, 16-byte aligned, not written by other work until this returns.
    pub unsafe fn compute_device(
        &mut self,
        layer: usize,
        picks: &[Pick],
        acts: u64,
        rows: usize,
        out: u64,
    ) -> Result<()> {
        if picks.is_empty() {
            return Ok(());
        }
        self.ensure_tables()?;
        let s = self.gpu.stream.clone();
        let n = picks.len();
        grow(&s, &mut self.act, n * self.inter)?;
        self.staging.clear();
        for p in picks {
            Self::weights_of(&self.w, layer, p, rows)?;
            self.staging
                .extend_from_slice(&(p.row as i32).to_le_bytes());
        }
        for p in picks {
            self.staging
                .extend_from_slice(&(p.expert as i32).to_le_bytes());
        }
        let len = self.staging.len();
        grow(&s, &mut self.packed, len)?;
        s.memcpy_htod(&self.staging[..len], &mut self.packed.slice_mut(..len))
            .map_err(|e| gpu_err("copying to the GPU", e))?;
        let base = self.packed.device_ptr(&s).0;
        let ptrs = [acts, base, base + 4 * n as u64, layer as u64];
        self.launch_grouped(&s, ptrs, n, out)?;
        s.synchronize().map_err(|e| gpu_err("synchronising", e))
    }

    /// One output row per pick, in pick order: the same contract as [`ExpertBank::compute`].
    pub fn compute(
        &mut self,
        layer: usize,
        picks: &[Pick],
        acts: &[f32],
        out: &mut [f32],
    ) -> Result<()> {
        let h = self.hidden;
        if picks.is_empty() {
            return Ok(());
        }
        crate::bank::check_out(out.len(), picks.len(), h)?;
        let rows = acts.len() / h.max(1);
        let s = self.gpu.stream.clone();
        self.host_rows.clear();
        self.host_gu.clear();
        self.host_dn.clear();
        for p in picks {
            let (gu, dn) = Self::weights_of(&self.w, layer, p, rows)?;
            self.host_rows.push(p.row as i32);
            self.host_gu.push(gu.p);
            self.host_dn.push(dn.p);
        }
        let n = picks.len();
        grow(&s, &mut self.out, n * h)?;
        let e = |x| gpu_err("copying to the GPU", x);
        if self.upload == Upload::Packed {
            self.ensure_tables()?;
            grow(&s, &mut self.act, n * self.inter)?;
            // one buffer: acts f32 | rows i32 | expert ids i32, 8-aligned
            let al = |x: usize| x.div_ceil(8) * 8;
            let oa = 0;
            let or = al(oa + acts.len() * 4);
            let oi = al(or + n * 4);
            let len = oi + n * 4;
            self.staging.clear();
            self.staging.resize(len, 0);
            for (i, x) in acts.iter().enumerate() {
                self.staging[oa + 4 * i..oa + 4 * i + 4].copy_from_slice(&x.to_le_bytes());
            }
            for (i, p) in picks.iter().enumerate() {
                let r = self.host_rows[i];
                self.staging[or + 4 * i..or + 4 * i + 4].copy_from_slice(&r.to_le_bytes());
                let e = p.expert as i32;
                self.staging[oi + 4 * i..oi + 4 * i + 4].copy_from_slice(&e.to_le_bytes());
            }
            grow(&s, &mut self.packed, len)?;
            s.memcpy_htod(&self.staging[..len], &mut self.packed.slice_mut(..len))
                .map_err(e)?;
            let (base, guard) = self.packed.device_ptr(&s);
            drop(guard); // one stream: the launches below are ordered after the copy anyway
            let ptrs = [
                base + oa as u64,
                base + or as u64,
                base + oi as u64,
                layer as u64,
            ];
            self.last = Some((ptrs, n));
            // the pointers address the regions just copied into `packed`; every pick was
            // checked above (row in range, expert resident); out holds n rows of H
            let out = self.out.device_ptr(&s).0;
            self.launch_grouped(&s, ptrs, n, out)?;
        } else {
            let (hi, ii) = (h as i32, self.inter as i32);
            let cfg = self.cfg(n);
            grow(&s, &mut self.acts, acts.len())?;
            grow(&s, &mut self.rows, n)?;
            grow(&s, &mut self.gate_up, n)?;
            grow(&s, &mut self.down, n)?;
            s.memcpy_htod(acts, &mut self.acts.slice_mut(..acts.len()))
                .map_err(e)?;
            s.memcpy_htod(&self.host_rows, &mut self.rows.slice_mut(..n))
                .map_err(e)?;
            s.memcpy_htod(&self.host_gu, &mut self.gate_up.slice_mut(..n))
                .map_err(e)?;
            s.memcpy_htod(&self.host_dn, &mut self.down.slice_mut(..n))
                .map_err(e)?;
            let mut a = ExpertSwiglu {
                acts: self.acts.device_ptr(&s).0,
                rows: self.rows.device_ptr(&s).0,
                gate_up: self.gate_up.device_ptr(&s).0,
                down: self.down.device_ptr(&s).0,
                out: self.out.device_ptr(&s).0,
                hidden: hi,
                inter: ii,
            };
            if !self.biases.is_empty() || self.glu.is_some_and(|g| g != Glu::Silu) {
                return Err(Error::Gpu(
                    "the separate-upload path (a bench's comparison) takes experts without \
                     biases or the clamped activation"
                        .into(),
                ));
            }
            let d = match self.dtype(layer) {
                Wdt::F32 => 0,
                Wdt::Bf16 => 1,
                Wdt::F8 => {
                    return Err(Error::Gpu(
                        "the separate-upload path (a bench's comparison) takes f32 or bf16 \
                         experts, not FP8"
                            .into(),
                    ))
                }
            };
            // SAFETY: the arguments match the kernel's signature; every pointer the kernel
            // follows (rows < activation rows, resident experts' weights of [2I,H] and [H,I])
            // was checked above, and the scratch holds n picks.
            unsafe { launch_raw(&s, &self.f[d], &mut a.params(), false, cfg) }
                .map_err(|e| gpu_err("launching expert_swiglu", e))?;
        }
        s.memcpy_dtoh(&self.out.slice(..n * h), &mut out[..n * h])
            .map_err(|e| gpu_err("copying from the GPU", e))?;
        s.synchronize().map_err(|e| gpu_err("synchronising", e))
    }
}
