//! Priced drafting: the default drafter's first draft costs work (the MTP layer absorbs
//! every row it has not seen, the prompt first), so the default pays it only where drafting
//! can pay at all (docs/speculative.md, "Priced drafting").
//!
//! Before the drafter does anything, plain steps and 2-row verifies alternate, the verifies
//! with free drafts (prompt lookup, padded): any draft is lossless, so a probe costs only its
//! extra row. Each probe is paired with the plain step just before it, so a drift of the
//! machine (the first steps after a prefill run slower) cancels. Were every draft accepted,
//! a depth-1 cycle would emit 2 tokens for `plain + extra + draft` seconds, against 2 plain
//! steps; drafting is engaged only if that saves more over the tokens still to generate than
//! the absorb of the backlog costs:
//!
//! ```text
//! remaining · (plain − (plain + extra + draft) / 2)  >  backlog · absorb_row
//! ```
//!
//! `extra` is the median over the pairs of (probe − plain), `plain` their plain steps'
//! median, `draft` a draft's cost before one ran (`draft_share` · plain, the MTP head's
//! weights per token over the main model's), `absorb_row` = `draft_share` · a prefill row's
//! time. Otherwise drafting is priced out for the rest of the generation and the drafter
//! drops what it holds. Once engaged, the first measured drafts are checked the same way
//! (with the backlog gone) and can still price drafting out.

/// What the bytes a draft reads cost (the target's expert store measures them; 0 when every
/// expert is in RAM). A draft of G tokens reads G·`mtp_row_bytes` in the MTP layer (MTP
/// drafts only) and its verify G·`verify_row_bytes` more than a plain step (the extra union
/// of its rows' routed experts against the cache), each byte at `secs_per_byte`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ByteCosts {
    /// Measured seconds per byte read.
    pub secs_per_byte: f64,
    /// Expected bytes one more verify row reads beyond a plain step's.
    pub verify_row_bytes: f64,
    /// Expected bytes one row through the MTP layer reads.
    pub mtp_row_bytes: f64,
    /// The MTP layer's bytes not in RAM: the most absorbing many rows reads.
    pub mtp_missing_bytes: f64,
}

impl ByteCosts {
    /// Nothing to read: every expert in RAM.
    pub const FREE: ByteCosts = ByteCosts {
        secs_per_byte: 0.0,
        verify_row_bytes: 0.0,
        mtp_row_bytes: 0.0,
        mtp_missing_bytes: 0.0,
    };

    /// Seconds the reads of one draft token cost (`mtp`: drafted by the MTP layer).
    pub fn draft_token_secs(&self, mtp: bool) -> f64 {
        let bytes = self.verify_row_bytes + if mtp { self.mtp_row_bytes } else { 0.0 };
        finite(bytes * self.secs_per_byte)
    }

    /// Seconds the reads of absorbing `rows` rows through the MTP layer cost.
    pub fn absorb_secs(&self, rows: usize) -> f64 {
        let bytes = (rows as f64 * self.mtp_row_bytes).min(self.mtp_missing_bytes);
        finite(bytes * self.secs_per_byte)
    }

    /// Seconds the reads of one extra verify row cost.
    pub fn verify_row_secs(&self) -> f64 {
        finite(self.verify_row_bytes * self.secs_per_byte)
    }
}

/// `x`, or 0 when it is negative or not finite.
fn finite(x: f64) -> f64 {
    if x.is_finite() {
        x.max(0.0)
    } else {
        0.0
    }
}

/// A draft priced by its bytes must be worth this much more than what it costs.
pub const BYTE_MARGIN: f64 = 1.05;
/// With every expert in RAM, the depth controller drafts only where a depth's rate beats a
/// plain step's by this much. Its estimate of a depth's tokens per cycle carries a few
/// percent of noise over its memory (~100 cycles: at acceptance 0.66, ±0.05 tokens, 3%), and
/// drafting at break-even loses to `draft="off"` by what switching costs (the MTP layer
/// absorbs the rows of the plain steps before it drafts again, the explorations): on the
/// GLM-like stand-in in RAM, where depth 1 ran at 0.98× off, the controller without a margin
/// mixed depths 0–2 and ran at 0.96× (Intel Xeon with AMX, 2026-12-07).
pub const RAM_MARGIN: f64 = 1.03;
/// The acceptance expected of a first draft before any was measured (the depth controller's
/// prior): what the bytes of a probe are weighed against.
pub const PRIOR_ACCEPTANCE: f64 = 0.5;

/// Where the price check stands.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Engagement {
    /// Measuring; the drafter has done nothing.
    Probing,
    /// Drafting can pay: the depth controller chooses as for any drafter.
    Engaged,
    /// Drafting cannot pay here: no more drafts in this generation.
    PricedOut,
}

/// What the next cycle does, as far as pricing is concerned.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Step {
    /// A plain step (one row).
    Plain,
    /// A verify of one free draft.
    Probe,
    /// Drafting is engaged: the depth controller decides.
    Draft,
}

/// What the engagement test needs from the generation.
#[derive(Clone, Copy, Debug)]
pub struct Backlog {
    /// Rows the drafter must absorb before its first draft.
    pub rows: usize,
    /// Tokens still to generate.
    pub remaining: usize,
    /// Seconds of a prefill row (all layers), `None` when nothing was prefilled.
    pub prefill_row_secs: Option<f64>,
}

#[derive(Clone, Debug)]
pub struct DraftPricing {
    draft_share: f64,
    /// What the reads of drafts cost ([`set_byte_costs`](Self::set_byte_costs)).
    bytes: ByteCosts,
    state: Engagement,
    /// The plain step before the pending probe.
    last_plain: Option<f64>,
    /// (plain, probe) seconds of each pair.
    pairs: Vec<(f64, f64)>,
    /// Seconds of typical drafts since engagement.
    drafts: Vec<f64>,
    /// Plain steps since engagement (their times price the measured drafts).
    plains: Vec<f64>,
}

impl DraftPricing {
    /// Pairs of (plain step, probe) measured before deciding.
    pub const PAIRS: usize = 3;
    /// Typical drafts measured after engagement before they are priced.
    pub const DRAFTS: usize = 3;

    pub fn new(draft_share: f64) -> Self {
        DraftPricing {
            draft_share: if draft_share.is_finite() {
                draft_share.max(0.0)
            } else {
                0.0
            },
            bytes: ByteCosts::FREE,
            state: Engagement::Probing,
            last_plain: None,
            pairs: Vec::new(),
            drafts: Vec::new(),
            plains: Vec::new(),
        }
    }

    pub fn state(&self) -> Engagement {
        self.state
    }

    /// A price check that starts from `probes` (the (plain, probe) pairs of an earlier
    /// generation on the same caches, [`probes`](Self::probes)): what a verify row costs is the
    /// model's and the host's, not the prompt's, so once they are complete it decides at its
    /// first step, on the new backlog, without probing again. A verdict of priced out is
    /// carried by the caches themselves (`CacheState::mtp_priced_out`).
    pub fn with_probes(draft_share: f64, probes: Vec<(f64, f64)>) -> DraftPricing {
        let mut next = DraftPricing::new(draft_share);
        next.pairs = probes;
        next
    }

    /// The (plain step, probe) pairs measured so far.
    pub fn probes(&self) -> &[(f64, f64)] {
        &self.pairs
    }

    /// Stop drafting for the rest of the generation (the depth controller gave up).
    pub fn price_out(&mut self) {
        self.state = Engagement::PricedOut;
    }

    /// Price drafts by their bytes too (the store's measure, refreshed by the loop).
    pub fn set_byte_costs(&mut self, bytes: ByteCosts) {
        self.bytes = bytes;
    }

    /// The next step. `first` is true before any decode step of this generation (it is a
    /// plain step, and not timed as a pair's: it runs cold).
    pub fn next(&mut self, first: bool, backlog: Backlog) -> Step {
        match self.state {
            Engagement::PricedOut => Step::Plain,
            Engagement::Engaged => Step::Draft,
            Engagement::Probing if self.pairs.len() < Self::PAIRS => {
                if first || self.last_plain.is_none() {
                    Step::Plain
                } else if self.bytes_rule_out() {
                    // Not even worth probing: a probe's own rows would read those bytes.
                    self.state = Engagement::PricedOut;
                    Step::Plain
                } else {
                    Step::Probe
                }
            }
            Engagement::Probing => {
                self.state = if self.pays(backlog) {
                    Engagement::Engaged
                } else {
                    Engagement::PricedOut
                };
                self.next(false, backlog)
            }
        }
    }

    /// A decode forward of `rows` rows took `secs`; `probe` when it verified a probe.
    pub fn record_verify(&mut self, rows: usize, secs: f64, probe: bool, first: bool) {
        if !secs.is_finite() || first {
            return;
        }
        match (self.state, rows, probe) {
            (Engagement::Probing, 1, _) => self.last_plain = Some(secs),
            (Engagement::Probing, 2, true) => {
                if let Some(plain) = self.last_plain.take() {
                    self.pairs.push((plain, secs));
                }
            }
            (Engagement::Engaged, 1, _) => self.plains.push(secs),
            _ => {}
        }
    }

    /// A typical draft (one that did not absorb a backlog) of `depth` tokens took `secs`.
    /// After [`DRAFTS`](Self::DRAFTS) of them, drafting is priced out if a draft plus an extra
    /// verify row costs a plain step or more.
    pub fn record_draft(&mut self, depth: usize, secs: f64) -> bool {
        if self.state != Engagement::Engaged || depth == 0 || !secs.is_finite() {
            return false;
        }
        self.drafts.push(secs / depth as f64);
        if self.drafts.len() < Self::DRAFTS {
            return false;
        }
        let (plain, extra) = self.probed();
        let plain = if self.plains.is_empty() {
            plain
        } else {
            median(&self.plains)
        };
        let draft = median(&self.drafts);
        self.drafts.clear();
        if extra + draft >= plain {
            self.state = Engagement::PricedOut;
            return true;
        }
        false
    }

    /// (median plain step, median extra row) of the probe pairs.
    fn probed(&self) -> (f64, f64) {
        let plains: Vec<f64> = self.pairs.iter().map(|p| p.0).collect();
        let extras: Vec<f64> = self.pairs.iter().map(|p| p.1 - p.0).collect();
        (median(&plains), median(&extras).max(0.0))
    }

    /// Whether the bytes alone make drafting lose: a depth-1 cycle at the expected acceptance
    /// ([`PRIOR_ACCEPTANCE`]) emits 1 + a tokens for a plain step plus one draft token's
    /// reads, which must beat 1 + a plain steps by [`BYTE_MARGIN`]. False when reads are
    /// free (every expert in RAM) or no plain step was measured yet.
    fn bytes_rule_out(&self) -> bool {
        let read = self.bytes.draft_token_secs(true);
        let Some(plain) = self.last_plain.or_else(|| self.pairs.first().map(|p| p.0)) else {
            return false;
        };
        read > 0.0 && (1.0 + PRIOR_ACCEPTANCE) * plain <= BYTE_MARGIN * (plain + read)
    }

    /// The engagement test (module docs). Priced by bytes as well, the extra row costs at
    /// least its expected reads, a draft its MTP layer's, the backlog its absorb's, and
    /// drafting must save [`BYTE_MARGIN`] over them.
    fn pays(&self, backlog: Backlog) -> bool {
        if self.pairs.is_empty() {
            return false;
        }
        let (plain, extra) = self.probed();
        let b = &self.bytes;
        let extra = extra.max(b.verify_row_secs());
        let draft = self.draft_share * plain + (b.draft_token_secs(true) - b.verify_row_secs());
        let margin = if b.draft_token_secs(true) > 0.0 {
            BYTE_MARGIN
        } else {
            1.0
        };
        let saved_per_token = plain - margin * (plain + extra + draft) / 2.0;
        let absorb_row = self.draft_share * backlog.prefill_row_secs.unwrap_or(plain);
        let absorb = backlog.rows as f64 * absorb_row + b.absorb_secs(backlog.rows);
        saved_per_token > 0.0 && backlog.remaining as f64 * saved_per_token > margin * absorb
    }
}

/// The median of `v` (0 when empty).
fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return 0.0;
    }
    let mut s = v.to_vec();
    s.sort_by(f64::total_cmp);
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn backlog(rows: usize, remaining: usize) -> Backlog {
        Backlog {
            rows,
            remaining,
            prefill_row_secs: Some(0.1),
        }
    }

    /// Drive the check with plain steps of `plain` s and probes of `plain + extra` s.
    fn probe(p: &mut DraftPricing, plain: f64, extra: f64, b: Backlog) -> Vec<Step> {
        let mut steps = Vec::new();
        let mut first = true;
        for _ in 0..20 {
            let s = p.next(first, b);
            steps.push(s);
            match s {
                Step::Plain => p.record_verify(1, plain, false, first),
                Step::Probe => p.record_verify(2, plain + extra, true, first),
                Step::Draft => break,
            }
            first = false;
            if p.state() == Engagement::PricedOut {
                break;
            }
        }
        steps
    }

    #[test]
    fn probes_alternate_with_plain_steps_after_a_cold_first_one() {
        use Step::*;
        let mut p = DraftPricing::new(0.05);
        let steps = probe(&mut p, 1.0, 0.1, backlog(10, 100));
        assert_eq!(
            steps,
            vec![Plain, Plain, Probe, Plain, Probe, Plain, Probe, Draft]
        );
        assert_eq!(p.state(), Engagement::Engaged);
    }

    #[test]
    fn a_verify_row_that_costs_a_plain_step_prices_drafting_out() {
        // Perfect acceptance would give 2 tokens for 1 + 0.95 + 0.1 > 2 plain steps.
        let mut p = DraftPricing::new(0.1);
        probe(&mut p, 1.0, 0.95, backlog(0, 1000));
        assert_eq!(p.state(), Engagement::PricedOut);
        assert_eq!(p.next(false, backlog(0, 1000)), Step::Plain);
    }

    #[test]
    fn a_backlog_that_the_remaining_tokens_cannot_repay_prices_drafting_out() {
        // Saves (1 − (1 + 0.2 + 0.1) / 2) = 0.35 s a token; absorbing costs 0.1 · 0.1 s a row.
        let cheap = |rows, remaining| {
            let mut p = DraftPricing::new(0.1);
            probe(&mut p, 1.0, 0.2, backlog(rows, remaining));
            p.state()
        };
        assert_eq!(cheap(1000, 100), Engagement::Engaged); // 35 s > 10 s
        assert_eq!(cheap(1000, 20), Engagement::PricedOut); // 7 s < 10 s
    }

    #[test]
    fn drift_between_pairs_cancels() {
        // The machine slows down 10% a pair; each probe is 0.3 over its own plain step.
        let mut p = DraftPricing::new(0.1);
        let b = backlog(0, 100);
        let mut plain = 1.0;
        let mut first = true;
        loop {
            match p.next(first, b) {
                Step::Plain => p.record_verify(1, plain, false, first),
                Step::Probe => {
                    p.record_verify(2, plain + 0.3, true, false);
                    plain *= 1.1;
                }
                Step::Draft => break,
            }
            first = false;
        }
        let (_, extra) = p.probed();
        assert!((extra - 0.3).abs() < 1e-9, "{extra}");
    }

    #[test]
    fn measured_drafts_that_cost_a_step_price_drafting_out_after_engagement() {
        let mut p = DraftPricing::new(0.05);
        probe(&mut p, 1.0, 0.2, backlog(0, 100));
        assert_eq!(p.state(), Engagement::Engaged);
        assert!(!p.record_draft(1, 0.9));
        assert!(!p.record_draft(1, 0.9));
        assert!(p.record_draft(1, 0.9), "0.2 + 0.9 ≥ 1");
        assert_eq!(p.state(), Engagement::PricedOut);
        let mut q = DraftPricing::new(0.05);
        probe(&mut q, 1.0, 0.2, backlog(0, 100));
        for _ in 0..6 {
            assert!(!q.record_draft(2, 0.6), "0.2 + 0.3 < 1");
        }
        assert_eq!(q.state(), Engagement::Engaged);
    }
}
