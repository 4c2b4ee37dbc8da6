//! The decode cycles: draft, verify in one forward, accept, roll back, emit; and the end of
//! a generation, with what the caches then hold.

use std::sync::atomic::AtomicBool;

use super::{
    CacheState, Decoding, DraftDepth, DraftMemory, Emitted, FinishReason, Generation, Planned,
    BYTE_COSTS_EVERY,
};
use crate::decode::ngram;
use crate::decode::pricing::{Backlog, Engagement, Step};

/// What the next cycle verifies.
enum Cycle {
    /// This many of the drafter's drafts (0: a plain step).
    Draft(usize),
    /// This many free drafts, to price drafting before the drafter works.
    Probe(usize),
}
use crate::decode::stats::MAX_DEPTH;
use crate::decode::{check_cancel, check_step, StepOutput, Target};
use crate::{Error, Result};

impl<'d, 'c> Decoding<'d, 'c> {
    /// The whole generation on `target` alone: prefill, then cycles verified by `step_all`.
    pub(crate) fn run(
        &mut self,
        target: &mut dyn Target,
        on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
        cancel: &AtomicBool,
    ) -> Result<FinishReason> {
        if let Some(f) = self.prefill(target, on_tokens, cancel)? {
            return Ok(f);
        }
        loop {
            if let Some(f) = self.plan(target, cancel)? {
                return Ok(f);
            }
            check_cancel(cancel)?;
            let (feed, kv) = (self.feed().to_vec(), target.kv_len());
            let out = target.step_all(&feed, kv)?;
            if let Some(f) = self.verified(target, &out, on_tokens)? {
                return Ok(f);
            }
        }
    }

    /// Settle the target (main KV holds every context token but the last; the MTP KV never
    /// more) and return the generation with what the caches now hold; `finish` is how the
    /// steps ended (an error is returned as is, after settling).
    pub(crate) fn end(
        mut self,
        target: &mut dyn Target,
        finish: Result<FinishReason>,
    ) -> Result<(Generation, CacheState)> {
        self.settle(target);
        let generated = self.ctx.len() - self.prompt_len;
        self.stats.guard_pauses = self.guard.pauses();
        self.stats.mtp_forwards = self.drafter.as_ref().map_or(0, |d| d.mtp_forwards());
        let secs = self.now() - self.started;
        self.stats.finish(generated, secs);
        let finish = finish?;
        let generation = Generation {
            tokens: self.ctx[self.prompt_len..].to_vec(),
            finish,
            stats: self.stats,
            logprobs: self.logprobs,
        };
        let mut tokens = generation.kv_tokens(&self.ctx[..self.prompt_len]);
        tokens.truncate(target.kv_len());
        let mtp_pending = self
            .drafter
            .as_mut()
            .map(|d| d.take_pending())
            .unwrap_or_default();
        let mtp_priced_out = self.mtp_priced_out
            || self
                .pricing
                .as_ref()
                .is_some_and(|p| p.state() == Engagement::PricedOut);
        let draft_memory = match (&self.drafter, self.opts.depth) {
            (Some(d), DraftDepth::Auto) => Some(DraftMemory {
                mtp: d.uses_mtp_layer(),
                depth: self.depth,
                probes: self
                    .pricing
                    .as_ref()
                    .map(|p| p.probes().to_vec())
                    .unwrap_or_default(),
            }),
            _ => self.passed_on_memory.take(),
        };
        Ok((
            generation,
            CacheState {
                tokens,
                mtp_pending,
                mtp_priced_out,
                draft_memory,
            },
        ))
    }

    /// Time the planned cycle's verify from now (a batch plans every lane before its one
    /// forward: a lane's verify time is that forward's, not the other lanes' drafting).
    pub(crate) fn restart_verify_clock(&mut self) {
        let now = self.now();
        if let Some(p) = self.planned.as_mut() {
            p.started = now;
        }
    }

    /// The next cycle, its depth capped so that the burst fits max_new_tokens and the context.
    fn next_cycle(&mut self, target: &dyn Target) -> Cycle {
        let generated = self.ctx.len() - self.prompt_len;
        let remaining = self.opts.max_new_tokens - generated;
        let mut cap = MAX_DEPTH.min(remaining - 1);
        if let Some(mc) = self.opts.max_context {
            cap = cap.min(mc - self.ctx.len() - 1);
        }
        if self.drafter.is_none() || self.guard.paused() || cap == 0 {
            return Cycle::Draft(0);
        }
        match self.opts.depth {
            DraftDepth::Fixed(g) => Cycle::Draft(g.min(cap)),
            DraftDepth::Auto => {
                self.refresh_byte_costs(target);
                let backlog = self.backlog(target);
                let first = self.stats.decode_forwards == 0;
                let Some(pricing) = self.pricing.as_mut() else {
                    return Cycle::Draft(self.depth.choose(cap));
                };
                let mut step = pricing.next(first, backlog);
                if step == Step::Draft && self.depth.gave_up() {
                    // Drafting kept not paying: stop for good rather than keep the MTP
                    // layer's upkeep and explorations.
                    pricing.price_out();
                    step = Step::Plain;
                }
                if pricing.state() == Engagement::PricedOut {
                    self.release_drafter();
                }
                match step {
                    Step::Plain => Cycle::Draft(0),
                    Step::Probe => Cycle::Probe(1),
                    Step::Draft => Cycle::Draft(self.depth.choose(cap)),
                }
            }
        }
    }

    /// Every [`BYTE_COSTS_EVERY`] cycles (and before the first), price drafts by what their
    /// reads now cost: the depth controller per draft token, the default drafter's price
    /// check for its engagement.
    fn refresh_byte_costs(&mut self, target: &dyn Target) {
        let age = self.byte_costs_age.map_or(BYTE_COSTS_EVERY, |a| a + 1);
        if age < BYTE_COSTS_EVERY {
            self.byte_costs_age = Some(age);
            return;
        }
        self.byte_costs_age = Some(0);
        let costs = target.byte_costs();
        let mtp = self.drafter.as_ref().is_some_and(|d| d.uses_mtp_layer());
        self.depth.set_byte_price(costs.draft_token_secs(mtp));
        if let Some(p) = self.pricing.as_mut() {
            p.set_byte_costs(costs);
        }
    }

    /// What the drafter must absorb before its first draft, and what is left to repay it.
    fn backlog(&self, target: &dyn Target) -> Backlog {
        let prefilled = self.prompt_len - self.prefilled_from;
        Backlog {
            rows: target.kv_len().saturating_sub(target.mtp_kv_len()),
            remaining: self.opts.max_new_tokens - (self.ctx.len() - self.prompt_len),
            prefill_row_secs: (prefilled > 0 && self.stats.prefill_secs > 0.0)
                .then(|| self.stats.prefill_secs / prefilled as f64),
        }
    }

    /// Drafting was priced out: the drafter drops what it holds (releasing is idempotent).
    fn release_drafter(&mut self) {
        if let Some(d) = self.drafter.as_mut() {
            d.release();
        }
    }

    /// The first half of a cycle: draft (the target's caches must be this generation's).
    /// Returns the finish reason when the context is full; else the rows to verify are
    /// [`feed`](Self::feed), at positions from the target's `kv_len()`.
    pub(crate) fn plan(
        &mut self,
        target: &mut dyn Target,
        cancel: &AtomicBool,
    ) -> Result<Option<FinishReason>> {
        if let Some(mc) = self.opts.max_context {
            if self.ctx.len() >= mc {
                return Ok(Some(FinishReason::ContextFull));
            }
        }
        let (drafts, probe) = match self.next_cycle(target) {
            Cycle::Draft(g) => (self.draft(target, g, cancel)?, false),
            Cycle::Probe(g) => (self.probe_drafts(g), true),
        };
        let mut feed = Vec::with_capacity(1 + drafts.len());
        feed.push(self.ctx[self.ctx.len() - 1]);
        feed.extend_from_slice(&drafts);
        self.planned = Some(Planned {
            kv: target.kv_len(),
            drafts,
            feed,
            probe,
            started: self.now(),
        });
        Ok(None)
    }

    /// `g` free drafts for a probe: prompt lookup, padded with the last context token. Any
    /// drafts are lossless (each row's pick decides), so a probe costs only its extra rows.
    fn probe_drafts(&self, g: usize) -> Vec<u32> {
        let mut drafts = ngram::lookup(&self.ctx, g);
        let last = self.ctx[self.ctx.len() - 1];
        drafts.resize(g, last);
        drafts
    }

    /// The rows the planned cycle verifies (empty when none is planned).
    pub(crate) fn feed(&self) -> &[u32] {
        self.planned.as_ref().map_or(&[], |p| &p.feed)
    }

    /// The second half of a cycle: `out` is the target's forward over [`feed`](Self::feed)
    /// (its rows already appended to the target's caches). Accepts, rolls back the rejected
    /// rows and emits the burst; returns the finish reason once generation is over.
    pub(crate) fn verified(
        &mut self,
        target: &mut dyn Target,
        out: &StepOutput,
        on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
    ) -> Result<Option<FinishReason>> {
        let Some(Planned {
            kv,
            drafts,
            feed,
            probe,
            started,
        }) = self.planned.take()
        else {
            return Err(Error::Internal("a verify without a planned cycle".into()));
        };
        let first = self.stats.decode_forwards == 0;
        self.stats.forwards += 1;
        self.stats.decode_forwards += 1;
        check_step(out, feed.len(), self.vocab, self.hidden, "step_all")?;
        let burst = self.accept(&out.logits, &drafts)?;
        let accepted = burst.len() - 1;
        let secs = self.now() - started;
        self.stats.verify_secs += secs;
        self.depth.record_verify(feed.len(), secs);
        if let Some(p) = self.pricing.as_mut() {
            p.record_verify(feed.len(), secs, probe, first);
        }

        // A probe's drafts are not the drafter's: they say nothing of its acceptance.
        if !drafts.is_empty() && !probe {
            self.depth.record_acceptance(drafts.len(), accepted);
            self.guard.record(drafts.len(), accepted);
        }
        self.stats
            .record_cycle(drafts.len(), drafts.len(), accepted);
        // Keep the rows of the fed token and the accepted drafts; drop rejected ones.
        target.truncate(kv + accepted + 1);
        if let Some(d) = self.drafter.as_mut() {
            d.observe(&out.hidden.slice(0..accepted + 1));
        }
        Ok(self.emit(&burst, on_tokens))
    }

    /// Ask the drafter for `g` drafts (upkeep only when `g == 0`).
    fn draft(
        &mut self,
        target: &mut dyn Target,
        g: usize,
        cancel: &AtomicBool,
    ) -> Result<Vec<u32>> {
        let clock = self.clock;
        // While drafting is being priced the drafter does no work, upkeep included.
        let probing = self
            .pricing
            .as_ref()
            .is_some_and(|p| p.state() == Engagement::Probing);
        let Some(drafter) = self.drafter.as_mut() else {
            return Ok(Vec::new());
        };
        let t = clock();
        let typical = std::mem::replace(&mut self.drafted_last_cycle, g > 0);
        if g == 0 {
            if !probing {
                drafter.idle(target, &self.ctx, cancel)?;
            }
            self.stats.draft_secs += clock() - t;
            return Ok(Vec::new());
        }
        let mut drafts = drafter.propose(target, &self.ctx, g, cancel)?;
        drafts.truncate(g);
        let secs = clock() - t;
        self.stats.draft_secs += secs;
        if let Some(&bad) = drafts.iter().find(|&&d| d as usize >= self.vocab) {
            return Err(Error::Internal(format!(
                "drafter proposed token {bad}, outside the vocabulary ({})",
                self.vocab
            )));
        }
        if !drafts.is_empty() && typical {
            self.depth.record_draft(drafts.len(), secs);
            let priced_out = self
                .pricing
                .as_mut()
                .is_some_and(|p| p.record_draft(drafts.len(), secs));
            if priced_out {
                self.release_drafter();
            }
        }
        Ok(drafts)
    }

    /// Walk the verified rows: row j's pick is the token after [t, d1..dj]. Returns the
    /// accepted drafts followed by the target's own token.
    fn accept(&mut self, logits: &[f32], drafts: &[u32]) -> Result<Vec<u32>> {
        let mut burst = Vec::with_capacity(drafts.len() + 1);
        for (j, row) in logits.chunks_exact(self.vocab).enumerate() {
            // Row j follows the context and drafts[..j]: all accepted if we got here, so
            // they are the tokens plain decoding emitted before it.
            let draft = drafts.get(j).copied();
            let tok = self.choose(row, &drafts[..j], draft)?;
            burst.push(tok);
            if Some(tok) != draft {
                break;
            }
        }
        Ok(burst)
    }

    /// Append `burst` up to a stop token or max_new_tokens and report it to `on_tokens`.
    pub(super) fn emit(
        &mut self,
        burst: &[u32],
        on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
    ) -> Option<FinishReason> {
        let before = self.ctx.len();
        let scored_before = self.logprobs.len();
        let mut finish = None;
        let mut scored = std::mem::take(&mut self.burst_logprobs).into_iter();
        for &t in burst {
            self.ctx.push(t);
            self.history.push(t, &self.opts.sampling);
            self.logprobs.extend(scored.next());
            if self.opts.stop_tokens.contains(&t) {
                finish = Some(FinishReason::Stop);
                break;
            }
            if self.ctx.len() - self.prompt_len >= self.opts.max_new_tokens {
                finish = Some(FinishReason::Length);
                break;
            }
        }
        self.guard.on_emitted(self.ctx.len() - before);
        let emitted = Emitted {
            tokens: &self.ctx[before..],
            logprobs: &self.logprobs[scored_before..],
        };
        if !on_tokens(emitted) && finish.is_none() {
            finish = Some(FinishReason::Cancelled);
        }
        finish
    }

    /// Restore the invariant after the last cycle (or an error): main KV holds every context
    /// token but the last; MTP KV never holds more rows than that.
    fn settle(&mut self, target: &mut dyn Target) {
        self.planned = None;
        let keep = self.ctx.len().saturating_sub(1).min(target.kv_len());
        let keep = if self.ctx.len() == self.prompt_len {
            // Nothing emitted: the prompt may be partly prefilled; drop it all.
            0
        } else {
            keep
        };
        if target.kv_len() > keep {
            target.truncate(keep);
        }
        if target.mtp_kv_len() > keep {
            target.mtp_truncate(keep);
        }
    }
}
