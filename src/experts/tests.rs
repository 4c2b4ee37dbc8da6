//! Store tests on small synthetic containers: byte-identical views across every mode, cache
//! size, pin set, worker count and prefetch mode; faults; budget accounting; prefetch
//! bookkeeping; the routing-history file; the container adapter.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::source::{fnv1a, FNV_OFFSET};
use super::synth::{self, SynthSpec};
use super::*;
use crate::quant::QuantFormat;

const G64: QuantFormat = QuantFormat::Int4Grouped { group_size: 64 };

fn make(spec: &SynthSpec) -> (tempfile::TempDir, Arc<StaticSource>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = synth::write(dir.path(), spec).expect("synth");
    (dir, Arc::new(src))
}

fn opts(io: IoMode, budget: u64) -> StoreOptions {
    StoreOptions {
        io,
        ram_budget_bytes: Some(budget),
        io_threads: 2,
        pin: PinPolicy::Off,
        prefetch: PrefetchMode::Off,
        prefetch_threads: 1,
        usage_file: false,
        ..Default::default()
    }
}

fn digest_mats(mats: [&crate::quant::QMatrix<'_>; 3]) -> u64 {
    let mut h = FNV_OFFSET;
    for m in mats {
        h = fnv1a(m.data(), h);
        h = fnv1a(bytemuck::cast_slice(m.scales()), h);
        h = fnv1a(&[m.rows() as u8, m.cols() as u8], h);
    }
    h
}

fn digest(v: &ExpertView<'_>) -> u64 {
    digest_mats([&v.gate, &v.up, &v.down])
}

/// The digest of an expert computed straight from the file bytes.
fn reference(src: &StaticSource, layer: usize, e: usize) -> u64 {
    let loc = src.locate(layer, e).expect("loc");
    let files: Vec<Vec<u8>> = src
        .files
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect();
    let get = |r: ByteRange| &files[r.file][r.offset as usize..r.end() as usize];
    let scales: Vec<Vec<f32>> = loc
        .mats()
        .iter()
        .map(|m| {
            get(m.scales.expect("scales"))
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .collect();
    let q: Vec<crate::quant::QMatrix<'_>> = loc
        .mats()
        .iter()
        .zip(&scales)
        .map(|(m, s)| {
            crate::quant::QMatrix::new(m.format, m.rows, m.cols, get(m.data), s).expect("q")
        })
        .collect();
    digest_mats([&q[0], &q[1], &q[2]])
}

/// A deterministic routing trace: (layer, ids, predicted ids for that layer).
fn trace(spec: &SynthSpec, calls: usize) -> Vec<(usize, Vec<usize>, Vec<usize>)> {
    let layers = spec.moe_layers();
    let n = spec.n_routed_experts;
    let mut x = 12345u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..calls)
        .map(|i| {
            let l = layers[i % layers.len()];
            // Skewed: low ids are hot.
            let ids: Vec<usize> = (0..3)
                .map(|_| (rnd() % n as u64).min(rnd() % n as u64) as usize)
                .collect();
            let mut pred = ids[..2].to_vec();
            pred.push((rnd() % n as u64) as usize);
            (l, ids, pred)
        })
        .collect()
}

type Seen = Vec<(usize, Vec<(usize, u64)>)>;

fn run(store: &ExpertStore, tr: &[(usize, Vec<usize>, Vec<usize>)], predict: bool) -> Seen {
    let mut out = Vec::new();
    for (l, ids, pred) in tr {
        if predict {
            store.prefetch(*l, pred);
            store.hint_previous(*l);
        }
        let mut got = Vec::new();
        store
            .with_experts(*l, ids, &mut |id, v| {
                got.push((id, digest(v)));
                Ok(())
            })
            .expect("with_experts");
        got.sort_unstable();
        let mut want: Vec<usize> = ids.clone();
        want.sort_unstable();
        want.dedup();
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            want,
            "each id once"
        );
        out.push((*l, got));
    }
    out
}

#[test]
fn views_match_file_bytes_in_every_configuration() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let refs: BTreeMap<(usize, usize), u64> = spec
        .moe_layers()
        .into_iter()
        .flat_map(|l| (0..spec.n_routed_experts).map(move |e| (l, e)))
        .map(|(l, e)| ((l, e), reference(&src, l, e)))
        .collect();
    let tr = trace(&spec, 60);
    let expected: Seen = tr
        .iter()
        .map(|(l, ids, _)| {
            let mut ids = ids.clone();
            ids.sort_unstable();
            ids.dedup();
            (*l, ids.iter().map(|&e| (e, refs[&(*l, e)])).collect())
        })
        .collect();
    let one = src.locate(1, 0).expect("loc").bytes();
    let pins = PinPolicy::Explicit(vec![(1, 0), (2, 1), (3, 0)]);
    let mut configs = 0;
    for io in [IoMode::Mmap, IoMode::Pread, IoMode::Direct] {
        for budget in [0, 2 * one, 4 * one, 10 * one, 1 << 30] {
            for (pin, threads, prefetch) in [
                (PinPolicy::Off, 1, PrefetchMode::Off),
                (pins.clone(), 3, PrefetchMode::Real),
                (PinPolicy::Off, 2, PrefetchMode::Hint),
                (PinPolicy::Off, 4, PrefetchMode::Real),
            ] {
                if matches!(pin, PinPolicy::Explicit(_)) && budget < 10 * one {
                    continue; // the pins alone need 3 experts (6 with O_DIRECT slack)
                }
                let o = StoreOptions {
                    pin: pin.clone(),
                    io_threads: threads,
                    prefetch,
                    guard_tokens: 0,
                    ..opts(io, budget)
                };
                let store = ExpertStore::open_source(src.clone(), o).expect("open");
                let seen = run(&store, &tr, prefetch != PrefetchMode::Off);
                assert_eq!(
                    seen, expected,
                    "{io:?} budget {budget} {pin:?} {threads} {prefetch:?}"
                );
                let s = store.stats();
                assert!(s.lru_bytes + s.pinned_bytes <= budget, "{s:?}");
                configs += 1;
            }
        }
    }
    assert!(configs > 40);
}

#[test]
fn misaligned_scales_are_copied_and_still_exact() {
    let spec = SynthSpec {
        misalign: true,
        ..SynthSpec::tiny(QuantFormat::Int4PerRow)
    };
    let (_d, src) = make(&spec);
    for io in [IoMode::Mmap, IoMode::Pread, IoMode::Direct] {
        let store = ExpertStore::open_source(src.clone(), opts(io, 1 << 20)).expect("open");
        store
            .with_experts(2, &[0, 3, 7], &mut |id, v| {
                assert_eq!(digest(v), reference(&src, 2, id));
                Ok(())
            })
            .expect("call");
        assert!(
            store.stats().live_owned_bytes > 0,
            "scales were copied ({io:?})"
        );
    }
}

/// Resident experts come as one batch, each load as its own after them; every id once.
#[test]
fn resident_experts_come_as_one_batch() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let store = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 1 << 30)).expect("open");
    store
        .with_experts(2, &[1, 4], &mut |_, _| Ok(()))
        .expect("warm");
    let mut batches: Vec<Vec<usize>> = Vec::new();
    store
        .with_expert_batches(2, &[6, 4, 1, 3, 4], &mut |batch| {
            for (id, v) in batch {
                assert_eq!(digest(v), reference(&src, 2, *id));
            }
            batches.push(batch.iter().map(|(id, _)| *id).collect());
            Ok(())
        })
        .expect("call");
    assert_eq!(batches[0], vec![1, 4], "the resident ones first, together");
    let mut loaded: Vec<usize> = batches[1..].iter().flatten().copied().collect();
    loaded.sort_unstable();
    assert_eq!(loaded, vec![3, 6]);
    assert!(batches[1..].iter().all(|b| b.len() == 1), "{batches:?}");
}

#[test]
fn views_feed_the_kernels() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let store = ExpertStore::open_source(src.clone(), opts(IoMode::Mmap, 0)).expect("open");
    let x: Vec<f32> = (0..2 * spec.hidden)
        .map(|i| (i as f32 * 0.37).sin())
        .collect();
    let mut outs = Vec::new();
    for io in [IoMode::Mmap, IoMode::Direct] {
        let store2 = ExpertStore::open_source(src.clone(), opts(io, 1 << 20)).expect("open");
        let mut y = vec![0f32; 2 * spec.moe_intermediate];
        store2
            .with_experts(1, &[5], &mut |_, v| {
                crate::quant::kernels::matmul(&v.up, &x, 2, &mut y, None)
            })
            .expect("call");
        assert!(y.iter().all(|v| v.is_finite()) && y.iter().any(|&v| v != 0.0));
        outs.push(y);
    }
    assert_eq!(outs[0], outs[1]);
    drop(store);
}

#[test]
fn container_adapter_finds_the_same_experts() {
    let spec = SynthSpec::tiny(G64);
    let (d, src) = make(&spec);
    let c = Arc::new(crate::container::Container::open(d.path()).expect("container"));
    let cs = ContainerSource::new(c.clone()).expect("source");
    assert_eq!(cs.num_layers(), src.num_layers());
    for l in 0..cs.num_layers() {
        assert_eq!(cs.num_experts(l), src.num_experts(l), "layer {l}");
        for e in 0..cs.num_experts(l) {
            let (a, b) = (cs.locate(l, e).expect("a"), src.locate(l, e).expect("b"));
            assert_eq!(
                a.mats().map(|m| (m.data, m.scales, m.format)),
                b.mats().map(|m| (m.data, m.scales, m.format))
            );
        }
    }
    let store = ExpertStore::open(c, opts(IoMode::Pread, 1 << 20)).expect("open");
    assert_eq!(store.layers(), vec![(1, 8), (2, 8), (3, 8)]);
    store
        .with_experts(3, &[4], &mut |id, v| {
            assert_eq!(digest(v), reference(&src, 3, id));
            Ok(())
        })
        .expect("mtp layer experts");
    assert_ne!(cs.fingerprint(), "");
}

#[test]
fn bad_arguments_are_typed_errors() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let store = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 1 << 20)).expect("open");
    let mut f = |_: usize, _: &ExpertView<'_>| Ok(());
    assert!(matches!(
        store.with_experts(0, &[0], &mut f),
        Err(Error::InvalidArgument { .. })
    ));
    assert!(matches!(
        store.with_experts(1, &[8], &mut f),
        Err(Error::InvalidArgument { .. })
    ));
    store.prefetch(0, &[1]); // ignored, never fails
    store.prefetch(1, &[99]);
    // The callback's own error comes back, and the store goes on.
    let r = store.with_experts(1, &[1, 2], &mut |_, _| {
        Err(Error::Internal("from f".into()))
    });
    assert!(matches!(r, Err(Error::Internal(m)) if m == "from f"));
    store.with_experts(1, &[1, 2], &mut f).expect("usable");
    let bad = StoreOptions {
        io_threads: 0,
        ..opts(IoMode::Pread, 0)
    };
    assert!(ExpertStore::open_source(src.clone(), bad).is_err());
    let bad = StoreOptions {
        pin: PinPolicy::Explicit(vec![(0, 0)]),
        ..opts(IoMode::Pread, 1 << 20)
    };
    assert!(ExpertStore::open_source(src, bad).is_err());
}

/// Faults mid-generation give typed errors naming the file; the store stays usable.
#[test]
fn faults_are_typed_and_recoverable() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    // Experts 0..5 of layer 1 live in shard 0, layer 1 expert 5.. in shard 1.
    let shard0 = src.files[0].clone();
    let name0 = shard0
        .file_name()
        .and_then(|n| n.to_str())
        .expect("name")
        .to_owned();
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    for io in [IoMode::Mmap, IoMode::Pread, IoMode::Direct] {
        let store = ExpertStore::open_source(src.clone(), opts(io, 0)).expect("open");
        for (kind, check) in [
            (FaultKind::Eio, "io"),
            (FaultKind::Missing, "io"),
            (FaultKind::ShortRead(100), "container"),
        ] {
            store.faults().inject(&name0, kind, Some(1));
            let err = store.with_experts(1, &[0, 1], &mut ok).expect_err("fault");
            match (&err, check) {
                (Error::Io { path, source }, "io") => {
                    assert_eq!(path, &shard0);
                    let want = if kind == FaultKind::Eio {
                        Some(libc::EIO)
                    } else {
                        Some(libc::ENOENT)
                    };
                    assert_eq!(source.raw_os_error(), want);
                }
                (Error::Container { file, tensor, .. }, "container") => {
                    assert_eq!(file, &shard0);
                    assert!(tensor
                        .as_deref()
                        .is_some_and(|t| t.contains("layers.1.mlp.experts")));
                }
                _ => panic!("{io:?} {kind:?}: unexpected {err:?}"),
            }
            store.faults().clear();
            store
                .with_experts(1, &[0, 1], &mut ok)
                .expect("usable after the fault");
        }
    }
}

/// A filesystem that refuses O_DIRECT reads (EINVAL): the direct store falls back to buffered
/// reads, delivers the same bytes, and reports the mode in effect as pread.
#[test]
fn refused_direct_reads_fall_back_to_buffered() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let name0 = src.files[0]
        .file_name()
        .and_then(|n| n.to_str())
        .expect("name")
        .to_owned();
    let store = ExpertStore::open_source(src.clone(), opts(IoMode::Direct, 0)).expect("open");
    if store.stats().io_mode != IoMode::Direct {
        // This filesystem already refused O_DIRECT at open time: the fallback under test ran.
        assert_eq!(store.stats().io_mode, IoMode::Pread);
        return;
    }
    store
        .faults()
        .inject(&name0, FaultKind::DirectRefused, Some(1));
    let mut got = Vec::new();
    store
        .with_experts(1, &[0, 1], &mut |e, v: &ExpertView<'_>| {
            got.push((e, digest(v)));
            Ok(())
        })
        .expect("falls back instead of failing");
    got.sort();
    assert_eq!(
        got,
        vec![(0, reference(&src, 1, 0)), (1, reference(&src, 1, 1))]
    );
    assert_eq!(
        store.stats().io_mode,
        IoMode::Pread,
        "the fallback is reported"
    );
    // Later loads keep working, buffered.
    store
        .with_experts(1, &[2, 6], &mut |e, v: &ExpertView<'_>| {
            assert_eq!(digest(v), reference(&src, 1, e));
            Ok(())
        })
        .expect("later loads");
}

#[test]
fn a_truncated_shard_is_an_error_not_a_crash() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let shard1 = src.files[1].clone();
    let full = std::fs::read(&shard1).expect("read");
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    for io in [IoMode::Mmap, IoMode::Pread, IoMode::Direct] {
        let store = ExpertStore::open_source(src.clone(), opts(io, 0)).expect("open");
        let f = std::fs::OpenOptions::new()
            .write(true)
            .open(&shard1)
            .expect("open rw");
        f.set_len(1000).expect("truncate");
        // Layer 1 expert 6 lives in shard 1 (5 experts per shard).
        match store.with_experts(1, &[2, 6], &mut ok) {
            Err(Error::Container { file, .. }) => assert_eq!(file, shard1),
            other => panic!("{io:?}: expected a container error, got {other:?}"),
        }
        store
            .with_experts(1, &[0, 2], &mut ok)
            .expect("other shards still work");
        std::fs::write(&shard1, &full).expect("restore");
        store
            .with_experts(1, &[6], &mut |id, v| {
                assert_eq!(digest(v), reference(&src, 1, id));
                Ok(())
            })
            .expect("works again once restored");
    }
    // A shard deleted after open keeps serving its bytes (the descriptor stays open).
    let store = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 0)).expect("open");
    std::fs::remove_file(&shard1).expect("rm");
    store
        .with_experts(1, &[6], &mut ok)
        .expect("deleted but open");
}

#[test]
fn resident_memory_stays_within_budget_plus_fixed_overhead() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let one = src.locate(1, 0).expect("loc").bytes();
    let tr = trace(&spec, 120);
    for (budget, prefetch) in [
        (0, PrefetchMode::Off),
        (3 * one, PrefetchMode::Real),
        (7 * one, PrefetchMode::Real),
    ] {
        let o = StoreOptions {
            prefetch,
            prefetch_threads: 2,
            io_threads: 2,
            ..opts(IoMode::Pread, budget)
        };
        let window = 2 * o.io_threads as u64;
        let pool = window + o.prefetch_threads as u64 + 1;
        let store = ExpertStore::open_source(src.clone(), o).expect("open");
        let one = store.charged_bytes(1, 0).expect("charged");
        // Budget + transient loads (demand window + the one in use) + the slab pool.
        let bound = budget + (window + 1 + pool) * one;
        for (l, ids, pred) in &tr {
            store.prefetch(*l, pred);
            store
                .with_experts(*l, ids, &mut |_, _| {
                    let s = store.stats();
                    // The cache's own accounting never exceeds the budget...
                    assert!(s.lru_bytes + s.pinned_bytes <= budget);
                    // ...and the real allocation exceeds it by at most a fixed overhead.
                    assert!(s.live_owned_bytes <= bound, "{s:?}");
                    Ok(())
                })
                .expect("call");
        }
        let s = store.stats();
        assert!(s.peak_owned_bytes <= bound, "{s:?}");
        assert!(s.peak_owned_bytes >= one);
        drop(store);
    }
}

#[test]
fn prefetch_real_loads_once_and_counts_recall() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let o = StoreOptions {
        prefetch: PrefetchMode::Real,
        ..opts(IoMode::Pread, 1 << 30)
    };
    let store = ExpertStore::open_source(src.clone(), o).expect("open");
    store.prefetch(2, &[1, 2, 3]);
    // Wait for the prefetch thread to finish the three loads.
    let t = std::time::Instant::now();
    while store.stats().total.loads < 3 {
        assert!(t.elapsed().as_secs() < 10, "prefetch never completed");
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    store.with_experts(2, &[2, 3, 4, 5], &mut ok).expect("call");
    let l2 = store
        .stats()
        .layers
        .iter()
        .find(|x| x.0 == 2)
        .expect("layer 2")
        .1;
    assert_eq!(l2.hits_prefetched, 2);
    assert_eq!(l2.misses, 2);
    assert_eq!(l2.loads, 5, "no expert loaded twice");
    assert_eq!((l2.recalled_router, l2.routed_router), (2, 4));
    assert!((l2.recall_router() - 0.5).abs() < 1e-12);
    assert_eq!(l2.prefetch_issued, 3);
    // The unused prediction (1) is wasted once the LRU evicts it; previous-token recall.
    store.hint_previous(2);
    store.with_experts(2, &[2, 3, 6], &mut ok).expect("call");
    let l2 = store
        .stats()
        .layers
        .iter()
        .find(|x| x.0 == 2)
        .expect("layer 2")
        .1;
    assert_eq!((l2.recalled_previous, l2.routed_previous), (2, 3));
    assert_eq!(l2.hits_lru, 2);
}

#[test]
fn demand_waits_for_an_in_flight_prefetch_instead_of_reading_again() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    for _ in 0..20 {
        let o = StoreOptions {
            prefetch: PrefetchMode::Real,
            prefetch_threads: 2,
            ..opts(IoMode::Pread, 1 << 30)
        };
        let store = ExpertStore::open_source(src.clone(), o).expect("open");
        store.prefetch(1, &[0, 1, 2, 3, 4, 5, 6, 7]);
        let mut seen = Vec::new();
        store
            .with_experts(1, &[0, 1, 2, 3, 4, 5, 6, 7], &mut |id, v| {
                seen.push((id, digest(v)));
                Ok(())
            })
            .expect("call");
        drop(store.stats());
        // Prefetch jobs still queued find the slot busy; give them time, then count loads.
        std::thread::sleep(std::time::Duration::from_millis(20));
        let s = store.stats().total;
        assert_eq!(s.loads, 8, "{s:?}");
        assert_eq!(s.misses + s.hits_inflight + s.hits_prefetched, 8, "{s:?}");
        seen.sort_unstable();
        for (id, d) in seen {
            assert_eq!(d, reference(&src, 1, id));
        }
    }
}

#[test]
fn hint_mode_counts_useful_and_wasted_hints() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    for io in [IoMode::Mmap, IoMode::Pread] {
        let o = StoreOptions {
            prefetch: PrefetchMode::Hint,
            ..opts(io, 0)
        };
        let store = ExpertStore::open_source(src.clone(), o).expect("open");
        store.prefetch(3, &[0, 1, 2]);
        let t = std::time::Instant::now();
        while store.stats().total.prefetch_issued < 3 {
            assert!(t.elapsed().as_secs() < 10);
            std::thread::sleep(std::time::Duration::from_millis(1));
        }
        store
            .with_experts(3, &[0, 5], &mut |_, _| Ok(()))
            .expect("call");
        let s = store.stats().total;
        assert_eq!((s.prefetch_useful, s.prefetch_wasted), (1, 2));
        assert_eq!(s.loads, 2, "hints load nothing into the cache");
    }
}

/// With O_DIRECT the page cache is bypassed, so a hint would only make the kernel read bytes
/// nobody uses: neither `Hint` prefetches nor the previous-token hints are issued.
#[test]
fn no_page_cache_hints_under_direct_io() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    for prefetch in [PrefetchMode::Hint, PrefetchMode::Real] {
        let o = StoreOptions {
            prefetch,
            ..opts(IoMode::Direct, 1 << 30)
        };
        let store = ExpertStore::open_source(src.clone(), o).expect("open");
        if store.stats().io_mode != IoMode::Direct {
            continue; // the filesystem refused O_DIRECT: hints are useful again
        }
        let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
        for _ in 0..3 {
            store.hint_previous(1);
            if prefetch == PrefetchMode::Hint {
                store.prefetch(1, &[3, 4]);
            }
            store.with_experts(1, &[0, 1], &mut ok).expect("call");
        }
        std::thread::sleep(std::time::Duration::from_millis(20));
        let s = store.stats().total;
        assert_eq!(s.prefetch_issued, 0, "{prefetch:?}");
        assert!(s.predicted_previous > 0, "predictions are still counted");
    }
}

/// Store options that keep a routing history in `cache` and pin from it, with room for 8
/// experts of `one` bytes.
fn history_options(cache: &std::path::Path, one: u64) -> StoreOptions {
    StoreOptions {
        usage_file: true,
        cache_dir: Some(cache.to_path_buf()),
        pin: PinPolicy::History { fraction: 0.5 },
        ..opts(IoMode::Pread, 8 * one)
    }
}

#[test]
fn routing_history_pins_the_hot_set_across_runs() {
    let spec = SynthSpec::tiny(G64);
    let (d, src) = make(&spec);
    let one = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 0))
        .and_then(|s| s.charged_bytes(1, 0))
        .expect("charged");
    let cache = tempfile::tempdir().expect("cache dir");
    let o = history_options(cache.path(), one);
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    {
        let store = ExpertStore::open_source(src.clone(), o.clone()).expect("open");
        assert_eq!(store.stats().pin_set_len, 0, "no history yet");
        for _ in 0..5 {
            store.with_experts(1, &[3, 4], &mut ok).expect("call");
            store.with_experts(2, &[7], &mut ok).expect("call");
        }
        store.with_experts(3, &[1], &mut ok).expect("call");
        assert!(matches!(
            store.save_usage().expect("save"),
            SaveOutcome::Written(_)
        ));
        // A second save adds nothing new.
        store.save_usage().expect("save");
    }
    // Kept in the cache under the model's fingerprint, never in the model directory.
    let p = usage::history_path(cache.path(), &src.fingerprint);
    assert!(
        !d.path().join(USAGE_FILE).exists(),
        "wrote into the model directory"
    );
    let (c, w) = usage::load(&p, &src.fingerprint, &[(1, 8), (2, 8), (3, 8)]);
    assert_eq!(w, None);
    assert_eq!(
        (c.layers[&1][3], c.layers[&2][7], c.layers[&3][1], c.total()),
        (5, 5, 1, 16)
    );
    // Next run: the budget's half (4 experts) pins the four hottest.
    let store = ExpertStore::open_source(src.clone(), o.clone()).expect("open");
    let s = store.stats();
    assert_eq!((s.pin_set_len, s.pin_set_bytes), (4, 4 * one));
    store.with_experts(1, &[3, 4], &mut ok).expect("call");
    store.with_experts(1, &[3, 4], &mut ok).expect("call");
    assert_eq!(store.stats().total.hits_pinned, 2);
    assert!(matches!(
        store.save_usage().expect("save"),
        SaveOutcome::Written(_)
    ));
    drop(store);
    let (c, _) = usage::load(&p, &src.fingerprint, &[(1, 8), (2, 8), (3, 8)]);
    assert_eq!(c.layers[&1][3], 7, "merged across runs");
    // Another model's history is ignored (with a warning), never an error.
    let other = StaticSource {
        fingerprint: "another".into(),
        ..(*src).clone()
    };
    let store = ExpertStore::open_source(Arc::new(other), o.clone()).expect("open");
    assert_eq!(store.stats().pin_set_len, 0);
    drop(store);
    // An unwritable history path: skipped with a warning, generation goes on.
    std::fs::remove_file(&p).expect("rm");
    std::fs::create_dir(&p).expect("a directory in the way");
    let store = ExpertStore::open_source(src.clone(), o).expect("open");
    store.with_experts(1, &[0], &mut ok).expect("call");
    assert!(matches!(
        store.save_usage().expect("no error"),
        SaveOutcome::Skipped(_)
    ));
}

#[test]
fn a_legacy_history_in_the_model_directory_is_read_but_never_written() {
    let spec = SynthSpec::tiny(G64);
    let (d, src) = make(&spec);
    let shape = [(1, 8), (2, 8), (3, 8)];
    let one = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 0))
        .and_then(|s| s.charged_bytes(1, 0))
        .expect("charged");
    // A history from before it moved to the cache: expert 5 of layer 2 is hot.
    let legacy = d.path().join(USAGE_FILE);
    let mut hot = UsageCounts::zeros(&shape);
    hot.layers.get_mut(&2).expect("layer 2")[5] = 9;
    usage::save(
        &legacy,
        &src.fingerprint,
        &shape,
        &hot,
        &UsageCounts::zeros(&shape),
    )
    .expect("legacy");
    let before = std::fs::read(&legacy).expect("read");
    let cache = tempfile::tempdir().expect("cache dir");
    let o = history_options(cache.path(), one);
    let store = ExpertStore::open_source(src.clone(), o.clone()).expect("open");
    assert_eq!(
        store.stats().pin_set_len,
        1,
        "the legacy history picks the pins"
    );
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    store.with_experts(1, &[0], &mut ok).expect("call");
    let p = usage::history_path(cache.path(), &src.fingerprint);
    assert_eq!(store.usage_path(), Some(p.as_path()));
    assert!(matches!(
        store.save_usage().expect("save"),
        SaveOutcome::Written(_)
    ));
    drop(store);
    assert_eq!(
        std::fs::read(&legacy).expect("read"),
        before,
        "legacy file modified"
    );
    // The cache now holds the legacy counts plus this run's, and takes precedence.
    let (c, w) = usage::load(&p, &src.fingerprint, &shape);
    assert_eq!(w, None);
    assert_eq!((c.layers[&2][5], c.layers[&1][0], c.total()), (9, 1, 10));
    std::fs::remove_file(&legacy).expect("rm");
    let store = ExpertStore::open_source(src.clone(), o).expect("open");
    assert_eq!(store.stats().pin_set_len, 2, "read from the cache");
    // No history file: nothing is read or written anywhere.
    drop(store);
    let off = ExpertStore::open_source(src, opts(IoMode::Pread, 8 * one)).expect("open");
    assert_eq!(off.usage_path(), None);
    assert!(matches!(
        off.save_usage().expect("save"),
        SaveOutcome::Skipped(_)
    ));
    assert!(!d.path().join(USAGE_FILE).exists());
}

#[test]
fn synthetic_model_with_dense_part_opens_as_a_complete_container() {
    let spec = SynthSpec {
        dense: true,
        ..SynthSpec::tiny(G64)
    };
    let (d, _src) = make(&spec);
    let c = crate::container::Container::open(d.path()).expect("container");
    for name in crate::container::expected_names(c.config()) {
        assert!(c.contains(&name), "missing {name}");
    }
    let q = c
        .weight("model.layers.0.self_attn.q_b_proj.weight")
        .expect("q_b");
    assert_eq!(q.format(), G64);
    let e = c.weight("model.embed_tokens.weight").expect("embed");
    assert_eq!(
        (e.format(), e.rows()),
        (QuantFormat::Int8PerRow, spec.vocab_size)
    );
    let mtp = c.weight("model.layers.3.eh_proj.weight").expect("eh_proj");
    assert_eq!(mtp.format(), QuantFormat::Int8PerRow);
    let tok: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(d.path().join("tokenizer.json")).expect("tok"),
    )
    .expect("json");
    assert_eq!(tok["model"]["vocab"]["t255"], 255);
    assert_eq!(tok["model"]["vocab"]["</s>"], 1);
}

#[test]
fn real_prefetch_is_gated_while_predictions_are_poor() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let o = StoreOptions {
        prefetch: PrefetchMode::Real,
        prefetch_min_precision: 0.5,
        ..opts(IoMode::Pread, 1 << 30)
    };
    let store = ExpertStore::open_source(src.clone(), o).expect("open");
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    let gated = |s: &ExpertStore| s.stats().total.prefetch_gated;
    // Precision starts at the gate (0.5): the first prediction goes through; a wrong one
    // drops it to 0.375 and closes the gate.
    store.prefetch(1, &[7]);
    store.with_experts(1, &[0], &mut ok).expect("call");
    assert_eq!(gated(&store), 0);
    store.prefetch(1, &[6]);
    assert_eq!(gated(&store), 1, "gated while the predictor is poor");
    // Predictions still count for recall, so a right one (0.53) opens the gate again.
    store.with_experts(1, &[6], &mut ok).expect("call");
    store.prefetch(1, &[5]);
    assert_eq!(gated(&store), 1, "open again");
    let s = store.stats().total;
    assert_eq!((s.recalled_router, s.routed_router), (1, 2));
    // The gate is off at 0.
    let o = StoreOptions {
        prefetch: PrefetchMode::Real,
        prefetch_min_precision: 0.0,
        ..opts(IoMode::Pread, 1 << 30)
    };
    let store = ExpertStore::open_source(src, o).expect("open");
    for _ in 0..5 {
        store.prefetch(1, &[7]);
        store.with_experts(1, &[0], &mut ok).expect("call");
    }
    assert_eq!(gated(&store), 0);
}

/// The gate prices what a prefetch would read: predictions of resident experts (right or
/// wrong) do not move the precision, so a predictor whose right guesses are all cache hits
/// and whose reads are all wasted is gated.
#[test]
fn prefetch_gate_counts_only_predictions_that_would_read() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let o = StoreOptions {
        prefetch: PrefetchMode::Real,
        ..opts(IoMode::Pread, 1 << 30)
    };
    let store = ExpertStore::open_source(src, o).expect("open");
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    let gated = |s: &ExpertStore| s.stats().total.prefetch_gated;
    store.with_experts(1, &[0], &mut ok).expect("warm expert 0");
    // Each call routes to the resident expert 0; the predictor names it (right, a cache
    // hit) and a cold expert (wrong, a wasted read). Counting every prediction gives 0.5
    // per call, which keeps the gate open; counting the cold ones gives 0.
    for cold in [7, 6, 5] {
        // Wait for the previous prefetch to land, so the next prediction sees it resident.
        std::thread::sleep(std::time::Duration::from_millis(50));
        store.prefetch(1, &[0, cold]);
        store.with_experts(1, &[0], &mut ok).expect("call");
    }
    assert!(gated(&store) >= 2, "gated: {}", gated(&store));
    let s = store.stats().total;
    assert_eq!(
        (s.recalled_router, s.routed_router),
        (3, 3),
        "recall counts every prediction"
    );
}

/// A resident layer is loaded at open, outside the budget, never evicted, keeps its bytes and
/// stays out of the routing history; other layers keep the whole budget for their LRUs.
#[test]
fn resident_layers_load_at_open_beyond_the_budget() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let mtp = spec.num_hidden_layers; // the MTP layer's index
    let one = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 0))
        .expect("open")
        .charged_bytes(1, 0)
        .expect("bytes");
    let n = spec.n_routed_experts as u64;
    for io in [IoMode::Mmap, IoMode::Pread, IoMode::Direct] {
        let o = StoreOptions {
            resident_layers: vec![mtp],
            ..opts(io, 2 * one)
        };
        let store = ExpertStore::open_source(src.clone(), o).expect("open");
        let s = store.stats();
        let mtp_bytes: u64 = (0..spec.n_routed_experts)
            .map(|e| store.charged_bytes(mtp, e).expect("bytes"))
            .sum();
        assert_eq!(s.budget_bytes, 2 * one + mtp_bytes, "{one}");
        assert_eq!(s.pin_set_len, spec.n_routed_experts);
        assert_eq!(s.pinned_bytes, mtp_bytes);
        assert_eq!(
            s.total.bytes_read, 0,
            "open's loads are not counted as decode reads"
        );
        // Using every expert of the resident layer reads nothing more, bytes unchanged.
        let mut seen = 0;
        store
            .with_experts(
                mtp,
                &(0..spec.n_routed_experts).collect::<Vec<_>>(),
                &mut |e, v| {
                    assert_eq!(digest(v), reference(&src, mtp, e));
                    seen += 1;
                    Ok(())
                },
            )
            .expect("resident");
        assert_eq!(seen, spec.n_routed_experts);
        let s = store.stats();
        assert_eq!((s.total.misses, s.total.bytes_read), (0, 0));
        assert_eq!(s.total.hits_pinned, n);
        // The main layers still have the 2-expert budget between them.
        assert_eq!(s.lru_capacity_bytes, 2 * one);
    }
    let bad = StoreOptions {
        resident_layers: vec![0],
        ..opts(IoMode::Pread, 0)
    };
    match ExpertStore::open_source(src, bad) {
        Err(err) => assert!(err.to_string().contains("resident_layers"), "{err}"),
        Ok(_) => panic!("a dense layer cannot be resident"),
    }
}

/// The busy clock counts the union of read intervals: overlapping reads count once, so the
/// busy time never exceeds the wall time of the calls, and idle time is not counted.
#[test]
fn io_busy_time_is_the_union_of_reads() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let store = ExpertStore::open_source(src, opts(IoMode::Pread, 0)).expect("open");
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    let t = Instant::now();
    store
        .with_experts(1, &[0, 1, 2, 3, 4, 5], &mut ok)
        .expect("call");
    let first = store.stats().io_busy_ns;
    let wall = t.elapsed().as_nanos() as u64;
    assert!(
        first > 0 && first <= wall,
        "busy {first} ns, wall {wall} ns"
    );
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert_eq!(
        store.stats().io_busy_ns,
        first,
        "idle time is not busy time"
    );
    store.reset_stats();
    assert_eq!(store.stats().io_busy_ns, 0);
}

#[test]
fn holds_every_expert_exactly_when_no_expert_is_read_twice() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let probe = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 0)).expect("open");
    let layers = probe.layers();
    let total: u64 = layers
        .iter()
        .flat_map(|&(l, n)| (0..n).map(move |e| (l, e)))
        .map(|(l, e)| probe.charged_bytes(l, e).expect("charged"))
        .sum();
    assert!(!probe.holds_every_expert(), "a zero budget holds nothing");
    drop(probe);
    // Every expert of every layer, routed twice over: the second pass reads nothing when the
    // store holds every expert, and something when it does not.
    let every: Vec<(usize, Vec<usize>, Vec<usize>)> = layers
        .iter()
        .flat_map(|&(l, n)| (0..n).map(move |e| (l, vec![e], Vec::new())))
        .collect();
    let pins_one_layer = PinPolicy::Explicit((0..layers[0].1).map(|e| (layers[0].0, e)).collect());
    for (budget, pin, holds) in [
        (total, PinPolicy::Off, true),
        (2 * total, PinPolicy::Off, true),
        (total - 1, PinPolicy::Off, false),
        // The pins are one layer's experts: with the budget at the total, the other layers'
        // equal shares of what is left come to less than each of them holds.
        (total, pins_one_layer.clone(), false),
        (total + total, pins_one_layer, true),
    ] {
        let o = StoreOptions {
            pin: pin.clone(),
            ..opts(IoMode::Pread, budget)
        };
        let store = ExpertStore::open_source(src.clone(), o).expect("open");
        assert_eq!(
            store.holds_every_expert(),
            holds,
            "budget {budget}, pins {pin:?}"
        );
        run(&store, &every, false);
        let first = store.stats().total.loads;
        run(&store, &every, false);
        let second = store.stats().total.loads - first;
        assert_eq!(
            second == 0,
            holds,
            "budget {budget}, pins {pin:?}: {second} reloads"
        );
    }
}
