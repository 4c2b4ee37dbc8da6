//! Dequant-matmul kernels at GLM-5.2 shapes, with 2 threads, reported as GB/s of weight bytes
//! (data + scales): compare with the `bandwidth` group of the same run.
//!
//! - `kernels/<format>/<name OxI>/S<s>`: the dispatched path, S = 1, 4, 8.
//! - `kernel_paths/int4_g64/expert_gate_OxI/S1/<path>`: every available path, A/B.
//! - `expert_ffn/int4_g64/S<s>`: the fused expert (gate, up, down), bytes of all three.

use std::hint::black_box;
use std::time::Duration;

use colibri::quant::kernels::{self, KernelPath};
use colibri::quant::{QMatrix, QuantFormat};
use criterion::{criterion_group, BenchmarkGroup, Criterion, Throughput};

/// (name, O, I) from DESIGN §2: expert gate/up and down, MLA kv_a, o_proj.
const SHAPES: [(&str, usize, usize); 4] = [
    ("expert_gate", 2048, 6144),
    ("expert_down", 6144, 2048),
    ("kv_a", 576, 6144),
    ("o_proj", 6144, 16384),
];

const THREADS: usize = 2;

/// Deterministic pseudo-random bytes.
fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

/// A random matrix in `format`: random nibbles/bytes with scales in [0.005, 0.01), or random
/// bf16 values in (-1, 1).
struct Owned {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    data: Vec<u8>,
    scales: Vec<f32>,
}

impl Owned {
    fn new(format: QuantFormat, rows: usize, cols: usize, seed: u64) -> Self {
        let n = format.data_bytes(rows, cols).expect("size");
        let mut data = bytes(seed, n);
        if format == QuantFormat::Bf16 {
            for pair in data.chunks_exact_mut(2) {
                // sign, exponent 119..126 (|v| < 1), random mantissa.
                let e = 119 + (pair[1] & 7) as u16;
                let v = ((pair[1] as u16 & 0x80) << 8) | (e << 7) | (pair[0] as u16 & 0x7F);
                pair.copy_from_slice(&v.to_le_bytes());
            }
        }
        let scales = bytes(seed + 1, format.scale_count(rows, cols).expect("size"))
            .into_iter()
            .map(|b| 0.005 + b as f32 / 51200.0)
            .collect();
        Owned {
            format,
            rows,
            cols,
            data,
            scales,
        }
    }

    fn view(&self) -> QMatrix<'_> {
        QMatrix::new(self.format, self.rows, self.cols, &self.data, &self.scales).expect("view")
    }

    /// The first `r` rows as a matrix of their own.
    fn head(&self, r: usize) -> QMatrix<'_> {
        let rb = self.format.row_bytes(self.cols);
        let sr = self.format.scales_per_row(self.cols);
        QMatrix::new(
            self.format,
            r,
            self.cols,
            &self.data[..r * rb],
            &self.scales[..r * sr],
        )
        .expect("head")
    }
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

fn matmul_shapes(c: &mut Criterion) {
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
            let m = Owned::new(format, rows, cols, i as u64);
            let w = m.view();
            g.throughput(Throughput::Bytes(w.stream_bytes() as u64));
            for s in [1, 4, 8] {
                let x = activations(s, cols);
                let mut y = vec![0.0f32; s * rows];
                kernels::matmul(&w, &x, s, &mut y, Some(&pool)).expect("matmul");
                check(path, &m, &x, s, &y);
                g.bench_function(format!("{format}/{name}_{rows}x{cols}/S{s}"), |b| {
                    b.iter(|| {
                        kernels::matmul(&w, black_box(&x), s, &mut y, Some(&pool))
                            .expect("matmul");
                        black_box(&y);
                    })
                });
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
    let m = Owned::new(format, rows, cols, 0);
    let w = m.view();
    g.throughput(Throughput::Bytes(w.stream_bytes() as u64));
    let x = activations(1, cols);
    for path in KernelPath::available() {
        let mut y = vec![0.0f32; rows];
        kernels::matmul_with(path, &w, &x, 1, &mut y, Some(&pool)).expect("matmul");
        check(path, &m, &x, 1, &y);
        g.bench_function(format!("{format}/{name}_{rows}x{cols}/S1/{path}"), |b| {
            b.iter(|| {
                kernels::matmul_with(path, &w, black_box(&x), 1, &mut y, Some(&pool))
                    .expect("matmul");
                black_box(&y);
            })
        });
    }
    g.finish();
}

fn expert(c: &mut Criterion) {
    let pool = pool();
    let mut g = c.benchmark_group("expert_ffn");
    short(&mut g);
    let format = QuantFormat::Int4Grouped { group_size: 64 };
    let (f, h) = (2048, 6144);
    let (gate, up, down) = (
        Owned::new(format, f, h, 11),
        Owned::new(format, f, h, 12),
        Owned::new(format, h, f, 13),
    );
    let (gv, uv, dv) = (gate.view(), up.view(), down.view());
    let total = gv.stream_bytes() + uv.stream_bytes() + dv.stream_bytes();
    assert_eq!(total, 21_233_664, "DESIGN §3: a GLM-5.2 expert at gs64");
    g.throughput(Throughput::Bytes(total as u64));
    for s in [1, 4, 8] {
        let x = activations(s, h);
        let mut out = vec![0.0f32; s * h];
        g.bench_function(format!("{format}/{f}x{h}/S{s}"), |b| {
            b.iter(|| {
                kernels::expert_ffn(&gv, &uv, &dv, black_box(&x), s, &mut out, Some(&pool))
                    .expect("expert");
                black_box(&out);
            })
        });
    }
    g.finish();
}

criterion_group!(benches, paths, matmul_shapes, expert);
