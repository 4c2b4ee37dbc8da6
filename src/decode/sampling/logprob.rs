//! Log-probabilities of a generated token and its most likely alternatives, under the
//! sampler's distribution.

use super::{processed_distribution, SamplingParams};
use crate::Result;

/// Most alternatives a token's log-probability may list (OpenAI's and vLLM's default cap).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probability of a generated token and, when asked, the most likely alternatives.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// (token, logprob) of the `top_logprobs` most likely tokens, most likely first (ties:
    /// lower id first).
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities the sampler's distribution gives a (processed) row: when sampling,
/// the processed distribution itself (temperature, top-k, top-p, min-p; a cut token is
/// −inf); when greedy, whose distribution is a point mass, the softmax of the processed logits
/// at temperature 1 (what OpenAI's API reports at temperature 0).
pub fn token_logprob(
    logits: &[f32],
    params: &SamplingParams,
    token: u32,
    top: usize,
) -> Result<TokenLogprob> {
    let probs = if params.is_greedy() {
        let unit = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        processed_distribution(logits, &unit)?
    } else {
        processed_distribution(logits, params)?
    };
    let ln = |p: f64| {
        if p > 0.0 {
            p.ln() as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut best: Vec<(u32, f32)> = Vec::new();
    if top > 0 {
        let mut ids: Vec<u32> = (0..probs.len() as u32).collect();
        let order = |a: &u32, b: &u32| {
            probs[*b as usize]
                .total_cmp(&probs[*a as usize])
                .then(a.cmp(b))
        };
        let k = top.min(ids.len());
        if k < ids.len() {
            ids.select_nth_unstable_by(k - 1, order);
            ids.truncate(k);
        }
        ids.sort_unstable_by(order);
        best = ids
            .into_iter()
            .map(|t| (t, ln(probs[t as usize])))
            .collect();
    }
    Ok(TokenLogprob {
        token,
        logprob: ln(probs.get(token as usize).copied().unwrap_or(0.0)),
        top: best,
    })
}
