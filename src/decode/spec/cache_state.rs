//! What a target's caches hold between generations, and how much of it a new prompt keeps.

use super::DraftSource;
use crate::carried::Carried;
use crate::decode::depth::DepthController;
use crate::decode::Target;

/// What the automatic depth and the default drafter's price check learned in the
/// generations on these caches: the next one starts from it instead of measuring again
/// (docs/speculative.md, "Guard and automatic depth").
#[derive(Clone, Debug)]
pub(crate) struct DraftMemory {
    /// The drafter it was learned with uses the MTP layer (else it is the n-gram drafter's).
    pub mtp: bool,
    pub depth: DepthController,
    /// The price check's (plain step, probe) pairs (default drafting only; else empty).
    pub probes: Vec<(f64, f64)>,
}

/// What a target's caches hold between generations, for
/// [`generate_after`](super::generate_after): the tokens of the main KV rows and the main
/// hidden states the MTP layer has not absorbed yet. Start with `CacheState::default()`
/// (nothing known) for a target whose caches are unknown.
#[derive(Clone, Debug, Default)]
pub struct CacheState {
    /// Tokens whose main KV rows the target holds (prompt and output of the last
    /// generation, but its last token).
    pub tokens: Vec<u32>,
    /// [rows, hidden]: main hidden states of positions `mtp_kv_len()..kv_len()`.
    pub(super) mtp_pending: Carried,
    /// A generation with the default drafting found that MTP drafts cannot pay here
    /// (`DepthController::could_pay`) and dropped the MTP layer's state: later default
    /// generations on these caches start without drafting and keep the whole prefix.
    pub(super) mtp_priced_out: bool,
    /// What drafting learned in the last generations on these caches (`None`: nothing yet).
    pub(super) draft_memory: Option<DraftMemory>,
}

impl CacheState {
    /// Forget everything (the target's caches were changed behind our back).
    pub fn clear(&mut self) {
        self.tokens.clear();
        self.mtp_pending = Carried::default();
        self.mtp_priced_out = false;
        self.draft_memory = None;
    }

    /// A state restored from what [`mtp_pending`](Self::mtp_pending) and `tokens` were
    /// (a saved context): the caller vouches that the caches it goes with hold
    /// `tokens.len()` main rows and `tokens.len() − pending rows` MTP rows.
    pub fn from_parts(tokens: Vec<u32>, mtp_pending: Carried) -> Self {
        CacheState {
            tokens,
            mtp_pending,
            mtp_priced_out: false,
            draft_memory: None,
        }
    }

    /// Whether the last default generation priced MTP drafting out on these caches.
    pub fn mtp_priced_out(&self) -> bool {
        self.mtp_priced_out
    }

    /// What drafting learned in the generations on these caches.
    #[cfg(test)]
    pub(crate) fn draft_memory(&self) -> Option<&DraftMemory> {
        self.draft_memory.as_ref()
    }

    /// [rows, hidden]: the main hidden states the MTP layer has not absorbed yet.
    pub fn mtp_pending(&self) -> &Carried {
        &self.mtp_pending
    }
}

/// The rows a generation of `prompt` keeps from `previous`: (main rows, MTP rows, the
/// pending hidden states of the MTP rows..main rows). The main rows are the common prefix
/// less the last prompt token (a forward must produce its logits). With MTP drafting the
/// MTP rows are its true rows within the prefix, short of the prefix's last token (each row
/// pairs a position with the next token); when the hidden states between them and the main
/// rows are not all known, the main rows stop there too.
pub(super) fn reusable_prefix(
    target: &dyn Target,
    previous: CacheState,
    prompt: &[u32],
    source: DraftSource,
) -> (usize, usize, Carried) {
    let (kv, mtp_len, h) = (target.kv_len(), target.mtp_kv_len(), target.hidden_size());
    let held = previous.tokens.len().min(kv);
    let common = previous.tokens[..held]
        .iter()
        .zip(prompt)
        .take_while(|(a, b)| a == b)
        .count();
    let keep = common.min(prompt.len().saturating_sub(1));
    if source != DraftSource::Mtp {
        return (keep, 0, Carried::default());
    }
    let mut pending = previous.mtp_pending;
    let pending_known = h > 0 && mtp_len + pending.rows() == kv;
    if pending_known && mtp_len <= keep && mtp_len < common.max(1) {
        pending.truncate(keep - mtp_len);
        (keep, mtp_len, pending)
    } else {
        let rows = mtp_len.min(keep).min(common.saturating_sub(1));
        (rows, rows, Carried::default())
    }
}
