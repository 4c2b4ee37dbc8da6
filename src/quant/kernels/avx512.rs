//! AVX-512 (F + BW) kernels: 16 f32 lanes, two accumulators per dot product (vector v →
//! v % 2), tiles of four weight rows × up to two activation rows (the last rows: two × up to
//! four, one × up to eight; 16 accumulators each), activations in 64-byte-aligned rows. Int4
//! whose groups are whole 32-element blocks (gs a multiple of 32, or per row; the docs/container.md
//! default gs64 among them) is decoded through a
//! 16-entry table per group (`vpermps`, [`Int4Lut`]) against activations rearranged once per
//! call into even/odd halves of each block; gs 16 and 48 use the shift-and-convert decode
//! ([`Int4`]). Weights are dequantised exactly to f32 (no integer-activation tricks), so the
//! result is the f32 dot product of the reference weights in this path's fixed order (see the
//! module docs of `kernels`).
//!
//! Every function here needs AVX-512 F and BW; the entry points carry `#[target_feature]` and
//! the helpers are `#[inline(always)]` into them (the intrinsics need Rust 1.89, the crate's
//! MSRV).

use std::arch::x86_64::*;
use std::ptr;

use super::group_magic;
use crate::quant::format::{QMatrix, QuantFormat};

/// Lanes per vector.
const L: usize = 16;
/// Independent accumulators per dot product (vector v → accumulator v % A).
const A: usize = 2;
/// Vectors decoded together (one load of packed weights).
const D: usize = 4;
/// Activation rows per tile with one weight row (16 accumulators).
const TILE: usize = 8;
/// Activation rows per tile with two weight rows (16 accumulators).
const TILE_PAIR: usize = 4;
/// Activation rows per tile with four weight rows (16 accumulators).
const TILE_QUAD: usize = 2;

/// A weight row as a sequence of exactly dequantised 16-lane vectors. Implementations hold raw
/// pointers into a row whose length matches the `n` the caller iterates over.
trait Src: Copy {
    /// Vector `v` (elements 16v .. 16v+15, all inside the row).
    unsafe fn one(self, v: usize) -> __m512;
    /// Vectors 2p and 2p+1 (both whole).
    #[inline(always)]
    unsafe fn pair(self, p: usize) -> [__m512; 2] {
        // SAFETY: forwarded contract: vectors 2p and 2p+1 are whole.
        unsafe { [self.one(2 * p), self.one(2 * p + 1)] }
    }
    /// Vectors 4q .. 4q+3 as pairs 2q and 2q+1 (all whole); a source may share work between
    /// the two pairs (the table-decoded int4 computes one table when both are in one group).
    #[inline(always)]
    unsafe fn quad(self, q: usize) -> [[__m512; 2]; 2] {
        // SAFETY: forwarded contract: vectors 4q .. 4q+3 are whole.
        unsafe { [self.pair(2 * q), self.pair(2 * q + 1)] }
    }
    /// Vectors `0..whole(n)` of a row of n elements are whole (every lane an element).
    #[inline(always)]
    fn whole(n: usize) -> usize {
        n / L
    }
    /// A row of n elements is vectors `0..vectors(n)`; those from `whole(n)` on are partial.
    #[inline(always)]
    fn vectors(n: usize) -> usize {
        n.div_ceil(L)
    }
    /// The lanes of partial vector v that hold elements, in W and in X alike.
    #[inline(always)]
    fn tail_mask(n: usize, _v: usize) -> __mmask16 {
        mask(n % L)
    }
    /// Partial vector `v` of a row of `n` elements; lanes outside `tail_mask` are +0.
    unsafe fn tail(self, v: usize, n: usize) -> __m512;
    /// Hint the cache about the bytes some way ahead of vector `v` (no effect on results).
    #[inline(always)]
    fn prefetch(self, _v: usize) {}
}

/// The low `r` (0..=16) lanes.
#[inline(always)]
fn mask(r: usize) -> __mmask16 {
    debug_assert!(r <= L);
    ((1u32 << r) - 1) as __mmask16
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
    unsafe fn scale(self, v: usize) -> __m512 {
        // SAFETY: `group_magic` maps every vector of the row to its group, < scales_per_row.
        unsafe { _mm512_set1_ps(*self.scales.add(((v as u64 * self.magic) >> 32) as usize)) }
    }
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

impl Src for Int4 {
    #[inline(always)]
    fn prefetch(self, v: usize) {
        // SAFETY: a prefetch never faults, whatever the address (hence `wrapping_add`).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(
                self.data.wrapping_add(v * 8 + INT4_PREFETCH_BYTES) as *const i8
            )
        };
    }

    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m512 {
        // SAFETY: vector v is full, so bytes 8v .. 8v+8 are in the row.
        unsafe {
            let b = _mm_loadl_epi64(self.data.add(v * 8) as *const __m128i);
            deq(nibbles8(b), self.scale(v))
        }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> __m512 {
        let r = n % L;
        // SAFETY: the row ends ceil(r/2) bytes after byte 8v; padding nibbles read as 8 (0).
        unsafe {
            let mut buf = [0x88u8; 16];
            ptr::copy_nonoverlapping(self.data.add(v * 8), buf.as_mut_ptr(), r.div_ceil(2));
            let b = _mm_loadu_si128(buf.as_ptr() as *const __m128i);
            _mm512_maskz_mov_ps(mask(r), deq(nibbles8(b), self.scale(v)))
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
/// decode of [`Int4`] costs three times as many instructions, and int4 at S = 1 was bound by
/// them).
///
/// `BPG` is the number of 32-element blocks per group when it is fixed at compile time: 2 for
/// the default gs64 (docs/container.md), whose block b is in group b/2 (a shift; int4 at S = 1 is bound by
/// the instruction count of its loop, and this took gs64 from 26.9 to 30.0 GiB/s on one core
/// with the matrix in L2, +8% at S = 4 and 8), [`PER_ROW`], or [`ANY_EVEN`] / [`ANY_ODD`] for
/// other group sizes (a multiply by `magic`). With an even count (per row included), blocks
/// 2q and 2q+1 share a group and [`Src::quad`] computes their table once.
#[derive(Clone, Copy)]
struct Int4Lut<const BPG: usize> {
    data: *const u8,
    scales: *const f32,
    /// Block b is in group `(b · magic) >> 32` (read for `ANY_EVEN` and `ANY_ODD` only).
    magic: u64,
    /// Prefetch distance in bytes.
    ahead: usize,
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
    /// Row o of `w`, whose group size is `gs` (a multiple of 32, 0 for per-row); `ahead` is
    /// the prefetch distance in bytes.
    #[inline(always)]
    fn row(w: &QMatrix<'_>, o: usize, gs: usize, ahead: usize) -> Self {
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

impl<const BPG: usize> Src for Int4Lut<BPG> {
    #[inline(always)]
    fn whole(n: usize) -> usize {
        2 * (n / 32)
    }

    #[inline(always)]
    fn vectors(n: usize) -> usize {
        2 * n.div_ceil(32)
    }

    #[inline(always)]
    fn tail_mask(n: usize, v: usize) -> __mmask16 {
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
        let byte = v * 8 + self.ahead;
        // The scales too: they are a stream of their own (1/8 of the bytes at gs64) that the
        // hardware prefetcher left to miss; fetching them ahead took int4-gs64 at S = 1 from
        // 33 to 42–47 GiB/s (2 threads, DRAM). One prefetch per call although a line of
        // scales covers 16 calls at gs64: prefetching on every 8th call only measured the same.
        let group = self.group(byte / 16);
        // SAFETY: a prefetch never faults, whatever the address (hence `wrapping_add`).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(self.data.wrapping_add(byte) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(self.scales.wrapping_add(group) as *const i8);
        };
    }

    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m512 {
        // SAFETY: forwarded: vector v is whole, so block v/2 is.
        unsafe { Self::decode(self.bytes(v / 2), self.table(v / 2))[v % 2] }
    }

    #[inline(always)]
    unsafe fn pair(self, p: usize) -> [__m512; 2] {
        // SAFETY: forwarded: vectors 2p and 2p+1 are whole, so block p is.
        unsafe { Self::decode(self.bytes(p), self.table(p)) }
    }

    #[inline(always)]
    unsafe fn quad(self, q: usize) -> [[__m512; 2]; 2] {
        // SAFETY: forwarded: vectors 4q .. 4q+3 are whole, so blocks 2q and 2q+1 are.
        unsafe {
            let t0 = self.table(2 * q);
            let t1 = if Self::PAIRS_SHARE {
                t0
            } else {
                self.table(2 * q + 1)
            };
            [
                Self::decode(self.bytes(2 * q), t0),
                Self::decode(self.bytes(2 * q + 1), t1),
            ]
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

/// int8 per row: w = q · scale.
#[derive(Clone, Copy)]
struct Int8 {
    data: *const u8,
    scale: f32,
}

impl Src for Int8 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m512 {
        // SAFETY: bytes 16v .. 16v+16 are in the row.
        unsafe {
            let b = _mm_loadu_si128(self.data.add(v * L) as *const __m128i);
            deq(b, _mm512_set1_ps(self.scale))
        }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> __m512 {
        let r = n % L;
        // SAFETY: the row ends r bytes after byte 16v.
        unsafe {
            let mut buf = [0u8; 16];
            ptr::copy_nonoverlapping(self.data.add(v * L), buf.as_mut_ptr(), r);
            let b = _mm_loadu_si128(buf.as_ptr() as *const __m128i);
            _mm512_maskz_mov_ps(mask(r), deq(b, _mm512_set1_ps(self.scale)))
        }
    }
}

/// [`Int8`] with software prefetch `ahead` bytes in front of the vector being read (as for
/// int4: without it int8 was the slowest format per byte at S = 1).
#[derive(Clone, Copy)]
struct Int8Ahead {
    row: Int8,
    ahead: usize,
}

impl Src for Int8Ahead {
    #[inline(always)]
    fn prefetch(self, v: usize) {
        // SAFETY: a prefetch never faults, whatever the address (hence `wrapping_add`).
        unsafe {
            _mm_prefetch::<_MM_HINT_T0>(self.row.data.wrapping_add(v * L + self.ahead) as *const i8)
        };
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

/// bf16: the 16 bits are the top half of the f32.
#[derive(Clone, Copy)]
struct Bf16(*const u8);

#[inline(always)]
unsafe fn bf16_to_f32(b: __m256i) -> __m512 {
    // SAFETY: AVX-512 F guaranteed by the caller.
    unsafe { _mm512_castsi512_ps(_mm512_slli_epi32::<16>(_mm512_cvtepu16_epi32(b))) }
}

impl Src for Bf16 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m512 {
        // SAFETY: bytes 32v .. 32v+32 are in the row.
        unsafe { bf16_to_f32(_mm256_loadu_si256(self.0.add(v * 2 * L) as *const __m256i)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> __m512 {
        let r = n % L;
        // SAFETY: the row ends 2r bytes after byte 32v.
        unsafe {
            let mut buf = [0u8; 2 * L];
            ptr::copy_nonoverlapping(self.0.add(v * 2 * L), buf.as_mut_ptr(), 2 * r);
            bf16_to_f32(_mm256_loadu_si256(buf.as_ptr() as *const __m256i))
        }
    }
}

/// IEEE half: `vcvtph2ps` is exact (subnormals included).
#[derive(Clone, Copy)]
struct F16(*const u8);

impl Src for F16 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m512 {
        // SAFETY: bytes 32v .. 32v+32 are in the row.
        unsafe { _mm512_cvtph_ps(_mm256_loadu_si256(self.0.add(v * 2 * L) as *const __m256i)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> __m512 {
        let r = n % L;
        // SAFETY: the row ends 2r bytes after byte 32v.
        unsafe {
            let mut buf = [0u8; 2 * L];
            ptr::copy_nonoverlapping(self.0.add(v * 2 * L), buf.as_mut_ptr(), 2 * r);
            _mm512_cvtph_ps(_mm256_loadu_si256(buf.as_ptr() as *const __m256i))
        }
    }
}

/// f32 (little-endian bytes, any alignment), or a decoded row buffer.
#[derive(Clone, Copy)]
struct F32(*const f32);

impl Src for F32 {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> __m512 {
        // SAFETY: elements 16v .. 16v+16 are in the row.
        unsafe { _mm512_loadu_ps(self.0.add(v * L)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> __m512 {
        // SAFETY: masked lanes are not read (fault suppression), the rest are in the row.
        unsafe { _mm512_maskz_loadu_ps(mask(n % L), self.0.add(v * L)) }
    }
}

/// Sum of the accumulators in a fixed tree: a0 + a1, then halves, quarters, pairs, lanes.
#[inline(always)]
unsafe fn reduce(a: [__m512; A]) -> f32 {
    // SAFETY: AVX-512 F guaranteed by the caller.
    unsafe {
        let v = _mm512_add_ps(a[0], a[1]);
        let hi = _mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(_mm512_castps_pd(v)));
        let h = _mm256_add_ps(_mm512_castps512_ps256(v), hi);
        let q = _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps::<1>(h));
        let d = _mm_add_ps(q, _mm_movehl_ps(q, q));
        _mm_cvtss_f32(_mm_add_ss(d, _mm_movehdup_ps(d)))
    }
}

/// Accumulate vectors `v0..v1` of `NW` weight rows against `T` activation rows of `n` elements
/// (`x[t]` points at vector `v0` of row t) into `acc`: vector v goes to accumulator v % A of
/// every (weight row, activation row); the partial vectors at the end (from `S::whole(n)`)
/// have the lanes outside `S::tail_mask` zero in W and X. `v0` is a multiple of D, so walking
/// `0..S::vectors(n)` in consecutive ranges performs exactly the same operations on every
/// accumulator as walking it in one go.
#[inline(always)]
unsafe fn accumulate<S: Src, const NW: usize, const T: usize>(
    w: [S; NW],
    x: [*const f32; T],
    n: usize,
    v0: usize,
    v1: usize,
    acc: &mut [[[__m512; A]; T]; NW],
) {
    // SAFETY: the caller guarantees the CPU features, that each `x[t]` points at the
    // elements v0·L .. min(v1·L, n) of a row and each source at a row of n elements.
    unsafe {
        let (whole, total) = (S::whole(n), S::vectors(n));
        let full = v1.min(whole);
        let mut v = v0;
        while v + D <= full {
            for src in &w {
                src.prefetch(v);
            }
            let mut wq = [[[_mm512_setzero_ps(); 2]; 2]; NW];
            for k in 0..NW {
                wq[k] = w[k].quad(v / D);
            }
            // Pair h of the quad is vectors v + 2h, v + 2h + 1 (indexing keeps every loop
            // here unrolled over constants).
            #[allow(clippy::needless_range_loop)]
            for h in 0..D / 2 {
                let u = v + 2 * h;
                for t in 0..T {
                    for j in 0..2 {
                        let xv = _mm512_loadu_ps(x[t].add((u - v0 + j) * L));
                        for k in 0..NW {
                            acc[k][t][j % A] = _mm512_fmadd_ps(wq[k][h][j], xv, acc[k][t][j % A]);
                        }
                    }
                }
            }
            v += D;
        }
        while v < full {
            let mut wv = [_mm512_setzero_ps(); NW];
            for k in 0..NW {
                wv[k] = w[k].one(v);
            }
            for t in 0..T {
                let xv = _mm512_loadu_ps(x[t].add((v - v0) * L));
                for k in 0..NW {
                    acc[k][t][v % A] = _mm512_fmadd_ps(wv[k], xv, acc[k][t][v % A]);
                }
            }
            v += 1;
        }
        v = v.max(whole);
        while v < v1.min(total) {
            let mut wv = [_mm512_setzero_ps(); NW];
            for k in 0..NW {
                wv[k] = w[k].tail(v, n);
            }
            let m = S::tail_mask(n, v);
            for t in 0..T {
                let xv = _mm512_maskz_loadu_ps(m, x[t].add((v - v0) * L));
                for k in 0..NW {
                    acc[k][t][v % A] = _mm512_fmadd_ps(wv[k], xv, acc[k][t][v % A]);
                }
            }
            v += 1;
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
        let mut acc = [[[_mm512_setzero_ps(); A]; T]; NW];
        accumulate(w, x, n, 0, S::vectors(n), &mut acc);
        let mut y = [[0.0f32; T]; NW];
        for k in 0..NW {
            for t in 0..T {
                y[k][t] = reduce(acc[k][t]);
            }
        }
        y
    }
}

/// All `s` activation rows against `NW` weight rows of `n` elements (as the source walks
/// them), tile by tile. Activation row t starts at `x[t · x.len()/s]`. `out[k]` points at `s`
/// floats for weight row k.
#[inline(always)]
unsafe fn tiles<S: Src, const NW: usize, const TM: usize>(
    w: [S; NW],
    x: &[f32],
    s: usize,
    n: usize,
    out: [*mut f32; NW],
) {
    // SAFETY: `x` holds s rows of at least n; each `out[k]` points at s writable floats.
    unsafe {
        const { assert!(matches!(TM, 1..=4 | 8)) };
        let xp = x.as_ptr();
        let stride = x.len() / s;
        macro_rules! tile {
            ($t:literal, $t0:expr) => {{
                let mut xs = [xp; $t];
                for (i, p) in xs.iter_mut().enumerate() {
                    *p = xp.add(($t0 + i) * stride);
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

/// `out[i·s + t] = W[o0 + i] · x_t` for the rows `o0..o0 + out.len()/s`.
///
/// # Safety
/// The CPU supports AVX-512 F and BW; `x.len() == s · w.cols()`, `s > 0`,
/// `out.len()` is a multiple of s and `o0 + out.len()/s <= w.rows()`.
/// The activations are in the layout [`x_layout`] gives for `w`'s format.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn rows(w: &QMatrix<'_>, o0: usize, x: &[f32], s: usize, out: &mut [f32]) {
    let n = w.cols();
    // SAFETY: the caller's contract; `make` builds sources over whole rows of n elements.
    unsafe {
        with_src_lut!(w.format(), n, 4, |mk| rows_paired(
            |o| mk(w, o),
            n,
            o0,
            x,
            s,
            out
        ))
    }
}

/// Row `o` of `w` dequantised into `out` (`w.cols()` floats) in natural order, through the
/// shift-and-convert sources of [`with_src!`] (the table-decoded int4 produces its vectors in
/// a permuted order): the same exact f32 weights as `pack::reference_dequantize_row`.
///
/// # Safety
/// The CPU supports AVX-512 F and BW; `o < w.rows()` and `out.len() >= w.cols()`.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn dequantize_row(w: &QMatrix<'_>, o: usize, out: &mut [f32]) {
    // SAFETY: the caller's contract; each source spans the `w.cols()` elements of row o.
    unsafe { dequantize_row_into!(w, o, out) }
}

/// `v` into the 16 floats at `p`.
#[inline(always)]
unsafe fn store(p: *mut f32, v: __m512) {
    // SAFETY: the caller's: AVX-512 F, and 16 writable floats at `p`.
    unsafe { _mm512_storeu_ps(p, v) }
}

/// The partial vector `v` of a row of `n` elements into `out` (its `n % 16` elements).
#[inline(always)]
unsafe fn store_last<S: Src>(src: S, v: usize, n: usize, out: &mut [f32]) {
    // SAFETY: the caller's: AVX-512 F, vector v is the row's partial last one, and the mask
    // writes only `out.len() == n % 16` floats.
    unsafe { _mm512_mask_storeu_ps(out.as_mut_ptr(), mask(out.len()), src.tail(v, n)) }
}

/// [`with_src!`] with this path's table-decoded int4 ([`Int4Lut`]) for the formats
/// [`lut_group`] accepts; `$per_pass` weight rows of `$n` columns are read side by side (it
/// sets the prefetch distance).
macro_rules! with_src_lut {
    ($fmt:expr, $n:expr, $per_pass:expr, |$mk:ident| $body:expr) => {{
        let ahead = prefetch_distance($fmt.row_bytes($n), $per_pass);
        match lut_group($fmt) {
            Some(0) => {
                let $mk = move |w: &QMatrix<'_>, o: usize| Int4Lut::<PER_ROW>::row(w, o, 0, ahead);
                $body
            }
            Some(64) => {
                let $mk = move |w: &QMatrix<'_>, o: usize| Int4Lut::<2>::row(w, o, 64, ahead);
                $body
            }
            Some(gs) if gs % 64 == 0 => {
                let $mk =
                    move |w: &QMatrix<'_>, o: usize| Int4Lut::<ANY_EVEN>::row(w, o, gs, ahead);
                $body
            }
            Some(gs) => {
                let $mk = move |w: &QMatrix<'_>, o: usize| Int4Lut::<ANY_ODD>::row(w, o, gs, ahead);
                $body
            }
            None if $fmt == QuantFormat::Int8PerRow => {
                let $mk = move |w: &QMatrix<'_>, o: usize| Int8Ahead {
                    row: Int8 {
                        data: w.row_data(o).as_ptr(),
                        scale: w.row_scales(o)[0],
                    },
                    ahead,
                };
                $body
            }
            None => with_src!($fmt, |$mk| $body),
        }
    }};
}
use with_src_lut;

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

/// Rows `o0..o0 + out.len()/s`, four weight rows at a time in tiles of `TILE_QUAD` activation
/// rows (then a pair in tiles of `TILE_PAIR`, then one row in tiles of `TILE`; 16 accumulators
/// or fewer each). Four rows: at S = 1 their eight accumulator chains cover the FMA latency of
/// both pipes (two rows left four), and at S > 1 each activation vector loaded feeds four
/// FMAs (L1 loads, not FMAs, bound these tiles: 4 × 2 measured 4–14% faster than 2 × 4, and
/// 2 × 4 had been 25–35% faster than 1 × 8). Each dot product is computed exactly as in
/// [`dot_tile`], whatever the tiling.
#[inline(always)]
unsafe fn rows_paired<S: Src>(
    make: impl Fn(usize) -> S,
    n: usize,
    o0: usize,
    x: &[f32],
    s: usize,
    out: &mut [f32],
) {
    // SAFETY: forwarded from `rows`: `out` holds [rows, s] for rows o0.. that exist.
    unsafe {
        let rows = out.len() / s;
        let y = out.as_mut_ptr();
        let mut i = 0;
        while i + 4 <= rows {
            let w = [
                make(o0 + i),
                make(o0 + i + 1),
                make(o0 + i + 2),
                make(o0 + i + 3),
            ];
            let y4 = [
                y.add(i * s),
                y.add((i + 1) * s),
                y.add((i + 2) * s),
                y.add((i + 3) * s),
            ];
            tiles::<S, 4, TILE_QUAD>(w, x, s, n, y4);
            i += 4;
        }
        while i + 2 <= rows {
            let w = [make(o0 + i), make(o0 + i + 1)];
            tiles::<S, 2, TILE_PAIR>(w, x, s, n, [y.add(i * s), y.add((i + 1) * s)]);
            i += 2;
        }
        if i < rows {
            tiles::<S, 1, TILE>([make(o0 + i)], x, s, n, [y.add(i * s)]);
        }
    }
}

/// [`rows`] for two matrices of the same shape (gate and up), sharing the activation loads.
///
/// # Safety
/// As [`rows`], for both `a` and `b`, which have the same shape; `out_a` and `out_b` have the
/// same length.
#[target_feature(enable = "avx512f,avx512bw")]
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
        // Two rows of each matrix per pass.
        with_src_lut!(a.format(), n, 2, |mk| rows_src_both(
            |k, o| if k == 0 { mk(a, o) } else { mk(b, o) },
            n,
            o0,
            x,
            s,
            [out_a, out_b]
        ))
    }
}

/// Rows `o0..` of two matrices (`make(k, o)`: row o of matrix k) against all `s` activation
/// rows: two rows of each per pass in tiles of `TILE_QUAD` (as [`rows_paired`] does with four
/// rows of one matrix), then a last row of each in tiles of `TILE_PAIR`.
#[inline(always)]
unsafe fn rows_src_both<S: Src>(
    make: impl Fn(usize, usize) -> S,
    n: usize,
    o0: usize,
    x: &[f32],
    s: usize,
    out: [&mut [f32]; 2],
) {
    // SAFETY: forwarded from `rows_pair`.
    unsafe {
        let [out_a, out_b] = out;
        let rows = out_a.len() / s;
        let (ya, yb) = (out_a.as_mut_ptr(), out_b.as_mut_ptr());
        let mut i = 0;
        while i + 2 <= rows {
            let (p, q) = (o0 + i, o0 + i + 1);
            let w = [make(0, p), make(0, q), make(1, p), make(1, q)];
            let y4 = [
                ya.add(i * s),
                ya.add((i + 1) * s),
                yb.add(i * s),
                yb.add((i + 1) * s),
            ];
            tiles::<S, 4, TILE_QUAD>(w, x, s, n, y4);
            i += 2;
        }
        rows_src::<S, 2, TILE_PAIR>(
            make,
            n,
            o0 + i,
            x,
            s,
            [&mut out_a[i * s..], &mut out_b[i * s..]],
        );
    }
}

/// Independent FMA chains of [`fma_peak`]: 12 × 4 cycles of latency covers two FMA pipes.
const PEAK_CHAINS: usize = 12;

/// `iters` rounds of [`PEAK_CHAINS`] independent 16-lane FMAs (`iters · 12 · 32` flops): the
/// machine's f32 FMA ceiling on this path, for benches to report the kernels against.
///
/// # Safety
/// The CPU supports AVX-512 F.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn fma_peak(iters: usize, seed: f32) -> f32 {
    let mut acc = [_mm512_set1_ps(seed); PEAK_CHAINS];
    let (a, b) = (_mm512_set1_ps(0.999_99), _mm512_set1_ps(1e-7));
    for _ in 0..iters {
        for c in acc.iter_mut() {
            *c = _mm512_fmadd_ps(*c, a, b);
        }
    }
    let mut sum = _mm512_setzero_ps();
    for c in acc {
        sum = _mm512_add_ps(sum, c);
    }
    _mm512_reduce_add_ps(sum)
}

/// Flops per iteration of [`fma_peak`].
pub(super) const PEAK_FLOPS_PER_ITER: usize = PEAK_CHAINS * 2 * L;
