//! The MTP drafter: absorb (true token, true hidden) pairs into the MTP layer's KV, then
//! chain the head for up to G drafts (docs/speculative.md, "MTP bookkeeping").
//!
//! MTP KV row i holds the pair (t_{i+1}, h_i): the token at main position i+1 and the main
//! model's hidden state at position i. Between cycles the MTP KV holds only true rows, the
//! first `mtp_kv_len()` positions; the main hidden states of positions
//! `mtp_kv_len()..kv_len()` wait in `pending`. Drafting absorbs them in one `mtp_step`
//! (the last of those rows pairs the not-yet-fed context token with h_{kv_len−1}, and its
//! logits give d1), chains single-row steps on (d_{g−1}, that step's MTP hidden) for deeper
//! drafts, then truncates the chained rows, which rest on drafted tokens.

use std::sync::atomic::AtomicBool;

use super::sampling::argmax;
use super::{check_cancel, check_step, last_logits, Drafter, Target};
use crate::carried::Carried;
use crate::{Error, Result};

/// While drafting is off, pending rows are absorbed once this many have piled up, so memory
/// stays bounded.
pub const BACKLOG_ROWS: usize = 256;

pub struct MtpDrafter {
    vocab: usize,
    hidden: usize,
    /// Main hidden states of positions mtp_kv_len().. not yet absorbed: [rows, H].
    pending: Carried,
    /// Rows per absorbing `mtp_step` (0 = all at once).
    chunk: usize,
    forwards: u64,
    /// Drafting was priced out: nothing is kept or absorbed any more.
    released: bool,
}

impl MtpDrafter {
    pub fn new(target: &dyn Target, chunk: usize) -> Self {
        MtpDrafter {
            vocab: target.vocab_size(),
            hidden: target.hidden_size(),
            pending: Carried::default(),
            chunk,
            forwards: 0,
            released: false,
        }
    }

    /// A drafter that resumes an earlier generation's: `pending` holds the main hidden
    /// states of positions `target.mtp_kv_len()..target.kv_len()` ([rows, H]).
    pub fn resume(target: &dyn Target, chunk: usize, pending: Carried) -> Self {
        MtpDrafter {
            pending,
            ..Self::new(target, chunk)
        }
    }

    fn pending_rows(&self) -> usize {
        self.pending.rows()
    }

    /// Run every pending pair through the MTP layer. Returns the head logits and MTP hidden of
    /// the last row (`None` when nothing was pending).
    fn absorb(
        &mut self,
        target: &mut dyn Target,
        context: &[u32],
        cancel: &AtomicBool,
    ) -> Result<Option<(Vec<f32>, Carried)>> {
        let (v, h) = (self.vocab, self.hidden);
        let rows = self.pending_rows();
        if rows == 0 {
            return Ok(None);
        }
        let start = target.mtp_kv_len();
        let kv = target.kv_len();
        if start + rows != kv || context.len() != kv + 1 {
            return Err(Error::Internal(format!(
                "MTP bookkeeping: {start} absorbed + {rows} pending rows, main KV {kv}, context {}",
                context.len()
            )));
        }
        let chunk = if self.chunk == 0 { rows } else { self.chunk };
        let mut done = 0;
        let mut last = None;
        let result = (|| {
            while done < rows {
                let n = chunk.min(rows - done);
                check_cancel(cancel)?;
                let pos = start + done;
                // One chunk of all the rows (the usual case) passes them without a copy.
                let part = (n < rows).then(|| self.pending.slice(done..done + n));
                // Only the last row's logits are read (they give d1).
                let out = target.mtp_step_last(
                    &context[pos + 1..pos + 1 + n],
                    part.as_ref().unwrap_or(&self.pending),
                    pos,
                )?;
                self.forwards += 1;
                let logits = last_logits(&out, n, v, h, "mtp_step_last")?.to_vec();
                done += n;
                last = Some((logits, out.hidden.slice(n - 1..n)));
            }
            Ok(())
        })();
        // Whatever was absorbed is no longer pending, even when a chunk failed.
        self.pending.drop_front(done);
        result.map(|()| last)
    }

    /// Chain the head from (d1's logits, its MTP hidden) to `max` drafts.
    fn chain(
        &mut self,
        target: &mut dyn Target,
        logits: &[f32],
        hidden: Carried,
        max: usize,
        cancel: &AtomicBool,
    ) -> Result<Vec<u32>> {
        let true_len = target.mtp_kv_len();
        let mut drafts = vec![argmax(logits)?];
        let mut z = hidden;
        while drafts.len() < max {
            check_cancel(cancel)?;
            let d = drafts[drafts.len() - 1];
            let out = target.mtp_step(&[d], &z, true_len + drafts.len() - 1)?;
            self.forwards += 1;
            check_step(&out, 1, self.vocab, self.hidden, "mtp_step")?;
            drafts.push(argmax(&out.logits)?);
            z = out.hidden;
        }
        Ok(drafts)
    }
}

impl Drafter for MtpDrafter {
    fn observe(&mut self, hidden: &Carried) {
        if !self.released {
            self.pending.extend(hidden);
        }
    }

    fn propose(
        &mut self,
        target: &mut dyn Target,
        context: &[u32],
        max: usize,
        cancel: &AtomicBool,
    ) -> Result<Vec<u32>> {
        if self.released {
            return Ok(Vec::new());
        }
        let Some((logits, z)) = self.absorb(target, context, cancel)? else {
            return Ok(Vec::new());
        };
        let true_len = target.mtp_kv_len();
        let drafts = self.chain(target, &logits, z, max, cancel);
        // Chained rows rest on drafted tokens: drop them, accepted or not.
        target.mtp_truncate(true_len);
        drafts
    }

    fn idle(
        &mut self,
        target: &mut dyn Target,
        context: &[u32],
        cancel: &AtomicBool,
    ) -> Result<()> {
        if !self.released && self.pending_rows() >= BACKLOG_ROWS {
            self.absorb(target, context, cancel)?;
        }
        Ok(())
    }

    fn mtp_forwards(&self) -> u64 {
        self.forwards
    }

    fn uses_mtp_layer(&self) -> bool {
        true
    }

    fn release(&mut self) {
        self.released = true;
        self.pending = Carried::default();
    }

    /// The hidden states not yet absorbed (positions `mtp_kv_len()..kv_len()`), for the
    /// next generation on the same caches.
    fn take_pending(&mut self) -> Carried {
        std::mem::take(&mut self.pending)
    }
}
