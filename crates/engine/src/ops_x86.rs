//! The matrix product's x86-64 kernels: weights read as stored (f32, bf16, f16) and
//! widened in registers, tiles of weight rows by input rows so each weight vector is
//! loaded once for several input rows and several accumulator chains run side by side.
//!
//! Every output is the same sum as `ops::dot_body` computes, bit for bit: 16 lanes, lane
//! `j` accumulating `x[16c + j] * w[16c + j]` by fused multiply-add over the chunks `c` in
//! order, the lanes reduced 16 -> 8 -> 4 -> 2 -> 1 pairwise, plus the tail's scalar sum.
//! The 256-bit path holds a lane set in two registers, the 512-bit path in one; the sums
//! are the same, so a step's output does not depend on which path or tile computed it
//! (the batch and map invariance of the CPU engine rests on this).

use std::arch::x86_64::*;

use crate::ops::{Bf16, Elem, F16};
use crate::ops_tiles::tail;

/// A stored weight type the kernels widen in registers.
pub trait Wide: Elem {
    /// 8 elements at `p` as f32.
    ///
    /// # Safety
    /// `p` addresses 8 elements; the CPU has avx2 and f16c.
    unsafe fn w8(p: *const Self) -> __m256;
    /// 16 elements at `p` as f32.
    ///
    /// # Safety
    /// `p` addresses 16 elements; the CPU has avx512f.
    unsafe fn w16(p: *const Self) -> __m512;
}

impl Wide for f32 {
    #[inline(always)]
    unsafe fn w8(p: *const f32) -> __m256 {
        _mm256_loadu_ps(p)
    }
    #[inline(always)]
    unsafe fn w16(p: *const f32) -> __m512 {
        _mm512_loadu_ps(p)
    }
}

impl Wide for Bf16 {
    #[inline(always)]
    unsafe fn w8(p: *const Bf16) -> __m256 {
        let h = _mm_loadu_si128(p as *const __m128i);
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(h)))
    }
    #[inline(always)]
    unsafe fn w16(p: *const Bf16) -> __m512 {
        let h = _mm256_loadu_si256(p as *const __m256i);
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(h)))
    }
}

impl Wide for F16 {
    #[inline(always)]
    unsafe fn w8(p: *const F16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }
    #[inline(always)]
    unsafe fn w16(p: *const F16) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i))
    }
}

/// 8 lanes reduced 8 -> 4 -> 2 -> 1 pairwise.
#[inline(always)]
unsafe fn reduce8(v8: __m256) -> f32 {
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(v2) + _mm_cvtss_f32(_mm_shuffle_ps::<1>(v2, v2))
}

/// `R` weight rows by `C` input rows, 256-bit: lanes 0-7 and 8-15 in two registers.
#[inline(always)]
unsafe fn tile256<E: Wide, const R: usize, const C: usize>(
    x: [*const f32; C],
    w: [*const E; R],
    k: usize,
) -> [[f32; C]; R] {
    let mut lo = [[_mm256_setzero_ps(); C]; R];
    let mut hi = [[_mm256_setzero_ps(); C]; R];
    let chunks = k / 16;
    for c in 0..chunks {
        let o = c * 16;
        let mut wl = [_mm256_setzero_ps(); R];
        let mut wh = [_mm256_setzero_ps(); R];
        for r in 0..R {
            wl[r] = E::w8(w[r].add(o));
            wh[r] = E::w8(w[r].add(o + 8));
        }
        for i in 0..C {
            let xl = _mm256_loadu_ps(x[i].add(o));
            let xh = _mm256_loadu_ps(x[i].add(o + 8));
            for r in 0..R {
                lo[r][i] = _mm256_fmadd_ps(xl, wl[r], lo[r][i]);
                hi[r][i] = _mm256_fmadd_ps(xh, wh[r], hi[r][i]);
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for i in 0..C {
            let s = reduce8(_mm256_add_ps(lo[r][i], hi[r][i]));
            out[r][i] = s + tail(x[i], w[r], chunks * 16, k);
        }
    }
    out
}

/// `[dot(q, rows[0]), .., dot(q, rows[3])]` over `k` floats each, the sums of
/// `ops::dot_body` (decode attention's scores, four cached positions at a time).
///
/// # Safety
/// The CPU has avx2 and fma; `q` and each of `rows` address `k` floats.
#[target_feature(enable = "avx2,fma")]
pub unsafe fn dots4<E: Wide>(q: *const f32, rows: [*const E; 4], k: usize) -> [f32; 4] {
    let r = tile256::<E, 4, 1>([q], rows, k);
    [r[0][0], r[1][0], r[2][0], r[3][0]]
}

/// `R` weight rows by `C` input rows, 512-bit: the 16 lanes in one register.
#[inline(always)]
unsafe fn tile512<E: Wide, const R: usize, const C: usize>(
    x: [*const f32; C],
    w: [*const E; R],
    k: usize,
) -> [[f32; C]; R] {
    let mut acc = [[_mm512_setzero_ps(); C]; R];
    let chunks = k / 16;
    for c in 0..chunks {
        let o = c * 16;
        let mut wv = [_mm512_setzero_ps(); R];
        for r in 0..R {
            wv[r] = E::w16(w[r].add(o));
        }
        for i in 0..C {
            let xv = _mm512_loadu_ps(x[i].add(o));
            for r in 0..R {
                acc[r][i] = _mm512_fmadd_ps(xv, wv[r], acc[r][i]);
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for i in 0..C {
            let a = acc[r][i];
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(a)));
            let s = reduce8(_mm256_add_ps(_mm512_castps512_ps256(a), hi));
            out[r][i] = s + tail(x[i], w[r], chunks * 16, k);
        }
    }
    out
}

entry!(
    /// y[i * ldy + o] = dot(x[i], w[o]) for `o` in `outs`, `i < n`; 256-bit registers.
    ///
    /// # Safety
    /// The CPU has avx2, fma and f16c; `outs.start <= outs.end <= ldy`; `x` addresses
    /// `n * k` floats, `w` `outs.end * k` elements, `y` `n * ldy` floats, the outputs
    /// written here by no other thread.
    block256, "avx2,fma,f16c", tile256, 4, (2, 2)
);

entry!(
    /// As [`block256`] with 512-bit registers (twice the accumulators: larger tiles).
    ///
    /// # Safety
    /// As [`block256`], and the CPU has avx512f.
    block512, "avx512f,avx2,fma,f16c", tile512, 8, (4, 4)
);
