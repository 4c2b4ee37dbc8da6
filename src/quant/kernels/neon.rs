//! aarch64 NEON kernels: 4 f32 lanes, four accumulators per dot product (vector v → v % 4),
//! tiles of up to four activation rows (two with a weight-row pair).
//!
//! Kept deliberately simple: every weight row is first dequantised exactly into an f32 buffer
//! (int4 blocks of 16 with NEON, everything else by the reference `pack::reference_dequantize_row`), then the
//! dot products read the buffer, so S = 1 and S > 1 share every instruction that touches a sum.
//!
//! Tested without aarch64 hardware: `scripts/test-aarch64.sh` cross-builds the crate and runs
//! its tests under qemu user-mode emulation (the kernel tests — every path against the scalar
//! and f64 references, S-invariance bit for bit — and the transformers goldens, with
//! `COLIBRI_KERNEL=neon` as well). Speed on real NEON hardware is unmeasured.

use std::arch::aarch64::*;

use crate::quant::format::{QMatrix, QuantFormat};
use crate::quant::pack;

/// Lanes per vector.
const L: usize = 4;
/// Independent accumulators per dot product.
const A: usize = 4;
/// Activation rows per tile with one weight row (16 accumulators).
const TILE: usize = 4;
/// Activation rows per tile with two weight rows (16 accumulators).
const TILE_PAIR: usize = 2;

/// Dequantise row `o` of `w` into `buf` (length ≥ cols rounded up to 4; the padding is +0).
#[inline(always)]
unsafe fn fill(w: &QMatrix<'_>, o: usize, buf: &mut [f32]) {
    let n = w.cols();
    let padded = n.div_ceil(L) * L;
    buf[n..padded].iter_mut().for_each(|v| *v = 0.0);
    match w.format() {
        QuantFormat::Int4PerRow | QuantFormat::Int4Grouped { .. } => {
            let gs = w.format().group_size(n);
            let data = w.row_data(o);
            let scales = w.row_scales(o);
            // Whole blocks of 16 elements (8 bytes); every group size is a multiple of 16, so
            // a block lies in one group.
            let blocks = n / 16;
            for b in 0..blocks {
                let scale = scales[b * 16 / gs];
                // SAFETY: NEON is guaranteed by the caller; bytes 8b..8b+8 are in the row and
                // elements 16b..16b+16 are in `buf`.
                unsafe {
                    let bytes = vld1_u8(data.as_ptr().add(b * 8));
                    let lo = vand_u8(bytes, vdup_n_u8(0x0F));
                    let hi = vshr_n_u8::<4>(bytes);
                    // Element 2j = low nibble of byte j, 2j+1 = high nibble.
                    let q = vsubq_s8(
                        vreinterpretq_s8_u8(vcombine_u8(vzip1_u8(lo, hi), vzip2_u8(lo, hi))),
                        vdupq_n_s8(8),
                    );
                    let q16 = [vmovl_s8(vget_low_s8(q)), vmovl_s8(vget_high_s8(q))];
                    let s = vdupq_n_f32(scale);
                    let p = buf.as_mut_ptr().add(b * 16);
                    for (h, q16) in q16.into_iter().enumerate() {
                        let q32 = [vmovl_s16(vget_low_s16(q16)), vmovl_s16(vget_high_s16(q16))];
                        for (k, q32) in q32.into_iter().enumerate() {
                            vst1q_f32(p.add(h * 8 + k * 4), vmulq_f32(vcvtq_f32_s32(q32), s));
                        }
                    }
                }
            }
            // The rest, exactly as the reference does it.
            for i in blocks * 16..n {
                let byte = data[i / 2];
                let nibble = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                buf[i] = (nibble as i32 - 8) as f32 * scales[i / gs];
            }
        }
        _ => pack::reference_dequantize_row(w, o, &mut buf[..n]),
    }
}

/// Row `o` of `w` dequantised into `out` (`w.cols()` floats), as the kernels here see it: the
/// same values as the reference `pack::reference_dequantize_row` (int4 by NEON, everything else by the
/// reference itself).
///
/// # Safety
/// The CPU supports NEON; `o < w.rows()` and `out.len() == w.cols()`.
pub(super) unsafe fn dequantize_row(w: &QMatrix<'_>, o: usize, out: &mut [f32]) {
    let n = w.cols();
    // SAFETY: forwarded; `fill` wants a buffer padded to whole vectors.
    unsafe {
        if n.is_multiple_of(L) {
            fill(w, o, out);
        } else {
            let mut buf = vec![0.0f32; n.div_ceil(L) * L];
            fill(w, o, &mut buf);
            out.copy_from_slice(&buf[..n]);
        }
    }
}

/// Sum of four accumulators: (a0 + a1) + (a2 + a3), then (l0 + l1) + (l2 + l3).
#[inline(always)]
unsafe fn reduce(a: [float32x4_t; A]) -> f32 {
    // SAFETY: NEON guaranteed by the caller.
    unsafe {
        let v = vaddq_f32(vaddq_f32(a[0], a[1]), vaddq_f32(a[2], a[3]));
        (vgetq_lane_f32::<0>(v) + vgetq_lane_f32::<1>(v))
            + (vgetq_lane_f32::<2>(v) + vgetq_lane_f32::<3>(v))
    }
}

/// Dot products of `NW` decoded weight rows (padded buffers) with `T` activation rows of n.
#[inline(always)]
unsafe fn dot_tile<const NW: usize, const T: usize>(
    w: [*const f32; NW],
    x: [*const f32; T],
    n: usize,
) -> [[f32; T]; NW] {
    // SAFETY: NEON guaranteed by the caller; each `w[k]` holds n rounded up to 4 floats, each
    // `x[t]` holds n floats (its tail is copied, never over-read).
    unsafe {
        let (nv, r) = (n / L, n % L);
        let mut acc = [[[vdupq_n_f32(0.0); A]; T]; NW];
        for v in 0..nv {
            let mut wv = [vdupq_n_f32(0.0); NW];
            for k in 0..NW {
                wv[k] = vld1q_f32(w[k].add(v * L));
            }
            for t in 0..T {
                let xv = vld1q_f32(x[t].add(v * L));
                for k in 0..NW {
                    acc[k][t][v % A] = vfmaq_f32(acc[k][t][v % A], wv[k], xv);
                }
            }
        }
        if r > 0 {
            let v = nv;
            let mut wv = [vdupq_n_f32(0.0); NW];
            for k in 0..NW {
                wv[k] = vld1q_f32(w[k].add(v * L));
            }
            for t in 0..T {
                let mut tail = [0.0f32; L];
                std::ptr::copy_nonoverlapping(x[t].add(v * L), tail.as_mut_ptr(), r);
                let xv = vld1q_f32(tail.as_ptr());
                for k in 0..NW {
                    acc[k][t][v % A] = vfmaq_f32(acc[k][t][v % A], wv[k], xv);
                }
            }
        }
        let mut y = [[0.0f32; T]; NW];
        for k in 0..NW {
            for t in 0..T {
                y[k][t] = reduce(acc[k][t]);
            }
        }
        y
    }
}

/// All `s` activation rows against `NW` decoded weight rows, in tiles of `TM` rows, then one
/// smaller tile. `out[k]` points at `s` floats for weight row k.
#[inline(always)]
unsafe fn tiles<const NW: usize, const TM: usize>(
    w: [*const f32; NW],
    x: &[f32],
    s: usize,
    n: usize,
    out: [*mut f32; NW],
) {
    // SAFETY: `x` holds s rows of n; each `out[k]` points at s writable floats.
    unsafe {
        const { assert!(TM == 2 || TM == 4) };
        let xp = x.as_ptr();
        macro_rules! tile {
            ($t:literal, $t0:expr) => {{
                let mut xs = [xp; $t];
                for (i, p) in xs.iter_mut().enumerate() {
                    *p = xp.add(($t0 + i) * n);
                }
                let y = dot_tile::<NW, $t>(w, xs, n);
                for k in 0..NW {
                    for i in 0..$t {
                        *out[k].add($t0 + i) = y[k][i];
                    }
                }
            }};
        }
        let mut t0 = 0;
        while s - t0 >= TM {
            match TM {
                4 => tile!(4, t0),
                _ => tile!(2, t0),
            }
            t0 += TM;
        }
        match s - t0 {
            0 => {}
            1 => tile!(1, t0),
            2 => tile!(2, t0),
            _ => tile!(3, t0),
        }
    }
}

/// `out[i·s + t] = W[o0 + i] · x_t` for the rows `o0..o0 + out.len()/s`.
///
/// # Safety
/// The CPU supports NEON; `x.len() == s · w.cols()`, `s > 0`, `out.len()` is a multiple of s
/// and `o0 + out.len()/s <= w.rows()`.
#[target_feature(enable = "neon")]
pub(super) unsafe fn rows(w: &QMatrix<'_>, o0: usize, x: &[f32], s: usize, out: &mut [f32]) {
    let n = w.cols();
    let mut buf = vec![0.0f32; n.div_ceil(L) * L];
    for (i, y) in out.chunks_exact_mut(s).enumerate() {
        // SAFETY: the caller's contract; `buf` is padded to whole vectors.
        unsafe {
            fill(w, o0 + i, &mut buf);
            tiles::<1, TILE>([buf.as_ptr()], x, s, n, [y.as_mut_ptr()]);
        }
    }
}

/// [`rows`] for two matrices of the same shape (gate and up), sharing the activation loads.
///
/// # Safety
/// As [`rows`], for both `a` and `b`, which have the same shape; `out_a` and `out_b` have the
/// same length.
#[target_feature(enable = "neon")]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows_pair(
    a: &QMatrix<'_>,
    b: &QMatrix<'_>,
    o0: usize,
    x: &[f32],
    s: usize,
    out_a: &mut [f32],
    out_b: &mut [f32],
) {
    let n = a.cols();
    let mut buf_a = vec![0.0f32; n.div_ceil(L) * L];
    let mut buf_b = vec![0.0f32; n.div_ceil(L) * L];
    let pairs = out_a.chunks_exact_mut(s).zip(out_b.chunks_exact_mut(s));
    for (i, (ya, yb)) in pairs.enumerate() {
        // SAFETY: the caller's contract; the buffers are padded to whole vectors.
        unsafe {
            fill(a, o0 + i, &mut buf_a);
            fill(b, o0 + i, &mut buf_b);
            let w = [buf_a.as_ptr(), buf_b.as_ptr()];
            tiles::<2, TILE_PAIR>(w, x, s, n, [ya.as_mut_ptr(), yb.as_mut_ptr()]);
        }
    }
}
