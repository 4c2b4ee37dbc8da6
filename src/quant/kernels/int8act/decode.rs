//! The int8 arithmetic for decode-sized calls (one to a few activation rows: decode steps,
//! verifies, batch lanes) on AVX-512 VNNI. It computes what the parent module defines, bit for
//! bit: each block's exact integer `Σ q·xq`, scaled and added into lane `b mod 16` in block
//! order, then [`super::sum_lanes`]. Only the data layout differs from the prefill tiles
//! (`vnni.rs`), because here a weight row serves one row of activations, not many:
//!
//! - the **weights are not transposed to the lanes**. The prefill tiles transpose every
//!   weight row into the activations' lane layout (64 shuffles per 16 blocks), which pays
//!   when 64 activation rows share it and costs a decode step more than the bytes do. Here an
//!   int4 chunk's 512 bytes are only permuted by qwords (16 permutes) and split into low and
//!   high nibbles, an int8 row's block is loaded as it is;
//! - the **activations are laid out to match** (built once per call, [`DecodeActs`]): for
//!   int4 weights, whose chunks of 16 blocks the kernel transposes by qwords (each vector
//!   then holds one qword, 16 elements, of 8 blocks), line 8g + 2j + e of a chunk holds in
//!   qword i block 8g + i's elements 16j + 2k + e (e = 0: the even ones, which the low
//!   nibbles meet); for int8 weights, the blocks in element order;
//! - each int4 `vpdpbusd` then adds to 2 lanes per block of one accumulator per 8 blocks, and
//!   2 permutes per chunk and activation row bring each block's sum into lane `b mod 16`,
//!   where the prefill tiles' transpose put it (the transpose, 16 permutes per chunk, is
//!   shared by every activation row); an int8 `vpdpbusd` leaves 16 partial sums of a block,
//!   which a reduction tree (14 shuffles per 16 blocks and activation row) brings there.
//!
//! Integer sums are exact in any order, and the f32 steps are the reference's, so the result
//! is the reference's and the prefill tiles' for every row: a row's value never depends on
//! the call it is in (row invariance, docs/architecture.md "Decode arithmetic").

use std::arch::x86_64::*;

use super::decode_acts::DecodeActs;
use super::vnni::{load_bytes, sum_lanes16, sum_lanes16_index};
use super::{block_scales, offset_shift, OutColumns, BLOCK, LANES};
use crate::quant::format::{QMatrix, QuantFormat};

/// `y[t, o0 + i] ≈ W[o0 + i] · x_t` by the int8 arithmetic for `i < n` and every row t of `x`.
///
/// # Safety
/// The CPU has the features enabled here; `x.cols == w.cols()`, `x` was laid out for `w`'s
/// format (one [`supports`](super::supports) accepts), `o0 + n <= w.rows()`, `out` is
/// [x.rows, w.rows()], and no other task writes its columns `o0..o0 + n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn rows(w: &QMatrix<'_>, o0: usize, n: usize, x: &DecodeActs, out: OutColumns) {
    debug_assert_eq!(x.int8, w.format() == QuantFormat::Int8PerRow);
    let shift = offset_shift(w.format());
    let rb = w.format().row_bytes(w.cols());
    if let Some(packed) = x.packed() {
        if let Some(scales) = PackedScales::of(w.format()) {
            // SAFETY: the caller's contract; `packed` is `x`'s rows tiled for `w`'s format.
            return unsafe { rows_packed(w, o0, n, x.cols / BLOCK, packed, scales, out) };
        }
    }
    // Block scales of formats whose stored scales are not one per block (groups of 128 and
    // more): zero past the last block, and only the first `blocks` change from row to row.
    let mut ws = match w.format() {
        QuantFormat::Int4Grouped { group_size: BLOCK }
        | QuantFormat::Int4PerRow
        | QuantFormat::Int8PerRow => Vec::new(),
        _ => vec![0.0f32; x.chunks * LANES],
    };
    // lanes[t][i]: activation row t's 16 lane sums against weight row g + i of the group,
    // summed 16 at once by `sum_lanes16` (one scalar tree per output cost more than a
    // hidden-256 row's products).
    // (On the stack for calls of up to DECODE_MAX_ROWS rows: a task's allocation cost as much
    // as a narrow row's products.)
    let (mut on_stack, mut on_heap);
    let lanes: &mut [[__m512; LANES]] = if x.rows <= super::DECODE_MAX_ROWS {
        on_stack = [[_mm512_setzero_ps(); LANES]; super::DECODE_MAX_ROWS];
        &mut on_stack[..x.rows]
    } else {
        on_heap = vec![[_mm512_setzero_ps(); LANES]; x.rows];
        &mut on_heap
    };
    // The tree leaves weight row i's sum in lane `sum_lanes16_index(i)`: this gathers them
    // back into order.
    let order: [i32; LANES] = std::array::from_fn(|i| sum_lanes16_index(i) as i32);
    // SAFETY: AVX-512 F is enabled here; 16 values.
    let order = unsafe { _mm512_loadu_si512(order.as_ptr().cast()) };
    let mut g = o0;
    while g < o0 + n {
        let count = (o0 + n - g).min(LANES);
        for i in 0..count {
            let o = g + i;
            let scales = w.row_scales(o);
            let ws = match w.format() {
                // Read where they are stored: a copy would cost a store-forwarding stall per row.
                QuantFormat::Int4Grouped { group_size: BLOCK } => RowScales::PerBlock(scales),
                QuantFormat::Int4PerRow | QuantFormat::Int8PerRow => RowScales::PerRow(scales[0]),
                _ => {
                    block_scales(w, o, &mut ws);
                    RowScales::PerBlock(&ws)
                }
            };
            prefetch_ahead(w.data(), o * rb, rb);
            let data = w.row_data(o);
            let mut t0 = 0;
            while t0 < x.rows {
                // SAFETY: the features are enabled here; `t0 < x.rows`.
                let (na, v) = unsafe { tile_of_rows(data, ws, x, t0, shift) };
                for (l, v) in lanes[t0..t0 + na].iter_mut().zip(v) {
                    l[i] = v;
                }
                t0 += na;
            }
        }
        let mask: u16 = if count == LANES {
            u16::MAX
        } else {
            (1u16 << count) - 1
        };
        for (t, l) in lanes.iter().enumerate() {
            // SAFETY: the features are enabled here; the caller's contract for `out`: the
            // `count` columns g.. of row t are this task's and in bounds (masked store).
            unsafe {
                let sums = _mm512_permutexvar_ps(order, sum_lanes16(*l));
                _mm512_mask_storeu_ps(out.row_ptr(t, g), mask, sums);
            }
        }
        g += count;
    }
}

/// How far ahead of the weight row being read its matrix is prefetched (into L1), from
/// paired runs of `verify_rows` on the side-by-side model (Xeon with AMX, 2 threads, host
/// busy): 2 KiB ahead took 1-row and 8-row forwards 3–9% and 10–12% below the same kernel
/// without it; 1 KiB about the same, 8 and 16 KiB (the exact kernels' distance, `avx512.rs`)
/// and `prefetcht1` less. Two threads read their own runs of rows; the hardware prefetchers
/// stop at each 4 KiB page and restart at each task.
const PREFETCH_BYTES: usize = 2048;

/// Prefetch (into L1) the lines of `data` [`PREFETCH_BYTES`] past `start..start + len`, those
/// inside `data`.
#[inline(always)]
fn prefetch_ahead(data: &[u8], start: usize, len: usize) {
    let end = (start + len + PREFETCH_BYTES).min(data.len());
    let mut at = start + PREFETCH_BYTES;
    while at < end {
        // SAFETY: `at < data.len()`; a prefetch reads nothing architecturally; SSE is part of
        // x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(data.as_ptr().add(at).cast()) };
        at += 64;
    }
}

/// How a packed chunk's weight scales are stored.
#[derive(Clone, Copy)]
enum PackedScales {
    /// One per block (int4 in groups of 64): a packed chunk's 16 are contiguous.
    PerBlock,
    /// One per row (per-row int4 and int8): each serves its row's nb blocks.
    PerRow,
}

impl PackedScales {
    fn of(format: QuantFormat) -> Option<PackedScales> {
        match format {
            QuantFormat::Int4Grouped { group_size: BLOCK } => Some(PackedScales::PerBlock),
            QuantFormat::Int4PerRow | QuantFormat::Int8PerRow => Some(PackedScales::PerRow),
            _ => None,
        }
    }
}

/// [`rows`] for weight rows of `nb` whole blocks (nb = 1, 2, 4, 8), 16 / nb of them per
/// 16-block chunk against `packed` (each activation row repeated 16 / nb times): block b of
/// row r of the chunk lands in lane `r · nb + b`, as block b of that row alone lands in lane
/// b. The reference sums lanes by halves (8, 4, 2, 1); lanes nb and up of a lone row hold +0
/// (an `fma` onto +0 never gives −0), so the steps of distance nb and more change nothing
/// and the steps nb / 2 … 1, done here inside each row's nb lanes, give its bits.
///
/// # Safety
/// As [`rows`], with `packed` built from `x` by [`DecodeActs::new`] and `nb = w.cols() / 64`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn rows_packed(
    w: &QMatrix<'_>,
    o0: usize,
    n: usize,
    nb: usize,
    packed: &DecodeActs,
    scales: PackedScales,
    out: OutColumns,
) {
    let shift = offset_shift(w.format());
    let per = LANES / nb;
    let rb = w.format().row_bytes(w.cols());
    let (data, stored) = (w.data(), w.scales());
    // Lane j of a packed chunk: block j mod nb of row j / nb.
    let row_of: [i32; LANES] = std::array::from_fn(|j| (j / nb) as i32);
    // The tree's steps inside a row: lane i + lane i + d for d = nb / 2 … 1.
    let step = |d: usize| -> [i32; LANES] { std::array::from_fn(|i| ((i + d) % LANES) as i32) };
    let mut steps = [[0i32; LANES]; 3];
    for (k, s) in steps.iter_mut().enumerate() {
        *s = step((nb >> (k + 1)).max(1));
    }
    let steps = &steps[..nb.trailing_zeros() as usize];
    // The lanes that hold a row's sum: 0, nb, 2nb, …
    let firsts: u16 = (0..per).fold(0, |m, r| m | 1 << (r * nb));
    let mut o = o0;
    while o < o0 + n {
        let count = (o0 + n - o).min(per);
        let blocks = count * nb;
        prefetch_ahead(data, o * rb, count * rb);
        let bytes = &data[o * rb..(o + count) * rb];
        let lane_mask: u16 = if blocks >= LANES {
            u16::MAX
        } else {
            (1u16 << blocks) - 1
        };
        // SAFETY: the features are enabled here; the loads read `count` stored scales (or
        // `blocks`) from row o on, which exist (`o + count <= w.rows()`).
        let ws = unsafe {
            match scales {
                PackedScales::PerBlock => RowScales::PerBlock(&stored[o * nb..(o + count) * nb]),
                PackedScales::PerRow => {
                    let row_mask: u16 = (1u32 << count).wrapping_sub(1) as u16;
                    let v = _mm512_maskz_loadu_ps(row_mask, stored.as_ptr().add(o));
                    let idx = _mm512_loadu_si512(row_of.as_ptr().cast());
                    RowScales::Lanes(_mm512_maskz_mov_ps(
                        lane_mask,
                        _mm512_permutexvar_ps(idx, v),
                    ))
                }
            }
        };
        let mut t0 = 0;
        while t0 < packed.rows {
            // SAFETY: the features are enabled here; `t0 < packed.rows`.
            let (na, v) = unsafe { tile_of_rows(bytes, ws, packed, t0, shift) };
            for (a, mut l) in v.into_iter().take(na).enumerate() {
                // SAFETY: the features are enabled here; `steps` hold 16 indices each; the
                // store writes `count` columns o.. of row t0 + a, which are this task's.
                unsafe {
                    for s in steps {
                        let idx = _mm512_loadu_si512(s.as_ptr().cast());
                        l = _mm512_add_ps(l, _mm512_permutexvar_ps(idx, l));
                    }
                    _mm512_mask_compressstoreu_ps(
                        out.row_ptr(t0 + a, o).cast(),
                        firsts & lane_mask,
                        l,
                    );
                }
            }
            t0 += na;
        }
        o += count;
    }
}

/// [`row_tile`] for the next up to 4 activation rows from `t0`: how many, and their lane
/// vectors (the first that many of the 4).
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `t0 < x.rows`.
#[inline(always)]
unsafe fn tile_of_rows(
    data: &[u8],
    ws: RowScales<'_>,
    x: &DecodeActs,
    t0: usize,
    shift: u32,
) -> (usize, [__m512; 4]) {
    let na = (x.rows - t0).min(4);
    // SAFETY: the caller's contract; `t0 + na <= x.rows`.
    unsafe {
        let mut v = [_mm512_setzero_ps(); 4];
        match na {
            4 => v = row_tile::<4>(data, ws, x, t0, shift),
            3 => v[..3].copy_from_slice(&row_tile::<3>(data, ws, x, t0, shift)),
            2 => v[..2].copy_from_slice(&row_tile::<2>(data, ws, x, t0, shift)),
            _ => v[..1].copy_from_slice(&row_tile::<1>(data, ws, x, t0, shift)),
        }
        (na, v)
    }
}

/// A weight row's scale for each of its blocks.
#[derive(Clone, Copy)]
enum RowScales<'a> {
    /// One per block (the blocks past the slice have none: 0).
    PerBlock(&'a [f32]),
    /// One for the whole row.
    PerRow(f32),
    /// A packed chunk's 16 scales, ready (`rows_packed`).
    Lanes(__m512),
}

impl RowScales<'_> {
    /// The scales of blocks `base..base + 16` (0 past the row's last block, as the reference's
    /// [`block_scales`] has them), for a row of `held` blocks.
    ///
    /// # Safety
    /// The CPU has AVX-512 F.
    #[inline(always)]
    unsafe fn chunk(self, base: usize, held: usize) -> __m512 {
        let mask = |n: usize| -> u16 {
            if n >= LANES {
                u16::MAX
            } else {
                (1u16 << n) - 1
            }
        };
        // SAFETY: AVX-512 F is enabled by the caller; the masked load reads only the
        // `len - base` values that exist (none when `base >= len`, when it reads nothing).
        unsafe {
            match self {
                RowScales::PerBlock(s) => {
                    let n = s.len().saturating_sub(base);
                    if n == 0 {
                        return _mm512_setzero_ps();
                    }
                    _mm512_maskz_loadu_ps(mask(n), s.as_ptr().add(base))
                }
                RowScales::PerRow(v) => {
                    _mm512_maskz_mov_ps(mask(held.saturating_sub(base)), _mm512_set1_ps(v))
                }
                RowScales::Lanes(v) => v,
            }
        }
    }
}

/// 64 bytes of a weight row from byte `start`: one plain load where the row holds them all
/// (`full`), else the masked load of what it has.
///
/// # Safety
/// The CPU has AVX-512 F and BW; with `full`, `start + 64 <= data.len()`.
#[inline(always)]
unsafe fn weight_bytes(data: &[u8], start: usize, full: bool) -> __m512i {
    // SAFETY: the caller's contract (in bounds when `full`; `load_bytes` masks otherwise).
    unsafe {
        if full {
            _mm512_loadu_si512(data.as_ptr().add(start).cast())
        } else {
            load_bytes(data, start, BLOCK)
        }
    }
}

/// The lane of the reduction tree's result that holds block `c` of a chunk: the tree leaves
/// block `4i + k` in lane `4k + i`.
const TREE_LANE: [i32; 16] = [0, 4, 8, 12, 1, 5, 9, 13, 2, 6, 10, 14, 3, 7, 11, 15];

/// One weight row (its bytes `data` and block scales `ws`) against activation rows
/// `t0..t0 + NA`: the sums of the blocks of each chunk in lane `b mod 16`, scaled and added
/// into that row's lanes in block order.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `t0 + NA <= x.rows`.
#[inline(always)]
unsafe fn row_tile<const NA: usize>(
    data: &[u8],
    ws: RowScales<'_>,
    x: &DecodeActs,
    t0: usize,
    shift: u32,
) -> [__m512; NA] {
    // SAFETY: the caller's contract.
    unsafe {
        if x.int8 {
            row_tile_int8::<NA>(data, ws, x, t0, shift)
        } else {
            row_tile_int4::<NA>(data, ws, x, t0, shift)
        }
    }
}

/// Qword q of a pair of raw weight vectors (`_mm512_permutex2var_epi64`): from `a` (the 4
/// blocks 8g + 4P, + 1 of the first, + 2, + 3 of the second; 4 qwords each) to qwords
/// `2h, 2h + 1` of those 4 blocks, block by block (`INT4_STEP_A[h]`).
const INT4_STEP_A: [[i64; 8]; 2] = [[0, 1, 4, 5, 8, 9, 12, 13], [2, 3, 6, 7, 10, 11, 14, 15]];
/// Then from two of those (blocks 8g..8g + 4 and 8g + 4..8g + 8) to qword `2h + jj` of each of
/// the 8 blocks (`INT4_STEP_B[jj]`).
const INT4_STEP_B: [[i64; 8]; 2] = [[0, 2, 4, 6, 8, 10, 12, 14], [1, 3, 5, 7, 9, 11, 13, 15]];
/// Lane L of a chunk's sums: block L's two partials, from the pairs of lanes 2i, 2i + 1 of
/// the accumulators of blocks 0–7 (`a`) and 8–15 (`b`): `INT4_PAIRS[e]`, e = 0, 1.
const INT4_PAIRS: [[i32; 16]; 2] = [
    [0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30],
    [1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31],
];

/// [`row_tile`] for int4 weights. A chunk's 512 bytes (16 blocks of 32, two per 64-byte
/// vector) are transposed by qwords (16 two-source permutes, shared by every activation
/// row) into vectors that each hold one qword (16 elements) of 8 blocks, so that a block's
/// products gather in 2 lanes of one accumulator: per activation row, the chunk costs its 16
/// `vpdpbusd`, 2 permutes and an add to bring each block's sum into lane `b mod 16`, where
/// the reduction tree of the untransposed layout cost 14 shuffles and 7 adds. The activation
/// lines match (`quantize_row`): line 8g + 2j + e, qword i = block 8g + i's elements
/// 16j + 2k + e.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `t0 + NA <= x.rows`; `x` is laid out for int4.
#[inline(always)]
unsafe fn row_tile_int4<const NA: usize>(
    data: &[u8],
    ws: RowScales<'_>,
    x: &DecodeActs,
    t0: usize,
    shift: u32,
) -> [__m512; NA] {
    // SAFETY: AVX-512 F, BW and VNNI are enabled by the caller. Lines `base..base + 16` and
    // block offsets `base + 16 <= blocks` of rows `t0 + a < x.rows` are inside `x`'s vectors,
    // lines are 64-byte aligned, and the weight loads are masked to `data` (`weight_bytes`).
    unsafe {
        let blocks = x.chunks * LANES;
        let zero = _mm512_setzero_si512();
        let nibble = _mm512_set1_epi8(0x0F);
        let shift = _mm512_set1_epi32(shift as i32);
        let step_a = [
            _mm512_loadu_si512(INT4_STEP_A[0].as_ptr().cast()),
            _mm512_loadu_si512(INT4_STEP_A[1].as_ptr().cast()),
        ];
        let step_b = [
            _mm512_loadu_si512(INT4_STEP_B[0].as_ptr().cast()),
            _mm512_loadu_si512(INT4_STEP_B[1].as_ptr().cast()),
        ];
        let pairs = [
            _mm512_loadu_si512(INT4_PAIRS[0].as_ptr().cast()),
            _mm512_loadu_si512(INT4_PAIRS[1].as_ptr().cast()),
        ];
        let mut lanes = [_mm512_setzero_ps(); NA];
        let rows = x.lines.as_ptr().add(t0 * blocks);
        // The blocks that hold columns (past them a chunk's weights and activations are zero:
        // their work is skipped).
        let held = x.cols.div_ceil(BLOCK);
        for c in 0..x.chunks {
            let base = c * LANES;
            // acc[a][g]: lanes 2i, 2i + 1 = partial sums of block base + 8g + i.
            let mut acc = [[zero; 2]; NA];
            for g in 0..2 {
                if base + 8 * g >= held {
                    break;
                }
                // w[k]: blocks base + 8g + 2k, + 1 as stored.
                let mut w = [zero; 4];
                for (k, w) in w.iter_mut().enumerate() {
                    let b = base + 8 * g + 2 * k;
                    if b < held {
                        *w = weight_bytes(data, b * BLOCK / 2, (b + 2) * BLOCK / 2 <= data.len());
                    }
                }
                // q[p][h]: qwords 2h, 2h + 1 of blocks 8g + 4p .. 8g + 4p + 4.
                // (Written out, not `array::from_fn`: closures would not inherit the caller's
                // target features.)
                let q = [
                    [
                        _mm512_permutex2var_epi64(w[0], step_a[0], w[1]),
                        _mm512_permutex2var_epi64(w[0], step_a[1], w[1]),
                    ],
                    [
                        _mm512_permutex2var_epi64(w[2], step_a[0], w[3]),
                        _mm512_permutex2var_epi64(w[2], step_a[1], w[3]),
                    ],
                ];
                for j in 0..4 {
                    // Qword j of blocks 8g .. 8g + 8.
                    let v = _mm512_permutex2var_epi64(q[0][j / 2], step_b[j % 2], q[1][j / 2]);
                    let lo = _mm512_and_si512(v, nibble);
                    let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), nibble);
                    let line = base + 8 * g + 2 * j;
                    for (a, acc) in acc.iter_mut().enumerate() {
                        let row = rows.add(a * blocks + line);
                        let even = _mm512_dpbusd_epi32(acc[g], lo, _mm512_load_si512(row.cast()));
                        acc[g] =
                            _mm512_dpbusd_epi32(even, hi, _mm512_load_si512(row.add(1).cast()));
                    }
                }
            }
            for (a, acc) in acc.iter().enumerate() {
                let tree = _mm512_add_epi32(
                    _mm512_permutex2var_epi32(acc[0], pairs[0], acc[1]),
                    _mm512_permutex2var_epi32(acc[0], pairs[1], acc[1]),
                );
                let off = (t0 + a) * blocks + base;
                let sums = _mm512_loadu_si512(x.sums.as_ptr().add(off).cast());
                let sx = _mm512_loadu_ps(x.scales.as_ptr().add(off));
                let sw = ws.chunk(base, held);
                // Σ u·xq − o·Σ xq = Σ q·xq, block b in lane b mod 16.
                let d = _mm512_sub_epi32(tree, _mm512_sllv_epi32(sums, shift));
                lanes[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, sx), lanes[a]);
            }
        }
        lanes
    }
}

/// [`row_tile`] for int8 weights (activation lines: the blocks in element order): each
/// `vpdpbusd` leaves 16 partial sums of a block, and a reduction tree (14 shuffles per 16
/// blocks and activation row) brings each block's sum into lane `b mod 16`.
///
/// # Safety
/// The CPU has AVX-512 F, BW and VNNI; `t0 + NA <= x.rows`.
#[inline(always)]
unsafe fn row_tile_int8<const NA: usize>(
    data: &[u8],
    ws: RowScales<'_>,
    x: &DecodeActs,
    t0: usize,
    shift: u32,
) -> [__m512; NA] {
    // SAFETY: AVX-512 F, BW and VNNI are enabled by the caller. Line `k < blocks` and block
    // offsets `base + 16 <= blocks` of rows `t0 + a < x.rows` are inside `x`'s vectors, lines are 64-byte aligned, and the weight loads are masked to
    // `data` (`load_bytes`, `int8_block`).
    let lanes = unsafe {
        let blocks = x.chunks * LANES;
        let block_bytes = BLOCK;
        let zero = _mm512_setzero_si512();
        let shift = _mm512_set1_epi32(shift as i32);
        let tree_lane = _mm512_loadu_si512(TREE_LANE.as_ptr().cast());
        let mut lanes = [_mm512_setzero_ps(); NA];
        // Row a's line k (plain pointer arithmetic, not a closure: closures would not inherit the
        // caller's target features).
        let rows = x.lines.as_ptr().add(t0 * blocks);
        // The blocks that hold columns: a chunk's blocks past them have zero activations
        // and weights, so their integer sums are 0 and their work is skipped (a hidden
        // size of 256 is 4 blocks of a 16-block chunk, an expert's 64 columns 1).
        let held = x.cols.div_ceil(BLOCK);
        for c in 0..x.chunks {
            let base = c * LANES;
            // t[a][m]: 128-bit lane q = four partial sums of block base + 4m + q.
            let mut t = [[zero; 4]; NA];
            for m in 0..4 {
                if base + 4 * m >= held {
                    break;
                }
                // p[a][h]: lanes 0–7 = partial sums of block base + 4m + 2h, lanes 8–15 of the next.
                let mut p = [[zero; 2]; NA];
                for h in 0..2 {
                    let b = base + 4 * m + 2 * h;
                    if b >= held {
                        break;
                    }
                    // Whether the row holds every byte of blocks b and b + 1.
                    let full = (b + 2) * block_bytes <= data.len();
                    let flip = _mm512_set1_epi8(-128);
                    let wa = _mm512_xor_si512(weight_bytes(data, b * BLOCK, full), flip);
                    let wb = _mm512_xor_si512(weight_bytes(data, (b + 1) * BLOCK, full), flip);
                    for (a, p) in p.iter_mut().enumerate() {
                        let da = _mm512_dpbusd_epi32(
                            zero,
                            wa,
                            _mm512_load_si512(rows.add(a * blocks + b).cast()),
                        );
                        let db = _mm512_dpbusd_epi32(
                            zero,
                            wb,
                            _mm512_load_si512(rows.add(a * blocks + b + 1).cast()),
                        );
                        p[h] = _mm512_add_epi32(
                            _mm512_shuffle_i32x4::<0x44>(da, db),
                            _mm512_shuffle_i32x4::<0xEE>(da, db),
                        );
                    }
                }
                for (t, p) in t.iter_mut().zip(&p) {
                    t[m] = _mm512_add_epi32(
                        _mm512_shuffle_i32x4::<0x88>(p[0], p[1]),
                        _mm512_shuffle_i32x4::<0xDD>(p[0], p[1]),
                    );
                }
            }
            for (a, t) in t.iter().enumerate() {
                // u_n: lanes 4q, 4q + 1 = block base + 8n + q, lanes 4q + 2, 4q + 3 = block
                // base + 8n + 4 + q, two partial sums each.
                let u0 = _mm512_add_epi32(
                    _mm512_unpacklo_epi64(t[0], t[1]),
                    _mm512_unpackhi_epi64(t[0], t[1]),
                );
                let u1 = _mm512_add_epi32(
                    _mm512_unpacklo_epi64(t[2], t[3]),
                    _mm512_unpackhi_epi64(t[2], t[3]),
                );
                let (f0, f1) = (_mm512_castsi512_ps(u0), _mm512_castsi512_ps(u1));
                let tree = _mm512_add_epi32(
                    _mm512_castps_si512(_mm512_shuffle_ps::<0b10_00_10_00>(f0, f1)),
                    _mm512_castps_si512(_mm512_shuffle_ps::<0b11_01_11_01>(f0, f1)),
                );
                let off = (t0 + a) * blocks + base;
                let sums = _mm512_loadu_si512(x.sums.as_ptr().add(off).cast());
                let sx = _mm512_loadu_ps(x.scales.as_ptr().add(off));
                let sw = ws.chunk(base, held);
                // Σ u·xq − o·Σ xq = Σ q·xq, block b in lane b mod 16.
                let d = _mm512_sub_epi32(
                    _mm512_permutexvar_epi32(tree_lane, tree),
                    _mm512_sllv_epi32(sums, shift),
                );
                lanes[a] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(d), _mm512_mul_ps(sw, sx), lanes[a]);
            }
        }
        lanes
    };
    lanes
}
