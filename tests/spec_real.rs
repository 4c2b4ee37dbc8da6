//! Speculative decoding on real models (the transformers fixtures): drafting never changes
//! greedy output, a fixed seed reproduces sampled output, and KV rollback leaves the model
//! consistent. The models run the engine's default arithmetic (int8 where the int8 decode
//! kernel runs), and greedy drafting is checked in exact f32 too.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use colibri::container::Container;
use colibri::decode::{
    generate, DraftDepth, DraftSource, GenerateOptions, GuardConfig, SamplingParams, Target,
};
use colibri::engine::EngineOptions;
use colibri::model::{Model, ModelOptions, Sequence};
use colibri::quant::kernels::Arithmetic;

fn load(name: &str) -> Model {
    load_in(name, EngineOptions::default_decode())
}

/// `name` with `arith` for prompts and decode alike.
fn load_in(name: &str, arith: Arithmetic) -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name);
    let opts = ModelOptions {
        decode_arithmetic: arith,
        prefill_arithmetic: arith,
        ..ModelOptions::default()
    };
    Model::load(Arc::new(Container::open(&dir).unwrap()), &opts).unwrap()
}

/// 20 prompts: random ones and repetitive ones (so the n-gram drafter finds matches).
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    let mut x = 12345u64;
    let mut next = || {
        x = x
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((x >> 33) as u32) % vocab
    };
    (0..20)
        .map(|i| {
            let len = 3 + i % 9;
            let base: Vec<u32> = (0..len).map(|_| next()).collect();
            if i % 2 == 0 {
                base
            } else {
                base.iter().cycle().take(len * 3).copied().collect()
            }
        })
        .collect()
}

fn run(m: &mut dyn Target, prompt: &[u32], opts: &GenerateOptions) -> Vec<u32> {
    let cancel = AtomicBool::new(false);
    let g = generate(m, prompt, opts, &mut |_| true, &cancel).unwrap();
    // The target is left consistent: every emitted token but the last is in the KV cache.
    assert_eq!(m.kv_len(), prompt.len() + g.tokens.len() - 1);
    assert!(m.mtp_kv_len() <= m.kv_len());
    g.tokens
}

#[test]
fn drafting_never_changes_greedy_output() {
    let mut arithmetics = vec![EngineOptions::default_decode(), Arithmetic::Exact];
    arithmetics.dedup();
    for (name, arith) in ["dsv3_a", "glm_b", "glm_dsa"]
        .into_iter()
        .flat_map(|n| arithmetics.iter().map(move |&a| (n, a)))
    {
        let model = load_in(name, arith);
        let mut m = Sequence::owned(&model);
        let vocab = model.config().vocab_size as u32;
        for prompt in prompts(vocab) {
            let base = GenerateOptions {
                max_new_tokens: 24,
                draft: DraftSource::Off,
                ..GenerateOptions::default()
            };
            let plain = run(&mut m, &prompt, &base);
            for draft in [DraftSource::Mtp, DraftSource::Ngram] {
                for g in 1..=4 {
                    let opts = GenerateOptions {
                        draft,
                        depth: DraftDepth::Fixed(g),
                        // Keep drafting on: the guard would pause a random model's head.
                        guard: GuardConfig {
                            enabled: false,
                            ..GuardConfig::default()
                        },
                        ..base.clone()
                    };
                    let got = run(&mut m, &prompt, &opts);
                    assert_eq!(
                        got, plain,
                        "{name} {arith:?} {draft:?} G={g} prompt {prompt:?}"
                    );
                }
            }
        }
    }
}

#[test]
fn fixed_seed_reproduces_sampled_output_with_drafting() {
    let model = load("dsv3_a");
    let mut m = Sequence::owned(&model);
    let prompt = [5u32, 17, 99, 3, 5, 17];
    let opts = |seed| GenerateOptions {
        max_new_tokens: 20,
        sampling: SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            seed: Some(seed),
            ..SamplingParams::default()
        },
        draft: DraftSource::Mtp,
        depth: DraftDepth::Fixed(3),
        guard: GuardConfig {
            enabled: false,
            ..GuardConfig::default()
        },
        ..GenerateOptions::default()
    };
    let a = run(&mut m, &prompt, &opts(7));
    let b = run(&mut m, &prompt, &opts(7));
    let c = run(&mut m, &prompt, &opts(8));
    assert_eq!(a, b);
    assert_ne!(a, c);
}

/// A generation that starts from an earlier one's caches (`generate_after`) keeps the common
/// prefix and gives exactly what a fresh prefill gives: greedy and seeded sampling, with
/// drafting off, MTP and n-gram, on a DeepSeek-V3 fixture and on the DSA one. A continued
/// conversation keeps all of the previous turn; a prompt edited early keeps what still
/// matches (with MTP one token less: its row pairs a position with the next token).
#[test]
fn prefix_reuse_gives_the_fresh_output() {
    use colibri::decode::{generate_after, CacheState};
    for name in ["dsv3_a", "glm_dsa"] {
        let (warm_model, fresh_model) = (load(name), load(name));
        let mut warm = Sequence::owned(&warm_model);
        let mut fresh = Sequence::owned(&fresh_model);
        let vocab = warm_model.config().vocab_size as u32;
        let p1: Vec<u32> = (0..14).map(|i| 2 + (i * 53 + 7) % (vocab - 2)).collect();
        for draft in [DraftSource::Off, DraftSource::Mtp, DraftSource::Ngram] {
            for temperature in [0.0f32, 1.0] {
                let opts = GenerateOptions {
                    max_new_tokens: 12,
                    sampling: SamplingParams {
                        temperature,
                        top_k: 0,
                        top_p: 1.0,
                        seed: Some(11),
                        ..SamplingParams::default()
                    },
                    draft,
                    depth: DraftDepth::Fixed(2),
                    guard: GuardConfig {
                        enabled: false,
                        ..GuardConfig::default()
                    },
                    ..GenerateOptions::default()
                };
                let cancel = AtomicBool::new(false);
                let label = format!("{name} {draft:?} T={temperature}");
                let mut state = CacheState::default();
                let gen = |m: &mut dyn Target, state: &mut CacheState, p: &[u32]| {
                    generate_after(m, state, p, &opts, &mut |_| true, &cancel).unwrap()
                };
                let g1 = gen(&mut warm, &mut state, &p1);
                assert_eq!(g1.stats.prompt_cached_tokens, 0);
                assert_eq!(state.tokens.len(), warm.kv_len(), "{label}");
                // Turn 2: the whole of turn 1 plus new tokens; turn 3: an edit at position 5;
                // turn 4: the same prompt again.
                let mut p2 = p1.clone();
                p2.extend(&g1.tokens);
                p2.extend([3, 4, 5]);
                let mut p3 = p1[..5].to_vec();
                p3.extend([9, 8, 7, 6]);
                for (turn, prompt) in [(2, p2), (3, p3.clone()), (4, p3)] {
                    let common = state
                        .tokens
                        .iter()
                        .zip(&prompt)
                        .take_while(|(a, b)| a == b)
                        .count();
                    let g = gen(&mut warm, &mut state, &prompt);
                    let want = run(&mut fresh, &prompt, &opts);
                    assert_eq!(g.tokens, want, "{label} turn {turn}");
                    let most = common.min(prompt.len() - 1);
                    let cached = g.stats.prompt_cached_tokens;
                    if turn == 2 || draft != DraftSource::Mtp {
                        assert_eq!(cached, most, "{label} turn {turn}");
                    } else {
                        assert!(cached + 1 >= most && cached <= most, "{label} turn {turn}");
                    }
                    assert!(cached > 0, "{label} turn {turn}: something is reused");
                }
            }
        }
    }
}
