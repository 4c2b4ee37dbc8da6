//! The machine's own limit: multi-threaded streaming read of a ≥ 1 GiB buffer. Kernel and
//! I/O benches report their GB/s as a fraction of this.

use std::hint::black_box;

use criterion::{criterion_group, Criterion, Throughput};
use rayon::prelude::*;

const BYTES: usize = 1 << 30;

fn streaming_read(c: &mut Criterion) {
    let buf: Vec<u64> = (0..BYTES / 8).map(|i| i as u64).collect();
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .expect("thread pool");
    let expected: u64 = buf.iter().fold(0u64, |a, &v| a ^ v);
    let mut g = c.benchmark_group("bandwidth");
    g.throughput(Throughput::Bytes(BYTES as u64));
    g.sample_size(10);
    g.bench_function(format!("read_1GiB_{threads}threads"), |b| {
        b.iter(|| {
            let x = pool.install(|| {
                buf.par_chunks(1 << 16)
                    .map(|c| c.iter().fold(0u64, |a, &v| a ^ v))
                    .reduce(|| 0, |a, b| a ^ b)
            });
            assert_eq!(x, expected);
            black_box(x)
        })
    });
    g.finish();
}

criterion_group!(benches, streaming_read);
