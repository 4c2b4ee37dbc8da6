//! The int8 arithmetic for decode-sized calls on AVX2 (x86-64 CPUs without AVX-512 VNNI): the
//! AVX-512 VNNI decode kernel's job (`decode.rs`) with 256-bit `vpmaddubsw`, computing what the
//! parent module defines bit for bit.
//!
//! - The **weights stay as stored** and the **activations are laid out to match** by this
//!   kernel's own quantiser into [`DecodeActs`]' lines ([`quantize_row`]: for int4, per pair
//!   of blocks one line of both blocks' even elements and one of their odd ones; for int8,
//!   the blocks in element order). A block is one 32-byte
//!   load of int4 weights, whose low nibbles meet the block's 32 even activations and whose
//!   high nibbles its 32 odd ones, or two 32-byte halves of int8 weights.
//! - **int4** (`u = q + 8`): `vpmaddubsw(u, x)` on the even and on the odd half, added as
//!   16-bit integers (|·| ≤ 2 · 2 · 15 · 127 = 7,620, and two neighbours ≤ 15,240 after the
//!   first `vphaddw` of a pair of blocks), then `vpmaddwd` by ones into 32 bits; each block's
//!   sum less `8 · Σ xq` is `Σ q · xq`.
//! - **int8** (stored signed, `q`): the sign trick of the prefill kernel (`avx2.rs`),
//!   `vpmaddubsw(|q|, sign(xq, q))` (≤ 2 · 128 · 127 = 32,512 per pair), widened per half.
//! - Eight blocks' partial sums are reduced by a `vphadd` tree into one vector, block j in lane
//!   j, which the scales multiply and `fma` adds into the lanes `b mod 16` (two vectors of 8) in
//!   block order, as the reference does; the 16 lanes are then summed by [`sum_lanes`]' tree.
//! - Rows of 1, 2 or 4 whole blocks (hidden 256 is 4, an expert's 64 columns 1) are packed:
//!   one 8-block group holds 8 / nb weight rows, block j of the group being block j mod nb of
//!   row j / nb. A lone row's lanes past nb hold +0 (an `fma` onto +0 never gives −0), so the
//!   reference's lane steps of distance nb and more change nothing, and the steps nb / 2 … 1,
//!   done inside each row's lanes, give its bits.
//!
//! Integer sums are exact in any order and the f32 steps are the reference's, so a row's value
//! never depends on the call it is in (row invariance).
//!
//! [`sum_lanes`]: super::sum_lanes

use std::arch::x86_64::*;

use super::decode_acts::DecodeActs;
use super::{Line, OutColumns, BLOCK, LANES};
use crate::quant::format::{QMatrix, QuantFormat};

/// One activation row into [`DecodeActs`]' lines, scales and sums (`blocks` = chunks · 16 each)
/// in this kernel's layout (module docs; [`act_offsets`] reads it): the scalar quantiser's
/// bytes, scales and sums, placed as this kernel reads them.
///
/// # Safety
/// The CPU has AVX2 and FMA; the slices hold `16 · chunks_for(src.len())` elements.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_row(
    src: &[f32],
    int8: bool,
    lines: &mut [Line],
    scales: &mut [f32],
    sums: &mut [i32],
) {
    let z = _mm256_setzero_si256();
    // Per 128-bit lane: the even bytes, then the odd ones.
    let split = _mm256_setr_epi8(
        0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5, 7, 9, 11, 13, 15, 0, 2, 4, 6, 8, 10, 12, 14, 1, 3, 5,
        7, 9, 11, 13, 15,
    );
    for p in 0..lines.len() / 2 {
        if 2 * p * BLOCK >= src.len() {
            // Past the row: zeros (a decode row of 256 columns fills 4 of its 16 blocks).
            for b in 2 * p..2 * p + 2 {
                lines[b] = Line([0; 64]);
                (scales[b], sums[b]) = (0.0, 0);
            }
            continue;
        }
        let mut pair = [[z; 2]; 2];
        for (h, v) in pair.iter_mut().enumerate() {
            let b = 2 * p + h;
            // SAFETY: the features are enabled here.
            (*v, scales[b], sums[b]) = match unsafe { super::avx2::quantize_block(src, b * BLOCK) }
            {
                Some(block) => block,
                None => ([z; 2], 0.0, 0),
            };
        }
        let (first, second) = if int8 {
            (pair[0], pair[1])
        } else {
            // A block's 64 bytes as its 32 even elements and its 32 odd ones, in order.
            let (mut even, mut odd) = ([z; 2], [z; 2]);
            for (k, [h0, h1]) in pair.into_iter().enumerate() {
                // Quads: E(0–15), E(16–31), O(0–15), O(16–31); then the same of 32–63.
                let s0 = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(h0, split));
                let s1 = _mm256_permute4x64_epi64::<0b11_01_10_00>(_mm256_shuffle_epi8(h1, split));
                even[k] = _mm256_permute2x128_si256::<0x20>(s0, s1);
                odd[k] = _mm256_permute2x128_si256::<0x31>(s0, s1);
            }
            (even, odd)
        };
        // SAFETY: lines `2p` and `2p + 1` exist (`lines.len()` is a multiple of 16) and are
        // 64-byte aligned; each store writes one 32-byte half.
        unsafe {
            for (k, halves) in [first, second].into_iter().enumerate() {
                let dst = lines[2 * p + k].0.as_mut_ptr();
                _mm256_store_si256(dst.cast(), halves[0]);
                _mm256_store_si256(dst.add(32).cast(), halves[1]);
            }
        }
    }
}

/// Blocks per reduction group: one per 32-bit lane of a 256-bit vector.
const GROUP: usize = 8;

/// Activation rows per tile against one weight row (1..=4).
const TILE_ROWS: usize = 2;

/// Byte offsets in an activation row's lines of block `b`'s two 32-byte halves: for int4 its
/// even and odd elements, for int8 elements 0–31 and 32–63.
#[inline(always)]
fn act_offsets(b: usize, int8: bool) -> (usize, usize) {
    if int8 {
        (b * BLOCK, b * BLOCK + 32)
    } else {
        let even = (b & !1) * BLOCK + (b & 1) * 32;
        (even, even + BLOCK)
    }
}

/// The integer sums of up to 8 blocks against activation rows `x_rows` (pointers to their
/// lines, as bytes): lane j of row a's vector is `Σ u · xq` (int4, before the offset) or
/// `Σ q · xq` (int8) of weight block j (the `bb` = 32 or 64 bytes from `w + j · bb`) against
/// activation block `xb[j]`, for `j < nv` (0 past it).
///
/// # Safety
/// The CPU has AVX2; `w` has `nv · bb` readable bytes and `xb[j]` is a block of every row of
/// `x_rows` for `j < nv`.
#[inline(always)]
unsafe fn group_sums<const NA: usize>(
    w: *const u8,
    xb: &[usize; GROUP],
    nv: usize,
    x_rows: &[*const u8; NA],
    int8: bool,
) -> [__m256i; NA] {
    // SAFETY: the caller's contract: every pointer read below is to weight block j's bytes or
    // to a half of block `xb[j]` of an activation row, for `j < nv`.
    unsafe {
        let bb = if int8 { BLOCK } else { BLOCK / 2 };
        let z = _mm256_setzero_si256();
        let ones = _mm256_set1_epi16(1);
        // h[p][a], per 128-bit lane: two partial sums of block 2p, then two of block 2p + 1.
        let mut h = [[z; NA]; GROUP / 2];
        for (p, h) in h.iter_mut().enumerate() {
            let j = 2 * p;
            if j >= nv {
                break;
            }
            // A missing second block of the pair: zero weights against the first's
            // activations.
            let j2 = if j + 1 < nv { j + 1 } else { j };
            let (xa, xb2) = (act_offsets(xb[j], int8), act_offsets(xb[j2], int8));
            // (Loops, not closures, here and below: a closure would not inherit the entry
            // point's target features.)
            if int8 {
                let mut wv = [z; 4];
                wv[0] = _mm256_loadu_si256(w.add(j * bb).cast());
                wv[1] = _mm256_loadu_si256(w.add(j * bb + 32).cast());
                if j + 1 < nv {
                    wv[2] = _mm256_loadu_si256(w.add(j2 * bb).cast());
                    wv[3] = _mm256_loadu_si256(w.add(j2 * bb + 32).cast());
                }
                let mut wa = [z; 4];
                for k in 0..4 {
                    wa[k] = _mm256_abs_epi8(wv[k]);
                }
                let offs = [xa.0, xa.1, xb2.0, xb2.1];
                for (a, h) in h.iter_mut().enumerate() {
                    let mut d = [z; 4];
                    for k in 0..4 {
                        let xv = _mm256_load_si256(x_rows[a].add(offs[k]).cast());
                        d[k] = _mm256_madd_epi16(
                            _mm256_maddubs_epi16(wa[k], _mm256_sign_epi8(xv, wv[k])),
                            ones,
                        );
                    }
                    *h = _mm256_hadd_epi32(
                        _mm256_add_epi32(d[0], d[1]),
                        _mm256_add_epi32(d[2], d[3]),
                    );
                }
            } else {
                let nibble = _mm256_set1_epi8(0x0F);
                let v0 = _mm256_loadu_si256(w.add(j * bb).cast());
                let v1 = if j + 1 < nv {
                    _mm256_loadu_si256(w.add(j2 * bb).cast())
                } else {
                    z
                };
                let (lo0, hi0) = (
                    _mm256_and_si256(v0, nibble),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v0), nibble),
                );
                let (lo1, hi1) = (
                    _mm256_and_si256(v1, nibble),
                    _mm256_and_si256(_mm256_srli_epi16::<4>(v1), nibble),
                );
                for (a, h) in h.iter_mut().enumerate() {
                    let row = x_rows[a];
                    let first = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo0, _mm256_load_si256(row.add(xa.0).cast())),
                        _mm256_maddubs_epi16(hi0, _mm256_load_si256(row.add(xa.1).cast())),
                    );
                    let second = _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo1, _mm256_load_si256(row.add(xb2.0).cast())),
                        _mm256_maddubs_epi16(hi1, _mm256_load_si256(row.add(xb2.1).cast())),
                    );
                    // Neighbours of one block added in 16 bits (≤ 15,240), then widened.
                    *h = _mm256_madd_epi16(_mm256_hadd_epi16(first, second), ones);
                }
            }
        }
        let mut out = [z; NA];
        for (a, out) in out.iter_mut().enumerate() {
            // Per 128-bit lane L: one partial sum of each of blocks 0–3 (g0) and 4–7 (g1).
            let g0 = _mm256_hadd_epi32(h[0][a], h[1][a]);
            let g1 = _mm256_hadd_epi32(h[2][a], h[3][a]);
            *out = _mm256_add_epi32(
                _mm256_permute2x128_si256::<0x20>(g0, g1),
                _mm256_permute2x128_si256::<0x31>(g0, g1),
            );
        }
        out
    }
}

/// A weight row's scale for each of its blocks.
#[derive(Clone, Copy)]
enum RowScales<'a> {
    /// One per block (the blocks past the slice have none: 0).
    PerBlock(&'a [f32]),
    /// One for the whole row of `held` blocks.
    PerRow(f32, usize),
}

impl RowScales<'_> {
    /// The scales of blocks `base..base + 8` (0 past the row's last block, as the reference's
    /// [`block_scales`] has them).
    ///
    /// # Safety
    /// The CPU has AVX2.
    #[inline(always)]
    unsafe fn group(self, base: usize) -> __m256 {
        // SAFETY: AVX2 is enabled by the caller; the plain load reads 8 values of the slice.
        unsafe {
            match self {
                RowScales::PerBlock(s) => {
                    if base + GROUP <= s.len() {
                        return _mm256_loadu_ps(s.as_ptr().add(base));
                    }
                    let mut buf = [0.0f32; GROUP];
                    let n = s.len().saturating_sub(base);
                    buf[..n].copy_from_slice(&s[base..base + n]);
                    _mm256_loadu_ps(buf.as_ptr())
                }
                RowScales::PerRow(v, held) => {
                    let n = held.saturating_sub(base).min(GROUP) as i32;
                    let keep = _mm256_cmpgt_epi32(
                        _mm256_set1_epi32(n),
                        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
                    );
                    _mm256_and_ps(_mm256_set1_ps(v), _mm256_castsi256_ps(keep))
                }
            }
        }
    }
}

/// `y[t, o0 + i] ≈ W[o0 + i] · x_t` by the int8 arithmetic for `i < n` and every row t of `x`.
///
/// # Safety
/// The CPU has the features enabled here; `x.cols == w.cols()`, `x` was laid out for `w`'s
/// format (one [`supports`](super::supports) accepts), `o0 + n <= w.rows()`, `out` is
/// [x.rows, w.rows()], and no other task writes its columns `o0..o0 + n`.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn rows(w: &QMatrix<'_>, o0: usize, n: usize, x: &DecodeActs, out: OutColumns) {
    debug_assert_eq!(x.int8, w.format() == QuantFormat::Int8PerRow);
    let nb = x.cols / BLOCK;
    if x.cols.is_multiple_of(BLOCK) && matches!(nb, 1 | 2 | 4) {
        // SAFETY: the caller's contract; the rows are nb whole blocks.
        return unsafe { rows_packed(w, o0, n, nb, x, out) };
    }
    let held = x.cols.div_ceil(BLOCK);
    // Block scales of formats whose stored scales are not one per block (groups of 128 and
    // more): zero past the last block.
    let mut ws = match w.format() {
        QuantFormat::Int4Grouped { group_size: BLOCK }
        | QuantFormat::Int4PerRow
        | QuantFormat::Int8PerRow => Vec::new(),
        _ => vec![0.0f32; x.chunks * LANES],
    };
    // Each block's scale among its row's (computed once: a division per block cost more than
    // a narrow row's products).
    let group_of: Vec<usize> = match w.format() {
        QuantFormat::Int4Grouped { group_size } if group_size != BLOCK => {
            (0..held).map(|b| b * BLOCK / group_size).collect()
        }
        _ => Vec::new(),
    };
    for o in o0..o0 + n {
        let scales = w.row_scales(o);
        let rs = match w.format() {
            QuantFormat::Int4Grouped { group_size: BLOCK } => RowScales::PerBlock(scales),
            QuantFormat::Int4PerRow | QuantFormat::Int8PerRow => RowScales::PerRow(scales[0], held),
            _ => {
                // As `block_scales` gives them (zero past the last block, set once).
                for (s, &g) in ws.iter_mut().zip(&group_of) {
                    *s = scales[g];
                }
                RowScales::PerBlock(&ws)
            }
        };
        let data = w.row_data(o);
        let mut t0 = 0;
        while t0 < x.rows {
            let na = (x.rows - t0).min(TILE_ROWS);
            macro_rules! tile {
                ($na:literal) => {{
                    // SAFETY: the features are enabled here; `t0 + na <= x.rows`.
                    let v = unsafe { row_tile::<$na>(data, rs, x, t0) };
                    for (a, v) in v.into_iter().enumerate() {
                        // SAFETY: row t0 + a < x.rows and column o are in bounds and this
                        // task's (the caller's contract).
                        unsafe { out.set(t0 + a, o, v) };
                    }
                }};
            }
            match na {
                4 => tile!(4),
                3 => tile!(3),
                2 => tile!(2),
                _ => tile!(1),
            }
            t0 += na;
        }
    }
}

/// The 16 lanes of each activation row (two vectors: lanes 0–7, 8–15) summed by
/// [`super::sum_lanes`]' tree: lane i + lane i + 8, then + 4, + 2, + 1.
///
/// # Safety
/// The CPU has AVX2.
#[inline(always)]
unsafe fn sum_lanes(l: [__m256; 2]) -> f32 {
    let v8 = _mm256_add_ps(l[0], l[1]);
    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
    _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)))
}

/// One weight row (its bytes `data` and block scales `ws`) against activation rows
/// `t0..t0 + NA`: their values.
///
/// # Safety
/// The CPU has AVX2 and FMA; `t0 + NA <= x.rows`; `data` is a row of `x.cols` columns in the
/// format `x` was laid out for.
#[inline(always)]
unsafe fn row_tile<const NA: usize>(
    data: &[u8],
    ws: RowScales<'_>,
    x: &DecodeActs,
    t0: usize,
) -> [f32; NA] {
    // SAFETY: AVX2 and FMA are enabled by the caller. Activation rows `t0 + a < x.rows` hold
    // `blocks` lines, scales and sums, and every block read is below `held <= blocks`; weight
    // blocks are read in place where the row holds all their bytes, else from a zero-padded
    // copy.
    unsafe {
        let blocks = x.chunks * LANES;
        let held = x.cols.div_ceil(BLOCK);
        let bb = if x.int8 { BLOCK } else { BLOCK / 2 };
        let mut x_rows = [x.lines.as_ptr().cast::<u8>(); NA];
        for (a, p) in x_rows.iter_mut().enumerate() {
            *p = x.lines.as_ptr().add((t0 + a) * blocks).cast::<u8>();
        }
        let mut lanes = [[_mm256_setzero_ps(); 2]; NA];
        let mut tail = [0u8; GROUP * BLOCK];
        let xb: [usize; GROUP] = std::array::from_fn(|j| j);
        for c in 0..x.chunks {
            for h in 0..2 {
                let base = c * LANES + GROUP * h;
                if base >= held {
                    // Blocks of zeros from here on: each would add +0 to its lane.
                    break;
                }
                let nv = (held - base).min(GROUP);
                let start = base * bb;
                let wp = if start + nv * bb <= data.len() {
                    data.as_ptr().add(start)
                } else {
                    // The row's last group, with a partial last block: a zero-padded copy.
                    let have = data.len() - start;
                    tail[..have].copy_from_slice(&data[start..]);
                    tail[have..].fill(0);
                    tail.as_ptr()
                };
                let mut xb = xb;
                for v in xb.iter_mut() {
                    *v += base;
                }
                let d = group_sums::<NA>(wp, &xb, nv, &x_rows, x.int8);
                let sw = ws.group(base);
                for (a, lanes) in lanes.iter_mut().enumerate() {
                    let off = (t0 + a) * blocks + base;
                    let mut d = d[a];
                    if !x.int8 {
                        // Σ u·xq − 8 · Σ xq = Σ q·xq.
                        let sums = _mm256_loadu_si256(x.sums.as_ptr().add(off).cast());
                        d = _mm256_sub_epi32(d, _mm256_slli_epi32::<3>(sums));
                    }
                    let sx = _mm256_loadu_ps(x.scales.as_ptr().add(off));
                    lanes[h] =
                        _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), _mm256_mul_ps(sw, sx), lanes[h]);
                }
            }
        }
        let mut out = [0.0f32; NA];
        for (o, l) in out.iter_mut().zip(lanes) {
            *o = sum_lanes(l);
        }
        out
    }
}

/// [`rows`] for weight rows of `nb` whole blocks (nb = 1, 2, 4): 8 / nb of them per group (see
/// the module docs).
///
/// # Safety
/// As [`rows`], with `nb = w.cols() / 64`.
#[inline(always)]
unsafe fn rows_packed(
    w: &QMatrix<'_>,
    o0: usize,
    n: usize,
    nb: usize,
    x: &DecodeActs,
    out: OutColumns,
) {
    let per = GROUP / nb;
    let blocks = x.chunks * LANES;
    let bb = if x.int8 { BLOCK } else { BLOCK / 2 };
    let xb: [usize; GROUP] = std::array::from_fn(|j| j % nb);
    // Each activation row's block scales and sums in the group's lanes.
    let tiled = |t: usize| -> ([f32; GROUP], [i32; GROUP]) {
        let at = |j: usize| t * blocks + j % nb;
        (
            std::array::from_fn(|j| x.scales[at(j)]),
            std::array::from_fn(|j| x.sums[at(j)]),
        )
    };
    let (mut on_stack, on_heap);
    let lanes_x: &[([f32; GROUP], [i32; GROUP])] = if x.rows <= super::DECODE_MAX_ROWS {
        on_stack = [([0.0; GROUP], [0; GROUP]); super::DECODE_MAX_ROWS];
        for (t, v) in on_stack.iter_mut().enumerate().take(x.rows) {
            *v = tiled(t);
        }
        &on_stack[..x.rows]
    } else {
        on_heap = (0..x.rows).map(tiled).collect::<Vec<_>>();
        &on_heap
    };
    // The tree's steps inside a row: lane i + lane i + d for d = nb / 2 … 1.
    let step = |d: usize| -> [i32; GROUP] {
        std::array::from_fn(|i| (i - i % nb + (i % nb + d) % nb) as i32)
    };
    let steps = [step((nb / 2).max(1)), step(1)];
    let steps = &steps[2 - nb.trailing_zeros() as usize..];
    // Rows of whole blocks lie end to end: a group's weights are `nv · bb` consecutive bytes,
    // and its scales (one per block, or per row) consecutive values.
    let (data, stored) = (w.data(), w.scales());
    let spr = w.format().scales_per_row(w.cols());
    // Where block j of a group finds its scale, from the group's first row's first scale
    // (computed once: the divisions cost more than a group's products).
    let scale_at: [usize; GROUP] = std::array::from_fn(|j| match w.format() {
        QuantFormat::Int4Grouped { group_size } => (j / nb) * spr + (j % nb) * BLOCK / group_size,
        _ => j / nb,
    });
    let mut o = o0;
    while o < o0 + n {
        let count = (o0 + n - o).min(per);
        let nv = count * nb;
        let group = &data[o * nb * bb..(o * nb + nv) * bb];
        let mut sw = [0.0f32; GROUP];
        match w.format() {
            QuantFormat::Int4Grouped { group_size: BLOCK } => {
                sw[..nv].copy_from_slice(&stored[o * nb..o * nb + nv]);
            }
            _ => {
                let first = &stored[o * spr..];
                for (s, at) in sw.iter_mut().zip(scale_at).take(nv) {
                    *s = first[at];
                }
            }
        }
        // SAFETY: AVX2 and FMA are enabled by the caller; `group` holds the nv whole blocks,
        // the activation blocks `j mod nb < nb <= blocks` exist in every row, and the outputs
        // written are rows t < x.rows and columns o..o + count of this task.
        unsafe {
            let wp = group.as_ptr();
            let sw = _mm256_loadu_ps(sw.as_ptr());
            let mut step_v = [_mm256_setzero_si256(); 2];
            for (v, s) in step_v.iter_mut().zip(steps) {
                *v = _mm256_loadu_si256(s.as_ptr().cast());
            }
            let step_v = &step_v[..steps.len()];
            let mut t0 = 0;
            while t0 < x.rows {
                let na = (x.rows - t0).min(TILE_ROWS);
                let mut d = [_mm256_setzero_si256(); 4];
                macro_rules! sums {
                    ($na:literal) => {{
                        let mut p = [x.lines.as_ptr().cast::<u8>(); $na];
                        for (a, p) in p.iter_mut().enumerate() {
                            *p = x.lines.as_ptr().add((t0 + a) * blocks).cast::<u8>();
                        }
                        d[..$na].copy_from_slice(&group_sums::<$na>(wp, &xb, nv, &p, x.int8));
                    }};
                }
                match na {
                    4 => sums!(4),
                    3 => sums!(3),
                    2 => sums!(2),
                    _ => sums!(1),
                }
                for (a, d) in d.iter().take(na).enumerate() {
                    let (sx, sums) = &lanes_x[t0 + a];
                    let mut d = *d;
                    if !x.int8 {
                        let sums = _mm256_loadu_si256(sums.as_ptr().cast());
                        d = _mm256_sub_epi32(d, _mm256_slli_epi32::<3>(sums));
                    }
                    let scale = _mm256_mul_ps(sw, _mm256_loadu_ps(sx.as_ptr()));
                    let mut l = _mm256_fmadd_ps(_mm256_cvtepi32_ps(d), scale, _mm256_setzero_ps());
                    for s in step_v {
                        l = _mm256_add_ps(l, _mm256_permutevar8x32_ps(l, *s));
                    }
                    let mut v = [0.0f32; GROUP];
                    _mm256_storeu_ps(v.as_mut_ptr(), l);
                    for r in 0..count {
                        out.set(t0 + a, o + r, v[r * nb]);
                    }
                }
                t0 += na;
            }
        }
        o += count;
    }
}
