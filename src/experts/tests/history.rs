//! The routing-history file: pins the hot set across runs; a legacy one is read, never
//! written.

use super::*;

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

/// A history that routed the MTP layer (taken while it was not resident), then a store that
/// keeps that layer resident: the history pins spend the budget on the other layers only, and
/// the resident layer comes on top (a wrapped sum once pinned it and refused the budget).
#[test]
fn a_resident_layer_in_the_history_is_not_pinned_from_the_budget() {
    let spec = SynthSpec::tiny(G64);
    let (_d, src) = make(&spec);
    let mtp = spec.num_hidden_layers;
    let one = ExpertStore::open_source(src.clone(), opts(IoMode::Pread, 0))
        .and_then(|s| s.charged_bytes(1, 0))
        .expect("charged");
    let cache = tempfile::tempdir().expect("cache dir");
    let o = history_options(cache.path(), one);
    let mut ok = |_: usize, _: &ExpertView<'_>| Ok(());
    {
        let store = ExpertStore::open_source(src.clone(), o.clone()).expect("open");
        for _ in 0..3 {
            store.with_experts(1, &[0, 1], &mut ok).expect("call");
            store
                .with_experts(
                    mtp,
                    &(0..spec.n_routed_experts).collect::<Vec<_>>(),
                    &mut ok,
                )
                .expect("call");
        }
        store.with_experts(2, &[5], &mut ok).expect("call");
        store.save_usage().expect("save");
    }
    let resident = StoreOptions {
        resident_layers: vec![mtp],
        ..o
    };
    let store =
        ExpertStore::open_source(src, resident).expect("a resident layer beyond the budget");
    let s = store.stats();
    let n = spec.n_routed_experts;
    let mtp_bytes: u64 = (0..n)
        .map(|e| store.charged_bytes(mtp, e).expect("bytes"))
        .sum();
    // Half the 8-expert budget pins layer 1's two hot experts and layer 2's one; the
    // resident layer is pinned on top.
    assert_eq!(s.pin_set_bytes, 3 * one + mtp_bytes);
    assert_eq!(s.pin_set_len, 3 + n);
    assert_eq!(s.budget_bytes, 8 * one + mtp_bytes);
}
