//! Sampling: the emitted distribution equals plain sampling.

use super::*;

const N: usize = 20_000;
/// TV bound for one position's marginal over K = 16 outcomes from N samples:
/// E[TV] ≤ ½ Σ √(p(1−p)/N) ≤ ½ √(K/N) = 0.0141, and TV moves by at most 1/N per sample, so
/// by McDiarmid P(TV ≥ E[TV] + t) ≤ exp(−2Nt²) = 1e-6 for t = √(ln 1e6 / 2N) = 0.0186.
const TV_BOUND: f64 = 0.033;

fn sampling_opts(
    draft: DraftSource,
    depth: DraftDepth,
    top_k: usize,
    top_p: f32,
    penalties: bool,
) -> GenerateOptions {
    let sp = SamplingParams {
        temperature: 1.0,
        top_k,
        top_p,
        seed: None,
        ..SamplingParams::default()
    };
    GenerateOptions {
        max_new_tokens: 3,
        sampling: if penalties { penalised(sp) } else { sp },
        stop_tokens: if penalties { vec![5] } else { Vec::new() },
        draft,
        depth,
        guard: no_guard(),
        ..GenerateOptions::default()
    }
}

/// Exact marginals of plain sampling at output positions 1..=3 by enumeration, each row
/// processed with the history of the tokens before it.
fn exact_marginals(t: &MockTarget, prompt: &[u32], o: &GenerateOptions) -> [Vec<f64>; 3] {
    let (v, sp) = (t.cfg.vocab, &o.sampling);
    let n = prompt.len();
    let history = History::new(prompt, sp, &o.stop_tokens);
    let dist = |prev: Option<u32>, cur: u32, extra: &[u32]| {
        processed_distribution(&history.process(t.logits(prev, cur), sp, extra), sp).unwrap()
    };
    let prev0 = if n >= 2 { Some(prompt[n - 2]) } else { None };
    let p1 = dist(prev0, prompt[n - 1], &[]);
    let mut m2 = vec![0.0; v];
    let mut m3 = vec![0.0; v];
    for a in 0..v as u32 {
        if p1[a as usize] == 0.0 {
            continue;
        }
        let p2 = dist(Some(prompt[n - 1]), a, &[a]);
        for b in 0..v as u32 {
            let pab = p1[a as usize] * p2[b as usize];
            m2[b as usize] += pab;
            if pab == 0.0 {
                continue;
            }
            let p3 = dist(Some(a), b, &[a, b]);
            for c in 0..v {
                m3[c] += pab * p3[c];
            }
        }
    }
    [p1, m2, m3]
}

/// Empirical marginals of N seeded generations (seeds 0..N) through `run`.
fn empirical(
    t: &mut MockTarget,
    prompt: &[u32],
    o: &GenerateOptions,
    forced_mtp: Option<Acceptance>,
) -> [Vec<f64>; 3] {
    let v = t.cfg.vocab;
    let mut counts = [vec![0usize; v], vec![0usize; v], vec![0usize; v]];
    let cancel = AtomicBool::new(false);
    for seed in 0..N as u64 {
        let mut o = o.clone();
        o.sampling.seed = Some(seed);
        let g = match forced_mtp {
            None => generate(t, prompt, &o, &mut |_| true, &cancel),
            Some(acc) => {
                let mut d = MtpDrafter::new(t, 0);
                let clock = t.clock();
                let hooks = Hooks {
                    drafter: Some(&mut d),
                    acceptance: acc,
                    clock: &clock,
                };
                run(t, prompt, &o, hooks, &mut |_| true, &cancel)
            }
        }
        .unwrap();
        // The negative control may accept a masked stop token and end early.
        if forced_mtp != Some(Acceptance::AcceptAll) {
            assert_eq!(g.tokens.len(), 3);
        }
        for (pos, &tok) in g.tokens.iter().enumerate() {
            counts[pos][tok as usize] += 1;
        }
    }
    counts.map(|c| c.into_iter().map(|x| x as f64 / N as f64).collect())
}

fn tv(p: &[f64], q: &[f64]) -> f64 {
    0.5 * p.iter().zip(q).map(|(a, b)| (a - b).abs()).sum::<f64>()
}

#[test]
fn sampled_output_distribution_matches_plain_sampling_and_the_negative_control_fails() {
    // MTP head right 70% of the time; temperature 1 over V = 16.
    let mut t = MockTarget::new(MockConfig {
        mtp_error: 0.3,
        ..MockConfig::default()
    });
    let prompt = [3, 11, 6];
    for (top_k, top_p, pen) in [(0, 1.0, false), (6, 0.9, false), (0, 1.0, true)] {
        let base = sampling_opts(DraftSource::Off, DraftDepth::Auto, top_k, top_p, pen);
        let exact = exact_marginals(&t, &prompt, &base);
        if pen {
            // The processing is really on: the stop token is masked at position 1, the
            // prompt's tokens are penalised, and the marginal differs from the raw one.
            let raw = exact_marginals(
                &t,
                &prompt,
                &sampling_opts(DraftSource::Off, DraftDepth::Auto, 0, 1.0, false),
            );
            assert_eq!(exact[0][5], 0.0);
            let moved = (0..3).map(|p| tv(&exact[p], &raw[p])).fold(0.0, f64::max);
            assert!(moved > 0.05, "penalties changed little: TV {moved}");
            // Plain sampling through run() matches the enumeration with the history.
            let plain = empirical(&mut t, &prompt, &base, None);
            for pos in 0..3 {
                let d = tv(&plain[pos], &exact[pos]);
                assert!(
                    d <= TV_BOUND,
                    "plain with penalties, position {}: TV {d}",
                    pos + 1
                );
            }
        }
        for depth in [2, 3] {
            let o = sampling_opts(
                DraftSource::Mtp,
                DraftDepth::Fixed(depth),
                top_k,
                top_p,
                pen,
            );
            let emp = empirical(&mut t, &prompt, &o, None);
            for pos in 0..3 {
                let d = tv(&emp[pos], &exact[pos]);
                eprintln!(
                    "top_k {top_k} top_p {top_p} G {depth} position {}: TV {d:.4}",
                    pos + 1
                );
                assert!(
                    d <= TV_BOUND,
                    "top_k {top_k} top_p {top_p} G {depth} position {}: TV {d}",
                    pos + 1
                );
            }
        }
        // Negative control: accepting every draft skews positions 2 and 3 towards the head's picks.
        let o = sampling_opts(DraftSource::Mtp, DraftDepth::Fixed(2), top_k, top_p, pen);
        let emp = empirical(&mut t, &prompt, &o, Some(Acceptance::AcceptAll));
        let worst = (0..3)
            .map(|pos| tv(&emp[pos], &exact[pos]))
            .fold(0.0, f64::max);
        eprintln!("top_k {top_k} top_p {top_p} negative control: worst TV {worst:.4}");
        assert!(
            worst > TV_BOUND,
            "negative control passed the bound: TV {worst}"
        );
        // The same run with the exact rule passes, so the failure is the rule's.
        let emp = empirical(&mut t, &prompt, &o, Some(Acceptance::Exact));
        let worst = (0..3)
            .map(|pos| tv(&emp[pos], &exact[pos]))
            .fold(0.0, f64::max);
        assert!(worst <= TV_BOUND, "exact rule through run(): TV {worst}");
    }
}

#[test]
fn fixed_seed_reproduces_and_equals_plain_sampling_per_seed() {
    let mut t = MockTarget::new(MockConfig {
        mtp_error: 0.3,
        logit_scale: 2.0,
        ..MockConfig::default()
    });
    let prompt = [9, 9, 1, 0];
    let sp = |seed| SamplingParams {
        temperature: 0.8,
        top_k: 10,
        top_p: 0.95,
        seed: Some(seed),
        ..SamplingParams::default()
    };
    let with = |draft, depth, seed| GenerateOptions {
        max_new_tokens: 40,
        sampling: sp(seed),
        draft,
        depth,
        ..GenerateOptions::default()
    };
    let a = gen(
        &mut t,
        &prompt,
        &with(DraftSource::Mtp, DraftDepth::Fixed(3), 42),
    );
    let b = gen(
        &mut t,
        &prompt,
        &with(DraftSource::Mtp, DraftDepth::Fixed(3), 42),
    );
    let c = gen(
        &mut t,
        &prompt,
        &with(DraftSource::Mtp, DraftDepth::Fixed(3), 43),
    );
    assert_eq!(a.tokens, b.tokens);
    assert_ne!(a.tokens, c.tokens);
    // One uniform per emitted token, in order: any drafter gives plain sampling's tokens.
    for seed in 0..50 {
        let plain = gen(
            &mut t,
            &prompt,
            &with(DraftSource::Off, DraftDepth::Auto, seed),
        );
        for (draft, depth) in [
            (DraftSource::Mtp, DraftDepth::Fixed(1)),
            (DraftSource::Mtp, DraftDepth::Fixed(4)),
            (DraftSource::Mtp, DraftDepth::Auto),
            (DraftSource::Ngram, DraftDepth::Fixed(3)),
        ] {
            let g = gen(&mut t, &prompt, &with(draft, depth, seed));
            assert_eq!(g.tokens, plain.tokens, "seed {seed} {draft:?} {depth:?}");
        }
    }
}
