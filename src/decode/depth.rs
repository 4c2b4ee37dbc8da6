//! The automatic depth controller: picks the draft depth G maximising expected tokens per
//! second from measured acceptance and measured verify and draft cost (docs/speculative.md,
//! "Guard and automatic depth").

use super::pricing::BYTE_MARGIN;
use super::stats::MAX_DEPTH;

/// A decayed weighted least-squares line y ≈ a + b·x with b ≥ 0 (costs do not fall as the
/// batch grows). With a single distinct x the slope is taken as 0: flat, i.e. optimistic.
#[derive(Clone, Copy, Debug, Default)]
struct LinFit {
    w: f64,
    sx: f64,
    sxx: f64,
    sy: f64,
    sxy: f64,
    samples: u64,
}

impl LinFit {
    /// Old samples fade: weight 0.98^age (≈ 50 samples of memory).
    const DECAY: f64 = 0.98;

    fn add(&mut self, x: f64, y: f64) {
        let d = Self::DECAY;
        self.w = self.w * d + 1.0;
        self.sx = self.sx * d + x;
        self.sxx = self.sxx * d + x * x;
        self.sy = self.sy * d + y;
        self.sxy = self.sxy * d + x * y;
        self.samples += 1;
    }

    fn predict(&self, x: f64) -> Option<f64> {
        if self.samples == 0 {
            return None;
        }
        let mx = self.sx / self.w;
        let my = self.sy / self.w;
        let var = self.sxx / self.w - mx * mx;
        let slope = if var > 1e-9 {
            ((self.sxy / self.w - mx * my) / var).max(0.0)
        } else {
            0.0
        };
        Some((my + slope * (x - mx)).max(0.0))
    }
}

/// Automatic draft depth. Keeps, per depth j, the decayed counts of drafts that reached
/// depth j (all earlier ones accepted) and of those accepted, giving the conditional
/// acceptance a_j = (accepted_j + 2·a_{j−1}) / (reached_j + 2) (a_0 = 0.5: an unexplored depth
/// is assumed as good as the one before it); and decayed least-squares lines through the measured wall
/// time of a decode forward against S (= 1 + G rows) and of drafting against G. It picks the
/// G in 0..=cap maximising E(G) / cost(G), E(G) = 1 + Σ_{g≤G} Π_{j≤g} a_j,
/// cost(G) = verify(1+G) + draft(G), never more than one depth beyond the deepest measured.
#[derive(Debug)]
pub struct DepthController {
    max_depth: usize,
    /// seconds per decode forward against S − 1
    verify: LinFit,
    /// seconds of drafting against G − 1
    draft: LinFit,
    /// deepest S measured
    widest: usize,
    /// index j (1..=MAX_DEPTH)
    reached: [f64; MAX_DEPTH + 1],
    accepted: [f64; MAX_DEPTH + 1],
    decisions: u64,
    /// Decisions between explorations: `EXPLORE_EVERY`, doubled (up to `EXPLORE_MAX`) after
    /// each exploration made while drafting is off, reset once drafting pays.
    explore_interval: u64,
    /// The decision at which the next exploration happens.
    next_explore: u64,
    explorations: u64,
    /// Seconds the reads of one draft token cost ([`set_byte_price`](Self::set_byte_price));
    /// 0 when every expert is in RAM.
    byte_secs: f64,
}

impl DepthController {
    /// Counts are multiplied by this at each record, so old evidence fades (≈ 100 cycles).
    const DECAY: f64 = 0.99;
    /// Every this many decisions, one explores a neighbour of the best depth.
    pub const EXPLORE_EVERY: u64 = 32;
    /// The longest interval between explorations while drafting stays off. An exploration out
    /// of G = 0 costs more than its verify: the MTP layer first absorbs every row it missed
    /// while idle (up to the interval's worth of rows, read from disk when its experts are
    /// not resident), so a drafter that keeps not paying is re-tested ever more rarely.
    pub const EXPLORE_MAX: u64 = 512;

    pub fn new(max_depth: usize) -> Self {
        DepthController {
            max_depth: max_depth.clamp(1, MAX_DEPTH),
            verify: LinFit::default(),
            draft: LinFit::default(),
            widest: 0,
            reached: [0.0; MAX_DEPTH + 1],
            accepted: [0.0; MAX_DEPTH + 1],
            decisions: 0,
            explore_interval: Self::EXPLORE_EVERY,
            next_explore: Self::EXPLORE_EVERY,
            explorations: 0,
            byte_secs: 0.0,
        }
    }

    /// Price each draft token at `secs` of reads as well (the MTP layer's expected misses
    /// and the verify's expected extra union against the cache, at the measured cost per
    /// byte): a depth then costs at least a plain step plus its reads, and is chosen only if
    /// its rate beats a plain step's by [`BYTE_MARGIN`]. 0 (every expert in RAM) is the
    /// controller without byte prices.
    pub fn set_byte_price(&mut self, secs: f64) {
        self.byte_secs = if secs.is_finite() { secs.max(0.0) } else { 0.0 };
    }

    /// [`cost`](Self::cost) with the reads of the drafts priced in: the measured cost, or a
    /// plain step plus `g` drafts' reads where that is more (a verify measured while the
    /// cache happened to hold its experts says nothing of the next one).
    fn priced_cost(&self, g: usize) -> f64 {
        let c = self.cost(g);
        if g == 0 || self.byte_secs <= 0.0 {
            return c;
        }
        c.max(self.cost(0) + g as f64 * self.byte_secs)
    }

    /// Whether some depth could pay at all, every draft accepted, with the reads priced in.
    fn can_pay(&self, cap: usize) -> bool {
        if self.byte_secs <= 0.0 {
            return true;
        }
        let plain = 1.0 / self.cost(0).max(1e-12);
        (1..=cap.min(self.max_depth))
            .any(|g| (g + 1) as f64 / self.priced_cost(g).max(1e-12) > BYTE_MARGIN * plain)
    }

    /// Wall time of a decode forward over `rows` rows (1 = a plain step).
    pub fn record_verify(&mut self, rows: usize, secs: f64) {
        if rows >= 1 && secs.is_finite() {
            self.verify.add((rows - 1) as f64, secs);
            self.widest = self.widest.max(rows);
        }
    }

    /// Wall time of drafting `depth` tokens.
    pub fn record_draft(&mut self, depth: usize, secs: f64) {
        if depth >= 1 && secs.is_finite() {
            self.draft.add((depth - 1) as f64, secs);
        }
    }

    /// A verify of `proposed` drafts accepted the first `accepted`.
    pub fn record_acceptance(&mut self, proposed: usize, accepted: usize) {
        for j in 1..=MAX_DEPTH {
            self.reached[j] *= Self::DECAY;
            self.accepted[j] *= Self::DECAY;
        }
        // Depth j is reached when drafts 1..j−1 were all accepted.
        for j in 1..=proposed.min(MAX_DEPTH) {
            if j > accepted + 1 {
                break;
            }
            self.reached[j] += 1.0;
            if j <= accepted {
                self.accepted[j] += 1.0;
            }
        }
    }

    /// Posterior means of the acceptance of depths 1..=MAX_DEPTH (index j − 1), each given the
    /// earlier depths were accepted. Depth j's prior is 2 pseudo-counts at depth j − 1's
    /// estimate (0.5 for depth 1): an unexplored depth is assumed as good as the one before it.
    pub fn acceptances(&self) -> [f64; MAX_DEPTH] {
        let mut out = [0.0; MAX_DEPTH];
        let mut prior = 0.5;
        for j in 1..=MAX_DEPTH {
            let a = (self.accepted[j] + 2.0 * prior) / (self.reached[j] + 2.0);
            out[j - 1] = a;
            prior = a;
        }
        out
    }

    /// Expected tokens emitted by one cycle at depth `g`.
    pub fn expected_tokens(&self, g: usize) -> f64 {
        let mut e = 1.0;
        let mut prod = 1.0;
        for a in self.acceptances().iter().take(g) {
            prod *= a;
            e += prod;
        }
        e
    }

    /// Estimated seconds of one cycle at depth `g` (1.0 + 0 before anything was measured).
    pub fn cost(&self, g: usize) -> f64 {
        let v = self.verify.predict(g as f64).unwrap_or(1.0);
        let d = if g == 0 {
            0.0
        } else {
            self.draft.predict((g - 1) as f64).unwrap_or(0.0)
        };
        v + d
    }

    /// Candidates never go more than one depth beyond the deepest measured verify.
    fn frontier(&self) -> usize {
        self.widest.min(self.max_depth)
    }

    /// The best depth in 0..=min(cap, frontier) by E(G)/cost(G); ties go to the smaller G.
    pub fn best(&self, cap: usize) -> usize {
        let top = cap.min(self.frontier());
        let plain = self.expected_tokens(0) / self.cost(0).max(1e-12);
        // Priced by bytes, a depth must beat a plain step by the margin.
        let bar = if self.byte_secs > 0.0 {
            plain * BYTE_MARGIN
        } else {
            plain
        };
        let mut best = (0, plain);
        for g in 1..=top {
            let rate = self.expected_tokens(g) / self.priced_cost(g).max(1e-12);
            if rate > best.1.max(bar) * (1.0 + 1e-9) {
                best = (g, rate);
            }
        }
        best.0
    }

    /// The depth for the next cycle: first a plain step (to measure S = 1), then
    /// [`best`](Self::best), except that every `EXPLORE_EVERY`-th decision tries a neighbour
    /// of the best (alternately one deeper and one shallower) so the estimates around the
    /// optimum stay fresh. A neighbour's rate is close to the best's, so exploring costs little
    /// while drafting pays; while the best is 0 the interval doubles after each exploration
    /// (up to `EXPLORE_MAX`), since leaving G = 0 also pays the MTP layer's backlog.
    pub fn choose(&mut self, cap: usize) -> usize {
        self.decisions += 1;
        if self.widest == 0 {
            return 0;
        }
        // Where the reads make every depth lose even at perfect acceptance, nothing is worth
        // exploring either.
        if !self.can_pay(cap) {
            return 0;
        }
        let best = self.best(cap);
        if self.decisions < self.next_explore {
            return best;
        }
        self.explore_interval = if best == 0 {
            (self.explore_interval * 2).min(Self::EXPLORE_MAX)
        } else {
            Self::EXPLORE_EVERY
        };
        self.next_explore = self.decisions + self.explore_interval;
        self.explorations += 1;
        let deeper = self.explorations % 2 == 1;
        let top = cap.min(self.max_depth);
        if (deeper || best == 0) && best < top {
            best + 1
        } else {
            best.saturating_sub(1)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A controller that measured verify cost `cost(S)` at every S and saw 1000 verifies at
    /// depth `a.len()` whose per-depth conditional acceptance is exactly `a[j-1]`
    /// (deterministic dithering: depth j accepts whenever its running sum of a_j passes 1).
    fn trained(cost: impl Fn(usize) -> f64, a: &[f64]) -> DepthController {
        let mut c = DepthController::new(MAX_DEPTH);
        for s in 1..=MAX_DEPTH + 1 {
            c.record_verify(s, cost(s));
        }
        let mut acc = vec![0.0; a.len()];
        for _ in 0..1000 {
            let mut k = 0;
            while k < a.len() {
                acc[k] += a[k];
                if acc[k] < 1.0 {
                    break;
                }
                acc[k] -= 1.0;
                k += 1;
            }
            c.record_acceptance(a.len(), k);
        }
        c
    }

    #[test]
    fn measured_acceptance_follows_the_data() {
        let c = trained(|_| 1.0, &[0.8; 8]);
        let a = c.acceptances();
        for (j, aj) in a.iter().enumerate().take(3) {
            assert!((aj - 0.8).abs() < 0.03, "a_{} = {aj}", j + 1);
        }
        // E(2) = 1 + 0.8 + 0.64.
        assert!((c.expected_tokens(2) - 2.44).abs() < 0.06);
    }

    #[test]
    fn expensive_verify_turns_drafting_off() {
        // Every extra row costs as much as a plain step; acceptance 0.5: E(1)/cost(1) = 0.75 < 1.
        let c = trained(|s| s as f64, &[0.5; 8]);
        assert_eq!(c.best(8), 0);
    }

    #[test]
    fn cheap_verify_and_high_acceptance_go_deep() {
        let c = trained(|_| 1.0, &[0.9; 8]);
        assert_eq!(c.best(8), 8);
        // The cap (max_new_tokens or context left) is respected.
        assert_eq!(c.best(3), 3);
    }

    #[test]
    fn a_bad_second_depth_stops_at_one() {
        // a1 = 0.8, a2 = 0.1; cost 1 + 0.1 per extra row:
        // E(1)/c(1) = 1.8/1.1 = 1.64 > E(2)/c(2) = 1.88/1.2 = 1.57 > E(0)/c(0) = 1.
        let mut a = [0.1; 8];
        a[0] = 0.8;
        let c = trained(|s| 1.0 + 0.1 * (s - 1) as f64, &a);
        assert_eq!(c.best(8), 1);
    }

    #[test]
    fn drafting_cost_counts() {
        // Free verify width but drafting each token costs a full step: with a = 0.5 nothing pays.
        let mut c = trained(|_| 1.0, &[0.5; 8]);
        for g in 1..=MAX_DEPTH {
            c.record_draft(g, g as f64);
        }
        assert_eq!(c.best(8), 0);
    }

    #[test]
    fn fresh_controller_measures_a_plain_step_then_explores_one_depth_at_a_time() {
        let mut c = DepthController::new(MAX_DEPTH);
        assert_eq!(c.choose(8), 0);
        c.record_verify(1, 1.0);
        // Only depth 1 is a candidate until S = 2 was measured.
        assert_eq!(c.choose(8), 1);
        c.record_verify(2, 1.0);
        c.record_acceptance(1, 1);
        assert_eq!(c.choose(8), 2);
        c.record_verify(3, 1.0);
        c.record_acceptance(2, 2);
        assert_eq!(c.choose(8), 3);
    }

    #[test]
    fn exploration_tries_the_neighbours_of_the_best_depth() {
        let n = 4 * DepthController::EXPLORE_EVERY as usize;
        // Best is 8 (the maximum): exploration can only go shallower.
        let mut c = trained(|_| 1.0, &[0.9; 8]);
        let picks: Vec<usize> = (0..n).map(|_| c.choose(8)).collect();
        assert_eq!(picks.iter().filter(|&&g| g == 8).count(), n - 4);
        assert_eq!(picks.iter().filter(|&&g| g == 7).count(), 4);
        // Best is 0: exploration tries depth 1 only, ever more rarely (after 32, then 64,
        // 128, 256 decisions... up to EXPLORE_MAX).
        let mut c = trained(|s| s as f64, &[0.5; 8]);
        let picks: Vec<usize> = (0..n).map(|_| c.choose(8)).collect();
        let ones: Vec<usize> = (0..n).filter(|&i| picks[i] == 1).collect();
        assert_eq!(ones, vec![31, 95], "decisions 32 and 32 + 64");
        assert_eq!(picks.iter().filter(|&&g| g == 0).count(), n - 2);
        let mut c = trained(|s| s as f64, &[0.5; 8]);
        let long: Vec<usize> = (0..4000).map(|_| c.choose(8)).collect();
        let ones: Vec<usize> = (0..4000).filter(|&i| long[i] == 1).collect();
        let gaps: Vec<usize> = ones.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(&gaps[..5], &[64, 128, 256, 512, 512]);
        // Best is 1: alternately 2 and 0.
        let mut a = [0.1; 8];
        a[0] = 0.8;
        let mut c = trained(|s| 1.0 + 0.1 * (s - 1) as f64, &a);
        let picks: Vec<usize> = (0..n).map(|_| c.choose(8)).collect();
        assert_eq!(picks.iter().filter(|&&g| g == 2).count(), 2);
        assert_eq!(picks.iter().filter(|&&g| g == 0).count(), 2);
    }
}
