//! The decode loop's view of the model (`decode::Target`), here because the engine is
//! what composes the two: `model` knows nothing of decoding.

use crate::decode::{StepOutput, Target};
use crate::error::Result;
use crate::model::forward::{Model, MtpForward};
use crate::model::Carried;

/// An MTP step: its hidden is already post-norm (the head's `shared_head.norm`).
fn out(f: MtpForward) -> StepOutput {
    StepOutput {
        logits: f.logits,
        hidden: f.post_norm_hidden,
    }
}

/// A main-model step whose hidden is `model.norm(h)`: the state the MTP head consumes (see
/// `Model::mtp_step`), handed to the decode loop by `step_all` and `step_last`.
fn normed_step(
    m: &mut Model,
    tokens: &[u32],
    start: usize,
    all_logits: bool,
    prefill: bool,
) -> Result<StepOutput> {
    let f = if prefill {
        m.prefill(tokens, start, all_logits)?
    } else {
        m.step(tokens, start, all_logits)?
    };
    let hidden = m.final_norm(&f.pre_norm_hidden);
    Ok(StepOutput {
        logits: f.logits,
        hidden,
    })
}

impl Target for Model {
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
    fn hidden_size(&self) -> usize {
        self.config().hidden_size
    }
    fn step_all(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        normed_step(self, tokens, start_pos, true, false)
    }
    fn step_last(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        normed_step(self, tokens, start_pos, false, false)
    }
    fn prefill(
        &mut self,
        tokens: &[u32],
        start_pos: usize,
        all_logits: bool,
    ) -> Result<StepOutput> {
        normed_step(self, tokens, start_pos, all_logits, true)
    }
    fn kv_len(&self) -> usize {
        Model::kv_len(self)
    }
    fn truncate(&mut self, len: usize) {
        Model::truncate(self, len)
    }
    fn has_mtp(&self) -> bool {
        Model::has_mtp(self)
    }
    fn mtp_step(&mut self, tokens: &[u32], hidden: &Carried, start: usize) -> Result<StepOutput> {
        Model::mtp_step(self, tokens, hidden, start, true).map(out)
    }
    fn mtp_step_last(
        &mut self,
        tokens: &[u32],
        hidden: &Carried,
        start_pos: usize,
    ) -> Result<StepOutput> {
        Model::mtp_step(self, tokens, hidden, start_pos, false).map(out)
    }
    fn mtp_kv_len(&self) -> usize {
        Model::mtp_kv_len(self)
    }
    fn mtp_truncate(&mut self, len: usize) {
        Model::mtp_truncate(self, len)
    }
}
