//! The int8 matmul's entry point: shape checks, the kernel, the split over threads.

use rayon::prelude::*;

use super::reference::reference_rows;
#[cfg(target_arch = "x86_64")]
use super::{avx2, decode, decode_avx2, vnni, DecodeActs};
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
    split_rows(o, w.format().row_bytes(w.cols()), pool, work);
    Ok(())
}

/// `work(o0, n)` over the `o` weight rows of a call, split over `pool`'s threads (~8 parts per
/// thread for balance, each at least ~16 KiB of weights), or all on this thread without one.
fn split_rows(
    o: usize,
    row_bytes: usize,
    pool: Option<&rayon::ThreadPool>,
    work: impl Fn(usize, usize) + Sync,
) {
    match pool {
        None => work(0, o),
        Some(pool) => {
            let threads = pool.current_num_threads().max(1);
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
}

/// `y ≈ x · Wᵀ` by the int8 arithmetic for a decode-sized call (`s` rows of `x`, [s, cols]
/// row-major) on the active int8 kernel's decode kernel (AVX-512 VNNI, `decode.rs`, or AVX2,
/// `decode_avx2.rs`): the same values as [`matmul_quantized`] gives for the same rows, bit for
/// bit. An error where that kernel has none (the scalar reference) or the format has no int8
/// form.
#[cfg(target_arch = "x86_64")]
pub fn matmul_decode(
    w: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    y: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    if !supports(w.format()) {
        return Err(Error::invalid(
            "int8 matmul",
            format!("{} weights have no int8-activation form", w.format()),
        ));
    }
    crate::quant::kernels::check_shapes(w, x.len(), s, y.len())?;
    let acts = DecodeActs::new(x, s, w.cols(), w.format())?;
    matmul_decode_quantized(w, &acts, y, pool);
    Ok(())
}

/// [`matmul_decode`] for activations already laid out for `w` (shapes checked by the caller).
#[cfg(target_arch = "x86_64")]
pub(super) fn matmul_decode_quantized(
    w: &QMatrix<'_>,
    x: &DecodeActs,
    y: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) {
    let (o, s) = (w.rows(), x.rows);
    if o == 0 || s == 0 {
        return;
    }
    let out = OutColumns {
        ptr: y.as_mut_ptr(),
        s,
        o,
    };
    // SAFETY: `x`'s kernel runs here (checked when it was quantised) and the caller checked
    // the shapes agree; rows `o0..o0 + n` are in `w`, and no other task writes their columns.
    let work = |o0: usize, n: usize| unsafe { decode_rows(w, o0, n, x, out) };
    split_rows(o, w.format().row_bytes(w.cols()), pool, work);
}

/// The decode kernel `x` was quantised for, on weight rows `o0..o0 + n`.
///
/// # Safety
/// As `decode::rows` (the kernel runs here: `DecodeActs::fill_on` checked it).
#[cfg(target_arch = "x86_64")]
unsafe fn decode_rows(w: &QMatrix<'_>, o0: usize, n: usize, x: &DecodeActs, out: OutColumns) {
    // SAFETY: the caller's contract.
    unsafe {
        match x.kernel {
            Int8Kernel::Vnni => decode::rows(w, o0, n, x, out),
            _ => decode_avx2::rows(w, o0, n, x, out),
        }
    }
}

/// One matrix of a [`matmuls_decode`] pass: `y ≈ x · Wᵀ` ([x.rows, W.rows] row-major).
#[cfg(target_arch = "x86_64")]
pub struct DecodeJob<'a> {
    pub w: QMatrix<'a>,
    pub x: &'a DecodeActs,
    pub y: &'a mut [f32],
}

/// Every job's product in one parallel pass (one fork-join for all of a MoE layer's experts,
/// as the exact kernels batch them), each by its activations' decode kernel: the same values as one
/// [`matmul_decode`] per job. Errors if a job's shapes or layout do not fit.
#[cfg(target_arch = "x86_64")]
pub fn matmuls_decode(jobs: &mut [DecodeJob<'_>], pool: Option<&rayon::ThreadPool>) -> Result<()> {
    for j in jobs.iter() {
        if !supports(j.w.format())
            || j.x.cols != j.w.cols()
            || !j.x.fits(j.w.format())
            || j.y.len() != j.x.rows * j.w.rows()
        {
            return Err(Error::invalid(
                "int8 matmul",
                format!(
                    "W [{}, {}] ({}) does not fit activations of {} rows × {} columns and an \
                     output of {} values",
                    j.w.rows(),
                    j.w.cols(),
                    j.w.format(),
                    j.x.rows,
                    j.x.cols,
                    j.y.len()
                ),
            ));
        }
    }
    let outs: Vec<OutColumns> = jobs
        .iter_mut()
        .map(|j| OutColumns {
            ptr: j.y.as_mut_ptr(),
            s: j.x.rows,
            o: j.w.rows(),
        })
        .collect();
    let threads = pool.map_or(1, |p| p.current_num_threads().max(1));
    let total: usize = jobs.iter().map(|j| j.w.rows()).sum();
    // (job, first row, rows): ~8 tasks per thread over all jobs, each at least ~16 KiB.
    let mut tasks = Vec::new();
    for (k, j) in jobs.iter().enumerate() {
        let (o, row_bytes) = (j.w.rows(), j.w.format().row_bytes(j.w.cols()));
        if o == 0 || j.x.rows == 0 {
            continue;
        }
        let per = total
            .div_ceil(threads * 8)
            .max((16 << 10) / row_bytes.max(1))
            .clamp(1, o);
        tasks.extend((0..o.div_ceil(per)).map(|i| (k, i * per, per.min(o - i * per))));
    }
    let jobs = &*jobs;
    // SAFETY: each job's decode kernel runs here (every `DecodeActs` was built after checking
    // it), the shapes were checked above, and the tasks write disjoint columns of their job's
    // output.
    let run = |&(k, o0, n): &(usize, usize, usize)| unsafe {
        decode_rows(&jobs[k].w, o0, n, jobs[k].x, outs[k])
    };
    match pool {
        Some(pool) if tasks.len() > 1 => pool.install(|| tasks.par_iter().for_each(run)),
        _ => tasks.iter().for_each(run),
    }
    Ok(())
}
