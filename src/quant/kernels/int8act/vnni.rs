//! The int8 arithmetic on AVX-512 VNNI (see the parent module for what it computes). Each
//! weight row is decoded once per pass into the activations' lane layout (`decode_row`:
//! unsigned bytes, 16 lines per chunk of 16 blocks, by a 16 × 16 transpose of 32-bit words), so
//! that one `vpdpbusd` adds four products of each of 16 blocks into that block's own 32-bit
//! lane and a chunk's 16 instructions finish 16 block sums at once. Tiles of up to four weight
//! rows × four activation rows share each loaded vector: 16 integer accumulators per chunk,
//! then each lane converted and scaled once per chunk (one `vcvtdq2ps`, one `vmulps`, one
//! `vfmadd` per tile cell and chunk, against the 16 `vpdpbusd`).
//!
//! Every function here needs AVX-512 F, BW, VL and VNNI: `rows` enables them and the rest is
//! `#[inline(always)]` into it.

use std::arch::x86_64::*;

use super::{offset_shift, Line, OutColumns, QuantizedActs, TileRows, BLOCK, LANES};
use crate::quant::format::{QMatrix, QuantFormat};

/// `n` bytes of `data` from `start` (fewer past its end, the rest zero) in the low bytes of a
/// vector.
#[inline(always)]
pub(super) unsafe fn load_bytes(data: &[u8], start: usize, n: usize) -> __m512i {
    if start >= data.len() {
        // SAFETY: AVX-512 F is enabled by the caller.
        return unsafe { _mm512_setzero_si512() };
    }
    let avail = (data.len() - start).min(n);
    let mask = if avail >= 64 {
        u64::MAX
    } else {
        (1u64 << avail) - 1
    };
    // SAFETY: `start < data.len()`, so the pointer is in bounds; the mask covers only the
    // `avail` bytes that exist (masked-out bytes are not read); AVX-512 BW is enabled.
    unsafe { _mm512_maskz_loadu_epi8(mask, data.as_ptr().add(start).cast()) }
}

/// Block `b` of an int4 row as 64 unsigned nibbles in element order.
#[inline(always)]
unsafe fn int4_block(data: &[u8], b: usize) -> __m512i {
    // SAFETY: AVX-512 F and BW are enabled by the caller.
    unsafe {
        let packed = _mm512_castsi512_si256(load_bytes(data, b * BLOCK / 2, BLOCK / 2));
        // u16 lane m = byte m; then its low byte = the low nibble (element 2m) and its high
        // byte = the high nibble (element 2m + 1).
        let t = _mm512_cvtepu8_epi16(packed);
        _mm512_and_si512(
            _mm512_or_si512(t, _mm512_slli_epi16::<4>(t)),
            _mm512_set1_epi16(0x0F0F),
        )
    }
}

/// Block `b` of an int8 row as 64 unsigned bytes `q + 128` in element order.
#[inline(always)]
unsafe fn int8_block(data: &[u8], b: usize) -> __m512i {
    // SAFETY: AVX-512 F is enabled by the caller.
    unsafe { _mm512_xor_si512(load_bytes(data, b * BLOCK, BLOCK), _mm512_set1_epi8(-128)) }
}

/// 16 × 16 transpose of 32-bit words: `out[k]` word j = `r[j]` word k.
#[inline(always)]
unsafe fn transpose16(r: [__m512i; 16]) -> [__m512i; 16] {
    // SAFETY: AVX-512 F is enabled by the caller.
    unsafe {
        let z = _mm512_setzero_si512();
        // t[2m] / t[2m + 1]: per 128-bit lane L, words 0–1 / 2–3 of r[2m] and r[2m + 1]
        // interleaved.
        let mut t = [z; 16];
        for m in 0..8 {
            t[2 * m] = _mm512_unpacklo_epi32(r[2 * m], r[2 * m + 1]);
            t[2 * m + 1] = _mm512_unpackhi_epi32(r[2 * m], r[2 * m + 1]);
        }
        // u[4n + p]: per 128-bit lane L, word p of L in rows 4n..4n + 4.
        let mut u = [z; 16];
        for n in 0..4 {
            u[4 * n] = _mm512_unpacklo_epi64(t[4 * n], t[4 * n + 2]);
            u[4 * n + 1] = _mm512_unpackhi_epi64(t[4 * n], t[4 * n + 2]);
            u[4 * n + 2] = _mm512_unpacklo_epi64(t[4 * n + 1], t[4 * n + 3]);
            u[4 * n + 3] = _mm512_unpackhi_epi64(t[4 * n + 1], t[4 * n + 3]);
        }
        // out[4L + p] = lane L of u[p], u[4 + p], u[8 + p], u[12 + p]: a 4 × 4 transpose of
        // 128-bit lanes.
        let mut out = [z; 16];
        for p in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0x44>(u[p], u[4 + p]);
            let v1 = _mm512_shuffle_i32x4::<0xEE>(u[p], u[4 + p]);
            let v2 = _mm512_shuffle_i32x4::<0x44>(u[8 + p], u[12 + p]);
            let v3 = _mm512_shuffle_i32x4::<0xEE>(u[8 + p], u[12 + p]);
            out[p] = _mm512_shuffle_i32x4::<0x88>(v0, v2);
            out[4 + p] = _mm512_shuffle_i32x4::<0xDD>(v0, v2);
            out[8 + p] = _mm512_shuffle_i32x4::<0x88>(v1, v3);
            out[12 + p] = _mm512_shuffle_i32x4::<0xDD>(v1, v3);
        }
        out
    }
}

/// Elements `start..start + 64` of `src` (fewer past its end, the rest zero) quantised by the
/// scalar `quantize_block`'s arithmetic (max |x|, `x · (127 / m)` rounded by the f32 adder,
/// clamped), vector by vector, so the same bytes for finite `x`: the 64 i8 in element order,
/// the block's scale and its `Σ xq`; `None` for a block of zeros (or past the end, or not
/// finite), whose bytes, scale and sum are all 0.
///
/// # Safety
/// The CPU has AVX-512 F and BW.
#[inline(always)]
pub(super) unsafe fn quantize_block_vec(src: &[f32], start: usize) -> Option<(__m512i, f32, i32)> {
    let n = src.len().saturating_sub(start).min(BLOCK);
    let mut v = [_mm512_setzero_ps(); 4];
    for (q, vq) in v.iter_mut().enumerate() {
        let have = n.saturating_sub(16 * q).min(16);
        if have > 0 {
            let mask = ((1u32 << have) - 1) as __mmask16;
            // SAFETY: the mask covers elements `start + 16q .. start + 16q + have`, all inside
            // `src`; masked-out elements are not read; AVX-512 F is enabled by the caller.
            *vq = unsafe { _mm512_maskz_loadu_ps(mask, src.as_ptr().add(start + 16 * q)) };
        }
    }
    let amax = _mm512_max_ps(
        _mm512_max_ps(_mm512_abs_ps(v[0]), _mm512_abs_ps(v[1])),
        _mm512_max_ps(_mm512_abs_ps(v[2]), _mm512_abs_ps(v[3])),
    );
    let m = _mm512_reduce_max_ps(amax);
    if n == 0 || m == 0.0 || !m.is_finite() {
        return None;
    }
    let rounder = _mm512_set1_ps(super::ROUNDER);
    let (lo, hi) = (_mm512_set1_ps(-127.0), _mm512_set1_ps(127.0));
    let inv = _mm512_set1_ps(127.0 / m);
    let mut sum = _mm512_setzero_si512();
    let mut bytes = _mm512_setzero_si512();
    for (q, vq) in v.iter().enumerate() {
        let t = _mm512_sub_ps(_mm512_add_ps(_mm512_mul_ps(*vq, inv), rounder), rounder);
        let i = _mm512_cvtps_epi32(_mm512_min_ps(_mm512_max_ps(t, lo), hi));
        sum = _mm512_add_epi32(sum, i);
        let packed = _mm512_castsi128_si512(_mm512_cvtepi32_epi8(i));
        bytes = match q {
            0 => _mm512_inserti32x4::<0>(bytes, _mm512_castsi512_si128(packed)),
            1 => _mm512_inserti32x4::<1>(bytes, _mm512_castsi512_si128(packed)),
            2 => _mm512_inserti32x4::<2>(bytes, _mm512_castsi512_si128(packed)),
            _ => _mm512_inserti32x4::<3>(bytes, _mm512_castsi512_si128(packed)),
        };
    }
    Some((bytes, m / 127.0, _mm512_reduce_add_epi32(sum)))
}

/// One row of activations quantised into the lane layout (`lines`, `scales`, `sums`: this
/// row's, chunks · 16 each) by [`quantize_block_vec`], 16 blocks at a time into their lanes by
/// [`transpose16`].
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and VNNI; `lines`, `scales` and `sums` have
/// `16 · ceil(ceil(src.len() / 64) / 16)` elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn quantize_row(
    src: &[f32],
    lines: &mut [Line],
    scales: &mut [f32],
    sums: &mut [i32],
) {
    for (c, chunk) in lines.chunks_exact_mut(LANES).enumerate() {
        let mut r = [_mm512_setzero_si512(); 16];
        for (j, row) in r.iter_mut().enumerate() {
            let b = c * LANES + j;
            // SAFETY: the features are enabled here.
            (*row, scales[b], sums[b]) = match unsafe { quantize_block_vec(src, b * BLOCK) } {
                Some(block) => block,
                None => (_mm512_setzero_si512(), 0.0, 0),
            };
        }
        // SAFETY: features enabled here; each store writes one aligned 64-byte line.
        unsafe {
            for (line, v) in chunk.iter_mut().zip(transpose16(r)) {
                _mm512_store_si512(line.0.as_mut_ptr().cast(), v);
            }
        }
    }
}

/// Each vector's 16 lanes summed by [`super::sum_lanes`]' tree (lane i + lane i + 8, then + 4, + 2,
/// + 1), 16 vectors at once: cell c's sum lands in lane [`sum_lanes16_index`]`(c)`.
#[inline(always)]
pub(super) unsafe fn sum_lanes16(v: [__m512; 16]) -> __m512 {
    // SAFETY: AVX-512 F is enabled by the caller.
    unsafe {
        // u[m]: lanes 0–7 = cell 2m's i + (i + 8), lanes 8–15 = cell 2m + 1's.
        let mut u = [_mm512_setzero_ps(); 8];
        for (m, u) in u.iter_mut().enumerate() {
            let (a, b) = (v[2 * m], v[2 * m + 1]);
            *u = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
            );
        }
        // w[m]: 128-bit lane q = cell 4m + q's i + (i + 4).
        let mut w = [_mm512_setzero_ps(); 4];
        for (m, w) in w.iter_mut().enumerate() {
            let (c, d) = (u[2 * m], u[2 * m + 1]);
            *w = _mm512_add_ps(
                _mm512_shuffle_f32x4::<0b10_00_10_00>(c, d),
                _mm512_shuffle_f32x4::<0b11_01_11_01>(c, d),
            );
        }
        // y[m]: 128-bit lane q = cells 8m + q and 8m + 4 + q, two partials each: i + (i + 2).
        let mut y = [_mm512_setzero_ps(); 2];
        for (m, y) in y.iter_mut().enumerate() {
            let (e, f) = (_mm512_castps_pd(w[2 * m]), _mm512_castps_pd(w[2 * m + 1]));
            *y = _mm512_add_ps(
                _mm512_castpd_ps(_mm512_unpacklo_pd(e, f)),
                _mm512_castpd_ps(_mm512_unpackhi_pd(e, f)),
            );
        }
        // 128-bit lane q = cells q, 4 + q, 8 + q, 12 + q: partial 0 + partial 1.
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b10_00_10_00>(y[0], y[1]),
            _mm512_shuffle_ps::<0b11_01_11_01>(y[0], y[1]),
        )
    }
}

/// The lane of [`sum_lanes16`]'s result that holds cell `c`'s sum.
#[inline(always)]
pub(super) fn sum_lanes16_index(c: usize) -> usize {
    4 * (c % 4) + c / 4
}

/// This kernel's pieces for the shared pass loop (`super::tile_rows`).
struct Kernel;

impl super::Tiles for Kernel {
    const WR: usize = 4;
    const AR: usize = 4;
    /// The weights' offset as a shift (`offset_shift`).
    type Format = u32;

    fn format(w: &QMatrix<'_>) -> u32 {
        offset_shift(w.format())
    }

    /// Row `o` of `w` as unsigned bytes in the lane layout: line `16c + k`, lane j = elements
    /// `4k..4k + 4` of block `16c + j` (`out.len()` = chunks · 16).
    #[inline(always)]
    unsafe fn decode_row(w: &QMatrix<'_>, o: usize, out: &mut [Line]) {
        let data = w.row_data(o);
        let int8 = w.format() == QuantFormat::Int8PerRow;
        // SAFETY: AVX-512 F and BW are enabled by the caller; each store writes one 64-byte line
        // of `out`, whose lines are 64-byte aligned.
        unsafe {
            for (c, lines) in out.chunks_exact_mut(LANES).enumerate() {
                let mut r = [_mm512_setzero_si512(); 16];
                for (j, v) in r.iter_mut().enumerate() {
                    *v = if int8 {
                        int8_block(data, c * LANES + j)
                    } else {
                        int4_block(data, c * LANES + j)
                    };
                }
                for (line, v) in lines.iter_mut().zip(transpose16(r)) {
                    _mm512_store_si512(line.0.as_mut_ptr().cast(), v);
                }
            }
        }
    }

    /// One tile: rows `0..NW` of the decoded weights (`wl`, `ws`: [NW][blocks]) against
    /// activation rows `t0..t0 + NA`; returns `[w][a]`.
    ///
    /// # Safety
    /// The CPU has AVX-512 F and VNNI; `wl` and `ws` hold `NW · blocks` elements and `x` has at
    /// least `t0 + NA` rows.
    #[inline(always)]
    unsafe fn tile<const NW: usize, const NA: usize>(
        wl: &[Line],
        ws: &[f32],
        x: &QuantizedActs,
        t0: usize,
        shift: u32,
    ) -> [[f32; NA]; NW] {
        // SAFETY: AVX-512 F and VNNI are enabled by the caller. The row pointers start inside
        // `wl` (row r < NW: `r · blocks < wl.len()`) and `x.q`/`x.sums`/`x.scales` (row
        // `t0 + a < x.rows`), and every offset added below is `base + k < blocks` lines or
        // `base + 16 <= blocks` values into the row, so each load is in bounds; lines are
        // 64-byte aligned.
        unsafe {
            let TileRows {
                w_lines: w_rows,
                w_scales,
                x_lines: x_rows,
                x_sums,
                x_scales,
            } = TileRows::<NW, NA>::new(wl, ws, x, t0);
            let mut sums = [[_mm512_setzero_ps(); NA]; NW];
            let shift = _mm512_set1_epi32(shift as i32);
            for c in 0..x.chunks {
                let base = c * LANES;
                // Each lane starts at −o · Σxq of its block, so the sum ends at Σ q · xq.
                let mut acc = [[_mm512_setzero_si512(); NA]; NW];
                for a in 0..NA {
                    let sums_x = _mm512_loadu_si512(x_sums[a].add(base).cast());
                    let init =
                        _mm512_sub_epi32(_mm512_setzero_si512(), _mm512_sllv_epi32(sums_x, shift));
                    for row in acc.iter_mut() {
                        row[a] = init;
                    }
                }
                for k in base..base + LANES {
                    let mut wv = [_mm512_setzero_si512(); NW];
                    for r in 0..NW {
                        wv[r] = _mm512_load_si512(w_rows[r].add(k).cast());
                    }
                    for a in 0..NA {
                        let xv = _mm512_load_si512(x_rows[a].add(k).cast());
                        for (row, w) in acc.iter_mut().zip(&wv) {
                            row[a] = _mm512_dpbusd_epi32(row[a], *w, xv);
                        }
                    }
                }
                for a in 0..NA {
                    let sx = _mm512_loadu_ps(x_scales[a].add(base));
                    for r in 0..NW {
                        let sw = _mm512_loadu_ps(w_scales[r].add(base));
                        sums[r][a] = _mm512_fmadd_ps(
                            _mm512_cvtepi32_ps(acc[r][a]),
                            _mm512_mul_ps(sw, sx),
                            sums[r][a],
                        );
                    }
                }
            }
            let mut cells = [_mm512_setzero_ps(); 16];
            for r in 0..NW {
                for a in 0..NA {
                    cells[r * NA + a] = sums[r][a];
                }
            }
            let mut lanes = [0.0f32; 16];
            _mm512_storeu_ps(lanes.as_mut_ptr(), sum_lanes16(cells));
            let mut out = [[0.0f32; NA]; NW];
            for (r, row) in out.iter_mut().enumerate() {
                for (a, v) in row.iter_mut().enumerate() {
                    *v = lanes[sum_lanes16_index(r * NA + a)];
                }
            }
            out
        }
    }
}

/// `y[t, o0 + i] ≈ W[o0 + i] · x_t` by the int8 arithmetic for `i < n`, every t, the
/// activations in passes of `pass` rows (`super::tile_rows` over this kernel).
///
/// # Safety
/// The CPU has the features enabled here; `super::tile_rows`' contract.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
pub(super) unsafe fn rows(
    w: &QMatrix<'_>,
    o0: usize,
    n: usize,
    x: &QuantizedActs,
    pass: usize,
    out: OutColumns,
) {
    // SAFETY: the caller's contract; the features are enabled here and `tile_rows` is
    // inlined into this function.
    unsafe { super::tile_rows::<Kernel>(w, o0, n, x, pass, out) }
}

/// [`sum_lanes16`] for the tests: the sums of 16 vectors, in cell order.
#[cfg(test)]
#[inline(always)]
pub(super) unsafe fn sum_lanes16_for_tests(v: [__m512; 16]) -> [f32; 16] {
    let mut lanes = [0.0f32; 16];
    // SAFETY: forwarded: the caller enables AVX-512 F.
    unsafe { _mm512_storeu_ps(lanes.as_mut_ptr(), sum_lanes16(v)) };
    std::array::from_fn(|c| lanes[sum_lanes16_index(c)])
}

/// [`transpose16`] for the tests.
#[cfg(test)]
#[inline(always)]
pub(super) unsafe fn transpose16_for_tests(r: [__m512i; 16]) -> [__m512i; 16] {
    // SAFETY: forwarded: the caller enables AVX-512 F.
    unsafe { transpose16(r) }
}
