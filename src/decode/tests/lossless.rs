//! Drafting never changes greedy output: MTP, n-gram and forced drafters, penalties,
//! logprobs, chunked prefill.

use super::*;

#[test]
fn greedy_with_mtp_and_ngram_drafting_is_token_identical_to_plain() {
    let mut t = mock();
    let mut mtp_acc = (0u64, 0u64);
    let mut ngram_accepted = 0;
    for prompt in prompts(16) {
        t.step_calls = 0;
        let plain = gen(
            &mut t,
            &prompt,
            &opts(DraftSource::Off, DraftDepth::Auto, 40),
        );
        assert_eq!(plain.tokens.len(), 40);
        assert_eq!(plain.stats.forwards, 40);
        assert_eq!(plain.stats.proposed, 0);
        let mut depths: Vec<DraftDepth> = (1..=4).map(DraftDepth::Fixed).collect();
        depths.push(DraftDepth::Auto);
        for source in [DraftSource::Mtp, DraftSource::Ngram] {
            for &depth in &depths {
                t.step_calls = 0;
                t.mtp_calls = 0;
                let g = gen(&mut t, &prompt, &opts(source, depth, 40));
                assert_eq!(
                    g.tokens, plain.tokens,
                    "{source:?} {depth:?} prompt {prompt:?}"
                );
                assert_eq!(g.finish, FinishReason::Length);
                if source == DraftSource::Mtp {
                    mtp_acc.0 += g.stats.proposed_per_depth[0];
                    mtp_acc.1 += g.stats.accepted_per_depth[0];
                } else {
                    ngram_accepted += g.stats.accepted;
                }
            }
        }
    }
    // The mock head is right 80% of the time when it gets the true (token, hidden) pairs:
    // a depth-1 acceptance near 0.8 shows the absorb/chain bookkeeping feeds it correctly.
    let a1 = mtp_acc.1 as f64 / mtp_acc.0 as f64;
    assert!((0.7..0.9).contains(&a1), "MTP depth-1 acceptance {a1}");
    assert!(ngram_accepted > 0);
}

#[test]
fn greedy_with_penalties_bias_and_min_tokens_stays_identical_to_plain() {
    let mut t = mock();
    for prompt in prompts(16) {
        let with = |draft, depth| GenerateOptions {
            sampling: penalised(SamplingParams::default()),
            stop_tokens: vec![5],
            ..opts(draft, depth, 30)
        };
        let plain = gen(&mut t, &prompt, &with(DraftSource::Off, DraftDepth::Auto));
        let raw = gen(
            &mut t,
            &prompt,
            &opts(DraftSource::Off, DraftDepth::Auto, 30),
        );
        assert!(
            !plain.tokens[..2].contains(&5),
            "min_tokens: {:?}",
            plain.tokens
        );
        assert_ne!(plain.tokens, raw.tokens, "the penalties changed nothing");
        for (source, depth) in [
            (DraftSource::Mtp, DraftDepth::Fixed(1)),
            (DraftSource::Mtp, DraftDepth::Fixed(4)),
            (DraftSource::Mtp, DraftDepth::Auto),
            (DraftSource::Ngram, DraftDepth::Fixed(3)),
        ] {
            let g = gen(&mut t, &prompt, &with(source, depth));
            assert_eq!(
                g.tokens, plain.tokens,
                "{source:?} {depth:?} prompt {prompt:?}"
            );
        }
    }
}

#[test]
fn logprobs_come_from_the_sampled_distribution_and_do_not_change_the_tokens() {
    let mut t = mock();
    let prompt = [3, 11, 6];
    for temperature in [0.0f32, 0.8] {
        let base = GenerateOptions {
            sampling: SamplingParams {
                temperature,
                top_k: 6,
                seed: Some(4),
                ..penalised(SamplingParams::default())
            },
            stop_tokens: vec![5],
            ..opts(DraftSource::Mtp, DraftDepth::Fixed(3), 12)
        };
        let scored = GenerateOptions {
            logprobs: Some(3),
            ..base.clone()
        };
        let a = gen(&mut t, &prompt, &base);
        let b = gen(&mut t, &prompt, &scored);
        assert_eq!(a.tokens, b.tokens);
        assert!(a.logprobs.is_empty());
        assert_eq!(b.logprobs.len(), b.tokens.len());
        // Recompute each token's row without speculation and compare.
        let mut ctx = prompt.to_vec();
        let mut history = History::new(&prompt, &base.sampling, &base.stop_tokens);
        for (lp, &tok) in b.logprobs.iter().zip(&b.tokens) {
            let n = ctx.len();
            let row = history.process(t.logits(Some(ctx[n - 2]), ctx[n - 1]), &base.sampling, &[]);
            let want = token_logprob(&row, &base.sampling, tok, 3).unwrap();
            assert_eq!(lp, &want);
            assert_eq!(lp.token, tok);
            assert_eq!(lp.top.len(), 3);
            assert!(lp.top.windows(2).all(|w| w[0].1 >= w[1].1));
            if temperature == 0.0 {
                assert_eq!(lp.top[0].0, tok, "greedy picks the most likely token");
            }
            ctx.push(tok);
            history.push(tok, &base.sampling);
        }
    }
}

#[test]
fn each_burst_carries_the_logprobs_of_its_own_tokens() {
    // What a stream sends with each chunk: bursts of several tokens (MTP drafts accepted),
    // each with one row per token, which together are the generation's logprobs.
    let mut t = mock();
    let prompt = [3, 11, 6];
    let o = GenerateOptions {
        logprobs: Some(2),
        ..opts(DraftSource::Mtp, DraftDepth::Fixed(3), 40)
    };
    let mut bursts: Vec<(Vec<u32>, Vec<TokenLogprob>)> = Vec::new();
    let g = generate(
        &mut t,
        &prompt,
        &o,
        &mut |e: Emitted<'_>| {
            bursts.push((e.tokens.to_vec(), e.logprobs.to_vec()));
            true
        },
        &AtomicBool::new(false),
    )
    .unwrap();
    assert!(
        bursts.iter().any(|(t, _)| t.len() > 1),
        "some burst has drafts"
    );
    for (tokens, scored) in &bursts {
        let ids: Vec<u32> = scored.iter().map(|lp| lp.token).collect();
        assert_eq!(&ids, tokens);
    }
    let streamed: Vec<TokenLogprob> = bursts.into_iter().flat_map(|(_, s)| s).collect();
    assert_eq!(streamed, g.logprobs);
    // Without logprobs a burst carries none.
    let plain = opts(DraftSource::Mtp, DraftDepth::Fixed(3), 10);
    let mut any = false;
    generate(
        &mut t,
        &prompt,
        &plain,
        &mut |e: Emitted<'_>| {
            any |= !e.logprobs.is_empty();
            true
        },
        &AtomicBool::new(false),
    )
    .unwrap();
    assert!(!any);
}

#[test]
fn mtp_drafting_at_depth_4_emits_more_than_two_tokens_per_forward() {
    let mut t = mock();
    let prompt = [1, 2, 3];
    let g = gen(
        &mut t,
        &prompt,
        &opts(DraftSource::Mtp, DraftDepth::Fixed(4), 200),
    );
    // Per-depth acceptance 0.8: E = 1 + 0.8 + 0.64 + 0.51 + 0.41 = 3.36 tokens per forward.
    assert!(g.stats.tokens_per_forward > 2.5, "{:?}", g.stats);
    assert!(g.stats.depth_histogram[4] > 0);
    assert!(g.stats.mtp_forwards > 0);
}

#[test]
fn forced_drafters_are_lossless() {
    let mut t = mock();
    let v = 16;
    for (i, prompt) in prompts(v).into_iter().enumerate() {
        let plain = gen(
            &mut t,
            &prompt,
            &opts(DraftSource::Off, DraftDepth::Auto, 30),
        );
        let mut reference = prompt.clone();
        reference.extend(&plain.tokens);
        for depth in 1..=4 {
            let mut modes = vec![
                Forced::AcceptAll,
                Forced::RejectAll,
                Forced::Random(Rng::from_seed(i as u64)),
            ];
            modes.extend((0..depth).map(Forced::WrongAt));
            for mode in modes {
                let label = match &mode {
                    Forced::AcceptAll => format!("accept-all G={depth}"),
                    Forced::RejectAll => format!("reject-all G={depth}"),
                    Forced::WrongAt(k) => format!("wrong-at-{k} G={depth}"),
                    Forced::Random(_) => format!("random G={depth}"),
                };
                let mut d = ForcedDrafter {
                    reference: reference.clone(),
                    vocab: v,
                    mode,
                };
                let o = opts(DraftSource::Auto, DraftDepth::Fixed(depth), 30);
                let g = run_forced(&mut t, &prompt, &o, &mut d, Acceptance::Exact);
                assert_eq!(g.tokens, plain.tokens, "{label} on prompt {prompt:?}");
                let s = &g.stats;
                match d.mode {
                    Forced::AcceptAll => {
                        assert_eq!(s.accepted, s.proposed, "{label}");
                        // 29 tokens after the first, G + 1 per forward; the depth is capped so
                        // that the last cycle emits exactly what is left.
                        assert_eq!(
                            s.decode_forwards as usize,
                            29usize.div_ceil(depth + 1),
                            "{label}"
                        );
                    }
                    Forced::RejectAll => {
                        assert_eq!(s.accepted, 0, "{label}");
                        assert_eq!(s.decode_forwards, 29, "{label}");
                    }
                    Forced::WrongAt(k) => {
                        assert_eq!(s.accepted_per_depth[k], 0, "{label}");
                        for j in 0..k {
                            assert_eq!(s.accepted_per_depth[j], s.proposed_per_depth[j], "{label}");
                        }
                    }
                    Forced::Random(_) => {}
                }
            }
        }
    }
}

#[test]
fn chunked_prefill_and_absorb_match_one_shot() {
    let mut t = mock();
    let prompt: Vec<u32> = (0..37).map(|i| (i * 7 % 16) as u32).collect();
    let whole = gen(
        &mut t,
        &prompt,
        &opts(DraftSource::Mtp, DraftDepth::Fixed(3), 30),
    );
    let mut o = opts(DraftSource::Mtp, DraftDepth::Fixed(3), 30);
    o.prefill_chunk = 8;
    t.step_calls = 0;
    t.mtp_calls = 0;
    let chunked = gen(&mut t, &prompt, &o);
    assert_eq!(chunked.tokens, whole.tokens);
    assert_eq!(chunked.stats.accepted, whole.stats.accepted);
    assert_eq!(chunked.stats.forwards, whole.stats.forwards + 4);
}
