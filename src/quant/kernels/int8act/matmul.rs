//! The int8 matmul's entry point: shape checks, the kernel, the split over threads.

use rayon::prelude::*;

use super::reference::reference_rows;
#[cfg(target_arch = "x86_64")]
use super::{avx2, vnni};
use super::{chunks_for, supports, Int8Kernel, OutColumns, QuantizedActs, LANES};
use crate::error::{Error, Result};
use crate::quant::format::QMatrix;

/// Whether `w`, the activations `x` and an output of `y_len` values make one call.
pub(super) fn check(w: &QMatrix<'_>, x: &QuantizedActs, y_len: usize) -> Result<()> {
    if !supports(w.format()) {
        return Err(Error::invalid(
            "int8 matmul",
            format!("{} weights have no int8-activation form", w.format()),
        ));
    }
    if x.cols != w.cols() || x.rows.checked_mul(w.rows()) != Some(y_len) {
        return Err(Error::invalid(
            "int8 matmul",
            format!(
                "W is [{}, {}] so X must have {} columns and Y {}×{} values; got {} columns \
                 and {y_len} values",
                w.rows(),
                w.cols(),
                w.cols(),
                x.rows,
                w.rows(),
                x.cols
            ),
        ));
    }
    Ok(())
}

/// Activation rows per pass over the weights: the quantised rows of a pass stay in L2
/// (1 MiB of them; L2 is 1–2 MiB per core on the VNNI CPUs), and every weight row is decoded
/// once per pass.
fn rows_per_pass(cols: usize) -> usize {
    ((1 << 20) / (chunks_for(cols) * LANES * 64)).max(8)
}

/// `y ≈ x · Wᵀ` by the int8 arithmetic, for activations already quantised, on `kernel` (an
/// error if this CPU cannot run it). `pool` parallelises over weight rows. The result does
/// not depend on the kernel, the pool or its threads.
pub fn matmul_quantized(
    w: &QMatrix<'_>,
    x: &QuantizedActs,
    y: &mut [f32],
    kernel: Int8Kernel,
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    check(w, x, y.len())?;
    if !kernel.available() {
        return Err(Error::invalid(
            "int8 matmul",
            format!("this CPU cannot run the {} int8 kernel", kernel.name()),
        ));
    }
    let (o, s) = (w.rows(), x.rows);
    if o == 0 || s == 0 {
        return Ok(());
    }
    let out = OutColumns {
        ptr: y.as_mut_ptr(),
        s,
        o,
    };
    let row_bytes = w.format().row_bytes(w.cols());
    // Weight rows `o0..o0 + n` into their columns of `y`.
    let work = |o0: usize, n: usize| {
        let pass = rows_per_pass(w.cols());
        // SAFETY (both): the kernel's availability was checked above; `check` made the shapes
        // agree; rows `o0..o0 + n` are in `w`, and no other task writes their columns.
        #[cfg(target_arch = "x86_64")]
        match kernel {
            Int8Kernel::Vnni => return unsafe { vnni::rows(w, o0, n, x, pass, out) },
            Int8Kernel::Avx2 => return unsafe { avx2::rows(w, o0, n, x, pass, out) },
            Int8Kernel::Reference => {}
        }
        let _ = (kernel, pass);
        let mut chunk = vec![0.0f32; n * s];
        reference_rows(w, o0, x, &mut chunk);
        for (i, row) in chunk.chunks_exact(s).enumerate() {
            for (t, v) in row.iter().enumerate() {
                // SAFETY: t < s and o0 + i < o; this task alone writes column o0 + i.
                unsafe { out.set(t, o0 + i, *v) };
            }
        }
    };
    match pool {
        None => work(0, o),
        Some(pool) => {
            let threads = pool.current_num_threads().max(1);
            // ~8 chunks per thread for balance, but at least ~16 KiB of weights per chunk.
            let per = o
                .div_ceil(threads * 8)
                .max((16 << 10) / row_bytes.max(1))
                .clamp(1, o);
            pool.install(|| {
                (0..o.div_ceil(per))
                    .into_par_iter()
                    .for_each(|i| work(i * per, per.min(o - i * per)))
            });
        }
    }
    Ok(())
}
