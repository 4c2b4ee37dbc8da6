//! Stand-alone probe of the exact S = 1 int4-g64 inner loop on AVX2 (developer tool, not part
//! of the crate): the kept form of `src/quant/kernels/avx2_int4.rs` against two alternatives
//! without its `vpmovzxbd` widening, and a plain streaming read of the same bytes. Each
//! variant computes two weight rows per pass, `Σ_g s_g · (Σ n·x + Σ_g)`, over 6,144 columns;
//! the values are not checked against each other (the activation layouts differ), only timed.
//! docs/benchmarks.md, "Session 14", has the figures and what they mean.
//!
//! ```text
//! rustc -O -C target-cpu=native tools/probe_int4_loops.rs -o /tmp/probe_int4_loops
//! /tmp/probe_int4_loops 64 1        # 64 rows (192 KiB: L2), 1 thread
//! /tmp/probe_int4_loops 32768 2     # 100 MB from DRAM, 2 threads
//! /tmp/probe_int4_loops 32768 2 0   # ... without software prefetch (third argument: bytes)
//! ```

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::time::Instant;

/// Columns of a weight row.
const I: usize = 6144;
/// Elements per group (one scale).
const GS: usize = 64;

/// What one call computes: `rows` weight rows (packed nibbles `w`, scales `sc`) against one
/// activation row `x` (with per-group sums `sums`), prefetching `pf` bytes ahead (0: none).
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

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn hsum(v: __m256) -> f32 {
    let mut t = [0f32; 8];
    _mm256_storeu_ps(t.as_mut_ptr(), v);
    t.iter().sum()
}

/// The kept form: per 32-element block, two halves of 8 bytes widened to 8 lanes; low
/// nibbles by `and`, high by a shift, both converted, one FMA each.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn widen(j: Job<'_>, out: &mut [f32]) {
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
                        _mm_prefetch::<_MM_HINT_T0>(pk.add(16 * b + j.pf) as *const i8);
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
unsafe fn planes<const CH: usize, const MAGIC: bool>(j: Job<'_>, out: &mut [f32]) {
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
                        _mm_prefetch::<_MM_HINT_T0>(pk.add(32 * b + j.pf) as *const i8);
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
unsafe fn read_only(j: Job<'_>, out: &mut [f32]) {
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

#[cfg(target_arch = "x86_64")]
fn main() {
    assert!(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma"));
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(d, |a| a.parse().expect("a number"));
    let (rows, threads, pf) = (arg(1, 64), arg(2, 1).max(1), arg(3, 4096));
    let rows = rows / threads / 2 * 2 * threads;
    let w: Vec<u8> = (0..rows * I / 2).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8).collect();
    let sc: Vec<f32> = (0..rows * I / GS).map(|i| 0.01 + (i % 7) as f32 * 0.001).collect();
    let x: Vec<f32> = (0..I + 64).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
    let sums = vec![0.5f32; I / GS * 8 + 8];
    let variants: [(&str, Variant); 6] = [
        ("read only", read_only),
        ("widen (kept)", widen),
        ("planes, 2 acc", planes::<2, false>),
        ("planes, 4 acc", planes::<4, false>),
        ("planes+magic, 2 acc", planes::<2, true>),
        ("planes+magic, 4 acc", planes::<4, true>),
    ];
    let per = rows / threads;
    let reps = (128_000 / rows).max(3);
    println!("{rows} rows x {I} int4-g64, {threads} thread(s), prefetch {pf} B, {reps} reps");
    for round in 0..3 {
        for (name, f) in variants {
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
                            // SAFETY: AVX2 and FMA were checked above; every pointer the
                            // variants form stays inside the job's slices (prefetches may
                            // point past them, which never faults).
                            unsafe { f(job, &mut o) };
                            std::hint::black_box(&o);
                        }
                    });
                }
            });
            let gib = (rows * I / 2 * reps) as f64 / t.elapsed().as_secs_f64() / (1u64 << 30) as f64;
            println!("round {round}  {name:22} {gib:6.2} GiB/s");
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("an x86-64 (AVX2) probe");
}
