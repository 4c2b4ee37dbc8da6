//! The prefill: the prompt checked, then run through the target in chunks, scored when
//! asked, and the first token picked.

use std::sync::atomic::AtomicBool;

use super::{Decoding, Emitted, FinishReason, PrefillRows, PROGRESS_CHUNK};
use crate::decode::prompt::score_prompt_rows;
use crate::decode::{check_cancel, last_logits, StepOutput, Target};
use crate::{Error, Result};

pub(super) fn check_prompt(prompt: &[u32], vocab: usize, max_context: Option<usize>) -> Result<()> {
    if prompt.is_empty() {
        return Err(Error::invalid(
            "prompt",
            "is empty; give at least one token (e.g. the BOS token)",
        ));
    }
    if let Some((i, &t)) = prompt
        .iter()
        .enumerate()
        .find(|&(_, &t)| t as usize >= vocab)
    {
        return Err(Error::invalid(
            "prompt",
            format!("token id {t} at index {i} is outside the vocabulary (size {vocab})"),
        ));
    }
    if let Some(mc) = max_context {
        if prompt.len() >= mc {
            return Err(Error::invalid(
                "prompt",
                format!(
                    "{} tokens leave no room to generate within max_context {mc}; shorten the prompt",
                    prompt.len()
                ),
            ));
        }
    }
    Ok(())
}

impl<'d, 'c> Decoding<'d, 'c> {
    /// Run the prompt (from the first position not kept in the cache) through the model and
    /// emit the first generated token; returns the finish reason if that ends generation.
    pub(crate) fn prefill(
        &mut self,
        target: &mut dyn Target,
        on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
        cancel: &AtomicBool,
    ) -> Result<Option<FinishReason>> {
        loop {
            let out = {
                let Some(rows) = self.prefill_rows() else {
                    return Ok(None);
                };
                check_cancel(cancel)?;
                target.prefill(rows.tokens, rows.start, rows.all_logits)?
            };
            if let Some(f) = self.prefilled(&out, on_tokens)? {
                return Ok(Some(f));
            }
        }
    }

    /// Whether prompt rows remain to prefill.
    pub(crate) fn prefilling(&self) -> bool {
        self.prefill_at < self.prompt_len
    }

    /// The prefill's next forward: the next chunk of the prompt (all of what is left, or
    /// `prefill_chunk` rows, or [`PROGRESS_CHUNK`] when progress is reported), at positions
    /// from the target's `kv_len()`; `None` once the prompt is in the cache. Its forward
    /// goes to [`prefilled`](Self::prefilled).
    pub(crate) fn prefill_rows(&mut self) -> Option<PrefillRows<'_>> {
        if !self.prefilling() {
            return None;
        }
        if self.prefill_started.is_none() {
            self.prefill_started = Some(self.now());
        }
        let (start, end) = (self.prefill_at, self.prefill_end());
        Some(PrefillRows {
            tokens: &self.ctx[start..end],
            start,
            all_logits: self.opts.sampling.prompt_logprobs.is_some(),
        })
    }

    /// The end of the chunk [`prefill_rows`](Self::prefill_rows) gives.
    fn prefill_end(&self) -> usize {
        let chunk = match (self.opts.prefill_chunk, &self.opts.prefill_progress) {
            (0, Some(_)) => PROGRESS_CHUNK,
            (0, None) => self.prompt_len,
            (c, _) => c,
        };
        (self.prefill_at + chunk).min(self.prompt_len)
    }

    /// `out` is the target's prefill forward over [`prefill_rows`](Self::prefill_rows) (its
    /// rows already in the target's caches): score the prompt's tokens when asked, hand the
    /// rows to the drafter, report progress, and after the prompt's last chunk emit the
    /// first generated token; returns the finish reason if that ends generation.
    pub(crate) fn prefilled(
        &mut self,
        out: &StepOutput,
        on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
    ) -> Result<Option<FinishReason>> {
        let (start, end, n) = (self.prefill_at, self.prefill_end(), self.prompt_len);
        let (vocab, hidden) = (self.vocab, self.hidden);
        score_prompt_rows(
            out,
            &self.ctx,
            start,
            end,
            &self.opts.sampling,
            vocab,
            hidden,
        )?;
        let last = last_logits(out, end - start, vocab, hidden, "step_last")?;
        self.stats.forwards += 1;
        if let Some(d) = self.drafter.as_mut() {
            d.observe(&out.hidden);
        }
        if let Some(p) = &self.opts.prefill_progress {
            (p.0)(end - self.prefilled_from, n - self.prefilled_from);
        }
        self.prefill_at = end;
        if end < n {
            return Ok(None);
        }
        let first = self.choose(last, &[], None)?;
        let began = self.prefill_started.unwrap_or(self.started);
        self.stats.prefill_secs = self.now() - began;
        Ok(self.emit(&[first], on_tokens))
    }
}
