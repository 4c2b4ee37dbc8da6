//! What one generation reports: the decode loop's counters and the expert store's, in one
//! typed struct whose field names are the names every front end shows (the Python
//! `GenerationStats`, the CLI, the server's metrics). docs/python-api.md lists them.

use serde::Serialize;

use crate::decode::DecodeStats;
use crate::experts::StoreStats;

/// One generation's stats (`Engine::generate`). Times are wall-clock seconds.
#[derive(Clone, Debug, Default, PartialEq, Serialize)]
pub struct GenerationStats {
    pub prompt_tokens: usize,
    /// Leading prompt tokens whose KV the session already held: the prefill skipped them.
    pub prompt_cached_tokens: usize,
    /// Tokens emitted (a final stop token included).
    pub generated_tokens: usize,
    /// Main-model forwards: prefill chunks plus decode forwards.
    pub forwards: u64,
    /// Forwards after the prefill (plain steps and verifies).
    pub decode_forwards: u64,
    /// MTP-layer forwards (absorbs and chained drafts).
    pub mtp_forwards: u64,
    /// Generated tokens per decode forward (1.0 without drafting; the first token comes
    /// from the prefill).
    pub tokens_per_forward: f64,
    /// Decode speed: (generated − 1) / decode seconds; 0 without a decode forward.
    pub tokens_per_second: f64,
    /// Prompt-processing speed: prefilled (uncached) tokens / prefill seconds.
    pub prompt_tokens_per_second: f64,
    pub prefill_seconds: f64,
    pub decode_seconds: f64,
    /// Draft tokens proposed / accepted per depth (index 0 is depth 1).
    pub drafts_proposed: Vec<u64>,
    pub drafts_accepted: Vec<u64>,
    pub acceptance_rate: f64,
    pub draft_seconds: f64,
    pub verify_seconds: f64,
    /// Times the pause guard switched drafting off.
    pub guard_pauses: u64,
    /// Decode cycles per draft depth (index 0: no draft).
    pub depth_histogram: Vec<u64>,
    /// Routed-expert calls served from memory (pinned, LRU, prefetched, in flight).
    pub expert_hits: u64,
    /// Routed-expert calls that read from disk.
    pub expert_misses: u64,
    pub expert_bytes_read: u64,
    /// Seconds the forward waited for expert reads.
    pub expert_wait_seconds: f64,
    /// Share of the routed experts the router lookahead predicted; `None` when it predicted
    /// nothing (prefetch off).
    pub prefetch_recall: Option<f64>,
    pub prefetch_useful: u64,
    pub prefetch_wasted: u64,
    /// The I/O mode in effect ("direct" becomes "pread" after a refused O_DIRECT read).
    pub io_mode: &'static str,
}

impl GenerationStats {
    /// Combine the decode loop's counters with the store's (reset when the generation began).
    pub fn new(d: &DecodeStats, store: &StoreStats) -> Self {
        let decode_seconds = (d.total_secs - d.prefill_secs).max(0.0);
        let decoded = d.generated_tokens.saturating_sub(1);
        let prefilled = d.prompt_tokens.saturating_sub(d.prompt_cached_tokens);
        let per_second = |n: usize, secs: f64| if secs > 0.0 { n as f64 / secs } else { 0.0 };
        let recall = store.total.recall_router();
        GenerationStats {
            prompt_tokens: d.prompt_tokens,
            prompt_cached_tokens: d.prompt_cached_tokens,
            generated_tokens: d.generated_tokens,
            forwards: d.forwards,
            decode_forwards: d.decode_forwards,
            mtp_forwards: d.mtp_forwards,
            tokens_per_forward: d.tokens_per_forward,
            tokens_per_second: per_second(decoded, decode_seconds),
            prompt_tokens_per_second: per_second(prefilled, d.prefill_secs),
            prefill_seconds: d.prefill_secs,
            decode_seconds,
            drafts_proposed: d.proposed_per_depth.clone(),
            drafts_accepted: d.accepted_per_depth.clone(),
            acceptance_rate: d.acceptance_rate,
            draft_seconds: d.draft_secs,
            verify_seconds: d.verify_secs,
            guard_pauses: d.guard_pauses,
            depth_histogram: d.depth_histogram.clone(),
            expert_hits: store.total.hits(),
            expert_misses: store.total.misses,
            expert_bytes_read: store.total.bytes_read,
            expert_wait_seconds: store.total.wait_s(),
            prefetch_recall: (!recall.is_nan()).then_some(recall),
            prefetch_useful: store.total.prefetch_useful,
            prefetch_wasted: store.total.prefetch_wasted,
            io_mode: store.io_mode.name(),
        }
    }

    /// The field names, sorted (what the Python result's fields are checked
    /// against).
    pub fn field_names() -> Vec<String> {
        match serde_json::to_value(GenerationStats::default()) {
            Ok(serde_json::Value::Object(map)) => map.keys().cloned().collect(),
            _ => Vec::new(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_rates_come_from_the_counters() {
        let mut d = DecodeStats {
            prompt_tokens: 10,
            prompt_cached_tokens: 4,
            generated_tokens: 9,
            prefill_secs: 0.5,
            total_secs: 2.5,
            ..Default::default()
        };
        d.decode_forwards = 4;
        let s = GenerationStats::new(&d, &StoreStats::default());
        assert!((s.tokens_per_second - 4.0).abs() < 1e-12); // 8 tokens in 2 s
        assert!((s.prompt_tokens_per_second - 12.0).abs() < 1e-12); // 6 tokens in 0.5 s
        assert!((s.decode_seconds - 2.0).abs() < 1e-12);
        assert_eq!(s.prefetch_recall, None);
        let names = GenerationStats::field_names();
        assert!(names.iter().any(|n| n == "prompt_tokens"), "{names:?}");
        assert!(names.iter().any(|n| n == "io_mode"), "{names:?}");
    }
}
