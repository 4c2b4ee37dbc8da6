"""The machine's ceilings: a small probe compiled with rustc (the method of benches/probes.rs)
that measures the streaming-read bandwidth, the f32 FMA and int8 VNNI peaks, and the
exact-arithmetic stream floor."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

PROBE_RS = r"""
// Machine ceilings for tools/bench_llamacpp.py: the method of benches/probes.rs (a streaming
// XOR read of a 1 GiB buffer with software prefetch 8 KiB ahead; independent FMA chains),
// plus an int8 VNNI (vpdpbusd) ceiling. Prints one JSON line.
use std::arch::x86_64::*;
use std::time::Instant;

fn xor_prefetching(words: &[u64]) -> u64 {
    const AHEAD: usize = 8192 / 8;
    let mut acc = [0u64; 8];
    let lines = words.chunks_exact(8);
    let rest = lines.remainder().iter().fold(0, |a, &b| a ^ b);
    for (i, line) in lines.enumerate() {
        let ahead = words.as_ptr().wrapping_add(i * 8 + AHEAD) as *const i8;
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead) };
        for (a, &v) in acc.iter_mut().zip(line) { *a ^= v; }
    }
    acc.iter().fold(rest, |a, &b| a ^ b)
}

const CHAINS: usize = 12;

// The exact f32 S = 1 int4 loop's floor of work (tools/probe_stream_compute.rs): the same
// prefetching stream, each 64-byte line converted to floats once and multiplied into 128
// lanes of FMAs (one lane per int4 weight) against 8 activation vectors (constant addresses:
// held in registers), and nothing else. No exact decode can stream faster than this on the
// machine; docs/benchmarks.md, "How much compute a stream can carry".
/// Prefetch the line 8 KiB past `q` into L2 (`t1`, as the kernels do on AMD) or L1.
#[inline(always)]
fn prefetch_ahead(q: *const u8, t1: bool) {
    let ahead = q.wrapping_add(8192) as *const i8;
    unsafe {
        if t1 { _mm_prefetch::<_MM_HINT_T1>(ahead) } else { _mm_prefetch::<_MM_HINT_T0>(ahead) }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn exact_floor512(words: &[u64], x: &[f32], t1: bool) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 8];
    let p = words.as_ptr() as *const u8;
    let lines = words.len() / 8;
    for i in 0..lines {
        let q = p.add(64 * i);
        prefetch_ahead(q, t1);
        let v = _mm512_cvtepi32_ps(_mm512_loadu_si512(q as *const _));
        for k in 0..8 {
            let xv = _mm512_loadu_ps(x.as_ptr().add(16 * k));
            acc[k] = _mm512_fmadd_ps(v, xv, acc[k]);
        }
    }
    let mut s = acc[0];
    for a in &acc[1..] { s = _mm512_add_ps(s, *a); }
    _mm512_reduce_add_ps(s)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn exact_floor256(words: &[u64], x: &[f32], t1: bool) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 8];
    let p = words.as_ptr() as *const u8;
    let lines = words.len() / 8;
    for i in 0..lines {
        let q = p.add(64 * i);
        prefetch_ahead(q, t1);
        for h in 0..2 {
            let v = _mm256_cvtepi32_ps(_mm256_loadu_si256(q.add(32 * h) as *const __m256i));
            for k in 0..8 {
                let xv = _mm256_loadu_ps(x.as_ptr().add(8 * k));
                acc[k] = _mm256_fmadd_ps(v, xv, acc[k]);
            }
        }
    }
    let mut s = acc[0];
    for a in &acc[1..] { s = _mm256_add_ps(s, *a); }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}

#[target_feature(enable = "avx512f")]
unsafe fn fma512(iters: usize, seed: f32) -> f32 {
    let mut acc = [_mm512_set1_ps(seed); CHAINS];
    let (a, b) = (_mm512_set1_ps(0.999_99), _mm512_set1_ps(1e-7));
    for _ in 0..iters { for c in acc.iter_mut() { *c = _mm512_fmadd_ps(*c, a, b); } }
    let mut s = _mm512_setzero_ps();
    for c in acc { s = _mm512_add_ps(s, c); }
    _mm512_reduce_add_ps(s)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn fma256(iters: usize, seed: f32) -> f32 {
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    let (a, b) = (_mm256_set1_ps(0.999_99), _mm256_set1_ps(1e-7));
    for _ in 0..iters { for c in acc.iter_mut() { *c = _mm256_fmadd_ps(*c, a, b); } }
    let mut s = _mm256_setzero_ps();
    for c in acc { s = _mm256_add_ps(s, c); }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}

#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vnni512(iters: usize, seed: i32) -> i32 {
    let mut acc = [_mm512_set1_epi32(seed); CHAINS];
    let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
    for _ in 0..iters { for c in acc.iter_mut() { *c = _mm512_dpbusd_epi32(*c, a, b); } }
    let mut s = _mm512_setzero_si512();
    for c in acc { s = _mm512_add_epi32(s, c); }
    _mm512_reduce_add_epi32(s)
}

fn median(mut v: Vec<f64>) -> f64 { v.sort_by(|a, b| a.partial_cmp(b).unwrap()); v[v.len() / 2] }

fn main() {
    let threads: usize = std::env::args().nth(1).map_or(2, |s| s.parse().unwrap());
    let gib: usize = std::env::args().nth(2).map_or(1, |s| s.parse().unwrap());
    let bytes = gib << 30;
    let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let want = buf.iter().fold(0u64, |a, &v| a ^ v);
    let mut read = Vec::new();
    for _ in 0..11 {
        let t = Instant::now();
        let per = buf.len() / threads;
        let x = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads).map(|k| {
                let end = if k + 1 == threads { buf.len() } else { (k + 1) * per };
                let part = &buf[k * per..end];
                s.spawn(move || part.chunks(1 << 13).map(xor_prefetching).fold(0, |a, b| a ^ b))
            }).collect();
            hs.into_iter().map(|h| h.join().unwrap()).fold(0, |a, b| a ^ b)
        });
        let dt = t.elapsed().as_secs_f64();
        assert_eq!(x, want);
        read.push(bytes as f64 / dt / 1e9);
    }
    read.remove(0);
    let avx512 = is_x86_feature_detected!("avx512f");
    // The kernels prefetch into L2 on AMD (src/quant/kernels/avx512.rs).
    let v = __cpuid(0);
    let amd = v.ebx == 0x6874_7541 && v.edx == 0x6974_6e65 && v.ecx == 0x444d_4163;
    let x: Vec<f32> = (0..128).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut floor = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let per = buf.len() / threads;
        std::thread::scope(|s| {
            for k in 0..threads {
                let end = if k + 1 == threads { buf.len() } else { (k + 1) * per };
                let (part, x) = (&buf[k * per..end], &x);
                s.spawn(move || std::hint::black_box(unsafe {
                    if avx512 { exact_floor512(part, x, amd) } else { exact_floor256(part, x, amd) }
                }));
            }
        });
        floor.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let vnni = avx512 && is_x86_feature_detected!("avx512vnni");
    let iters = 1usize << 22;
    let mut fma = Vec::new();
    let mut int8 = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads).map(|k| s.spawn(move || unsafe {
                if avx512 { fma512(iters, k as f32 + 1.0) } else { fma256(iters, k as f32 + 1.0) }
            })).collect();
            for h in hs { std::hint::black_box(h.join().unwrap()); }
        });
        let lanes = if avx512 { 16 } else { 8 };
        fma.push((threads * iters * CHAINS * 2 * lanes) as f64 / t.elapsed().as_secs_f64() / 1e9);
        if vnni {
            let t = Instant::now();
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads)
                    .map(|k| s.spawn(move || unsafe { vnni512(iters, k as i32) }))
                    .collect();
                for h in hs { std::hint::black_box(h.join().unwrap()); }
            });
            // 16 lanes x 4 byte products, each a multiply and an add
            int8.push((threads * iters * CHAINS * 2 * 64) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    println!(
        concat!(
            "{{\"threads\": {}, \"read_GBps\": {:.3}, \"read_GBps_max\": {:.3}, ",
            "\"fma_f32_GFLOPs\": {:.2}, \"fma_path\": \"{}\", \"vnni_int8_GOPs\": {}, ",
            "\"exact_floor_GBps\": {:.3}}}"
        ),
        threads,
        median(read.clone()),
        read.iter().cloned().fold(0.0, f64::max),
        median(fma),
        if avx512 { "avx512" } else { "avx2" },
        if vnni { format!("{:.2}", median(int8)) } else { "null".to_string() },
        median(floor)
    );
}
"""


def probe(cache: Path, threads: int, gib: int) -> dict[str, Any]:
    exe = cache / "probe"
    src = cache / "probe.rs"
    if not exe.exists() or not src.exists() or src.read_text() != PROBE_RS:
        src.write_text(PROBE_RS)
        rustc = shutil.which("rustc")
        if rustc is None:
            raise SystemExit("the bandwidth/FMA probe needs rustc (rustup.rs)")
        cmd = [
            rustc,
            "--edition",
            "2021",
            "-O",
            "-C",
            "target-cpu=native",
            str(src),
            "-o",
            str(exe),
        ]
        subprocess.run(cmd, check=True)
    out = subprocess.run(
        [str(exe), str(threads), str(gib)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)
