//! Batches: each lane gets what it gets alone, prefilled together or not.

use super::*;

#[test]
fn a_batch_gives_each_session_what_it_gets_alone() {
    for (rel, vocab) in [
        ("python/colibri/models/tiny", 4096u32),
        ("tests/fixtures/glm_dsa", 256),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let e = open(rel, tmp.path(), None);
        let prompts: Vec<Vec<u32>> = vec![
            PROMPT.iter().map(|t| t % vocab).collect(),
            vec![5, 17, 99 % vocab, 3],
            (0..23).map(|i| (i * 37 + 11) % vocab).collect(),
        ];
        let mut sampled = options(&e, true);
        sampled.logprobs = Some(3);
        let mut penalised = options(&e, false);
        penalised.sampling.repetition_penalty = 1.4;
        penalised.sampling.presence_penalty = 0.3;
        penalised.max_new_tokens = 7;
        // Each lane drafts its own way inside the batch: MTP (greedy and sampled) and
        // prompt lookup.
        penalised.draft = DraftSource::Ngram;
        let mut greedy = options(&e, false);
        greedy.depth = DraftDepth::Fixed(2);
        let opts = [greedy, sampled, penalised];
        let sessions: Vec<_> = (0..3).map(|_| e.new_session().unwrap()).collect();
        for turn in 0..2 {
            let prompts_now: Vec<Vec<u32>> = prompts
                .iter()
                .zip(&sessions)
                .map(|(p, s)| {
                    let mut held = s.tokens().unwrap();
                    if turn == 0 {
                        p.clone()
                    } else {
                        held.extend([1, 2, 3]);
                        held
                    }
                })
                .collect();
            let requests: Vec<BatchRequest> = sessions
                .iter()
                .zip(&prompts_now)
                .zip(&opts)
                .map(|((s, p), o)| BatchRequest {
                    session: s.clone(),
                    prompt: p.clone(),
                    options: o.clone(),
                })
                .collect();
            let mut streamed = vec![Vec::new(); 3];
            let out = e
                .generate_batch(
                    requests,
                    &mut |i, t| {
                        streamed[i].extend_from_slice(t.tokens);
                        true
                    },
                    &AtomicBool::new(false),
                )
                .unwrap();
            let alone_engine = open(rel, tmp.path(), None);
            for (i, r) in out.into_iter().enumerate() {
                let got = r.unwrap();
                // Alone with the same drafting, and alone without any: the same tokens.
                for draft in [opts[i].draft, DraftSource::Off] {
                    let mut o = opts[i].clone();
                    o.draft = draft;
                    let alone = alone_engine
                        .generate(
                            Some(&alone_engine.new_session().unwrap()),
                            &prompts_now[i],
                            &o,
                            &mut |_| true,
                            &AtomicBool::new(false),
                        )
                        .unwrap();
                    assert_eq!(
                        got.tokens, alone.tokens,
                        "{rel} turn {turn} request {i} vs alone with {draft:?}"
                    );
                    assert_eq!(
                        got.logprobs, alone.logprobs,
                        "{rel} turn {turn} request {i}"
                    );
                }
                if i == 0 {
                    assert!(
                        got.stats.mtp_forwards > 0,
                        "request {i} drafted in the batch"
                    );
                    assert!(
                        got.stats.drafts_proposed.iter().sum::<u64>() > 0,
                        "request {i} verified drafts in the batch"
                    );
                }
                assert_eq!(streamed[i], got.tokens);
                assert_eq!(
                    sessions[i].kv_tokens().unwrap(),
                    prompts_now[i].len() + got.tokens.len() - 1
                );
                if turn == 1 {
                    assert!(got.stats.prompt_cached_tokens > 0, "turn 2 reuses turn 1");
                }
            }
        }
    }
}

/// Prompts that arrive together are prefilled in one forward, the long ones in the int8
/// prefill arithmetic: each lane still gets exactly what it gets alone on an engine with the
/// same arithmetic (int8 rounds each row's activations by its own scales, so rows of other
/// prompts in the forward change nothing), and a short prompt beside them stays exact.
#[test]
fn prompts_prefilled_together_in_int8_give_what_each_gets_alone() {
    use crate::quant::kernels::int8act::PREFILL_MIN_ROWS;
    let tmp = tempfile::tempdir().unwrap();
    let open_int8 = || {
        let opts = EngineOptions {
            usage_file: false,
            threads: 2,
            spill_dir: Some(tmp.path().to_path_buf()),
            prefill: Some(Arithmetic::Int8),
            decode: Some(Arithmetic::Exact),
            ..EngineOptions::default()
        };
        Engine::open(&model_dir("python/colibri/models/tiny"), &opts).expect("the model opens")
    };
    let e = open_int8();
    let prompts: Vec<Vec<u32>> = [40usize, 64, PREFILL_MIN_ROWS, 100, 5]
        .iter()
        .enumerate()
        .map(|(k, &n)| {
            (0..n as u32)
                .map(|i| (i * 53 + 7 * k as u32 + 1) % 4096)
                .collect()
        })
        .collect();
    let opts: Vec<GenerateOptions> = (0..prompts.len())
        .map(|k| GenerateOptions {
            logprobs: Some(2),
            ..options(&e, k % 2 == 1)
        })
        .collect();
    let requests: Vec<BatchRequest> = prompts
        .iter()
        .zip(&opts)
        .map(|(p, o)| BatchRequest {
            session: e.new_session().unwrap(),
            prompt: p.clone(),
            options: o.clone(),
        })
        .collect();
    let out = e
        .generate_batch(requests, &mut |_, _| true, &AtomicBool::new(false))
        .unwrap();
    let alone = open_int8();
    let exact = open_in(
        "python/colibri/models/tiny",
        &tmp.path().join("exact"),
        None,
        Arithmetic::Exact,
    );
    let mut differs_from_exact = 0;
    for (k, r) in out.into_iter().enumerate() {
        let got = r.unwrap();
        let want = alone
            .generate(
                Some(&alone.new_session().unwrap()),
                &prompts[k],
                &opts[k],
                &mut |_| true,
                &AtomicBool::new(false),
            )
            .unwrap();
        assert_eq!(
            got.tokens,
            want.tokens,
            "prompt {k} of {} tokens",
            prompts[k].len()
        );
        assert_eq!(got.tokens.len(), 12);
        assert_eq!(
            logprob_bits(&got.logprobs),
            logprob_bits(&want.logprobs),
            "prompt {k}: the batch's logprobs are bit for bit the lone run's"
        );
        let reference = exact
            .generate(
                Some(&exact.new_session().unwrap()),
                &prompts[k],
                &opts[k],
                &mut |_| true,
                &AtomicBool::new(false),
            )
            .unwrap();
        let same_as_exact = reference.tokens == got.tokens
            && logprob_bits(&reference.logprobs) == logprob_bits(&got.logprobs);
        if prompts[k].len() < PREFILL_MIN_ROWS {
            assert!(same_as_exact, "prompt {k} is short: exact prefill");
        } else if !same_as_exact {
            differs_from_exact += 1;
        }
    }
    // The negative control: the int8 arithmetic did run on the long prompts (otherwise the
    // comparison with the lone int8 engine would show nothing).
    assert!(
        differs_from_exact >= 1,
        "a long prompt's int8 prefill differs from the exact one somewhere"
    );
}

/// Every token id and logprob bit of `l`, flattened, so that two runs compare bit for bit.
fn logprob_bits(l: &[crate::decode::TokenLogprob]) -> Vec<u32> {
    let mut bits = Vec::new();
    for t in l {
        bits.extend([t.token, t.logprob.to_bits()]);
        for &(id, p) in &t.top {
            bits.extend([id, p.to_bits()]);
        }
    }
    bits
}

#[test]
fn a_batch_refuses_a_session_twice() {
    let tmp = tempfile::tempdir().unwrap();
    let e = open("python/colibri/models/tiny", tmp.path(), None);
    let s = e.new_session().unwrap();
    let r = |s: &Arc<Session>| BatchRequest {
        session: s.clone(),
        prompt: PROMPT.to_vec(),
        options: options(&e, false),
    };
    let err = e
        .generate_batch(
            vec![r(&s), r(&s)],
            &mut |_, _| true,
            &AtomicBool::new(false),
        )
        .err()
        .unwrap();
    assert!(err.to_string().contains("each session once"), "{err}");
}
