//! AVX2 + FMA (+ F16C): the vector operations of the x86 tile driver (`driver.rs`) on 8 f32
//! lanes, and its entry points. Tiles of up to three activation rows with one weight row (one
//! with a weight-row pair), every weight row of a matrix by itself, so that accumulators and
//! decoded weights fit the 16 ymm registers; int4 decoded 32 elements per load
//! ([`Isa::int4_x4`]). Weights are dequantised exactly to f32, so the result is the f32 dot
//! product of the reference weights in the driver's fixed order (see the module docs of
//! `kernels`).
//!
//! Every function here needs AVX2, FMA and F16C; the entry points carry `#[target_feature]` and
//! the rest is `#[inline(always)]` into them.

use std::arch::x86_64::*;
use std::ptr;

use super::driver::{isa_entry_points, Isa, A, D};
use crate::quant::format::QMatrix;

/// The AVX2 + FMA + F16C instruction set.
#[derive(Clone, Copy)]
pub(super) struct Avx2;

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

/// bf16 → f32: the 16 bits are the top half.
#[inline(always)]
unsafe fn bf16_to_f32(b: __m128i) -> __m256 {
    // SAFETY: AVX2 guaranteed by the caller.
    unsafe { _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(b))) }
}

/// The sum of the 8 lanes of `v` in a fixed tree: halves, pairs, lanes (the last steps of
/// every x86 reduction: this path's, AVX-512's and `vecops`').
#[inline(always)]
pub(super) unsafe fn sum_lanes(v: __m256) -> f32 {
    // SAFETY: AVX guaranteed by the caller.
    unsafe {
        let q = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)))
    }
}

impl Isa for Avx2 {
    type V = __m256;
    type Mask = __m256i;
    const L: usize = 8;
    /// 6 accumulators + 4 decoded vectors.
    const TILE: usize = 3;
    /// 4 accumulators + 8 decoded vectors.
    const TILE_PAIR: usize = 1;
    const TILE_QUAD: Option<usize> = None;
    const INT4_PREFETCH_BYTES: Option<usize> = None;

    #[inline(always)]
    unsafe fn zero() -> __m256 {
        // SAFETY: AVX guaranteed by the caller.
        unsafe { _mm256_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn splat(v: f32) -> __m256 {
        // SAFETY: AVX guaranteed by the caller.
        unsafe { _mm256_set1_ps(v) }
    }

    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m256 {
        // SAFETY: the caller's: AVX, and 8 readable floats at `p`.
        unsafe { _mm256_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn load_masked(m: __m256i, p: *const f32) -> __m256 {
        // SAFETY: the caller's: AVX, and the lanes of `m` readable (the others are not read).
        unsafe { _mm256_maskload_ps(p, m) }
    }

    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m256) {
        // SAFETY: the caller's: AVX, and 8 writable floats at `p`.
        unsafe { _mm256_storeu_ps(p, v) }
    }

    #[inline(always)]
    unsafe fn first_lanes(r: usize) -> __m256i {
        // SAFETY: AVX2 guaranteed by the caller.
        unsafe {
            _mm256_cmpgt_epi32(
                _mm256_set1_epi32(r as i32),
                _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
            )
        }
    }

    #[inline(always)]
    unsafe fn zero_outside(m: __m256i, v: __m256) -> __m256 {
        // SAFETY: AVX guaranteed by the caller.
        unsafe { _mm256_and_ps(v, _mm256_castsi256_ps(m)) }
    }

    #[inline(always)]
    unsafe fn fma(a: __m256, b: __m256, acc: __m256) -> __m256 {
        // SAFETY: FMA guaranteed by the caller.
        unsafe { _mm256_fmadd_ps(a, b, acc) }
    }

    /// a0 + a1, then halves, pairs, lanes.
    #[inline(always)]
    unsafe fn reduce(acc: [__m256; A]) -> f32 {
        // SAFETY: AVX guaranteed by the caller.
        unsafe { sum_lanes(_mm256_add_ps(acc[0], acc[1])) }
    }

    #[inline(always)]
    unsafe fn int8(p: *const u8, scale: __m256) -> __m256 {
        // SAFETY: the caller's: AVX2, and 8 readable bytes at `p`.
        unsafe { deq(_mm_loadl_epi64(p as *const __m128i), scale) }
    }

    #[inline(always)]
    unsafe fn int4(p: *const u8, scale: __m256) -> __m256 {
        // SAFETY: the caller's: AVX2, and 4 readable bytes at `p`.
        unsafe {
            let word = ptr::read_unaligned(p as *const i32);
            deq(nibbles4(_mm_cvtsi32_si128(word)), scale)
        }
    }

    /// The 32 nibbles of 16 bytes from one load, widened together.
    #[inline(always)]
    unsafe fn int4_x4(p: *const u8, scales: [__m256; D]) -> [__m256; D] {
        // SAFETY: the caller's: AVX2, and 16 readable bytes at `p`.
        unsafe {
            let b = _mm_loadu_si128(p as *const __m128i);
            let t = _mm256_cvtepu8_epi16(b);
            let u = _mm256_and_si256(
                _mm256_or_si256(t, _mm256_slli_epi16::<4>(t)),
                _mm256_set1_epi16(0x0F0F),
            );
            let q = _mm256_sub_epi8(u, _mm256_set1_epi8(8));
            let (lo, hi) = (_mm256_castsi256_si128(q), _mm256_extracti128_si256::<1>(q));
            [
                deq(lo, scales[0]),
                deq(_mm_srli_si128::<8>(lo), scales[1]),
                deq(hi, scales[2]),
                deq(_mm_srli_si128::<8>(hi), scales[3]),
            ]
        }
    }

    #[inline(always)]
    unsafe fn bf16(p: *const u8) -> __m256 {
        // SAFETY: the caller's: AVX2, and 16 readable bytes at `p`.
        unsafe { bf16_to_f32(_mm_loadu_si128(p as *const __m128i)) }
    }

    #[inline(always)]
    unsafe fn f16(p: *const u8) -> __m256 {
        // SAFETY: the caller's: F16C, and 16 readable bytes at `p`.
        unsafe { _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)) }
    }

    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: a prefetch never faults, whatever the address; SSE is part of x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
    }
}

isa_entry_points!(Avx2, "avx2,fma,f16c");
