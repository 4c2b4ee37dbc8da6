//! The logit processing of a row ([`History::process`]): the logit bias, the repetition /
//! presence / frequency penalties, the structured-output mask and `min_tokens`' mask of the
//! stop tokens, from the prompt and the tokens generated before the row.

use std::collections::{HashMap, HashSet};

use super::SamplingParams;
use crate::decode::constraint::ConstraintState;

/// What the logit processing of a row depends on: the prompt and the tokens generated
/// before it. Kept incrementally by the decode loop ([`push`](Self::push) per emitted token).
#[derive(Clone, Debug, Default)]
pub struct History {
    /// Every token of the prompt and the output (repetition penalty).
    seen: HashSet<u32>,
    /// Occurrences of each token in the output (presence and frequency penalties).
    output: HashMap<u32, u32>,
    generated: usize,
    /// Masked while fewer than `min_tokens` were generated.
    stop_tokens: Vec<u32>,
    /// Where the output stands in the structured-output grammar.
    constraint: Option<ConstraintState>,
}

impl History {
    /// The history at the first generated token of `prompt`.
    pub fn new(prompt: &[u32], params: &SamplingParams, stop_tokens: &[u32]) -> Self {
        History {
            seen: if params.repetition_penalty != 1.0 {
                prompt.iter().copied().collect()
            } else {
                HashSet::new()
            },
            output: HashMap::new(),
            generated: 0,
            stop_tokens: if params.min_tokens > 0 {
                stop_tokens.to_vec()
            } else {
                Vec::new()
            },
            constraint: params.constraint.as_ref().map(|g| g.start(stop_tokens)),
        }
    }

    /// `token` was emitted.
    pub fn push(&mut self, token: u32, params: &SamplingParams) {
        self.generated += 1;
        if let Some(c) = &mut self.constraint {
            c.push(token);
        }
        if params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
            *self.output.entry(token).or_default() += 1;
        }
    }

    /// The processed logits of a row whose context is this history followed by `extra`
    /// (the drafts before a verified row): `row` itself when nothing applies.
    pub fn process<'a>(
        &self,
        row: &'a [f32],
        params: &SamplingParams,
        extra: &[u32],
    ) -> std::borrow::Cow<'a, [f32]> {
        if !params.processes_logits() {
            return std::borrow::Cow::Borrowed(row);
        }
        let mut x = row.to_vec();
        for &(t, b) in &params.logit_bias {
            if let Some(v) = x.get_mut(t as usize) {
                *v += b;
            }
        }
        let r = params.repetition_penalty;
        if r != 1.0 {
            let penalise = |v: &mut f32| *v = if *v > 0.0 { *v / r } else { *v * r };
            for &t in &self.seen {
                if let Some(v) = x.get_mut(t as usize) {
                    penalise(v);
                }
            }
            for (i, &t) in extra.iter().enumerate() {
                // Once per token, whether the history or an earlier draft holds it.
                if !self.seen.contains(&t) && !extra[..i].contains(&t) {
                    if let Some(v) = x.get_mut(t as usize) {
                        penalise(v);
                    }
                }
            }
        }
        let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
        if presence != 0.0 || frequency != 0.0 {
            let mut counts = self.output.clone();
            for &t in extra {
                *counts.entry(t).or_default() += 1;
            }
            for (&t, &c) in &counts {
                if let Some(v) = x.get_mut(t as usize) {
                    *v -= presence + frequency * c as f32;
                }
            }
        }
        let complete = match &self.constraint {
            Some(c) => c.mask(&mut x, extra),
            None => false,
        };
        // A complete grammar allows only the stop tokens: it ends the output, min_tokens or not.
        if self.generated + extra.len() < params.min_tokens && !complete {
            for &t in &self.stop_tokens {
                if let Some(v) = x.get_mut(t as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        std::borrow::Cow::Owned(x)
    }
}
