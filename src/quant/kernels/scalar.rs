//! Scalar reference kernels: the specification the SIMD paths are tested against. Each weight
//! row is dequantised by the reference [`reference_dequantize_row`], then each activation row gets one
//! dot product accumulated sequentially in index order ([`dot_in_order`]). The scalar kernel path runs
//! exactly this arithmetic, chunked over output rows.

use crate::quant::format::QMatrix;
use crate::quant::pack::reference_dequantize_row;

/// Sequential dot product `Σ_i a[i]·b[i]`, accumulated in index order in f32: the textbook sum,
/// the specification of the matmul kernels (the SIMD paths each accumulate in their own fixed
/// order and are tested against it to rounding), and what the scalar path computes. Not
/// attention's dot product: that is `vecops::dot_16_lanes`, an order every path reproduces
/// bit for bit; the two stay apart because changing either would change the values of its
/// users (the scalar path's logits, or attention's).
#[inline]
pub fn dot_in_order(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = 0.0f32;
    for (a, b) in a.iter().zip(b) {
        acc += a * b;
    }
    acc
}

/// Reference `Y = X · Wᵀ`: dequantise one row of W, then one dot product per activation row,
/// accumulated in index order. `x` is [S, I], `y` is [S, O], both row-major.
pub fn matmul(w: &QMatrix<'_>, x: &[f32], s: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    let mut wrow = vec![0.0f32; cols];
    for o in 0..rows {
        reference_dequantize_row(w, o, &mut wrow);
        for r in 0..s {
            y[r * rows + o] = dot_in_order(&x[r * cols..(r + 1) * cols], &wrow);
        }
    }
}

/// The reference computation for the output rows `o0..o0 + out.len() / s`, written transposed:
/// `out[i·s + t] = W[o0 + i] · x_t`.
pub(super) fn rows(w: &QMatrix<'_>, o0: usize, x: &[f32], s: usize, out: &mut [f32]) {
    let cols = w.cols();
    let mut wrow = vec![0.0f32; cols];
    for (i, out) in out.chunks_exact_mut(s).enumerate() {
        reference_dequantize_row(w, o0 + i, &mut wrow);
        for (t, y) in out.iter_mut().enumerate() {
            *y = dot_in_order(&x[t * cols..(t + 1) * cols], &wrow);
        }
    }
}

/// [`rows`] for two matrices of the same shape.
#[allow(clippy::too_many_arguments)]
pub(super) fn rows_pair(
    a: &QMatrix<'_>,
    b: &QMatrix<'_>,
    o0: usize,
    x: &[f32],
    s: usize,
    out_a: &mut [f32],
    out_b: &mut [f32],
) {
    rows(a, o0, x, s, out_a);
    rows(b, o0, x, s, out_b);
}
