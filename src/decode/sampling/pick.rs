//! Picking a token from a (processed) row: greedy argmax, or an inverse-CDF draw from the
//! processed distribution.

use super::{processed_distribution, SamplingParams};
use crate::{Error, Result};

/// Index of the largest logit; ties go to the lowest id. NaN or +Inf anywhere is an
/// [`Error::NonFiniteOutput`] (non-finite weights, or an overflow); -Inf is a masked token.
pub fn argmax(logits: &[f32]) -> Result<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if x.is_nan() {
            return Err(nan_logits(i));
        }
        if x == f32::INFINITY {
            return Err(inf_logit(i));
        }
        match best {
            Some((_, b)) if x <= b => {}
            _ => best = Some((i, x)),
        }
    }
    best.map(|(i, _)| i as u32)
        .ok_or_else(|| Error::Internal("argmax over an empty logits row".into()))
}

pub(super) fn inf_logit(index: usize) -> Error {
    Error::NonFiniteOutput(format!(
        "the model produced an infinite logit (token id {index})"
    ))
}

pub(super) fn nan_logits(index: usize) -> Error {
    Error::NonFiniteOutput(format!("the model produced a NaN logit (token id {index})"))
}

/// Inverse-CDF draw from `probs` with a uniform `u ∈ [0, 1)`, scanning ids in ascending order.
/// Only tokens with positive probability can be returned.
pub fn sample(probs: &[f64], u: f64) -> Result<u32> {
    let total: f64 = probs.iter().sum();
    let target = u * total;
    let mut cum = 0.0;
    let mut last_positive = None;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cum += p;
            last_positive = Some(i as u32);
            if target < cum {
                return Ok(i as u32);
            }
        }
    }
    // Rounding can leave `target` at the very top of the range: the last positive token.
    last_positive.ok_or_else(|| Error::Internal("sampling from an all-zero distribution".into()))
}

/// The token for one (processed) logits row: argmax when greedy, else a draw with the
/// uniform `u`.
pub fn pick(logits: &[f32], params: &SamplingParams, u: f64) -> Result<u32> {
    let best = argmax(logits)?;
    if logits[best as usize] == f32::NEG_INFINITY {
        return Err(nothing_allowed());
    }
    if params.is_greedy() {
        return Ok(best);
    }
    sample(&processed_distribution(logits, params)?, u)
}

/// Every logit of a processed row is −inf: the processing left no token to pick (the model's
/// own logits are never −inf everywhere in practice; `argmax` reports NaN and +inf).
fn nothing_allowed() -> Error {
    Error::invalid(
        "sampling_params",
        "no token can be picked: logit_bias, min_tokens and the structured-output constraint \
         (guided_json / guided_regex / guided_grammar) together mask every token, or the \
         constraint failed (a grammar too complex for its limits)",
    )
}
