//! The int8 arithmetic on AVX2 (see the parent module for what it computes), for x86-64 CPUs
//! without AVX-512 VNNI (AMD Zen 2/3, Intel before Ice Lake), as llama.cpp's AVX2 Q4×Q8 dot
//! products do it. The lane layouts are the VNNI kernel's: a 64-byte line is two 256-bit
//! halves, lanes 0–7 and 8–15. Per half-line and tile cell:
//! - **int4** weights (unsigned nibbles `u = q + 8`): `vpmaddubsw` multiplies the bytes and
//!   adds neighbours into 16 bits (|u·x + u'·x'| ≤ 2 · 15 · 127 = 3,810), eight lines' results
//!   are added as 16-bit integers (≤ 30,480: no overflow), and `vpmaddwd` by ones widens each
//!   32-bit lane's two halves into the block's 32-bit sum, which starts at `−8 · Σxq`;
//! - **int8** weights (stored signed, `q`): the sign trick — `vpmaddubsw(|q|, sign(xq, q))`
//!   (≤ 2 · 128 · 127 = 32,512 per pair) — widened every line, since two would overflow.
//!
//! Both give each block's exact integer `Σ q·xq`, then the same scaling and the same lane
//! sums as the reference, so the results are the reference's bit for bit. Weight rows are
//! decoded once per pass into the lane layout (16 blocks at a time, by four 8 × 8 transposes
//! of 32-bit words); activations are quantised into it the same way.
//!
//! Every function here needs AVX2 and FMA: the entry points enable them and the rest is
//! `#[inline(always)]` into them.

use std::arch::x86_64::*;

use super::{Line, OutColumns, QuantizedActs, TileRows, BLOCK, LANES};
use crate::quant::format::{QMatrix, QuantFormat};

/// 8 × 8 transpose of 32-bit words: `out[k]` word j = `r[j]` word k.
#[inline(always)]
unsafe fn transpose8(r: [__m256i; 8]) -> [__m256i; 8] {
    // SAFETY: AVX2 is enabled by the caller.
    unsafe {
        // t[2m] / t[2m + 1]: per 128-bit lane, words 0–1 / 2–3 of r[2m] and r[2m + 1]
        // interleaved.
        let mut t = [_mm256_setzero_si256(); 8];
        for m in 0..4 {
            t[2 * m] = _mm256_unpacklo_epi32(r[2 * m], r[2 * m + 1]);
            t[2 * m + 1] = _mm256_unpackhi_epi32(r[2 * m], r[2 * m + 1]);
        }
        // u[4n + p]: per 128-bit lane L, word p of L in rows 4n..4n + 4.
        let mut u = [_mm256_setzero_si256(); 8];
        for n in 0..2 {
            u[4 * n] = _mm256_unpacklo_epi64(t[4 * n], t[4 * n + 2]);
            u[4 * n + 1] = _mm256_unpackhi_epi64(t[4 * n], t[4 * n + 2]);
            u[4 * n + 2] = _mm256_unpacklo_epi64(t[4 * n + 1], t[4 * n + 3]);
            u[4 * n + 3] = _mm256_unpackhi_epi64(t[4 * n + 1], t[4 * n + 3]);
        }
        // Word p of each 128-bit lane: lane 0 holds word p, lane 1 word 4 + p.
        let mut out = [_mm256_setzero_si256(); 8];
        for p in 0..4 {
            out[p] = _mm256_permute2x128_si256::<0x20>(u[p], u[4 + p]);
            out[4 + p] = _mm256_permute2x128_si256::<0x31>(u[p], u[4 + p]);
        }
        out
    }
}

/// 16 blocks, each 64 bytes in element order as two vectors (words 0–7, 8–15), stored into a
/// chunk's 16 lines: line k, lane j = word k of block j.
#[inline(always)]
unsafe fn store_chunk(blocks: &[[__m256i; 2]; 16], lines: &mut [Line]) {
    debug_assert_eq!(lines.len(), LANES);
    // SAFETY: AVX2 is enabled by the caller; each store writes one 32-byte half of a 64-byte
    // aligned line of `lines` (16 of them).
    unsafe {
        for (group, half) in [(0usize, 0usize), (0, 1), (8, 0), (8, 1)] {
            let mut r = [_mm256_setzero_si256(); 8];
            for (j, v) in r.iter_mut().enumerate() {
                *v = blocks[group + j][half];
            }
            // Words 8·half.. of blocks group..group + 8: lines 8·half + k, lanes group...
            for (k, v) in transpose8(r).into_iter().enumerate() {
                let line = &mut lines[8 * half + k];
                let dst = line.0.as_mut_ptr().add(if group == 0 { 0 } else { 32 });
                _mm256_store_si256(dst.cast(), v);
            }
        }
    }
}

/// `n` bytes of `data` from `start` (fewer past its end, the rest zero).
#[inline(always)]
fn tail_bytes(data: &[u8], start: usize, n: usize) -> [u8; 64] {
    let mut buf = [0u8; 64];
    if start < data.len() {
        let avail = (data.len() - start).min(n);
        buf[..avail].copy_from_slice(&data[start..start + avail]);
    }
    buf
}

/// Block `b` of an int4 row as 64 unsigned nibbles in element order.
#[inline(always)]
unsafe fn int4_block(data: &[u8], b: usize) -> [__m256i; 2] {
    let start = b * BLOCK / 2;
    let tail;
    let ptr = if start + BLOCK / 2 <= data.len() {
        // SAFETY: in bounds, checked just above.
        unsafe { data.as_ptr().add(start) }
    } else {
        tail = tail_bytes(data, start, BLOCK / 2);
        tail.as_ptr()
    };
    // SAFETY: AVX2 is enabled by the caller; `ptr` has 32 readable bytes.
    unsafe {
        let v = _mm256_loadu_si256(ptr.cast());
        let mask = _mm256_set1_epi8(0x0F);
        let lo = _mm256_and_si256(v, mask);
        let hi = _mm256_and_si256(_mm256_srli_epi16::<4>(v), mask);
        // Per 128-bit lane: bytes 0–7 (8–15) of the lane, low nibble then high: elements
        // 0–15 / 32–47 (16–31 / 48–63).
        let e0 = _mm256_unpacklo_epi8(lo, hi);
        let e1 = _mm256_unpackhi_epi8(lo, hi);
        [
            _mm256_permute2x128_si256::<0x20>(e0, e1),
            _mm256_permute2x128_si256::<0x31>(e0, e1),
        ]
    }
}

/// Block `b` of an int8 row as 64 signed bytes in element order.
#[inline(always)]
unsafe fn int8_block(data: &[u8], b: usize) -> [__m256i; 2] {
    let start = b * BLOCK;
    let tail;
    let ptr = if start + BLOCK <= data.len() {
        // SAFETY: in bounds, checked just above.
        unsafe { data.as_ptr().add(start) }
    } else {
        tail = tail_bytes(data, start, BLOCK);
        tail.as_ptr()
    };
    // SAFETY: AVX2 is enabled by the caller; `ptr` has 64 readable bytes.
    unsafe {
        [
            _mm256_loadu_si256(ptr.cast()),
            _mm256_loadu_si256(ptr.add(32).cast()),
        ]
    }
}

/// One row of activations quantised into the lane layout (`lines`, `scales`, `sums`: this
/// row's, chunks · 16 each), by the scalar `quantize_block`'s arithmetic vector by vector (the
/// same bytes for finite `x`).
///
/// # Safety
/// The CPU has AVX2 and FMA; `lines`, `scales` and `sums` have
/// `16 · ceil(ceil(src.len() / 64) / 16)` elements.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn quantize_row(
    src: &[f32],
    lines: &mut [Line],
    scales: &mut [f32],
    sums: &mut [i32],
) {
    let z = _mm256_setzero_si256();
    for (c, chunk) in lines.chunks_exact_mut(LANES).enumerate() {
        let mut r = [[z; 2]; 16];
        for (j, row) in r.iter_mut().enumerate() {
            let b = c * LANES + j;
            // SAFETY: AVX2 and FMA are enabled here.
            (*row, scales[b], sums[b]) = match unsafe { quantize_block(src, b * BLOCK) } {
                Some(block) => block,
                None => ([z; 2], 0.0, 0),
            };
        }
        // SAFETY: AVX2 is enabled here; `chunk` is 16 aligned lines.
        unsafe { store_chunk(&r, chunk) };
    }
}

/// The block of `src` from element `start` (zero-padded past its end) by the scalar
/// `quantize_block`'s arithmetic: its 64 bytes in element order (elements 0–31, 32–63), scale
/// and integer sum; `None` for a block of zeros (or past the end, or not finite).
///
/// # Safety
/// The CPU has AVX2 and FMA.
#[inline(always)]
pub(super) unsafe fn quantize_block(src: &[f32], start: usize) -> Option<([__m256i; 2], f32, i32)> {
    let rounder = _mm256_set1_ps(super::ROUNDER);
    let (lo, hi) = (_mm256_set1_ps(-127.0), _mm256_set1_ps(127.0));
    let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
    // Words in `packs`' order (0, 2, 4, 6 | 1, 3, 5, 7) back into element order.
    let order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
    let z = _mm256_setzero_si256();
    let n = src.len().saturating_sub(start).min(BLOCK);
    let mut buf = [0.0f32; BLOCK];
    let ptr = if n == BLOCK {
        // SAFETY: `start + 64 <= src.len()`.
        unsafe { src.as_ptr().add(start) }
    } else {
        if n > 0 {
            buf[..n].copy_from_slice(&src[start..start + n]);
        }
        buf.as_ptr()
    };
    let mut v = [_mm256_setzero_ps(); 8];
    for (q, vq) in v.iter_mut().enumerate() {
        // SAFETY: `ptr` has 64 readable floats.
        *vq = unsafe { _mm256_loadu_ps(ptr.add(8 * q)) };
    }
    let mut amax = _mm256_and_ps(v[0], abs_mask);
    for vq in &v[1..] {
        amax = _mm256_max_ps(amax, _mm256_and_ps(*vq, abs_mask));
    }
    let m4 = _mm_max_ps(
        _mm256_castps256_ps128(amax),
        _mm256_extractf128_ps::<1>(amax),
    );
    let m2 = _mm_max_ps(m4, _mm_movehl_ps(m4, m4));
    let m = _mm_cvtss_f32(_mm_max_ss(m2, _mm_shuffle_ps::<1>(m2, m2)));
    if n == 0 || m == 0.0 || !m.is_finite() {
        return None;
    }
    let inv = _mm256_set1_ps(127.0 / m);
    let mut ints = [z; 8];
    let mut sum = z;
    for (i, vq) in ints.iter_mut().zip(&v) {
        let t = _mm256_sub_ps(_mm256_add_ps(_mm256_mul_ps(*vq, inv), rounder), rounder);
        *i = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(t, lo), hi));
        sum = _mm256_add_epi32(sum, *i);
    }
    // |values| ≤ 127: the saturating packs are exact.
    let mut row = [z; 2];
    for (h, half) in row.iter_mut().enumerate() {
        let a = _mm256_packs_epi32(ints[4 * h], ints[4 * h + 1]);
        let b = _mm256_packs_epi32(ints[4 * h + 2], ints[4 * h + 3]);
        *half = _mm256_permutevar8x32_epi32(_mm256_packs_epi16(a, b), order);
    }
    let s4 = _mm_add_epi32(
        _mm256_castsi256_si128(sum),
        _mm256_extracti128_si256::<1>(sum),
    );
    let s2 = _mm_add_epi32(s4, _mm_unpackhi_epi64(s4, s4));
    let sum = _mm_cvtsi128_si32(_mm_add_epi32(s2, _mm_shuffle_epi32::<1>(s2)));
    Some((row, m / 127.0, sum))
}

/// This kernel's pieces for the shared pass loop (`super::tile_rows`).
struct Kernel;

impl super::Tiles for Kernel {
    const WR: usize = 4;
    const AR: usize = 2;
    /// Whether the weights are int8 (else int4).
    type Format = bool;

    fn format(w: &QMatrix<'_>) -> bool {
        w.format() == QuantFormat::Int8PerRow
    }

    /// Row `o` of `w` in the lane layout (`out.len()` = chunks · 16): int4 as unsigned nibbles,
    /// int8 as its signed bytes.
    #[inline(always)]
    unsafe fn decode_row(w: &QMatrix<'_>, o: usize, out: &mut [Line]) {
        let data = w.row_data(o);
        let int8 = w.format() == QuantFormat::Int8PerRow;
        let blocks = w.cols().div_ceil(BLOCK);
        // SAFETY: AVX2 is enabled by the caller.
        unsafe {
            let z = _mm256_setzero_si256();
            for (c, lines) in out.chunks_exact_mut(LANES).enumerate() {
                let mut r = [[z; 2]; 16];
                for (j, v) in r.iter_mut().enumerate() {
                    let b = c * LANES + j;
                    if b < blocks {
                        *v = if int8 {
                            int8_block(data, b)
                        } else {
                            int4_block(data, b)
                        };
                    }
                }
                store_chunk(&r, lines);
            }
        }
    }

    /// One tile: rows `0..NW` of the decoded weights (`wl`, `ws`: [NW][blocks]) against
    /// activation rows `t0..t0 + NA`; returns `[w][a]`.
    ///
    /// # Safety
    /// The CPU has AVX2 and FMA; `wl` and `ws` hold `NW · blocks` elements and `x` has at
    /// least `t0 + NA` rows.
    #[inline(always)]
    unsafe fn tile<const NW: usize, const NA: usize>(
        wl: &[Line],
        ws: &[f32],
        x: &QuantizedActs,
        t0: usize,
        int8: bool,
    ) -> [[f32; NA]; NW] {
        // SAFETY: AVX2 and FMA are enabled by the caller. The row pointers start inside `wl`
        // (row r < NW) and `x.q`/`x.sums`/`x.scales` (row `t0 + a < x.rows`), and every offset
        // added below is `base + k < blocks` lines (plus 32 bytes: the second half of a line) or
        // `base + 8h + 8 <= blocks` values into its row, so each load is in bounds; lines are
        // 64-byte aligned.
        unsafe {
            let TileRows {
                w_lines,
                w_scales,
                x_lines,
                x_sums,
                x_scales,
            } = TileRows::<NW, NA>::new(wl, ws, x, t0);
            // Byte pointers: the loads below address half lines.
            let w_rows = w_lines.map(|p| p.cast::<u8>());
            let x_rows = x_lines.map(|p| p.cast::<u8>());
            let ones = _mm256_set1_epi16(1);
            let z = _mm256_setzero_si256();
            let mut sums = [[[_mm256_setzero_ps(); NA]; NW]; 2];
            for c in 0..x.chunks {
                let base = c * LANES;
                for (h, sums) in sums.iter_mut().enumerate() {
                    // Byte offset of line k's half h.
                    let at = |k: usize| 64 * k + 32 * h;
                    let mut acc = [[z; NA]; NW];
                    if int8 {
                        for k in base..base + LANES {
                            let mut wv = [z; NW];
                            let mut wa = [z; NW];
                            for r in 0..NW {
                                wv[r] = _mm256_load_si256(w_rows[r].add(at(k)).cast());
                                wa[r] = _mm256_abs_epi8(wv[r]);
                            }
                            for a in 0..NA {
                                let xv = _mm256_load_si256(x_rows[a].add(at(k)).cast());
                                for r in 0..NW {
                                    let p =
                                        _mm256_maddubs_epi16(wa[r], _mm256_sign_epi8(xv, wv[r]));
                                    acc[r][a] =
                                        _mm256_add_epi32(acc[r][a], _mm256_madd_epi16(p, ones));
                                }
                            }
                        }
                    } else {
                        // Each lane starts at −8 · Σxq of its block, so the sum ends at Σ q · xq.
                        for a in 0..NA {
                            let sx = _mm256_loadu_si256(x_sums[a].add(base + 8 * h).cast());
                            let init = _mm256_sub_epi32(z, _mm256_slli_epi32::<3>(sx));
                            for row in acc.iter_mut() {
                                row[a] = init;
                            }
                        }
                        for g in 0..2 {
                            let mut acc16 = [[z; NA]; NW];
                            for k in base + 8 * g..base + 8 * g + 8 {
                                let mut wv = [z; NW];
                                for r in 0..NW {
                                    wv[r] = _mm256_load_si256(w_rows[r].add(at(k)).cast());
                                }
                                for a in 0..NA {
                                    let xv = _mm256_load_si256(x_rows[a].add(at(k)).cast());
                                    for r in 0..NW {
                                        acc16[r][a] = _mm256_add_epi16(
                                            acc16[r][a],
                                            _mm256_maddubs_epi16(wv[r], xv),
                                        );
                                    }
                                }
                            }
                            for r in 0..NW {
                                for a in 0..NA {
                                    acc[r][a] = _mm256_add_epi32(
                                        acc[r][a],
                                        _mm256_madd_epi16(acc16[r][a], ones),
                                    );
                                }
                            }
                        }
                    }
                    for a in 0..NA {
                        let sx = _mm256_loadu_ps(x_scales[a].add(base + 8 * h));
                        for r in 0..NW {
                            let sw = _mm256_loadu_ps(w_scales[r].add(base + 8 * h));
                            sums[r][a] = _mm256_fmadd_ps(
                                _mm256_cvtepi32_ps(acc[r][a]),
                                _mm256_mul_ps(sw, sx),
                                sums[r][a],
                            );
                        }
                    }
                }
            }
            // `sum_lanes`' tree: lane i + lane i + 8, then + 4, + 2, + 1.
            let mut out = [[0.0f32; NA]; NW];
            for r in 0..NW {
                for a in 0..NA {
                    let v8 = _mm256_add_ps(sums[0][r][a], sums[1][r][a]);
                    let v4 = _mm_add_ps(_mm256_castps256_ps128(v8), _mm256_extractf128_ps::<1>(v8));
                    let v2 = _mm_add_ps(v4, _mm_movehl_ps(v4, v4));
                    out[r][a] = _mm_cvtss_f32(_mm_add_ss(v2, _mm_shuffle_ps::<1>(v2, v2)));
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
#[target_feature(enable = "avx2,fma")]
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

/// [`transpose8`] for the tests.
#[cfg(test)]
#[inline(always)]
pub(super) unsafe fn transpose8_for_tests(r: [__m256i; 8]) -> [__m256i; 8] {
    // SAFETY: forwarded: the caller enables AVX2.
    unsafe { transpose8(r) }
}
