//! Priced drafting end to end: the defaults (`draft="auto"`, automatic depth) measure before
//! the MTP layer does any work, and leave it idle where drafting cannot pay.

use super::*;
use crate::decode::pricing::DraftPricing;
use crate::decode::spec::generate_timed;

/// The defaults on `t` after `prompt`, timed by the mock's virtual clock.
fn defaults(t: &mut MockTarget, state: &mut CacheState, prompt: &[u32], n: usize) -> Generation {
    t.step_calls = 0;
    t.mtp_calls = 0;
    let clock = t.clock();
    let o = opts(DraftSource::Auto, DraftDepth::Auto, n);
    let g = generate_timed(
        t,
        state,
        prompt,
        &o,
        &mut |_| true,
        &AtomicBool::new(false),
        &clock,
    )
    .unwrap_or_else(|e| panic!("generate failed: {e}"));
    assert_eq!(g.stats.mtp_forwards as usize, t.mtp_calls);
    g
}

fn plain(cfg: &MockConfig, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut t = MockTarget::new(cfg.clone());
    gen(&mut t, prompt, &opts(DraftSource::Off, DraftDepth::Auto, n)).tokens
}

/// A verify row that costs a plain step: drafting cannot pay even if every draft were
/// accepted, so the MTP layer never runs, the output is plain decoding's, and the next
/// default generation on the same caches keeps its whole prefix without drafting.
#[test]
fn where_verify_rows_cost_a_plain_step_the_mtp_layer_never_runs() {
    let cfg = MockConfig {
        cost_per_row: 1.0,
        mtp_cost_per_row: 0.1,
        mtp_draft_share: 0.2,
        ..MockConfig::default()
    };
    let prompt: Vec<u32> = (0..40).map(|i| (i * 7 % 13) as u32 + 1).collect();
    let mut t = MockTarget::new(cfg.clone());
    let mut state = CacheState::default();
    let g = defaults(&mut t, &mut state, &prompt, 60);
    assert_eq!(g.tokens, plain(&cfg, &prompt, 60));
    assert_eq!(t.mtp_calls, 0, "the MTP layer ran");
    assert_eq!(g.stats.proposed, DraftPricing::PAIRS as u64, "the probes");
    assert!(state.mtp_priced_out());
    // The next turn: the conversation so far plus a new token.
    let mut next = prompt.clone();
    next.extend(&g.tokens);
    next.push(3);
    let g2 = defaults(&mut t, &mut state, &next, 20);
    assert_eq!(g2.stats.prompt_cached_tokens, next.len() - 2);
    assert_eq!((t.mtp_calls, g2.stats.proposed), (0, 0));
    assert_eq!(g2.tokens, plain(&cfg, &next, 20));
    assert!(state.mtp_priced_out());
    // Asked for by name, MTP drafting runs whatever it costs.
    let o = opts(DraftSource::Mtp, DraftDepth::Auto, 20);
    gen(&mut t, &next, &o);
    assert!(t.mtp_calls > 0);
}

/// A cheap verify row: drafting pays, so after the probes the MTP head drafts (the mock's
/// head is right 80% of the time) and the output is still plain decoding's.
#[test]
fn where_verify_rows_are_cheap_the_defaults_draft() {
    let cfg = MockConfig {
        cost_base: 1.0,
        cost_per_row: 0.05,
        mtp_cost_per_row: 0.01,
        mtp_draft_share: 0.02,
        ..MockConfig::default()
    };
    let prompt = [1, 2, 3];
    let mut t = MockTarget::new(cfg.clone());
    let mut state = CacheState::default();
    let g = defaults(&mut t, &mut state, &prompt, 200);
    assert_eq!(g.tokens, plain(&cfg, &prompt, 200));
    assert!(t.mtp_calls > 0 && g.stats.accepted > 20, "{:?}", g.stats);
    assert!(g.stats.tokens_per_forward > 1.5, "{:?}", g.stats);
    assert!(!state.mtp_priced_out());
}

/// A long prompt and few tokens to generate: absorbing the prompt through the MTP layer
/// would cost more than drafting could save, so it is not paid.
#[test]
fn a_backlog_the_answer_cannot_repay_is_not_absorbed() {
    let cfg = MockConfig {
        cost_base: 1.0,
        cost_per_row: 0.3,
        mtp_cost_per_row: 0.2,
        mtp_draft_share: 0.2,
        ..MockConfig::default()
    };
    let prompt: Vec<u32> = (0..2000).map(|i| (i * 5 % 11) as u32 + 1).collect();
    let mut t = MockTarget::new(cfg.clone());
    let g = defaults(&mut t, &mut CacheState::default(), &prompt, 24);
    assert_eq!(t.mtp_calls, 0);
    assert_eq!(g.tokens, plain(&cfg, &prompt, 24));
    // The same costs with room to repay it: drafting starts.
    let short = &prompt[..8];
    let mut t = MockTarget::new(cfg.clone());
    defaults(&mut t, &mut CacheState::default(), short, 200);
    assert!(t.mtp_calls > 0);
}
