//! The replay through the real store, on the tiny synthetic container (two MoE layers and an
//! MTP layer of 8 experts): determinism, the budget's two ends, the MTP mapping, bad input.

use std::sync::Arc;

use super::replay::{replay, ReplayOptions};
use super::*;
use crate::experts::synth::{self, SynthSpec};
use crate::experts::{ExpertStore, IoMode, PinPolicy, PrefetchMode, StoreOptions};
use crate::quant::QuantFormat;

fn container() -> (tempfile::TempDir, Arc<crate::experts::StaticSource>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let spec = SynthSpec::tiny(QuantFormat::Int4Grouped { group_size: 64 });
    let src = synth::write(dir.path(), &spec).expect("synth");
    (dir, Arc::new(src))
}

fn trace(seed: u64, draft_depth: usize) -> Trace {
    let hist = Histogram::glm52().resized(8, 2).expect("resize");
    let spec = WorkloadSpec {
        seed,
        layers: 2,
        conversations: 3,
        prompt_tokens: 16,
        decode_tokens: 40,
        prefill_chunk: 8,
        draft_depth,
        mtp: draft_depth > 0,
        ..WorkloadSpec::default()
    };
    Workload::new(&hist, spec).expect("workload").generate()
}

fn store(
    src: &Arc<crate::experts::StaticSource>,
    slots: u64,
    prefetch: bool,
) -> (ExpertStore, u64) {
    let probe = ExpertStore::open_source(src.clone(), opts(1 << 30, false)).expect("open");
    let eb = probe.charged_bytes(probe.layers()[0].0, 0).expect("bytes");
    drop(probe);
    let s = ExpertStore::open_source(src.clone(), opts(slots * eb, prefetch)).expect("open");
    (s, eb)
}

fn opts(budget: u64, prefetch: bool) -> StoreOptions {
    StoreOptions {
        io: IoMode::Pread,
        ram_budget_bytes: Some(budget),
        io_threads: 2,
        pin: PinPolicy::Off,
        prefetch: if prefetch {
            PrefetchMode::Real
        } else {
            PrefetchMode::Off
        },
        prefetch_threads: 1,
        usage_file: false,
        ..Default::default()
    }
}

const FAST: ReplayOptions = ReplayOptions {
    compute_bytes_per_second: 1e12,
    dense_seconds_per_row: 0.0,
    prefetch: false,
};

#[test]
fn identical_seeds_give_identical_hit_sequences() {
    let (_d, src) = container();
    let t = trace(3, 0);
    // 9 slots over 3 layers: 3 per layer, so hits depend on the LRU's order.
    let a = replay(&store(&src, 9, false).0, &t, &FAST).expect("replay");
    let b = replay(&store(&src, 9, false).0, &t, &FAST).expect("replay");
    assert_eq!(a.hits_per_call, b.hits_per_call);
    assert!(a.hits > 0 && a.hits < a.lookups, "{a:?}");
    let other = replay(&store(&src, 9, false).0, &trace(4, 0), &FAST).expect("replay");
    assert_ne!(
        a.hits_per_call, other.hits_per_call,
        "another seed, the same hits"
    );
    assert_eq!(a.tokens, t.generated_tokens());
}

#[test]
fn the_budget_s_two_ends() {
    let (_d, src) = container();
    let t = trace(5, 0);
    let (s, eb) = store(&src, 0, false);
    let none = replay(&s, &t, &FAST).expect("replay");
    assert_eq!(none.hits, 0, "nothing cached, yet hits: {none:?}");
    // Every lookup reads its expert once: the same whole number of bytes each (the stored
    // bytes, at most the charged ones).
    let read = (none.bytes_per_token * none.tokens as f64).round() as u64;
    assert_eq!(
        read % none.lookups,
        0,
        "{read} bytes, {} lookups",
        none.lookups
    );
    assert!(
        read / none.lookups <= eb && read / none.lookups > eb / 2,
        "{read}"
    );
    // Everything fits: the decode rows only miss experts the prompts never touched.
    let (s, _) = store(&src, 24, false);
    let all = replay(&s, &t, &FAST).expect("replay");
    assert!(all.hit_rate > 0.9, "{all:?}");
    assert!(all.bytes_per_token * all.tokens as f64 <= (16 * eb) as f64);
}

#[test]
fn prefetch_and_drafts_replay_through_the_mtp_layer() {
    let (_d, src) = container();
    let t = trace(6, 2);
    assert!(t.header.mtp_layer.is_some());
    let (s, _) = store(&src, 6, true);
    let r = replay(
        &s,
        &t,
        &ReplayOptions {
            prefetch: true,
            ..FAST
        },
    )
    .expect("replay");
    assert!(r.tokens_per_forward > 1.0, "{r:?}");
    assert!((0.0..=1.0).contains(&r.prefetch_recall), "{r:?}");
    assert!((0.0..=1.0).contains(&r.prefetch_precision), "{r:?}");
    let mtp = s.layers().last().expect("layers").0;
    let st = s.stats();
    let mtp_lookups = st
        .layers
        .iter()
        .find(|(l, _)| *l == mtp)
        .map_or(0, |(_, x)| x.routed);
    assert!(
        mtp_lookups > 0,
        "the MTP rows did not reach the store's last layer"
    );
}

#[test]
fn a_trace_wider_than_the_store_is_refused() {
    let (_d, src) = container();
    let hist = Histogram::glm52().resized(16, 2).expect("resize");
    let spec = WorkloadSpec {
        layers: 2,
        conversations: 1,
        prompt_tokens: 0,
        decode_tokens: 4,
        ..WorkloadSpec::default()
    };
    let t = Workload::new(&hist, spec).expect("workload").generate();
    let err = replay(&store(&src, 4, false).0, &t, &FAST).expect_err("16 experts on 8");
    assert!(err.to_string().contains("16 experts"), "{err}");
    let bad = ReplayOptions {
        compute_bytes_per_second: 0.0,
        ..FAST
    };
    assert!(replay(&store(&src, 4, false).0, &trace(1, 0), &bad).is_err());
}
