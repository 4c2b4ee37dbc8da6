//! The decode loop's view of the model (`decode::Target`): a [`Sequence`], the model's
//! weights with one session's caches. Here because the engine is what composes the two:
//! `model` knows nothing of decoding.

use std::borrow::BorrowMut;

use crate::carried::Carried;
use crate::decode::{ByteCosts, StepOutput, Target};
use crate::error::Result;
use crate::model::{Forward, KvCaches, MtpForward, Sequence};

/// A main-model step: its carried state is `model.norm(h)`, what the MTP head consumes.
fn main_out(f: Forward) -> StepOutput {
    StepOutput {
        logits: f.logits,
        hidden: f.carried,
    }
}

/// An MTP step: its hidden is already post-norm (the head's `shared_head.norm`).
fn mtp_out(f: MtpForward) -> StepOutput {
    StepOutput {
        logits: f.logits,
        hidden: f.post_norm_hidden,
    }
}

impl<C: BorrowMut<KvCaches>> Target for Sequence<'_, C> {
    fn vocab_size(&self) -> usize {
        self.model().config().vocab_size
    }
    fn hidden_size(&self) -> usize {
        self.model().config().hidden_size
    }
    fn step_all(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        self.step(tokens, start_pos, true).map(main_out)
    }
    fn step_last(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        self.step(tokens, start_pos, false).map(main_out)
    }
    fn prefill(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        all_logits: bool,
    ) -> Result<StepOutput> {
        Sequence::prefill(self, tokens, start_pos, all_logits).map(main_out)
    }
    fn kv_len(&self) -> usize {
        Sequence::kv_len(self)
    }
    fn truncate(&mut self, len: usize) {
        Sequence::truncate(self, len)
    }
    fn has_mtp(&self) -> bool {
        self.model().has_mtp()
    }
    fn mtp_step(&mut self, tokens: &[u32], hidden: &Carried, start: usize) -> Result<StepOutput> {
        Sequence::mtp_step(self, tokens, hidden, start, true).map(mtp_out)
    }
    fn mtp_step_last(
        &mut self,
        tokens: &[u32],
        hidden: &Carried,
        start_pos: usize,
    ) -> Result<StepOutput> {
        Sequence::mtp_step(self, tokens, hidden, start_pos, false).map(mtp_out)
    }
    fn mtp_kv_len(&self) -> usize {
        Sequence::mtp_kv_len(self)
    }
    fn mtp_truncate(&mut self, len: usize) {
        Sequence::mtp_truncate(self, len)
    }
    fn mtp_draft_share(&self) -> f64 {
        self.model().config().mtp_draft_share()
    }
    fn byte_costs(&self) -> ByteCosts {
        self.model()
            .read_price()
            .map_or(ByteCosts::FREE, |p| ByteCosts {
                secs_per_byte: p.secs_per_byte,
                verify_row_bytes: p.main_row_bytes,
                mtp_row_bytes: p.mtp_row_bytes,
                mtp_missing_bytes: p.mtp_missing_bytes,
            })
    }
}
