//! Views equal the file bytes in every configuration; the container adapter; argument
//! errors.

use super::*;

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
