//! The routing workload generator: per row and MoE layer a top-k expert set with GLM-5.2's
//! statistics (docs/expert-store.md, "The routing workload").
//!
//! Each layer is a router over latent scores, as a real router is (scores = h·Wᵀ + bias):
//!
//! ```text
//! score_t(e) = bias(e) + τ·u_c(e) + κ·[e ∈ row_{t−1}] + ε_t(e),   row_t = top-k(score_t)
//! ```
//!
//! - `bias` is fitted per layer so each expert's share of rows equals its share in the
//!   histogram (the shipped GLM-5.2 one, or a user's own history): the skew.
//! - `κ` (stickiness) favours the experts the previous token routed to: it sets how many
//!   experts consecutive tokens share (GLM-5.2: 41.3%).
//! - `u_c` is drawn per conversation and layer: each conversation (topic) has its own hot
//!   set, `τ` its strength. `τ` is held small (0.1): at 0.2 a fresh per-layer LRU of 65
//!   slots already hits 66% on 16 layers, above the field's 57% ± 5 (docs/expert-store.md).
//! - The router lookahead sees the next layer's scores through noise `η·ξ` (a fresh normal
//!   per expert): `η` sets its recall (GLM-5.2: 71.6% at top-k).
//! - Speculation: a forward verifies a decode row and `draft_depth` drafts; the first `A` are
//!   accepted with the unconditional per-depth rates published for GLM-5.2's MTP head
//!   (P(A ≥ d) = 0.834 / 0.653 / 0.494). Accepted drafts are the next real tokens; rejected
//!   ones are routed as forks of the row before them, with the same stickiness. Each draft
//!   step also runs the MTP layer (its own router; the histogram has no MTP layer, so it gets
//!   the median layer's popularity).
//!
//! `κ` and `η` were fitted by [`calibrate`] and are the defaults of [`Knobs`]; the tests hold
//! a generated workload's statistics to the published targets (±3 points).

use rayon::prelude::*;

use super::histogram::{Histogram, LayerHistogram};
use super::rng::{normal_quantile, Rng};
use super::trace::{Row, RowKind, Trace};

/// The generator's constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Knobs {
    /// Score bonus of the experts the previous token routed to (consecutive tokens sharing
    /// experts, without the slow drift that would also make tokens ten apart share them).
    pub stickiness: f64,
    /// Strength of each conversation's own hot set.
    pub topic: f64,
    /// Noise of the router lookahead's view of the next layer's scores.
    pub lookahead_noise: f64,
}

impl Default for Knobs {
    /// Fitted by [`calibrate`] to GLM-5.2's published figures (overlap 41.3%, lookahead recall
    /// 71.6%) on the shipped histogram, 8 layers, 2 seeds.
    fn default() -> Self {
        Knobs {
            stickiness: 1.65,
            topic: 0.10,
            lookahead_noise: 0.41,
        }
    }
}

/// What to generate.
#[derive(Debug, Clone, PartialEq)]
pub struct WorkloadSpec {
    pub seed: u64,
    /// MoE layers, evenly spaced over the histogram's (0: all of them).
    pub layers: usize,
    pub conversations: usize,
    /// Prompt tokens per conversation (prefill rows).
    pub prompt_tokens: usize,
    /// Tokens generated per conversation.
    pub decode_tokens: usize,
    /// Prefill rows per forward.
    pub prefill_chunk: usize,
    /// Drafts per verify forward (0: plain decoding).
    pub draft_depth: usize,
    /// P(the first d drafts are all accepted), d = 1, 2, ...; the last value repeats.
    pub acceptance: Vec<f64>,
    /// Emit the MTP layer's rows (one per draft step).
    pub mtp: bool,
    /// Emit the router lookahead's predictions on decode and draft rows.
    pub lookahead: bool,
    pub knobs: Knobs,
}

/// GLM-5.2's MTP acceptance per depth (llama.cpp, fully resident, greedy; unconditional).
pub const GLM52_ACCEPTANCE: [f64; 3] = [0.834, 0.653, 0.494];

impl Default for WorkloadSpec {
    fn default() -> Self {
        WorkloadSpec {
            seed: 1,
            layers: 0,
            conversations: 12,
            prompt_tokens: 256,
            decode_tokens: 256,
            prefill_chunk: 512,
            draft_depth: 0,
            acceptance: GLM52_ACCEPTANCE.to_vec(),
            mtp: false,
            lookahead: true,
            knobs: Knobs::default(),
        }
    }
}

impl WorkloadSpec {
    /// Check the parameters (one message per mistake).
    pub fn validate(&self) -> crate::Result<()> {
        use crate::Error;
        if self.conversations == 0 || self.decode_tokens + self.prompt_tokens == 0 {
            return Err(Error::invalid(
                "workload",
                "needs at least one conversation with at least one token",
            ));
        }
        if self.prefill_chunk == 0 {
            return Err(Error::invalid("prefill_chunk", "must be at least 1"));
        }
        if self.draft_depth > 16 {
            return Err(Error::invalid("draft_depth", "must be at most 16"));
        }
        if self.draft_depth > 0
            && (self.acceptance.is_empty()
                || self.acceptance.iter().any(|p| !(0.0..=1.0).contains(p))
                || self.acceptance.windows(2).any(|w| w[1] > w[0]))
        {
            return Err(Error::invalid(
                "acceptance",
                "give P(first d drafts accepted) for d = 1, 2, ...: each in [0, 1], not increasing",
            ));
        }
        let k = self.knobs;
        if [k.topic, k.lookahead_noise, k.stickiness]
            .iter()
            .any(|&x| !(0.0..=16.0).contains(&x))
        {
            return Err(Error::invalid(
                "knobs",
                "topic, stickiness and lookahead_noise must be in [0, 16]",
            ));
        }
        Ok(())
    }

    fn acceptance_at(&self, d: usize) -> f64 {
        let a = &self.acceptance;
        a.get(d - 1).or(a.last()).copied().unwrap_or(0.0)
    }
}

/// Standard normal upper tail, 1 − Φ(x) (erfc by Numerical Recipes' Chebyshev fit, |ε| < 1.2e-7).
fn upper_tail(x: f64) -> f64 {
    let z = x.abs() / std::f64::consts::SQRT_2;
    let t = 1.0 / (1.0 + 0.5 * z);
    let poly = -z * z - 1.265_512_23
        + t * (1.000_023_68
            + t * (0.374_091_96
                + t * (0.096_784_18
                    + t * (-0.186_288_06
                        + t * (0.278_868_07
                            + t * (-1.135_203_98
                                + t * (1.488_515_87 + t * (-0.822_152_23 + t * 0.170_872_77))))))));
    let erfc = t * poly.exp();
    if x >= 0.0 {
        0.5 * erfc
    } else {
        1.0 - 0.5 * erfc
    }
}

/// Fit each expert's bias so its share of rows is `target` (inclusion probabilities summing
/// to `k`) when scores are `bias + spread·N(0,1)` (the stationary law of every row, whatever
/// the persistence). Start from the mean-field solution (a common threshold 0), then correct
/// with the exact thresholds of sampled rows: given a row's k-th and (k+1)-th scores,
/// expert e is in that row's top-k with probability ≈ P(bias_e + spread·N > θ), averaged over
/// rows (a smooth estimate, so rare experts need few samples).
pub fn fit_biases(target: &[f64], k: usize, spread: f64, seed: u64) -> Vec<f64> {
    let n = target.len();
    let mut bias: Vec<f64> = target
        .iter()
        .map(|&p| spread * normal_quantile(1.0 - p))
        .map(|x| -x)
        .collect();
    let mut rng = Rng::new(seed, 0xB1A5);
    let mut scores = vec![0.0f64; n];
    const SAMPLES: usize = 400;
    for _ in 0..4 {
        let mut est = vec![0.0f64; n];
        for _ in 0..SAMPLES {
            for (s, b) in scores.iter_mut().zip(&bias) {
                *s = b + spread * rng.normal();
            }
            let mut sorted = scores.clone();
            sorted.select_nth_unstable_by(k, |a, b| b.total_cmp(a));
            // The threshold between the k-th and the (k+1)-th score.
            let kth = sorted[..k].iter().copied().fold(f64::INFINITY, f64::min);
            let theta = 0.5 * (kth + sorted[k]);
            for (e, b) in est.iter_mut().zip(&bias) {
                *e += upper_tail((theta - b) / spread);
            }
        }
        let total: f64 = est.iter().sum();
        for (i, b) in bias.iter_mut().enumerate() {
            let f = (est[i] / total * k as f64).clamp(1e-9, 1.0 - 1e-9);
            let p = target[i].clamp(1e-9, 1.0 - 1e-9);
            *b += spread * (normal_quantile(p) - normal_quantile(f));
        }
    }
    bias
}

/// One layer's router: each expert's fitted bias.
#[derive(Debug, Clone)]
struct LayerModel {
    bias: Vec<f64>,
}

/// A calibrated generator for one histogram.
#[derive(Debug, Clone)]
pub struct Workload {
    pub spec: WorkloadSpec,
    pub layers: Vec<usize>,
    pub experts: usize,
    pub top_k: usize,
    pub mtp_layer: Option<usize>,
    models: Vec<LayerModel>,
    mtp_model: Option<LayerModel>,
    pub source: String,
}

/// One slot of the row schedule of a conversation.
#[derive(Debug, Clone, Copy)]
enum Step {
    /// A real token: advance the layer's process.
    Real,
    /// A rejected draft: a fork of the previous row (real or fork) that the real process
    /// does not follow.
    Fork,
}

struct Slot {
    row: usize,
    step: Step,
    lookahead: bool,
}

/// Where a layer's process is in one conversation: the previous row's experts, for the
/// real token stream and for a chain of rejected drafts forked off it.
#[derive(Clone)]
struct Chain {
    prev: Vec<bool>,
}

struct LayerState {
    real: Chain,
    fork: Chain,
    /// This conversation's hot set (a standard normal per expert).
    u: Vec<f64>,
    rng: Rng,
    scores: Vec<f64>,
    idx: Vec<u16>,
}

impl LayerState {
    fn new(n: usize, mut rng: Rng) -> Self {
        let u: Vec<f64> = (0..n).map(|_| rng.normal()).collect();
        let real = Chain {
            prev: vec![false; n],
        };
        LayerState {
            fork: real.clone(),
            real,
            u,
            rng,
            scores: vec![0.0; n],
            idx: (0..n as u16).collect(),
        }
    }

    /// The deterministic part of expert `i`'s next score on `chain`.
    fn mean(&self, model: &LayerModel, knobs: &Knobs, chain: &Chain, i: usize) -> f64 {
        model.bias[i] + knobs.topic * self.u[i] + if chain.prev[i] { knobs.stickiness } else { 0.0 }
    }

    /// The next row of the real stream (or of the fork): score, take the top-k, and (with
    /// `noise`) also what the router lookahead would have predicted.
    fn step(
        &mut self,
        model: &LayerModel,
        knobs: &Knobs,
        fork: bool,
        k: usize,
        noise: Option<f64>,
    ) -> RoutedRow {
        for i in 0..self.scores.len() {
            let chain = if fork { &self.fork } else { &self.real };
            self.scores[i] = self.mean(model, knobs, chain, i) + self.rng.normal();
        }
        let ids = top_k_of(&self.scores, &mut self.idx, k);
        let pred = noise.map(|eta| {
            let noisy: Vec<f64> = self
                .scores
                .iter()
                .map(|&s| s + eta * self.rng.normal())
                .collect();
            top_k_of(&noisy, &mut self.idx, k)
        });
        let chain = if fork { &mut self.fork } else { &mut self.real };
        chain.prev.fill(false);
        for &e in &ids {
            chain.prev[e as usize] = true;
        }
        (ids, pred)
    }
}

/// A row's experts and, where asked, the router lookahead's prediction of them.
type RoutedRow = (Vec<u16>, Option<Vec<u16>>);

/// The `k` highest of `scores`, best first (the router's order, so a trace can be cut to
/// fewer experts per token); `idx` is scratch holding a permutation.
fn top_k_of(scores: &[f64], idx: &mut [u16], k: usize) -> Vec<u16> {
    let by_score = |a: &u16, b: &u16| {
        scores[*b as usize]
            .total_cmp(&scores[*a as usize])
            .then(a.cmp(b))
    };
    idx.select_nth_unstable_by(k - 1, by_score);
    let mut out = idx[..k].to_vec();
    out.sort_unstable_by(by_score);
    out
}

/// Refit `bias` on the process itself (stickiness and topics change each expert's share from
/// what the plain score law gives): run 8 conversations × 250 rows and move each bias by the
/// normal-quantile gap between its target share and its smoothed share (each row's
/// probability of including the expert given the row's threshold and everything but the
/// row's fresh noise).
fn refit_on_process(bias: &mut [f64], target: &[f64], k: usize, knobs: &Knobs, seed: u64) {
    let n = bias.len();
    let spread = (1.0 + knobs.topic * knobs.topic).sqrt();
    for iter in 0..4u64 {
        let model = LayerModel {
            bias: bias.to_vec(),
        };
        let mut est = vec![0.0f64; n];
        for conv in 0..8u64 {
            let mut st = LayerState::new(n, Rng::new(seed, 0xF17 + iter * 64 + conv));
            for _ in 0..250 {
                let mean: Vec<f64> = (0..n)
                    .map(|i| st.mean(&model, knobs, &st.real, i))
                    .collect();
                st.step(&model, knobs, false, k, None);
                let mut sorted = st.scores.clone();
                sorted.select_nth_unstable_by(k, |x, y| y.total_cmp(x));
                let kth = sorted[..k].iter().copied().fold(f64::INFINITY, f64::min);
                let theta = 0.5 * (kth + sorted[k]);
                for (e, m) in est.iter_mut().zip(&mean) {
                    *e += upper_tail(theta - m);
                }
            }
        }
        let total: f64 = est.iter().sum();
        for (i, b) in bias.iter_mut().enumerate() {
            let f = (est[i] / total * k as f64).clamp(1e-9, 1.0 - 1e-9);
            let p = target[i].clamp(1e-9, 1.0 - 1e-9);
            *b += spread * (normal_quantile(p) - normal_quantile(f));
        }
    }
}

impl Workload {
    /// A generator for `spec` over `hist` (its layers evenly spaced to `spec.layers`).
    pub fn new(hist: &Histogram, spec: WorkloadSpec) -> crate::Result<Self> {
        spec.validate()?;
        let chosen: Vec<&LayerHistogram> = hist.spaced_layers(spec.layers);
        let kn = spec.knobs;
        let spread = (1.0 + kn.topic * kn.topic).sqrt();
        let fit = |l: &LayerHistogram, seed: u64| {
            let target = hist.inclusion(l);
            let mut bias = fit_biases(&target, hist.top_k, spread, seed);
            refit_on_process(&mut bias, &target, hist.top_k, &spec.knobs, seed);
            LayerModel { bias }
        };
        let models = chosen
            .par_iter()
            .map(|l| fit(l, spec.seed ^ l.layer as u64))
            .collect();
        let layers: Vec<usize> = chosen.iter().map(|l| l.layer).collect();
        let (mtp_layer, mtp_model) = if spec.mtp && spec.draft_depth > 0 {
            // The MTP layer is not in the histogram: give it the median layer's popularity.
            let mid = &hist.layers[hist.layers.len() / 2];
            let last = hist.layers.iter().map(|l| l.layer).max().unwrap_or(0);
            (Some(last + 1), Some(fit(mid, spec.seed ^ 0x3750)))
        } else {
            (None, None)
        };
        Ok(Workload {
            layers,
            experts: hist.experts,
            top_k: hist.top_k,
            mtp_layer,
            models,
            mtp_model,
            source: hist.source.clone(),
            spec,
        })
    }

    /// Generate the trace.
    pub fn generate(&self) -> Trace {
        let mut trace = Trace::new(
            self.layers.clone(),
            self.experts,
            self.top_k,
            self.mtp_layer,
        );
        for conv in 0..self.spec.conversations {
            self.conversation(conv, &mut trace);
        }
        trace
    }

    /// Append conversation `conv`: its rows (schedule first, then each layer's column).
    fn conversation(&self, conv: usize, trace: &mut Trace) {
        let spec = &self.spec;
        let mut sched = Rng::new(spec.seed, 0x5C4E_D000 + conv as u64);
        let first_forward = trace.rows.last().map_or(0, |r| r.forward + 1);
        let base = trace.rows.len();
        let mut slots: Vec<Slot> = Vec::new();
        let mut mtp_rows: Vec<usize> = Vec::new();
        let mut forward = first_forward;
        let push = |trace: &mut Trace, kind, forward, accepted| {
            trace.rows.push(Row {
                forward,
                conv: conv as u32,
                kind,
                experts: Vec::new(),
                lookahead: None,
                accepted,
            });
            trace.rows.len() - 1
        };
        for start in (0..spec.prompt_tokens).step_by(spec.prefill_chunk) {
            for _ in start..(start + spec.prefill_chunk).min(spec.prompt_tokens) {
                let row = push(trace, RowKind::Prompt, forward, None);
                slots.push(Slot {
                    row,
                    step: Step::Real,
                    lookahead: false,
                });
            }
            forward += 1;
        }
        let mut generated = 0;
        while generated < spec.decode_tokens {
            let depth = spec.draft_depth.min(spec.decode_tokens - generated - 1);
            let u = sched.uniform();
            let accepted = (1..=depth)
                .take_while(|&d| u < spec.acceptance_at(d))
                .count();
            if self.mtp_model.is_some() {
                for _ in 0..depth {
                    mtp_rows.push(push(trace, RowKind::Mtp, forward, None));
                }
            }
            let row = push(trace, RowKind::Decode, forward, None);
            slots.push(Slot {
                row,
                step: Step::Real,
                lookahead: spec.lookahead,
            });
            for d in 1..=depth {
                let ok = d <= accepted;
                let row = push(trace, RowKind::Draft, forward, Some(ok));
                let step = if ok { Step::Real } else { Step::Fork };
                slots.push(Slot {
                    row,
                    step,
                    lookahead: spec.lookahead,
                });
            }
            generated += accepted + 1;
            forward += 1;
        }
        let k = self.top_k;
        let knobs = spec.knobs;
        let columns: Vec<Vec<RoutedRow>> = self
            .models
            .par_iter()
            .enumerate()
            .map(|(li, model)| {
                let stream = ((conv as u64) << 20) | li as u64;
                let mut st = LayerState::new(self.experts, Rng::new(spec.seed, stream));
                let mut forked = false;
                slots
                    .iter()
                    .map(|s| {
                        let fork = matches!(s.step, Step::Fork);
                        if fork && !forked {
                            st.fork = st.real.clone();
                        }
                        forked = fork;
                        let noise = s.lookahead.then_some(knobs.lookahead_noise);
                        st.step(model, &knobs, fork, k, noise)
                    })
                    .collect()
            })
            .collect();
        for column in columns {
            for (s, (ids, pred)) in slots.iter().zip(column) {
                let r = &mut trace.rows[s.row];
                r.experts.push(ids);
                if let Some(p) = pred {
                    r.lookahead.get_or_insert_with(Vec::new).push(p);
                }
            }
        }
        if let Some(model) = &self.mtp_model {
            let stream = ((conv as u64) << 20) | 0xFFFFF;
            let mut st = LayerState::new(self.experts, Rng::new(spec.seed, stream));
            for &row in &mtp_rows {
                let (ids, _) = st.step(model, &knobs, false, k, None);
                trace.rows[row].experts.push(ids);
            }
        }
        debug_assert!(trace.rows[base..].iter().all(|r| !r.experts.is_empty()));
    }
}

/// The published figures [`calibrate`] fits the knobs to.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Targets {
    pub consecutive_overlap: f64,
    pub lookahead_recall: f64,
    pub pair_lift: f64,
}

/// GLM-5.2's (../shared/routing/README.md): 41.3% overlap, 71.6% one-layer lookahead recall,
/// median lift 2.94 of the shipped file's co-activated pairs.
pub const GLM52_TARGETS: Targets = Targets {
    consecutive_overlap: 0.413,
    lookahead_recall: 0.716,
    pair_lift: 2.94,
};

/// The statistics [`calibrate`] matches, measured on the sample the public file was counted
/// on (10 conversations × 127 decode tokens), averaged over `seeds` seeds.
pub fn measure(hist: &Histogram, knobs: Knobs, layers: usize, seeds: u64) -> Targets {
    let mut acc = Targets {
        consecutive_overlap: 0.0,
        lookahead_recall: 0.0,
        pair_lift: 0.0,
    };
    for seed in 1..=seeds {
        let spec = WorkloadSpec {
            seed,
            layers,
            conversations: 10,
            prompt_tokens: 0,
            decode_tokens: 127,
            knobs,
            ..WorkloadSpec::default()
        };
        let s = match Workload::new(hist, spec) {
            Ok(w) => super::stats::TraceStats::of(&w.generate()),
            Err(_) => continue,
        };
        acc.consecutive_overlap += s.consecutive_overlap / seeds as f64;
        acc.lookahead_recall += s.lookahead_recall / seeds as f64;
        acc.pair_lift += s.pair_lift / seeds as f64;
    }
    acc
}

/// Fit [`Knobs`] to `targets` on `hist`, starting from `start` (whose `topic` is kept: it is
/// bounded by the fresh-cache hit rate, not fitted): stickiness by bisection on the overlap,
/// then lookahead noise on the recall (the noise does not change the routed rows). Takes a
/// minute; the defaults were fitted with it.
pub fn calibrate(
    hist: &Histogram,
    targets: Targets,
    start: Knobs,
    layers: usize,
    seeds: u64,
) -> Knobs {
    let bisect = |lo: f64, hi: f64, rising: bool, target: f64, f: &dyn Fn(f64) -> f64| {
        let (mut lo, mut hi) = (lo, hi);
        for _ in 0..10 {
            let mid = 0.5 * (lo + hi);
            if (f(mid) < target) == rising {
                lo = mid;
            } else {
                hi = mid;
            }
        }
        0.5 * (lo + hi)
    };
    let mut k = start;
    let kk = k;
    k.stickiness = bisect(0.0, 6.0, true, targets.consecutive_overlap, &|a| {
        measure(
            hist,
            Knobs {
                stickiness: a,
                ..kk
            },
            layers,
            seeds,
        )
        .consecutive_overlap
    });
    let kk = k;
    k.lookahead_noise = bisect(0.0, 4.0, false, targets.lookahead_recall, &|n| {
        measure(
            hist,
            Knobs {
                lookahead_noise: n,
                ..kk
            },
            layers,
            seeds,
        )
        .lookahead_recall
    });
    k
}
