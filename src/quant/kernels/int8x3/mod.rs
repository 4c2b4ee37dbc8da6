//! The split-int8 decode arithmetic (`decode="int8x3"`): `Y[S×O] = X[S×I] · Wᵀ` for int4
//! weights, with every activation written as a 23-bit integer per block of 64 elements and
//! split into three int8 digits, each digit multiplied by the stored nibbles with AVX-512 VNNI
//! `vpdpbusd` and the three partial sums recombined as integers. It exists because the exact
//! f32 kernels are bound by their own instructions, not by the memory, on AVX-512 CPUs that
//! run 512-bit operations on 256-bit units (Zen 4: ~60% of the bandwidth at S = 1,
//! docs/benchmarks.md, "Side by side on AMD EPYC Zen 4"): here each 64 bytes of nibbles cost
//! six `vpdpbusd` instead of eight conversions and FMAs behind a table lookup.
//!
//! **Not bit-identical to the exact kernels, but as accurate as f32 per block**: each
//! activation is rounded to a step of `m / (127·2¹⁶)`, m its block's largest magnitude, an
//! error below `2⁻²⁴·m` (f32's own relative precision), and the products are summed exactly
//! as integers. The result of a row never depends on S, its
//! position in a call, the pool or its threads (each row's digits are its own), so decode,
//! draft and verify compute the same function and speculation stays lossless in this
//! arithmetic exactly as in the exact one. It is an option (`decode`), not the default: the
//! exact kernels stay the reference every decode path is held to (docs/architecture.md,
//! "Decode arithmetic").
//!
//! The arithmetic, which the scalar reference ([`reference_matmul`]) and the VNNI path
//! (`vnni.rs`) compute bit for bit:
//! - **activations** ([`SplitActs::new`]): per row and block b of 64 elements, `m = max|x|`,
//!   `Q = round_half_even(x · (QMAX / m))` in f64 (|Q| ≤ QMAX = 127·2¹⁶) and `sx_b = m / QMAX`
//!   as f32 (a block of zeros, or one with a NaN or infinity: `Q = 0`, `sx_b = 0`); Q is
//!   written in balanced base-256 digits `Q = d₀·2¹⁶ + d₁·2⁸ + d₂`, each in [−128, 127];
//! - **weights** as their stored nibbles `u = q + 8`;
//! - **lanes**: the row is walked in chunks of 128 elements (64 bytes of nibbles); lane l of
//!   chunk c holds the 8 elements `128c + 8l .. 128c + 8l + 8`, all in block `2c + l / 8`;
//!   its integer `E = ((e₀·2⁸) + e₁)·2⁸ + e₂ − 8·ΣQ` with `e_k = Σ u·d_k` over the lane's
//!   elements is `Σ q·Q` exactly (every partial sum fits in 31 bits);
//! - **sum**: `lane_l = fma(E as f32, sw_b · sx_b, lane_l)` over the chunks in order (`sw_b`
//!   the weight scale of block b: its group's, gs a multiple of 64, or the row's), then the 16
//!   lanes by `int8act`'s fixed tree.
//!
//! Other formats (int8 per row, whose 8-bit weights would overflow a lane's 32 bits against
//! 23-bit activations, group sizes that are not multiples of 64, float weights) have no such
//! form: [`supports`] says so and the caller runs the exact kernel for them.

#[cfg(target_arch = "x86_64")]
mod vnni;

use super::int8act::{par_weight_rows, sum_lanes, Line, OutColumns};
use crate::error::{Error, Result};
use crate::quant::format::{QMatrix, QuantFormat};
use crate::quant::pack::reference_dequantize_row;

/// Elements per activation block (one scale each).
pub const BLOCK: usize = 64;
/// Elements per 64-byte chunk of nibbles: two blocks, one per half of the lanes.
const CHUNK: usize = 128;
/// 32-bit lanes per vector.
const LANES: usize = 16;
/// Lines per activation row and chunk: three digits × (even elements, odd elements).
const LINES: usize = 6;
/// The largest |Q|: 127·2¹⁶, so that the top digit stays within ±127.
const QMAX: i32 = 127 << 16;
/// 1.5 · 2⁵²: adding and removing it rounds an f64 below 2⁵¹ in magnitude to the nearest
/// integer, ties to even (`round_ties_even` is a libm call on baseline x86-64).
const ROUNDER: f64 = 6_755_399_441_055_744.0;

/// Whether `format` has a split-int8 form.
pub fn supports(format: QuantFormat) -> bool {
    match format {
        QuantFormat::Int4PerRow => true,
        QuantFormat::Int4Grouped { group_size } => group_size % BLOCK == 0,
        _ => false,
    }
}

/// Whether this CPU runs the SIMD kernel (AVX-512 F, BW, VL and VNNI). Elsewhere the
/// arithmetic runs as the scalar reference: correct, far slower than the exact kernels, so
/// the engine refuses the option there.
pub fn available() -> bool {
    let f = crate::cpu::features();
    cfg!(target_arch = "x86_64") && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni
}

/// Chunks of 128 elements for `cols` columns.
fn chunks_for(cols: usize) -> usize {
    cols.div_ceil(CHUNK)
}

/// Activation rows split into int8 digits and laid out for `vpdpbusd` against packed nibbles:
/// row r's chunk c is 6 lines (digit k's even elements, then its odd ones), each byte j of a
/// line the digit of element `128c + 2j` (even) or `128c + 2j + 1` (odd), matching byte j of
/// the weights' 64-byte chunk (its low and high nibbles).
pub struct SplitActs {
    rows: usize,
    cols: usize,
    chunks: usize,
    /// [rows][chunks][LINES] lines of i8 digits (as bytes).
    digits: Vec<Line>,
    /// [rows][chunks][16]: `8·ΣQ` over each lane's 8 elements (the nibbles' offset).
    offsets: Vec<i32>,
    /// [rows][chunks][16]: `sx_b` of each lane's block (0 past the last block).
    scales: Vec<f32>,
}

impl SplitActs {
    /// Split `x` ([rows, cols] row-major). Decode and verify calls have a few rows of a few
    /// thousand elements: scalar code, on the calling thread.
    pub fn new(x: &[f32], rows: usize, cols: usize) -> Self {
        let chunks = chunks_for(cols);
        let mut acts = SplitActs {
            rows,
            cols,
            chunks,
            digits: vec![Line([0; 64]); rows * chunks * LINES],
            offsets: vec![0; rows * chunks * LANES],
            scales: vec![0.0; rows * chunks * LANES],
        };
        let mut q = [0i32; BLOCK];
        for r in 0..rows {
            let src = &x[r * cols..(r + 1) * cols];
            for (b, block) in src.chunks(BLOCK).enumerate() {
                let sx = quantize_block(block, &mut q);
                let (c, half) = (b / 2, b % 2);
                let lane0 = (r * chunks + c) * LANES + half * LANES / 2;
                acts.scales[lane0..lane0 + LANES / 2].fill(sx);
                let lines = &mut acts.digits[(r * chunks + c) * LINES..][..LINES];
                for (e, &v) in q.iter().enumerate() {
                    // Element 64·half + e of the chunk: byte j of the even or odd line.
                    let j = half * BLOCK + e;
                    for (k, d) in digits(v).into_iter().enumerate() {
                        lines[2 * k + j % 2].0[j / 2] = d as u8;
                    }
                    acts.offsets[(r * chunks + c) * LANES + j / 8] += v << 3;
                }
            }
        }
        acts
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Q of element `e` of row r, rebuilt from its digits.
    fn q(&self, r: usize, e: usize) -> i32 {
        let (c, j) = (e / CHUNK, e % CHUNK);
        let lines = &self.digits[(r * self.chunks + c) * LINES..][..LINES];
        let d = |k: usize| lines[2 * k + j % 2].0[j / 2] as i8 as i32;
        (d(0) << 16) + (d(1) << 8) + d(2)
    }
}

/// One block: Q of each element (zero-padded past `src`) and the block's scale.
fn quantize_block(src: &[f32], q: &mut [i32; BLOCK]) -> f32 {
    let m = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    q.fill(0);
    if m == 0.0 || !m.is_finite() || src.iter().any(|v| !v.is_finite()) {
        // A NaN or Inf activation is the forward's own error to report; split it to zeros
        // rather than to garbage.
        return 0.0;
    }
    let inv = f64::from(QMAX) / f64::from(m);
    for (d, v) in q.iter_mut().zip(src) {
        let r = ((f64::from(*v) * inv + ROUNDER) - ROUNDER).clamp(-f64::from(QMAX), f64::from(QMAX));
        *d = r as i32;
    }
    (f64::from(m) / f64::from(QMAX)) as f32
}

/// Q's balanced base-256 digits, most significant first: `Q = d₀·2¹⁶ + d₁·2⁸ + d₂`.
fn digits(q: i32) -> [i8; 3] {
    let d2 = ((q + 128) & 255) - 128;
    let r = (q - d2) >> 8;
    let d1 = ((r + 128) & 255) - 128;
    let d0 = (r - d1) >> 8;
    [d0 as i8, d1 as i8, d2 as i8]
}

/// The weight scale of each block of row `o`, [chunks · 2] (0 past the last block).
fn block_scales(w: &QMatrix<'_>, o: usize, out: &mut [f32]) {
    let scales = w.row_scales(o);
    let blocks = w.cols().div_ceil(BLOCK);
    let group_blocks = w.format().group_size(w.cols()).div_ceil(BLOCK).max(1);
    for (b, s) in out.iter_mut().enumerate() {
        *s = if b < blocks {
            scales[b / group_blocks]
        } else {
            0.0
        };
    }
}

/// The reference: `y[t, o]` for the activations `x` by the arithmetic in the module docs,
/// from the reference dequantiser's integers (not from the lane layouts).
pub fn reference_matmul(w: &QMatrix<'_>, x: &SplitActs, y: &mut [f32]) -> Result<()> {
    check(w, x, y.len())?;
    let (cols, s) = (w.cols(), x.rows);
    let mut deq = vec![0.0f32; cols];
    let mut u = vec![0i32; x.chunks * CHUNK];
    let mut sw = vec![0.0f32; x.chunks * 2];
    for o in 0..w.rows() {
        // The stored nibbles: the reference weights divided by their scale, plus 8 (exact:
        // each weight is an integer times its scale).
        reference_dequantize_row(w, o, &mut deq);
        block_scales(w, o, &mut sw);
        u.fill(0);
        for (e, v) in deq.iter().enumerate() {
            let s = sw[e / BLOCK];
            u[e] = if s == 0.0 { 8 } else { (v / s).round() as i32 + 8 };
        }
        for t in 0..s {
            let mut lanes = [0.0f32; LANES];
            for c in 0..x.chunks {
                for (l, lane) in lanes.iter_mut().enumerate() {
                    let mut e = [0i32; 3];
                    for i in 0..8 {
                        let el = c * CHUNK + 8 * l + i;
                        if el < cols {
                            for (k, d) in digits(x.q(t, el)).into_iter().enumerate() {
                                e[k] += u[el] * i32::from(d);
                            }
                        }
                    }
                    let at = (t * x.chunks + c) * LANES + l;
                    let int = (((e[0] << 8) + e[1]) << 8) + e[2] - x.offsets[at];
                    let scale = sw[2 * c + l / 8] * x.scales[at];
                    *lane = (int as f32).mul_add(scale, *lane);
                }
            }
            y[t * w.rows() + o] = sum_lanes(&lanes);
        }
    }
    Ok(())
}

fn check(w: &QMatrix<'_>, x: &SplitActs, y_len: usize) -> Result<()> {
    if !supports(w.format()) {
        return Err(Error::invalid(
            "int8x3 matmul",
            format!("{} weights have no split-int8 form", w.format()),
        ));
    }
    if x.cols != w.cols() || x.rows.checked_mul(w.rows()) != Some(y_len) {
        return Err(Error::invalid(
            "int8x3 matmul",
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

/// `y = x · Wᵀ` by the split-int8 arithmetic: the VNNI kernel where the CPU has it, else the
/// reference (the same bits). `pool` parallelises over weight rows; the result depends on
/// neither the pool nor its threads.
pub fn matmul(
    w: &QMatrix<'_>,
    x: &SplitActs,
    y: &mut [f32],
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    check(w, x, y.len())?;
    let (o, s) = (w.rows(), x.rows);
    if o == 0 || s == 0 {
        return Ok(());
    }
    if !available() {
        return reference_matmul(w, x, y);
    }
    let out = OutColumns::new(y, s, o);
    let row_bytes = w.format().row_bytes(w.cols());
    par_weight_rows(o, row_bytes, pool, |o0, n| {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: `available` said the CPU has the kernel's features; `check` made the shapes
        // agree and the format one `supports` accepts; rows `o0..o0 + n` are in `w`, and no
        // other task writes their columns.
        unsafe {
            vnni::rows(w, o0, n, x, out)
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (o0, n, out);
    });
    Ok(())
}

#[cfg(test)]
mod tests;
