//! The log-probabilities of the prompt's own tokens (vLLM's `prompt_logprobs`), scored from
//! the prefill's forward: token i under the model's distribution after tokens 0..i (the
//! softmax of its logits at temperature 1; no logit processing applies to a prompt).

use std::sync::{Arc, Mutex};

use super::sampling::{token_logprob, SamplingParams, TokenLogprob};
use super::{check_step, StepOutput, Target};
use crate::Result;

/// Where the prefill writes the prompt tokens' log-probabilities, each with the `top` most
/// likely alternatives. Shared: the caller keeps a clone and [`take`](Self::take)s them after
/// the generation. The prefill must cover the whole prompt (no cached prefix) for them all
/// to be there.
#[derive(Clone, Debug)]
pub struct PromptLogprobs {
    pub top: usize,
    scores: Arc<Mutex<Vec<TokenLogprob>>>,
}

impl PromptLogprobs {
    pub fn new(top: usize) -> Self {
        PromptLogprobs {
            top,
            scores: Arc::default(),
        }
    }

    /// The scores of prompt tokens 1.. (token 0 has no context), in order.
    pub fn take(&self) -> Vec<TokenLogprob> {
        match self.scores.lock() {
            Ok(mut s) => std::mem::take(&mut *s),
            Err(p) => std::mem::take(&mut *p.into_inner()),
        }
    }
}

impl PartialEq for PromptLogprobs {
    fn eq(&self, other: &Self) -> bool {
        self.top == other.top && Arc::ptr_eq(&self.scores, &other.scores)
    }
}

/// The prefill forward over `prompt[start..end]` at positions `start..` (`Target::prefill`):
/// the last row's logits, or, when `sampling` asks for the prompt's log-probabilities, every
/// row's, each row scoring the prompt token after it (the last row of the prompt has none to
/// score).
pub(crate) fn prefill_forward(
    target: &mut dyn Target,
    prompt: &[u32],
    start: usize,
    end: usize,
    sampling: &SamplingParams,
) -> Result<StepOutput> {
    let Some(sink) = &sampling.prompt_logprobs else {
        return target.prefill(&prompt[start..end], start, false);
    };
    let out = target.prefill(&prompt[start..end], start, true)?;
    let vocab = target.vocab_size();
    check_step(&out, end - start, vocab, target.hidden_size(), "step_all")?;
    let unit = SamplingParams {
        temperature: 1.0,
        ..SamplingParams::default()
    };
    let mut scored = Vec::with_capacity(end - start);
    for (row, &next) in out.logits.chunks_exact(vocab).zip(&prompt[start + 1..]) {
        scored.push(token_logprob(row, &unit, next, sink.top)?);
    }
    match sink.scores.lock() {
        Ok(mut s) => s.extend(scored),
        Err(p) => p.into_inner().extend(scored),
    }
    Ok(out)
}
