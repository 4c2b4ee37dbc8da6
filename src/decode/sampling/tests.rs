use super::*;
use crate::Error;

fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
    SamplingParams {
        temperature,
        top_k,
        top_p,
        seed: Some(0),
        ..SamplingParams::default()
    }
}

fn close(a: &[f64], b: &[f64]) -> bool {
    a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
}

#[test]
fn min_p_keeps_tokens_at_least_that_share_of_the_top_one() {
    // Weights relative to the top: 1, e^-1 = 0.37, e^-2 = 0.14, e^-3 = 0.05.
    let logits = [3.0f32, 2.0, 1.0, 0.0];
    let sp = SamplingParams {
        min_p: 0.2,
        ..params(1.0, 0, 1.0)
    };
    let got = processed_distribution(&logits, &sp).unwrap();
    let (a, b) = (1.0f64, (-1.0f64).exp());
    assert!(
        close(&got, &[a / (a + b), b / (a + b), 0.0, 0.0]),
        "{got:?}"
    );
    let bad = SamplingParams {
        min_p: 1.5,
        ..params(1.0, 0, 1.0)
    };
    assert!(bad.validate().unwrap_err().to_string().contains("'min_p'"));
}

#[test]
fn history_applies_bias_penalties_and_min_tokens_with_the_drafts_before_a_row() {
    let sp = SamplingParams {
        repetition_penalty: 2.0,
        presence_penalty: 0.5,
        frequency_penalty: 0.25,
        logit_bias: vec![(0, 1.0)],
        min_tokens: 2,
        ..params(1.0, 0, 1.0)
    };
    let row = [1.0f32, 2.0, -2.0, 4.0, 0.5];
    let mut h = History::new(&[1, 2], &sp, &[4]);
    // Prompt tokens 1 and 2: repetition only (2/2, -2*2); stop token 4 masked.
    let x = h.process(&row, &sp, &[]);
    assert_eq!(&x[..], &[2.0, 1.0, -4.0, 4.0, f32::NEG_INFINITY]);
    h.push(3, &sp);
    // Output holds 3 once; the drafts add 3 again and 0: repetition once per token,
    // frequency per occurrence; two tokens before the row lift the min_tokens mask.
    let x = h.process(&row, &sp, &[3, 0]);
    let t3 = 4.0 / 2.0 - 0.5 - 0.25 * 2.0;
    let t0 = (1.0 + 1.0) / 2.0 - 0.5 - 0.25;
    assert_eq!(&x[..], &[t0, 1.0, -4.0, t3, 0.5]);
    // Nothing to do: the row itself.
    let plain = params(1.0, 0, 1.0);
    assert!(matches!(
        History::new(&[1], &plain, &[4]).process(&row, &plain, &[1]),
        std::borrow::Cow::Borrowed(_)
    ));
    assert!(sp.validate_tokens(4).is_ok() && sp.validate_tokens(0).is_err());
}

#[test]
fn logprobs_are_the_sampled_law_or_the_unit_temperature_softmax_when_greedy() {
    let logits = [0.0f32, 1.0, 2.0];
    let z: f64 = [0.0f64, 1.0, 2.0].iter().map(|x| x.exp()).sum();
    let g = token_logprob(&logits, &params(0.0, 0, 1.0), 2, 2).unwrap();
    assert!((f64::from(g.logprob) - (2.0 - z.ln())).abs() < 1e-6);
    assert_eq!(g.top.iter().map(|t| t.0).collect::<Vec<_>>(), [2, 1]);
    // Sampling with top-k 2 cuts token 0: its logprob is -inf.
    let s = token_logprob(&logits, &params(1.0, 2, 1.0), 0, 3).unwrap();
    assert_eq!(s.logprob, f32::NEG_INFINITY);
    assert_eq!(s.top[2], (0, f32::NEG_INFINITY));
}

#[test]
fn validation_rejects_bad_values_with_named_parameter() {
    for t in [-0.5, f32::NAN, f32::INFINITY] {
        let e = params(t, 0, 1.0).validate().unwrap_err().to_string();
        assert!(e.contains("'temperature'"), "{e}");
    }
    for p in [0.0, -0.1, 1.5, f32::NAN] {
        let e = params(1.0, 0, p).validate().unwrap_err().to_string();
        assert!(e.contains("'top_p'"), "{e}");
    }
    assert!(params(0.0, 0, 1.0).validate().is_ok());
    assert!(params(0.7, 40, 0.95).validate().is_ok());
}

#[test]
fn argmax_breaks_ties_by_lowest_id_and_rejects_nan() {
    assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]).unwrap(), 1);
    assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]).unwrap(), 0);
    assert!(matches!(
        argmax(&[1.0, f32::NAN]),
        Err(Error::NonFiniteOutput(m)) if m.contains("NaN logit (token id 1)")
    ));
    assert!(argmax(&[]).is_err());
}

#[test]
fn temperature_one_is_softmax() {
    let logits = [0.0f32, 1.0, 2.0];
    let e: Vec<f64> = [0.0f64, 1.0, 2.0].iter().map(|x| x.exp()).collect();
    let s: f64 = e.iter().sum();
    let want: Vec<f64> = e.iter().map(|x| x / s).collect();
    let got = processed_distribution(&logits, &params(1.0, 0, 1.0)).unwrap();
    assert!(close(&got, &want), "{got:?}");
    // Temperature 2 halves the logits.
    let e2: Vec<f64> = [0.0f64, 0.5, 1.0].iter().map(|x| x.exp()).collect();
    let s2: f64 = e2.iter().sum();
    let want2: Vec<f64> = e2.iter().map(|x| x / s2).collect();
    let got2 = processed_distribution(&logits, &params(2.0, 0, 1.0)).unwrap();
    assert!(close(&got2, &want2), "{got2:?}");
}

#[test]
fn top_k_keeps_k_largest_with_lowest_id_on_ties() {
    // ids 1 and 2 tie for second place: top-2 keeps 3 (the largest) and 1 (the lower id).
    let logits = [0.0f32, 1.0, 1.0, 2.0];
    let got = processed_distribution(&logits, &params(1.0, 2, 1.0)).unwrap();
    let (a, b) = (2.0f64.exp(), 1.0f64.exp());
    assert!(
        close(&got, &[0.0, b / (a + b), 0.0, a / (a + b)]),
        "{got:?}"
    );
}

#[test]
fn top_p_keeps_smallest_prefix_reaching_the_mass() {
    // Probabilities 0.5, 0.3, 0.2 (by construction through log-probs).
    let logits = [0.5f64.ln() as f32, 0.3f64.ln() as f32, 0.2f64.ln() as f32];
    let got = processed_distribution(&logits, &params(1.0, 0, 0.75)).unwrap();
    assert!((got[0] - 0.5 / 0.8).abs() < 1e-6 && (got[1] - 0.3 / 0.8).abs() < 1e-6);
    assert_eq!(got[2], 0.0);
    // top_p below the largest probability keeps just the argmax.
    let got = processed_distribution(&logits, &params(1.0, 0, 0.1)).unwrap();
    assert_eq!(got, vec![1.0, 0.0, 0.0]);
}

#[test]
fn top_p_ties_cut_the_higher_id() {
    let logits = [0.0f32; 4];
    let got = processed_distribution(&logits, &params(1.0, 0, 0.5)).unwrap();
    assert_eq!(got, vec![0.5, 0.5, 0.0, 0.0]);
}

#[test]
fn top_k_then_top_p_compose() {
    // Uniform over 6; top-k 4 → 0.25 each; top-p 0.6 keeps 3 of them (0.75 ≥ 0.6).
    let logits = [0.0f32; 6];
    let got = processed_distribution(&logits, &params(1.0, 4, 0.6)).unwrap();
    let third = 1.0 / 3.0;
    assert!(
        close(&got, &[third, third, third, 0.0, 0.0, 0.0]),
        "{got:?}"
    );
}

#[test]
fn greedy_distribution_is_a_point_mass() {
    let got = processed_distribution(&[0.1, 0.9, 0.9], &params(0.0, 0, 1.0)).unwrap();
    assert_eq!(got, vec![0.0, 1.0, 0.0]);
}

#[test]
fn neg_inf_logits_get_zero_mass_and_bad_rows_error() {
    let got = processed_distribution(&[f32::NEG_INFINITY, 0.0], &params(1.0, 0, 1.0)).unwrap();
    assert_eq!(got, vec![0.0, 1.0]);
    assert!(processed_distribution(&[f32::NEG_INFINITY; 3], &params(1.0, 0, 1.0)).is_err());
    assert!(processed_distribution(&[0.0, f32::NAN], &params(1.0, 0, 1.0)).is_err());
    assert!(processed_distribution(&[0.0, f32::INFINITY], &params(1.0, 0, 1.0)).is_err());
}

/// An overflowing forward is the weights' fault, never a silent pick or an
/// internal error: +Inf under greedy, and all -Inf under sampling, are NonFiniteOutput.
#[test]
fn infinite_logits_are_non_finite_output_errors() {
    assert!(matches!(
        argmax(&[0.0, f32::INFINITY, 1.0]),
        Err(Error::NonFiniteOutput(m)) if m.contains("infinite logit (token id 1)")
    ));
    assert_eq!(argmax(&[f32::NEG_INFINITY, 0.5]).ok(), Some(1));
    assert!(matches!(
        processed_distribution(&[f32::NEG_INFINITY; 3], &params(1.0, 0, 1.0)),
        Err(Error::NonFiniteOutput(_))
    ));
}

/// The textbook version: sort everything, cut, renormalise.
fn reference(logits: &[f32], t: f64, top_k: usize, top_p: f64) -> Vec<f64> {
    let mut ids: Vec<usize> = (0..logits.len()).collect();
    ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    if top_k > 0 {
        ids.truncate(top_k);
    }
    let max = f64::from(logits[ids[0]]);
    let w: Vec<f64> = ids
        .iter()
        .map(|&i| ((f64::from(logits[i]) - max) / t).exp())
        .collect();
    let total: f64 = w.iter().sum();
    let mut keep = ids.len();
    let mut cum = 0.0;
    for (j, x) in w.iter().enumerate() {
        cum += x;
        if cum >= top_p * total {
            keep = j + 1;
            break;
        }
    }
    let kept: f64 = w[..keep].iter().sum();
    let mut p = vec![0.0; logits.len()];
    for (&i, &x) in ids[..keep].iter().zip(&w) {
        p[i] = x / kept;
    }
    p
}

#[test]
fn matches_the_full_sort_reference_on_large_vocabularies() {
    let mut rng = crate::decode::rng::Rng::from_seed(5);
    for case in 0..24 {
        let v = [50, 1000, 5000][case % 3];
        let spread = [0.5, 4.0, 12.0][(case / 3) % 3];
        // Quantised logits so ties occur.
        let logits: Vec<f32> = (0..v)
            .map(|_| ((rng.next_f64() * spread * 8.0).round() / 8.0) as f32)
            .collect();
        let t = [0.7f32, 1.0, 1.5][case % 3];
        let top_k = [0, 0, 40, 300][case % 4];
        let top_p = [0.5f32, 0.9, 0.99, 1.0][(case / 4) % 4];
        let got = processed_distribution(&logits, &params(t, top_k, top_p)).unwrap();
        let want = reference(&logits, f64::from(t), top_k, f64::from(top_p));
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!((g - w).abs() < 1e-9, "case {case} id {i}: {g} vs {w}");
            assert_eq!(*g == 0.0, *w == 0.0, "case {case} id {i}: support differs");
        }
    }
}

#[test]
fn sample_is_inverse_cdf_in_id_order() {
    let p = [0.25, 0.0, 0.5, 0.25];
    assert_eq!(sample(&p, 0.0).unwrap(), 0);
    assert_eq!(sample(&p, 0.2499).unwrap(), 0);
    assert_eq!(sample(&p, 0.25).unwrap(), 2);
    assert_eq!(sample(&p, 0.7499).unwrap(), 2);
    assert_eq!(sample(&p, 0.75).unwrap(), 3);
    assert_eq!(sample(&p, 0.999_999_999).unwrap(), 3);
    assert!(sample(&[0.0, 0.0], 0.5).is_err());
}
