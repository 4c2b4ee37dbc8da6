//! Token selection: greedy argmax, and sampling from the *processed* distribution.
//!
//! A row's logits are first *processed* by what the context decides ([`History`]: the
//! logit bias, the repetition / presence / frequency penalties, the structured-output mask
//! of a [`Grammar`](crate::decode::Grammar), `min_tokens`' mask of the stop tokens), then picked: argmax when greedy, else a draw from the *processed
//! distribution* (temperature, then top-k, then top-p, then min-p, renormalised).
//!
//! Sampling is inverse-CDF over token ids in ascending order with one uniform draw `u` per
//! emitted token. The speculative loop relies on that: it picks the target's token for every
//! verified row exactly as plain decoding would (the row's history being the context plus
//! the drafts before it, which are the tokens plain decoding emitted if they are accepted)
//! and accepts a draft iff the pick equals it (docs/speculative.md, "Acceptance"). So every
//! processing step here keeps speculation lossless, as long as it depends only on the
//! tokens before the row.
//!
//! By job: `params` (the parameters and their checks), `history` (the logit processing),
//! `distribution` (temperature and the cuts), `pick` (argmax and the draw) and `logprob`
//! (log-probabilities of a picked token).

mod distribution;
mod history;
mod logprob;
mod params;
mod pick;
#[cfg(test)]
mod tests;

pub use distribution::processed_distribution;
pub use history::History;
pub use logprob::{token_logprob, TokenLogprob, MAX_TOP_LOGPROBS};
pub use params::SamplingParams;
pub use pick::{argmax, pick, sample};
