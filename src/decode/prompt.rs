//! The log-probabilities of the prompt's own tokens (vLLM's `prompt_logprobs`), scored from
//! the prefill's forward: token i under the model's distribution after tokens 0..i (the
//! softmax of its logits at temperature 1; no logit processing applies to a prompt).

use std::sync::{Arc, Mutex};

use super::sampling::{token_logprob, SamplingParams, TokenLogprob};
use super::{check_step, StepOutput};
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

/// Score the prompt tokens `prompt[start + 1..=end]` (those there are) from the prefill's
/// forward `out` over `prompt[start..end]`, whose every row's logits it holds, when
/// `sampling` asks for the prompt's log-probabilities; each row scores the prompt token
/// after it (the last row of the prompt has none to score).
pub(crate) fn score_prompt_rows(
    out: &StepOutput,
    prompt: &[u32],
    start: usize,
    end: usize,
    sampling: &SamplingParams,
    vocab: usize,
    hidden: usize,
) -> Result<()> {
    let Some(sink) = &sampling.prompt_logprobs else {
        return Ok(());
    };
    check_step(out, end - start, vocab, hidden, "step_all")?;
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
    Ok(())
}
