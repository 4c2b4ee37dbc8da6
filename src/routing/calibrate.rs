//! Fitting the routing workload's knobs to published figures: [`measure`] a generated
//! workload's statistics on the sample the public file was counted on, and [`calibrate`] the
//! knobs to [`Targets`] by bisection (docs/expert-store.md, "The routing workload").

use super::histogram::Histogram;
use super::workload::{Knobs, Workload, WorkloadSpec};

/// The published figures [`calibrate`] fits the knobs to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Targets {
    pub consecutive_overlap: f64,
    pub lookahead_recall: f64,
    pub pair_lift: f64,
    /// Median share of a layer's experts holding half its selections.
    pub half_share: f64,
}

/// GLM-5.2's (../shared/routing/README.md): 41.3% overlap, 71.6% one-layer lookahead recall,
/// median lift 2.94 of the shipped file's co-activated pairs, 49 of 256 experts holding half
/// of a layer's selections.
pub const GLM52_TARGETS: Targets = Targets {
    consecutive_overlap: 0.413,
    lookahead_recall: 0.716,
    pair_lift: 2.94,
    half_share: 49.0 / 256.0,
};

/// The statistics [`calibrate`] matches, measured on the sample the public file was counted
/// on (10 conversations of 10 topics × 127 decode tokens, pairs as the file selected them),
/// averaged over `seeds` seeds.
pub fn measure(hist: &Histogram, knobs: Knobs, layers: usize, seeds: u64) -> Targets {
    let mut acc = Targets {
        consecutive_overlap: 0.0,
        lookahead_recall: 0.0,
        pair_lift: 0.0,
        half_share: 0.0,
    };
    for seed in 1..=seeds {
        let spec = WorkloadSpec::public_sample(seed, layers, knobs);
        let s = match Workload::new(hist, spec) {
            Ok(w) => super::stats::TraceStats::of(&w.generate()),
            Err(_) => continue,
        };
        acc.consecutive_overlap += s.consecutive_overlap / seeds as f64;
        acc.lookahead_recall += s.lookahead_recall / seeds as f64;
        acc.pair_lift += s.pair_lift / seeds as f64;
        acc.half_share += s.half_share / seeds as f64;
    }
    acc
}

/// Fit [`Knobs`] to `targets` on `hist`, starting from `start` (whose `topic` and
/// `persistence` are kept: assumptions, see docs/expert-store.md): two rounds of stickiness by
/// bisection on the overlap, coactivation on the pair lift and flatten on the half-share,
/// then lookahead noise on the recall (the noise does not change the routed rows). Takes a
/// few minutes; the defaults were fitted with it.
pub fn calibrate(
    hist: &Histogram,
    targets: Targets,
    start: Knobs,
    layers: usize,
    seeds: u64,
) -> Knobs {
    let bisect = |lo: f64, hi: f64, rising: bool, target: f64, f: &dyn Fn(f64) -> f64| {
        let (mut lo, mut hi) = (lo, hi);
        for _ in 0..8 {
            let mid = 0.5 * (lo + hi);
            if (f(mid) < target) == rising {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    };
    let m = |k: Knobs| measure(hist, k, layers, seeds);
    let mut k = start;
    for _ in 0..2 {
        let kk = k;
        k.coactivation = bisect(0.0, 4.0, true, targets.pair_lift, &|a| {
            m(Knobs {
                coactivation: a,
                ..kk
            })
            .pair_lift
        });
        let kk = k;
        k.flatten = bisect(0.4, 1.0, false, targets.half_share, &|g| {
            m(Knobs { flatten: g, ..kk }).half_share
        });
        let kk = k;
        k.stickiness = bisect(0.0, 4.0, true, targets.consecutive_overlap, &|a| {
            m(Knobs {
                stickiness: a,
                ..kk
            })
            .consecutive_overlap
        });
    }
    let kk = k;
    k.lookahead_noise = bisect(0.0, 4.0, false, targets.lookahead_recall, &|n| {
        m(Knobs {
            lookahead_noise: n,
            ..kk
        })
        .lookahead_recall
    });
    k
}
