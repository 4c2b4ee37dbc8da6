//! Dequant-matmul: `Y[S×O] = X[S×I] · Wᵀ` with f32 activations, exact dequantisation and f32
//! accumulation. The accumulation order belongs to the format, never to S: row s of an S-row
//! call equals the S=1 call bit for bit (draft and verify must compute the same function).
//!
//! `scalar` is the reference every SIMD path is tested against.

pub mod scalar;

use crate::error::{Error, Result};
use crate::quant::format::QMatrix;

/// Check the shapes of a matmul call.
fn check_shapes(w: &QMatrix<'_>, x: &[f32], s: usize, y: &[f32]) -> Result<()> {
    if x.len() != s * w.cols() || y.len() != s * w.rows() {
        return Err(Error::invalid(
            "matmul",
            format!(
                "W is [{}, {}] so X must hold {s}×{} values and Y {s}×{}; got {} and {}",
                w.rows(),
                w.cols(),
                w.cols(),
                w.rows(),
                x.len(),
                y.len()
            ),
        ));
    }
    Ok(())
}

/// `y[s, o] = Σ_i x[s, i] · W[o, i]` for S rows of `x` (row-major [S, I]) into `y`
/// (row-major [S, O]). `pool` parallelises over output rows; `None` runs on this thread.
pub fn matmul(
    w: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    y: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    check_shapes(w, x, s, y)?;
    let _ = pool;
    scalar::matmul(w, x, s, y);
    Ok(())
}
