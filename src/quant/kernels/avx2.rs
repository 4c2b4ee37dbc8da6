//! AVX2 + FMA (+ F16C) kernels: 8 f32 lanes, two accumulators per dot product (vector v →
//! v % 2), int4 decoded 32 elements per load, tiles of up to three activation rows (one with a
//! weight-row pair) so that accumulators and decoded weights fit the 16 ymm registers. Weights
//! are dequantised exactly to f32, so the result is the f32 dot product of the reference
//! weights in this path's fixed order (see the module docs of `kernels`).
//!
//! Every function here needs AVX2, FMA and F16C; the entry points carry `#[target_feature]` and
//! the helpers are `#[inline(always)]` into them.

use std::arch::x86_64::*;
use std::ptr;

use super::group_magic;
use crate::quant::format::{QMatrix, QuantFormat};

/// Lanes per vector.
const L: usize = 8;
/// Independent accumulators per dot product (vector v → accumulator v % A).
const A: usize = 2;
/// Vectors decoded together (one load of packed weights).
const D: usize = 4;
/// Activation rows per tile with one weight row (6 accumulators).
const TILE: usize = 3;
/// Activation rows per tile with two weight rows (4 accumulators).
const TILE_PAIR: usize = 1;

/// A weight row as a sequence of exactly dequantised 8-lane vectors. Implementations hold raw
/// pointers into a row whose length matches the `n` the caller iterates over.
trait Src: Copy {
    /// Vector `v` (elements 8v .. 8v+7, all inside the row).
    unsafe fn one(self, v: usize) -> __m256;
    /// Vectors 4c .. 4c+3 (all full; D = 4).
    #[inline(always)]
    unsafe fn chunk(self, c: usize) -> [__m256; D] {
        // SAFETY: forwarded contract: vectors 4c..4c+3 are full.
        unsafe {
            [
                self.one(D * c),
                self.one(D * c + 1),
                self.one(D * c + 2),
                self.one(D * c + 3),
            ]
        }
    }
    /// The last, partial vector `v` holding `r` (1..8) elements; lanes ≥ r are +0.
    unsafe fn tail(self, v: usize, r: usize) -> __m256;
}

/// All-ones in lanes < r, zero elsewhere.
#[inline(always)]
unsafe fn mask(r: usize) -> __m256i {
    // SAFETY: AVX2 guaranteed by the caller.
    unsafe {
        _mm256_cmpgt_epi32(
            _mm256_set1_epi32(r as i32),
            _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
        )
    }
}

/// Zero the lanes ≥ r.
#[inline(always)]
unsafe fn keep(r: usize, v: __m256) -> __m256 {
    // SAFETY: AVX guaranteed by the caller.
    unsafe { _mm256_and_ps(v, _mm256_castsi256_ps(mask(r))) }
}

/// int4 (grouped or per-row): element 2j is the low nibble of byte j, 2j+1 the high one;
/// w = (nibble − 8) · scale[group(v)].
#[derive(Clone, Copy)]
struct Int4 {
    data: *const u8,
    scales: *const f32,
    magic: u64,
}

impl Int4 {
    #[inline(always)]
    unsafe fn scale(self, v: usize) -> __m256 {
        // SAFETY: `group_magic` maps every vector of the row to its group, < scales_per_row.
        unsafe { _mm256_set1_ps(*self.scales.add(((v as u64 * self.magic) >> 32) as usize)) }
    }
}

/// The low 4 bytes of `b` → 8 signed bytes `nibble − 8` in element order (low 8 bytes).
#[inline(always)]
unsafe fn nibbles4(b: __m128i) -> __m128i {
    // SAFETY: SSE4.1 is implied by the AVX2 the caller guarantees.
    unsafe {
        // u16 lane j = byte j; then its low byte = the low nibble and its high byte = the high
        // nibble: the bytes are in element order.
        let t = _mm_cvtepu8_epi16(b);
        let u = _mm_and_si128(
            _mm_or_si128(t, _mm_slli_epi16::<4>(t)),
            _mm_set1_epi16(0x0F0F),
        );
        _mm_sub_epi8(u, _mm_set1_epi8(8))
    }
}

/// The low 8 signed bytes of `q` → f32 · scale.
#[inline(always)]
unsafe fn deq(q: __m128i, scale: __m256) -> __m256 {
    // SAFETY: AVX2 guaranteed by the caller.
    unsafe { _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q)), scale) }
}

impl Src for Int4 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m256 {
        // SAFETY: vector v is full, so bytes 4v .. 4v+4 are in the row.
        unsafe {
            let word = ptr::read_unaligned(self.data.add(v * 4) as *const i32);
            deq(nibbles4(_mm_cvtsi32_si128(word)), self.scale(v))
        }
    }

    #[inline(always)]
    unsafe fn chunk(self, c: usize) -> [__m256; D] {
        // SAFETY: vectors 4c..4c+3 are full, so bytes 16c .. 16c+16 are in the row.
        unsafe {
            let b = _mm_loadu_si128(self.data.add(c * 16) as *const __m128i);
            let t = _mm256_cvtepu8_epi16(b);
            let u = _mm256_and_si256(
                _mm256_or_si256(t, _mm256_slli_epi16::<4>(t)),
                _mm256_set1_epi16(0x0F0F),
            );
            let q = _mm256_sub_epi8(u, _mm256_set1_epi8(8));
            let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
            let v = D * c;
            [
                deq(lo, self.scale(v)),
                deq(_mm_srli_si128::<8>(lo), self.scale(v + 1)),
                deq(hi, self.scale(v + 2)),
                deq(_mm_srli_si128::<8>(hi), self.scale(v + 3)),
            ]
        }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, r: usize) -> __m256 {
        // SAFETY: the row ends ceil(r/2) bytes after byte 4v; padding nibbles read as 8 (0).
        unsafe {
            let mut buf = [0x88u8; 4];
            ptr::copy_nonoverlapping(self.data.add(v * 4), buf.as_mut_ptr(), r.div_ceil(2));
            let word = i32::from_le_bytes(buf);
            keep(r, deq(nibbles4(_mm_cvtsi32_si128(word)), self.scale(v)))
        }
    }
}

/// int8 per row: w = q · scale.
#[derive(Clone, Copy)]
struct Int8 {
    data: *const u8,
    scale: f32,
}

impl Src for Int8 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m256 {
        // SAFETY: bytes 8v .. 8v+8 are in the row.
        unsafe {
            let b = _mm_loadl_epi64(self.data.add(v * L) as *const __m128i);
            deq(b, _mm256_set1_ps(self.scale))
        }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, r: usize) -> __m256 {
        // SAFETY: the row ends r bytes after byte 8v.
        unsafe {
            let mut buf = [0u8; 16];
            ptr::copy_nonoverlapping(self.data.add(v * L), buf.as_mut_ptr(), r);
            let b = _mm_loadu_si128(buf.as_ptr() as *const __m128i);
            keep(r, deq(b, _mm256_set1_ps(self.scale)))
        }
    }
}

/// bf16: the 16 bits are the top half of the f32.
#[derive(Clone, Copy)]
struct Bf16(*const u8);

#[inline(always)]
unsafe fn bf16_to_f32(b: __m128i) -> __m256 {
    // SAFETY: AVX2 guaranteed by the caller.
    unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(b))) }
}

impl Src for Bf16 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m256 {
        // SAFETY: bytes 16v .. 16v+16 are in the row.
        unsafe { bf16_to_f32(_mm_loadu_si128(self.0.add(v * 2 * L) as *const __m128i)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, r: usize) -> __m256 {
        // SAFETY: the row ends 2r bytes after byte 16v.
        unsafe {
            let mut buf = [0u8; 2 * L];
            ptr::copy_nonoverlapping(self.0.add(v * 2 * L), buf.as_mut_ptr(), 2 * r);
            bf16_to_f32(_mm_loadu_si128(buf.as_ptr() as *const __m128i))
        }
    }
}

/// IEEE half: `vcvtph2ps` (F16C) is exact (subnormals included).
#[derive(Clone, Copy)]
struct F16(*const u8);

impl Src for F16 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m256 {
        // SAFETY: bytes 16v .. 16v+16 are in the row; F16C guaranteed by the caller.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(self.0.add(v * 2 * L) as *const __m128i)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, r: usize) -> __m256 {
        // SAFETY: the row ends 2r bytes after byte 16v.
        unsafe {
            let mut buf = [0u8; 2 * L];
            ptr::copy_nonoverlapping(self.0.add(v * 2 * L), buf.as_mut_ptr(), 2 * r);
            _mm256_cvtph_ps(_mm_loadu_si128(buf.as_ptr() as *const __m128i))
        }
    }
}

/// f32 (little-endian bytes, any alignment), or a decoded row buffer.
#[derive(Clone, Copy)]
struct F32(*const f32);

impl Src for F32 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m256 {
        // SAFETY: elements 8v .. 8v+8 are in the row.
        unsafe { _mm256_loadu_ps(self.0.add(v * L)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, r: usize) -> __m256 {
        // SAFETY: masked lanes are not read (fault suppression), the rest are in the row.
        unsafe { _mm256_maskload_ps(self.0.add(v * L), mask(r)) }
    }
}

/// Sum of the accumulators in a fixed tree: a0 + a1, then halves, pairs, lanes.
#[inline(always)]
unsafe fn reduce(a: [__m256; A]) -> f32 {
    // SAFETY: AVX guaranteed by the caller.
    unsafe {
        let v = _mm256_add_ps(a[0], a[1]);
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)))
    }
}

/// Accumulate vectors `v0..v1` of `NW` weight rows against `T` activation rows of length `n`
/// (`x[t]` points at element `v0 · L` of row t) into `acc`: vector v goes to accumulator v % A of every (weight row, activation row); the
/// partial last vector (number n / L) has its lanes past n zero in W and X. `v0` is a multiple
/// of D, so walking 0..n.div_ceil(L) in consecutive ranges performs exactly the same
/// operations on every accumulator as walking it in one go.
#[inline(always)]
unsafe fn accumulate<S: Src, const NW: usize, const T: usize>(
    w: [S; NW],
    x: [*const f32; T],
    n: usize,
    v0: usize,
    v1: usize,
    acc: &mut [[[__m256; A]; T]; NW],
) {
    // SAFETY: the caller guarantees the CPU features, that each `x[t]` points at the
    // elements v0·L .. min(v1·L, n) of a row and each source at a row of n elements.
    unsafe {
        let (nv, r) = (n / L, n % L);
        let full = v1.min(nv);
        let mut v = v0;
        while v + D <= full {
            let mut wv = [[_mm256_setzero_ps(); D]; NW];
            for k in 0..NW {
                wv[k] = w[k].chunk(v / D);
            }
            for t in 0..T {
                for j in 0..D {
                    let xv = _mm256_loadu_ps(x[t].add((v - v0 + j) * L));
                    for k in 0..NW {
                        acc[k][t][j % A] = _mm256_fmadd_ps(wv[k][j], xv, acc[k][t][j % A]);
                    }
                }
            }
            v += D;
        }
        while v < full {
            let mut wv = [_mm256_setzero_ps(); NW];
            for k in 0..NW {
                wv[k] = w[k].one(v);
            }
            for t in 0..T {
                let xv = _mm256_loadu_ps(x[t].add((v - v0) * L));
                for k in 0..NW {
                    acc[k][t][v % A] = _mm256_fmadd_ps(wv[k], xv, acc[k][t][v % A]);
                }
            }
            v += 1;
        }
        if r > 0 && v1 > nv {
            let mut wv = [_mm256_setzero_ps(); NW];
            for k in 0..NW {
                wv[k] = w[k].tail(nv, r);
            }
            for t in 0..T {
                let xv = _mm256_maskload_ps(x[t].add((nv - v0) * L), mask(r));
                for k in 0..NW {
                    acc[k][t][nv % A] = _mm256_fmadd_ps(wv[k], xv, acc[k][t][nv % A]);
                }
            }
        }
    }
}

/// Dot products of `NW` weight rows with `T` activation rows of length `n` in one pass: each
/// decoded weight vector is applied to all `T` rows. The tiles of one call after the first
/// decode the same weight row again, from L1: memory is read once per call whatever S is.
#[inline(always)]
unsafe fn dot_tile<S: Src, const NW: usize, const T: usize>(
    w: [S; NW],
    x: [*const f32; T],
    n: usize,
) -> [[f32; T]; NW] {
    // SAFETY: forwarded contract of `accumulate`.
    unsafe {
        let mut acc = [[[_mm256_setzero_ps(); A]; T]; NW];
        accumulate(w, x, n, 0, n.div_ceil(L), &mut acc);
        let mut y = [[0.0f32; T]; NW];
        for k in 0..NW {
            for t in 0..T {
                y[k][t] = reduce(acc[k][t]);
            }
        }
        y
    }
}

/// All `s` activation rows against `NW` weight rows, tile by tile. `out[k]` points at `s`
/// floats for weight row k.
#[inline(always)]
unsafe fn tiles<S: Src, const NW: usize, const TM: usize>(
    w: [S; NW],
    x: &[f32],
    s: usize,
    n: usize,
    out: [*mut f32; NW],
) {
    // SAFETY: `x` holds s rows of n; each `out[k]` points at s writable floats.
    unsafe {
        const { assert!(matches!(TM, 1..=4 | 8)) };
        let xp = x.as_ptr();
        macro_rules! tile {
            ($t:literal, $t0:expr) => {{
                let mut xs = [xp; $t];
                for (i, p) in xs.iter_mut().enumerate() {
                    *p = xp.add(($t0 + i) * n);
                }
                let y = dot_tile::<S, NW, $t>(w, xs, n);
                for k in 0..NW {
                    for i in 0..$t {
                        *out[k].add($t0 + i) = y[k][i];
                    }
                }
            }};
        }
        for_tiles!(s, TM, tile);
    }
}

/// Rows `o0..o0 + rows` of `NW` matrices (`make(k, o)` is row o of matrix k) against all `s`
/// activation rows, into `out[k]` ([rows, s]).
#[inline(always)]
unsafe fn rows_src<S: Src, const NW: usize, const TM: usize>(
    make: impl Fn(usize, usize) -> S,
    n: usize,
    o0: usize,
    x: &[f32],
    s: usize,
    out: [&mut [f32]; NW],
) {
    // SAFETY: forwarded from `rows`.
    unsafe {
        for i in 0..out[0].len() / s {
            let mut w = [make(0, o0 + i); NW];
            let mut y = [std::ptr::null_mut(); NW];
            for k in 0..NW {
                w[k] = make(k, o0 + i);
                y[k] = out[k].as_mut_ptr().add(i * s);
            }
            tiles::<S, NW, TM>(w, x, s, n, y);
        }
    }
}

/// Row `o` of `w` dequantised into `out` (`w.cols()` floats): the same exact f32 weights as
/// `pack::reference_dequantize_row`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `o < w.rows()` and `out.len() >= w.cols()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize_row(w: &QMatrix<'_>, o: usize, out: &mut [f32]) {
    // SAFETY: the caller's contract; each source spans the `w.cols()` elements of row o.
    unsafe { dequantize_row_into!(w, o, out) }
}

/// `v` into the 8 floats at `p`.
#[inline(always)]
unsafe fn store(p: *mut f32, v: __m256) {
    // SAFETY: the caller's: AVX, and 8 writable floats at `p`.
    unsafe { _mm256_storeu_ps(p, v) }
}

/// The partial vector `v` of a row of `n` elements into `out` (its `n % 8` elements).
#[inline(always)]
unsafe fn store_last<S: Src>(src: S, v: usize, n: usize, out: &mut [f32]) {
    let mut last = [0.0f32; L];
    // SAFETY: the caller's: AVX2, and vector v is the row's partial last one.
    unsafe { _mm256_storeu_ps(last.as_mut_ptr(), src.tail(v, n % L)) };
    out.copy_from_slice(&last[..out.len()]);
}

/// `out[i·s + t] = W[o0 + i] · x_t` for the rows `o0..o0 + out.len()/s`.
///
/// # Safety
/// The CPU supports AVX2, FMA and F16C; `x.len() == s · w.cols()`, `s > 0`,
/// `out.len()` is a multiple of s and `o0 + out.len()/s <= w.rows()`.
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn rows(w: &QMatrix<'_>, o0: usize, x: &[f32], s: usize, out: &mut [f32]) {
    let n = w.cols();
    // SAFETY: the caller's contract; `mk` builds sources over whole rows of n elements.
    unsafe {
        with_src!(w.format(), |mk| rows_src::<_, 1, TILE>(
            |_, o| mk(w, o),
            n,
            o0,
            x,
            s,
            [out]
        ))
    }
}

/// [`rows`] for two matrices of the same shape (gate and up), sharing the activation loads.
///
/// # Safety
/// As [`rows`], for both `a` and `b`, which have the same shape; `out_a` and `out_b` have the
/// same length.
#[target_feature(enable = "avx2,fma,f16c")]
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
    let n = a.cols();
    // SAFETY: the caller's contract. Mixed formats fall back to one matrix at a time, which
    // computes every dot product in the same order.
    unsafe {
        if a.format() != b.format() {
            rows(a, o0, x, s, out_a);
            rows(b, o0, x, s, out_b);
            return;
        }
        with_src!(a.format(), |mk| rows_src::<_, 2, TILE_PAIR>(
            |k, o| if k == 0 { mk(a, o) } else { mk(b, o) },
            n,
            o0,
            x,
            s,
            [out_a, out_b]
        ))
    }
}

/// Independent FMA chains of [`fma_peak`]: 12 × 4 cycles of latency covers two FMA pipes.
const PEAK_CHAINS: usize = 12;

/// `iters` rounds of [`PEAK_CHAINS`] independent 8-lane FMAs: the f32 FMA ceiling on this
/// path, for benches.
///
/// # Safety
/// The CPU supports AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn fma_peak(iters: usize, seed: f32) -> f32 {
    let mut acc = [_mm256_set1_ps(seed); PEAK_CHAINS];
    let (a, b) = (_mm256_set1_ps(0.999_99), _mm256_set1_ps(1e-7));
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm256_fmadd_ps(*c, a, b);
        }
    }
    let mut out = [0.0f32; L];
    let mut sum = _mm256_setzero_ps();
    for c in acc {
        sum = _mm256_add_ps(sum, c);
    }
    // SAFETY: `out` holds L floats.
    unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
    out.iter().sum()
}

/// Flops per iteration of [`fma_peak`].
pub(super) const PEAK_FLOPS_PER_ITER: usize = PEAK_CHAINS * 2 * L;
