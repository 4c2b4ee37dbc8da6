//! Decoding: token selection, draft sources (the model's MTP head, n-gram prompt lookup) and
//! the speculative draft/verify loop. Model-independent: the model is reached only through
//! [`Target`]. docs/speculative.md explains the algorithm, the MTP bookkeeping and the tests.
//!
//! - `rng`: deterministic PRNG; `sampling`: logit processing, the processed distribution,
//!   greedy/sampled picks, logprobs; `constraint`: the structured-output mask (llguidance)
//! - `ngram`, `mtp`: drafters; `guard`: the pause guard; `depth`: the automatic depth
//!   controller; `stats`: counters
//! - `spec`: [`generate`], the loop that drafts, verifies, accepts and rolls back
//! - `request`: [`GenerateRequest`](request::GenerateRequest), a generation as a caller
//!   states it (every field, its default), made into [`GenerateOptions`]

pub mod constraint;
pub mod depth;
pub mod guard;
pub mod mtp;
pub mod ngram;
pub mod pricing;
pub mod prompt;
pub mod request;
pub mod rng;
pub mod sampling;
pub mod spec;
pub mod stats;

#[cfg(test)]
mod mock;
#[cfg(test)]
mod tests;
#[cfg(test)]
mod tests_constraint;
#[cfg(test)]
mod tests_real;

use std::sync::atomic::{AtomicBool, Ordering};

use crate::carried::Carried;
use crate::{Error, Result};

pub use constraint::{Grammar, GrammarSpec, Vocabulary};
pub use guard::GuardConfig;
pub use pricing::ByteCosts;
pub use prompt::PromptLogprobs;
pub use sampling::{History, SamplingParams, TokenLogprob};
pub use spec::{
    generate, generate_after, CacheState, DraftDepth, DraftSource, Emitted, FinishReason,
    GenerateOptions, Generation, PrefillProgress, PROGRESS_CHUNK,
};
pub use stats::DecodeStats;

/// What a target's forward returns to the loop.
pub struct StepOutput {
    /// [S, V] row-major (or the last row only, from the `_last` calls).
    pub logits: Vec<f32>,
    /// [S, H]: the state the MTP head carries from each row — for the main model
    /// `model.norm(h)` of its final residual (post-norm, what transformers' MTP consumes), for
    /// the MTP head its own normed output. Not the raw residual: a [`Carried`] only the model
    /// builds, which the loop holds and passes back but cannot make up.
    pub hidden: Carried,
}

pub trait Target {
    fn vocab_size(&self) -> usize;
    fn hidden_size(&self) -> usize;
    /// Main model over `tokens` at positions start_pos..start_pos+S (start_pos == kv_len()); appends KV rows;
    /// returns logits and the MTP head's carried state (`model.norm(h)`) of every row.
    fn step_all(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput>;
    fn kv_len(&self) -> usize;
    fn truncate(&mut self, len: usize); // roll back main-model KV to `len` rows
    fn has_mtp(&self) -> bool;
    /// MTP layer over S rows: row j takes token `tokens[j]` (the token at main position p+1) and
    /// `hidden[j]` (the hidden that produced it: main hidden at p, or the previous MTP output when
    /// chaining); appends MTP KV rows at `start_pos..` (== `mtp_kv_len()`); returns the head's
    /// logits (predicting the token after `tokens[j]`) and the MTP layer's output hidden (to chain
    /// the next depth).
    fn mtp_step(
        &mut self,
        tokens: &[u32],
        hidden: &Carried,
        start_pos: usize,
    ) -> Result<StepOutput>;
    /// [`step_all`](Self::step_all) for a caller that reads only the last row's logits
    /// (prefill): `logits` may hold that row alone (`vocab` values), which spares the LM head
    /// every other row (at GLM-5 size, ~1.9 GFLOP per row). Every row's hidden is returned.
    fn step_last(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        self.step_all(tokens, start_pos)
    }
    /// The forward of a prompt's rows (prefill): [`step_all`](Self::step_all) when
    /// `all_logits`, else [`step_last`](Self::step_last). A target may compute a long
    /// prefill with a faster, inexact arithmetic (the model's `prefill` option): the prompt's
    /// KV rows are then approximate, but every decode step and verify after it is exact, so
    /// speculation stays lossless with respect to plain decoding after the same prefill.
    fn prefill(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        all_logits: bool,
    ) -> Result<StepOutput> {
        if all_logits {
            self.step_all(tokens, start_pos)
        } else {
            self.step_last(tokens, start_pos)
        }
    }
    /// [`mtp_step`](Self::mtp_step) for a caller that reads only the last row's logits (an
    /// MTP absorb): `logits` may hold that row alone.
    fn mtp_step_last(
        &mut self,
        tokens: &[u32],
        hidden: &Carried,
        start_pos: usize,
    ) -> Result<StepOutput> {
        self.mtp_step(tokens, hidden, start_pos)
    }
    fn mtp_kv_len(&self) -> usize;
    fn mtp_truncate(&mut self, len: usize);
    /// What an MTP draft token costs against a plain step before one was timed (the share of
    /// the weights it uses: `ModelConfig::mtp_draft_share`); 0 = free.
    fn mtp_draft_share(&self) -> f64 {
        0.0
    }
    /// What the bytes a draft reads cost now (the expert store's measure of its misses and
    /// of a byte's read time: `experts::read_costs`); free when every expert is in RAM.
    fn byte_costs(&self) -> ByteCosts {
        ByteCosts::FREE
    }
}

/// A source of draft tokens for the loop in [`spec`].
///
/// Between cycles the main KV holds every context token but the last (`kv_len() ==
/// context.len() - 1`); the last one is fed by the next verify.
pub trait Drafter {
    /// The main model kept new KV rows (prefill, or the accepted rows of a verify) whose
    /// carried states (`StepOutput::hidden`: `model.norm(h)`) are `hidden` ([rows, H], in
    /// position order).
    fn observe(&mut self, _hidden: &Carried) {}

    /// Up to `max` (≥ 1) draft tokens to follow `context`. May return fewer, or none.
    /// Must leave the target's main KV untouched.
    fn propose(
        &mut self,
        target: &mut dyn Target,
        context: &[u32],
        max: usize,
        cancel: &AtomicBool,
    ) -> Result<Vec<u32>>;

    /// A cycle without drafting (guard pause or depth 0): a chance to do bounded upkeep.
    fn idle(
        &mut self,
        _target: &mut dyn Target,
        _context: &[u32],
        _cancel: &AtomicBool,
    ) -> Result<()> {
        Ok(())
    }

    /// `mtp_step` calls made so far.
    fn mtp_forwards(&self) -> u64 {
        0
    }

    /// Whether its drafts run the MTP layer (whose reads a draft's price then includes).
    fn uses_mtp_layer(&self) -> bool {
        false
    }

    /// Drafting is over for this generation (priced out): drop what is held for it and do no
    /// more upkeep. Called again on every later cycle, so it must be idempotent.
    fn release(&mut self) {}

    /// What the drafter holds for the next generation on the same caches (the MTP drafter:
    /// the main hidden states its layer has not absorbed), taken out of it.
    fn take_pending(&mut self) -> Carried {
        Carried::default()
    }
}

/// A borrowed drafter drafts as the drafter (tests hand the loop their forced drafters).
impl<D: Drafter + ?Sized> Drafter for &mut D {
    fn observe(&mut self, hidden: &Carried) {
        (**self).observe(hidden)
    }
    fn propose(
        &mut self,
        target: &mut dyn Target,
        context: &[u32],
        max: usize,
        cancel: &AtomicBool,
    ) -> Result<Vec<u32>> {
        (**self).propose(target, context, max, cancel)
    }
    fn idle(
        &mut self,
        target: &mut dyn Target,
        context: &[u32],
        cancel: &AtomicBool,
    ) -> Result<()> {
        (**self).idle(target, context, cancel)
    }
    fn mtp_forwards(&self) -> u64 {
        (**self).mtp_forwards()
    }
    fn uses_mtp_layer(&self) -> bool {
        (**self).uses_mtp_layer()
    }
    fn release(&mut self) {
        (**self).release()
    }
    fn take_pending(&mut self) -> Carried {
        (**self).take_pending()
    }
}

/// `Err(Error::Cancelled)` once the caller raised `cancel`.
pub(crate) fn check_cancel(cancel: &AtomicBool) -> Result<()> {
    if cancel.load(Ordering::Relaxed) {
        Err(Error::Cancelled)
    } else {
        Ok(())
    }
}

/// A target's output must have `rows` rows of logits and hidden states.
pub(crate) fn check_step(
    out: &StepOutput,
    rows: usize,
    vocab: usize,
    hidden: usize,
    what: &str,
) -> Result<()> {
    check_step_rows(out, rows, rows, vocab, hidden, what)
}

/// [`check_step`] for `step_last`/`mtp_step_last`, whose logits are of the last row or of
/// all rows; returns the last row's logits.
pub(crate) fn last_logits<'a>(
    out: &'a StepOutput,
    rows: usize,
    vocab: usize,
    hidden: usize,
    what: &str,
) -> Result<&'a [f32]> {
    let logit_rows = if out.logits.len() == vocab { 1 } else { rows };
    check_step_rows(out, rows, logit_rows, vocab, hidden, what)?;
    Ok(&out.logits[(logit_rows - 1) * vocab..])
}

fn check_step_rows(
    out: &StepOutput,
    rows: usize,
    logit_rows: usize,
    vocab: usize,
    hidden: usize,
    what: &str,
) -> Result<()> {
    if out.logits.len() != logit_rows * vocab || out.hidden.values().len() != rows * hidden {
        return Err(Error::Internal(format!(
            "{what} over {rows} rows returned {} logits and {} hidden values; expected {} and {}",
            out.logits.len(),
            out.hidden.values().len(),
            logit_rows * vocab,
            rows * hidden
        )));
    }
    Ok(())
}
