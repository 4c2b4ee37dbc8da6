//! The split-int8 arithmetic on AVX-512 VNNI (see the parent module for what it computes).
//! Weight rows are streamed as they are stored, with no decode into another layout: each
//! 64-byte chunk is split into its low and high nibbles (one AND, one shift and AND), which
//! meet the activations' even and odd lines in `vpdpbusd`; the three digits' sums are
//! recombined by two shifts into the running integer (`((e₀ ≪ 8) + e₁) ≪ 8 + e₂`, each
//! `vpdpbusd` accumulating onto the shifted sum), the nibbles' offset removed, and the lane
//! converted and scaled once per chunk. Tiles of up to two weight rows × four activation rows
//! share every loaded vector (8 accumulators of 16 f32 lanes).
//!
//! The weight streams are prefetched as the exact AVX-512 kernels do theirs (`avx512.rs`,
//! `Ahead`): at least 8 KiB ahead, into L2 on AMD and into L1 elsewhere.
//!
//! Every function here needs AVX-512 F, BW, VL and VNNI: `rows` enables them and the rest is
//! `#[inline(always)]` into it.

use std::arch::x86_64::*;

use super::{block_scales, SplitActs, CHUNK, LANES, LINES};
use crate::quant::format::{QMatrix, QuantFormat};
use crate::quant::kernels::int8act::{sum_lanes, OutColumns};

/// Weight rows per tile.
const NW_MAX: usize = 2;
/// Activation rows per tile.
const NA_MAX: usize = 4;
/// Bytes ahead of the current chunk that each weight stream is prefetched, at least.
const PREFETCH_BYTES: usize = 8192;

/// Where a tile's weight rows are and how they are prefetched.
#[derive(Clone, Copy)]
struct Stream {
    /// Bytes of the last chunk of a row that exist (1..=64).
    tail_bytes: usize,
    /// Prefetch distance in bytes.
    ahead: usize,
    /// Prefetch into L2 (`prefetcht1`) rather than L1.
    to_l2: bool,
}

/// One tile: weight rows `w[0..NW]` (their bytes and per-block scales, 2 per chunk) against
/// activation rows `t0..t0 + NA` of `x`; returns the sums `[w][a]`.
///
/// # Safety
/// AVX-512 F, BW, VL and VNNI are enabled by the caller; each `w[r]` points at a whole packed
/// row of `x.cols` int4 columns and each `ws[r]` at `2 · x.chunks` scales; `t0 + NA <= x.rows`.
#[inline(always)]
unsafe fn tile<const NW: usize, const NA: usize>(
    w: [*const u8; NW],
    ws: [*const f32; NW],
    x: &SplitActs,
    t0: usize,
    stream: Stream,
) -> [[f32; NA]; NW] {
    // SAFETY: the caller's contract; every load below is within a row of `w` (the last chunk
    // masked to the bytes that exist), its scales, or the activations' rows `t0..t0 + NA`.
    unsafe {
        let low4 = _mm512_set1_epi8(0x0F);
        // Lanes 0..8 take the first block's scale, 8..16 the second's.
        let pair = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
        let mut acc = [[_mm512_setzero_ps(); NA]; NW];
        let chunks = x.chunks;
        for c in 0..chunks {
            let bytes_mask = if c + 1 == chunks && stream.tail_bytes < 64 {
                (1u64 << stream.tail_bytes) - 1
            } else {
                u64::MAX
            };
            let mut lo = [_mm512_setzero_si512(); NW];
            let mut hi = [_mm512_setzero_si512(); NW];
            let mut sw = [_mm512_setzero_ps(); NW];
            for r in 0..NW {
                let p = w[r].add(64 * c);
                let ahead = p.wrapping_add(stream.ahead) as *const i8;
                if stream.to_l2 {
                    _mm_prefetch::<_MM_HINT_T1>(ahead);
                } else {
                    _mm_prefetch::<_MM_HINT_T0>(ahead);
                }
                let v = _mm512_maskz_loadu_epi8(bytes_mask, p as *const i8);
                lo[r] = _mm512_and_si512(v, low4);
                hi[r] = _mm512_and_si512(_mm512_srli_epi16::<4>(v), low4);
                let two = _mm_castsi128_ps(_mm_loadl_epi64(ws[r].add(2 * c) as *const __m128i));
                sw[r] = _mm512_permutexvar_ps(pair, _mm512_castps128_ps512(two));
            }
            for a in 0..NA {
                let row = (t0 + a) * chunks + c;
                let lines = x.digits.as_ptr().add(row * LINES) as *const __m512i;
                let d: [__m512i; LINES] = [
                    _mm512_load_si512(lines),
                    _mm512_load_si512(lines.add(1)),
                    _mm512_load_si512(lines.add(2)),
                    _mm512_load_si512(lines.add(3)),
                    _mm512_load_si512(lines.add(4)),
                    _mm512_load_si512(lines.add(5)),
                ];
                let offsets = _mm512_loadu_si512(x.offsets.as_ptr().add(row * LANES) as *const _);
                let sx = _mm512_loadu_ps(x.scales.as_ptr().add(row * LANES));
                for r in 0..NW {
                    let mut e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[r], d[0]);
                    e = _mm512_dpbusd_epi32(e, hi[r], d[1]);
                    e = _mm512_slli_epi32::<8>(e);
                    e = _mm512_dpbusd_epi32(e, lo[r], d[2]);
                    e = _mm512_dpbusd_epi32(e, hi[r], d[3]);
                    e = _mm512_slli_epi32::<8>(e);
                    e = _mm512_dpbusd_epi32(e, lo[r], d[4]);
                    e = _mm512_dpbusd_epi32(e, hi[r], d[5]);
                    let int = _mm512_sub_epi32(e, offsets);
                    acc[r][a] = _mm512_fmadd_ps(
                        _mm512_cvtepi32_ps(int),
                        _mm512_mul_ps(sw[r], sx),
                        acc[r][a],
                    );
                }
            }
        }
        let mut out = [[0.0f32; NA]; NW];
        for r in 0..NW {
            for a in 0..NA {
                let mut lanes = [0.0f32; LANES];
                _mm512_storeu_ps(lanes.as_mut_ptr(), acc[r][a]);
                out[r][a] = sum_lanes(&lanes);
            }
        }
        out
    }
}

/// [`tile`] for run-time sizes (1..=2 weight rows, 1..=4 activation rows), results into `out`
/// at weight row `o` (its column) and activation row `t0`.
///
/// # Safety
/// As [`tile`] for `nw` rows and `na` activation rows; columns `o..o + nw` are this task's.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_into(
    nw: usize,
    na: usize,
    w: [*const u8; NW_MAX],
    ws: [*const f32; NW_MAX],
    x: &SplitActs,
    t0: usize,
    stream: Stream,
    o: usize,
    out: OutColumns,
) {
    macro_rules! run {
        ($nw:literal, $na:literal) => {{
            let (w, ws) = (
                std::array::from_fn::<_, $nw, _>(|r| w[r]),
                std::array::from_fn::<_, $nw, _>(|r| ws[r]),
            );
            // SAFETY: forwarded from the caller.
            let v = unsafe { tile::<$nw, $na>(w, ws, x, t0, stream) };
            for (r, row) in v.iter().enumerate() {
                for (a, value) in row.iter().enumerate() {
                    // SAFETY: the caller's contract: columns `o..o + nw` are this task's and
                    // `t0 + na <= S`.
                    unsafe { out.set(t0 + a, o + r, *value) };
                }
            }
        }};
    }
    match (nw, na) {
        (2, 4) => run!(2, 4),
        (2, 3) => run!(2, 3),
        (2, 2) => run!(2, 2),
        (2, 1) => run!(2, 1),
        (1, 4) => run!(1, 4),
        (1, 3) => run!(1, 3),
        (1, 2) => run!(1, 2),
        _ => run!(1, 1),
    }
}

/// `y[t, o0 + i] = W[o0 + i] · x_t` by the split-int8 arithmetic for `i < n`, every t.
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and VNNI; `x.cols == w.cols()`, `w`'s format is one
/// [`super::supports`] accepts, `o0 + n <= w.rows()`, `out` is [x.rows, w.rows()], and no
/// other task writes its columns `o0..o0 + n`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn rows(w: &QMatrix<'_>, o0: usize, n: usize, x: &SplitActs, out: OutColumns) {
    let row_bytes = w.format().row_bytes(w.cols());
    let stream = Stream {
        tail_bytes: row_bytes - 64 * (x.chunks - 1),
        ahead: PREFETCH_BYTES.max(row_bytes * NW_MAX),
        to_l2: crate::cpu::features().amd,
    };
    debug_assert_eq!(x.chunks, row_bytes.div_ceil(64));
    debug_assert_eq!(CHUNK, 128);
    // gs64 (docs/container.md's default): the row's own scales are one per block. Other
    // group sizes and per-row scales: each row's per-block scales written out first.
    let gs64 = w.format() == QuantFormat::Int4Grouped { group_size: 64 };
    // Two per chunk, so the last chunk's pair is readable even when the row has an odd
    // number of blocks (the padding block's scale is 0, and so are its activations).
    let mut table = vec![0.0f32; NW_MAX * 2 * x.chunks];
    for i0 in (0..n).step_by(NW_MAX) {
        let nw = NW_MAX.min(n - i0);
        let mut wp = [std::ptr::null::<u8>(); NW_MAX];
        let mut sp = [std::ptr::null::<f32>(); NW_MAX];
        for r in 0..nw {
            let o = o0 + i0 + r;
            wp[r] = w.row_data(o).as_ptr();
            if gs64 && w.cols().div_ceil(64) % 2 == 0 {
                sp[r] = w.row_scales(o).as_ptr();
            } else {
                let t = &mut table[r * 2 * x.chunks..(r + 1) * 2 * x.chunks];
                if gs64 {
                    // Only the last scale pair is short: copy the row's scales.
                    let s = w.row_scales(o);
                    t[..s.len()].copy_from_slice(s);
                    t[s.len()..].fill(0.0);
                } else {
                    block_scales(w, o, t);
                }
                sp[r] = t.as_ptr();
            }
        }
        let mut t = 0;
        while t < x.rows {
            let na = NA_MAX.min(x.rows - t);
            // SAFETY: the caller's features and shapes; `wp[..nw]` are whole rows of `w`,
            // `sp[..nw]` hold 2 · chunks scales each, `t + na <= x.rows`, and columns
            // `o0 + i0..o0 + i0 + nw` are this call's.
            unsafe { tile_into(nw, na, wp, sp, x, t, stream, o0 + i0, out) };
            t += na;
        }
    }
}
