//! The decode loop's view of the model (`decode::Target`).

use crate::decode::{StepOutput, Target};
use crate::error::Result;
use crate::model::forward::{Forward, Model};

fn out(f: Forward) -> StepOutput {
    StepOutput {
        logits: f.logits,
        hidden: f.hidden,
    }
}

impl Target for Model {
    fn vocab_size(&self) -> usize {
        self.config().vocab_size
    }
    fn hidden_size(&self) -> usize {
        self.config().hidden_size
    }
    /// The hidden handed to the decode loop is `model.norm(h)`: the state the MTP head
    /// consumes (see `Model::mtp_step`).
    fn step_all(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        let f = self.step(tokens, start_pos, true)?;
        let hidden = self.final_norm(&f.hidden);
        Ok(StepOutput {
            logits: f.logits,
            hidden,
        })
    }
    /// As `step_all`, with the logits of the last row only.
    fn step_last(&mut self, tokens: &[u32], start_pos: usize) -> Result<StepOutput> {
        let f = self.step(tokens, start_pos, false)?;
        let hidden = self.final_norm(&f.hidden);
        Ok(StepOutput {
            logits: f.logits,
            hidden,
        })
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
    fn mtp_step(&mut self, tokens: &[u32], hidden: &[f32], start_pos: usize) -> Result<StepOutput> {
        Model::mtp_step(self, tokens, hidden, start_pos).map(out)
    }
    fn mtp_step_last(
        &mut self,
        tokens: &[u32],
        hidden: &[f32],
        start_pos: usize,
    ) -> Result<StepOutput> {
        Model::mtp_step_last(self, tokens, hidden, start_pos).map(out)
    }
    fn mtp_kv_len(&self) -> usize {
        Model::mtp_kv_len(self)
    }
    fn mtp_truncate(&mut self, len: usize) {
        Model::mtp_truncate(self, len)
    }
}
