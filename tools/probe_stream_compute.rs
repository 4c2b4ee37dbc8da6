//! Stand-alone probe (developer tool, not part of the crate): how much of the memory
//! bandwidth a streaming loop reaches as a function of the compute it does per byte, on this
//! machine. It answers "what would decode need to stream at 85% of the bandwidth": a loop
//! cannot stream faster than it computes, and this measures how close to the bandwidth a
//! loop gets when its in-cache speed is 1×, 2×, 4× … the bandwidth.
//!
//! Each variant reads its buffer once per pass, 64-byte line by line, with a software
//! prefetch 8 KiB ahead (`prefetcht1` on AMD, `prefetcht0` elsewhere: the kernels' choice,
//! src/quant/kernels/avx512.rs), and does `W` independent 16-lane FMAs per line, each the
//! line's 16 floats times one of 16 activation vectors held in registers (`W` = 0: an XOR,
//! the plain read; the kernels' activation loads go to the load ports, not the vector units).
//! `W` = 8 is 128 multiply-adds per 64 bytes: one FMA lane per int4 weight, the least an
//! exact f32 S = 1 int4 loop can do, with no decoding at all.
//!
//! For each `W` it reports the loop's speed in cache (one thread, 256 KiB, many passes) times
//! the thread count (its compute ceiling C), its speed from DRAM on all threads (A), and the
//! plain read from DRAM (B, `W` = 0): the ratio C/B is the loop's headroom over the
//! bandwidth and A/B what it reached. Rounds alternate the variant order; medians.
//!
//! ```text
//! rustc -O -C target-cpu=native tools/probe_stream_compute.rs -o /tmp/probe_stream_compute
//! /tmp/probe_stream_compute            # 2 threads, 512 MiB each, 7 rounds
//! /tmp/probe_stream_compute 2 512 7 8192
//! ```
//! docs/benchmarks.md ("How much compute a stream can carry") has the figures.

#[cfg(target_arch = "x86_64")]
use std::arch::x86_64::*;
use std::time::Instant;

/// Stream `buf` once: per 64-byte line `W` FMAs (or an XOR when `W` is 0), prefetching
/// `pf` bytes ahead into L2 (`t1`) or L1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pass<const W: usize>(buf: &[u8], x: &[__m512], pf: usize, t1: bool) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 16];
    let p = buf.as_ptr();
    // Sixteen activation vectors held in registers (see the module docs).
    let xr: [__m512; 16] = std::array::from_fn(|k| x[k % x.len()]);
    let mut i = 0;
    while i + 64 <= buf.len() {
        let q = p.add(i);
        // `wrapping_add`: the address may lie past the buffer; a prefetch never faults.
        let ahead = q.wrapping_add(pf) as *const i8;
        if t1 {
            _mm_prefetch::<_MM_HINT_T1>(ahead);
        } else {
            _mm_prefetch::<_MM_HINT_T0>(ahead);
        }
        let v = _mm512_load_si512(q as *const _);
        if W == 0 {
            acc[0] = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(acc[0]), v));
        } else {
            let vf = _mm512_castsi512_ps(v);
            for k in 0..W {
                acc[k % 16] = _mm512_fmadd_ps(vf, xr[k % 16], acc[k % 16]);
            }
        }
        i += 64;
    }
    let mut t = acc[0];
    for a in &acc[1..] {
        t = _mm512_add_ps(t, *a);
    }
    _mm512_reduce_add_ps(t)
}

#[cfg(target_arch = "x86_64")]
/// A 64-byte aligned buffer of `bytes` whose floats are small and normal.
fn buffer(bytes: usize) -> Vec<__m512> {
    // SAFETY: AVX-512 F is checked in `main` before any buffer is made.
    vec![unsafe { _mm512_set1_ps(0.0115) }; bytes / 64]
}

#[cfg(target_arch = "x86_64")]
fn as_bytes(b: &[__m512]) -> &[u8] {
    // SAFETY: a __m512 is 64 plain bytes; the slice covers exactly the vectors.
    unsafe { std::slice::from_raw_parts(b.as_ptr() as *const u8, b.len() * 64) }
}

/// The variants: FMAs per line.
const WS: [usize; 7] = [0, 2, 4, 6, 8, 12, 16];

#[cfg(target_arch = "x86_64")]
/// One pass of variant `w` over `buf`.
fn run(w: usize, buf: &[u8], x: &[__m512], pf: usize, t1: bool) -> f32 {
    // SAFETY: AVX-512 F is checked in `main`; `pass` reads only inside `buf` and `x`
    // (prefetches may point past them, which never faults).
    unsafe {
        match w {
            0 => pass::<0>(buf, x, pf, t1),
            2 => pass::<2>(buf, x, pf, t1),
            4 => pass::<4>(buf, x, pf, t1),
            6 => pass::<6>(buf, x, pf, t1),
            8 => pass::<8>(buf, x, pf, t1),
            12 => pass::<12>(buf, x, pf, t1),
            _ => pass::<16>(buf, x, pf, t1),
        }
    }
}

#[cfg(target_arch = "x86_64")]
/// GB/s of `reps` passes of variant `w` on every buffer, one thread per buffer.
fn rate(w: usize, bufs: &[Vec<__m512>], x: &[__m512], reps: usize, pf: usize, t1: bool) -> f64 {
    let t = Instant::now();
    std::thread::scope(|s| {
        for b in bufs {
            s.spawn(move || {
                for _ in 0..reps {
                    std::hint::black_box(run(w, as_bytes(b), x, pf, t1));
                }
            });
        }
    });
    let bytes: usize = bufs.iter().map(|b| b.len() * 64 * reps).sum();
    bytes as f64 / t.elapsed().as_secs_f64() / 1e9
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[cfg(target_arch = "x86_64")]
fn main() {
    if !is_x86_feature_detected!("avx512f") {
        eprintln!("this probe needs AVX-512 F");
        return;
    }
    let arg = |i: usize, d: usize| {
        std::env::args()
            .nth(i)
            .map_or(d, |a| a.parse().expect("a number"))
    };
    let (threads, mib, rounds, pf) = (arg(1, 2).max(1), arg(2, 512), arg(3, 7).max(1), arg(4, 8192));
    let amd = std::arch::x86_64::__cpuid(0);
    // "AuthenticAMD": ebx "Auth", edx "enti", ecx "cAMD".
    let t1 = amd.ebx == 0x6874_7541 && amd.edx == 0x6974_6e65 && amd.ecx == 0x444d_4163;
    let x = buffer(16 * 64);
    let small = vec![buffer(256 << 10)];
    let big: Vec<Vec<__m512>> = (0..threads).map(|_| buffer(mib << 20)).collect();
    println!(
        "{threads} thread(s), {mib} MiB each from DRAM, 256 KiB in cache, prefetch {pf} B {}, {rounds} rounds",
        if t1 { "prefetcht1" } else { "prefetcht0" }
    );
    let mut cache = vec![Vec::new(); WS.len()];
    let mut dram = vec![Vec::new(); WS.len()];
    for r in 0..rounds {
        for j in 0..WS.len() {
            let j = if r % 2 == 1 { WS.len() - 1 - j } else { j };
            cache[j].push(rate(WS[j], &small, &x, 2000, pf, t1));
            dram[j].push(rate(WS[j], &big, &x, 1, pf, t1));
        }
    }
    let read = median(dram[0].clone());
    println!("plain read from DRAM (B): {read:.1} GB/s");
    println!("| FMAs per 64-byte line | in cache x threads (C), GB/s | C / B | from DRAM (A), GB/s | A / B |");
    println!("|---|---|---|---|---|");
    for (j, w) in WS.iter().enumerate() {
        let c = median(cache[j].clone()) * threads as f64;
        let a = median(dram[j].clone());
        println!("| {w} | {c:.1} | {:.2} | {a:.1} | {:.0}% |", c / read, 100.0 * a / read);
    }
}

#[cfg(not(target_arch = "x86_64"))]
fn main() {
    eprintln!("an x86-64 probe");
}
