//! Stand-alone probe of the exact S = 1 int4-g64 inner loop (developer tool, not part of the
//! crate): the kept forms of `src/quant/kernels/avx2_int4.rs` (AVX2) and `avx512.rs`
//! (`Int4Lut`: a 16-entry table `(k − 8)·s_g` per group, looked up by `vpermps`) against
//! alternatives — the same lookups on a repacked layout (one 64-byte load per two groups, no
//! widening), nibble planes with and without an exponent trick, the scale factored out
//! of each group in 16 lanes, split-int8 forms (`vpdpbusd` against the activations as K int8
//! pieces: what decode could use to approach the bandwidth) — and a plain streaming read of
//! the same bytes. Each variant computes two weight rows per pass over 6,144 columns; the
//! values are not checked against each other (the activation layouts differ), only timed.
//! The AVX-512 and VNNI variants run where the CPU has them. docs/benchmarks-history.md
//! ("AVX2 int4 by group: decode on Zen 3" for AVX2, "Side by side on AMD EPYC Zen 4" for
//! AVX-512, "What bounds exact decode in cache on Zen 4" for the repacked layout) has the
//! figures.
//!
//! ```text
//! rustc -O -C target-cpu=native tools/probe_int4_loops.rs -o /tmp/probe_int4_loops
//! /tmp/probe_int4_loops 64 1                # 64 rows (192 KiB: L2), 1 thread
//! /tmp/probe_int4_loops 32768 2             # 100 MB from DRAM, 2 threads, 4 KiB ahead
//! /tmp/probe_int4_loops 32768 2 8192 20     # ... 8 KiB ahead (third argument: bytes, 0 none), 20 reps
//! /tmp/probe_int4_loops 32768 2 8192 20 1   # ... prefetching into L2 (`prefetcht1`), not L1
//! ```

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

/// Columns of a weight row.
const I: usize = 6144;
/// Elements per group (one scale).
const GS: usize = 64;

/// What one call computes: `rows` weight rows (packed nibbles `w`, scales `sc`) against one
/// activation row `x` (with per-group vectors `sums`), prefetching `pf` bytes ahead (0: none).
#[derive(Clone, Copy)]
struct Job<'a> {
    w: &'a [u8],
    sc: &'a [f32],
    x: &'a [f32],
    sums: &'a [f32],
    rows: usize,
    pf: usize,
}

type Variant = unsafe fn(Job<'_>, &mut [f32]);

/// Prefetch into L2 (`prefetcht1`) instead of L1 (`prefetcht0`): the fifth argument, 1.
static HINT_T1: AtomicBool = AtomicBool::new(false);

/// Prefetch the line at `p` as [`HINT_T1`] says.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch(p: *const u8) {
    // SAFETY: a prefetch never faults, whatever the address; SSE is part of x86-64.
    unsafe {
        if HINT_T1.load(Ordering::Relaxed) {
            _mm_prefetch::<_MM_HINT_T1>(p as *const i8);
        } else {
            _mm_prefetch::<_MM_HINT_T0>(p as *const i8);
        }
    }
}

/// Prefetch `pf` bytes past offset `at` of both rows of a pass (none when `pf` is 0).
#[cfg(target_arch = "x86_64")]
#[inline(always)]
fn prefetch2(p: [*const u8; 2], at: usize, pf: usize) {
    if pf > 0 {
        for pk in p {
            prefetch(pk.wrapping_add(at + pf));
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let mut t = [0f32; 8];
    _mm256_storeu_ps(t.as_mut_ptr(), v);
    t.iter().sum()
}

/// AVX2, the kept form of `avx2_int4.rs`: per 32-element block, two halves of 8 bytes widened to 8 lanes; low
/// nibbles by `and`, high by a shift, both converted, one FMA each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen256(j: Job<'_>, out: &mut [f32]) {
    let (rb, groups) = (I / 2, I / GS);
    for r in (0..j.rows).step_by(2) {
        let p = [j.w.as_ptr().add(r * rb), j.w.as_ptr().add((r + 1) * rb)];
        let s = [j.sc.as_ptr().add(r * groups), j.sc.as_ptr().add((r + 1) * groups)];
        let mut tot = [_mm256_setzero_ps(); 2];
        let mut b = 0;
        for g in 0..groups {
            let sum = _mm256_loadu_ps(j.sums.as_ptr().add(g * 8));
            let mut acc = [[sum, _mm256_setzero_ps()]; 2];
            for _ in 0..GS / 32 {
                if b % 4 == 0 && j.pf > 0 {
                    for pk in p {
                        prefetch(pk.wrapping_add(16 * b + j.pf));
                    }
                }
                for h in 0..2 {
                    let xe = _mm256_loadu_ps(j.x.as_ptr().add(32 * b + 8 * h));
                    let xo = _mm256_loadu_ps(j.x.as_ptr().add(32 * b + 16 + 8 * h));
                    for k in 0..2 {
                        let d = _mm256_cvtepu8_epi32(_mm_loadl_epi64(
                            p[k].add(16 * b + 8 * h) as *const __m128i,
                        ));
                        let lo = _mm256_cvtepi32_ps(_mm256_and_si256(d, _mm256_set1_epi32(0xF)));
                        let hi = _mm256_cvtepi32_ps(_mm256_srli_epi32::<4>(d));
                        acc[k][0] = _mm256_fmadd_ps(lo, xe, acc[k][0]);
                        acc[k][1] = _mm256_fmadd_ps(hi, xo, acc[k][1]);
                    }
                }
                b += 1;
            }
            for k in 0..2 {
                let sv = _mm256_broadcast_ss(&*s[k].add(g));
                tot[k] = _mm256_fmadd_ps(_mm256_add_ps(acc[k][0], acc[k][1]), sv, tot[k]);
            }
        }
        out[r] = hsum(tot[0]);
        out[r + 1] = hsum(tot[1]);
    }
}

/// Nibble planes: a 32-byte load is 8 lanes of 8 nibbles, plane k = `(v >> 4k) & 15`
/// (activations would be permuted to match once per call); `MAGIC`: each plane as the
/// float `1 + n/16` by its bits (`0x3F800000 | n << 19`) instead of a conversion. `CH`
/// accumulators per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn planes256<const CH: usize, const MAGIC: bool>(j: Job<'_>, out: &mut [f32]) {
    let (rb, groups) = (I / 2, I / GS);
    let (m4, m19, one) = (
        _mm256_set1_epi32(0xF),
        _mm256_set1_epi32(0xF << 19),
        _mm256_set1_epi32(0x3F80_0000),
    );
    for r in (0..j.rows).step_by(2) {
        let p = [j.w.as_ptr().add(r * rb), j.w.as_ptr().add((r + 1) * rb)];
        let s = [j.sc.as_ptr().add(r * groups), j.sc.as_ptr().add((r + 1) * groups)];
        let mut tot = [_mm256_setzero_ps(); 2];
        for g in 0..groups {
            let sum = _mm256_loadu_ps(j.sums.as_ptr().add(g * 8));
            let mut acc = [[_mm256_setzero_ps(); CH]; 2];
            acc[0][0] = sum;
            acc[1][0] = sum;
            for bb in 0..GS / 64 {
                let b = g * (GS / 64) + bb;
                let xb = j.x.as_ptr().add(64 * b);
                if b % 2 == 0 && j.pf > 0 {
                    for pk in p {
                        prefetch(pk.wrapping_add(32 * b + j.pf));
                    }
                }
                let v = [
                    _mm256_loadu_si256(p[0].add(32 * b) as *const __m256i),
                    _mm256_loadu_si256(p[1].add(32 * b) as *const __m256i),
                ];
                macro_rules! plane {
                    ($k:literal, $shr:literal, $sh_magic:literal, $left:literal) => {{
                        let xk = _mm256_loadu_ps(xb.add(8 * $k));
                        for kk in 0..2 {
                            let f = if MAGIC {
                                let t = if $left {
                                    _mm256_slli_epi32::<$sh_magic>(v[kk])
                                } else {
                                    _mm256_srli_epi32::<$sh_magic>(v[kk])
                                };
                                _mm256_castsi256_ps(_mm256_or_si256(_mm256_and_si256(t, m19), one))
                            } else {
                                let n = _mm256_and_si256(_mm256_srli_epi32::<$shr>(v[kk]), m4);
                                _mm256_cvtepi32_ps(n)
                            };
                            acc[kk][$k % CH] = _mm256_fmadd_ps(f, xk, acc[kk][$k % CH]);
                        }
                    }};
                }
                plane!(0, 0, 19, true);
                plane!(1, 4, 15, true);
                plane!(2, 8, 11, true);
                plane!(3, 12, 7, true);
                plane!(4, 16, 3, true);
                plane!(5, 20, 1, false);
                plane!(6, 24, 5, false);
                plane!(7, 28, 9, false);
            }
            for k in 0..2 {
                let mut a = acc[k][0];
                for c in acc[k].iter().skip(1) {
                    a = _mm256_add_ps(a, *c);
                }
                let sv = _mm256_broadcast_ss(&*s[k].add(g));
                tot[k] = _mm256_fmadd_ps(a, sv, tot[k]);
            }
        }
        out[r] = hsum(tot[0]);
        out[r + 1] = hsum(tot[1]);
    }
}

/// The bytes alone: a xor of every 32-byte load (the streaming-read reference).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn read_only256(j: Job<'_>, out: &mut [f32]) {
    let n = j.rows * I / 2;
    let p = j.w.as_ptr();
    let mut a = [_mm256_setzero_si256(); 4];
    let mut i = 0;
    while i + 128 <= n {
        for (k, ak) in a.iter_mut().enumerate() {
            *ak = _mm256_xor_si256(*ak, _mm256_loadu_si256(p.add(i + 32 * k) as *const __m256i));
        }
        i += 128;
    }
    let v = _mm256_xor_si256(_mm256_xor_si256(a[0], a[1]), _mm256_xor_si256(a[2], a[3]));
    out[0] = _mm256_extract_epi32::<0>(v) as f32;
}

/// AVX-512, the kept form of `avx512.rs`: per 32-element block (16 bytes) `vpmovzxbd` to 16 lanes, even elements
/// by `vpermps` of the low nibble, odd by the shifted one, from the group's table.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn lut512(j: Job<'_>, out: &mut [f32]) {
    let (rb, groups) = (I / 2, I / GS);
    let vals = _mm512_setr_ps(
        -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
    );
    for r in (0..j.rows).step_by(2) {
        let p = [j.w.as_ptr().add(r * rb), j.w.as_ptr().add((r + 1) * rb)];
        let s = [j.sc.as_ptr().add(r * groups), j.sc.as_ptr().add((r + 1) * groups)];
        let mut acc = [[_mm512_setzero_ps(); 2]; 2];
        for g in 0..groups {
            let t = [
                _mm512_mul_ps(vals, _mm512_set1_ps(*s[0].add(g))),
                _mm512_mul_ps(vals, _mm512_set1_ps(*s[1].add(g))),
            ];
            for bb in 0..GS / 32 {
                let b = g * (GS / 32) + bb;
                if b % 4 == 0 {
                    prefetch2(p, 16 * b, j.pf);
                }
                let xe = _mm512_loadu_ps(j.x.as_ptr().add(32 * b));
                let xo = _mm512_loadu_ps(j.x.as_ptr().add(32 * b + 16));
                for k in 0..2 {
                    let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p[k].add(16 * b) as *const __m128i));
                    let e = _mm512_permutexvar_ps(q, t[k]);
                    let o = _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(q), t[k]);
                    acc[k][0] = _mm512_fmadd_ps(e, xe, acc[k][0]);
                    acc[k][1] = _mm512_fmadd_ps(o, xo, acc[k][1]);
                }
            }
        }
        out[r] = _mm512_reduce_add_ps(_mm512_add_ps(acc[0][0], acc[0][1]));
        out[r + 1] = _mm512_reduce_add_ps(_mm512_add_ps(acc[1][0], acc[1][1]));
    }
}

/// The kept table decode on a *repacked* layout (weights rearranged once, at load time): each
/// 64 bytes hold two g64 groups, dword lane i carrying group A's elements `16j + i` in its low
/// 16 bits (nibble j) and group B's in its high 16 bits, so a plain 64-byte load, seven
/// immediate shifts and eight `vpermps` (each with its own group's scaled table) decode 128
/// weights in element order: no `vpmovzxbd` (which shares the permute unit on Zen 4), and the
/// activations need no rearranging. Same exact weights `(k − 8)·s_g` as the kept form.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn repacked512(j: Job<'_>, out: &mut [f32]) {
    let (rb, groups) = (I / 2, I / GS);
    let vals = _mm512_setr_ps(
        -8.0, -7.0, -6.0, -5.0, -4.0, -3.0, -2.0, -1.0, 0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0,
    );
    for r in (0..j.rows).step_by(2) {
        let p = [j.w.as_ptr().add(r * rb), j.w.as_ptr().add((r + 1) * rb)];
        let s = [j.sc.as_ptr().add(r * groups), j.sc.as_ptr().add((r + 1) * groups)];
        let mut acc = [[_mm512_setzero_ps(); 4]; 2];
        for q in 0..groups / 2 {
            prefetch2(p, 64 * q, j.pf);
            let x = j.x.as_ptr().add(128 * q);
            for k in 0..2 {
                let v = _mm512_loadu_si512(p[k].add(64 * q) as *const _);
                let ta = _mm512_mul_ps(vals, _mm512_set1_ps(*s[k].add(2 * q)));
                let tb = _mm512_mul_ps(vals, _mm512_set1_ps(*s[k].add(2 * q + 1)));
                let w = [
                    _mm512_permutexvar_ps(v, ta),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<4>(v), ta),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<8>(v), ta),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<12>(v), ta),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<16>(v), tb),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<20>(v), tb),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<24>(v), tb),
                    _mm512_permutexvar_ps(_mm512_srli_epi32::<28>(v), tb),
                ];
                for (u, wu) in w.iter().enumerate() {
                    acc[k][u % 4] = _mm512_fmadd_ps(*wu, _mm512_loadu_ps(x.add(16 * u)), acc[k][u % 4]);
                }
            }
        }
        for k in 0..2 {
            let a = _mm512_add_ps(_mm512_add_ps(acc[k][0], acc[k][1]), _mm512_add_ps(acc[k][2], acc[k][3]));
            out[r + k] = _mm512_reduce_add_ps(a);
        }
    }
}

/// By group, widened: as `lut` but the nibbles converted (`and`/shift, `vcvtdq2ps`) and the
/// scale applied once per group to the group's sum (`avx2_int4.rs`'s form in 16 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen512(j: Job<'_>, out: &mut [f32]) {
    let (rb, groups) = (I / 2, I / GS);
    let m4 = _mm512_set1_epi32(0xF);
    for r in (0..j.rows).step_by(2) {
        let p = [j.w.as_ptr().add(r * rb), j.w.as_ptr().add((r + 1) * rb)];
        let s = [j.sc.as_ptr().add(r * groups), j.sc.as_ptr().add((r + 1) * groups)];
        let mut tot = [_mm512_setzero_ps(); 2];
        for g in 0..groups {
            let sum = _mm512_loadu_ps(j.sums.as_ptr().add(g * 16));
            let mut acc = [[sum, _mm512_setzero_ps()]; 2];
            for bb in 0..GS / 32 {
                let b = g * (GS / 32) + bb;
                if b % 4 == 0 {
                    prefetch2(p, 16 * b, j.pf);
                }
                let xe = _mm512_loadu_ps(j.x.as_ptr().add(32 * b));
                let xo = _mm512_loadu_ps(j.x.as_ptr().add(32 * b + 16));
                for k in 0..2 {
                    let q = _mm512_cvtepu8_epi32(_mm_loadu_si128(p[k].add(16 * b) as *const __m128i));
                    let lo = _mm512_cvtepi32_ps(_mm512_and_si512(q, m4));
                    let hi = _mm512_cvtepi32_ps(_mm512_srli_epi32::<4>(q));
                    acc[k][0] = _mm512_fmadd_ps(lo, xe, acc[k][0]);
                    acc[k][1] = _mm512_fmadd_ps(hi, xo, acc[k][1]);
                }
            }
            for k in 0..2 {
                let sv = _mm512_set1_ps(*s[k].add(g));
                tot[k] = _mm512_fmadd_ps(_mm512_add_ps(acc[k][0], acc[k][1]), sv, tot[k]);
            }
        }
        out[r] = _mm512_reduce_add_ps(tot[0]);
        out[r + 1] = _mm512_reduce_add_ps(tot[1]);
    }
}

/// Nibble planes by their float bits: one 64-byte load is two g64 groups (16 lanes of 8
/// nibbles, lanes 0..8 the first group); plane k is the float `1 + n/16`
/// (`0x3F800000 | n << 19`: one shift and one `vpternlogd`), the constant part taken out
/// through the groups' activation sums; the scales are applied per lane half. `CH`
/// accumulators per row.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq")]
unsafe fn planes512<const CH: usize>(j: Job<'_>, out: &mut [f32]) {
    let (rb, groups) = (I / 2, I / GS);
    let (m19, one) = (_mm512_set1_epi32(0xF << 19), _mm512_set1_epi32(0x3F80_0000));
    for r in (0..j.rows).step_by(2) {
        let p = [j.w.as_ptr().add(r * rb), j.w.as_ptr().add((r + 1) * rb)];
        let s = [j.sc.as_ptr().add(r * groups), j.sc.as_ptr().add((r + 1) * groups)];
        let mut tot = [_mm512_setzero_ps(); 2];
        for h in 0..groups / 2 {
            let sum = _mm512_loadu_ps(j.sums.as_ptr().add(h * 16));
            let mut acc = [[_mm512_setzero_ps(); CH]; 2];
            acc[0][0] = sum;
            acc[1][0] = sum;
            prefetch2(p, 64 * h, j.pf);
            let xb = j.x.as_ptr().add(128 * h);
            let v = [
                _mm512_loadu_si512(p[0].add(64 * h) as *const _),
                _mm512_loadu_si512(p[1].add(64 * h) as *const _),
            ];
            macro_rules! plane {
                ($k:literal, $sh:literal, $left:literal) => {{
                    let xk = _mm512_loadu_ps(xb.add(16 * $k));
                    for kk in 0..2 {
                        let t = if $left {
                            _mm512_slli_epi32::<$sh>(v[kk])
                        } else {
                            _mm512_srli_epi32::<$sh>(v[kk])
                        };
                        // (t & m19) | one
                        let f = _mm512_castsi512_ps(_mm512_ternarylogic_epi32::<0xEA>(t, m19, one));
                        acc[kk][$k % CH] = _mm512_fmadd_ps(f, xk, acc[kk][$k % CH]);
                    }
                }};
            }
            plane!(0, 19, true);
            plane!(1, 15, true);
            plane!(2, 11, true);
            plane!(3, 7, true);
            plane!(4, 3, true);
            plane!(5, 1, false);
            plane!(6, 5, false);
            plane!(7, 9, false);
            for k in 0..2 {
                let mut a = acc[k][0];
                for c in acc[k].iter().skip(1) {
                    a = _mm512_add_ps(a, *c);
                }
                let sv = _mm512_insertf32x8::<1>(
                    _mm512_set1_ps(*s[k].add(2 * h)),
                    _mm256_set1_ps(*s[k].add(2 * h + 1)),
                );
                tot[k] = _mm512_fmadd_ps(a, sv, tot[k]);
            }
        }
        out[r] = _mm512_reduce_add_ps(tot[0]);
        out[r + 1] = _mm512_reduce_add_ps(tot[1]);
    }
}

/// Split int8, the scale kept per group: activations as `K` int8 pieces per 64-element block
/// (`x ≈ sx · Σ_p 2^(−7p) · xq_p`, each piece the rounded residual of the ones before, so
/// K = 3 leaves an error below `2^−22` of the block's largest magnitude), weights as their
/// unsigned nibbles (low nibbles of 64 bytes one vector, high ones another, no transposition:
/// the activations are laid out to match once per call). Per 64 bytes (two g64 groups, lanes
/// 0..8 and 8..16) and piece: two `vpdpbusd`; pieces combined as integers (`INT`: shifted by
/// 7 bits and added, each lane's 8 products below 2^14) or as floats (one conversion and one
/// FMA each); then one FMA by the two groups' scales. `Σ xq` corrections (the nibbles' offset
/// of 8) are per group and activation only, so a call adds them once per group through
/// `sums`, as `widen` does.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw,avx512dq,avx512vnni")]
unsafe fn split512<const K: usize, const INT: bool>(j: Job<'_>, out: &mut [f32]) {
    let (rb, groups) = (I / 2, I / GS);
    let m4 = _mm512_set1_epi8(0x0F);
    // The pieces as bytes: [h][piece][even 64 | odd 64] (the probe reuses `x`'s bits).
    let xq = j.x.as_ptr() as *const u8;
    for r in (0..j.rows).step_by(2) {
        let p = [j.w.as_ptr().add(r * rb), j.w.as_ptr().add((r + 1) * rb)];
        let s = [j.sc.as_ptr().add(r * groups), j.sc.as_ptr().add((r + 1) * groups)];
        let mut tot = [_mm512_setzero_ps(); 2];
        for h in 0..groups / 2 {
            prefetch2(p, 64 * h, j.pf);
            let sum = _mm512_loadu_ps(j.sums.as_ptr().add(h * 16));
            // 2 x 64 bytes per piece of activations, reused across K pieces by the probe
            // (their loads are what matters, not their values).
            let xb = xq.add(128 * (h % 8));
            for k in 0..2 {
                let v = _mm512_loadu_si512(p[k].add(64 * h) as *const _);
                let lo = _mm512_and_si512(v, m4);
                let hi = _mm512_and_si512(_mm512_srli_epi16::<4>(v), m4);
                let sv = _mm512_insertf32x8::<1>(
                    _mm512_set1_ps(*s[k].add(2 * h)),
                    _mm256_set1_ps(*s[k].add(2 * h + 1)),
                );
                let mut f = sum;
                let mut d = _mm512_setzero_si512();
                for piece in 0..K {
                    let xe = _mm512_loadu_si512(xb.add(1024 * piece) as *const _);
                    let xo = _mm512_loadu_si512(xb.add(1024 * piece + 64) as *const _);
                    let e = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe);
                    let e = _mm512_dpbusd_epi32(e, hi, xo);
                    if INT {
                        d = _mm512_add_epi32(_mm512_slli_epi32::<7>(d), e);
                    } else {
                        f = _mm512_fmadd_ps(_mm512_cvtepi32_ps(e), _mm512_set1_ps(0.0078125), f);
                    }
                }
                if INT {
                    f = _mm512_add_ps(f, _mm512_cvtepi32_ps(d));
                }
                tot[k] = _mm512_fmadd_ps(f, sv, tot[k]);
            }
        }
        out[r] = _mm512_reduce_add_ps(tot[0]);
        out[r + 1] = _mm512_reduce_add_ps(tot[1]);
    }
}

/// The bytes alone: a xor of every 64-byte load (the streaming-read reference).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn read_only512(j: Job<'_>, out: &mut [f32]) {
    let n = j.rows * I / 2;
    let p = j.w.as_ptr();
    let mut a = [_mm512_setzero_si512(); 4];
    let mut i = 0;
    while i + 256 <= n {
        if j.pf > 0 {
            prefetch(p.wrapping_add(i + j.pf));
            prefetch(p.wrapping_add(i + 128 + j.pf));
        }
        for (k, ak) in a.iter_mut().enumerate() {
            *ak = _mm512_xor_si512(*ak, _mm512_loadu_si512(p.add(i + 64 * k) as *const _));
        }
        i += 256;
    }
    let v = _mm512_xor_si512(_mm512_xor_si512(a[0], a[1]), _mm512_xor_si512(a[2], a[3]));
    out[0] = _mm512_reduce_add_epi32(v) as f32;
}

#[cfg(target_arch = "x86_64")]
fn main() {
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(d, |a| a.parse().expect("a number"));
    let (rows, threads, pf) = (arg(1, 64), arg(2, 1).max(1), arg(3, 4096));
    let rows = rows / threads / 2 * 2 * threads;
    HINT_T1.store(arg(5, 0) == 1, Ordering::Relaxed);
    let reps = arg(4, (128_000 / rows).max(3));
    let w: Vec<u8> = (0..rows * I / 2).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8).collect();
    let sc: Vec<f32> = (0..rows * I / GS).map(|i| 0.01 + (i % 7) as f32 * 0.001).collect();
    let x: Vec<f32> = (0..I + 4096).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
    let sums = vec![0.5f32; I / GS * 16 + 16];
    // Only the variants this CPU runs.
    let mut variants: Vec<(&str, Variant)> = vec![
        ("avx2 read only", read_only256),
        ("avx2 widen (kept)", widen256),
        ("avx2 planes, 2 acc", planes256::<2, false>),
        ("avx2 planes, 4 acc", planes256::<4, false>),
        ("avx2 planes+magic, 2 acc", planes256::<2, true>),
        ("avx2 planes+magic, 4 acc", planes256::<4, true>),
    ];
    let avx512 = is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512dq");
    if avx512 {
        variants.extend([
            ("avx512 read only", read_only512 as Variant),
            ("avx512 lut (kept)", lut512),
            ("avx512 lut, repacked layout", repacked512),
            ("avx512 widen by group", widen512),
            ("avx512 planes+magic, 2", planes512::<2>),
            ("avx512 planes+magic, 4", planes512::<4>),
        ]);
        if is_x86_feature_detected!("avx512vnni") {
            variants.extend([
                ("split int8 K=3, int", split512::<3, true> as Variant),
                ("split int8 K=3, float", split512::<3, false>),
                ("split int8 K=4, int", split512::<4, true>),
                ("split int8 K=2, int", split512::<2, true>),
            ]);
        }
    }
    let per = rows / threads;
    println!("{rows} rows x {I} int4-g64, {threads} thread(s), prefetch {pf} B, {reps} reps");
    for round in 0..3 {
        for &(name, f) in &variants {
            let t = Instant::now();
            std::thread::scope(|scope| {
                for th in 0..threads {
                    let job = Job {
                        w: &w[th * per * I / 2..(th + 1) * per * I / 2],
                        sc: &sc[th * per * I / GS..(th + 1) * per * I / GS],
                        x: &x,
                        sums: &sums,
                        rows: per,
                        pf,
                    };
                    scope.spawn(move || {
                        let mut o = vec![0f32; per];
                        for _ in 0..reps {
                            // SAFETY: every variant in the list runs on this CPU (checked
                            // above); every pointer the variants form stays inside the job's
                            // slices (prefetches may point past them, which never faults).
                            unsafe { f(job, &mut o) };
                            std::hint::black_box(&o);
                        }
                    });
                }
            });
            let gib = (rows * I / 2 * reps) as f64 / t.elapsed().as_secs_f64() / (1u64 << 30) as f64;
            println!("round {round}  {name:26} {gib:6.2} GiB/s");
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("an x86-64 probe");
}
