//! End-to-end tests of the decode loop on the mock target (docs/speculative.md, "Tests").

mod depth;
mod ending;
mod lossless;
mod pricing;
mod sampling;

use std::sync::atomic::{AtomicBool, Ordering};

use super::guard::GuardConfig;
use super::mock::{Forced, ForcedDrafter, MockConfig, MockTarget};
use super::mtp::MtpDrafter;
use super::rng::Rng;
use super::sampling::{processed_distribution, token_logprob, History, SamplingParams};
use super::spec::{run, Acceptance, Hooks};
use super::*;
use crate::Error;

fn no_guard() -> GuardConfig {
    GuardConfig {
        enabled: false,
        ..GuardConfig::default()
    }
}

fn opts(draft: DraftSource, depth: DraftDepth, max_new_tokens: usize) -> GenerateOptions {
    GenerateOptions {
        max_new_tokens,
        sampling: SamplingParams::greedy(),
        draft,
        depth,
        guard: no_guard(),
        ..GenerateOptions::default()
    }
}

fn gen(target: &mut MockTarget, prompt: &[u32], o: &GenerateOptions) -> Generation {
    target.step_calls = 0;
    target.mtp_calls = 0;
    let g = generate(target, prompt, o, &mut |_| true, &AtomicBool::new(false))
        .unwrap_or_else(|e| panic!("generate failed: {e}"));
    settled(target, prompt, &g);
    g
}

fn settled(target: &MockTarget, prompt: &[u32], g: &Generation) {
    if let Err(e) = target.check_settled(prompt.len(), g.tokens.len()) {
        panic!("target not settled after generate: {e}");
    }
    assert_eq!(g.stats.generated_tokens, g.tokens.len());
    assert_eq!(g.stats.forwards as usize, target.step_calls);
    assert_eq!(g.stats.mtp_forwards as usize, target.mtp_calls);
}

fn run_forced(
    target: &mut MockTarget,
    prompt: &[u32],
    o: &GenerateOptions,
    drafter: &mut ForcedDrafter,
    acceptance: Acceptance,
) -> Generation {
    target.step_calls = 0;
    target.mtp_calls = 0;
    let clock = target.clock();
    let hooks = Hooks {
        drafter: Some(drafter),
        acceptance,
        clock: &clock,
    };
    let g = run(
        target,
        prompt,
        o,
        hooks,
        &mut |_| true,
        &AtomicBool::new(false),
    )
    .unwrap_or_else(|e| panic!("run failed: {e}"));
    settled(target, prompt, &g);
    g
}

/// 24 prompts: random ones of length 1..=12, and some with repeats (for the n-gram drafter).
fn prompts(vocab: u32) -> Vec<Vec<u32>> {
    let mut rng = Rng::from_seed(99);
    let mut out = Vec::new();
    for i in 0..24 {
        let len = 1 + (i % 12);
        let mut p: Vec<u32> = (0..len)
            .map(|_| rng.below(u64::from(vocab)) as u32)
            .collect();
        if i % 3 == 0 {
            let again = p.clone();
            p.extend(again);
        }
        out.push(p);
    }
    out
}

fn mock() -> MockTarget {
    MockTarget::new(MockConfig::default())
}

/// Context-dependent processing for the lossless tests: every penalty, a bias, and
/// `min_tokens` masking the stop token 5 at output positions 1 and 2.
fn penalised(sp: SamplingParams) -> SamplingParams {
    SamplingParams {
        repetition_penalty: 1.6,
        presence_penalty: 0.5,
        frequency_penalty: 0.4,
        logit_bias: vec![(2, 1.5), (7, -0.8)],
        min_tokens: 2,
        ..sp
    }
}
