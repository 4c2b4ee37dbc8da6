//! The router's top-k and its weights with fewer experts per token (the `experts_per_token`
//! option), against hand computations, and the option on the trained embedded model.

use std::path::Path;
use std::sync::{Arc, Mutex};

use super::*;
use crate::model::{ForwardKind, Model, ModelOptions, RoutedRows, RoutingSink, Sequence};
use crate::quant::QuantFormat;

/// A router over 8 experts in 4 groups of 2 (2 groups kept), `routed_scaling_factor` 2.5,
/// whose weight is the identity: the row given to `route` is the logits.
fn router(top_k: usize, norm_topk_prob: bool, bias: Vec<f32>) -> Router {
    let e = bias.len();
    let mut bytes = Vec::with_capacity(e * e * 4);
    for r in 0..e {
        for c in 0..e {
            bytes.extend_from_slice(&f32::from(u8::from(r == c)).to_le_bytes());
        }
    }
    Router {
        weight: Weight::from_owned(QuantFormat::F32, e, e, bytes, Vec::new()).unwrap(),
        e_score_correction_bias: bias,
        top_k,
        n_group: 4,
        topk_group: 2,
        norm_topk_prob,
        routed_scaling_factor: 2.5,
    }
}

/// Logits whose sigmoid scores are `p`: ln(p / (1 − p)).
fn logits(p: &[f32]) -> Vec<f32> {
    p.iter().map(|&p| (p / (1.0 - p)).ln()).collect()
}

/// Scores 0.9 0.2 | 0.3 0.4 | 0.8 0.7 | 0.6 0.5 in groups of two; a bias of 0.45 on expert 3
/// makes its choice score 0.85. Group scores (sum of the best two choices): 1.1, 1.15, 1.5,
/// 1.1, so groups 2 and 1 are kept and expert 0 (the best score) is out. The choice among
/// experts 2..=5 is 3 (0.85), 4 (0.8), 5 (0.7), 2 (0.3); the weights are the scores (not the
/// biased choice), normalised over the chosen and times 2.5.
fn route(top_k: usize, norm: bool) -> Routing {
    let mut bias = vec![0.0f32; 8];
    bias[3] = 0.45;
    let r = router(top_k, norm, bias);
    let x = logits(&[0.9, 0.2, 0.3, 0.4, 0.8, 0.7, 0.6, 0.5]);
    r.route(&x, 1, r.top_k(), None).unwrap().remove(0)
}

fn assert_close(got: &[f32], want: &[f32]) {
    assert_eq!(got.len(), want.len(), "{got:?} vs {want:?}");
    for (g, w) in got.iter().zip(want) {
        assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
}

#[test]
fn fewer_experts_are_the_best_of_the_same_choice_renormalised_as_the_model_does() {
    let full = route(4, true);
    assert_eq!(full.ids, [3, 4, 5, 2]);
    // 0.4, 0.8, 0.7, 0.3 over their sum 2.2, times 2.5.
    assert_close(&full.weights, &[0.4545454, 0.9090909, 0.7954545, 0.3409091]);
    let two = route(2, true);
    assert_eq!(two.ids, [3, 4]);
    // 0.4 and 0.8 over 1.2, times 2.5: the weights of the two sum to 2.5 as the four did.
    assert_close(&two.weights, &[0.8333333, 1.6666667]);
    let one = route(1, true);
    assert_eq!(one.ids, [3]);
    assert_close(&one.weights, &[2.5]);
    // Without norm_topk_prob the model does not normalise, and neither do fewer experts:
    // each keeps its score times 2.5.
    let plain = route(2, false);
    assert_eq!(plain.ids, [3, 4]);
    assert_close(&plain.weights, &[1.0, 2.0]);
    assert_close(&route(4, false).weights, &[1.0, 2.0, 1.75, 0.75]);
}

#[test]
fn experts_per_token_takes_one_to_k_and_names_the_range_otherwise() {
    assert_eq!(experts_per_token(None, 6).unwrap(), 6);
    assert_eq!(experts_per_token(Some(6), 6).unwrap(), 6);
    assert_eq!(experts_per_token(Some(1), 6).unwrap(), 1);
    for bad in [0, 7, 100] {
        let err = experts_per_token(Some(bad), 6).unwrap_err();
        assert!(matches!(err, Error::InvalidArgument { .. }), "{err:?}");
        let msg = err.to_string();
        assert!(
            msg.contains("'experts_per_token'") && msg.contains("1..=6"),
            "{msg}"
        );
    }
}

/// The embedded trained model (k = 2 of 16, groups, norm_topk_prob, scaling 2.5) with
/// `experts_per_token`.
fn tiny(experts_per_token: Option<usize>) -> Model {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/colibri/models/tiny");
    let c = Container::open(&dir).expect("the embedded model opens");
    let opts = ModelOptions {
        experts_per_token,
        ..ModelOptions::default()
    };
    Model::load(Arc::new(c), &opts).expect("the embedded model loads")
}

const PROMPT: [u32; 6] = [1, 200, 31, 417, 90, 12];

fn logits_of(model: &Model) -> Vec<f32> {
    Sequence::owned(model)
        .step(&PROMPT, 0, true)
        .expect("the forward runs")
        .logits
}

/// Greedy tokens after `PROMPT`, one step at a time.
fn greedy(model: &Model, n: usize) -> Vec<u32> {
    let mut seq = Sequence::owned(model);
    let mut logits = seq.step(&PROMPT, 0, false).unwrap().logits;
    let mut out = Vec::new();
    for _ in 0..n {
        let t = top_indices(&logits, 1)[0] as u32;
        out.push(t);
        let pos = seq.kv_len();
        logits = seq.step(&[t], pos, false).unwrap().logits;
    }
    out
}

#[test]
fn the_models_own_k_is_the_model_unchanged_and_fewer_change_the_logits() {
    let plain = tiny(None);
    let k = plain.config().num_experts_per_tok;
    assert_eq!((plain.experts_per_token(), k), (2, 2));
    let same = tiny(Some(k));
    let want = logits_of(&plain);
    let got = logits_of(&same);
    assert!(
        want.iter()
            .zip(&got)
            .all(|(a, b)| a.to_bits() == b.to_bits()),
        "experts_per_token = k must be bit-identical"
    );
    let fewer = tiny(Some(1));
    assert_eq!(fewer.experts_per_token(), 1);
    let one = logits_of(&fewer);
    let moved = want.iter().zip(&one).map(|(a, b)| (a - b).abs());
    assert!(
        moved.fold(0.0f32, f32::max) > 1e-3,
        "k' = 1 left the logits as they were"
    );
    assert!(one.iter().all(|v| v.is_finite()));
    assert_eq!(
        greedy(&fewer, 12),
        greedy(&fewer, 12),
        "greedy stays deterministic"
    );
}

#[test]
fn a_model_load_refuses_experts_per_token_outside_one_to_k() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("python/colibri/models/tiny");
    for bad in [0, 3] {
        let c = Container::open(&dir).unwrap();
        let opts = ModelOptions {
            experts_per_token: Some(bad),
            ..ModelOptions::default()
        };
        let err = Model::load(Arc::new(c), &opts).err().expect("refused");
        assert!(err.to_string().contains("1..=2"), "{err}");
    }
}

/// Every routed row's expert count, by forward kind.
#[derive(Default)]
struct Widths(Mutex<Vec<(ForwardKind, usize)>>);

impl RoutingSink for Widths {
    fn forward(&self, kind: ForwardKind, rows: &[RoutedRows]) {
        let mut seen = self.0.lock().unwrap();
        for r in rows {
            for row in &r.experts {
                seen.extend(row.iter().map(|layer| (kind, layer.len())));
            }
        }
    }
    fn truncated(&self, _: u64, _: usize) {}
}

#[test]
fn the_mtp_layer_routes_with_the_same_experts_per_token() {
    let model = tiny(Some(1));
    assert!(model.has_mtp());
    let sink = Arc::new(Widths::default());
    model.set_routing_sink(Some(sink.clone()));
    let mut seq = Sequence::owned(&model);
    let f = seq.step(&PROMPT, 0, true).unwrap();
    seq.mtp_step(
        &PROMPT[1..],
        &f.carried.slice(0..PROMPT.len() - 1),
        0,
        false,
    )
    .unwrap();
    let seen = sink.0.lock().unwrap();
    assert!(seen.iter().any(|(k, _)| *k == ForwardKind::Mtp), "{seen:?}");
    assert!(seen.iter().all(|(_, n)| *n == 1), "{seen:?}");
}
