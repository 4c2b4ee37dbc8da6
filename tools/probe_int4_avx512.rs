//! Stand-alone probe of the exact S = 1 int4-g64 inner loop on AVX-512 (developer tool, not
//! part of the crate; the AVX2 one is tools/probe_int4_loops.rs): the kept form of
//! `src/quant/kernels/avx512.rs` (`Int4Lut`: a 16-entry table `(k − 8)·s_g` per group,
//! looked up by `vpermps`) against forms that factor the scale out of each group as
//! `avx2_int4.rs` does, split-int8 forms (`vpdpbusd` against the activations as K int8
//! pieces: what decode could use to approach the bandwidth) and a plain streaming read of the
//! same bytes. Each variant computes
//! two weight rows per pass over 6,144 columns; the values are not checked against each other
//! (the activation layouts differ), only timed. docs/benchmarks.md has the figures.
//!
//! ```text
//! rustc -O -C target-cpu=native tools/probe_int4_avx512.rs -o /tmp/probe_int4_avx512
//! /tmp/probe_int4_avx512 64 1        # 64 rows (192 KiB: L2), 1 thread
//! /tmp/probe_int4_avx512 32768 2 8192 20   # 100 MB from DRAM, 2 threads, 8 KiB ahead, 20 reps
//! /tmp/probe_int4_avx512 32768 2 8192 20 1 # ... prefetching into L2 (`prefetcht1`), not L1
//! ```

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
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

/// Prefetch into L2 (`T1`) instead of L1 (`T0`): the fifth argument, 1.
static HINT_T1: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

type Variant = unsafe fn(Job<'_>, &mut [f32]);

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn prefetch2(p: [*const u8; 2], at: usize, pf: usize) {
    if pf > 0 {
        for pk in p {
            if HINT_T1.load(std::sync::atomic::Ordering::Relaxed) {
                _mm_prefetch::<_MM_HINT_T1>(pk.wrapping_add(at + pf) as *const i8);
            } else {
                _mm_prefetch::<_MM_HINT_T0>(pk.wrapping_add(at + pf) as *const i8);
            }
        }
    }
}

/// The kept form: per 32-element block (16 bytes) `vpmovzxbd` to 16 lanes, even elements
/// by `vpermps` of the low nibble, odd by the shifted one, from the group's table.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn lut(j: Job<'_>, out: &mut [f32]) {
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

/// By group, widened: as `lut` but the nibbles converted (`and`/shift, `vcvtdq2ps`) and the
/// scale applied once per group to the group's sum (`avx2_int4.rs`'s form in 16 lanes).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn widen(j: Job<'_>, out: &mut [f32]) {
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
unsafe fn planes<const CH: usize>(j: Job<'_>, out: &mut [f32]) {
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
unsafe fn split<const K: usize, const INT: bool>(j: Job<'_>, out: &mut [f32]) {
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
unsafe fn read_only(j: Job<'_>, out: &mut [f32]) {
    let n = j.rows * I / 2;
    let p = j.w.as_ptr();
    let mut a = [_mm512_setzero_si512(); 4];
    let mut i = 0;
    while i + 256 <= n {
        if j.pf > 0 {
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + j.pf) as *const i8);
            _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(i + 128 + j.pf) as *const i8);
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
    assert!(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512bw") && is_x86_feature_detected!("avx512dq"));
    let arg = |i: usize, d: usize| std::env::args().nth(i).map_or(d, |a| a.parse().expect("a number"));
    let (rows, threads, pf) = (arg(1, 64), arg(2, 1).max(1), arg(3, 4096));
    let rows = rows / threads / 2 * 2 * threads;
    let w: Vec<u8> = (0..rows * I / 2).map(|i| (i.wrapping_mul(2_654_435_761) >> 7) as u8).collect();
    let sc: Vec<f32> = (0..rows * I / GS).map(|i| 0.01 + (i % 7) as f32 * 0.001).collect();
    let x: Vec<f32> = (0..I + 4096).map(|i| ((i % 13) as f32 - 6.0) * 0.1).collect();
    let sums = vec![0.5f32; I / GS * 16 + 16];
    let vnni = is_x86_feature_detected!("avx512vnni");
    let mut variants: Vec<(&str, Variant)> = vec![
        ("read only", read_only),
        ("lut (kept)", lut),
        ("widen by group", widen),
        ("planes+magic, 2 acc", planes::<2>),
        ("planes+magic, 4 acc", planes::<4>),
    ];
    if vnni {
        variants.push(("split int8 K=3, int", split::<3, true>));
        variants.push(("split int8 K=3, float", split::<3, false>));
        variants.push(("split int8 K=4, int", split::<4, true>));
        variants.push(("split int8 K=2, int", split::<2, true>));
    }
    let per = rows / threads;
    HINT_T1.store(arg(5, 0) == 1, std::sync::atomic::Ordering::Relaxed);
    let reps = arg(4, (128_000 / rows).max(3));
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
                            // SAFETY: AVX-512 F and BW were checked above; every pointer the
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
    eprintln!("an x86-64 (AVX-512) probe");
}
