//! Vector operations of attention, with the same values on every path: [`dot_16_lanes`], a
//! dot product in one fixed order (16 partial sums), and [`axpy_reference`], `y += a·x`
//! (a multiply, then an add: no fused multiply-add). The SIMD versions run the same
//! operations lane by lane, so their results equal the references bit for bit; NEON uses the
//! references.
//!
//! Attention calls these once per key and per query row (millions of times per layer at a
//! long context), so the path is resolved once ([`VecOps`]), not per call.

use super::KernelPath;
use crate::Result;

/// Partial sums of [`dot_16_lanes`].
const DOT_LANES: usize = 16;

/// Rows per call of [`VecOps::dots`] and [`VecOps::axpys`].
pub const BATCH: usize = 4;

/// `Σ a_i·b_i` in one fixed order: element i of the whole blocks of 16 goes to partial sum
/// i % 16 (`acc += a·b`, a multiply then an add), the partial sums are added as a tree (lane i
/// with lane i + 8, then + 4, + 2, + 1), then the leftover products summed in order are added.
/// An in-order sum is one dependent add per element (latency-bound); sixteen independent sums
/// vectorise. This is attention's dot product, the same function on every path (its SIMD
/// versions equal it bit for bit); the matmul kernels' specification is the other order,
/// `scalar::dot_in_order`, which the SIMD matmuls match to rounding only (each has its own
/// order) and which the scalar path runs (so its values stay those of the plain sum).
pub fn dot_16_lanes(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0.0f32; DOT_LANES];
    let (ca, cb) = (a.chunks_exact(DOT_LANES), b.chunks_exact(DOT_LANES));
    let rest = leftover(ca.remainder(), cb.remainder());
    for (xa, xb) in ca.zip(cb) {
        for i in 0..DOT_LANES {
            acc[i] += xa[i] * xb[i];
        }
    }
    let mut w = DOT_LANES;
    while w > 1 {
        w /= 2;
        for i in 0..w {
            acc[i] += acc[i + w];
        }
    }
    acc[0] + rest
}

/// The in-order sum of the products of the elements after the last whole block.
#[inline(always)]
fn leftover(a: &[f32], b: &[f32]) -> f32 {
    a.iter().zip(b).map(|(x, y)| x * y).sum()
}

/// `y_i += a · x_i` (the product rounded, then the sum).
pub fn axpy_reference(y: &mut [f32], a: f32, x: &[f32]) {
    debug_assert_eq!(y.len(), x.len());
    for (y, x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// [`dot_16_lanes`] and [`axpy_reference`] on one kernel path, resolved once.
#[derive(Debug, Clone, Copy)]
pub struct VecOps {
    path: KernelPath,
}

impl VecOps {
    /// On the [`super::active_path`].
    pub fn active() -> Result<Self> {
        Self::on(super::active_path()?)
    }

    /// On `path` (an error if this CPU cannot run it).
    pub fn on(path: KernelPath) -> Result<Self> {
        Ok(VecOps {
            path: path.require()?,
        })
    }

    /// [`dot_16_lanes`]`(a, b)`; `a` and `b` have the same length.
    #[inline]
    pub fn dot(&self, a: &[f32], b: &[f32]) -> f32 {
        let n = a.len().min(b.len());
        let (a, b) = (&a[..n], &b[..n]);
        match self.path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `on` checked that the CPU has AVX-512 F; the slices have equal lengths.
            KernelPath::Avx512 => unsafe { x86::dot_avx512(a, b) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX2.
            KernelPath::Avx2 => unsafe { x86::dot_avx2(a, b) },
            _ => dot_16_lanes(a, b),
        }
    }

    /// `[dot(a, b) for b in bs]`, each exactly [`dot_16_lanes`]: the four sums run side by
    /// side (one sum is bound by the latency of its adds). All slices have `a`'s length.
    #[inline]
    pub fn dots(&self, a: &[f32], bs: [&[f32]; BATCH]) -> [f32; BATCH] {
        let n = bs.iter().fold(a.len(), |n, b| n.min(b.len()));
        let (a, bs) = (&a[..n], bs.map(|b| &b[..n]));
        match self.path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `on` checked that the CPU has AVX-512 F; the slices have equal lengths.
            KernelPath::Avx512 => unsafe { x86::dots_avx512(a, bs) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX2.
            KernelPath::Avx2 => unsafe { x86::dots_avx2(a, bs) },
            _ => bs.map(|b| dot_16_lanes(a, b)),
        }
    }

    /// `y += a[0]·xs[0]`, then `y += a[1]·xs[1]`, and so on: four [`axpy_reference`] calls in
    /// that order, with `y` kept in registers across them. All slices have `y`'s length.
    #[inline]
    pub fn axpys(&self, y: &mut [f32], a: [f32; BATCH], xs: [&[f32]; BATCH]) {
        let n = xs.iter().fold(y.len(), |n, x| n.min(x.len()));
        let (y, xs) = (&mut y[..n], xs.map(|x| &x[..n]));
        match self.path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `on` checked that the CPU has AVX-512 F; the slices have equal lengths.
            KernelPath::Avx512 => unsafe { x86::axpys_avx512(y, a, xs) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX2.
            KernelPath::Avx2 => unsafe { x86::axpys_avx2(y, a, xs) },
            _ => {
                for (a, x) in a.into_iter().zip(xs) {
                    axpy_reference(y, a, x);
                }
            }
        }
    }

    /// [`axpy_reference`]`(y, a, x)`; `y` and `x` have the same length.
    #[inline]
    pub fn axpy(&self, y: &mut [f32], a: f32, x: &[f32]) {
        let n = y.len().min(x.len());
        let (y, x) = (&mut y[..n], &x[..n]);
        match self.path {
            #[cfg(target_arch = "x86_64")]
            // SAFETY: `on` checked that the CPU has AVX-512 F; the slices have equal lengths.
            KernelPath::Avx512 => unsafe { x86::axpy_avx512(y, a, x) },
            #[cfg(target_arch = "x86_64")]
            // SAFETY: as above, with AVX2.
            KernelPath::Avx2 => unsafe { x86::axpy_avx2(y, a, x) },
            _ => axpy_reference(y, a, x),
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    use super::{leftover, BATCH, DOT_LANES};

    /// The tree of [`super::dot_16_lanes`] from the partial sums of lanes 0..8 (`lo`) and
    /// 8..16 (`hi`): lane i + lane i+8, then + 4, + 2, + 1 (`avx2::sum_lanes`).
    #[inline(always)]
    unsafe fn tree(lo: __m256, hi: __m256) -> f32 {
        // SAFETY: AVX guaranteed by the callers (AVX2 or AVX-512 F).
        unsafe { super::super::avx2::sum_lanes(_mm256_add_ps(lo, hi)) }
    }

    /// # Safety
    /// The CPU supports AVX-512 F; `a.len() == b.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dot_avx512(a: &[f32], b: &[f32]) -> f32 {
        let blocks = a.len() / DOT_LANES;
        // SAFETY: block k reads elements 16k .. 16k+16 < len of both slices.
        unsafe {
            let mut acc = _mm512_setzero_ps();
            for k in 0..blocks {
                let x = _mm512_loadu_ps(a.as_ptr().add(k * DOT_LANES));
                let y = _mm512_loadu_ps(b.as_ptr().add(k * DOT_LANES));
                acc = _mm512_add_ps(acc, _mm512_mul_ps(x, y));
            }
            let lo = _mm512_castps512_ps256(acc);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
            let rest = leftover(&a[blocks * DOT_LANES..], &b[blocks * DOT_LANES..]);
            tree(lo, hi) + rest
        }
    }

    /// # Safety
    /// The CPU supports AVX2; `a.len() == b.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dot_avx2(a: &[f32], b: &[f32]) -> f32 {
        let blocks = a.len() / DOT_LANES;
        // SAFETY: block k reads elements 16k .. 16k+16 < len of both slices.
        unsafe {
            let (mut lo, mut hi) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            for k in 0..blocks {
                let (pa, pb) = (a.as_ptr().add(k * DOT_LANES), b.as_ptr().add(k * DOT_LANES));
                lo = _mm256_add_ps(lo, _mm256_mul_ps(_mm256_loadu_ps(pa), _mm256_loadu_ps(pb)));
                hi = _mm256_add_ps(
                    hi,
                    _mm256_mul_ps(_mm256_loadu_ps(pa.add(8)), _mm256_loadu_ps(pb.add(8))),
                );
            }
            let rest = leftover(&a[blocks * DOT_LANES..], &b[blocks * DOT_LANES..]);
            tree(lo, hi) + rest
        }
    }

    /// # Safety
    /// The CPU supports AVX-512 F; every slice has `a`'s length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn dots_avx512(a: &[f32], bs: [&[f32]; BATCH]) -> [f32; BATCH] {
        let blocks = a.len() / DOT_LANES;
        // SAFETY: block k reads elements 16k .. 16k+16 < len of every slice.
        unsafe {
            let mut acc = [_mm512_setzero_ps(); BATCH];
            for k in 0..blocks {
                let x = _mm512_loadu_ps(a.as_ptr().add(k * DOT_LANES));
                for (acc, b) in acc.iter_mut().zip(&bs) {
                    let y = _mm512_loadu_ps(b.as_ptr().add(k * DOT_LANES));
                    *acc = _mm512_add_ps(*acc, _mm512_mul_ps(x, y));
                }
            }
            let mut out = [0.0f32; BATCH];
            for ((o, acc), b) in out.iter_mut().zip(acc).zip(&bs) {
                let lo = _mm512_castps512_ps256(acc);
                let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(acc)));
                *o = tree(lo, hi) + leftover(&a[blocks * DOT_LANES..], &b[blocks * DOT_LANES..]);
            }
            out
        }
    }

    /// # Safety
    /// The CPU supports AVX2; every slice has `a`'s length.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn dots_avx2(a: &[f32], bs: [&[f32]; BATCH]) -> [f32; BATCH] {
        let blocks = a.len() / DOT_LANES;
        // SAFETY: block k reads elements 16k .. 16k+16 < len of every slice.
        unsafe {
            let mut acc = [[_mm256_setzero_ps(); 2]; BATCH];
            for k in 0..blocks {
                let pa = a.as_ptr().add(k * DOT_LANES);
                let (x0, x1) = (_mm256_loadu_ps(pa), _mm256_loadu_ps(pa.add(8)));
                for (acc, b) in acc.iter_mut().zip(&bs) {
                    let pb = b.as_ptr().add(k * DOT_LANES);
                    acc[0] = _mm256_add_ps(acc[0], _mm256_mul_ps(x0, _mm256_loadu_ps(pb)));
                    acc[1] = _mm256_add_ps(acc[1], _mm256_mul_ps(x1, _mm256_loadu_ps(pb.add(8))));
                }
            }
            let mut out = [0.0f32; BATCH];
            for ((o, acc), b) in out.iter_mut().zip(acc).zip(&bs) {
                *o = tree(acc[0], acc[1])
                    + leftover(&a[blocks * DOT_LANES..], &b[blocks * DOT_LANES..]);
            }
            out
        }
    }

    /// # Safety
    /// The CPU supports AVX-512 F; every slice has `y`'s length.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpys_avx512(y: &mut [f32], a: [f32; BATCH], xs: [&[f32]; BATCH]) {
        let whole = y.len() / 16 * 16;
        // SAFETY: each vector covers elements i .. i+16 ≤ whole ≤ len of every slice.
        unsafe {
            let va = a.map(|a| _mm512_set1_ps(a));
            for i in (0..whole).step_by(16) {
                let p = y.as_mut_ptr().add(i);
                let mut v = _mm512_loadu_ps(p);
                for (va, x) in va.iter().zip(&xs) {
                    v = _mm512_add_ps(v, _mm512_mul_ps(*va, _mm512_loadu_ps(x.as_ptr().add(i))));
                }
                _mm512_storeu_ps(p, v);
            }
        }
        for (a, x) in a.into_iter().zip(xs) {
            super::axpy_reference(&mut y[whole..], a, &x[whole..]);
        }
    }

    /// # Safety
    /// The CPU supports AVX2; every slice has `y`'s length.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn axpys_avx2(y: &mut [f32], a: [f32; BATCH], xs: [&[f32]; BATCH]) {
        let whole = y.len() / 8 * 8;
        // SAFETY: each vector covers elements i .. i+8 ≤ whole ≤ len of every slice.
        unsafe {
            let va = a.map(|a| _mm256_set1_ps(a));
            for i in (0..whole).step_by(8) {
                let p = y.as_mut_ptr().add(i);
                let mut v = _mm256_loadu_ps(p);
                for (va, x) in va.iter().zip(&xs) {
                    v = _mm256_add_ps(v, _mm256_mul_ps(*va, _mm256_loadu_ps(x.as_ptr().add(i))));
                }
                _mm256_storeu_ps(p, v);
            }
        }
        for (a, x) in a.into_iter().zip(xs) {
            super::axpy_reference(&mut y[whole..], a, &x[whole..]);
        }
    }

    /// # Safety
    /// The CPU supports AVX-512 F; `y.len() == x.len()`.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn axpy_avx512(y: &mut [f32], a: f32, x: &[f32]) {
        let whole = y.len() / 16 * 16;
        // SAFETY: each vector covers elements i .. i+16 ≤ whole ≤ len of both slices.
        unsafe {
            let va = _mm512_set1_ps(a);
            for i in (0..whole).step_by(16) {
                let p = y.as_mut_ptr().add(i);
                let v = _mm512_mul_ps(va, _mm512_loadu_ps(x.as_ptr().add(i)));
                _mm512_storeu_ps(p, _mm512_add_ps(_mm512_loadu_ps(p), v));
            }
        }
        super::axpy_reference(&mut y[whole..], a, &x[whole..]);
    }

    /// # Safety
    /// The CPU supports AVX2; `y.len() == x.len()`.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn axpy_avx2(y: &mut [f32], a: f32, x: &[f32]) {
        let whole = y.len() / 8 * 8;
        // SAFETY: each vector covers elements i .. i+8 ≤ whole ≤ len of both slices.
        unsafe {
            let va = _mm256_set1_ps(a);
            for i in (0..whole).step_by(8) {
                let p = y.as_mut_ptr().add(i);
                let v = _mm256_mul_ps(va, _mm256_loadu_ps(x.as_ptr().add(i)));
                _mm256_storeu_ps(p, _mm256_add_ps(_mm256_loadu_ps(p), v));
            }
        }
        super::axpy_reference(&mut y[whole..], a, &x[whole..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn values(n: usize, mul: usize, m: usize, shift: f32, div: f32) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * mul % m) as f32 - shift) / div)
            .collect()
    }

    #[test]
    fn dot_matches_f64_at_every_length_and_uses_every_element() {
        for n in [0, 1, 7, 15, 16, 17, 31, 32, 33, 64, 67, 512, 576] {
            let a = values(n, 37, 101, 50.5, 7.0);
            let b = values(n, 53, 89, 44.0, 3.0);
            let want: f64 = a.iter().zip(&b).map(|(x, y)| *x as f64 * *y as f64).sum();
            let scale: f64 = a
                .iter()
                .zip(&b)
                .map(|(x, y)| (*x as f64 * *y as f64).abs())
                .sum();
            let got = dot_16_lanes(&a, &b) as f64;
            assert!(
                (got - want).abs() <= 1e-6 * scale.max(1.0),
                "n {n}: {got} vs {want}"
            );
            // Every element counts: changing the last one changes the result.
            if n > 0 {
                let mut c = b.clone();
                c[n - 1] += 1.0;
                assert_ne!(dot_16_lanes(&a, &c), dot_16_lanes(&a, &b), "n {n}");
            }
        }
    }

    #[test]
    fn a_path_this_cpu_lacks_is_an_error() {
        for path in KernelPath::ALL {
            assert_eq!(VecOps::on(path).is_ok(), path.is_available(), "{path}");
        }
    }

    #[test]
    fn every_path_equals_the_references_bit_for_bit() {
        for path in crate::quant::kernels::isa_check::paths() {
            let ops = VecOps::on(path).unwrap();
            for n in 0..200 {
                // Magnitudes spread over many binades, so that a different order of additions
                // or a fused multiply-add would change low bits.
                let a: Vec<f32> = values(n, 37, 101, 50.5, 7.0)
                    .iter()
                    .enumerate()
                    .map(|(i, v)| v * (1u32 << (i % 13)) as f32)
                    .collect();
                let b = values(n, 53, 89, 44.0, 3.1);
                assert_eq!(
                    ops.dot(&a, &b).to_bits(),
                    dot_16_lanes(&a, &b).to_bits(),
                    "{path} dot, n {n}"
                );
                let mut want = values(n, 29, 97, 40.0, 0.7);
                let mut got = want.clone();
                axpy_reference(&mut want, 0.337, &a);
                ops.axpy(&mut got, 0.337, &a);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{path} axpy, n {n}");
                // Four at once: each dot as alone; the axpys as four calls in order.
                let rows: Vec<Vec<f32>> = (0..BATCH)
                    .map(|r| values(n, 41 + 2 * r, 83, 40.0, 1.3 + r as f32))
                    .collect();
                let bs: [&[f32]; BATCH] = std::array::from_fn(|r| rows[r].as_slice());
                let dots = ops.dots(&a, bs);
                for r in 0..BATCH {
                    assert_eq!(
                        dots[r].to_bits(),
                        dot_16_lanes(&a, bs[r]).to_bits(),
                        "{path} dots row {r}, n {n}"
                    );
                }
                let coef = [0.337, -1.9, 1e-3, 7.5];
                let mut want = values(n, 29, 97, 40.0, 0.7);
                let mut got = want.clone();
                for r in 0..BATCH {
                    axpy_reference(&mut want, coef[r], bs[r]);
                }
                ops.axpys(&mut got, coef, bs);
                assert_eq!(bits(&got), bits(&want), "{path} axpys, n {n}");
            }
        }
    }
}
