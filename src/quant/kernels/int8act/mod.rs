//! The fast prefill arithmetic: `Y[S×O] ≈ X[S×I] · Wᵀ` with the activations rounded to int8
//! per block of 64 elements and each block's products summed as integers (AVX-512 VNNI
//! `vpdpbusd`), as llama.cpp's Q8 activations against Q4 weights do. **Not exact**: the
//! activations lose their low bits (≈ 0.4% of a block's largest magnitude). The engine uses it
//! only where exactness is not promised — prefill forwards of at least
//! [`PREFILL_MIN_ROWS`] rows when the `prefill` option allows it (docs/architecture.md,
//! "Prefill arithmetic"); decode and verify rows always run the exact kernels, so speculation
//! stays lossless.
//!
//! The arithmetic, which the scalar reference ([`reference_matmul`]) and the VNNI path
//! (`vnni.rs`) compute bit for bit:
//! - **activations** ([`QuantizedActs::new`]): per row and block b of 64 elements,
//!   `m = max|x|`, `xq = round_half_even(x · (127 / m))` as i8 and `sx_b = m / 127` (a block
//!   of zeros: `xq = 0`, `sx_b = 0`);
//! - **weights** as unsigned bytes `u = q + o` (int4: the stored nibble, o = 8; int8: o = 128),
//!   so that `d_b = Σ u·xq − o·Σ xq = Σ q·xq` is the block's exact integer dot product;
//! - **scales**: `sw_b`, the scale of the weight group holding block b (group sizes that are
//!   multiples of 64) or of the row (per-row int4 and int8);
//! - **sum**: block b goes to lane `b mod 16`:
//!   `lane = fma(d_b as f32, sw_b · sx_b, lane)` over the blocks in order, then the 16 lanes by
//!   [`sum_lanes`]' fixed tree.
//!
//! Formats with other group sizes, and float weights, have no int8 form: [`supports`] says so
//! and the caller runs the exact kernel for them.

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2;
#[cfg(target_arch = "x86_64")]
mod decode;
#[cfg(target_arch = "x86_64")]
mod decode_acts;
#[cfg(target_arch = "x86_64")]
pub use decode_acts::DecodeActs;
#[cfg(target_arch = "x86_64")]
mod decode_avx2;
#[cfg(target_arch = "x86_64")]
pub(super) mod vnni;

mod matmul;
mod reference;
#[cfg(target_arch = "x86_64")]
mod tiles;

use rayon::prelude::*;

use crate::quant::format::{QMatrix, QuantFormat};

pub use matmul::matmul_quantized;
#[cfg(target_arch = "x86_64")]
pub use matmul::{matmul_decode, matmuls_decode, DecodeJob};
pub use reference::reference_matmul;
#[cfg(target_arch = "x86_64")]
use tiles::{tile_rows, TileRows, Tiles};

/// Prefill forwards of fewer rows than this run the exact kernels whatever the option says:
/// decode steps and verify forwards (at most 1 + the deepest draft, 9 rows) stay below it.
pub const PREFILL_MIN_ROWS: usize = 16;

/// Int8 calls of at most this many activation rows run a decode kernel (`decode.rs` where the
/// VNNI kernel is the active one, `decode_avx2.rs` where AVX2 is); longer calls run the
/// prefill tiles. Either gives the
/// same values, so this only decides speed (`cargo bench --bench main -- 'kernels/.*int8'`).
pub const DECODE_MAX_ROWS: usize = 9;

/// Elements per activation block (one scale each), and per lane of a `vpdpbusd` chunk.
pub const BLOCK: usize = 64;
/// Blocks per chunk: one per 32-bit lane of a 512-bit vector.
const LANES: usize = 16;

/// 64 bytes in one cache line: the lane layouts are built of these, so no vector load splits
/// a line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line(pub [u8; 64]);

// SAFETY: 64 bytes, alignment 64: no padding, every bit pattern valid.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; it is `Copy` and `repr(C)`.
unsafe impl bytemuck::Pod for Line {}

/// Whether `format` has an int8-activation form (the weights' scales are constant over each
/// 64-element block).
pub fn supports(format: QuantFormat) -> bool {
    match format {
        QuantFormat::Int8PerRow | QuantFormat::Int4PerRow => true,
        QuantFormat::Int4Grouped { group_size } => group_size % BLOCK == 0,
        QuantFormat::F32 | QuantFormat::Bf16 | QuantFormat::F16 => false,
    }
}

/// The code that computes the int8 arithmetic: every one gives the reference's bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Kernel {
    /// [`reference_matmul`]'s scalar loops: correct everywhere, far slower than the exact
    /// kernels.
    Reference,
    /// AVX2 `vpmaddubsw` (`avx2.rs`, and `decode_avx2.rs` for decode-sized calls): x86-64
    /// CPUs without AVX-512 VNNI.
    Avx2,
    /// AVX-512 VNNI `vpdpbusd` (`vnni.rs`).
    Vnni,
}

impl Int8Kernel {
    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        let f = crate::cpu::features();
        let x86 = cfg!(target_arch = "x86_64");
        match self {
            Int8Kernel::Reference => true,
            Int8Kernel::Avx2 => x86 && f.avx2 && f.fma,
            Int8Kernel::Vnni => x86 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni,
        }
    }

    /// The fastest kernel this CPU runs.
    pub fn best() -> Int8Kernel {
        [Int8Kernel::Vnni, Int8Kernel::Avx2]
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Int8Kernel::Reference)
    }

    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Int8Kernel::Reference => "reference",
            Int8Kernel::Avx2 => "avx2",
            Int8Kernel::Vnni => "avx512-vnni",
        }
    }
}

/// Whether this CPU runs a SIMD int8 kernel (AVX-512 VNNI or AVX2); elsewhere the int8
/// arithmetic runs as the scalar reference, correct but slow.
pub fn simd_available() -> bool {
    Int8Kernel::best() != Int8Kernel::Reference
}

/// `u = q + offset` for a format: the shift with `offset = 1 << shift`.
fn offset_shift(format: QuantFormat) -> u32 {
    match format {
        QuantFormat::Int8PerRow => 7,
        _ => 3,
    }
}

/// Chunks of 16 blocks for `cols` columns.
fn chunks_for(cols: usize) -> usize {
    cols.div_ceil(BLOCK).div_ceil(LANES).max(1)
}

/// Activation rows quantised to int8 per 64-element block, laid out for `vpdpbusd`: row r's
/// chunk c is 16 lines; line k holds, in 32-bit lane j, elements `4k..4k+4` of block
/// `16c + j`.
pub struct QuantizedActs {
    rows: usize,
    cols: usize,
    chunks: usize,
    /// [rows][chunks · 16] lines of i8 (as bytes).
    q: Vec<Line>,
    /// [rows][chunks · 16]: `sx_b` (0 past the last block).
    scales: Vec<f32>,
    /// [rows][chunks · 16]: `Σ xq` of each block (0 past the last block).
    sums: Vec<i32>,
}

impl QuantizedActs {
    /// Quantise `x` ([rows, cols] row-major), rows in parallel on `pool` when given (each
    /// row's values do not depend on how rows are split).
    pub fn new(x: &[f32], rows: usize, cols: usize, pool: Option<&rayon::ThreadPool>) -> Self {
        Self::new_on(x, rows, cols, pool, Int8Kernel::best())
    }

    /// [`QuantizedActs::new`] by `kernel`'s quantiser (which must be available): every one
    /// gives the same bytes, scales and sums for finite `x`.
    fn new_on(
        x: &[f32],
        rows: usize,
        cols: usize,
        pool: Option<&rayon::ThreadPool>,
        kernel: Int8Kernel,
    ) -> Self {
        let chunks = chunks_for(cols);
        let blocks = chunks * LANES;
        let mut q = vec![Line([0; 64]); rows * blocks];
        let mut scales = vec![0.0f32; rows * blocks];
        let mut sums = vec![0i32; rows * blocks];
        let one_row =
            |r: usize, (lines, (scales, sums)): (&mut [Line], (&mut [f32], &mut [i32]))| {
                let src = &x[r * cols..(r + 1) * cols];
                #[cfg(target_arch = "x86_64")]
                match kernel {
                    // SAFETY (both): the caller says the CPU runs `kernel`; the row's lines,
                    // scales and sums are `blocks` long.
                    Int8Kernel::Vnni => {
                        return unsafe { vnni::quantize_row(src, lines, scales, sums) };
                    }
                    Int8Kernel::Avx2 => {
                        return unsafe { avx2::quantize_row(src, lines, scales, sums) };
                    }
                    Int8Kernel::Reference => {}
                }
                let _ = kernel;
                let mut xq = [0i8; BLOCK];
                for (b, src) in src.chunks(BLOCK).enumerate() {
                    let (scale, sum) = quantize_block(src, &mut xq);
                    scales[b] = scale;
                    sums[b] = sum;
                    let (c, j) = (b / LANES, b % LANES);
                    for k in 0..BLOCK / 4 {
                        let dst = &mut lines[c * LANES + k].0[4 * j..4 * j + 4];
                        for (d, v) in dst.iter_mut().zip(&xq[4 * k..4 * k + 4]) {
                            *d = *v as u8;
                        }
                    }
                }
            };
        if cols > 0 {
            match pool {
                Some(pool) if rows > 1 => pool.install(|| {
                    q.par_chunks_mut(blocks)
                        .zip(
                            scales
                                .par_chunks_mut(blocks)
                                .zip(sums.par_chunks_mut(blocks)),
                        )
                        .enumerate()
                        .for_each(|(r, row)| one_row(r, row))
                }),
                _ => q
                    .chunks_mut(blocks)
                    .zip(scales.chunks_mut(blocks).zip(sums.chunks_mut(blocks)))
                    .enumerate()
                    .for_each(|(r, row)| one_row(r, row)),
            }
        }
        QuantizedActs {
            rows,
            cols,
            chunks,
            q,
            scales,
            sums,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Block b of row r as i8, in element order (zeros past the end of the row).
    fn block(&self, r: usize, b: usize) -> [i8; BLOCK] {
        let blocks = self.chunks * LANES;
        let (c, j) = (b / LANES, b % LANES);
        let mut out = [0i8; BLOCK];
        for k in 0..BLOCK / 4 {
            let line = &self.q[r * blocks + c * LANES + k].0;
            for e in 0..4 {
                out[4 * k + e] = line[4 * j + e] as i8;
            }
        }
        out
    }
}

/// 1.5 · 2^23: see `quantize_block`.
const ROUNDER: f32 = 12_582_912.0;

/// One block: `xq` (zero-padded past `src`), and its scale and integer sum.
fn quantize_block(src: &[f32], xq: &mut [i8; BLOCK]) -> (f32, i32) {
    let m = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    xq.fill(0);
    if m == 0.0 || !m.is_finite() {
        // A NaN or Inf activation is the forward's own error to report; quantise it to zeros
        // rather than to garbage.
        return (0.0, 0);
    }
    let inv = 127.0 / m;
    let mut sum = 0i32;
    for (d, v) in xq.iter_mut().zip(src) {
        // Round half to even by the f32 adder: |v · inv| ≤ 127 (plus a rounding), far below
        // 2^22, where adding and removing 1.5 · 2^23 leaves the nearest integer, ties to even
        // (`round_ties_even` is a libm call on baseline x86-64: 10% of an int8 prefill).
        let r = ((v * inv + ROUNDER) - ROUNDER).clamp(-127.0, 127.0);
        *d = r as i8;
        sum += r as i32;
    }
    (m / 127.0, sum)
}

/// The 16 lanes summed by the fixed tree both paths use: halves added lane-wise (8, 4, 2, 1).
#[inline]
pub(super) fn sum_lanes(l: &[f32; LANES]) -> f32 {
    let mut v = *l;
    let mut n = LANES / 2;
    while n > 0 {
        for i in 0..n {
            v[i] += v[i + n];
        }
        n /= 2;
    }
    v[0]
}

/// The weight scale of each block of row `o`, [chunks · 16] (0 past the last block).
pub(super) fn block_scales(w: &QMatrix<'_>, o: usize, out: &mut [f32]) {
    let scales = w.row_scales(o);
    let blocks = w.cols().div_ceil(BLOCK);
    for (b, s) in out.iter_mut().enumerate() {
        *s = if b >= blocks {
            0.0
        } else {
            match w.format() {
                QuantFormat::Int4Grouped { group_size } => scales[b * BLOCK / group_size],
                _ => scales[0],
            }
        };
    }
}

/// The output `y` ([S, O] row-major) as the tasks of one call write it: each task its own
/// columns (weight rows), straight into place.
#[derive(Clone, Copy)]
pub(super) struct OutColumns {
    ptr: *mut f32,
    s: usize,
    o: usize,
}

// SAFETY: the pointer is to the caller's `y`, borrowed mutably for the whole call; tasks
// write disjoint columns (`set`'s contract) and nothing reads `y` until they have joined.
unsafe impl Send for OutColumns {}
// SAFETY: as above.
unsafe impl Sync for OutColumns {}

impl OutColumns {
    /// `y[t, col] = v`.
    ///
    /// # Safety
    /// `t < S`, `col < O`, and no other task of the call writes column `col`.
    #[inline(always)]
    pub(super) unsafe fn set(&self, t: usize, col: usize, v: f32) {
        debug_assert!(t < self.s && col < self.o);
        // SAFETY: in bounds by the contract (`y` holds S·O floats).
        unsafe { *self.ptr.add(t * self.o + col) = v };
    }

    /// Where `y[t, col]` is: columns `col..` of row t follow it.
    ///
    /// # Safety
    /// `t < S` and `col < O`; writes through it keep to row t's columns this task owns.
    #[cfg(target_arch = "x86_64")]
    #[inline(always)]
    pub(super) unsafe fn row_ptr(&self, t: usize, col: usize) -> *mut f32 {
        debug_assert!(t < self.s && col < self.o);
        // SAFETY: in bounds by the contract.
        unsafe { self.ptr.add(t * self.o + col) }
    }
}

#[cfg(test)]
mod tests;
