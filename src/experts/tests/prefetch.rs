//! Prefetch bookkeeping: real loads, hints, the direct-I/O exception and the gate on poor
//! predictions.

use super::*;

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
