//! Decode at long contexts with GLM's sparse attention: one decode step of a GLM-5.2-shaped
//! model (synthetic weights: 64 heads, q_lora 2048, kv_lora 512, 6144 hidden, experts at
//! 21 MB int4-gs64, DSA indexer 32 heads × 128 int8, index_topk 2048) after 1k, 4k and 16k
//! tokens of context, and the indexer's share of the step. The goal is a flat cost: past
//! index_topk each row attends to 2048 keys whatever the context, and only the indexer's
//! scoring (one 128-wide key per token per full layer) grows with it.
//!
//! The context is `KvCaches::append_synthetic` (random KV rows): prefilling 16k tokens
//! of this model takes hours on a small machine, and a step's cost does not depend on the
//! values in the cache. Layers: 1 dense + 3 MoE (16 experts each, top-8, all resident), DSA
//! kinds full, shared, shared, shared (GLM-5.2 has 21 full of 78). Read the summary table's
//! ratios, not the absolute times.
//!
//! A reference row times dense MLA over the whole 16k context (the same container with
//! `index_topk` above it: not the model past 2048 keys, only what the selection saves).
//!
//! Container: `$COLIBRI_CONTEXT_DIR` when set (written there on first use), else a temporary
//! one (≈ 1.6 GB).

use std::cell::RefCell;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use colibri::container::Container;
use colibri::experts::synth::{self, SynthSpec};
use colibri::model::{Model, ModelOptions, Sequence};
use criterion::{criterion_group, Criterion, SamplingMode};

const CONTEXTS: [usize; 3] = [1024, 4096, 16384];

fn spec() -> SynthSpec {
    let mut s = SynthSpec::glm52(0, 16);
    s.dense = true;
    s.first_k_dense_replace = 1;
    s.num_hidden_layers = 4;
    s.index_topk_freq = 4;
    s.index_skip_topk_offset = 1; // full at 0, shared at 1, 2, 3
    s.max_position_embeddings = 32768;
    s
}

fn container() -> (PathBuf, Option<tempfile::TempDir>) {
    if let Some(d) = std::env::var_os("COLIBRI_CONTEXT_DIR") {
        let dir = PathBuf::from(d);
        if !dir.join("config.json").is_file() {
            std::fs::create_dir_all(&dir).expect("create $COLIBRI_CONTEXT_DIR");
            synth::write(&dir, &spec()).expect("synthetic container");
        }
        return (dir, None);
    }
    let tmp = tempfile::tempdir().expect("tempdir");
    synth::write(tmp.path(), &spec()).expect("synthetic container");
    (tmp.path().to_path_buf(), Some(tmp))
}

fn decode_context(c: &mut Criterion) {
    let (dir, _tmp) = container();
    let cont = Arc::new(Container::open(&dir).expect("open container"));
    let m = Model::load(cont.clone(), &ModelOptions::default()).expect("load model");
    assert!(m.uses_dsa(), "the synthetic container has DSA indexers");
    let kv_per_token = m.kv_bytes_per_token();
    let caches = RefCell::new(m.new_caches());
    // (context, seconds per step, indexer seconds per step) of every timed iteration.
    let samples: RefCell<Vec<(usize, f64, f64)>> = RefCell::new(Vec::new());

    let mut g = c.benchmark_group("decode_context");
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(500));
    g.measurement_time(Duration::from_secs(8));
    for ctx in CONTEXTS {
        {
            let mut caches = caches.borrow_mut();
            caches.clear();
            caches.append_synthetic(ctx, 0x5eed + ctx as u64);
        }
        g.bench_function(format!("glm52_shape_dsa_{}k", ctx / 1024), |b| {
            b.iter_custom(|iters| {
                let mut caches = caches.borrow_mut();
                let mut seq = Sequence::new(&m, &mut caches);
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let ix = m.indexer_seconds();
                    let t = Instant::now();
                    seq.step(&[5], ctx, false).expect("decode step");
                    let dt = t.elapsed();
                    seq.truncate(ctx);
                    total += dt;
                    let ix = m.indexer_seconds() - ix;
                    samples.borrow_mut().push((ctx, dt.as_secs_f64(), ix));
                }
                total
            })
        });
    }

    // Reference (not the model past index_topk): dense MLA over the whole 16k context, the
    // same container with index_topk above the context.
    let dense_ctx = CONTEXTS[CONTEXTS.len() - 1];
    let text = std::fs::read_to_string(dir.join("config.json")).expect("config.json");
    let mut json: serde_json::Value = serde_json::from_str(&text).expect("config json");
    json["index_topk"] = serde_json::json!(1 << 20);
    let cfg =
        colibri::config::ModelConfig::from_json_str(&json.to_string(), dir.join("config.json"))
            .expect("config");
    let dense = Container::open_with_config(&dir, cfg).expect("open container");
    drop(caches);
    drop(m); // free the first model's experts before loading the second
    let dm = Model::load(Arc::new(dense), &ModelOptions::default()).expect("load model");
    let mut dense_seq = Sequence::owned(&dm);
    dense_seq
        .caches_mut()
        .append_synthetic(dense_ctx, 0x5eed + dense_ctx as u64);
    g.bench_function(
        format!("glm52_shape_dense_mla_{}k", dense_ctx / 1024),
        |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    dense_seq.step(&[5], dense_ctx, false).expect("decode step");
                    let dt = t.elapsed();
                    dense_seq.truncate(dense_ctx);
                    total += dt;
                    samples
                        .borrow_mut()
                        .push((usize::MAX, dt.as_secs_f64(), 0.0));
                }
                total
            })
        },
    );
    g.finish();

    let samples = samples.into_inner();
    let median = |ctx: usize, f: fn(&(usize, f64, f64)) -> f64| {
        let mut v: Vec<f64> = samples.iter().filter(|s| s.0 == ctx).map(f).collect();
        v.sort_by(f64::total_cmp);
        // NaN for a context a bench filter left out.
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let base = median(CONTEXTS[0], |s| s.1);
    eprintln!(
        "\ndecode_context summary (medians; KV {:.1} KiB per token):",
        kv_per_token as f64 / 1024.0
    );
    eprintln!("| context | step ms | tok/s | vs 1k | indexer ms | indexer share |");
    eprintln!("|---|---|---|---|---|---|");
    for ctx in CONTEXTS {
        let (step, ix) = (median(ctx, |s| s.1), median(ctx, |s| s.2));
        eprintln!(
            "| {ctx} | {:.1} | {:.2} | {:.2} | {:.2} | {:.1}% |",
            step * 1e3,
            1.0 / step,
            base / step,
            ix * 1e3,
            100.0 * ix / step
        );
    }
    let dense = median(usize::MAX, |s| s.1);
    eprintln!(
        "| {dense_ctx}, dense MLA (reference) | {:.1} | {:.2} | {:.2} | — | — |",
        dense * 1e3,
        1.0 / dense,
        base / dense
    );
}

criterion_group!(benches, decode_context);
