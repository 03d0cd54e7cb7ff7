//! The tiling both architectures' matrix-product kernels share (`ops_x86`, `ops_arm`):
//! `drive!` covers the outputs with a kernel's tiles, `entry!` makes a kernel's entry point.
//! Each module brings its own `Wide` trait and tile functions into the expansion.

use crate::ops::Elem;

/// The tail past the last full chunk of 16, as `ops::dot_body` sums it (fused
/// multiply-adds in order).
///
/// # Safety
/// `x` and `w` address `k` elements.
#[inline(always)]
pub(crate) unsafe fn tail<E: Elem>(x: *const f32, w: *const E, from: usize, k: usize) -> f32 {
    let mut t = 0f32;
    for j in from..k {
        t = (*x.add(j)).mul_add((*w.add(j)).f32(), t);
    }
    t
}

/// Covers `outs` x `0..n` with `R x C` tiles, then `R x 1` for the input rows left over,
/// then `1 x 1` for the weight rows left over.
macro_rules! drive {
    ($tile:ident, $x:expr, $n:expr, $w:expr, $k:expr, $outs:expr, $y:expr, $ldy:expr, $R:literal, $C:literal) => {{
        let (x, n, w, k, outs, y, ldy) = ($x, $n, $w, $k, $outs, $y, $ldy);
        let mut o = outs.start;
        while outs.end - o >= $R {
            let ws: [*const E; $R] = std::array::from_fn(|r| w.add((o + r) * k));
            let mut i = 0;
            while n - i >= $C {
                let xs: [*const f32; $C] = std::array::from_fn(|c| x.add((i + c) * k));
                let t = $tile::<E, $R, $C>(xs, ws, k);
                for r in 0..$R {
                    for c in 0..$C {
                        *y.add((i + c) * ldy + o + r) = t[r][c];
                    }
                }
                i += $C;
            }
            while i < n {
                let t = $tile::<E, $R, 1>([x.add(i * k)], ws, k);
                for r in 0..$R {
                    *y.add(i * ldy + o + r) = t[r][0];
                }
                i += 1;
            }
            o += $R;
        }
        while o < outs.end {
            for i in 0..n {
                *y.add(i * ldy + o) = $tile::<E, 1, 1>([x.add(i * k)], [w.add(o * k)], k)[0][0];
            }
            o += 1;
        }
    }};
}

/// One entry point per register width: `R x 1` tiles for a single input row, `R x C` for
/// several.
macro_rules! entry {
    ($(#[$doc:meta])* $name:ident, $features:literal, $tile:ident, $r1:literal, ($r:literal, $c:literal)) => {
        $(#[$doc])*
        #[target_feature(enable = $features)]
        pub unsafe fn $name<E: Wide>(
            x: *const f32,
            n: usize,
            w: *const E,
            k: usize,
            outs: std::ops::Range<usize>,
            y: *mut f32,
            ldy: usize,
        ) {
            if n == 1 {
                drive!($tile, x, n, w, k, outs, y, ldy, $r1, 1)
            } else {
                drive!($tile, x, n, w, k, outs, y, ldy, $r, $c)
            }
        }
    };
}
