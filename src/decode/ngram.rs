//! Prompt-lookup (n-gram) drafting: if the context's suffix of 4, 3 or 2 tokens occurred
//! earlier, propose the tokens that followed its most recent earlier occurrence.

use std::sync::atomic::AtomicBool;

use super::{Drafter, Target};
use crate::Result;

/// Longest suffix tried first; shorter ones down to `MIN_NGRAM` are fallbacks.
pub const MAX_NGRAM: usize = 4;
pub const MIN_NGRAM: usize = 2;

/// Up to `max` tokens that followed the most recent earlier occurrence of the longest suffix
/// (length `MAX_NGRAM` down to `MIN_NGRAM`) of `context`; empty when no suffix recurs.
pub fn lookup(context: &[u32], max: usize) -> Vec<u32> {
    let len = context.len();
    if max == 0 {
        return Vec::new();
    }
    for n in (MIN_NGRAM..=MAX_NGRAM).rev() {
        if len < n + 1 {
            continue;
        }
        let suffix = &context[len - n..];
        // An occurrence starting at i is followed by context[i + n], which must exist and
        // lie before the suffix's own last token, so i ≤ len − n − 1.
        if let Some(i) = (0..len - n).rev().find(|&i| &context[i..i + n] == suffix) {
            let from = i + n;
            let to = (from + max).min(len);
            return context[from..to].to_vec();
        }
    }
    Vec::new()
}

/// The n-gram drafter: stateless, uses only the context.
#[derive(Debug, Default)]
pub struct NgramDrafter;

impl Drafter for NgramDrafter {
    fn propose(
        &mut self,
        _target: &mut dyn Target,
        context: &[u32],
        max: usize,
        _cancel: &AtomicBool,
    ) -> Result<Vec<u32>> {
        Ok(lookup(context, max))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn longest_suffix_wins_over_shorter_more_recent_match() {
        // Suffix [1,2,3,4] occurs at 0 (followed by 9 9); [3,4] alone occurs later (followed by 7).
        let ctx = [1, 2, 3, 4, 9, 9, 3, 4, 7, 5, 1, 2, 3, 4];
        assert_eq!(lookup(&ctx, 2), vec![9, 9]);
    }

    #[test]
    fn most_recent_occurrence_is_used() {
        let ctx = [5, 6, 1, 5, 6, 2, 8, 5, 6];
        assert_eq!(lookup(&ctx, 3), vec![2, 8, 5]);
    }

    #[test]
    fn proposal_stops_at_end_of_context_and_at_max() {
        let ctx = [1, 2, 3, 1, 2];
        assert_eq!(lookup(&ctx, 8), vec![3, 1, 2]);
        assert_eq!(lookup(&ctx, 1), vec![3]);
        assert!(lookup(&ctx, 0).is_empty());
    }

    #[test]
    fn overlapping_runs_use_the_most_recent_occurrence() {
        // The most recent earlier [7,7,7,7] starts at len − 5, so one token follows it.
        assert_eq!(lookup(&[7, 7, 7, 7, 7], 3), vec![7]);
        assert_eq!(lookup(&[7, 7, 7, 7, 7, 7, 7], 2), vec![7]);
    }

    #[test]
    fn single_token_matches_do_not_count() {
        assert!(lookup(&[1, 2, 3, 4, 1], 4).is_empty());
        assert!(lookup(&[], 4).is_empty());
        assert!(lookup(&[3], 4).is_empty());
    }
}
