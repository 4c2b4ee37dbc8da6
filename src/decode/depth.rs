//! The automatic depth controller: picks the draft depth G maximising expected tokens per
//! second from measured acceptance and measured verify and draft cost (docs/speculative.md,
//! "Guard and automatic depth").

use super::pricing::{BYTE_MARGIN, RAM_MARGIN};
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
/// What it learned is a property of the model, the host and the workload, so the decode loop
/// carries it from one generation to the next on the same caches (`CacheState`).
#[derive(Clone, Debug)]
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
    /// Cycles left of the exploration out of G = 0 under way ([`EXPLORE_BURST`](Self::EXPLORE_BURST)).
    burst_left: u64,
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
    /// The controller has given up drafting ([`gave_up`](Self::gave_up)) once explorations out
    /// of G = 0 have failed until their interval reached this: three of them, after 32, 64
    /// and 128 plain cycles.
    pub const GIVE_UP_INTERVAL: u64 = 4 * Self::EXPLORE_EVERY;
    /// The longest interval between explorations while drafting stays off. An exploration out
    /// of G = 0 costs more than its verify: the MTP layer first absorbs every row it missed
    /// while idle (up to the interval's worth of rows, read from disk when its experts are
    /// not resident), so a drafter that keeps not paying is re-tested ever more rarely.
    pub const EXPLORE_MAX: u64 = 512;
    /// Cycles an exploration out of G = 0 drafts at depth 1 (unless depth 1 starts paying
    /// sooner): it pays the MTP layer's backlog once, so it gathers more than one outcome for
    /// it. One outcome per exploration left the estimate at the mercy of a single rejection,
    /// and two of them in a row gave drafting up where it would have paid.
    pub const EXPLORE_BURST: u64 = 8;
    /// A burst is judged after this many of its outcomes, and stopped when depth 1's estimated
    /// acceptance lies more than `BURST_SLACK` below the one at which it would pay.
    const BURST_JUDGED_AFTER: u64 = 3;
    const BURST_SLACK: f64 = 0.15;

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
            burst_left: 0,
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

    /// What a depth's rate must beat a plain step's by: the bytes' margin where reads are
    /// priced, else the estimates' noise's (drafting at break-even loses by its switching
    /// costs).
    fn margin(&self) -> f64 {
        if self.byte_secs > 0.0 {
            BYTE_MARGIN
        } else {
            RAM_MARGIN
        }
    }

    /// Whether some depth could pay at all, every draft accepted, with the reads priced in.
    fn can_pay(&self, cap: usize) -> bool {
        let plain = 1.0 / self.cost(0).max(1e-12);
        (1..=cap.min(self.max_depth))
            .any(|g| (g + 1) as f64 / self.priced_cost(g).max(1e-12) > self.margin() * plain)
    }

    /// The acceptance at which depth 1 would just beat a plain step by the margin.
    fn break_even_acceptance(&self) -> f64 {
        self.margin() * self.priced_cost(1) / self.cost(0).max(1e-12) - 1.0
    }

    /// Whether drafting keeps not paying: the best depth was 0 at each of the last
    /// explorations, until their interval reached [`GIVE_UP_INTERVAL`](Self::GIVE_UP_INTERVAL).
    /// The default drafter then stops for good on these caches, since even idle the MTP layer
    /// costs upkeep (it absorbs the rows it missed) and each exploration out of G = 0 pays
    /// that backlog.
    pub fn gave_up(&self) -> bool {
        self.explore_interval >= Self::GIVE_UP_INTERVAL
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

    /// The best depth in 0..=min(cap, frontier) by E(G)/cost(G); ties go to the smaller G. A
    /// depth must beat a plain step by [`RAM_MARGIN`] ([`BYTE_MARGIN`] where reads are priced).
    pub fn best(&self, cap: usize) -> usize {
        let top = cap.min(self.frontier());
        let plain = self.expected_tokens(0) / self.cost(0).max(1e-12);
        let bar = plain * self.margin();
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
    /// while drafting pays; while the best is 0 an exploration drafts a burst of
    /// `EXPLORE_BURST` cycles at depth 1 and the interval doubles after each (up to
    /// `EXPLORE_MAX`), since leaving G = 0 also pays the MTP layer's backlog.
    pub fn choose(&mut self, cap: usize) -> usize {
        self.decisions += 1;
        if self.widest == 0 {
            return 0;
        }
        // Where every depth loses even at perfect acceptance (the reads or the verify rows
        // cost too much), nothing is worth exploring either.
        if !self.can_pay(cap) {
            return 0;
        }
        let best = self.best(cap);
        if best == 0 && self.burst_left > 0 {
            // A burst that is clearly failing stops early (drafts that lose cost a cycle each).
            let seen = Self::EXPLORE_BURST - 1 - self.burst_left;
            let failing = seen >= Self::BURST_JUDGED_AFTER
                && self.acceptances()[0] < self.break_even_acceptance() - Self::BURST_SLACK;
            if !failing {
                self.burst_left -= 1;
                return cap.min(1);
            }
        }
        self.burst_left = 0;
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
        if best == 0 {
            self.burst_left = Self::EXPLORE_BURST - 1;
            top.min(1)
        } else if deeper && best < top {
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
    fn an_exploration_burst_far_below_break_even_stops_early_and_none_where_nothing_can_pay() {
        // Depth 1 pays above acceptance 1.03 · 1.5 − 1 = 0.545; it gets 0.2.
        let mut c = trained(|s| 1.0 + 0.5 * (s - 1) as f64, &[0.2; 8]);
        let picks: Vec<usize> = (0..64).map(|_| c.choose(8)).collect();
        let ones: Vec<usize> = (0..64).filter(|&i| picks[i] == 1).collect();
        assert_eq!(ones, vec![31, 32, 33, 34], "judged after 3 outcomes");
        // Each row costs a plain step: no depth pays even if every draft were accepted.
        let mut c = trained(|s| s as f64, &[0.9; 8]);
        assert!((0..600).all(|_| c.choose(8) == 0));
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
        // Best is 0: exploration tries depth 1 only, in bursts of EXPLORE_BURST cycles, ever
        // more rarely (after 32, then 64, 128, 256 decisions... up to EXPLORE_MAX).
        // (Each extra row costs half a plain step: depth 1 would pay at perfect acceptance.)
        let burst = DepthController::EXPLORE_BURST as usize;
        let half = |s: usize| 1.0 + 0.5 * (s - 1) as f64;
        let mut c = trained(half, &[0.5; 8]);
        let picks: Vec<usize> = (0..n).map(|_| c.choose(8)).collect();
        let ones: Vec<usize> = (0..n).filter(|&i| picks[i] == 1).collect();
        let expected: Vec<usize> = (31..31 + burst).chain(95..95 + burst).collect();
        assert_eq!(ones, expected, "decisions 32 and 32 + 64, a burst each");
        assert_eq!(picks.iter().filter(|&&g| g == 0).count(), n - 2 * burst);
        // Two explorations failed: the interval reached GIVE_UP_INTERVAL.
        assert!(c.gave_up());
        let mut c = trained(half, &[0.5; 8]);
        let long: Vec<usize> = (0..4000).map(|_| c.choose(8)).collect();
        let starts: Vec<usize> = (0..4000)
            .filter(|&i| long[i] == 1 && (i == 0 || long[i - 1] == 0))
            .collect();
        let gaps: Vec<usize> = starts.windows(2).map(|w| w[1] - w[0]).collect();
        assert_eq!(&gaps[..5], &[64, 128, 256, 512, 512]);
        // Best is 1: alternately 2 and 0.
        let mut a = [0.1; 8];
        a[0] = 0.8;
        let mut c = trained(|s| 1.0 + 0.1 * (s - 1) as f64, &a);
        let picks: Vec<usize> = (0..n).map(|_| c.choose(8)).collect();
        assert_eq!(picks.iter().filter(|&&g| g == 2).count(), 2);
        assert_eq!(picks.iter().filter(|&&g| g == 0).count(), 2);
    }

    /// A machine the controller runs on: a cycle of depth G verifies in
    /// `1 + extra · G` (a plain step is 1) and drafts in `draft · G`, each time off by up to
    /// ±`noise` at random; depth j is accepted with probability `a[j − 1]` given the earlier
    /// ones were. (What switching depths costs the MTP drafter, its backlog, is the decode
    /// loop's to price: `tests/pricing.rs`.)
    struct Machine {
        extra: f64,
        draft: f64,
        noise: f64,
        a: [f64; MAX_DEPTH],
        rng: u64,
    }

    impl Machine {
        fn new(extra: f64, draft: f64, a: &[f64]) -> Self {
            let mut acc = [0.0; MAX_DEPTH];
            acc[..a.len()].copy_from_slice(a);
            Machine {
                extra,
                draft,
                noise: 0.05,
                a: acc,
                rng: 0x9E37_79B9_7F4A_7C15,
            }
        }

        /// Uniform in [0, 1) (xorshift64*: deterministic, so the test is too).
        fn uniform(&mut self) -> f64 {
            self.rng ^= self.rng >> 12;
            self.rng ^= self.rng << 25;
            self.rng ^= self.rng >> 27;
            (self.rng.wrapping_mul(0x2545_F491_4F6C_DD1D) >> 11) as f64 / (1u64 << 53) as f64
        }

        fn jitter(&mut self, x: f64) -> f64 {
            x * (1.0 + self.noise * (2.0 * self.uniform() - 1.0))
        }

        /// Expected tokens per second at fixed depth `g` (a plain step emits 1 per second).
        fn rate(&self, g: usize) -> f64 {
            let (mut e, mut p) = (1.0, 1.0);
            for &a in &self.a[..g] {
                p *= a;
                e += p;
            }
            e / (1.0 + (self.extra + self.draft) * g as f64)
        }

        /// Tokens per second of `cycles` cycles with depths chosen by `c`, which is fed what
        /// the decode loop feeds it (`spec/cycle.rs`): every verify's time and outcome, and the
        /// time of its drafts.
        fn run(&mut self, c: &mut DepthController, cycles: usize) -> f64 {
            let (mut tokens, mut secs) = (0usize, 0.0);
            for _ in 0..cycles {
                let g = c.choose(MAX_DEPTH);
                if g > 0 {
                    let draft = self.jitter(self.draft * g as f64);
                    secs += draft;
                    c.record_draft(g, draft);
                }
                let verify = self.jitter(1.0 + self.extra * g as f64);
                secs += verify;
                c.record_verify(g + 1, verify);
                let mut accepted = 0;
                while accepted < g && self.uniform() < self.a[accepted] {
                    accepted += 1;
                }
                if g > 0 {
                    c.record_acceptance(g, accepted);
                }
                tokens += accepted + 1;
            }
            tokens as f64 / secs
        }
    }

    /// The mean rate of 32 generations of 128 tokens, the controller carried from one to the
    /// next as the decode loop carries it on the same caches.
    fn generations(m: &mut Machine) -> f64 {
        let mut c = DepthController::new(MAX_DEPTH);
        (0..32).map(|_| m.run(&mut c, 128)).sum::<f64>() / 32.0
    }

    #[test]
    fn drafting_at_break_even_does_not_lose_to_plain_steps() {
        // The GLM-like stand-in in RAM (docs/benchmarks.md, "Drafting with every weight in
        // RAM"): a 2-row verify costs ~1.62 plain steps, a draft ~0.07, depth 1 accepts 0.66
        // of its drafts: depth 1 runs at 0.98x plain, deeper ones lose more.
        for a in [[0.60, 0.55, 0.5], [0.66, 0.55, 0.5], [0.68, 0.6, 0.5]] {
            let mut m = Machine::new(0.62, 0.07, &a);
            let best_fixed = (1..=3).map(|g| m.rate(g)).fold(0.0, f64::max);
            assert!(
                best_fixed < 1.0,
                "a case where drafting loses: {best_fixed}"
            );
            let rate = generations(&mut m);
            assert!(rate >= 0.985, "acceptance {a:?}: auto {rate:.3}x plain");
        }
    }

    #[test]
    fn drafting_that_pays_is_found_within_three_percent_of_the_best_depth() {
        for (extra, a) in [
            (0.15, [0.8, 0.7, 0.6, 0.5]),
            (0.3, [0.75, 0.6, 0.5, 0.4]),
            (0.45, [0.8, 0.5, 0.4, 0.4]),
            (0.05, [0.9, 0.85, 0.8, 0.75]),
        ] {
            let mut m = Machine::new(extra, 0.03, &a);
            let best = (0..=MAX_DEPTH).map(|g| m.rate(g)).fold(0.0, f64::max);
            assert!(best > 1.1, "a case where drafting pays: {best}");
            let rate = generations(&mut m);
            assert!(
                rate >= 0.97 * best,
                "extra {extra}, acceptance {a:?}: auto {rate:.3} against the best depth's {best:.3}"
            );
        }
    }
}
