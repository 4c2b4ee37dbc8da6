//! AVX-512 (F + BW): the vector operations of the x86 tile driver (`driver.rs`) on 16 f32
//! lanes, its entry points, and this path's own row sources. Tiles of four weight rows × up to
//! two activation rows (the last rows: two × up to four, one × up to eight; 16 accumulators
//! each), activations in 64-byte-aligned rows. Int4 whose groups are whole 32-element blocks
//! (gs a multiple of 32, or per row; the docs/container.md default gs64 among them) is decoded
//! through a 16-entry table per group (`vpermps`, [`Int4Lut`]) against activations rearranged
//! once per call into even/odd halves of each block; gs 16 and 48 use the shift-and-convert
//! decode (`sources::Int4`). Weights are dequantised exactly to f32 (no integer-activation
//! tricks), so the result is the f32 dot product of the reference weights in the driver's
//! fixed order (see the module docs of `kernels`).
//!
//! Every function here needs AVX-512 F and BW; the entry points carry `#[target_feature]` and
//! the rest is `#[inline(always)]` into them (the intrinsics need Rust 1.89, the crate's
//! MSRV).

use std::arch::x86_64::*;
use std::ptr;

use super::driver::{isa_entry_points, Isa, OverSources, Src, A, D};
use super::sources::{self, Int8};
use crate::quant::format::{QMatrix, QuantFormat};

/// The AVX-512 F + BW instruction set.
#[derive(Clone, Copy)]
pub(super) struct Avx512;

/// Lanes per vector.
const L: usize = 16;

/// The low `r` (0..=16) lanes.
#[inline(always)]
fn mask(r: usize) -> __mmask16 {
    debug_assert!(r <= L);
    ((1u32 << r) - 1) as __mmask16
}

/// The low 8 bytes of `b` → 16 signed bytes `nibble − 8` in element order.
#[inline(always)]
unsafe fn nibbles8(b: __m128i) -> __m128i {
    // SAFETY: SSE4.1 is implied by the AVX-512 F the caller guarantees.
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

/// 16 signed bytes → f32 · scale.
#[inline(always)]
unsafe fn deq(q: __m128i, scale: __m512) -> __m512 {
    // SAFETY: AVX-512 F guaranteed by the caller.
    unsafe { _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)), scale) }
}

/// bf16 → f32: the 16 bits are the top half.
#[inline(always)]
unsafe fn bf16_to_f32(b: __m256i) -> __m512 {
    // SAFETY: AVX-512 F guaranteed by the caller.
    unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(b))) }
}

impl Isa for Avx512 {
    type V = __m512;
    type Mask = __mmask16;
    const L: usize = L;
    /// 16 accumulators.
    const TILE: usize = 8;
    /// 16 accumulators.
    const TILE_PAIR: usize = 4;
    /// 16 accumulators.
    const TILE_QUAD: Option<usize> = Some(2);
    const INT4_PREFETCH_BYTES: Option<usize> = Some(INT4_PREFETCH_BYTES);

    #[inline(always)]
    unsafe fn zero() -> __m512 {
        // SAFETY: AVX-512 F guaranteed by the caller.
        unsafe { _mm512_setzero_ps() }
    }

    #[inline(always)]
    unsafe fn splat(v: f32) -> __m512 {
        // SAFETY: AVX-512 F guaranteed by the caller.
        unsafe { _mm512_set1_ps(v) }
    }

    #[inline(always)]
    unsafe fn load(p: *const f32) -> __m512 {
        // SAFETY: the caller's: AVX-512 F, and 16 readable floats at `p`.
        unsafe { _mm512_loadu_ps(p) }
    }

    #[inline(always)]
    unsafe fn load_masked(m: __mmask16, p: *const f32) -> __m512 {
        // SAFETY: the caller's: AVX-512 F, and the lanes of `m` readable (the others are not
        // read: fault suppression).
        unsafe { _mm512_maskz_loadu_ps(m, p) }
    }

    #[inline(always)]
    unsafe fn store(p: *mut f32, v: __m512) {
        // SAFETY: the caller's: AVX-512 F, and 16 writable floats at `p`.
        unsafe { _mm512_storeu_ps(p, v) }
    }

    #[inline(always)]
    unsafe fn first_lanes(r: usize) -> __mmask16 {
        mask(r)
    }

    #[inline(always)]
    unsafe fn zero_outside(m: __mmask16, v: __m512) -> __m512 {
        // SAFETY: AVX-512 F guaranteed by the caller.
        unsafe { _mm512_maskz_mov_ps(m, v) }
    }

    #[inline(always)]
    unsafe fn fma(a: __m512, b: __m512, acc: __m512) -> __m512 {
        // SAFETY: AVX-512 F guaranteed by the caller.
        unsafe { _mm512_fmadd_ps(a, b, acc) }
    }

    /// a0 + a1, then halves, then as AVX2 (quarters, pairs, lanes).
    #[inline(always)]
    unsafe fn reduce(acc: [__m512; A]) -> f32 {
        // SAFETY: AVX-512 F guaranteed by the caller.
        unsafe {
            let v = _mm512_add_ps(acc[0], acc[1]);
            let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
            super::avx2::sum_lanes(_mm256_add_ps(_mm512_castps512_ps256(v), hi))
        }
    }

    #[inline(always)]
    unsafe fn int8(p: *const u8, scale: __m512) -> __m512 {
        // SAFETY: the caller's: AVX-512 F, and 16 readable bytes at `p`.
        unsafe { deq(_mm_loadu_si128(p as *const __m128i), scale) }
    }

    #[inline(always)]
    unsafe fn int4(p: *const u8, scale: __m512) -> __m512 {
        // SAFETY: the caller's: AVX-512 F, and 8 readable bytes at `p`.
        unsafe { deq(nibbles8(_mm_loadl_epi64(p as *const __m128i)), scale) }
    }

    #[inline(always)]
    unsafe fn bf16(p: *const u8) -> __m512 {
        // SAFETY: the caller's: AVX-512 F, and 32 readable bytes at `p`.
        unsafe { bf16_to_f32(_mm256_loadu_si256(p as *const __m256i)) }
    }

    #[inline(always)]
    unsafe fn f16(p: *const u8) -> __m512 {
        // SAFETY: the caller's: AVX-512 F, and 32 readable bytes at `p`.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(p as *const __m256i)) }
    }

    #[inline(always)]
    fn prefetch(p: *const u8) {
        // SAFETY: a prefetch never faults, whatever the address; SSE is part of x86-64.
        unsafe { _mm_prefetch::<_MM_HINT_T0>(p as *const i8) }
    }

    /// The table-decoded int4 ([`Int4Lut`]) for the formats [`lut_group`] accepts, int8 with
    /// prefetch ([`Int8Ahead`]), the plain sources for the rest.
    #[inline(always)]
    unsafe fn with_sources<B: OverSources<Self>>(
        format: QuantFormat,
        cols: usize,
        side_by_side: usize,
        body: B,
    ) {
        let ahead = Ahead {
            bytes: prefetch_distance(format.row_bytes(cols), side_by_side),
            to_l2: crate::cpu::features().amd,
        };
        // SAFETY: forwarded; each constructor spans the whole row o of the matrix it is given.
        unsafe {
            match lut_group(format) {
                Some(0) => body
                    .run(move |w: &QMatrix<'_>, o: usize| Int4Lut::<PER_ROW>::row(w, o, 0, ahead)),
                Some(64) => {
                    body.run(move |w: &QMatrix<'_>, o: usize| Int4Lut::<2>::row(w, o, 64, ahead))
                }
                Some(gs) if gs % 64 == 0 => body.run(move |w: &QMatrix<'_>, o: usize| {
                    Int4Lut::<ANY_EVEN>::row(w, o, gs, ahead)
                }),
                Some(gs) => body
                    .run(move |w: &QMatrix<'_>, o: usize| Int4Lut::<ANY_ODD>::row(w, o, gs, ahead)),
                None if format == QuantFormat::Int8PerRow => {
                    body.run(move |w: &QMatrix<'_>, o: usize| Int8Ahead {
                        row: Int8::row(w, o),
                        ahead,
                    })
                }
                None => sources::plain::<Self, B>(format, body),
            }
        }
    }
}

isa_entry_points!(Avx512, "avx512f,avx512bw");

/// How far ahead of the vector being decoded int4 data is prefetched: a single core streaming
/// int4 from DRAM went from 6.8 to 10 GB/s with it (the decode work keeps the core from
/// running far enough ahead on its own). With the table decode the core runs faster, and
/// 1 KiB ahead left int4 at S = 1 at 18 GiB/s of a measured 53; 8 KiB (about the bytes two
/// cores consume in one DRAM latency) took it to 30–36 (see [`prefetch_distance`]).
const INT4_PREFETCH_BYTES: usize = 8192;

/// The prefetch distance for int4 and int8 rows of `row_bytes` read `rows_per_pass` at a time
/// side by side: at least [`INT4_PREFETCH_BYTES`], and at least one pass, so that a prefetch
/// from row k lands in the rows of the next pass rather than in a row being read now (o_proj,
/// 8 KiB int4 rows read in pairs, went from 21 to 30 GiB/s with it).
fn prefetch_distance(row_bytes: usize, rows_per_pass: usize) -> usize {
    INT4_PREFETCH_BYTES.max(row_bytes * rows_per_pass)
}

/// How the int4 and int8 weight streams are prefetched: `bytes` ahead ([`prefetch_distance`]),
/// into L2 (`prefetcht1`) on AMD and into L1 (`prefetcht0`) elsewhere. On Zen 4 the L1 target
/// held a core's exact int4 loop to 60–70% of what it reads from DRAM alone; into L2 the
/// loop went from 13.8–16.3 to 16.6–19.6 GiB/s on two cores (tools/probe_int4_loops.rs) and decode of
/// the side-by-side model from 31.4 to 37.4 tok/s (docs/benchmarks.md, "Side by side on AMD
/// EPYC Zen 4"). Intel hosts keep L1: `prefetcht1` measured no gain on the Xeon where the
/// distance was tuned (docs/benchmarks.md, fourth session).
#[derive(Clone, Copy)]
struct Ahead {
    bytes: usize,
    to_l2: bool,
}

impl Ahead {
    /// Prefetch the line at `p`.
    #[inline(always)]
    fn fetch(self, p: *const u8) {
        if self.to_l2 {
            // SAFETY: a prefetch never faults, whatever the address; SSE is part of x86-64.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(p as *const i8) }
        } else {
            Avx512::prefetch(p)
        }
    }
}

/// int4 with a nibble → weight table (`vpermps`): the layout every int4 format whose groups
/// are whole 32-element blocks (gs a multiple of 32, or per row) uses on this path. Block b
/// (elements 32b .. 32b+31, bytes 16b .. 16b+15) is two vectors: 2b holds its even elements
/// (the low nibbles of the 16 bytes), 2b+1 its odd ones (the high nibbles), matching the
/// activations in the [`super::XLayout::Pairs32`] layout. The table entry for nibble k is
/// `(k − 8) as f32 · scale`, the reference dequantisation itself, so the weights are exact;
/// decoding costs one zero-extend per block and one permute per vector (the shift-and-convert
/// decode of `sources::Int4` costs three times as many instructions, and int4 at S = 1 was
/// bound by them).
///
/// `BPG` is the number of 32-element blocks per group when it is fixed at compile time: 2 for
/// the default gs64 (docs/container.md), whose block b is in group b/2 (a shift; int4 at S = 1
/// is bound by the instruction count of its loop, and this took gs64 from 26.9 to 30.0 GiB/s
/// on one core with the matrix in L2, +8% at S = 4 and 8), [`PER_ROW`], or [`ANY_EVEN`] /
/// [`ANY_ODD`] for other group sizes (a multiply by `magic`). With an even count (per row
/// included), blocks 2q and 2q+1 share a group and [`Src::quad`] computes their table once.
#[derive(Clone, Copy)]
struct Int4Lut<const BPG: usize> {
    data: *const u8,
    scales: *const f32,
    /// Block b is in group `(b · magic) >> 32` (read for `ANY_EVEN` and `ANY_ODD` only).
    magic: u64,
    /// Where and how far ahead the row is prefetched.
    ahead: Ahead,
}

/// [`Int4Lut`] with one group per row.
const PER_ROW: usize = 0;
/// [`Int4Lut`] with an even number of blocks per group, found through its `magic`.
const ANY_EVEN: usize = usize::MAX - 1;
/// [`Int4Lut`] with an odd number of blocks per group, found through its `magic`.
const ANY_ODD: usize = usize::MAX;

/// `[-8, -7, …, 7]`: nibble k → k − 8.
#[inline(always)]
unsafe fn nibble_values() -> __m512 {
    // SAFETY: AVX-512 F guaranteed by the caller.
    unsafe {
        _mm512_setr_ps(
            -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
        )
    }
}

impl<const BPG: usize> Int4Lut<BPG> {
    /// Row o of `w`, whose group size is `gs` (a multiple of 32, 0 for per-row), prefetched
    /// as `ahead` says.
    #[inline(always)]
    fn row(w: &QMatrix<'_>, o: usize, gs: usize, ahead: Ahead) -> Self {
        let magic = if gs == 0 {
            0
        } else {
            (1u64 << 32).div_ceil((gs / 32) as u64)
        };
        Int4Lut {
            data: w.row_data(o).as_ptr(),
            scales: w.row_scales(o).as_ptr(),
            magic,
            ahead,
        }
    }

    /// Blocks 2q and 2q+1 are in one group (`PER_ROW` and `ANY_EVEN` are even).
    const PAIRS_SHARE: bool = BPG.is_multiple_of(2);

    /// The group of block b.
    #[inline(always)]
    fn group(self, b: usize) -> usize {
        match BPG {
            PER_ROW => 0,
            ANY_EVEN | ANY_ODD => ((b as u64 * self.magic) >> 32) as usize,
            k => b / k,
        }
    }

    /// The table of block b's group.
    #[inline(always)]
    unsafe fn table(self, b: usize) -> __m512 {
        // SAFETY: `group` maps every block of the row to its group, < scales_per_row.
        unsafe {
            _mm512_mul_ps(
                nibble_values(),
                _mm512_set1_ps(*self.scales.add(self.group(b))),
            )
        }
    }

    /// Block b's bytes, one per 32-bit lane (the nibbles in bits 0..8).
    #[inline(always)]
    unsafe fn bytes(self, b: usize) -> __m512i {
        // SAFETY: block b < full: its 16 bytes are in the row.
        unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(self.data.add(16 * b) as *const __m128i)) }
    }

    /// Even and odd vectors of a full block with table `t` (`vpermps` reads index bits 0..4).
    #[inline(always)]
    unsafe fn decode(q: __m512i, t: __m512) -> [__m512; 2] {
        // SAFETY: AVX-512 F guaranteed by the caller.
        unsafe {
            [
                _mm512_permutexvar_ps(q, t),
                _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), t),
            ]
        }
    }
}

impl<const BPG: usize> Src<Avx512> for Int4Lut<BPG> {
    #[inline(always)]
    fn whole(n: usize) -> usize {
        2 * (n / 32)
    }

    #[inline(always)]
    fn vectors(n: usize) -> usize {
        2 * n.div_ceil(32)
    }

    #[inline(always)]
    unsafe fn tail_mask(n: usize, v: usize) -> __mmask16 {
        // Even lane i is element 2i of the block, odd lane i element 2i + 1.
        let rem = n % 32;
        mask(if v.is_multiple_of(2) {
            rem.div_ceil(2)
        } else {
            rem / 2
        })
    }

    #[inline(always)]
    fn prefetch(self, v: usize) {
        let byte = v * 8 + self.ahead.bytes;
        // The scales too: they are a stream of their own (1/8 of the bytes at gs64) that the
        // hardware prefetcher left to miss; fetching them ahead took int4-gs64 at S = 1 from
        // 33 to 42–47 GiB/s (2 threads, DRAM). One prefetch per call although a line of
        // scales covers 16 calls at gs64: prefetching on every 8th call only measured the same.
        let group = self.group(byte / 16);
        // `wrapping_add`: the addresses may lie past the row; a prefetch never faults.
        self.ahead.fetch(self.data.wrapping_add(byte));
        self.ahead
            .fetch(self.scales.wrapping_add(group) as *const u8);
    }

    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m512 {
        // SAFETY: forwarded: vector v is whole, so block v/2 is.
        unsafe { Self::decode(self.bytes(v / 2), self.table(v / 2))[v % 2] }
    }

    /// Blocks 2q and 2q+1 (vectors 4q, 4q+1 and 4q+2, 4q+3), one table for both where they
    /// share a group.
    #[inline(always)]
    unsafe fn quad(self, q: usize) -> [__m512; D] {
        // SAFETY: forwarded: vectors 4q .. 4q+3 are whole, so blocks 2q and 2q+1 are.
        unsafe {
            let t0 = self.table(2 * q);
            let t1 = if Self::PAIRS_SHARE {
                t0
            } else {
                self.table(2 * q + 1)
            };
            let [e0, o0] = Self::decode(self.bytes(2 * q), t0);
            let [e1, o1] = Self::decode(self.bytes(2 * q + 1), t1);
            [e0, o0, e1, o1]
        }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> __m512 {
        // SAFETY: block v/2 is the partial last one: the row has ceil((n % 32)/2) of its bytes;
        // padding nibbles read as 8 (weight 0) and are masked off anyway.
        unsafe {
            let b = v / 2;
            let mut buf = [0x88u8; 16];
            ptr::copy_nonoverlapping(
                self.data.add(16 * b),
                buf.as_mut_ptr(),
                (n % 32).div_ceil(2),
            );
            let mut q = _mm512_cvtepu8_epi32(_mm_loadu_si128(buf.as_ptr() as *const __m128i));
            if v % 2 == 1 {
                q = _mm512_srli_epi32::<4>(q);
            }
            _mm512_maskz_permutexvar_ps(Self::tail_mask(n, v), q, self.table(b))
        }
    }
}

/// `sources::Int8` with software prefetch `ahead` bytes in front of the vector being read (as
/// for int4: without it int8 was the slowest format per byte at S = 1).
#[derive(Clone, Copy)]
struct Int8Ahead {
    row: Int8<Avx512>,
    ahead: Ahead,
}

impl Src<Avx512> for Int8Ahead {
    #[inline(always)]
    fn prefetch(self, v: usize) {
        // `wrapping_add`: the address may lie past the row; a prefetch never faults.
        self.ahead
            .fetch(self.row.data.wrapping_add(v * L + self.ahead.bytes));
    }

    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m512 {
        // SAFETY: forwarded.
        unsafe { self.row.one(v) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> __m512 {
        // SAFETY: forwarded.
        unsafe { self.row.tail(v, n) }
    }
}

/// The group size of an int4 format this path decodes with a table ([`Int4Lut`]; 0 = per
/// row), `None` for every other format (gs 16 and 48 split a 32-element block).
fn lut_group(format: QuantFormat) -> Option<usize> {
    match format {
        QuantFormat::Int4PerRow => Some(0),
        QuantFormat::Int4Grouped { group_size } if group_size % 32 == 0 => Some(group_size),
        _ => None,
    }
}

/// How this path wants the activations of a matmul with weights in `format`.
pub(super) fn x_layout(format: QuantFormat) -> super::XLayout {
    if lut_group(format).is_some() {
        super::XLayout::Pairs32
    } else {
        super::XLayout::Rows16
    }
}
