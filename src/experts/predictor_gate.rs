//! The predictor gate: each layer remembers what the two predictors (router lookahead, the
//! previous token's experts) predicted for its next call, scores them against the routing
//! that call then makes (recall counters, and a running precision over the predictions that
//! would cost a read), and lets a predictor's prefetches through only while its precision is
//! at least `prefetch_min_precision` (docs/expert-store.md).

use std::sync::atomic::Ordering::Relaxed;

use super::{lock, LayerState};

/// Which predictor made a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Predictor {
    Router = 0,
    Previous = 1,
}

/// Predictions for a layer's next call, and its latest routing.
pub(super) struct Predictions {
    router: Vec<bool>,
    previous: Vec<bool>,
    pub hinted: Vec<bool>,
    /// The predictions each predictor made of experts that were not resident (what its
    /// prefetches would read): [router, previous].
    cold: [Vec<bool>; 2],
    pub last: Vec<usize>,
    /// Running precision of each predictor in this layer, starting at the gate
    /// (`prefetch_min_precision`, or `PRECISION_START` when the gate is off): [router,
    /// previous]. An EWMA of |cold ∩ routed| / |cold| per call: the share of the reads its
    /// prefetches would start that the call then uses. Predictions of resident experts do not
    /// count: they cost nothing and save nothing, and with a warm cache they are the easy,
    /// right ones (the previous token's experts), which hid that the reads actually issued
    /// were mostly wasted (measured: 0.10 of issued prefetches used at a 25% budget while 0.5
    /// of all predictions were right).
    precision: [f64; 2],
}

/// Weight of the latest call in the running precision.
const PRECISION_ALPHA: f64 = 0.25;
/// Starting precision when the gate is off (0); otherwise a predictor starts at the gate, so
/// one poor call closes it (short generations cannot afford a long learning phase).
const PRECISION_START: f64 = 0.5;

impl Predictions {
    /// No predictions yet for a layer of `n` experts, under the gate `min_precision`.
    pub fn new(n: usize, min_precision: f64) -> Self {
        let start = match min_precision {
            p if p > 0.0 => p.min(1.0),
            _ => PRECISION_START,
        };
        Predictions {
            router: vec![false; n],
            previous: vec![false; n],
            hinted: vec![false; n],
            cold: [vec![false; n], vec![false; n]],
            last: Vec::new(),
            precision: [start; 2],
        }
    }
}

impl LayerState {
    /// Routing history, predictor recall and hint usefulness for one call.
    pub(super) fn record_routing(&self, ids: &[usize]) {
        for &id in ids {
            self.usage[id].fetch_add(1, Relaxed);
        }
        let c = &self.counters;
        let mut p = lock(&self.pred);
        let routed = ids.len() as u64;
        let n_router = p.router.iter().filter(|&&b| b).count() as u64;
        let n_prev = p.previous.iter().filter(|&&b| b).count() as u64;
        let n_hinted = p.hinted.iter().filter(|&&b| b).count() as u64;
        let n_cold = [0, 1].map(|i| p.cold[i].iter().filter(|&&b| b).count() as u64);
        let (mut hr, mut hp, mut ha, mut hh) = (0u64, 0u64, 0u64, 0u64);
        let mut hit_cold = [0u64; 2];
        for &id in ids {
            hr += p.router[id] as u64;
            hp += p.previous[id] as u64;
            ha += (p.router[id] || p.previous[id]) as u64;
            hh += p.hinted[id] as u64;
            hit_cold[0] += p.cold[0][id] as u64;
            hit_cold[1] += p.cold[1][id] as u64;
        }
        c.predicted_router.fetch_add(n_router, Relaxed);
        c.predicted_previous.fetch_add(n_prev, Relaxed);
        if n_router > 0 {
            c.routed_router.fetch_add(routed, Relaxed);
            c.recalled_router.fetch_add(hr, Relaxed);
        }
        if n_prev > 0 {
            c.routed_previous.fetch_add(routed, Relaxed);
            c.recalled_previous.fetch_add(hp, Relaxed);
        }
        if n_router + n_prev > 0 {
            c.routed_any.fetch_add(routed, Relaxed);
            c.recalled_any.fetch_add(ha, Relaxed);
        }
        c.prefetch_useful.fetch_add(hh, Relaxed);
        c.prefetch_wasted.fetch_add(n_hinted - hh, Relaxed);
        p.router.fill(false);
        p.previous.fill(false);
        p.hinted.fill(false);
        for i in 0..2 {
            if n_cold[i] > 0 {
                let now = hit_cold[i] as f64 / n_cold[i] as f64;
                p.precision[i] = (1.0 - PRECISION_ALPHA) * p.precision[i] + PRECISION_ALPHA * now;
            }
            p.cold[i].fill(false);
        }
        p.last = ids.to_vec();
    }

    /// Record `who`'s prediction `ids` for this layer's next call (ids out of range are
    /// ignored) and return the predicted experts that are not resident (what a prefetch would
    /// read) and `who`'s running precision in this layer (the gate compares it with
    /// `prefetch_min_precision`).
    pub(super) fn note_prediction(&self, ids: &[usize], who: Predictor) -> (Vec<usize>, f64) {
        let n = self.locs.len();
        let cold: Vec<usize> = {
            let cache = lock(&self.cache);
            ids.iter()
                .copied()
                .filter(|&i| i < n && cache.is_empty(i))
                .collect()
        };
        let mut p = lock(&self.pred);
        let set = match who {
            Predictor::Router => &mut p.router,
            Predictor::Previous => &mut p.previous,
        };
        for &id in ids.iter().filter(|&&i| i < n) {
            set[id] = true;
        }
        for &id in &cold {
            p.cold[who as usize][id] = true;
        }
        (cold, p.precision[who as usize])
    }
}
