//! AVX2 int4 with the scale applied once per group, for the formats whose groups are whole
//! 32-element blocks (gs a multiple of 32, or one group per row; the docs/container.md
//! default gs64 among them). The tile driver's decode (`sources::Int4`) multiplies every
//! weight vector by its scale; on Zen 3 that multiply competes with the FMAs for the same two
//! pipes and bounded decode at a third of the memory bandwidth (docs/benchmarks.md, "AVX2
//! int4 by group"). Here each dot product is
//!
//! `y = Σ_g s_g · (Σ_{i∈g} n_i·x_i − 8·Σ_{i∈g} x_i)`, n_i the stored nibble (0..=15),
//!
//! which is the reference's `Σ (n_i − 8)·s_g·x_i` with the scale factored out of each group;
//! the nibbles are converted exactly (`vcvtdq2ps` of 0..15) and every product is formed
//! exactly inside an FMA. The result differs from the reference's f32 sum by rounding only
//! (the tests hold it to the same f64 tolerance as every path), and like every path its
//! order belongs to the format and I, never to S or the tiling.
//!
//! The activations come in [`super::XLayout::Int4Groups`]: per row, each 32-element block's
//! 16 even elements then its 16 odd ones (block bytes 0..8 widened to 8 lanes hold even
//! elements 0..8 in their low nibbles and odd elements 0..8 in their high ones), the last
//! block zero-padded, then one 8-lane vector per group, `−8 · Σ_v x_v` over the group's
//! vectors v in order ([`arrange`]). A dot product starts each group's first accumulator at
//! that vector, adds the block halves' low-nibble products into it and the high-nibble
//! products into a second, and adds their sum times the group's scale into a running total,
//! whose lanes are summed by `avx2::sum_lanes`.

use std::arch::x86_64::*;
use std::ptr;

use super::avx2::sum_lanes;
use crate::quant::format::{QMatrix, QuantFormat};

/// Elements per block: 16 bytes of packed nibbles.
const BLOCK: usize = 32;
/// f32 lanes per vector.
const L: usize = 8;
/// How far ahead of the block being decoded each weight row is prefetched, in bytes (one
/// prefetch per 64-byte line). Without it the loads of a row wait on DRAM between bursts of
/// arithmetic: 2 threads streamed 7.6 GB/s against 11.7 with 4 KiB (Zen 3, docs/benchmarks.md).
const PREFETCH_BYTES: usize = 4096;

/// Elements per group of an int4 format this kernel takes (`None` for per-row: the whole row
/// is one group), or `Err(())` for a format it does not (gs 16 and 48 split a block, and the
/// other formats are not int4).
fn group_of(format: QuantFormat) -> Result<Option<usize>, ()> {
    match format {
        QuantFormat::Int4PerRow => Ok(None),
        QuantFormat::Int4Grouped { group_size } if group_size % BLOCK == 0 => Ok(Some(group_size)),
        _ => Err(()),
    }
}

/// Whether this kernel computes matrices of `format` on the AVX2 path.
pub(super) fn takes(format: QuantFormat) -> bool {
    group_of(format).is_ok()
}

/// The geometry of one activation row in the layout, for rows of `cols` elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Shape {
    /// Columns (I).
    cols: usize,
    /// Blocks per row, the last one possibly partial.
    blocks: usize,
    /// Blocks per group (the last group may have fewer).
    group_blocks: usize,
    /// Groups per row (= scales per row).
    groups: usize,
}

impl Shape {
    /// The shape for `format` (one this kernel [`takes`]) and rows of `cols` elements.
    pub(super) fn of(format: QuantFormat, cols: usize) -> Shape {
        let blocks = cols.div_ceil(BLOCK);
        let group_blocks = match group_of(format) {
            Ok(Some(gs)) => gs / BLOCK,
            _ => blocks.max(1),
        };
        Shape {
            cols,
            blocks,
            group_blocks,
            groups: blocks.div_ceil(group_blocks),
        }
    }

    /// Floats of the rearranged elements of a row (then the group sums).
    fn sums_at(self) -> usize {
        self.blocks * BLOCK
    }

    /// Floats per activation row in the layout: the blocks, then the group sums, padded to
    /// whole 64-byte lines (16 floats).
    pub(super) fn row_floats(self) -> usize {
        self.sums_at() + self.groups.next_multiple_of(2) * L
    }

    /// Blocks of a row that are whole (16 bytes in the row).
    fn whole_blocks(self) -> usize {
        self.cols / BLOCK
    }
}

/// `x` ([s, n] row-major) into `out` ([s, shape.row_floats()], zero-filled by the caller) in
/// this kernel's layout (the module docs).
pub(super) fn arrange(x: &[f32], s: usize, shape: Shape, out: &mut [f32]) {
    let (n, width) = (shape.cols, shape.row_floats());
    debug_assert_eq!(out.len(), s * width);
    if width == 0 {
        return; // no columns
    }
    for (src, dst) in x
        .chunks_exact(n.max(1))
        .zip(out.chunks_exact_mut(width))
        .take(s)
    {
        let (blocks, sums) = dst.split_at_mut(shape.sums_at());
        for (b, blk) in blocks.chunks_exact_mut(BLOCK).enumerate() {
            let base = BLOCK * b;
            for i in 0..BLOCK / 2 {
                blk[i] = src.get(base + 2 * i).copied().unwrap_or(0.0);
                blk[BLOCK / 2 + i] = src.get(base + 2 * i + 1).copied().unwrap_or(0.0);
            }
        }
        let per_group = shape.group_blocks * BLOCK;
        for (g, sum) in sums.chunks_exact_mut(L).take(shape.groups).enumerate() {
            let group = &blocks[g * per_group..((g + 1) * per_group).min(blocks.len())];
            for v in group.chunks_exact(L) {
                for (acc, xv) in sum.iter_mut().zip(v) {
                    *acc += xv;
                }
            }
            // ×8 is exact.
            for acc in sum.iter_mut() {
                *acc *= -8.0;
            }
        }
    }
}

/// One weight row: its packed nibbles, its scales, and its last block's bytes padded to 16.
#[derive(Clone, Copy)]
struct Row {
    data: *const u8,
    scales: *const f32,
    tail: [u8; 16],
}

impl Row {
    /// Row `o` of `w` (`o < w.rows()`; `shape` is `w`'s).
    #[inline(always)]
    fn of(w: &QMatrix<'_>, o: usize, shape: Shape) -> Row {
        let data = w.row_data(o);
        let mut tail = [0u8; 16];
        let whole = shape.whole_blocks() * 16;
        // The partial block's bytes; the nibbles past the row meet zero activations.
        let rest = &data[whole.min(data.len())..];
        tail[..rest.len().min(16)].copy_from_slice(&rest[..rest.len().min(16)]);
        Row {
            data: data.as_ptr(),
            scales: w.row_scales(o).as_ptr(),
            tail,
        }
    }

    /// The 16 bytes of block `b`.
    #[inline(always)]
    fn block(&self, b: usize, whole: usize) -> *const u8 {
        if b < whole {
            self.data.wrapping_add(16 * b)
        } else {
            self.tail.as_ptr()
        }
    }
}

/// Bytes `8h .. 8h + 8` of a block → (low nibbles, high nibbles) as f32 lanes.
#[inline(always)]
unsafe fn nibbles(p: *const u8, h: usize) -> (__m256, __m256) {
    // SAFETY: the caller's: AVX2, and 16 readable bytes at `p`.
    unsafe {
        let d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p.add(8 * h) as *const __m128i));
        let lo = _mm256_and_si256(d, _mm256_set1_epi32(0xF));
        let hi = _mm256_srli_epi32::<4>(d);
        (_mm256_cvtepi32_ps(lo), _mm256_cvtepi32_ps(hi))
    }
}

/// Dot products of `NW` weight rows with `T` activation rows (`x[t]` at the start of row t in
/// the layout), each in the order of the module docs.
#[inline(always)]
unsafe fn dot_tile<const NW: usize, const T: usize>(
    w: &[Row; NW],
    x: [*const f32; T],
    shape: Shape,
) -> [[f32; T]; NW] {
    // SAFETY: the caller's: AVX2 + FMA; each `x[t]` holds a row of `shape.row_floats()`
    // floats and each row's data and scales span a whole weight row of `shape`.
    unsafe {
        let whole = shape.whole_blocks();
        let mut tot = [[_mm256_setzero_ps(); T]; NW];
        let mut b = 0;
        for g in 0..shape.groups {
            let end = (b + shape.group_blocks).min(shape.blocks);
            let mut acc = [[[_mm256_setzero_ps(); 2]; T]; NW];
            for t in 0..T {
                let sum = _mm256_loadu_ps(x[t].add(shape.sums_at() + g * L));
                for a in acc.iter_mut() {
                    a[t][0] = sum;
                }
            }
            while b < end {
                let mut p = [ptr::null(); NW];
                for k in 0..NW {
                    p[k] = w[k].block(b, whole);
                    if b % 4 == 0 {
                        // `wrapping_add`: the address may lie past the row; a prefetch never
                        // faults.
                        let ahead = w[k].data.wrapping_add(16 * b + PREFETCH_BYTES);
                        _mm_prefetch::<_MM_HINT_T0>(ahead as *const i8);
                    }
                }
                for h in 0..2 {
                    let mut q = [(_mm256_setzero_ps(), _mm256_setzero_ps()); NW];
                    for k in 0..NW {
                        q[k] = nibbles(p[k], h);
                    }
                    for t in 0..T {
                        let xe = _mm256_loadu_ps(x[t].add(BLOCK * b + L * h));
                        let xo = _mm256_loadu_ps(x[t].add(BLOCK * b + BLOCK / 2 + L * h));
                        for k in 0..NW {
                            acc[k][t][0] = _mm256_fmadd_ps(q[k].0, xe, acc[k][t][0]);
                            acc[k][t][1] = _mm256_fmadd_ps(q[k].1, xo, acc[k][t][1]);
                        }
                    }
                }
                b += 1;
            }
            for k in 0..NW {
                let s = _mm256_broadcast_ss(&*w[k].scales.add(g));
                for t in 0..T {
                    let group = _mm256_add_ps(acc[k][t][0], acc[k][t][1]);
                    tot[k][t] = _mm256_fmadd_ps(group, s, tot[k][t]);
                }
            }
        }
        let mut y = [[0.0f32; T]; NW];
        for k in 0..NW {
            for t in 0..T {
                y[k][t] = sum_lanes(tot[k][t]);
            }
        }
        y
    }
}

/// Activation rows `t0..t0 + T` (row t at `x + t·stride`) against `NW` weight rows, into
/// `out[k][t]` (`out[k]` points at the s results of weight row k).
#[inline(always)]
unsafe fn tile<const NW: usize, const T: usize>(
    w: &[Row; NW],
    x: *const f32,
    stride: usize,
    t0: usize,
    shape: Shape,
    out: [*mut f32; NW],
) {
    // SAFETY: forwarded: rows t0..t0+T exist in `x` and in each `out[k]`.
    unsafe {
        // (No closures here: they would be compiled without the entry point's features.)
        let mut xs = [x; T];
        for (i, p) in xs.iter_mut().enumerate() {
            *p = x.add((t0 + i) * stride);
        }
        let y = dot_tile::<NW, T>(w, xs, shape);
        for k in 0..NW {
            for (i, v) in y[k].iter().enumerate() {
                *out[k].add(t0 + i) = *v;
            }
        }
    }
}

/// All `s` activation rows against `NW` weight rows: tiles of `TM` rows, then the rest.
#[inline(always)]
unsafe fn all_rows<const NW: usize, const TM: usize>(
    w: &[Row; NW],
    x: *const f32,
    stride: usize,
    s: usize,
    shape: Shape,
    out: [*mut f32; NW],
) {
    // SAFETY: forwarded.
    unsafe {
        let mut t0 = 0;
        while s - t0 >= TM {
            tile::<NW, TM>(w, x, stride, t0, shape, out);
            t0 += TM;
        }
        match s - t0 {
            0 => {}
            1 => tile::<NW, 1>(w, x, stride, t0, shape, out),
            _ => tile::<NW, 2>(w, x, stride, t0, shape, out),
        }
    }
}

/// `out[i·s + t] = W[o0 + i] · x_t` for the rows `o0..o0 + out.len()/s`. One activation row:
/// two weight rows per pass (four accumulator chains, enough to hide the FMA latency); more:
/// one weight row against tiles of three (nine accumulators, the most the 16 registers hold).
///
/// # Safety
/// The CPU has AVX2 and FMA; `w`'s format is one this kernel [`takes`]; `s > 0`, `x` holds
/// `s` rows in this kernel's layout for `w`'s shape; `out.len()` is a multiple of s and
/// `o0 + out.len()/s <= w.rows()`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows(w: &QMatrix<'_>, o0: usize, x: &[f32], s: usize, out: &mut [f32]) {
    let shape = Shape::of(w.format(), w.cols());
    let (xp, stride) = (x.as_ptr(), shape.row_floats());
    debug_assert!(x.len() >= s * stride);
    let n = out.len() / s;
    let y = out.as_mut_ptr();
    // SAFETY: the caller's contract; rows o0..o0+n exist, out holds [n, s].
    unsafe {
        let mut i = 0;
        if s == 1 {
            while i + 2 <= n {
                let pair = [Row::of(w, o0 + i, shape), Row::of(w, o0 + i + 1, shape)];
                all_rows::<2, 1>(&pair, xp, stride, s, shape, [y.add(i), y.add(i + 1)]);
                i += 2;
            }
        }
        while i < n {
            let one = [Row::of(w, o0 + i, shape)];
            all_rows::<1, 3>(&one, xp, stride, s, shape, [y.add(i * s)]);
            i += 1;
        }
    }
}

/// [`rows`] for two matrices of one shape and format (gate and up), a row of each per pass,
/// sharing the activation loads.
///
/// # Safety
/// As [`rows`], for `a` and `b` alike (same shape and format); `out_a` and `out_b` have the
/// same length.
#[target_feature(enable = "avx2,fma")]
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
    debug_assert_eq!(a.format(), b.format());
    let shape = Shape::of(a.format(), a.cols());
    let (xp, stride) = (x.as_ptr(), shape.row_floats());
    debug_assert!(x.len() >= s * stride);
    let n = out_a.len() / s;
    let (ya, yb) = (out_a.as_mut_ptr(), out_b.as_mut_ptr());
    // SAFETY: the caller's contract, for both matrices.
    unsafe {
        for i in 0..n {
            let pair = [Row::of(a, o0 + i, shape), Row::of(b, o0 + i, shape)];
            all_rows::<2, 1>(&pair, xp, stride, s, shape, [ya.add(i * s), yb.add(i * s)]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shapes_cover_every_group_and_pad_to_lines() {
        let g64 = QuantFormat::Int4Grouped { group_size: 64 };
        let s = Shape::of(g64, 6144);
        assert_eq!((s.blocks, s.group_blocks, s.groups), (192, 2, 96));
        assert_eq!(s.row_floats(), 6144 + 96 * 8);
        // 100 columns: blocks 0..4 (the last partial), groups [0, 64) and [64, 100).
        let s = Shape::of(g64, 100);
        assert_eq!((s.blocks, s.whole_blocks(), s.groups), (4, 3, 2));
        assert_eq!(s.row_floats() % 16, 0);
        let s = Shape::of(QuantFormat::Int4PerRow, 70);
        assert_eq!((s.blocks, s.group_blocks, s.groups), (3, 3, 1));
        assert_eq!(s.row_floats(), 96 + 16);
        assert!(!takes(QuantFormat::Int4Grouped { group_size: 48 }));
        assert!(!takes(QuantFormat::Int8PerRow));
        assert!(takes(QuantFormat::Int4Grouped { group_size: 96 }));
    }

    #[test]
    fn arrange_splits_blocks_and_sums_each_group() {
        let g32 = QuantFormat::Int4Grouped { group_size: 32 };
        let shape = Shape::of(g32, 40);
        let x: Vec<f32> = (0..40).map(|i| i as f32).collect();
        let mut out = vec![0.0; shape.row_floats()];
        arrange(&x, 1, shape, &mut out);
        // Block 0: evens then odds.
        assert_eq!(out[0], 0.0);
        assert_eq!(out[1], 2.0);
        assert_eq!(out[16], 1.0);
        assert_eq!(out[31], 31.0);
        // Block 1: elements 32..40, zero-padded.
        assert_eq!(out[32..37], [32.0, 34.0, 36.0, 38.0, 0.0]);
        assert_eq!(out[48..53], [33.0, 35.0, 37.0, 39.0, 0.0]);
        // Group sums: lane l of group 0 sums block 0's vectors l, 8 + l, 16 + l, 24 + l.
        let sums = &out[64..80];
        let lane0 = 0.0 + 16.0 + 1.0 + 17.0;
        assert_eq!(sums[0], -8.0 * lane0);
        assert_eq!(sums[8], -8.0 * (32.0 + 33.0));
        assert_eq!(sums[8 + 4], 0.0);
    }
}
