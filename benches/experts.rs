//! Cold expert loads: throughput of loading random experts with the page cache dropped
//! (`posix_fadvise(DONTNEED)` on every shard before each iteration, RAM budget 0 so nothing
//! stays cached), per I/O mode and I/O thread count, against the raw sequential read bandwidth
//! of the same files measured in the same run (`raw_sequential`, one stream of 8 MiB reads).
//! Throughput is expert bytes per second; read each mode as a fraction of `raw_sequential`.
//!
//! Cold-cache iterations are long and must not repeat warm, so each sample is timed by hand
//! (`iter_custom`, flat sampling, one iteration per sample in practice).
//!
//! Container: `$COLIBRI_SYNTH_DIR` when set (a GLM-5.2-shaped container, e.g.
//! `cargo run --release --example make_synthetic -- --out /work/synth/glm52 --experts-only`),
//! else a temporary one of 1 MoE layer × 24 GLM-5.2 experts (≈ 510 MB).

use std::hint::black_box;
use std::io::Read;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use colibri::container::Container;
use colibri::experts::synth::{self, SynthSpec};
use colibri::experts::{
    ContainerSource, ExpertLocator, ExpertStore, IoMode, PinPolicy, PrefetchMode, StoreOptions,
};
use criterion::{criterion_group, Criterion, SamplingMode, Throughput};

/// Experts loaded per iteration (8 per call, like one token's layer).
const PER_ITER: usize = 64;

fn container() -> (PathBuf, Option<tempfile::TempDir>) {
    if let Some(d) = std::env::var_os("COLIBRI_SYNTH_DIR") {
        return (PathBuf::from(d), None);
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::write(tmp.path(), &SynthSpec::glm52(1, 24)).expect("synthetic container");
    (tmp.path().to_path_buf(), Some(tmp))
}

struct Rng(u64);
impl Rng {
    fn next(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n as u64) as usize
    }
}

/// `PER_ITER` random distinct (layer, expert) pairs, grouped 8 per call.
fn pick(layers: &[(usize, usize)], rng: &mut Rng, count: usize) -> Vec<(usize, Vec<usize>)> {
    let mut calls = Vec::new();
    let mut left = count;
    while left > 0 {
        let (l, n) = layers[rng.next(layers.len())];
        let mut ids: Vec<usize> = Vec::new();
        while ids.len() < 8.min(left).min(n) {
            let e = rng.next(n);
            if !ids.contains(&e) {
                ids.push(e);
            }
        }
        left -= ids.len();
        calls.push((l, ids));
    }
    calls
}

fn cold_loads(c: &mut Criterion) {
    let (dir, _tmp) = container();
    let cont = Arc::new(Container::open(&dir).expect("open container"));
    let src = Arc::new(ContainerSource::new(cont).expect("expert source"));
    let files: Vec<PathBuf> = src.files().to_vec();
    let layers: Vec<(usize, usize)> = (0..src.num_layers())
        .map(|l| (l, src.num_experts(l)))
        .filter(|x| x.1 > 0)
        .collect();
    let total: usize = layers.iter().map(|x| x.1).sum();
    let per_iter = PER_ITER.min(total);
    let expert_bytes = src.locate(layers[0].0, 0).expect("loc").bytes();
    let bytes = per_iter as u64 * expert_bytes;

    let open = |io: IoMode, threads: usize| {
        let opts = StoreOptions {
            io,
            ram_budget_bytes: Some(0),
            io_threads: threads,
            pin: PinPolicy::Off,
            prefetch: PrefetchMode::Off,
            usage_file: false,
            ..Default::default()
        };
        ExpertStore::open_source(src.clone(), opts).expect("open store")
    };
    // Check the answer before timing: every mode hands out the same bytes.
    let digest = |s: &ExpertStore| {
        let mut d = Vec::new();
        s.with_experts(layers[0].0, &[0, 1], &mut |id, v| {
            d.push((id, v.gate.data().to_vec(), v.down.scales().to_vec()));
            Ok(())
        })
        .expect("load");
        d.sort_by_key(|x| x.0);
        d
    };
    let want = digest(&open(IoMode::Pread, 1));
    for io in [IoMode::Mmap, IoMode::Direct] {
        assert!(digest(&open(io, 2)) == want, "{io:?} differs from pread");
    }

    let mut g = c.benchmark_group("experts_cold");
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(1));
    g.measurement_time(Duration::from_secs(10));
    g.throughput(Throughput::Bytes(bytes));

    let drop_all = || {
        for p in &files {
            if let Ok(f) = std::fs::File::open(p) {
                use std::os::fd::AsRawFd;
                // SAFETY: advisory syscall on a descriptor we own.
                unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            }
        }
    };
    let mut start_file = 0usize;
    g.bench_function("raw_sequential", |b| {
        let mut buf = vec![0u8; 8 << 20];
        b.iter_custom(|iters| {
            let mut t_all = Duration::ZERO;
            for _ in 0..iters {
                drop_all();
                // A different file each iteration, so no cache below the VM favours it.
                start_file += 1;
                let t = Instant::now();
                let mut left = bytes as usize;
                for i in 0..files.len() {
                    let p = &files[(start_file + i) % files.len()];
                    let mut f = std::fs::File::open(p).expect("open");
                    while left > 0 {
                        let want = buf.len().min(left);
                        let n = f.read(&mut buf[..want]).expect("read");
                        if n == 0 {
                            break;
                        }
                        left -= n;
                    }
                    if left == 0 {
                        break;
                    }
                }
                black_box(&buf);
                t_all += t.elapsed();
            }
            t_all
        })
    });

    // Interleaved table (only for an explicit container): raw and random iterations
    // alternate, each on bytes the previous iterations did not read, so slow drifts in machine
    // load and caches below the VM hit both sides alike.
    if std::env::var_os("COLIBRI_SYNTH_DIR").is_some() {
        let rounds = 9;
        let read_file = |i: usize| {
            let mut buf = vec![0u8; 8 << 20];
            let p = &files[i % files.len()];
            let mut f = std::fs::File::open(p).expect("open");
            let mut left = bytes as usize;
            let t = Instant::now();
            while left > 0 {
                let want = buf.len().min(left);
                let n = f.read(&mut buf[..want]).expect("read");
                if n == 0 {
                    break;
                }
                left -= n;
            }
            (bytes as usize - left) as f64 / t.elapsed().as_secs_f64()
        };
        eprintln!("\nexperts_cold interleaved ({rounds} rounds, {per_iter} experts = {bytes} bytes per side, GiB/s):");
        eprintln!("| mode | random experts | raw sequential | ratio |");
        eprintln!("|---|---|---|---|");
        let mut k = 7usize;
        for (io, threads) in [
            (IoMode::Pread, 1),
            (IoMode::Pread, 4),
            (IoMode::Direct, 1),
            (IoMode::Direct, 4),
            (IoMode::Mmap, 4),
        ] {
            let store = open(io, threads);
            let (mut r_s, mut m_s) = (Vec::new(), Vec::new());
            for _ in 0..rounds {
                k += 1;
                drop_all();
                r_s.push(read_file(k));
                let calls = pick(&layers, &mut Rng(k as u64 * 0x2545_f491), per_iter);
                store.drop_page_cache();
                let t = Instant::now();
                for (l, ids) in &calls {
                    store
                        .with_experts(*l, ids, &mut |_, v| {
                            black_box(v.down.data()[0]);
                            Ok(())
                        })
                        .expect("load");
                }
                m_s.push(bytes as f64 / t.elapsed().as_secs_f64());
            }
            let med = |v: &mut Vec<f64>| {
                v.sort_by(|a, b| a.total_cmp(b));
                v[v.len() / 2] / (1u64 << 30) as f64
            };
            let (m, r) = (med(&mut m_s), med(&mut r_s));
            eprintln!(
                "| {}, {threads} thread(s) | {m:.2} | {r:.2} | {:.0}% |",
                io.name(),
                100.0 * m / r
            );
        }
    }

    let mut seed = 0x5eed_u64;
    for (io, threads) in [
        (IoMode::Pread, 1),
        (IoMode::Pread, 4),
        (IoMode::Direct, 1),
        (IoMode::Direct, 4),
        (IoMode::Mmap, 4),
    ] {
        let store = open(io, threads);
        g.bench_function(format!("{}_{threads}threads", io.name()), |b| {
            b.iter_custom(|iters| {
                let mut t_all = Duration::ZERO;
                for _ in 0..iters {
                    seed += 1;
                    let calls = pick(&layers, &mut Rng(seed * 0x9e37_79b9), per_iter);
                    store.drop_page_cache();
                    let t = Instant::now();
                    for (l, ids) in &calls {
                        store
                            .with_experts(*l, ids, &mut |_, v| {
                                black_box(v.down.data()[0]);
                                Ok(())
                            })
                            .expect("load");
                    }
                    t_all += t.elapsed();
                }
                t_all
            })
        });
        let s = store.stats();
        assert_eq!(s.total.hits(), 0, "cold: nothing may be cached");
    }
    g.finish();
}

criterion_group!(benches, cold_loads);
