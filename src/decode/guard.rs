//! The pause guard: switches drafting off for a while after a run of failed proposals
//! (docs/speculative.md, "Guard and automatic depth"). The depth controller is in `depth`.

use std::collections::VecDeque;

use crate::{Error, Result};

/// Settings of the pause guard.
#[derive(Clone, Debug, PartialEq)]
pub struct GuardConfig {
    pub enabled: bool,
    /// The guard looks at the outcomes of the last `window` proposals.
    pub window: usize,
    /// ... and only judges once it holds at least `min_proposals` of them.
    pub min_proposals: usize,
    /// Pause when the window's acceptance is below this.
    pub min_acceptance: f64,
    /// Emitted tokens to decode without drafting before re-arming.
    pub pause_tokens: usize,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            enabled: true,
            window: 48,
            min_proposals: 24,
            min_acceptance: 0.10,
            pause_tokens: 256,
        }
    }
}

impl GuardConfig {
    pub fn validate(&self) -> Result<()> {
        if self.min_proposals == 0 || self.window < self.min_proposals {
            return Err(Error::invalid(
                "guard.window",
                format!(
                    "window {} must be ≥ min_proposals {} ≥ 1",
                    self.window, self.min_proposals
                ),
            ));
        }
        if !(0.0..=1.0).contains(&self.min_acceptance) {
            return Err(Error::invalid(
                "guard.min_acceptance",
                format!("got {}; it must lie in [0, 1]", self.min_acceptance),
            ));
        }
        Ok(())
    }
}

/// Pause guard: a sliding window of proposal outcomes (accepted or not).
#[derive(Debug)]
pub struct PauseGuard {
    cfg: GuardConfig,
    window: VecDeque<bool>,
    accepted_in_window: usize,
    paused_for: usize,
    pauses: u64,
}

impl PauseGuard {
    pub fn new(cfg: GuardConfig) -> Self {
        PauseGuard {
            window: VecDeque::with_capacity(cfg.window),
            cfg,
            accepted_in_window: 0,
            paused_for: 0,
            pauses: 0,
        }
    }

    pub fn paused(&self) -> bool {
        self.paused_for > 0
    }

    pub fn pauses(&self) -> u64 {
        self.pauses
    }

    /// Record one verify: `proposed` drafts of which the first `accepted` were accepted.
    pub fn record(&mut self, proposed: usize, accepted: usize) {
        if !self.cfg.enabled {
            return;
        }
        for g in 0..proposed {
            let ok = g < accepted;
            if self.window.len() == self.cfg.window {
                if let Some(true) = self.window.pop_front() {
                    self.accepted_in_window -= 1;
                }
            }
            self.window.push_back(ok);
            self.accepted_in_window += usize::from(ok);
        }
        let n = self.window.len();
        if n >= self.cfg.min_proposals
            && (self.accepted_in_window as f64) < self.cfg.min_acceptance * n as f64
        {
            self.paused_for = self.cfg.pause_tokens;
            self.pauses += 1;
            // Re-arm with a clean slate: the next judgement needs fresh evidence.
            self.window.clear();
            self.accepted_in_window = 0;
        }
    }

    /// `n` tokens were emitted; a pause runs out after `pause_tokens` of them.
    pub fn on_emitted(&mut self, n: usize) {
        self.paused_for = self.paused_for.saturating_sub(n);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn guard() -> PauseGuard {
        PauseGuard::new(GuardConfig::default())
    }

    #[test]
    fn guard_pauses_after_24_proposals_below_10_percent_and_rearms() {
        let mut g = guard();
        // 23 rejected proposals: not enough evidence yet.
        for _ in 0..23 {
            g.record(1, 0);
        }
        assert!(!g.paused());
        g.record(1, 0);
        assert!(g.paused());
        assert_eq!(g.pauses(), 1);
        g.on_emitted(255);
        assert!(g.paused());
        g.on_emitted(1);
        assert!(!g.paused());
        // Re-armed with an empty window: a few rejections do not pause again.
        g.record(4, 0);
        assert!(!g.paused());
    }

    #[test]
    fn guard_keeps_drafting_at_or_above_10_percent() {
        let mut g = guard();
        // 3 of 24 accepted = 12.5%.
        for i in 0..24 {
            g.record(1, usize::from(i % 8 == 0));
        }
        assert!(!g.paused());
        // Sliding window: 24 more rejections push the accepted ones out (48-wide window: 3/48 = 6%).
        for _ in 0..24 {
            g.record(1, 0);
        }
        assert!(g.paused());
    }

    #[test]
    fn guard_counts_every_proposal_of_a_burst() {
        let mut g = guard();
        // 6 verifies of depth 4, first draft accepted each time: 6/24 = 25%.
        for _ in 0..6 {
            g.record(4, 1);
        }
        assert!(!g.paused());
        let mut g = guard();
        for _ in 0..6 {
            g.record(4, 0);
        }
        assert!(g.paused());
    }

    #[test]
    fn disabled_guard_never_pauses() {
        let mut g = PauseGuard::new(GuardConfig {
            enabled: false,
            ..GuardConfig::default()
        });
        for _ in 0..100 {
            g.record(4, 0);
        }
        assert!(!g.paused());
    }

    #[test]
    fn guard_config_validation() {
        let bad = GuardConfig {
            window: 10,
            ..GuardConfig::default()
        };
        assert!(bad
            .validate()
            .unwrap_err()
            .to_string()
            .contains("guard.window"));
        let bad = GuardConfig {
            min_acceptance: 1.5,
            ..GuardConfig::default()
        };
        assert!(bad.validate().is_err());
        assert!(GuardConfig::default().validate().is_ok());
    }
}
