//! What the int8 decode kernel streams against the memory's bandwidth, measured in the same
//! run: a MoE layer's 9 experts (8 routed and a shared one) of the side-by-side model's shape
//! (gate/up 1024 × 2048, down 2048 × 1024, int4-g64, 3.4 MB each) with S = 1, 2, 4, 8 rows
//! each (`experts_ffn_in` in int8, one call per layer, as a forward makes it), cycling
//! through enough layers to come from DRAM (`--gib`, default 1.5: over a 480 MB L3), beside a
//! plain read of the same bytes on the same pool and the same calls on one layer held in
//! cache (the kernel's compute ceiling). Rounds alternate the variant order; medians (`--best`:
//! the fastest round, on a busy host).
//!
//! ```text
//! cargo run --release --example probe_decode_rows -- [--threads 2] [--gib 1.5] [--rounds 7] [--best]
//! ```

use std::time::Instant;

use colibri::quant::format::QuantFormat;
use colibri::quant::kernels::{self, Arithmetic, ExpertCall};
use rayon::prelude::*;

// The kernel benches' matrices and plain read (`cargo bench`), so both measure the same way.
#[allow(dead_code)]
#[path = "../benches/probes.rs"]
mod probes;
#[allow(dead_code)]
#[path = "../benches/random_matrix.rs"]
mod random_matrix;

use random_matrix::{bytes, Owned};

/// XOR of `b`'s words on the pool, prefetching 8 KiB ahead (the benches' plain read).
fn xor_words(b: &[u8]) -> u64 {
    let (_, mid, _) = bytemuck::pod_align_to::<u8, u64>(b);
    mid.par_chunks(1 << 14)
        .map(probes::xor_prefetching)
        .reduce(|| 0, |a, b| a ^ b)
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    if BEST.load(std::sync::atomic::Ordering::Relaxed) {
        v[0]
    } else {
        v[v.len() / 2]
    }
}

static BEST: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

fn main() {
    let mut threads = 2usize;
    let mut gib = 1.5f64;
    let mut rounds = 7usize;
    let mut args = std::env::args().skip(1);
    while let Some(a) = args.next() {
        if a == "--best" {
            BEST.store(true, std::sync::atomic::Ordering::Relaxed);
            continue;
        }
        let v = args.next().expect("a value");
        match a.as_str() {
            "--threads" => threads = v.parse().expect("--threads"),
            "--gib" => gib = v.parse().expect("--gib"),
            "--rounds" => rounds = v.parse().expect("--rounds"),
            _ => panic!("unknown flag {a}"),
        }
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("pool");
    let format = QuantFormat::Int4Grouped { group_size: 64 };
    let (f, h, n) = (1024usize, 2048usize, 9usize);
    let expert_bytes = 2 * format.data_bytes(f, h).expect("size")
        + format.data_bytes(h, f).expect("size")
        + 4 * (2 * format.scale_count(f, h).expect("n") + format.scale_count(h, f).expect("n"));
    let layer_bytes = n * expert_bytes;
    let count = ((gib * (1u64 << 30) as f64) as usize).div_ceil(layer_bytes);
    let layers: Vec<Vec<[Owned; 3]>> = (0..count as u64)
        .map(|l| {
            (0..n as u64)
                .map(|e| {
                    let seed = 1000 * l + 10 * e;
                    [
                        Owned::new(format, f, h, seed + 1),
                        Owned::new(format, f, h, seed + 2),
                        Owned::new(format, h, f, seed + 3),
                    ]
                })
                .collect()
        })
        .collect();
    let rows_set = [1usize, 2, 4, 8];
    let xs: Vec<Vec<f32>> = rows_set
        .iter()
        .map(|&s| {
            bytes(7 + s as u64, s * h)
                .into_iter()
                .map(|b| (b as f32 - 128.0) / 64.0)
                .collect()
        })
        .collect();
    let mut outs: Vec<Vec<f32>> = (0..n).map(|_| vec![0.0f32; 8 * h]).collect();
    // Variants: 0 = read; 1.. = int8 S rows from DRAM; then S rows in cache.
    let names: Vec<String> = std::iter::once("read".to_string())
        .chain(rows_set.iter().map(|s| format!("int8 S{s} dram")))
        .chain(rows_set.iter().map(|s| format!("int8 S{s} cache")))
        .collect();
    let mut times: Vec<Vec<f64>> = vec![Vec::new(); names.len()];
    let passes = count.max(8);
    let mut sink = 0u64;
    for round in 0..rounds {
        let mut order: Vec<usize> = (0..names.len()).collect();
        if round % 2 == 1 {
            order.reverse();
        }
        for &v in &order {
            let t = pool.install(|| {
                let t0 = Instant::now();
                for p in 0..passes {
                    let l = if v > rows_set.len() { 0 } else { p % count };
                    let layer = &layers[l];
                    if v == 0 {
                        for m in layer.iter().flatten() {
                            sink ^= xor_words(&m.data) ^ xor_words(bytemuck::cast_slice(&m.scales));
                        }
                        continue;
                    }
                    let k = (v - 1) % rows_set.len();
                    let s = rows_set[k];
                    let x = &xs[k];
                    let calls: Vec<ExpertCall<'_>> = layer
                        .iter()
                        .map(|[g, u, d]| ExpertCall {
                            gate: g.view(),
                            up: u.view(),
                            down: d.view(),
                            x,
                            s,
                        })
                        .collect();
                    let mut o: Vec<&mut [f32]> = outs.iter_mut().map(|y| &mut y[..s * h]).collect();
                    kernels::experts_ffn_in(Arithmetic::Int8, &calls, &mut o, Some(&pool))
                        .expect("experts");
                }
                t0.elapsed().as_secs_f64()
            });
            times[v].push(t / passes as f64);
        }
    }
    let read = median(&mut times[0].clone());
    println!(
        "{} layers of {:.1} MB, {threads} threads, {rounds} rounds (sink {})",
        count,
        layer_bytes as f64 / 1e6,
        sink & 1
    );
    println!("variant | ms/layer | GB/s | × read BW | × S1 time");
    let mut s1 = [0.0f64; 2];
    for (v, name) in names.iter().enumerate() {
        let t = median(&mut times[v]);
        if v == 1 {
            s1[0] = t;
        }
        if v == rows_set.len() + 1 {
            s1[1] = t;
        }
        let base = if v > rows_set.len() { s1[1] } else { s1[0] };
        println!(
            "{name} | {:.3} | {:.1} | {:.2} | {:.2}",
            t * 1e3,
            layer_bytes as f64 / t / 1e9,
            read / t,
            if v == 0 { 0.0 } else { t / base }
        );
    }
}
