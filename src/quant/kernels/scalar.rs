//! Scalar reference kernels: the specification the SIMD paths must reproduce bit for bit.

use crate::quant::format::QMatrix;
use crate::quant::pack::dequantize_row;

/// Reference `Y = X · Wᵀ`: dequantise one row of W, then one dot product per activation row,
/// accumulated in index order.
pub fn matmul(w: &QMatrix<'_>, x: &[f32], s: usize, y: &mut [f32]) {
    let (rows, cols) = (w.rows(), w.cols());
    let mut wrow = vec![0.0f32; cols];
    for o in 0..rows {
        dequantize_row(w, o, &mut wrow);
        for r in 0..s {
            let xr = &x[r * cols..(r + 1) * cols];
            let mut acc = 0.0f32;
            for (a, b) in xr.iter().zip(&wrow) {
                acc += a * b;
            }
            y[r * rows + o] = acc;
        }
    }
}
