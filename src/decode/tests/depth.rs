//! The pause guard and the automatic depth controller.

use super::*;

#[test]
fn pause_guard_stops_hopeless_drafting_and_rearms() {
    let mut t = mock();
    let prompt = [2, 3];
    let plain = gen(
        &mut t,
        &prompt,
        &opts(DraftSource::Off, DraftDepth::Auto, 300),
    );
    let mut reference = prompt.to_vec();
    reference.extend(&plain.tokens);
    let mut d = ForcedDrafter {
        reference,
        vocab: 16,
        mode: Forced::RejectAll,
    };
    let mut o = opts(DraftSource::Auto, DraftDepth::Fixed(4), 300);
    o.guard = GuardConfig::default();
    let g = run_forced(&mut t, &prompt, &o, &mut d, Acceptance::Exact);
    assert_eq!(g.tokens, plain.tokens);
    // 6 verifies × 4 rejected drafts → pause 256 tokens → re-arm → 6 more → pause again.
    assert_eq!(g.stats.guard_pauses, 2);
    assert_eq!(g.stats.proposed, 48);
    assert_eq!(g.stats.depth_histogram[4], 12);
}

#[test]
fn mtp_drafting_resumes_after_a_pause_with_its_backlog_absorbed() {
    // A head that is always wrong trips the guard; the pause leaves >256 rows pending, which
    // `idle` absorbs; afterwards the bookkeeping must still be exact (the mock checks it).
    let mut t = MockTarget::new(MockConfig {
        mtp_error: 1.0,
        ..MockConfig::default()
    });
    let prompt = [5, 6, 7];
    let plain = gen(
        &mut t,
        &prompt,
        &opts(DraftSource::Off, DraftDepth::Auto, 320),
    );
    let mut o = opts(DraftSource::Mtp, DraftDepth::Fixed(2), 320);
    o.guard = GuardConfig::default();
    let g = gen(&mut t, &prompt, &o);
    assert_eq!(g.tokens, plain.tokens);
    assert_eq!(g.stats.accepted, 0);
    assert_eq!(g.stats.guard_pauses, 2);
}

fn mean_depth(h: &[u64]) -> f64 {
    let cycles: u64 = h.iter().sum();
    let weighted: u64 = h.iter().enumerate().map(|(g, &c)| g as u64 * c).sum();
    weighted as f64 / cycles as f64
}

#[test]
fn auto_depth_follows_measured_cost_and_acceptance() {
    // Virtual time: the mock's step_all advances a clock by base + per_row · S.
    let prompt = [1, 2, 3];
    let forced = |cfg: MockConfig, mode: Forced, n: usize| {
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
            mode,
        };
        let o = opts(DraftSource::Auto, DraftDepth::Auto, n);
        let g = run_forced(&mut t, &prompt, &o, &mut d, Acceptance::Exact);
        assert_eq!(g.tokens, plain.tokens);
        g.stats.depth_histogram
    };
    // Nearly flat verify cost and an always-right drafter: the deepest drafts pay.
    let cheap = MockConfig {
        cost_base: 1.0,
        cost_per_row: 0.01,
        ..MockConfig::default()
    };
    let h = forced(cheap, Forced::AcceptAll, 300);
    eprintln!("flat cost, always right: depth histogram {h:?}");
    assert!(
        mean_depth(&h) >= 6.0 && h[8] * 2 > h.iter().sum::<u64>(),
        "{h:?}"
    );
    // Verify cost ∝ S and an always-wrong drafter: drafting never pays.
    let dear = MockConfig {
        cost_per_row: 1.0,
        ..MockConfig::default()
    };
    let h = forced(dear, Forced::RejectAll, 150);
    eprintln!("cost ∝ S, always wrong: depth histogram {h:?}");
    assert!(h[0] * 10 >= h.iter().sum::<u64>() * 9, "{h:?}");

    // The mock MTP head (per-depth acceptance 0.8) with cost 1 + 0.25·S: E(G)/cost(G) is
    // 0.80, 1.20, 1.39, 1.48, 1.49, 1.48, 1.44, 1.39, 1.33 for G = 0..8, best at 3..5.
    let mut t = MockTarget::new(MockConfig {
        cost_base: 1.0,
        cost_per_row: 0.25,
        ..MockConfig::default()
    });
    let plain = gen(
        &mut t,
        &prompt,
        &opts(DraftSource::Off, DraftDepth::Auto, 400),
    );
    let mut d = MtpDrafter::new(&t, 0);
    let clock = t.clock();
    let o = opts(DraftSource::Mtp, DraftDepth::Auto, 400);
    let hooks = Hooks {
        drafter: Some(&mut d),
        acceptance: Acceptance::Exact,
        clock: &clock,
    };
    let g = run(
        &mut t,
        &prompt,
        &o,
        hooks,
        &mut |_| true,
        &AtomicBool::new(false),
    )
    .unwrap();
    assert_eq!(g.tokens, plain.tokens);
    let h = &g.stats.depth_histogram;
    eprintln!("cost 1 + 0.25·S, MTP mock: depth histogram {h:?}");
    let mid: u64 = h[3..=5].iter().sum();
    assert!(mid * 10 >= h.iter().sum::<u64>() * 7, "{h:?}");
}
