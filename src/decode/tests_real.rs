//! The sampling guarantee on the real (trained) embedded model: with MTP drafting, the
//! emitted tokens at output positions 1..3 follow plain sampling's exact distribution, and a
//! flawed rule (accept every draft) fails the same bound. The models run the default
//! arithmetic (int8 decode and prefill where the int8 decode kernel runs, else exact).

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;
use std::time::Instant;

use super::guard::GuardConfig;
use super::mtp::MtpDrafter;
use super::sampling::{processed_distribution, SamplingParams};
use super::spec::{run, Acceptance, Hooks};
use super::*;
use crate::container::Container;
use crate::model::{Model, ModelOptions, Sequence};

/// Generations per distribution.
const N: usize = 3_000;
/// top-k 4 keeps the exact law enumerable: ≤ 4, 16 and 64 outcomes at positions 1, 2, 3.
const TOP_K: usize = 4;
/// TV bound at N = 3000 for a marginal over K ≤ 64 outcomes: E[TV] ≤ ½√(K/N) = 0.0730, and
/// TV moves by ≤ 1/N per sample, so by McDiarmid P(TV ≥ E[TV] + t) ≤ e^(−2Nt²) = 1e-6 for
/// t = √(ln 1e6 / 2N) = 0.0481.
const TV_BOUND: f64 = 0.122;

/// The engine's default arithmetic, for prompts and decode alike.
fn default_arithmetic() -> ModelOptions {
    let arith = crate::engine::EngineOptions::default_decode();
    ModelOptions {
        decode_arithmetic: arith,
        prefill_arithmetic: arith,
        ..ModelOptions::default()
    }
}

fn tiny() -> Option<Model> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/colibri/models/tiny");
    let c = Container::open(&dir).ok()?;
    Some(Model::load(Arc::new(c), &default_arithmetic()).expect("the embedded model loads"))
}

fn params() -> SamplingParams {
    SamplingParams {
        temperature: 1.0,
        top_k: TOP_K,
        top_p: 1.0,
        seed: None,
        ..SamplingParams::default()
    }
}

/// Exact marginals of plain sampling at positions 1..=3, by enumerating the top-k tree.
fn exact(m: &mut Sequence<'_>, prompt: &[u32]) -> [std::collections::HashMap<u32, f64>; 3] {
    let sp = params();
    let mut dist = |ctx: &[u32]| -> Vec<(u32, f64)> {
        m.reset();
        let f = m.step(ctx, 0, false).unwrap();
        let p = processed_distribution(&f.logits, &sp).unwrap();
        p.iter()
            .enumerate()
            .filter(|(_, &q)| q > 0.0)
            .map(|(i, &q)| (i as u32, q))
            .collect()
    };
    let mut out: [std::collections::HashMap<u32, f64>; 3] = Default::default();
    let mut ctx = prompt.to_vec();
    for (a, pa) in dist(&ctx) {
        *out[0].entry(a).or_default() += pa;
        ctx.push(a);
        for (b, pb) in dist(&ctx) {
            *out[1].entry(b).or_default() += pa * pb;
            ctx.push(b);
            for (c, pc) in dist(&ctx) {
                *out[2].entry(c).or_default() += pa * pb * pc;
            }
            ctx.pop();
        }
        ctx.pop();
    }
    m.reset();
    out
}

fn empirical(
    m: &mut Sequence<'_>,
    prompt: &[u32],
    acceptance: Acceptance,
) -> [std::collections::HashMap<u32, f64>; 3] {
    let mut out: [std::collections::HashMap<u32, f64>; 3] = Default::default();
    let cancel = AtomicBool::new(false);
    let start = Instant::now();
    let clock = move || start.elapsed().as_secs_f64();
    for seed in 0..N as u64 {
        let o = GenerateOptions {
            max_new_tokens: 3,
            sampling: SamplingParams {
                seed: Some(seed),
                ..params()
            },
            stop_tokens: Vec::new(),
            draft: DraftSource::Mtp,
            depth: DraftDepth::Fixed(2),
            guard: GuardConfig {
                enabled: false,
                ..GuardConfig::default()
            },
            ..GenerateOptions::default()
        };
        let mut d = MtpDrafter::new(m, 0);
        let hooks = Hooks {
            drafter: Some(&mut d),
            acceptance,
            clock: &clock,
        };
        let g = run(m, prompt, &o, hooks, &mut |_| true, &cancel).unwrap();
        assert_eq!(g.tokens.len(), 3);
        for (pos, &t) in g.tokens.iter().enumerate() {
            *out[pos].entry(t).or_default() += 1.0 / N as f64;
        }
    }
    out
}

fn tv(p: &std::collections::HashMap<u32, f64>, q: &std::collections::HashMap<u32, f64>) -> f64 {
    let keys: std::collections::HashSet<u32> = p.keys().chain(q.keys()).copied().collect();
    0.5 * keys
        .iter()
        .map(|k| (p.get(k).unwrap_or(&0.0) - q.get(k).unwrap_or(&0.0)).abs())
        .sum::<f64>()
}

/// MTP drafting at G=2 samples positions 1..3 from plain sampling's exact law, and accepting
/// every draft (the negative control) does not.
fn check_mtp_sampling(m: &mut Sequence<'_>, prompt: &[u32], label: &str) {
    assert!(Target::has_mtp(m), "{label}");
    let want = exact(m, prompt);
    let got = empirical(m, prompt, Acceptance::Exact);
    for pos in 0..3 {
        let d = tv(&got[pos], &want[pos]);
        eprintln!(
            "{label}, MTP G=2, position {}: TV {d:.4} (bound {TV_BOUND})",
            pos + 1
        );
        assert!(d <= TV_BOUND, "{label} position {}: TV {d}", pos + 1);
    }
    let bad = empirical(m, prompt, Acceptance::AcceptAll);
    let worst = (0..3).map(|p| tv(&bad[p], &want[p])).fold(0.0, f64::max);
    eprintln!("{label}, negative control (accept every draft): worst TV {worst:.4}");
    assert!(
        worst > TV_BOUND,
        "{label}: the negative control passed the bound: TV {worst}"
    );
}

#[test]
fn mtp_sampling_on_the_trained_model_matches_plain_sampling() {
    let Some(model) = tiny() else {
        panic!("python/colibri/models/tiny is missing: the embedded model must ship with the repo");
    };
    let mut caches = model.new_caches();
    let mut m = Sequence::new(&model, &mut caches);
    // `<|bos|>def fibonacci(n):` in the tiny tokenizer would do; any in-vocabulary ids work.
    let prompt: Vec<u32> = vec![0, 300, 301, 302, 303, 304];
    check_mtp_sampling(&mut m, &prompt, "real tiny model");
}

/// The same guarantee with GLM's sparse attention: the glm_dsa fixture (index_topk 8) after a
/// 20-token prompt, so every verify row, draft row and plain row attends to a selection.
#[test]
fn mtp_sampling_with_dsa_matches_plain_sampling() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/glm_dsa");
    let c = Container::open(&dir).expect("the glm_dsa fixture");
    let model = Model::load(Arc::new(c), &default_arithmetic()).expect("glm_dsa loads");
    assert!(model.uses_dsa());
    let prompt: Vec<u32> = (0..20).map(|i| 2 + (i * 37 % 250)).collect();
    assert!(prompt.len() > model.config().index_topk.unwrap());
    let mut caches = model.new_caches();
    let mut m = Sequence::new(&model, &mut caches);
    check_mtp_sampling(&mut m, &prompt, "glm_dsa (DSA)");
}

/// `step_last` / `mtp_step_last` return exactly the last row of `step_all` / `mtp_step` (and
/// every row's hidden): prefill and MTP absorbs rely on it to skip the other rows' LM head.
#[test]
fn last_row_forwards_match_the_full_ones() {
    let Some(model) = tiny() else {
        panic!("the embedded model must be present (python/colibri/models/tiny)");
    };
    let mut caches = model.new_caches();
    let mut m = Sequence::new(&model, &mut caches);
    let prompt: Vec<u32> = (10..30).collect();
    let v = model.config().vocab_size;
    let full = Target::step_all(&mut m, &prompt, 0).unwrap();
    m.reset();
    let last = Target::step_last(&mut m, &prompt, 0).unwrap();
    assert_eq!(last.logits.len(), v);
    assert_eq!(last.logits, full.logits[(prompt.len() - 1) * v..]);
    assert_eq!(last.hidden, full.hidden);

    let rows = prompt.len() - 1;
    let hidden = full.hidden.slice(0..rows);
    let mtp_full = Target::mtp_step(&mut m, &prompt[1..], &hidden, 0).unwrap();
    m.mtp_truncate(0);
    let mtp_last = Target::mtp_step_last(&mut m, &prompt[1..], &hidden, 0).unwrap();
    assert_eq!(mtp_last.logits.len(), v);
    assert_eq!(mtp_last.logits, mtp_full.logits[(rows - 1) * v..]);
    assert_eq!(mtp_last.hidden, mtp_full.hidden);
}
