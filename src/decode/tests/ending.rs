//! How generation ends: stop tokens and length inside a burst, the context limit, the
//! cancel flag and the callback; invalid options.

use super::*;

#[test]
fn stop_token_and_length_inside_a_burst_cut_the_burst() {
    let mut t = mock();
    let prompt = [4, 9, 4];
    let plain = gen(
        &mut t,
        &prompt,
        &opts(DraftSource::Off, DraftDepth::Auto, 40),
    );
    let mut reference = prompt.to_vec();
    reference.extend(&plain.tokens);
    // A stop token first seen at output index i ≥ 3, so it falls inside a 4-draft burst.
    let (i, stop) = plain
        .tokens
        .iter()
        .enumerate()
        .skip(3)
        .find(|&(i, t)| !plain.tokens[..i].contains(t))
        .map(|(i, &t)| (i, t))
        .expect("some token first appears after index 3");
    for max_new in [7, 13, 40] {
        let mut o = opts(DraftSource::Auto, DraftDepth::Fixed(4), max_new);
        o.stop_tokens = vec![stop];
        let mut d = ForcedDrafter {
            reference: reference.clone(),
            vocab: 16,
            mode: Forced::AcceptAll,
        };
        let g = run_forced(&mut t, &prompt, &o, &mut d, Acceptance::Exact);
        let end = (i + 1).min(max_new);
        assert_eq!(g.tokens, plain.tokens[..end], "max_new {max_new}");
        let want = if i < max_new {
            FinishReason::Stop
        } else {
            FinishReason::Length
        };
        assert_eq!(g.finish, want, "max_new {max_new}");
    }
}

#[test]
fn context_limit_ends_cleanly_and_a_full_prompt_is_rejected() {
    let mut t = mock();
    let prompt = [1, 5, 1, 5];
    let plain = gen(
        &mut t,
        &prompt,
        &opts(DraftSource::Off, DraftDepth::Auto, 40),
    );
    for source in [DraftSource::Off, DraftSource::Mtp, DraftSource::Ngram] {
        let mut o = opts(source, DraftDepth::Fixed(4), 40);
        o.max_context = Some(prompt.len() + 10);
        let g = gen(&mut t, &prompt, &o);
        assert_eq!(g.tokens, plain.tokens[..10], "{source:?}");
        assert_eq!(g.finish, FinishReason::ContextFull);
    }
    let mut o = opts(DraftSource::Off, DraftDepth::Auto, 5);
    o.max_context = Some(4);
    let e = generate(&mut t, &prompt, &o, &mut |_| true, &AtomicBool::new(false)).unwrap_err();
    assert!(
        matches!(e, Error::InvalidArgument { ref param, .. } if param == "prompt"),
        "{e}"
    );
}

#[test]
fn cancel_flag_stops_between_forwards_and_leaves_kv_consistent() {
    for source in [DraftSource::Off, DraftSource::Mtp, DraftSource::Ngram] {
        let mut t = mock();
        let prompt = [3, 1, 4, 1, 5];
        let cancel = AtomicBool::new(false);
        let mut seen = Vec::new();
        let o = opts(source, DraftDepth::Fixed(3), 100);
        let r = generate(
            &mut t,
            &prompt,
            &o,
            &mut |e: Emitted<'_>| {
                seen.extend_from_slice(e.tokens);
                if seen.len() >= 10 {
                    cancel.store(true, Ordering::Relaxed);
                }
                true
            },
            &cancel,
        );
        assert!(matches!(r, Err(Error::Cancelled)), "{source:?}");
        assert!(seen.len() >= 10 && seen.len() < 100);
        t.check_settled(prompt.len(), seen.len())
            .unwrap_or_else(|e| panic!("{source:?}: {e}"));
    }
    // Raised before the start: no forward at all.
    let mut t = mock();
    let r = generate(
        &mut t,
        &[1, 2],
        &opts(DraftSource::Mtp, DraftDepth::Auto, 5),
        &mut |_| true,
        &AtomicBool::new(true),
    );
    assert!(matches!(r, Err(Error::Cancelled)));
    assert_eq!((t.step_calls, t.kv_len()), (0, 0));
}

#[test]
fn callback_returning_false_finishes_as_cancelled() {
    let mut t = mock();
    let prompt = [7, 7, 2];
    let mut calls = 0;
    let o = opts(DraftSource::Mtp, DraftDepth::Fixed(2), 50);
    let g = generate(
        &mut t,
        &prompt,
        &o,
        &mut |_| {
            calls += 1;
            calls < 3
        },
        &AtomicBool::new(false),
    )
    .unwrap();
    assert_eq!(g.finish, FinishReason::Cancelled);
    settled(&t, &prompt, &g);
}

#[test]
fn bad_options_are_invalid_argument_errors() {
    let mut t = mock();
    let cancel = AtomicBool::new(false);
    let mut check = |o: &GenerateOptions, prompt: &[u32], param: &str| {
        let e = generate(&mut t, prompt, o, &mut |_| true, &cancel).unwrap_err();
        assert!(
            matches!(&e, Error::InvalidArgument { param: p, .. } if p == param),
            "{param}: {e}"
        );
    };
    let base = opts(DraftSource::Auto, DraftDepth::Auto, 5);
    check(&base, &[], "prompt");
    check(&base, &[1, 16], "prompt");
    check(
        &GenerateOptions {
            max_new_tokens: 0,
            ..base.clone()
        },
        &[1],
        "max_new_tokens",
    );
    check(
        &GenerateOptions {
            depth: DraftDepth::Fixed(9),
            ..base.clone()
        },
        &[1],
        "draft_depth",
    );
    check(
        &GenerateOptions {
            depth: DraftDepth::Fixed(0),
            ..base.clone()
        },
        &[1],
        "draft_depth",
    );
    let mut s = base.clone();
    s.sampling.top_p = 0.0;
    check(&s, &[1], "top_p");
    let mut s = base.clone();
    s.sampling.temperature = f32::NAN;
    check(&s, &[1], "temperature");
    let mut no_head = MockTarget::new(MockConfig {
        has_mtp: false,
        ..MockConfig::default()
    });
    let e = generate(
        &mut no_head,
        &[1],
        &opts(DraftSource::Mtp, DraftDepth::Auto, 5),
        &mut |_| true,
        &cancel,
    )
    .unwrap_err();
    assert!(
        e.to_string()
            .contains("'mtp' needs a model with an MTP head"),
        "{e}"
    );
    // Auto falls back to n-gram without a head (no mtp_step call would succeed).
    let g = gen(
        &mut no_head,
        &[1, 2, 1, 2, 1],
        &opts(DraftSource::Auto, DraftDepth::Fixed(3), 20),
    );
    assert_eq!(g.stats.mtp_forwards, 0);
    assert_eq!(DraftSource::parse("ngram").unwrap(), DraftSource::Ngram);
    assert!(DraftSource::parse("medusa").is_err());
    assert_eq!(DraftDepth::parse("auto").unwrap(), DraftDepth::Auto);
    assert_eq!(DraftDepth::parse("3").unwrap(), DraftDepth::Fixed(3));
    assert!(DraftDepth::parse("12").is_err() && DraftDepth::parse("x").is_err());
}

/// `FinishReason::ALL` lists every variant once (the match below has no wildcard, so a new
/// variant fails to compile until it is placed), and their names are distinct.
#[test]
fn finish_reason_all_lists_every_variant() {
    let position = |r: FinishReason| match r {
        FinishReason::Length => 0,
        FinishReason::Stop => 1,
        FinishReason::Cancelled => 2,
        FinishReason::ContextFull => 3,
    };
    let positions: Vec<usize> = FinishReason::ALL.iter().map(|&r| position(r)).collect();
    assert_eq!(positions, (0..FinishReason::ALL.len()).collect::<Vec<_>>());
    let names: std::collections::HashSet<&str> =
        FinishReason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(names.len(), FinishReason::ALL.len());
}
