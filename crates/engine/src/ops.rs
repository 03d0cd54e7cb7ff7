//! CPU kernels. Every output element is one dot product computed in a fixed order
//! (16 lanes, then a fixed pairwise reduction), whatever the batch size, the thread
//! count or the tier that runs it: results are batch-invariant and bitwise reproducible
//! on one machine. On x86-64 with AVX2+FMA the same code is compiled with fused
//! multiply-add (chosen once per process), elsewhere with separate multiply and add.

use std::sync::OnceLock;

/// A weight element as stored: f32, or a 16-bit float widened to f32 where it is read (exactly:
/// every bf16 and f16 value is an f32 value, so a product over 16-bit weights equals the one
/// over their widened copy, bit for bit).
pub trait Elem: Copy + Send + Sync + 'static {
    fn f32(self) -> f32;
}

impl Elem for f32 {
    #[inline(always)]
    fn f32(self) -> f32 {
        self
    }
}

/// A bfloat16 as stored (its bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct Bf16(pub u16);

impl Elem for Bf16 {
    #[inline(always)]
    fn f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }
}

/// An IEEE half as stored (its bits).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct F16(pub u16);

impl Elem for F16 {
    /// Branch-free (so it vectorises): the exponent and mantissa moved into an f32 and
    /// rescaled by 2^112, which is exact for normal and subnormal halves alike; infinities
    /// and NaNs keep an all-ones exponent.
    #[inline(always)]
    fn f32(self) -> f32 {
        let h = self.0 as u32;
        let sign = (h & 0x8000) << 16;
        let em = h & 0x7fff;
        let finite = f32::from_bits(em << 13) * f32::from_bits(0x7780_0000);
        let special = f32::from_bits((em << 13) | 0x7f80_0000);
        let v = if em >= 0x7c00 { special } else { finite };
        f32::from_bits(v.to_bits() | sign)
    }
}

/// An FP8 e4m3fn as stored (its bits): 1 sign, 4 exponent (bias 7), 3 mantissa bits, no
/// infinities, `S.1111.111` NaN, at most 448. Widened through a table: every value is exact
/// in f32.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
pub struct F8(pub u8);

const fn e4m3_table() -> [f32; 256] {
    let mut t = [0f32; 256];
    let mut i = 0;
    while i < 256 {
        let (e, m) = ((i >> 3) & 0xf, (i & 7) as f32);
        let v = if e == 15 && (i & 7) == 7 {
            f32::NAN
        } else if e == 0 {
            m / 512.0
        } else {
            let mut p = 1f32;
            let mut k = 0;
            // 2^(e - 7)
            while k < e {
                p *= 2.0;
                k += 1;
            }
            (1.0 + m / 8.0) * p / 128.0
        };
        t[i] = if i & 0x80 != 0 { -v } else { v };
        i += 1;
    }
    t
}

/// Every e4m3fn byte's value.
pub static E4M3: [f32; 256] = e4m3_table();

impl Elem for F8 {
    #[inline(always)]
    fn f32(self) -> f32 {
        E4M3[self.0 as usize]
    }
}

impl F8 {
    /// The e4m3fn nearest `x` (ties to the even code), saturated at +-448; NaN for NaN.
    pub fn from_f32(x: f32) -> F8 {
        if x.is_nan() {
            return F8(0x7f);
        }
        let a = x.abs().min(448.0);
        // the positive codes 0..=0x7e are increasing: the nearest by binary search
        let (mut lo, mut hi) = (0usize, 0x7e);
        while hi - lo > 1 {
            let mid = (lo + hi) / 2;
            if E4M3[mid] <= a {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        let (dl, dh) = (a - E4M3[lo], E4M3[hi] - a);
        let code = if dl < dh || (dl == dh && lo % 2 == 0) {
            lo
        } else {
            hi
        };
        F8(code as u8 | if x.is_sign_negative() { 0x80 } else { 0 })
    }
}

/// FP8 elements with one f32 scale per block of `block[0]` rows x `block[1]` columns (the
/// `weight_scale_inv` of DeepSeek's and Qwen's FP8 checkpoints): element (r, c) is
/// `v[r * cols + c] * scales[(r / block[0]) * ceil(cols / block[1]) + c / block[1]]`.
#[derive(Clone, Debug, PartialEq)]
pub struct BlockScaled {
    pub v: Vec<F8>,
    pub scales: Vec<f32>,
    pub cols: usize,
    pub block: [usize; 2],
}

impl BlockScaled {
    /// Column blocks per row of blocks.
    pub fn col_blocks(&self) -> usize {
        self.cols.div_ceil(self.block[1].max(1))
    }
    /// The scale of element `i`.
    #[inline]
    fn scale_of(&self, i: usize) -> f32 {
        let (r, c) = (i / self.cols.max(1), i % self.cols.max(1));
        self.scales[(r / self.block[0]) * self.col_blocks() + c / self.block[1]]
    }
}

/// A weight matrix's elements in their stored dtype.
#[derive(Clone, Debug, PartialEq)]
pub enum Elems {
    F32(Vec<f32>),
    Bf16(Vec<Bf16>),
    F16(Vec<F16>),
    /// FP8 e4m3 with block scales, dequantised where it is read.
    F8(BlockScaled),
}

impl Elems {
    pub fn len(&self) -> usize {
        match self {
            Elems::F32(v) => v.len(),
            Elems::Bf16(v) => v.len(),
            Elems::F16(v) => v.len(),
            Elems::F8(q) => q.v.len(),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// How many elements are NaN or infinite (FP8: a NaN byte, or a non-finite scale
    /// counted once).
    pub fn non_finite(&self) -> usize {
        match self {
            Elems::F32(v) => v.iter().filter(|x| !x.is_finite()).count(),
            Elems::Bf16(v) => v.iter().filter(|b| b.0 & 0x7f80 == 0x7f80).count(),
            Elems::F16(v) => v.iter().filter(|b| b.0 & 0x7c00 == 0x7c00).count(),
            Elems::F8(q) => {
                q.v.iter().filter(|b| b.0 & 0x7f == 0x7f).count()
                    + q.scales.iter().filter(|s| !s.is_finite()).count()
            }
        }
    }

    /// Bytes per element (FP8: its byte, the block scales aside).
    pub fn size(&self) -> usize {
        match self {
            Elems::F32(_) => 4,
            Elems::Bf16(_) | Elems::F16(_) => 2,
            Elems::F8(_) => 1,
        }
    }

    /// Bytes held: the elements, and an FP8 matrix's scales.
    pub fn bytes(&self) -> usize {
        match self {
            Elems::F8(q) => q.v.len() + 4 * q.scales.len(),
            d => d.len() * d.size(),
        }
    }

    /// The dtype's name as safetensors spells it.
    pub fn dtype(&self) -> &'static str {
        match self {
            Elems::F32(_) => "F32",
            Elems::Bf16(_) => "BF16",
            Elems::F16(_) => "F16",
            Elems::F8(_) => "F8_E4M3",
        }
    }

    /// Every element widened to f32, into a new vector.
    pub fn widened(&self) -> Vec<f32> {
        let mut out = vec![0f32; self.len()];
        self.widen_into(0, self.len(), &mut out);
        out
    }

    /// Every element widened to f32 (no copy when they are f32 already).
    pub fn into_f32(self) -> Vec<f32> {
        match self {
            Elems::F32(v) => v,
            d => d.widened(),
        }
    }

    /// Elements `a..b`, widened into `out[..b - a]` (panics, as slicing does, when either is
    /// out of range).
    pub fn widen_into(&self, a: usize, b: usize, out: &mut [f32]) {
        fn go<E: Elem>(v: &[E], out: &mut [f32]) {
            for (o, x) in out.iter_mut().zip(v) {
                *o = x.f32();
            }
        }
        let out = &mut out[..b - a];
        match self {
            Elems::F32(v) => out.copy_from_slice(&v[a..b]),
            Elems::Bf16(v) => go(&v[a..b], out),
            Elems::F16(v) => go(&v[a..b], out),
            Elems::F8(q) => {
                for (j, o) in out.iter_mut().enumerate() {
                    *o = q.v[a + j].f32() * q.scale_of(a + j);
                }
            }
        }
    }
}

/// A row-major matrix `[rows, cols]` (Hugging Face's `[out_features, in_features]`), its
/// elements kept in the dtype they were stored in (f32, bf16 or f16).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Elems,
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        Self::of(rows, cols, Elems::F32(data))
    }
    /// A matrix of stored elements (`rows * cols` of them).
    pub fn of(rows: usize, cols: usize, data: Elems) -> Self {
        assert_eq!(rows * cols, data.len(), "matrix data length");
        Matrix { rows, cols, data }
    }
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Matrix::new(rows, cols, vec![0.0; rows * cols])
    }
    /// Row `r`, widened into `out` (`cols` long).
    pub fn row_into(&self, r: usize, out: &mut [f32]) {
        self.data
            .widen_into(r * self.cols, (r + 1) * self.cols, &mut out[..self.cols]);
    }
    /// Element (r, c), widened (`c < cols`).
    pub fn at(&self, r: usize, c: usize) -> f32 {
        assert!(c < self.cols, "column {c} of {}", self.cols);
        let mut v = [0f32];
        let i = r * self.cols + c;
        self.data.widen_into(i, i + 1, &mut v);
        v[0]
    }
    /// Every element widened to f32 (a borrow when they are f32 already): what a consumer
    /// that reads only f32 (the GPU model today) uploads.
    pub fn to_f32(&self) -> std::borrow::Cow<'_, [f32]> {
        match &self.data {
            Elems::F32(v) => std::borrow::Cow::Borrowed(v),
            d => std::borrow::Cow::Owned(d.widened()),
        }
    }
    /// Rows `a..b` as their own matrix, in the stored dtype.
    /// (FP8: its blocks with it when `a` and `b` fall on block rows, else widened to f32.)
    pub fn rows_of(&self, a: usize, b: usize) -> Matrix {
        let (lo, hi) = (a * self.cols, b * self.cols);
        let data = match &self.data {
            Elems::F32(v) => Elems::F32(v[lo..hi].to_vec()),
            Elems::Bf16(v) => Elems::Bf16(v[lo..hi].to_vec()),
            Elems::F16(v) => Elems::F16(v[lo..hi].to_vec()),
            Elems::F8(q) => {
                let b0 = q.block[0];
                if a.is_multiple_of(b0) && (b.is_multiple_of(b0) || b == self.rows) {
                    let cb = q.col_blocks();
                    Elems::F8(BlockScaled {
                        v: q.v[lo..hi].to_vec(),
                        scales: q.scales[(a / b0) * cb..b.div_ceil(b0) * cb].to_vec(),
                        cols: q.cols,
                        block: q.block,
                    })
                } else {
                    let mut out = vec![0f32; hi - lo];
                    self.data.widen_into(lo, hi, &mut out);
                    Elems::F32(out)
                }
            }
        };
        Matrix::of(b - a, self.cols, data)
    }
    /// The transpose `[cols, rows]`, in the stored dtype.
    pub fn transposed(&self) -> Matrix {
        fn t<E: Copy>(v: &[E], rows: usize, cols: usize) -> Vec<E> {
            (0..cols)
                .flat_map(|c| (0..rows).map(move |r| v[r * cols + c]))
                .collect()
        }
        let (r, c) = (self.rows, self.cols);
        let data = match &self.data {
            Elems::F32(v) => Elems::F32(t(v, r, c)),
            Elems::Bf16(v) => Elems::Bf16(t(v, r, c)),
            Elems::F16(v) => Elems::F16(t(v, r, c)),
            Elems::F8(q) => {
                let (rb, cb) = (r.div_ceil(q.block[0]), q.col_blocks());
                Elems::F8(BlockScaled {
                    v: t(&q.v, r, c),
                    scales: t(&q.scales, rb, cb),
                    cols: r,
                    block: [q.block[1], q.block[0]],
                })
            }
        };
        Matrix::of(c, r, data)
    }
    /// Bytes held (the stored dtype's, with an FP8 matrix's scales).
    pub fn bytes(&self) -> usize {
        self.data.bytes()
    }
    /// The even rows, then the odd ones (gpt_oss's interleaved gate/up rows as the gate rows,
    /// then the up rows), in the stored dtype (an FP8 matrix widened).
    pub fn deinterleaved(&self) -> Matrix {
        fn d<E: Copy>(v: &[E], rows: usize, cols: usize) -> Vec<E> {
            (0..rows)
                .step_by(2)
                .chain((1..rows).step_by(2))
                .flat_map(|r| v[r * cols..(r + 1) * cols].iter().copied())
                .collect()
        }
        let (r, c) = (self.rows, self.cols);
        let data = match &self.data {
            Elems::F32(v) => Elems::F32(d(v, r, c)),
            Elems::Bf16(v) => Elems::Bf16(d(v, r, c)),
            Elems::F16(v) => Elems::F16(d(v, r, c)),
            Elems::F8(_) => Elems::F32(d(&self.to_f32(), r, c)),
        };
        Matrix::of(r, c, data)
    }
    /// These matrices' rows stacked (same columns); one dtype if all share it, else f32.
    pub fn stack(parts: &[Matrix]) -> Matrix {
        let cols = parts.first().map_or(0, |m| m.cols);
        assert!(
            parts.iter().all(|m| m.cols == cols),
            "stacked matrices' columns"
        );
        let rows = parts.iter().map(|m| m.rows).sum();
        fn cat<E: Clone>(
            parts: &[Matrix],
            get: impl Fn(&Elems) -> Option<&Vec<E>>,
        ) -> Option<Vec<E>> {
            let mut out = Vec::new();
            for m in parts {
                out.extend_from_slice(get(&m.data)?);
            }
            Some(out)
        }
        let data = if let Some(v) = cat(parts, |d| match d {
            Elems::Bf16(v) => Some(v),
            _ => None,
        }) {
            Elems::Bf16(v)
        } else if let Some(v) = cat(parts, |d| match d {
            Elems::F16(v) => Some(v),
            _ => None,
        }) {
            Elems::F16(v)
        } else if let Some(q) = stack_f8(parts) {
            Elems::F8(q)
        } else {
            let mut out = Vec::new();
            for m in parts {
                out.extend_from_slice(&m.to_f32());
            }
            Elems::F32(out)
        };
        Matrix::of(rows, cols, data)
    }
}

/// FP8 matrices stacked with their scales, when every part shares the block and all but the
/// last end on a block row (else None: the caller widens).
fn stack_f8(parts: &[Matrix]) -> Option<BlockScaled> {
    let first = match &parts.first()?.data {
        Elems::F8(q) => q,
        _ => return None,
    };
    let mut out = BlockScaled {
        v: Vec::new(),
        scales: Vec::new(),
        cols: first.cols,
        block: first.block,
    };
    for (i, m) in parts.iter().enumerate() {
        let Elems::F8(q) = &m.data else { return None };
        let last = i + 1 == parts.len();
        if q.block != first.block || (!last && !m.rows.is_multiple_of(q.block[0])) {
            return None;
        }
        out.v.extend_from_slice(&q.v);
        out.scales.extend_from_slice(&q.scales);
    }
    Some(out)
}

const LANES: usize = 16;

#[inline(always)]
fn dot_body<const FMA: bool, E: Elem>(a: &[f32], b: &[E]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; LANES];
    let chunks = n / LANES;
    for c in 0..chunks {
        let pa = &a[c * LANES..c * LANES + LANES];
        let pb = &b[c * LANES..c * LANES + LANES];
        for j in 0..LANES {
            let w = pb[j].f32();
            acc[j] = if FMA {
                pa[j].mul_add(w, acc[j])
            } else {
                pa[j] * w + acc[j]
            };
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..n {
        let w = b[i].f32();
        tail = if FMA {
            a[i].mul_add(w, tail)
        } else {
            a[i] * w + tail
        };
    }
    // fixed pairwise reduction: 16 -> 8 -> 4 -> 2 -> 1
    let mut w = LANES;
    while w > 1 {
        w /= 2;
        for j in 0..w {
            acc[j] += acc[j + w];
        }
    }
    acc[0] + tail
}

/// y[i, o] = dot(x[i], w[o]) for rows `o in o0..o1`, written at `y[i * ldy + o]`.
#[inline(always)]
fn block_body<const FMA: bool, E: Elem>(
    x: &[f32],
    n: usize,
    w: &[E],
    k: usize,
    outs: std::ops::Range<usize>,
    y: SyncPtr,
    ldy: usize,
) {
    for o in outs {
        let wr = &w[o * k..(o + 1) * k];
        for i in 0..n {
            let v = dot_body::<FMA, E>(&x[i * k..(i + 1) * k], wr);
            // SAFETY: i < n and o < w.rows <= ldy, so the index is inside y (checked by
            // the caller: y.len() >= n * ldy); each (i, o) is written by exactly one task.
            unsafe { *y.0.add(i * ldy + o) = v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_fma(a: &[f32], b: &[f32]) -> f32 {
    dot_body::<true, f32>(a, b)
}

fn has_fma() -> bool {
    static FMA: OnceLock<bool> = OnceLock::new();
    *FMA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::env::var_os("MOELANE_NO_FMA").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        }
        // every aarch64 CPU has NEON and fused multiply-add
        #[cfg(target_arch = "aarch64")]
        {
            std::env::var_os("MOELANE_NO_FMA").is_none()
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            false
        }
    })
}

/// 512-bit registers for the matrix products (`MOELANE_NO_AVX512` turns them off; the
/// results are the same bits either way).
#[cfg(target_arch = "x86_64")]
fn has_avx512() -> bool {
    static AVX512: OnceLock<bool> = OnceLock::new();
    *AVX512.get_or_init(|| {
        std::env::var_os("MOELANE_NO_AVX512").is_none() && is_x86_feature_detected!("avx512f")
    })
}

/// The dot product every kernel uses.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: the CPU supports avx2 and fma (checked at run time).
        return unsafe { dot_fma(a, b) };
    }
    #[cfg(target_arch = "aarch64")]
    if has_fma() {
        return dot_body::<true, f32>(a, b);
    }
    dot_body::<false, f32>(a, b)
}

/// An element of the KV cache: f32, or bf16 (half the bytes; rounded to nearest even as it
/// is written, widened exactly as it is read).
pub trait KvElem: Elem + Default {
    /// `v` as stored in the cache.
    fn from_f32(v: f32) -> Self;

    /// `[dot(q, rows[0]), .., dot(q, rows[3])]` over `k` elements, `dot_body`'s sums.
    ///
    /// # Safety
    /// The CPU has avx2 and fma; `q` and each of `rows` address `k` elements.
    #[cfg(target_arch = "x86_64")]
    unsafe fn dots4(q: *const f32, rows: [*const Self; 4], k: usize) -> [f32; 4];
}

impl KvElem for f32 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dots4(q: *const f32, rows: [*const Self; 4], k: usize) -> [f32; 4] {
        // SAFETY: the caller's
        unsafe { crate::ops_x86::dots4(q, rows, k) }
    }
}

impl KvElem for Bf16 {
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Bf16(half::bf16::from_f32(v).to_bits())
    }

    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    unsafe fn dots4(q: *const f32, rows: [*const Self; 4], k: usize) -> [f32; 4] {
        // SAFETY: the caller's
        unsafe { crate::ops_x86::dots4(q, rows, k) }
    }
}

/// One query head's decode attention over cached positions (see [`attend`]).
#[derive(Clone, Copy)]
pub struct Attend<'a, E: KvElem = f32> {
    /// The head's query (`head_dim` wide).
    pub q: &'a [f32],
    /// The layer's K and V caches.
    pub kc: &'a [E],
    pub vc: &'a [E],
    /// Each attended position's start in the caches, in order.
    pub offs: &'a [usize],
    /// The KV head's place in a position's row.
    pub base: usize,
    pub scale: f32,
    /// A sink logit joining the softmax (gpt_oss).
    pub sink: Option<f32>,
}

/// `a`'s attention: scores `q . k * scale` in `scores` (`offs.len()` long), their softmax
/// (with the sink where there is one), then `out = sum_j p_j v_j` (`q.len()` wide). The
/// order of every sum is fixed by the positions alone, so a row gives the same bits
/// whatever batch it is in; a bf16 cache gives the bits an f32 cache holding the same
/// (rounded) values gives.
pub fn attend<E: KvElem>(a: &Attend<E>, scores: &mut [f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: the CPU supports avx2 and fma (checked at run time).
        return unsafe { attend_fma(a, scores, out) };
    }
    #[cfg(target_arch = "aarch64")]
    if has_fma() {
        return attend_body::<true, E>(a, scores, out);
    }
    attend_body::<false, E>(a, scores, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn attend_fma<E: KvElem>(a: &Attend<E>, scores: &mut [f32], out: &mut [f32]) {
    let (hd, base) = (a.q.len(), a.base);
    // four positions' scores at a time (q loaded once for the four), the same sums as
    // dot_body's; the rest one by one
    let whole = a.offs.len() / 4 * 4;
    for (c, (s4, o4)) in scores[..whole]
        .chunks_exact_mut(4)
        .zip(a.offs.chunks_exact(4))
        .enumerate()
    {
        let (k0, k1, k2, k3) = (
            &a.kc[o4[0] + base..o4[0] + base + hd],
            &a.kc[o4[1] + base..o4[1] + base + hd],
            &a.kc[o4[2] + base..o4[2] + base + hd],
            &a.kc[o4[3] + base..o4[3] + base + hd],
        );
        // the rows AHEAD positions on, while these four are summed
        for &o in a.offs.iter().skip(c * 4 + AHEAD).take(4) {
            prefetch_row(a.kc, o + base, hd);
        }
        let d = E::dots4(
            a.q.as_ptr(),
            [k0.as_ptr(), k1.as_ptr(), k2.as_ptr(), k3.as_ptr()],
            hd,
        );
        for (s, d) in s4.iter_mut().zip(d) {
            *s = d * a.scale;
        }
    }
    for (s, &o) in scores[whole..].iter_mut().zip(&a.offs[whole..]) {
        *s = dot_body::<true, E>(a.q, &a.kc[o + base..o + base + hd]) * a.scale;
    }
    attend_rest::<true, E>(a, scores, out)
}

/// Dimensions of `out` accumulated at once in [`attend`] (kept in registers over the
/// positions: 8 independent chains of 256 bits).
const ATT_CHUNK: usize = 64;

/// Positions ahead whose K or V row [`attend`] asks the cache for.
const AHEAD: usize = 16;

/// Asks the cache for `v[at..at + len]` (a hint: no effect on results; nothing where the
/// range is not inside `v`).
#[inline(always)]
fn prefetch_row<E>(v: &[E], at: usize, len: usize) {
    #[cfg(target_arch = "x86_64")]
    if at + len <= v.len() {
        // a 64-byte line at a time
        let step = (64 / std::mem::size_of::<E>().max(1)).max(1);
        let mut i = 0;
        while i < len {
            // SAFETY: a prefetch of an address inside `v` (checked) reads nothing.
            unsafe {
                std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                    v.as_ptr().add(at + i).cast(),
                )
            };
            i += step;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (v, at, len);
}

#[inline(always)]
fn attend_body<const FMA: bool, E: KvElem>(a: &Attend<E>, scores: &mut [f32], out: &mut [f32]) {
    let (hd, base) = (a.q.len(), a.base);
    for (s, &o) in scores.iter_mut().zip(a.offs) {
        *s = dot_body::<FMA, E>(a.q, &a.kc[o + base..o + base + hd]) * a.scale;
    }
    attend_rest::<FMA, E>(a, scores, out)
}

/// [`attend`] after the scores: their softmax and the weighted sum of the V rows.
#[inline(always)]
fn attend_rest<const FMA: bool, E: KvElem>(a: &Attend<E>, scores: &mut [f32], out: &mut [f32]) {
    let (hd, base, vc, offs) = (a.q.len(), a.base, a.vc, a.offs);
    match a.sink {
        Some(x) => softmax_with_sink(scores, x),
        None => softmax(scores),
    }
    let fma = |p: f32, v: f32, s: f32| if FMA { p.mul_add(v, s) } else { p * v + s };
    let mut c0 = 0;
    while c0 < hd {
        let w = (hd - c0).min(ATT_CHUNK);
        let mut acc = [0f32; ATT_CHUNK];
        if w == ATT_CHUNK {
            for (j, (&p, &o)) in scores.iter().zip(offs).enumerate() {
                if let Some(&ahead) = offs.get(j + AHEAD) {
                    prefetch_row(vc, ahead + base + c0, w);
                }
                let v: &[E; ATT_CHUNK] = match vc[o + base + c0..o + base + c0 + w].try_into() {
                    Ok(v) => v,
                    Err(_) => unreachable!("a slice of ATT_CHUNK"),
                };
                for d in 0..ATT_CHUNK {
                    acc[d] = fma(p, v[d].f32(), acc[d]);
                }
            }
        } else {
            for (&p, &o) in scores.iter().zip(offs) {
                let v = &vc[o + base + c0..o + base + c0 + w];
                for d in 0..w {
                    acc[d] = fma(p, v[d].f32(), acc[d]);
                }
            }
        }
        out[c0..c0 + w].copy_from_slice(&acc[..w]);
        c0 += w;
    }
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: SyncPtr is only used to write disjoint elements from parallel tasks.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

fn run_block(
    x: &[f32],
    n: usize,
    w: &Matrix,
    outs: std::ops::Range<usize>,
    y: SyncPtr,
    ldy: usize,
) {
    #[cfg(target_arch = "aarch64")]
    use crate::ops_arm::Wide;
    #[cfg(target_arch = "x86_64")]
    use crate::ops_x86::Wide;
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    use Elem as Wide;
    fn wide<E: Wide>(
        x: &[f32],
        n: usize,
        w: &[E],
        k: usize,
        outs: std::ops::Range<usize>,
        y: SyncPtr,
        ldy: usize,
    ) {
        #[cfg(target_arch = "x86_64")]
        if has_fma() {
            let (wp, yp) = (w.as_ptr(), y.0);
            debug_assert!(x.len() >= n * k && w.len() >= outs.end * k);
            // SAFETY: the CPU has the features each path needs (checked at run time); x
            // holds n rows of k, w at least outs.end rows of k, and y n rows of ldy >=
            // outs.end (checked by `matmul`); each (i, o) is written by this task alone.
            unsafe {
                if has_avx512() {
                    crate::ops_x86::block512(x.as_ptr(), n, wp, k, outs, yp, ldy);
                } else {
                    crate::ops_x86::block256(x.as_ptr(), n, wp, k, outs, yp, ldy);
                }
            }
            return;
        }
        #[cfg(target_arch = "aarch64")]
        if has_fma() {
            debug_assert!(x.len() >= n * k && w.len() >= outs.end * k);
            // SAFETY: NEON is part of aarch64; x holds n rows of k, w at least outs.end rows
            // of k, and y n rows of ldy >= outs.end (checked by `matmul`); each (i, o) is
            // written by this task alone.
            unsafe {
                crate::ops_arm::block_neon(x.as_ptr(), n, w.as_ptr(), k, outs, y.0, ldy);
            }
            return;
        }
        block_body::<false, E>(x, n, w, k, outs, y, ldy)
    }
    let k = w.cols;
    match &w.data {
        Elems::F32(v) => wide(x, n, v, k, outs, y, ldy),
        Elems::Bf16(v) => wide(x, n, v, k, outs, y, ldy),
        Elems::F16(v) => wide(x, n, v, k, outs, y, ldy),
        Elems::F8(q) => {
            #[cfg(target_arch = "x86_64")]
            if has_fma() {
                // SAFETY: the CPU supports avx2 and fma (checked at run time).
                unsafe { block_f8_fma(x, n, q, outs, y, ldy) };
                return;
            }
            #[cfg(target_arch = "aarch64")]
            if has_fma() {
                return block_f8::<true>(x, n, q, outs, y, ldy);
            }
            block_f8::<false>(x, n, q, outs, y, ldy)
        }
    }
}

/// As `block_body` for FP8 rows: per block of columns, the dot product over the stored bytes,
/// times the block's scale, summed over the blocks in order.
#[inline(always)]
fn block_f8<const FMA: bool>(
    x: &[f32],
    n: usize,
    q: &BlockScaled,
    outs: std::ops::Range<usize>,
    y: SyncPtr,
    ldy: usize,
) {
    let (k, b1, cb) = (q.cols, q.block[1].max(1), q.col_blocks());
    for o in outs {
        let wr = &q.v[o * k..(o + 1) * k];
        let srow = &q.scales[(o / q.block[0]) * cb..(o / q.block[0] + 1) * cb];
        for i in 0..n {
            let xr = &x[i * k..(i + 1) * k];
            let mut v = 0f32;
            for (j, &s) in srow.iter().enumerate() {
                let (c0, c1) = (j * b1, ((j + 1) * b1).min(k));
                v += s * dot_body::<FMA, F8>(&xr[c0..c1], &wr[c0..c1]);
            }
            // SAFETY: as in `block_body`.
            unsafe { *y.0.add(i * ldy + o) = v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_f8_fma(
    x: &[f32],
    n: usize,
    q: &BlockScaled,
    outs: std::ops::Range<usize>,
    y: SyncPtr,
    ldy: usize,
) {
    block_f8::<true>(x, n, q, outs, y, ldy)
}

/// Work (multiply-adds) under which a matmul runs on the calling thread.
pub(crate) const PAR_MIN_WORK: usize = 1 << 16;

/// Multiply-adds under which a task of a parallel product is not split further.
const MIN_TASK_WORK: usize = 1 << 14;

/// y[n, w.rows] = x[n, w.cols] · wᵀ. Batch-invariant: row i of y depends only on row i of x.
pub fn matmul(x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) {
    assert!(x.len() >= n * w.cols, "matmul: x too short");
    assert!(y.len() >= n * w.rows, "matmul: y too short");
    let ptr = SyncPtr(y.as_mut_ptr());
    let work = n * w.rows * w.cols;
    let team = crate::team::team();
    if work < PAR_MIN_WORK || team.threads() == 1 {
        run_block(x, n, w, 0..w.rows, ptr, w.rows);
        return;
    }
    // Split the output rows into chunks of ~PAR_MIN_WORK work, at least two a thread (the
    // threads' speeds differ on a shared host), but never under MIN_TASK_WORK or 16 rows:
    // a smaller task costs its handoff more than its work.
    let per_row = n * w.cols;
    let chunk = (PAR_MIN_WORK / per_row.max(1))
        .min(w.rows.div_ceil(2 * team.threads()))
        .max(MIN_TASK_WORK / per_row.max(1))
        .max(16);
    let chunks = w.rows.div_ceil(chunk);
    team.run(chunks, &|c| {
        let o0 = c * chunk;
        let o1 = (o0 + chunk).min(w.rows);
        run_block(x, n, w, o0..o1, ptr, w.rows);
    });
}

/// Hugging Face RMSNorm: x * rsqrt(mean(x²) + eps) * weight, per row of `w.len()`.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32, y: &mut [f32]) {
    let d = w.len();
    for (xr, yr) in x.chunks_exact(d).zip(y.chunks_exact_mut(d)) {
        let ms = dot(xr, xr) / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for j in 0..d {
            yr[j] = w[j] * (xr[j] * inv);
        }
    }
}

/// In-place RMSNorm of each `w.len()`-wide chunk (q/k norm per head).
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let d = w.len();
    for xr in x.chunks_exact_mut(d) {
        let ms = dot(xr, xr) / d as f32;
        let inv = 1.0 / (ms + eps).sqrt();
        for j in 0..d {
            xr[j] = w[j] * (xr[j] * inv);
        }
    }
}

pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// Softmax in place over `x` and one more logit, `sink`, whose share is dropped (gpt_oss's
/// attention sinks): the weights sum to less than 1.
pub fn softmax_with_sink(x: &mut [f32], sink: f32) {
    let m = x.iter().copied().fold(sink, f32::max);
    let mut s = (sink - m).exp();
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// Softmax in place, in f32, max-subtracted.
pub fn softmax(x: &mut [f32]) {
    let m = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut s = 0.0;
    for v in x.iter_mut() {
        *v = (*v - m).exp();
        s += *v;
    }
    let inv = 1.0 / s;
    for v in x.iter_mut() {
        *v *= inv;
    }
}

/// The most positions RoPE tables are built for (262,144: DeepSeek-V3's, GLM-4.5's and
/// Kimi K2's 128k-160k contexts fit); a longer position is refused as a context overflow.
pub const MAX_ROPE_POSITIONS: usize = 1 << 18;

/// RoPE cos/sin tables, `[max_pos, head_dim / 2]`, computed in f32 as Hugging Face does.
#[derive(Clone, Debug)]
pub struct Rope {
    pub half: usize,
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
    pub max_pos: usize,
}

impl Rope {
    pub fn new(head_dim: usize, theta: f32, max_pos: usize) -> Self {
        Self::scaled(head_dim, theta, max_pos, None)
    }

    /// The tables of `dim` rotated dimensions, with YaRN's frequencies and table scale when
    /// given (computed in f32 as transformers does).
    pub fn scaled(
        head_dim: usize,
        theta: f32,
        max_pos: usize,
        yarn: Option<&crate::config::Yarn>,
    ) -> Self {
        let half = head_dim / 2;
        let mut inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut scale = 1.0f32;
        if let Some(y) = yarn {
            let d = head_dim as f64;
            let corr = |rot: f64| {
                d * (y.original_max_position_embeddings as f64 / (rot * 2.0 * std::f64::consts::PI))
                    .ln()
                    / (2.0 * (theta as f64).ln())
            };
            let (lo, hi) = (corr(y.beta_fast as f64), corr(y.beta_slow as f64));
            let (lo, hi) = if y.truncate {
                (lo.floor(), hi.ceil())
            } else {
                (lo, hi)
            };
            let low = lo.max(0.0) as f32;
            let high = hi.min(d - 1.0) as f32;
            let high = if low == high { high + 0.001 } else { high };
            for (i, f) in inv.iter_mut().enumerate() {
                let pos_freq = theta.powf((2 * i) as f32 / head_dim as f32);
                let (extra, inter) = (1.0 / pos_freq, 1.0 / (y.factor * pos_freq));
                let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                let ef = 1.0 - ramp;
                *f = inter * (1.0 - ef) + extra * ef;
            }
            scale = y.attention_factor;
        }
        let mut cos = vec![0.0; max_pos * half];
        let mut sin = vec![0.0; max_pos * half];
        for p in 0..max_pos {
            for i in 0..half {
                let f = p as f32 * inv[i];
                cos[p * half + i] = f.cos() * scale;
                sin[p * half + i] = f.sin() * scale;
            }
        }
        Rope {
            half,
            cos,
            sin,
            max_pos,
        }
    }

    /// Rotates one head vector whose pairs are interleaved, `(v[2i], v[2i+1])` by frequency
    /// i (deepseek_v3's layout), in place.
    pub fn apply_interleaved(&self, v: &mut [f32], pos: usize) {
        let h = self.half;
        let c = &self.cos[pos * h..(pos + 1) * h];
        let s = &self.sin[pos * h..(pos + 1) * h];
        for i in 0..h {
            let a = v[2 * i];
            let b = v[2 * i + 1];
            v[2 * i] = a * c[i] - b * s[i];
            v[2 * i + 1] = b * c[i] + a * s[i];
        }
    }

    /// Rotates one head vector (rotate-half layout) for position `pos`.
    pub fn apply(&self, v: &mut [f32], pos: usize) {
        let h = self.half;
        let c = &self.cos[pos * h..(pos + 1) * h];
        let s = &self.sin[pos * h..(pos + 1) * h];
        for i in 0..h {
            let a = v[i];
            let b = v[i + h];
            v[i] = a * c[i] - b * s[i];
            v[i + h] = b * c[i] + a * s[i];
        }
    }
}

/// The sigmoid router's choice (glm4_moe, deepseek_v3): `p` holds the logits of one row and
/// is left holding their sigmoids; the choice ranks sigmoid + `bias` (empty: none) among the
/// experts of the `topk_group` best of `n_group` equal groups (a group scored by the sum of its
/// two best), the others out of the running (scored -inf, as transformers 5 masks them);
/// `top` gets the k picks, best
/// first, with their choice scores (ties to the lower index). `choice`: scratch.
pub fn sigmoid_grouped_topk(
    p: &mut [f32],
    bias: &[f32],
    n_group: usize,
    topk_group: usize,
    k: usize,
    choice: &mut Vec<f32>,
    top: &mut Vec<(usize, f32)>,
) {
    let ne = p.len();
    choice.clear();
    for (e, x) in p.iter_mut().enumerate() {
        *x = 1.0 / (1.0 + (-*x).exp());
        choice.push(*x + bias.get(e).copied().unwrap_or(0.0));
    }
    let per = ne / n_group.max(1);
    if n_group > 1 && topk_group < n_group {
        let mut groups: Vec<(usize, f32)> = (0..n_group)
            .map(|g| {
                let s = &choice[g * per..(g + 1) * per];
                let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
                for &x in s {
                    if x > a {
                        b = a;
                        a = x;
                    } else if x > b {
                        b = x;
                    }
                }
                (g, a + b)
            })
            .collect();
        groups.sort_by(|x, y| y.1.total_cmp(&x.1).then(x.0.cmp(&y.0)));
        let mut keep = vec![false; n_group];
        for &(g, _) in &groups[..topk_group] {
            keep[g] = true;
        }
        for (e, c) in choice.iter_mut().enumerate() {
            if !keep[e / per] {
                *c = f32::NEG_INFINITY;
            }
        }
    }
    topk(choice, k, top);
}

/// Top-k of a probability row, descending, ties to the lower index (as torch.topk on distinct values).
pub fn topk(p: &[f32], k: usize, out: &mut Vec<(usize, f32)>) {
    out.clear();
    for (i, &v) in p.iter().enumerate() {
        if out.len() < k {
            out.push((i, v));
            let mut j = out.len() - 1;
            while j > 0 && out[j - 1].1 < out[j].1 {
                out.swap(j - 1, j);
                j -= 1;
            }
        } else if v > out[k - 1].1 {
            out[k - 1] = (i, v);
            let mut j = k - 1;
            while j > 0 && out[j - 1].1 < out[j].1 {
                out.swap(j - 1, j);
                j -= 1;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    /// NaN and infinite elements counted in every stored dtype (what the loader warns of).
    #[test]
    fn non_finite_elements_are_counted_in_every_dtype() {
        let f = Elems::F32(vec![1.0, f32::NAN, f32::INFINITY, -0.0]);
        assert_eq!(f.non_finite(), 2);
        // bf16: 0x7fc0 NaN, 0xff80 -inf, 0x3f80 1.0
        assert_eq!(
            Elems::Bf16(vec![Bf16(0x7fc0), Bf16(0xff80), Bf16(0x3f80)]).non_finite(),
            2
        );
        // f16: 0x7e00 NaN, 0x3c00 1.0
        assert_eq!(Elems::F16(vec![F16(0x7e00), F16(0x3c00)]).non_finite(), 1);
        // e4m3fn: 0x7f and 0xff are NaN, 0x7e (448) is not; one bad scale
        let q = BlockScaled {
            v: vec![F8(0x7f), F8(0xff), F8(0x7e)],
            scales: vec![f32::NAN],
            cols: 3,
            block: [1, 4],
        };
        assert_eq!(Elems::F8(q).non_finite(), 3);
    }

    #[test]
    fn attention_matches_a_plain_sum_and_one_order_of_sums() {
        let mut r = Rng::new(5);
        for (hd, npos, sink) in [
            (64, 37, None),
            (64, 4, Some(0.3f32)),
            (128, 130, None),
            (48, 9, Some(-1.0)),
            (16, 1, None),
            (80, 3, None),
        ] {
            // two KV heads a position, positions scattered in a larger cache
            let kvd = 2 * hd;
            let slots = 3 * npos + 5;
            let kc: Vec<f32> = (0..slots * kvd).map(|_| r.uniform() - 0.5).collect();
            let vc: Vec<f32> = (0..slots * kvd).map(|_| r.uniform() - 0.5).collect();
            let offs: Vec<usize> = (0..npos).map(|j| ((j * 7 + 3) % slots) * kvd).collect();
            let q: Vec<f32> = (0..hd).map(|_| r.uniform() * 2.0 - 1.0).collect();
            let (base, scale) = (hd, 0.125f32);
            let mut scores = vec![0f32; npos];
            let mut out = vec![f32::NAN; hd];
            let a = Attend {
                q: &q,
                kc: &kc,
                vc: &vc,
                offs: &offs,
                base,
                scale,
                sink,
            };
            attend(&a, &mut scores, &mut out);
            // the plain sum, in f64
            let s: Vec<f64> = offs
                .iter()
                .map(|&o| {
                    (0..hd)
                        .map(|d| q[d] as f64 * kc[o + base + d] as f64)
                        .sum::<f64>()
                        * scale as f64
                })
                .collect();
            let m = s
                .iter()
                .copied()
                .fold(sink.map_or(f64::MIN, |x| x as f64), f64::max);
            let z: f64 = s.iter().map(|x| (x - m).exp()).sum::<f64>()
                + sink.map_or(0.0, |x| (x as f64 - m).exp());
            for d in 0..hd {
                let want: f64 = offs
                    .iter()
                    .zip(&s)
                    .map(|(&o, &x)| (x - m).exp() / z * vc[o + base + d] as f64)
                    .sum();
                assert!(
                    (out[d] as f64 - want).abs() < 1e-5,
                    "hd {hd}, {npos} positions, dim {d}: {} against {want}",
                    out[d]
                );
            }
            // the dispatched kernel (four positions at a time on x86) gives the bits of the
            // one-position-at-a-time sums
            let mut s2 = vec![0f32; npos];
            let mut o2 = vec![f32::NAN; hd];
            attend_body::<true, f32>(&a, &mut s2, &mut o2);
            if has_fma() {
                assert_eq!(
                    out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    o2.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                    "hd {hd}, {npos} positions"
                );
            }
            // a bf16 cache: the bits of an f32 cache holding the same rounded values
            let k16: Vec<Bf16> = kc.iter().map(|&x| Bf16::from_f32(x)).collect();
            let v16: Vec<Bf16> = vc.iter().map(|&x| Bf16::from_f32(x)).collect();
            let (kw, vw): (Vec<f32>, Vec<f32>) = (
                k16.iter().map(|x| x.f32()).collect(),
                v16.iter().map(|x| x.f32()).collect(),
            );
            let mut o16 = vec![f32::NAN; hd];
            let mut ow = vec![f32::NAN; hd];
            let a16 = Attend {
                kc: &k16,
                vc: &v16,
                q: &q,
                offs: &offs,
                base,
                scale,
                sink,
            };
            attend(&a16, &mut vec![0f32; npos], &mut o16);
            let aw = Attend {
                kc: &kw,
                vc: &vw,
                ..a
            };
            attend(&aw, &mut vec![0f32; npos], &mut ow);
            assert_eq!(
                o16.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                ow.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "bf16 cache, hd {hd}, {npos} positions"
            );
            // and close to the f32 cache's (bf16 keeps 8 bits of mantissa)
            for d in 0..hd {
                assert!(
                    (o16[d] - out[d]).abs() < 2e-2,
                    "bf16 cache, dim {d}: {} against {}",
                    o16[d],
                    out[d]
                );
            }
            assert_eq!(Bf16::from_f32(1.0 + 1.0 / 256.0).f32(), 1.0, "ties to even");
            assert_eq!(Bf16::from_f32(1.0 + 3.0 / 256.0).f32(), 1.0 + 4.0 / 256.0);
        }
    }

    fn naive(x: &[f32], n: usize, w: &Matrix) -> Vec<f32> {
        let mut y = vec![0.0; n * w.rows];
        for i in 0..n {
            for o in 0..w.rows {
                let mut s = 0f64;
                for k in 0..w.cols {
                    s += x[i * w.cols + k] as f64 * w.at(o, k) as f64;
                }
                y[i * w.rows + o] = s as f32;
            }
        }
        y
    }

    #[test]
    fn matmul_matches_naive_and_is_batch_invariant() {
        let mut r = Rng::new(1);
        for &(n, rows, cols) in &[(1, 7, 5), (3, 33, 17), (16, 300, 256), (5, 1000, 64)] {
            let x: Vec<f32> = (0..n * cols).map(|_| r.normal()).collect();
            let w = Matrix::new(rows, cols, (0..rows * cols).map(|_| r.normal()).collect());
            let mut y = vec![0.0; n * rows];
            matmul(&x, n, &w, &mut y);
            let want = naive(&x, n, &w);
            for (a, b) in y.iter().zip(&want) {
                assert!((a - b).abs() <= 1e-4 * (1.0 + b.abs()), "{a} vs {b}");
            }
            // each row alone gives bitwise the same result
            for i in 0..n {
                let mut yi = vec![0.0; rows];
                matmul(&x[i * cols..(i + 1) * cols], 1, &w, &mut yi);
                assert_eq!(&yi[..], &y[i * rows..(i + 1) * rows]);
            }
        }
    }

    /// Every product path (scalar, 256-bit, 512-bit, any tile and leftover) gives each
    /// output bitwise what one `dot` of its row and column gives: the CPU engine's parity
    /// across batch sizes, maps and machines' register widths rests on it.
    #[test]
    fn every_kernel_path_gives_the_bits_of_one_dot() {
        let mut r = Rng::new(7);
        for &(n, rows, k) in &[
            (1, 1, 16),
            (1, 13, 70),
            (2, 9, 256),
            (3, 17, 33),
            (4, 8, 64),
            (5, 11, 300),
            (16, 37, 128),
            (17, 6, 15),
        ] {
            let x: Vec<f32> = (0..n * k).map(|_| r.normal()).collect();
            let wf: Vec<f32> = (0..rows * k).map(|_| r.normal()).collect();
            let bf: Vec<Bf16> = wf
                .iter()
                .map(|&v| Bf16(half::bf16::from_f32(v).to_bits()))
                .collect();
            let hf: Vec<F16> = wf
                .iter()
                .map(|&v| F16(half::f16::from_f32(v).to_bits()))
                .collect();
            for w in [
                Matrix::new(rows, k, wf.clone()),
                Matrix::of(rows, k, Elems::Bf16(bf.clone())),
                Matrix::of(rows, k, Elems::F16(hf.clone())),
            ] {
                let wide = w.to_f32();
                let want: Vec<f32> = (0..n)
                    .flat_map(|i| {
                        let xi = &x[i * k..(i + 1) * k];
                        (0..rows)
                            .map(|o| dot(xi, &wide[o * k..(o + 1) * k]))
                            .collect::<Vec<_>>()
                    })
                    .collect();
                let mut y = vec![0.0; n * rows];
                matmul(&x, n, &w, &mut y);
                assert_eq!(y, want, "matmul {} n {n} rows {rows} k {k}", w.data.dtype());
                #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
                if has_fma() {
                    match &w.data {
                        Elems::F32(v) => each_kernel(&x, n, v, rows, k, &want),
                        Elems::Bf16(v) => each_kernel(&x, n, v, rows, k, &want),
                        Elems::F16(v) => each_kernel(&x, n, v, rows, k, &want),
                        Elems::F8(_) => {}
                    }
                }
            }
        }
    }

    #[cfg(target_arch = "aarch64")]
    use crate::ops_arm::Wide;
    #[cfg(target_arch = "x86_64")]
    use crate::ops_x86::Wide;

    /// A product kernel's entry point.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    type Kernel<E> =
        unsafe fn(*const f32, usize, *const E, usize, std::ops::Range<usize>, *mut f32, usize);

    /// Each register-width kernel this CPU has, with the weight rows split unevenly (as the
    /// team's chunks split them): each output `want`'s bits.
    #[cfg(any(target_arch = "x86_64", target_arch = "aarch64"))]
    fn each_kernel<E: Wide>(x: &[f32], n: usize, w: &[E], rows: usize, k: usize, want: &[f32]) {
        let mut kernels: Vec<(&str, Kernel<E>)> = Vec::new();
        #[cfg(target_arch = "x86_64")]
        {
            kernels.push(("256-bit", crate::ops_x86::block256::<E>));
            if is_x86_feature_detected!("avx512f") {
                kernels.push(("512-bit", crate::ops_x86::block512::<E>));
            }
        }
        #[cfg(target_arch = "aarch64")]
        kernels.push(("neon", crate::ops_arm::block_neon::<E>));
        for (name, kernel) in kernels {
            let mut y = vec![f32::NAN; n * rows];
            for (a, b) in [(0, rows / 3), (rows / 3, rows)] {
                // SAFETY: the CPU has the kernel's features (has_fma and the check above);
                // x, w and y hold n x k, rows x k and n x rows.
                unsafe { kernel(x.as_ptr(), n, w.as_ptr(), k, a..b, y.as_mut_ptr(), rows) }
            }
            let same = y.iter().zip(want).all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "{name}: n {n} rows {rows} k {k}");
        }
    }

    #[test]
    fn every_half_widens_as_the_half_crate_does() {
        for bits in 0..=u16::MAX {
            let want = half::f16::from_bits(bits).to_f32();
            let got = F16(bits).f32();
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "{bits:#06x}: {got} vs {want}"
            );
            let want = half::bf16::from_bits(bits).to_f32();
            let got = Bf16(bits).f32();
            assert!(
                got.to_bits() == want.to_bits() || (got.is_nan() && want.is_nan()),
                "bf16 {bits:#06x}"
            );
        }
    }

    #[test]
    fn sixteen_bit_weights_give_the_products_of_their_widened_copy() {
        let mut r = Rng::new(3);
        for &(n, rows, cols) in &[(1, 7, 5), (3, 33, 17), (16, 300, 256), (5, 1000, 64)] {
            let x: Vec<f32> = (0..n * cols).map(|_| r.normal()).collect();
            let vals: Vec<f32> = (0..rows * cols).map(|_| r.normal()).collect();
            let bf = Matrix::of(
                rows,
                cols,
                Elems::Bf16(
                    vals.iter()
                        .map(|&v| Bf16(half::bf16::from_f32(v).to_bits()))
                        .collect(),
                ),
            );
            let hf = Matrix::of(
                rows,
                cols,
                Elems::F16(
                    vals.iter()
                        .map(|&v| F16(half::f16::from_f32(v).to_bits()))
                        .collect(),
                ),
            );
            for m in [bf, hf] {
                let wide = Matrix::new(rows, cols, m.to_f32().into_owned());
                assert_eq!(m.bytes() * 2, wide.bytes());
                let (mut a, mut b) = (vec![0.0; n * rows], vec![0.0; n * rows]);
                matmul(&x, n, &m, &mut a);
                matmul(&x, n, &wide, &mut b);
                assert_eq!(a, b, "{} {n}x{rows}x{cols}", m.data.dtype());
                let mut row = vec![0.0; cols];
                m.row_into(rows - 1, &mut row);
                assert_eq!(&row[..], &wide.to_f32()[(rows - 1) * cols..]);
            }
        }
    }

    #[test]
    fn stacking_keeps_a_shared_dtype_and_widens_a_mixed_one() {
        let b = |v: &[u16]| {
            Matrix::of(
                1,
                v.len(),
                Elems::Bf16(v.iter().map(|&x| Bf16(x)).collect()),
            )
        };
        let s = Matrix::stack(&[b(&[0x3f80, 0x4000]), b(&[0x4040, 0x4080])]);
        assert_eq!((s.rows, s.cols, s.data.dtype()), (2, 2, "BF16"));
        assert_eq!(s.at(1, 1), 4.0);
        let m = Matrix::stack(&[b(&[0x3f80, 0x4000]), Matrix::new(1, 2, vec![5.0, 6.0])]);
        assert_eq!(m.data, Elems::F32(vec![1.0, 2.0, 5.0, 6.0]));
    }

    #[test]
    fn rope_tables_reach_the_long_contexts_of_the_supported_families() {
        // DeepSeek-V3's 163,840 and GLM-4.5's / Kimi K2's 131,072 positions
        const { assert!(MAX_ROPE_POSITIONS >= 163_840) };
        let r = Rope::new(8, 10000.0, 163_840);
        let mut v = [1.0f32; 8];
        r.apply(&mut v, 163_839);
        assert!(v.iter().all(|x| x.is_finite()));
    }

    #[test]
    fn e4m3_values_and_rounding() {
        assert_eq!(F8(0x7e).f32(), 448.0);
        assert_eq!(F8(0x38).f32(), 1.0);
        assert_eq!(F8(0x08).f32(), 2f32.powi(-6));
        assert_eq!(F8(0x01).f32(), 2f32.powi(-9));
        assert_eq!(F8(0xb8).f32(), -1.0);
        assert!(F8(0x7f).f32().is_nan() && F8(0xff).f32().is_nan());
        // every finite code round-trips; positive codes increase
        for c in 0..=0xffu8 {
            let v = F8(c).f32();
            if !v.is_nan() && c != 0x80 {
                assert_eq!(F8::from_f32(v).0, c, "code {c:#x}");
            }
        }
        for c in 0..0x7eu8 {
            assert!(F8(c).f32() < F8(c + 1).f32());
        }
        // nearest, ties to the even code, saturation
        assert_eq!(F8::from_f32(1.0625).0, 0x38); // between 1.0 (0x38) and 1.125: even
        assert_eq!(F8::from_f32(1.07).0, 0x39);
        assert_eq!(F8::from_f32(1e6).0, 0x7e);
        assert_eq!(F8::from_f32(-1e6).0, 0xfe);
    }

    #[test]
    fn block_scaled_products_match_the_dequantised_matrix() {
        let mut rng = Rng::new(3);
        let (rows, cols, block): (usize, usize, [usize; 2]) = (13, 37, [4, 16]);
        let v: Vec<F8> = (0..rows * cols)
            .map(|_| F8::from_f32(rng.normal() * 100.0))
            .collect();
        let (rb, cb) = (rows.div_ceil(4), cols.div_ceil(16));
        let scales: Vec<f32> = (0..rb * cb).map(|i| 0.01 * (i + 1) as f32).collect();
        let q = Matrix::of(
            rows,
            cols,
            Elems::F8(BlockScaled {
                v,
                scales,
                cols,
                block,
            }),
        );
        let deq = Matrix::new(rows, cols, q.to_f32().into_owned());
        let x: Vec<f32> = (0..3 * cols).map(|_| rng.normal()).collect();
        let (mut a, mut b) = (vec![0f32; 3 * rows], vec![0f32; 3 * rows]);
        matmul(&x, 3, &q, &mut a);
        matmul(&x, 3, &deq, &mut b);
        for (p, r) in a.iter().zip(&b) {
            assert!((p - r).abs() <= 1e-4 * r.abs().max(1.0), "{p} vs {r}");
        }
        // transposed and row slices keep the blocks (or widen) with the same values
        assert_eq!(
            q.transposed().to_f32().into_owned(),
            deq.transposed().to_f32().into_owned()
        );
        assert_eq!(
            q.rows_of(4, 12).to_f32().into_owned(),
            deq.rows_of(4, 12).to_f32().into_owned()
        );
        assert_eq!(
            q.rows_of(3, 9).to_f32().into_owned(),
            deq.rows_of(3, 9).to_f32().into_owned()
        );
        assert!(matches!(q.rows_of(4, 12).data, Elems::F8(_)));
        let s = Matrix::stack(&[q.rows_of(0, 8), q.rows_of(8, 13)]);
        assert_eq!(s, q);
    }

    #[test]
    fn topk_orders_descending() {
        let mut out = Vec::new();
        topk(&[0.1, 0.5, 0.2, 0.9, 0.3], 3, &mut out);
        assert_eq!(out.iter().map(|x| x.0).collect::<Vec<_>>(), vec![3, 1, 4]);
    }

    #[test]
    fn rope_rotates_by_position() {
        let rope = Rope::new(4, 10000.0, 8);
        let mut v = vec![1.0, 0.0, 0.0, 0.0];
        rope.apply(&mut v, 1);
        assert!((v[0] - 1f32.cos()).abs() < 1e-6 && (v[2] - 1f32.sin()).abs() < 1e-6);
    }
}
