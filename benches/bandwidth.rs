//! The machine's own limits: multi-threaded streaming read of a ≥ 1 GiB buffer, with hardware
//! prefetch only and with software prefetch (kernel and I/O benches report their GB/s as a
//! fraction of the higher), and the f32 FMA ceiling of the
//! selected kernel path on 2 threads (`compute/fma_peak_2threads`, in GFLOP/s: kernel calls
//! with S > 1 do 2·S flops per weight, so their cost is judged against it).

use std::hint::black_box;

use colibri::quant::kernels::int8act::Int8Kernel;
use criterion::{criterion_group, Criterion, Throughput};
use rayon::prelude::*;

const BYTES: usize = 1 << 30;

/// A way to read a chunk of the buffer (returns the XOR of its words).
type Read = fn(&[u64]) -> u64;

fn streaming_read(c: &mut Criterion) {
    let buf: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let expected: u64 = buf.iter().fold(0u64, |a, &v| a ^ v);
    crate::probes::check_xor_prefetching();
    let mut g = c.benchmark_group("bandwidth");
    g.throughput(Throughput::Bytes(BYTES as u64));
    g.sample_size(10);
    // The second read prefetches 8 KiB ahead in software, as the kernels do: on the development
    // VM the hardware-prefetch-only read sometimes stays near 40 GiB/s while the prefetching
    // int8 kernel streams 55-64 GiB/s, so it alone would understate the machine's limit.
    // Report against the higher of the two.
    let reads: [(&str, Read); 2] = [
        ("read", |c| c.iter().fold(0u64, |a, &v| a ^ v)),
        ("read_prefetch", crate::probes::xor_prefetching),
    ];
    for (name, read) in reads {
        g.bench_function(format!("{name}_1GiB_{threads}threads"), |b| {
            b.iter(|| {
                let x =
                    pool.install(|| buf.par_chunks(1 << 16).map(read).reduce(|| 0, |a, b| a ^ b));
                assert_eq!(x, expected);
                black_box(x)
            })
        });
    }
    g.finish();
}

fn fma_peak(c: &mut Criterion) {
    let path = colibri::quant::kernels::selected_path();
    const ITERS: usize = 1 << 20;
    let Some((flops, _)) = crate::probes::fma_peak(path, 1, 1.0) else {
        eprintln!("compute: no FMA probe for path {path}");
        return;
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("thread pool");
    let mut g = c.benchmark_group("compute");
    // Elements = flops: criterion's "elem/s" reads as flop/s.
    g.throughput(Throughput::Elements((2 * flops * ITERS) as u64));
    g.sample_size(10);
    g.bench_function(format!("fma_peak_2threads/{path}"), |b| {
        b.iter(|| {
            let (x, y) = pool.install(|| {
                rayon::join(
                    || crate::probes::fma_peak(path, ITERS, black_box(1.0)),
                    || crate::probes::fma_peak(path, ITERS, black_box(2.0)),
                )
            });
            black_box((x, y))
        })
    });
    g.finish();
}

/// The int8 ceiling of the prefill's int8 kernel on this CPU (VNNI or AVX2), 2 threads
/// (`compute/int8_peak_2threads/<kernel>`, "elem/s" = integer ops/s, a multiply-add counted
/// as two).
fn int8_peak(c: &mut Criterion) {
    const ITERS: usize = 1 << 20;
    let kernel = Int8Kernel::best();
    let Some((ops, _)) = crate::probes::int8_peak(kernel, 1, 1) else {
        eprintln!("compute: no SIMD int8 kernel on this CPU, no int8 probe");
        return;
    };
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .expect("thread pool");
    let mut g = c.benchmark_group("compute");
    g.throughput(Throughput::Elements((2 * ops * ITERS) as u64));
    g.sample_size(10);
    g.bench_function(format!("int8_peak_2threads/{}", kernel.name()), |b| {
        b.iter(|| {
            let (x, y) = pool.install(|| {
                rayon::join(
                    || crate::probes::int8_peak(kernel, ITERS, black_box(1)),
                    || crate::probes::int8_peak(kernel, ITERS, black_box(2)),
                )
            });
            black_box((x, y))
        })
    });
    g.finish();
}

criterion_group!(benches, streaming_read, fma_peak, int8_peak);
