//! CPU kernels. Every output element is one dot product computed in a fixed order
//! (16 lanes, then a fixed pairwise reduction), whatever the batch size, the thread
//! count or the tier that runs it: results are batch-invariant and bitwise reproducible
//! on one machine. On x86-64 with AVX2+FMA the same code is compiled with fused
//! multiply-add (chosen once per process), elsewhere with separate multiply and add.

use rayon::prelude::*;
use std::sync::OnceLock;

/// A row-major matrix `[rows, cols]` (Hugging Face's `[out_features, in_features]`).
#[derive(Clone, Debug, PartialEq)]
pub struct Matrix {
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<f32>,
}

impl Matrix {
    pub fn new(rows: usize, cols: usize, data: Vec<f32>) -> Self {
        assert_eq!(rows * cols, data.len(), "matrix data length");
        Matrix { rows, cols, data }
    }
    pub fn zeros(rows: usize, cols: usize) -> Self {
        Matrix::new(rows, cols, vec![0.0; rows * cols])
    }
    pub fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
    pub fn bytes(&self) -> usize {
        self.data.len() * 4
    }
}

const LANES: usize = 16;

#[inline(always)]
fn dot_body<const FMA: bool>(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let mut acc = [0f32; LANES];
    let chunks = n / LANES;
    for c in 0..chunks {
        let pa = &a[c * LANES..c * LANES + LANES];
        let pb = &b[c * LANES..c * LANES + LANES];
        for j in 0..LANES {
            acc[j] = if FMA {
                pa[j].mul_add(pb[j], acc[j])
            } else {
                pa[j] * pb[j] + acc[j]
            };
        }
    }
    let mut tail = 0f32;
    for i in chunks * LANES..n {
        tail = if FMA {
            a[i].mul_add(b[i], tail)
        } else {
            a[i] * b[i] + tail
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
fn block_body<const FMA: bool>(
    x: &[f32],
    n: usize,
    w: &Matrix,
    o0: usize,
    o1: usize,
    y: SyncPtr,
    ldy: usize,
) {
    let k = w.cols;
    for o in o0..o1 {
        let wr = &w.data[o * k..(o + 1) * k];
        for i in 0..n {
            let v = dot_body::<FMA>(&x[i * k..(i + 1) * k], wr);
            // SAFETY: i < n and o < w.rows <= ldy, so the index is inside y (checked by
            // the caller: y.len() >= n * ldy); each (i, o) is written by exactly one task.
            unsafe { *y.0.add(i * ldy + o) = v };
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn block_fma(x: &[f32], n: usize, w: &Matrix, o0: usize, o1: usize, y: SyncPtr, ldy: usize) {
    block_body::<true>(x, n, w, o0, o1, y, ldy)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn dot_fma(a: &[f32], b: &[f32]) -> f32 {
    dot_body::<true>(a, b)
}

fn block_plain(x: &[f32], n: usize, w: &Matrix, o0: usize, o1: usize, y: SyncPtr, ldy: usize) {
    block_body::<false>(x, n, w, o0, o1, y, ldy)
}

fn has_fma() -> bool {
    static FMA: OnceLock<bool> = OnceLock::new();
    *FMA.get_or_init(|| {
        #[cfg(target_arch = "x86_64")]
        {
            std::env::var_os("MOELANE_NO_FMA").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
        }
        #[cfg(not(target_arch = "x86_64"))]
        {
            false
        }
    })
}

/// The dot product every kernel uses.
pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: the CPU supports avx2 and fma (checked at run time).
        return unsafe { dot_fma(a, b) };
    }
    dot_body::<false>(a, b)
}

#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: SyncPtr is only used to write disjoint elements from parallel tasks.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

fn run_block(x: &[f32], n: usize, w: &Matrix, o0: usize, o1: usize, y: SyncPtr, ldy: usize) {
    #[cfg(target_arch = "x86_64")]
    if has_fma() {
        // SAFETY: the CPU supports avx2 and fma (checked at run time).
        unsafe { block_fma(x, n, w, o0, o1, y, ldy) };
        return;
    }
    block_plain(x, n, w, o0, o1, y, ldy)
}

/// Work (multiply-adds) under which a matmul runs on the calling thread.
const PAR_MIN_WORK: usize = 1 << 16;

/// y[n, w.rows] = x[n, w.cols] · wᵀ. Batch-invariant: row i of y depends only on row i of x.
pub fn matmul(x: &[f32], n: usize, w: &Matrix, y: &mut [f32]) {
    assert!(x.len() >= n * w.cols, "matmul: x too short");
    assert!(y.len() >= n * w.rows, "matmul: y too short");
    let ptr = SyncPtr(y.as_mut_ptr());
    let work = n * w.rows * w.cols;
    if work < PAR_MIN_WORK || rayon::current_num_threads() == 1 {
        run_block(x, n, w, 0, w.rows, ptr, w.rows);
        return;
    }
    // Split the output rows into chunks of at least 16 rows and ~PAR_MIN_WORK work.
    let per_row = n * w.cols;
    let chunk = (PAR_MIN_WORK / per_row.max(1)).max(16);
    let chunks = w.rows.div_ceil(chunk);
    (0..chunks).into_par_iter().for_each(|c| {
        let o0 = c * chunk;
        let o1 = (o0 + chunk).min(w.rows);
        run_block(x, n, w, o0, o1, ptr, w.rows);
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
        let half = head_dim / 2;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / theta.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut cos = vec![0.0; max_pos * half];
        let mut sin = vec![0.0; max_pos * half];
        for p in 0..max_pos {
            for i in 0..half {
                let f = p as f32 * inv[i];
                cos[p * half + i] = f.cos();
                sin[p * half + i] = f.sin();
            }
        }
        Rope {
            half,
            cos,
            sin,
            max_pos,
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

    fn naive(x: &[f32], n: usize, w: &Matrix) -> Vec<f32> {
        let mut y = vec![0.0; n * w.rows];
        for i in 0..n {
            for o in 0..w.rows {
                let mut s = 0f64;
                for k in 0..w.cols {
                    s += x[i * w.cols + k] as f64 * w.data[o * w.cols + k] as f64;
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
