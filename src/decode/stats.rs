//! Counters and timings of one generation (docs/speculative.md, "Stats").

use serde::Serialize;

/// Deepest draft the loop supports; per-depth vectors have this many entries.
pub const MAX_DEPTH: usize = 8;

/// What one `generate` did. Times are wall-clock seconds measured inside the loop.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct DecodeStats {
    /// Tokens of the prompt.
    pub prompt_tokens: usize,
    /// Leading prompt tokens whose KV rows an earlier generation left in the cache, so the
    /// prefill did not compute them (`generate_after`; 0 for a fresh prefill).
    pub prompt_cached_tokens: usize,
    /// Tokens emitted (including a final stop token).
    pub generated_tokens: usize,
    /// Main-model `step_all` calls: prefill chunks plus decode forwards.
    pub forwards: u64,
    /// `step_all` calls after the prefill (plain steps and verifies); each emits ≥ 1 token.
    pub decode_forwards: u64,
    /// `mtp_step` calls (absorb batches and chained drafts).
    pub mtp_forwards: u64,
    /// (generated − 1) / decode_forwards: the first token comes from the prefill. 0 if no decode forward ran.
    pub tokens_per_forward: f64,
    /// Draft tokens proposed / accepted at depth g (index g − 1), g = 1..=MAX_DEPTH.
    pub proposed_per_depth: Vec<u64>,
    pub accepted_per_depth: Vec<u64>,
    pub proposed: u64,
    pub accepted: u64,
    /// accepted / proposed (0 when nothing was proposed).
    pub acceptance_rate: f64,
    /// Times the pause guard switched drafting off.
    pub guard_pauses: u64,
    /// Decode cycles run at each depth G (index G = 0..=MAX_DEPTH; 0 = no draft).
    pub depth_histogram: Vec<u64>,
    pub prefill_secs: f64,
    /// Drafting: MTP absorb + chained drafts, or the n-gram lookup.
    pub draft_secs: f64,
    /// Decode `step_all` calls (plain steps and verifies) plus picking/accepting tokens.
    pub verify_secs: f64,
    pub total_secs: f64,
}

impl DecodeStats {
    pub(crate) fn new(prompt_tokens: usize, prompt_cached_tokens: usize) -> Self {
        DecodeStats {
            prompt_tokens,
            prompt_cached_tokens,
            proposed_per_depth: vec![0; MAX_DEPTH],
            accepted_per_depth: vec![0; MAX_DEPTH],
            depth_histogram: vec![0; MAX_DEPTH + 1],
            ..Default::default()
        }
    }

    /// One verify cycle that proposed `proposed` drafts and accepted the first `accepted`.
    pub(crate) fn record_cycle(&mut self, depth: usize, proposed: usize, accepted: usize) {
        self.depth_histogram[depth.min(MAX_DEPTH)] += 1;
        for g in 0..proposed.min(MAX_DEPTH) {
            self.proposed_per_depth[g] += 1;
            if g < accepted {
                self.accepted_per_depth[g] += 1;
            }
        }
        self.proposed += proposed as u64;
        self.accepted += accepted as u64;
    }

    /// Fill the derived fields once the generation is over.
    pub(crate) fn finish(&mut self, generated: usize, total_secs: f64) {
        self.generated_tokens = generated;
        self.total_secs = total_secs;
        self.tokens_per_forward = if self.decode_forwards > 0 {
            generated.saturating_sub(1) as f64 / self.decode_forwards as f64
        } else {
            0.0
        };
        self.acceptance_rate = if self.proposed > 0 {
            self.accepted as f64 / self.proposed as f64
        } else {
            0.0
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cycles_accumulate_per_depth_and_derived_fields() {
        let mut s = DecodeStats::new(5, 0);
        s.record_cycle(3, 3, 1); // d1 accepted, d2 rejected (d3 never reached)
        s.record_cycle(2, 2, 2);
        s.record_cycle(0, 0, 0);
        s.decode_forwards = 3;
        s.finish(1 + 2 + 3 + 1, 1.0);
        assert_eq!(s.proposed_per_depth[..3], [2, 2, 1]);
        assert_eq!(s.accepted_per_depth[..3], [2, 1, 0]);
        assert_eq!(s.depth_histogram[..4], [1, 0, 1, 1]);
        assert_eq!((s.proposed, s.accepted), (5, 3));
        assert!((s.acceptance_rate - 0.6).abs() < 1e-12);
        assert!((s.tokens_per_forward - 2.0).abs() < 1e-12);
        let json = serde_json::to_string(&s).unwrap();
        assert!(
            json.contains("\"accepted_per_depth\":[2,1,0,0,0,0,0,0]"),
            "{json}"
        );
    }
}
