//! Memory within the budget, resident layers outside it, the I/O busy clock, and the
//! holds-every-expert shortcut.

use super::*;

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
