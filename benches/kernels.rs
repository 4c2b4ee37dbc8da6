//! Dequant-matmul kernels at GLM-5.2 shapes, with 2 threads, reported as GB/s of weight bytes
//! (data + scales): compare with the `bandwidth` group of the same run. Each bench cycles
//! through copies of its matrix (≥ 512 MiB in all) so the weights come from DRAM. Calls are
//! made from a thread of the pool, as the forward pass makes them.
//!
//! - `kernels/<format>/<name OxI>/S<s>`: the dispatched path, S = 1, 4, 8; `/S<s>/int8` the
//!   same rows in the int8 arithmetic (formats that have it, CPUs with a SIMD int8 kernel).
//! - `kernels/<format>/<name OxI>/read`: a prefetching 2-thread read of the same matrices'
//!   bytes, the paired limit for the S rows next to it.
//! - `kernel_paths/int4_g64/expert_gate_OxI/S1/<path>`: every available path, A/B.
//! - `expert_ffn/int4_g64/S<s>`: the fused expert (gate, up, down), bytes of all three.
//! - `kernel_l2/...`: one thread on an L2-resident matrix: the kernels' compute ceiling.

use std::hint::black_box;
use std::time::{Duration, Instant};

use colibri::quant::kernels::{self, Arithmetic, KernelPath};
use colibri::quant::{QMatrix, QuantFormat};

use crate::random_matrix::{bytes, Owned};
use criterion::{criterion_group, Bencher, BenchmarkGroup, Criterion, Throughput};

/// (name, O, I) of GLM-5.2 (its config.json): expert gate/up and down, MLA kv_a, o_proj.
const SHAPES: [(&str, usize, usize); 4] = [
    ("expert_gate", 2048, 6144),
    ("expert_down", 6144, 2048),
    ("kv_a", 576, 6144),
    ("o_proj", 6144, 16384),
];

const THREADS: usize = 2;

/// Each bench cycles through enough copies of its matrix to exceed this, so the weights come
/// from DRAM as in decode (where every layer's weights are cold), not from the 32 MiB L3.
/// 16× the L3: at 128 MiB (and at most 16 copies, 32 MiB for kv_a) the L3 kept part of a
/// cyclic working set, and plain reads of it ran at up to 107 GiB/s.
const WORKING_SET: usize = 512 << 20;

/// How many copies of a matrix of `bytes` make up the working set (1..=256).
fn copies(bytes: usize) -> usize {
    WORKING_SET.div_ceil(bytes.max(1)).clamp(1, 256)
}

fn activations(s: usize, cols: usize) -> Vec<f32> {
    bytes(7 + s as u64, s * cols)
        .into_iter()
        .map(|b| (b as f32 - 127.5) / 128.0)
        .collect()
}

/// Check the kernel against the scalar reference on the first rows before timing anything.
fn check(path: KernelPath, m: &Owned, x: &[f32], s: usize, y: &[f32]) {
    let r = m.rows.min(4);
    let head = m.head(r);
    let mut want = vec![0.0f32; s * r];
    kernels::scalar::matmul(&head, x, s, &mut want);
    for t in 0..s {
        for o in 0..r {
            let (g, w) = (y[t * m.rows + o], want[t * r + o]);
            assert!(
                (g - w).abs() <= 1e-3 * w.abs().max(1.0),
                "{path} {}: y[{t}, {o}] = {g}, reference {w}",
                m.format
            );
        }
    }
}

fn short(g: &mut BenchmarkGroup<'_, criterion::measurement::WallTime>) {
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(3));
}

fn pool() -> rayon::ThreadPool {
    rayon::ThreadPoolBuilder::new()
        .num_threads(THREADS)
        .build()
        .expect("thread pool")
}

/// Time `call` as the engine makes it: from a thread of the compute pool (a forward runs on
/// the pool, see `Model::step`) rather than with a round trip into the pool per call, which
/// costs ~10 µs on a 2-core VM.
fn iter_on_pool(b: &mut Bencher<'_>, pool: &rayon::ThreadPool, mut call: impl FnMut() + Send) {
    b.iter_custom(|iters| {
        pool.install(|| {
            let t = Instant::now();
            for _ in 0..iters {
                call();
            }
            t.elapsed()
        })
    });
}

/// XOR of a matrix's data and scales, read in parallel with software prefetch on the pool the
/// caller runs on ([`iter_on_pool`]).
fn read_matrix(m: &Owned) -> u64 {
    use rayon::prelude::*;
    let words = |b: &[u8]| -> u64 {
        let (head, mid, tail) = bytemuck::pod_align_to::<u8, u64>(b);
        let edge = head.iter().chain(tail).fold(0u64, |a, &v| a ^ v as u64);
        mid.par_chunks(1 << 15)
            .map(crate::probes::xor_prefetching)
            .reduce(|| edge, |a, b| a ^ b)
    };
    words(&m.data) ^ words(bytemuck::cast_slice(&m.scales))
}

fn matmul_shapes(c: &mut Criterion) {
    crate::probes::check_xor_prefetching();
    let pool = pool();
    let path = kernels::selected_path();
    eprintln!("kernels: path {path}, {THREADS} threads");
    let mut g = c.benchmark_group("kernels");
    short(&mut g);
    for format in [
        QuantFormat::Int4Grouped { group_size: 64 },
        QuantFormat::Int8PerRow,
        QuantFormat::Bf16,
    ] {
        for (i, &(name, rows, cols)) in SHAPES.iter().enumerate() {
            let first = Owned::new(format, rows, cols, i as u64);
            let n = copies(first.view().stream_bytes());
            let mats: Vec<Owned> = std::iter::once(first)
                .chain((1..n).map(|c| Owned::new(format, rows, cols, (i + 100 * c) as u64)))
                .collect();
            let views: Vec<QMatrix<'_>> = mats.iter().map(Owned::view).collect();
            g.throughput(Throughput::Bytes(views[0].stream_bytes() as u64));
            {
                // The same bytes read by a plain prefetching stream, on the same pool, in the
                // same run: the limit of this very memory (the 1 GiB reference can land on
                // faster or slower pages of this VM than these matrices).
                let mut it = 0usize;
                g.bench_function(format!("{format}/{name}_{rows}x{cols}/read"), |b| {
                    iter_on_pool(b, &pool, || {
                        it += 1;
                        black_box(read_matrix(&mats[it % mats.len()]));
                    })
                });
            }
            for s in [1, 4, 8] {
                let x = activations(s, cols);
                let mut y = vec![0.0f32; s * rows];
                kernels::matmul(&views[0], &x, s, &mut y, Some(&pool)).expect("matmul");
                check(path, &mats[0], &x, s, &y);
                let mut it = 0usize;
                g.bench_function(format!("{format}/{name}_{rows}x{cols}/S{s}"), |b| {
                    iter_on_pool(b, &pool, || {
                        it += 1;
                        let w = &views[it % views.len()];
                        kernels::matmul(w, black_box(&x), s, &mut y, Some(&pool)).expect("matmul");
                        black_box(&y);
                    })
                });
                // The same rows in the int8 decode arithmetic (activations quantised in the
                // call, as a forward does), where the CPU has a SIMD int8 kernel.
                if kernels::int8act::simd_available() && kernels::int8act::supports(format) {
                    let mut it = 0usize;
                    g.bench_function(format!("{format}/{name}_{rows}x{cols}/S{s}/int8"), |b| {
                        iter_on_pool(b, &pool, || {
                            it += 1;
                            let w = &views[it % views.len()];
                            kernels::matmul_in(
                                Arithmetic::Int8,
                                w,
                                black_box(&x),
                                s,
                                &mut y,
                                Some(&pool),
                            )
                            .expect("int8 matmul");
                            black_box(&y);
                        })
                    });
                }
            }
        }
    }
    g.finish();
}

fn paths(c: &mut Criterion) {
    let pool = pool();
    let mut g = c.benchmark_group("kernel_paths");
    short(&mut g);
    let format = QuantFormat::Int4Grouped { group_size: 64 };
    let (name, rows, cols) = SHAPES[0];
    let mats: Vec<Owned> = (0..copies(format.data_bytes(rows, cols).unwrap_or(1)))
        .map(|c| Owned::new(format, rows, cols, 100 * c as u64))
        .collect();
    let views: Vec<QMatrix<'_>> = mats.iter().map(Owned::view).collect();
    g.throughput(Throughput::Bytes(views[0].stream_bytes() as u64));
    let x = activations(1, cols);
    for path in KernelPath::available() {
        let mut y = vec![0.0f32; rows];
        kernels::matmul_with(path, &views[0], &x, 1, &mut y, Some(&pool)).expect("matmul");
        check(path, &mats[0], &x, 1, &y);
        let mut it = 0usize;
        g.bench_function(format!("{format}/{name}_{rows}x{cols}/S1/{path}"), |b| {
            iter_on_pool(b, &pool, || {
                it += 1;
                let w = &views[it % views.len()];
                kernels::matmul_with(path, w, black_box(&x), 1, &mut y, Some(&pool))
                    .expect("matmul");
                black_box(&y);
            })
        });
    }
    g.finish();
}

/// The kernels' own ceiling: one thread, a 768 KiB int4 matrix that stays in L2, so no DRAM
/// in the way. Compare with the DRAM-bound numbers above to see which limit a result hit.
fn in_cache(c: &mut Criterion) {
    let mut g = c.benchmark_group("kernel_l2");
    short(&mut g);
    let format = QuantFormat::Int4Grouped { group_size: 64 };
    let (rows, cols) = (256, 6144);
    let m = Owned::new(format, rows, cols, 5);
    let w = m.view();
    g.throughput(Throughput::Bytes(w.stream_bytes() as u64));
    for path in KernelPath::available() {
        if path == KernelPath::Scalar {
            continue;
        }
        for s in [1, 4, 8] {
            let x = activations(s, cols);
            let mut y = vec![0.0f32; s * rows];
            kernels::matmul_with(path, &w, &x, s, &mut y, None).expect("matmul");
            check(path, &m, &x, s, &y);
            g.bench_function(format!("{format}/{rows}x{cols}/S{s}/1thread/{path}"), |b| {
                b.iter(|| {
                    kernels::matmul_with(path, &w, black_box(&x), s, &mut y, None).expect("matmul");
                    black_box(&y);
                })
            });
        }
    }
    // The int8 arithmetic on the same matrix and rows (decode kernel up to its row limit).
    if kernels::int8act::simd_available() {
        for s in [1, 2, 4, 8, 9, 16] {
            let x = activations(s, cols);
            let mut y = vec![0.0f32; s * rows];
            g.bench_function(format!("{format}/{rows}x{cols}/S{s}/1thread/int8"), |b| {
                b.iter(|| {
                    kernels::matmul_in(Arithmetic::Int8, &w, black_box(&x), s, &mut y, None)
                        .expect("int8 matmul");
                    black_box(&y);
                })
            });
        }
    }
    g.finish();
}

fn expert(c: &mut Criterion) {
    let pool = pool();
    let mut g = c.benchmark_group("expert_ffn");
    short(&mut g);
    let format = QuantFormat::Int4Grouped { group_size: 64 };
    // GLM-5.2's expert, and the same bytes as the disk stand-ins' experts (hidden 256, the
    // intermediate padded to 49152: tall, narrow gate/up and a wide down; tools/make_standin.py).
    for (f, h) in [(2048, 6144), (49152, 256)] {
        let n = copies(21_233_664);
        let experts: Vec<[Owned; 3]> = (0..n as u64)
            .map(|c| {
                [
                    Owned::new(format, f, h, 11 + 100 * c),
                    Owned::new(format, f, h, 12 + 100 * c),
                    Owned::new(format, h, f, 13 + 100 * c),
                ]
            })
            .collect();
        let views: Vec<[QMatrix<'_>; 3]> = experts
            .iter()
            .map(|[g, u, d]| [g.view(), u.view(), d.view()])
            .collect();
        let total: usize = views[0].iter().map(QMatrix::stream_bytes).sum();
        assert_eq!(
            total, 21_233_664,
            "docs/container.md: a GLM-5.2 expert at gs64"
        );
        g.throughput(Throughput::Bytes(total as u64));
        for s in [1, 4, 8] {
            let x = activations(s, h);
            let mut out = vec![0.0f32; s * h];
            let mut it = 0usize;
            g.bench_function(format!("{format}/{f}x{h}/S{s}"), |b| {
                iter_on_pool(b, &pool, || {
                    it += 1;
                    let [gv, uv, dv] = &views[it % views.len()];
                    kernels::expert_ffn(gv, uv, dv, black_box(&x), s, &mut out, Some(&pool))
                        .expect("expert");
                    black_box(&out);
                })
            });
        }
    }
    g.finish();
}

/// A MoE layer's experts at decode: 9 experts (8 routed and a shared one) of the side-by-side
/// model's shape (tools/bench_llamacpp.py: gate/up 1024×2048, down 2048×1024, int4-gs64,
/// 3.5 MB each) at S = 1, run as one batch (`experts_ffn`: two fork-joins) and one by one
/// (`expert_ffn`: two each), cycling through enough layers to come from DRAM, and the same
/// bytes read plainly on the same pool.
fn moe_layer(c: &mut Criterion) {
    let pool = pool();
    let mut g = c.benchmark_group("moe_layer");
    short(&mut g);
    let format = QuantFormat::Int4Grouped { group_size: 64 };
    let (f, h, n) = (1024, 2048, 9);
    let layer_bytes = n * 3 * format.data_bytes(f, h).expect("size");
    let layers: Vec<Vec<[Owned; 3]>> = (0..copies(layer_bytes) as u64)
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
    let x = activations(1, h);
    let calls: Vec<Vec<kernels::ExpertCall<'_>>> = layers
        .iter()
        .map(|experts| {
            experts
                .iter()
                .map(|[gm, um, dm]| kernels::ExpertCall {
                    gate: gm.view(),
                    up: um.view(),
                    down: dm.view(),
                    x: &x,
                    s: 1,
                })
                .collect()
        })
        .collect();
    let bytes: usize = calls[0]
        .iter()
        .map(|c| c.gate.stream_bytes() + c.up.stream_bytes() + c.down.stream_bytes())
        .sum();
    g.throughput(Throughput::Bytes(bytes as u64));
    let mut ys = vec![vec![0.0f32; h]; n];
    let mut it = 0usize;
    g.bench_function(format!("{format}/{n}x{f}x{h}/read"), |b| {
        iter_on_pool(b, &pool, || {
            it += 1;
            let acc = layers[it % layers.len()]
                .iter()
                .flatten()
                .fold(0u64, |a, m| a ^ read_matrix(m));
            black_box(acc);
        })
    });
    g.bench_function(format!("{format}/{n}x{f}x{h}/S1/batch"), |b| {
        iter_on_pool(b, &pool, || {
            it += 1;
            let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
            kernels::experts_ffn(&calls[it % calls.len()], &mut outs, Some(&pool))
                .expect("experts");
            black_box(&ys);
        })
    });
    g.bench_function(format!("{format}/{n}x{f}x{h}/S1/one_by_one"), |b| {
        iter_on_pool(b, &pool, || {
            it += 1;
            for (c, y) in calls[it % calls.len()].iter().zip(ys.iter_mut()) {
                kernels::expert_ffn(&c.gate, &c.up, &c.down, c.x, 1, y, Some(&pool))
                    .expect("expert");
            }
            black_box(&ys);
        })
    });
    g.finish();
}

/// Prefill-sized calls (S = 64 and 512 activation rows, which the kernels run in blocks of 8):
/// compute-bound, so the throughput is in flops (criterion's "elem/s" = flop/s here); compare
/// with `compute/fma_peak` of the same run.
fn prefill(c: &mut Criterion) {
    let pool = pool();
    let mut g = c.benchmark_group("kernel_prefill");
    short(&mut g);
    let format = QuantFormat::Int4Grouped { group_size: 64 };
    let (name, rows, cols) = SHAPES[0];
    let m = Owned::new(format, rows, cols, 7);
    let w = m.view();
    for s in [64, 512] {
        let x = activations(s, cols);
        let mut y = vec![0.0f32; s * rows];
        kernels::matmul(&w, &x, s, &mut y, Some(&pool)).expect("matmul");
        check(kernels::selected_path(), &m, &x, s, &y);
        g.throughput(Throughput::Elements((2 * s * rows * cols) as u64));
        g.bench_function(format!("{format}/{name}_{rows}x{cols}/S{s}"), |b| {
            iter_on_pool(b, &pool, || {
                kernels::matmul(&w, black_box(&x), s, &mut y, Some(&pool)).expect("matmul");
                black_box(&y);
            })
        });
        // The same call with int8 activations (the `prefill` option's fast arithmetic; the
        // VNNI or AVX2 kernel where the CPU has one, else the scalar reference, so skipped there).
        if kernels::int8act::simd_available() {
            g.bench_function(format!("{format}/{name}_{rows}x{cols}/S{s}/int8"), |b| {
                iter_on_pool(b, &pool, || {
                    kernels::matmul_in(Arithmetic::Int8, &w, black_box(&x), s, &mut y, Some(&pool))
                        .expect("int8 matmul");
                    black_box(&y);
                })
            });
        }
    }
    g.finish();
}

criterion_group!(
    benches,
    paths,
    matmul_shapes,
    expert,
    moe_layer,
    in_cache,
    prefill
);
