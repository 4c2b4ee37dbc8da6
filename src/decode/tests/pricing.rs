//! Priced drafting end to end: the defaults (`draft="auto"`, automatic depth) measure before
//! the MTP layer does any work, and leave it idle where drafting cannot pay.

use super::*;
use crate::decode::pricing::{ByteCosts, DraftPricing};
use crate::decode::spec::generate_timed;
use crate::decode::stats::MAX_DEPTH;

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

/// Byte costs of a disk-bound target: each extra verify row reads `row_secs` seconds' worth
/// of experts it would not read plainly, and each MTP row as much again.
fn disk_bound(row_secs: f64) -> ByteCosts {
    ByteCosts {
        secs_per_byte: 1e-9,
        verify_row_bytes: row_secs * 1e9,
        mtp_row_bytes: row_secs * 1e9,
        mtp_missing_bytes: 1e12,
    }
}

/// The cheap-verify mock of `where_verify_rows_are_cheap_the_defaults_draft` (drafting pays
/// on compute time alone), with `bytes` for what its drafts read.
fn cheap_compute(bytes: ByteCosts) -> MockConfig {
    MockConfig {
        cost_base: 1.0,
        cost_per_row: 0.05,
        mtp_cost_per_row: 0.01,
        mtp_draft_share: 0.02,
        byte_costs: bytes,
        ..MockConfig::default()
    }
}

/// Disk-bound, a draft's bytes cost about a plain step: the defaults never engage the MTP
/// layer (whatever the measured compute says), do not even probe (a probe's row would read
/// those bytes), and decode plainly. In RAM the same mock drafts, and a byte price of a few
/// percent of a step does not stop it.
#[test]
fn a_disk_bound_target_stops_drafting_and_an_in_ram_one_does_not() {
    let prompt = [1, 2, 3];
    let n = 200;
    for (bytes, drafts) in [
        (disk_bound(1.0), false),
        (disk_bound(0.6), false),
        (ByteCosts::FREE, true),
        (disk_bound(0.005), true),
    ] {
        let cfg = cheap_compute(bytes);
        let mut t = MockTarget::new(cfg.clone());
        let mut state = CacheState::default();
        let g = defaults(&mut t, &mut state, &prompt, n);
        assert_eq!(g.tokens, plain(&cfg, &prompt, n), "{bytes:?}");
        if drafts {
            assert!(
                t.mtp_calls > 0 && g.stats.tokens_per_forward > 1.5,
                "{bytes:?}: {:?}",
                g.stats
            );
            assert!(!state.mtp_priced_out());
        } else {
            assert_eq!(t.mtp_calls, 0, "{bytes:?}: the MTP layer ran");
            assert_eq!(g.stats.proposed, 0, "{bytes:?}: probed");
            assert_eq!(g.stats.forwards as usize, t.step_calls);
            assert!(state.mtp_priced_out());
        }
    }
}

/// The depth controller alone (any drafter, here an always-right one): priced by bytes that
/// cost a plain step per draft token it never drafts, not even to explore; in RAM it goes
/// deep; lossless either way.
#[test]
fn the_depth_controller_prices_drafts_by_their_bytes() {
    let prompt = [1, 2, 3];
    let n = 300;
    let histogram = |bytes: ByteCosts| {
        let cfg = MockConfig {
            cost_base: 1.0,
            cost_per_row: 0.01,
            byte_costs: bytes,
            ..MockConfig::default()
        };
        let mut t = MockTarget::new(cfg);
        let plain = gen(
            &mut t,
            &prompt,
            &opts(DraftSource::Off, DraftDepth::Auto, n),
        );
        let mut reference = prompt.to_vec();
        reference.extend(&plain.tokens);
        let mut d = ForcedDrafter {
            reference,
            vocab: 16,
            mode: Forced::AcceptAll,
        };
        let o = opts(DraftSource::Ngram, DraftDepth::Auto, n);
        let g = run_forced(&mut t, &prompt, &o, &mut d, Acceptance::Exact);
        assert_eq!(g.tokens, plain.tokens);
        g.stats.depth_histogram
    };
    let disk = histogram(disk_bound(1.2));
    assert_eq!(disk[0], disk.iter().sum::<u64>(), "{disk:?}");
    let ram = histogram(ByteCosts::FREE);
    assert!(ram[8] * 2 > ram.iter().sum::<u64>(), "{ram:?}");
    // A small price leaves deep drafts paying.
    let cheap = histogram(disk_bound(0.02));
    assert!(cheap[0] * 4 < cheap.iter().sum::<u64>(), "{cheap:?}");
}

/// `turns` generations of `n` tokens on one target and its caches, each prompt the
/// conversation so far plus a new token, under `o`: the virtual seconds each took, the
/// caches' state after them, and every generation's tokens.
fn conversation(
    cfg: &MockConfig,
    o: &GenerateOptions,
    turns: usize,
) -> (Vec<f64>, CacheState, Vec<Vec<u32>>) {
    let mut t = MockTarget::new(cfg.clone());
    let mut state = CacheState::default();
    let mut prompt: Vec<u32> = (0..24).map(|i| (i * 7 % 13) as u32 + 1).collect();
    let clock = t.clock();
    let (mut secs, mut outputs) = (Vec::new(), Vec::new());
    for turn in 0..turns {
        let start = clock();
        let g = generate_timed(
            &mut t,
            &mut state,
            &prompt,
            o,
            &mut |_| true,
            &AtomicBool::new(false),
            &clock,
        )
        .unwrap_or_else(|e| panic!("generate failed: {e}"));
        secs.push(clock() - start);
        prompt.extend(&g.tokens);
        prompt.push(1 + turn as u32 % 5);
        outputs.push(g.tokens);
    }
    (secs, state, outputs)
}

/// Drafting at break-even in RAM, as on the GLM-like stand-in (a 2-row verify costs 1.6
/// plain steps, a draft 0.07, about 2 in 3 drafts accepted: depth 1 runs at ~0.98x plain):
/// over a conversation the defaults cost no more than 2% over `draft="off"`, and they stop
/// drafting on these caches for good.
#[test]
fn where_drafting_breaks_even_the_defaults_do_not_lose_a_conversation() {
    let cfg = MockConfig {
        cost_base: 0.4,
        cost_per_row: 0.6,
        mtp_cost_per_row: 0.07,
        mtp_draft_share: 0.07,
        mtp_error: 0.34,
        ..MockConfig::default()
    };
    let n = 128;
    let total = |o: &GenerateOptions| {
        let (secs, state, tokens) = conversation(&cfg, o, 6);
        (secs.iter().sum::<f64>(), state, tokens)
    };
    let (off, _, plain) = total(&opts(DraftSource::Off, DraftDepth::Auto, n));
    let (depth1, _, _) = total(&opts(DraftSource::Mtp, DraftDepth::Fixed(1), n));
    assert!(
        depth1 > off,
        "depth 1 must lose here: {depth1} against {off}"
    );
    let (auto, state, tokens) = total(&opts(DraftSource::Auto, DraftDepth::Auto, n));
    assert_eq!(tokens, plain);
    assert!(
        auto <= 1.02 * off,
        "the defaults {auto:.1} s against off {off:.1} s"
    );
    assert!(state.mtp_priced_out());
}

/// Where drafting pays, the defaults learn their depth in the first turn of a conversation
/// and carry it to the next turns, which run within 3% of the best fixed depth.
#[test]
fn where_drafting_pays_the_defaults_come_within_three_percent_of_the_best_depth() {
    for (base, row, error) in [(1.0, 0.05, 0.2), (0.5, 0.5, 0.1), (0.7, 0.3, 0.3)] {
        let cfg = MockConfig {
            cost_base: base,
            cost_per_row: row,
            mtp_cost_per_row: 0.02,
            mtp_draft_share: 0.02,
            mtp_error: error,
            ..MockConfig::default()
        };
        let n = 128;
        // The turns after the first (which learns).
        let later = |o: &GenerateOptions| -> (f64, CacheState) {
            let (secs, state, _) = conversation(&cfg, o, 6);
            (secs[1..].iter().sum(), state)
        };
        let (off, _) = later(&opts(DraftSource::Off, DraftDepth::Auto, n));
        let best = (1..=MAX_DEPTH)
            .map(|g| later(&opts(DraftSource::Mtp, DraftDepth::Fixed(g), n)).0)
            .fold(f64::INFINITY, f64::min);
        let (auto, state) = later(&opts(DraftSource::Auto, DraftDepth::Auto, n));
        assert!(
            best < 0.9 * off,
            "a case where drafting pays: {best} against {off}"
        );
        assert!(
            auto <= best / 0.97,
            "after the first turn the defaults took {auto:.1} s, the best depth {best:.1} s"
        );
        assert!(!state.mtp_priced_out());
    }
}

/// What the defaults learned on some caches survives a generation there that does not draft,
/// and the next default generation starts drafting at once: no probe, no measuring plain step.
#[test]
fn what_drafting_learned_survives_a_generation_without_it() {
    let cfg = cheap_compute(ByteCosts::FREE);
    let mut t = MockTarget::new(cfg.clone());
    let mut state = CacheState::default();
    let mut prompt = vec![1, 2, 3];
    let g = defaults(&mut t, &mut state, &prompt, 100);
    let learned = |s: &CacheState| s.draft_memory().map(|m| m.depth.expected_tokens(4));
    let before = learned(&state).expect("the defaults learned nothing");
    prompt.extend(&g.tokens);
    prompt.push(2);
    let clock = t.clock();
    let off = generate_timed(
        &mut t,
        &mut state,
        &prompt,
        &opts(DraftSource::Off, DraftDepth::Auto, 40),
        &mut |_| true,
        &AtomicBool::new(false),
        &clock,
    )
    .unwrap_or_else(|e| panic!("generate failed: {e}"));
    assert_eq!(learned(&state), Some(before));
    prompt.extend(&off.tokens);
    prompt.push(4);
    let g = defaults(&mut t, &mut state, &prompt, 60);
    assert_eq!(g.tokens, plain(&cfg, &prompt, 60));
    assert_eq!(
        g.stats.depth_histogram[0], 0,
        "{:?}",
        g.stats.depth_histogram
    );
    // A fresh cache state measures first.
    let g = defaults(&mut t, &mut CacheState::default(), &prompt, 60);
    assert!(
        g.stats.depth_histogram[0] > 0,
        "{:?}",
        g.stats.depth_histogram
    );
}
