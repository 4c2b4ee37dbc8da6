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
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use colibri::container::Container;
use colibri::experts::synth::{self, SynthSpec};
use colibri::experts::{
    ContainerSource, ExpertLocator, ExpertStore, IoMode, PinPolicy, PrefetchMode, StoreOptions,
};
use criterion::measurement::WallTime;
use criterion::{criterion_group, BenchmarkGroup, Criterion, SamplingMode, Throughput};

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

/// The I/O modes and thread counts measured, in table and bench order.
const MODES: [(IoMode, usize); 5] = [
    (IoMode::Pread, 1),
    (IoMode::Pread, 4),
    (IoMode::Direct, 1),
    (IoMode::Direct, 4),
    (IoMode::Mmap, 4),
];

/// The container under test and what every measurement of it needs.
struct Setup {
    src: Arc<ContainerSource>,
    /// The container's shard files.
    files: Vec<PathBuf>,
    /// (layer, experts) of every layer with experts.
    layers: Vec<(usize, usize)>,
    /// Experts loaded per iteration.
    per_iter: usize,
    /// Bytes of `per_iter` experts: what each iteration reads, on either side.
    bytes: u64,
}

impl Setup {
    fn new(dir: &Path) -> Setup {
        let cont = Arc::new(Container::open(dir).expect("open container"));
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
        Setup {
            src,
            files,
            layers,
            per_iter,
            bytes,
        }
    }

    /// A store over the container that caches nothing (RAM budget 0, no pinning, no prefetch).
    fn open(&self, io: IoMode, threads: usize) -> ExpertStore {
        let opts = StoreOptions {
            io,
            ram_budget_bytes: Some(0),
            io_threads: threads,
            pin: PinPolicy::Off,
            prefetch: PrefetchMode::Off,
            usage_file: false,
            ..Default::default()
        };
        ExpertStore::open_source(self.src.clone(), opts).expect("open store")
    }

    /// Drop every shard from the page cache.
    fn drop_all(&self) {
        for p in &self.files {
            if let Ok(f) = std::fs::File::open(p) {
                use std::os::fd::AsRawFd;
                // SAFETY: advisory syscall on a descriptor we own.
                unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
            }
        }
    }
}

/// Check the answer before timing: every mode hands out the same bytes.
fn check_modes_agree(s: &Setup) {
    let digest = |store: &ExpertStore| {
        let mut d = Vec::new();
        store
            .with_experts(s.layers[0].0, &[0, 1], &mut |id, v| {
                d.push((id, v.gate.data().to_vec(), v.down.scales().to_vec()));
                Ok(())
            })
            .expect("load");
        d.sort_by_key(|x| x.0);
        d
    };
    let want = digest(&s.open(IoMode::Pread, 1));
    for io in [IoMode::Mmap, IoMode::Direct] {
        assert!(digest(&s.open(io, 2)) == want, "{io:?} differs from pread");
    }
}

/// Load the experts of `calls`, touching one byte of each.
fn load_calls(store: &ExpertStore, calls: &[(usize, Vec<usize>)]) {
    for (l, ids) in calls {
        store
            .with_experts(*l, ids, &mut |_, v| {
                black_box(v.down.data()[0]);
                Ok(())
            })
            .expect("load");
    }
}

/// `raw_sequential`: `bytes` read cold in 8 MiB reads, the bandwidth ceiling.
fn bench_raw_sequential(g: &mut BenchmarkGroup<'_, WallTime>, s: &Setup) {
    let files = &s.files;
    let mut start_file = 0usize;
    g.bench_function("raw_sequential", |b| {
        let mut buf = vec![0u8; 8 << 20];
        b.iter_custom(|iters| {
            let mut t_all = Duration::ZERO;
            for _ in 0..iters {
                s.drop_all();
                // A different file each iteration, so no cache below the VM favours it.
                start_file += 1;
                let t = Instant::now();
                let mut left = s.bytes as usize;
                for i in 0..files.len() {
                    let p = &files[(start_file + i) % files.len()];
                    let mut f = std::fs::File::open(p).expect("open");
                    left = read_up_to(&mut f, &mut buf, left);
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
}

/// Read up to `left` bytes of `f` through `buf` (until its end); returns how many were left.
fn read_up_to(f: &mut std::fs::File, buf: &mut [u8], mut left: usize) -> usize {
    while left > 0 {
        let want = buf.len().min(left);
        let n = f.read(&mut buf[..want]).expect("read");
        if n == 0 {
            break;
        }
        left -= n;
    }
    left
}

/// Bytes per second of reading up to `s.bytes` of shard `i` (modulo the shards) from the start.
fn read_file_rate(s: &Setup, i: usize) -> f64 {
    let mut buf = vec![0u8; 8 << 20];
    let p = &s.files[i % s.files.len()];
    let mut f = std::fs::File::open(p).expect("open");
    let t = Instant::now();
    let left = read_up_to(&mut f, &mut buf, s.bytes as usize);
    (s.bytes as usize - left) as f64 / t.elapsed().as_secs_f64()
}

/// Interleaved table: raw and random iterations alternate, each on bytes the previous
/// iterations did not read, so slow drifts in machine load and caches below the VM hit both
/// sides alike.
fn print_interleaved_table(s: &Setup) {
    let (rounds, per_iter, bytes) = (9, s.per_iter, s.bytes);
    eprintln!("\nexperts_cold interleaved ({rounds} rounds, {per_iter} experts = {bytes} bytes per side, GiB/s):");
    eprintln!("| mode | random experts | raw sequential | ratio |");
    eprintln!("|---|---|---|---|");
    let mut k = 7usize;
    for (io, threads) in MODES {
        let store = s.open(io, threads);
        let (mut r_s, mut m_s) = (Vec::new(), Vec::new());
        for _ in 0..rounds {
            k += 1;
            s.drop_all();
            r_s.push(read_file_rate(s, k));
            let calls = pick(&s.layers, &mut Rng(k as u64 * 0x2545_f491), per_iter);
            store.drop_page_cache();
            let t = Instant::now();
            load_calls(&store, &calls);
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

/// One bench per mode: `per_iter` random experts loaded cold, nothing cached.
fn bench_modes(g: &mut BenchmarkGroup<'_, WallTime>, s: &Setup) {
    let mut seed = 0x5eed_u64;
    for (io, threads) in MODES {
        let store = s.open(io, threads);
        g.bench_function(format!("{}_{threads}threads", io.name()), |b| {
            b.iter_custom(|iters| {
                let mut t_all = Duration::ZERO;
                for _ in 0..iters {
                    seed += 1;
                    let calls = pick(&s.layers, &mut Rng(seed * 0x9e37_79b9), s.per_iter);
                    store.drop_page_cache();
                    let t = Instant::now();
                    load_calls(&store, &calls);
                    t_all += t.elapsed();
                }
                t_all
            })
        });
        let st = store.stats();
        assert_eq!(st.total.hits(), 0, "cold: nothing may be cached");
    }
}

fn cold_loads(c: &mut Criterion) {
    let (dir, _tmp) = container();
    let s = Setup::new(&dir);
    check_modes_agree(&s);

    let mut g = c.benchmark_group("experts_cold");
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(1));
    g.measurement_time(Duration::from_secs(10));
    g.throughput(Throughput::Bytes(s.bytes));

    bench_raw_sequential(&mut g, &s);
    // The interleaved table only for an explicit container.
    if std::env::var_os("COLIBRI_SYNTH_DIR").is_some() {
        print_interleaved_table(&s);
    }
    bench_modes(&mut g, &s);
    g.finish();
}

criterion_group!(benches, cold_loads);
