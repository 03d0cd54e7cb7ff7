//! The matrix product's aarch64 kernels (NEON, which every aarch64 CPU has, with fused
//! multiply-add): weights read as stored (f32, bf16, f16) and widened in registers (bf16 by
//! a shift, f16 by FCVTL), tiles of
//! weight rows by input rows so each weight vector is loaded once for several input rows.
//!
//! Every output is the same sum as `ops::dot_body::<true>` computes, bit for bit (as the
//! x86-64 kernels are): 16 lanes held in four registers of four, lane `j` accumulating
//! `x[16c + j] * w[16c + j]` by fused multiply-add over the chunks `c` in order, the lanes
//! reduced 16 -> 8 -> 4 -> 2 -> 1 pairwise, plus the tail's scalar sum. The engine's batch
//! and map invariance on an ARM host (the GB300's Grace) rests on it.

use std::arch::aarch64::*;

use crate::ops::{Bf16, Elem, F16};
use crate::ops_tiles::tail;

/// A stored weight type the kernels widen in registers.
pub trait Wide: Elem {
    /// 16 elements at `p` as f32, four to a register.
    ///
    /// # Safety
    /// `p` addresses 16 elements.
    unsafe fn w16(p: *const Self) -> [float32x4_t; 4];
}

impl Wide for f32 {
    #[inline(always)]
    unsafe fn w16(p: *const f32) -> [float32x4_t; 4] {
        [
            vld1q_f32(p),
            vld1q_f32(p.add(4)),
            vld1q_f32(p.add(8)),
            vld1q_f32(p.add(12)),
        ]
    }
}

impl Wide for Bf16 {
    #[inline(always)]
    unsafe fn w16(p: *const Bf16) -> [float32x4_t; 4] {
        // a bf16 is the top half of its f32: widen each u16 to u32, shifted up by 16
        let (a, b) = (
            vld1q_u16(p as *const u16),
            vld1q_u16((p as *const u16).add(8)),
        );
        let up = |h: uint16x4_t| vreinterpretq_f32_u32(vshll_n_u16::<16>(h));
        [
            up(vget_low_u16(a)),
            up(vget_high_u16(a)),
            up(vget_low_u16(b)),
            up(vget_high_u16(b)),
        ]
    }
}

impl Wide for F16 {
    #[inline(always)]
    unsafe fn w16(p: *const F16) -> [float32x4_t; 4] {
        // FCVTL widens four halves exactly (base Armv8 SIMD; Rust's half-precision
        // intrinsics are not stable, so it is written out)
        let up = |h: uint16x4_t| {
            let f: float32x4_t;
            std::arch::asm!("fcvtl {f:v}.4s, {h:v}.4h", f = lateout(vreg) f, h = in(vreg) h,
                            options(pure, nomem, nostack, preserves_flags));
            f
        };
        let (a, b) = (
            vld1q_u16(p as *const u16),
            vld1q_u16((p as *const u16).add(8)),
        );
        [
            up(vget_low_u16(a)),
            up(vget_high_u16(a)),
            up(vget_low_u16(b)),
            up(vget_high_u16(b)),
        ]
    }
}

/// `R` weight rows by `C` input rows: the `C` inputs' chunk loaded once, then each weight
/// row's chunk once for all of them.
#[inline(always)]
unsafe fn tile<E: Wide, const R: usize, const C: usize>(
    x: [*const f32; C],
    w: [*const E; R],
    k: usize,
) -> [[f32; C]; R] {
    let z = vdupq_n_f32(0.0);
    let mut acc = [[[z; 4]; C]; R];
    let chunks = k / 16;
    for c in 0..chunks {
        let o = c * 16;
        let xv: [[float32x4_t; 4]; C] = std::array::from_fn(|i| f32::w16(x[i].add(o)));
        for r in 0..R {
            let wv = E::w16(w[r].add(o));
            for i in 0..C {
                for g in 0..4 {
                    acc[r][i][g] = vfmaq_f32(acc[r][i][g], xv[i][g], wv[g]);
                }
            }
        }
    }
    let mut out = [[0f32; C]; R];
    for r in 0..R {
        for i in 0..C {
            let a = acc[r][i];
            // 16 -> 8 (lane j + lane j + 8), 8 -> 4, then 4 -> 2 -> 1
            let t = vaddq_f32(vaddq_f32(a[0], a[2]), vaddq_f32(a[1], a[3]));
            let s = (vgetq_lane_f32::<0>(t) + vgetq_lane_f32::<2>(t))
                + (vgetq_lane_f32::<1>(t) + vgetq_lane_f32::<3>(t));
            out[r][i] = s + tail(x[i], w[r], chunks * 16, k);
        }
    }
    out
}

entry!(
    /// y[i * ldy + o] = dot(x[i], w[o]) for `o` in `outs`, `i < n`; NEON registers.
    ///
    /// # Safety
    /// `outs.start <= outs.end <= ldy`; `x` addresses `n * k` floats, `w` `outs.end * k`
    /// elements, `y` `n * ldy` floats, the outputs written here by no other thread.
    block_neon, "neon", tile, 4, (2, 2)
);

#[cfg(test)]
mod tests {
    use super::*;

    /// Each half and bfloat16 widens in registers to what the scalar widening gives (NaNs
    /// stay NaNs).
    #[test]
    fn every_sixteen_bit_value_widens_as_the_scalar_path() {
        for base in (0..=u16::MAX).step_by(16) {
            let bits: [u16; 16] = std::array::from_fn(|j| base + j as u16);
            let h: [F16; 16] = bits.map(F16);
            let b: [Bf16; 16] = bits.map(Bf16);
            // SAFETY: 16 elements each; NEON is part of aarch64.
            let (wh, wb) = unsafe { (F16::w16(h.as_ptr()), Bf16::w16(b.as_ptr())) };
            let mut got = [[0f32; 16]; 2];
            for g in 0..4 {
                // SAFETY: 4 floats at each place.
                unsafe {
                    vst1q_f32(got[0].as_mut_ptr().add(4 * g), wh[g]);
                    vst1q_f32(got[1].as_mut_ptr().add(4 * g), wb[g]);
                }
            }
            for j in 0..16 {
                for (v, want) in [(got[0][j], h[j].f32()), (got[1][j], b[j].f32())] {
                    assert!(
                        v.to_bits() == want.to_bits() || (v.is_nan() && want.is_nan()),
                        "{:#06x}: {v} against {want}",
                        bits[j]
                    );
                }
            }
        }
    }
}
