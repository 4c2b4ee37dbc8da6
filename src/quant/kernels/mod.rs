//! Dequant-matmul: `Y[S×O] = X[S×I] · Wᵀ` with f32 activations, exact dequantisation and f32
//! accumulation. The accumulation order belongs to the format and I, never to S, the tile
//! position or the thread count: row s of an S-row call equals the S=1 call bit for bit (draft
//! and verify must compute the same function).
//!
//! `scalar` is the reference every SIMD path is tested against. The x86 paths are one tile
//! driver (`driver.rs`) over the vector operations of an ISA (`driver::Isa`, implemented by
//! `avx2.rs` and `avx512.rs`) and the row decoders of each format (`sources.rs`, plus
//! AVX-512's table-decoded int4 in `avx512.rs`), instantiated per ISA in its
//! `#[target_feature]` entry points; `neon.rs` is its own (it decodes a row into a buffer
//! first). The SIMD paths (`avx512`, `avx2`, `neon`) share one shape of computation:
//! - a weight row is consumed as vectors of L lanes (16 for AVX-512, 8 for AVX2, 4 for NEON);
//!   vector v is dequantised exactly (`(nibble − 8) as f32 · scale`, `q as f32 · scale`, the
//!   bf16/f16 bits widened) and fused-multiply-added into accumulator `v % A` of each
//!   activation row (A = 2 on x86, 4 on NEON); the last partial vector is masked (lanes past I
//!   are zero in both W and X); AVX-512 walks int4 (gs a multiple of 32, or per row) as the
//!   even then the odd elements of each 32-element block, with the activations rearranged to
//!   match once per call (`XLayout`, which on AVX-512 also puts every activation row in
//!   64-byte-aligned memory) — still one fixed order per format and I;
//! - the accumulators are summed in order, then the lanes by a fixed tree.
//!
//! One exception to that shape: AVX2 int4 whose groups are whole 32-element blocks (gs a
//! multiple of 32, or per row) runs `avx2_int4`, which multiplies each group's sum by its
//! scale once instead of every weight by it (`Σ_g s_g·(Σ n·x − 8·Σ x)`, the stored nibbles n
//! converted exactly): the same function in another, equally fixed, order, and on Zen 3
//! the difference between a third and two thirds of the memory bandwidth at S = 1.
//!
//! Activation rows are processed in tiles of a few rows (AVX-512: 2, for four weight rows at
//! once; AVX2: 3; NEON: 4) that share each decoded weight vector; every tile runs the same
//! instructions on its own accumulators, so the result of a row never depends on S or on its
//! position. A weight
//! row is read from memory by the first tile and from L1 by the others, so the weights of one
//! call are read from memory once whatever S is. Calls of more than `S_BLOCK` (8) rows run as
//! blocks of that many (the weights are read once per block; the activations of a block stay
//! in cache).
//!
//! The path is chosen once at run time from the CPU's features (`COLIBRI_KERNEL` =
//! `scalar|avx2|avx512|neon` overrides it, read once), and [`set_forced_path`] switches it for
//! tests and A/B benches.

mod ffn;
pub mod int8act;
pub mod isa_check;
pub mod scalar;
pub mod vecops;

mod layout;
mod path;

#[cfg(target_arch = "x86_64")]
mod driver;
#[cfg(target_arch = "x86_64")]
mod sources;

#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx2_int4;
#[cfg(target_arch = "x86_64")]
mod avx512;
#[cfg(target_arch = "aarch64")]
mod neon;

use crate::error::{Error, Result};
use crate::quant::format::QMatrix;

pub use ffn::{
    expert_ffn, expert_ffn_in, expert_ffn_with, experts_ffn, experts_ffn_in, experts_ffn_with,
    ExpertCall,
};

use layout::{XBuf, XLayout};
#[cfg(test)]
use path::parse_override;
pub use path::{active_path, selected_path, set_forced_path, KernelPath};

/// How a call may compute: exactly, or with int8 activations where exactness is not promised
/// (long prefills; docs/architecture.md, "Prefill arithmetic").
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum Arithmetic {
    /// f32 dequantisation and accumulation, S-invariant: every decode and verify row.
    #[default]
    Exact,
    /// Activations rounded to int8 per block of 64 and summed as integers ([`int8act`]), for
    /// the weight formats that have that form ([`int8act::supports`]); the others exact.
    Int8,
}

impl Arithmetic {
    /// The name used by the `prefill` option.
    pub fn name(self) -> &'static str {
        match self {
            Arithmetic::Exact => "exact",
            Arithmetic::Int8 => "int8",
        }
    }
}

/// The int8 kernel that goes with the active exact path: VNNI under the AVX-512 path where the
/// CPU has it, AVX2 under the AVX2 path (and under AVX-512 without VNNI), the scalar reference
/// under the scalar and NEON paths (so forcing the scalar path forces it for int8 too).
pub fn int8_kernel() -> Result<int8act::Int8Kernel> {
    use int8act::Int8Kernel;
    let wanted: &[Int8Kernel] = match active_path()? {
        KernelPath::Avx512 => &[Int8Kernel::Vnni, Int8Kernel::Avx2],
        KernelPath::Avx2 => &[Int8Kernel::Avx2],
        KernelPath::Scalar | KernelPath::Neon => &[],
    };
    Ok(wanted
        .iter()
        .copied()
        .find(|k| k.available())
        .unwrap_or(Int8Kernel::Reference))
}

/// [`matmul`] in `arith`: int8 activations when asked and `w`'s format has that form, else
/// exact. Either way row t of the result depends on row t of `x` alone: not on S, the other
/// rows, the pool or its threads (each row is quantised by itself and summed in a fixed order).
pub fn matmul_in(
    arith: Arithmetic,
    w: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    y: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    if arith == Arithmetic::Exact || !int8act::supports(w.format()) {
        return matmul(w, x, s, y, pool);
    }
    check_shapes(w, x.len(), s, y.len())?;
    let kernel = int8_kernel()?;
    #[cfg(target_arch = "x86_64")]
    if uses_decode_kernel(kernel, s) {
        return int8act::matmul_decode(w, x, s, y, pool);
    }
    let q = int8act::QuantizedActs::new(x, s, w.cols(), pool);
    int8act::matmul_quantized(w, &q, y, kernel, pool)
}

/// Whether an int8 call of `s` rows on `kernel` runs a decode kernel (AVX-512 VNNI or AVX2; the
/// same values either way).
#[cfg(target_arch = "x86_64")]
fn uses_decode_kernel(kernel: int8act::Int8Kernel, s: usize) -> bool {
    matches!(
        kernel,
        int8act::Int8Kernel::Vnni | int8act::Int8Kernel::Avx2
    ) && s <= int8act::DECODE_MAX_ROWS
}

/// Columns a matrix may have (the SIMD paths index scale groups with a 64-bit multiply-shift,
/// exact up to here; see `group_magic`).
const MAX_COLS: usize = 1 << 26;

/// Check the shapes of a matmul call.
fn check_shapes(w: &QMatrix<'_>, x_len: usize, s: usize, y_len: usize) -> Result<()> {
    if s.checked_mul(w.cols()) != Some(x_len) || s.checked_mul(w.rows()) != Some(y_len) {
        return Err(Error::invalid(
            "matmul",
            format!(
                "W is [{}, {}] so X must hold {s}×{} values and Y {s}×{}; got {} and {}",
                w.rows(),
                w.cols(),
                w.cols(),
                w.rows(),
                x_len,
                y_len
            ),
        ));
    }
    if w.cols() >= MAX_COLS {
        return Err(Error::invalid(
            "matmul",
            format!(
                "W has {} columns; at most {} are supported",
                w.cols(),
                MAX_COLS - 1
            ),
        ));
    }
    Ok(())
}

/// `y[s, o] = Σ_i x[s, i] · W[o, i]` for S rows of `x` (row-major [S, I]) into `y`
/// (row-major [S, O]), on the [`active_path`]. `pool` parallelises over output rows; `None`
/// runs on this thread. The result does not depend on S, the pool or its thread count.
pub fn matmul(
    w: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    y: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    matmul_with(active_path()?, w, x, s, y, pool)
}

/// [`matmul`] on an explicit path (an error if this CPU cannot run it).
pub fn matmul_with(
    path: KernelPath,
    w: &QMatrix<'_>,
    x: &[f32],
    s: usize,
    y: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    check_shapes(w, x.len(), s, y.len())?;
    path.require()?;
    if s == 0 || w.rows() == 0 {
        return Ok(());
    }
    if s > S_BLOCK {
        // Row s of any call is the S=1 call, so blocks of rows give the same values.
        let (i, o) = (w.cols(), w.rows());
        for b in s_blocks(s) {
            let (xb, yb) = (&x[b.start * i..b.end * i], &mut y[b.start * o..b.end * o]);
            matmul_with(path, w, xb, b.len(), yb, pool)?;
        }
        return Ok(());
    }
    let row_bytes = w.format().row_bytes(w.cols());
    let x = XLayout::of(path, w.format()).arrange(x, s, w.cols());
    let x = &x[..];
    if s == 1 {
        // Y^T == Y: the chunks write straight into y.
        for_row_chunks(w.rows(), 1, row_bytes, pool, y, |o0, out| {
            rows(path, w, o0, x, 1, out)
        });
    } else {
        let mut yt = vec![0.0f32; w.rows() * s];
        for_row_chunks(w.rows(), s, row_bytes, pool, &mut yt, |o0, out| {
            rows(path, w, o0, x, s, out)
        });
        transpose(&yt, w.rows(), s, y);
    }
    Ok(())
}

/// Row `row` of `w` dequantised into `out` (`w.cols()` floats) on the [`active_path`]: the
/// exact f32 weights the kernels multiply with (`(nibble − 8) · scale`, `q · scale`, bf16 and
/// f16 widened), equal bit for bit to the scalar reference `pack::reference_dequantize_row`. For code
/// that needs weights as numbers rather than as a product
/// (MLA's query absorption through the key half of `kv_b`).
pub fn dequantize_row(w: &QMatrix<'_>, row: usize, out: &mut [f32]) -> Result<()> {
    dequantize_row_with(active_path()?, w, row, out)
}

/// [`dequantize_row`] on an explicit path.
pub fn dequantize_row_with(
    path: KernelPath,
    w: &QMatrix<'_>,
    row: usize,
    out: &mut [f32],
) -> Result<()> {
    if row >= w.rows() || out.len() != w.cols() {
        return Err(Error::invalid(
            "dequantize_row",
            format!(
                "row {row} of a [{}, {}] matrix into {} floats (need row < {} and {} floats)",
                w.rows(),
                w.cols(),
                out.len(),
                w.rows(),
                w.cols()
            ),
        ));
    }
    path.require()?;
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `path.require()` succeeded (AVX2, FMA, F16C present); row and length were
        // checked above.
        KernelPath::Avx2 => unsafe { avx2::dequantize_row(w, row, out) },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX-512 F and BW present.
        KernelPath::Avx512 => unsafe { avx512::dequantize_row(w, row, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above, with NEON present.
        KernelPath::Neon => unsafe { neon::dequantize_row(w, row, out) },
        _ => crate::quant::pack::reference_dequantize_row(w, row, out),
    }
    Ok(())
}

/// Activation rows per kernel pass: larger calls ([`matmul`], [`expert_ffn`]) run in blocks of
/// this many rows. A pass streams its activation rows once per four weight rows; a block of
/// 8 rows stays in L2 (192 KiB at 6144 columns, 512 KiB at 16384), where 1024 rows (24 MiB)
/// came from DRAM on every pass. int4-gs64, 2 threads, S = 1024: 2048×6144 112 → 293
/// GFLOP/s; S = 64: 6144×2048 and 6144×16384 at 313–333 with blocks of 8, 278–293 with 16.
/// The weights are read once per block, little next to the block's arithmetic.
const S_BLOCK: usize = 8;

/// The activation rows `0..s` in blocks of [`S_BLOCK`].
fn s_blocks(s: usize) -> impl Iterator<Item = std::ops::Range<usize>> {
    (0..s)
        .step_by(S_BLOCK)
        .map(move |t0| t0..(t0 + S_BLOCK).min(s))
}

/// silu(v) = v / (1 + e^(−v)) in f32: one scalar function for every path.
#[inline]
pub fn silu(v: f32) -> f32 {
    v / (1.0 + (-v).exp())
}

/// `out[i·s + t] = W[o0 + i] · x_t` for the rows of one chunk (`out` is [n, s], n = len/s).
fn rows(path: KernelPath, w: &QMatrix<'_>, o0: usize, x: &[f32], s: usize, out: &mut [f32]) {
    match path {
        KernelPath::Scalar => scalar::rows(w, o0, x, s, out),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `path.require()` succeeded before any chunk ran, so the CPU has AVX2, FMA
        // and F16C; the shapes were checked by `check_shapes` and `for_row_chunks` passes
        // `o0 + out.len() / s <= w.rows()`; `x` is in `XLayout::of(path, w.format())`, the
        // int4-by-group layout exactly when `avx2_int4` takes the format.
        KernelPath::Avx2 => unsafe {
            if avx2_int4::takes(w.format()) {
                avx2_int4::rows(w, o0, x, s, out)
            } else {
                avx2::rows(w, o0, x, s, out)
            }
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: as above, with AVX-512 F and BW present.
        KernelPath::Avx512 => unsafe { avx512::rows(w, o0, x, s, out) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: as above, with NEON present.
        KernelPath::Neon => unsafe { neon::rows(w, o0, x, s, out) },
        #[allow(unreachable_patterns)]
        _ => unreachable!("kernel path {path} was checked to be available"),
    }
}

/// [`rows`] for two matrices of the same shape at once (gate and up), sharing the x loads.
#[allow(clippy::too_many_arguments)]
fn rows_pair(
    path: KernelPath,
    a: &QMatrix<'_>,
    b: &QMatrix<'_>,
    o0: usize,
    x: &[f32],
    s: usize,
    out_a: &mut [f32],
    out_b: &mut [f32],
) {
    match path {
        KernelPath::Scalar => scalar::rows_pair(a, b, o0, x, s, out_a, out_b),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see `rows`; `a` and `b` have the same shape (checked by `expert_ffn_with`)
        // and, called here, the same layout: the same format wherever it is int4 by group.
        KernelPath::Avx2 => unsafe {
            if avx2_int4::takes(a.format()) {
                debug_assert_eq!(a.format(), b.format());
                avx2_int4::rows_pair(a, b, o0, x, s, out_a, out_b)
            } else {
                avx2::rows_pair(a, b, o0, x, s, out_a, out_b)
            }
        },
        #[cfg(target_arch = "x86_64")]
        // SAFETY: see `rows`.
        KernelPath::Avx512 => unsafe { avx512::rows_pair(a, b, o0, x, s, out_a, out_b) },
        #[cfg(target_arch = "aarch64")]
        // SAFETY: see `rows`.
        KernelPath::Neon => unsafe { neon::rows_pair(a, b, o0, x, s, out_a, out_b) },
        #[allow(unreachable_patterns)]
        _ => unreachable!("kernel path {path} was checked to be available"),
    }
}

/// Split the output rows of a [rows, s] transposed result into chunks and run `work(o0, chunk)`
/// on each, in parallel on `pool` when given ([`ffn::for_chunks`] of one matrix).
fn for_row_chunks(
    rows: usize,
    s: usize,
    row_bytes: usize,
    pool: Option<&rayon::ThreadPool>,
    out_t: &mut [f32],
    work: impl Fn(usize, &mut [f32]) + Sync,
) {
    let shape = ffn::ChunkShape { rows, s, row_bytes };
    ffn::for_chunks(&[shape], vec![out_t], pool, |_, o0, chunk| work(o0, chunk));
}

/// `dst[t·rows + o] = src[o·s + t]`: [rows, s] → [s, rows].
fn transpose(src: &[f32], rows: usize, s: usize, dst: &mut [f32]) {
    if s == 0 {
        return;
    }
    for (o, row) in src.chunks_exact(s).enumerate().take(rows) {
        for (t, v) in row.iter().enumerate() {
            dst[t * rows + o] = *v;
        }
    }
}

/// Multiplier for the group of vector `v` (of `lanes` elements): `group = (v · m) >> 32` with
/// `m = ceil(2^32 / (gs / lanes))`, exact while `v · gs / lanes < 2^32`, which `cols < MAX_COLS` (2^26) guarantees for
/// lanes ≥ 4 and gs ≤ 256.
/// Per-row formats use `m = 0` (every vector in group 0).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn group_magic(format: crate::quant::QuantFormat, lanes: usize) -> u64 {
    match format {
        crate::quant::QuantFormat::Int4Grouped { group_size } => {
            let d = (group_size / lanes) as u64;
            (1u64 << 32).div_ceil(d)
        }
        _ => 0,
    }
}

#[cfg(test)]
mod tests;
