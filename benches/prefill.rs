//! Batched prefill: four prompts of 256 tokens prefilled in one forward
//! ([`Model::prefill`] over four sequences) against one after another, in the int8 prefill
//! arithmetic. Always on the trained GLM-like model (benches/models/glmlike: top-6 of 64
//! experts, all resident); also on `$COLIBRI_PREFILL_DIR` when set, e.g. a GLM-5.2-shaped
//! container (256 experts of 6144 × 2048, top-8) made by
//! `cargo run --release --example make_synthetic -- --out DIR --moe-layers 1 --experts 256
//! --dense-layers 0`. The summary prints the ratio of the medians.

use std::cell::RefCell;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use colibri::container::Container;
use colibri::model::{Model, ModelOptions, SeqRows};
use colibri::quant::kernels::Arithmetic;
use criterion::{criterion_group, Criterion, SamplingMode};

const PROMPTS: usize = 4;
const PROMPT_TOKENS: usize = 256;

fn prompts(vocab: usize) -> Vec<Vec<u32>> {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    (0..PROMPTS)
        .map(|_| {
            (0..PROMPT_TOKENS)
                .map(|_| {
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    (x % vocab as u64) as u32
                })
                .collect()
        })
        .collect()
}

/// Seconds of one pass: the prompts together (`batched`) or one after another.
fn pass(m: &Model, prompts: &[Vec<u32>], batched: bool) -> f64 {
    let mut caches: Vec<_> = prompts.iter().map(|_| m.new_caches()).collect();
    let t = Instant::now();
    let mut rows: Vec<SeqRows<'_>> = caches
        .iter_mut()
        .zip(prompts)
        .map(|(caches, p)| SeqRows {
            caches,
            tokens: p,
            all_logits: false,
        })
        .collect();
    if batched {
        m.prefill(&mut rows).expect("batched prefill");
    } else {
        for r in rows.iter_mut() {
            m.prefill(std::slice::from_mut(r)).expect("prefill");
        }
    }
    t.elapsed().as_secs_f64()
}

fn bench_model(c: &mut Criterion, name: &str, dir: &Path) {
    let container = Arc::new(Container::open(dir).expect("open container"));
    let opts = ModelOptions {
        prefill_arithmetic: Arithmetic::Int8,
        ..ModelOptions::default()
    };
    let m = Model::load(container, &opts).expect("load model");
    let prompts = prompts(m.config().vocab_size);
    let samples: RefCell<Vec<(bool, f64)>> = RefCell::new(Vec::new());
    let mut g = c.benchmark_group("prefill_batch");
    g.sampling_mode(SamplingMode::Flat);
    g.sample_size(10);
    g.warm_up_time(Duration::from_millis(200));
    g.measurement_time(Duration::from_secs(5));
    for batched in [false, true] {
        let label = if batched {
            "together"
        } else {
            "one_after_another"
        };
        g.bench_function(format!("{name}_{PROMPTS}x{PROMPT_TOKENS}_{label}"), |b| {
            b.iter_custom(|iters| {
                let mut total = 0.0;
                for _ in 0..iters {
                    let s = pass(&m, &prompts, batched);
                    samples.borrow_mut().push((batched, s));
                    total += s;
                }
                Duration::from_secs_f64(total)
            })
        });
    }
    g.finish();
    let samples = samples.into_inner();
    let median = |batched: bool| {
        let mut v: Vec<f64> = samples
            .iter()
            .filter(|s| s.0 == batched)
            .map(|s| s.1)
            .collect();
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    let (apart, together) = (median(false), median(true));
    if apart.is_nan() || together.is_nan() {
        return; // a filter selected neither or only one of the two passes
    }
    eprintln!(
        "\nprefill_batch {name}: {PROMPTS} × {PROMPT_TOKENS} tokens, int8 prefill, {} threads: \
         one after another {:.3} s, together {:.3} s ({:.0} tok/s): {:.2}× faster together",
        m.threads(),
        apart,
        together,
        (PROMPTS * PROMPT_TOKENS) as f64 / together,
        apart / together
    );
}

fn prefill_batch(c: &mut Criterion) {
    let glmlike = Path::new(env!("CARGO_MANIFEST_DIR")).join("benches/models/glmlike");
    bench_model(c, "glmlike", &glmlike);
    if let Some(dir) = std::env::var_os("COLIBRI_PREFILL_DIR") {
        bench_model(c, "prefill_dir", &PathBuf::from(dir));
    }
}

criterion_group!(benches, prefill_batch);
