//! The routing workload generator: per row and MoE layer a top-k expert set with GLM-5.2's
//! statistics (docs/expert-store.md, "The routing workload").
//!
//! Each layer is a router over latent scores, as a real router is (scores = h·Wᵀ + bias):
//!
//! ```text
//! score_t(e) = bias(e) + a·⟨w_e, z_t⟩ + κ·[e ∈ row_{t−1}] + ε_t(e),   row_t = top-k(score_t)
//! z_t = τ·m_c + y_t,   y_t = ρ·y_{t−1} + √(1−ρ²)·ξ_t        (D = 6 dimensions)
//! ```
//!
//! - `bias` is fitted per layer so each expert's share of rows equals its share in the
//!   histogram (the shipped GLM-5.2 one, or a user's own history) raised to `γ` (the
//!   histogram is itself a 10-topic sample, whose skew the topics inflate: `γ` < 1 is the
//!   flatter population a 10-topic sample of which has the histogram's skew).
//! - `z_t` is the token's hidden state seen by this layer's router (a unit direction `w_e`
//!   per expert, drawn once per layer: the router's weights). Experts whose directions are
//!   close fire together on the same tokens, `a` the strength: it sets the co-activation
//!   lift of the public pairs (GLM-5.2: median 2.94).
//! - `y_t` drifts slowly (`ρ` per token) around the conversation's topic `m_c` (strength
//!   `τ`): a working set that lasts for many tokens, and a hot set per topic. Topics are
//!   drawn from a pool (`WorkloadSpec::topics`), so a user's workload can repeat them.
//! - `κ` (stickiness) favours the experts the previous token routed to: with `ρ` it sets
//!   how many experts consecutive tokens share (GLM-5.2: 41.3%).
//! - The router lookahead sees the next layer's scores through noise `η·ξ` (a fresh normal
//!   per expert): `η` sets its recall (GLM-5.2: 71.6% at top-k).
//! - Speculation: a forward verifies a decode row and `draft_depth` drafts; the first `A` are
//!   accepted with the unconditional per-depth rates published for GLM-5.2's MTP head
//!   (P(A ≥ d) = 0.834 / 0.653 / 0.494). Accepted drafts are the next real tokens; rejected
//!   ones are routed as forks of the row before them, with the same stickiness. Each draft
//!   step also runs the MTP layer (its own router; the histogram has no MTP layer, so it gets
//!   the median layer's popularity).
//!
//! `κ`, `a`, `γ` and `η` were fitted by [`calibrate`] and are the defaults of [`Knobs`]; `ρ`,
//! `τ` and `D` are assumed (docs/expert-store.md says why). The tests hold a generated
//! workload's statistics to the published targets (±3 points).

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
    /// Strength of each conversation's topic in the hidden state (relative to its drift).
    pub topic: f64,
    /// Noise of the router lookahead's view of the next layer's scores.
    pub lookahead_noise: f64,
    /// Strength of the hidden state in the router's scores (co-activation).
    pub coactivation: f64,
    /// Per-token persistence of the hidden state's drift, in [0, 1).
    pub persistence: f64,
    /// Exponent on the histogram's popularity, in (0, 1] (1: the histogram as it is), when
    /// the histogram is a few-topic sample (`Histogram::topic_sample`): the population whose
    /// 10-topic samples have the sample's skew.
    pub flatten: f64,
}

/// Dimensions of the hidden state the routers see.
pub const LATENT_DIMS: usize = 6;

impl Default for Knobs {
    /// Fitted by [`calibrate`] to GLM-5.2's published figures (overlap 41.3%, lookahead recall
    /// 71.6%, pair lift 2.94, half-share 0.19) on the shipped histogram, 8 layers, 2 seeds;
    /// `topic` and `persistence` assumed.
    fn default() -> Self {
        Knobs {
            stickiness: 1.25,
            topic: 0.8,
            lookahead_noise: 0.66,
            coactivation: 1.45,
            persistence: 0.5,
            flatten: 0.80,
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
    /// Topics the conversations draw from (0: each conversation a topic of its own; n: a
    /// pool of n topics, drawn per conversation, shared by every seed with the same
    /// `topic_seed`, as a user's repeated workload repeats them).
    pub topics: usize,
    pub topic_seed: u64,
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
            topics: 0,
            topic_seed: 0,
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
    /// The sample the public GLM-5.2 file was counted on: 10 conversations (each its own
    /// topic) × 127 decode tokens, over `layers` layers.
    pub fn public_sample(seed: u64, layers: usize, knobs: Knobs) -> WorkloadSpec {
        WorkloadSpec {
            seed,
            layers,
            conversations: 10,
            topics: 0,
            prompt_tokens: 0,
            decode_tokens: 127,
            knobs,
            ..WorkloadSpec::default()
        }
    }

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
        if [k.topic, k.lookahead_noise, k.stickiness, k.coactivation]
            .iter()
            .any(|&x| !(0.0..=16.0).contains(&x))
        {
            return Err(Error::invalid(
                "knobs",
                "topic, stickiness, coactivation and lookahead_noise must be in [0, 16]",
            ));
        }
        let flatten_ok = k.flatten > 0.0 && k.flatten <= 1.0;
        if !((0.0..1.0).contains(&k.persistence) && flatten_ok) {
            return Err(Error::invalid(
                "knobs",
                "persistence must be in [0, 1) and flatten in (0, 1]",
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

/// One layer's router: each expert's fitted bias and its unit direction in the hidden state
/// (`LATENT_DIMS` per expert, row-major).
#[derive(Debug, Clone)]
struct LayerModel {
    bias: Vec<f64>,
    dirs: Vec<f64>,
}

/// The router directions of one layer: fixed by the layer (a model's weights), not by the seed.
fn directions(n: usize, layer_stream: u64) -> Vec<f64> {
    let mut rng = Rng::new(0xD1_2EC7, layer_stream);
    let mut w = vec![0.0f64; n * LATENT_DIMS];
    for row in w.chunks_mut(LATENT_DIMS) {
        for x in row.iter_mut() {
            *x = rng.normal();
        }
        let norm = row.iter().map(|x| x * x).sum::<f64>().sqrt().max(1e-12);
        for x in row.iter_mut() {
            *x /= norm;
        }
    }
    w
}

/// `p` (inclusion probabilities summing to `k`) raised to `gamma`, rescaled to sum to `k`,
/// capped below 1 (the excess spread over the rest).
fn flattened(p: &[f64], k: usize, gamma: f64) -> Vec<f64> {
    let raw: Vec<f64> = p.iter().map(|&x| x.max(1e-12).powf(gamma)).collect();
    let total: f64 = raw.iter().sum::<f64>().max(1e-12);
    let mut q: Vec<f64> = raw.iter().map(|&x| x / total * k as f64).collect();
    for _ in 0..8 {
        let over: f64 = q.iter().filter(|&&x| x > 0.99).map(|&x| x - 0.99).sum();
        if over <= 0.0 {
            break;
        }
        let under: f64 = q.iter().filter(|&&x| x <= 0.99).sum();
        for x in q.iter_mut() {
            *x = if *x > 0.99 {
                0.99
            } else {
                *x * (1.0 + over / under)
            };
        }
    }
    q
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
    /// The hidden state's drift around the topic.
    drift: [f64; LATENT_DIMS],
}

struct LayerState {
    real: Chain,
    fork: Chain,
    /// This conversation's topic in the hidden state.
    topic: [f64; LATENT_DIMS],
    rng: Rng,
    scores: Vec<f64>,
    /// The deterministic part of the last step's scores (all but the fresh noise).
    means: Vec<f64>,
    idx: Vec<u16>,
}

/// A standard normal vector of the hidden state's size.
fn normal_vec(rng: &mut Rng) -> [f64; LATENT_DIMS] {
    let mut v = [0.0; LATENT_DIMS];
    for x in v.iter_mut() {
        *x = rng.normal();
    }
    v
}

impl LayerState {
    /// A conversation's start on one layer: `topic` its topic vector, `rng` its own numbers.
    fn new(n: usize, topic: [f64; LATENT_DIMS], mut rng: Rng) -> Self {
        let real = Chain {
            prev: vec![false; n],
            drift: normal_vec(&mut rng),
        };
        LayerState {
            fork: real.clone(),
            real,
            topic,
            rng,
            scores: vec![0.0; n],
            means: vec![0.0; n],
            idx: (0..n as u16).collect(),
        }
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
        let rho = knobs.persistence;
        let fresh = (1.0 - rho * rho).sqrt();
        let mut z = [0.0; LATENT_DIMS];
        {
            let chain = if fork { &mut self.fork } else { &mut self.real };
            for (d, zd) in z.iter_mut().enumerate() {
                chain.drift[d] = rho * chain.drift[d] + fresh * self.rng.normal();
                *zd = knobs.coactivation * (knobs.topic * self.topic[d] + chain.drift[d]);
            }
        }
        let chain = if fork { &self.fork } else { &self.real };
        for i in 0..self.scores.len() {
            let w = &model.dirs[i * LATENT_DIMS..(i + 1) * LATENT_DIMS];
            let latent: f64 = w.iter().zip(&z).map(|(a, b)| a * b).sum();
            let m = model.bias[i] + latent + if chain.prev[i] { knobs.stickiness } else { 0.0 };
            self.means[i] = m;
            self.scores[i] = m + self.rng.normal();
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
fn refit_on_process(
    bias: &mut [f64],
    dirs: &[f64],
    target: &[f64],
    k: usize,
    knobs: &Knobs,
    seed: u64,
) {
    let n = bias.len();
    let spread = latent_spread(knobs);
    for iter in 0..4u64 {
        let model = LayerModel {
            bias: bias.to_vec(),
            dirs: dirs.to_vec(),
        };
        let mut est = vec![0.0f64; n];
        for conv in 0..16u64 {
            let mut rng = Rng::new(seed, 0xF17 + iter * 64 + conv);
            let topic = normal_vec(&mut rng);
            let mut st = LayerState::new(n, topic, rng);
            for _ in 0..150 {
                st.step(&model, knobs, false, k, None);
                let mut sorted = st.scores.clone();
                sorted.select_nth_unstable_by(k, |x, y| y.total_cmp(x));
                let kth = sorted[..k].iter().copied().fold(f64::INFINITY, f64::min);
                let theta = 0.5 * (kth + sorted[k]);
                for (e, m) in est.iter_mut().zip(&st.means) {
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

/// The spread of a score's stationary law: the fresh noise and the hidden state's part.
fn latent_spread(k: &Knobs) -> f64 {
    (1.0 + k.coactivation * k.coactivation * (1.0 + k.topic * k.topic)).sqrt()
}

impl Workload {
    /// A generator for `spec` over `hist` (its layers evenly spaced to `spec.layers`).
    pub fn new(hist: &Histogram, spec: WorkloadSpec) -> crate::Result<Self> {
        spec.validate()?;
        let chosen: Vec<&LayerHistogram> = hist.spaced_layers(spec.layers);
        let kn = spec.knobs;
        let spread = latent_spread(&kn);
        let fit = |l: &LayerHistogram, seed: u64, stream: u64| {
            // Only a few-topic sample is flattened to its population (see `Knobs::flatten`).
            let gamma = if hist.topic_sample { kn.flatten } else { 1.0 };
            let target = flattened(&hist.inclusion(l), hist.top_k, gamma);
            let dirs = directions(hist.experts, stream);
            let mut bias = fit_biases(&target, hist.top_k, spread, seed);
            refit_on_process(&mut bias, &dirs, &target, hist.top_k, &spec.knobs, seed);
            LayerModel { bias, dirs }
        };
        let models = chosen
            .par_iter()
            .map(|l| fit(l, spec.seed ^ l.layer as u64, l.layer as u64))
            .collect();
        let layers: Vec<usize> = chosen.iter().map(|l| l.layer).collect();
        let (mtp_layer, mtp_model) = if spec.mtp && spec.draft_depth > 0 {
            // The MTP layer is not in the histogram: give it the median layer's popularity.
            let mid = &hist.layers[hist.layers.len() / 2];
            let last = hist.layers.iter().map(|l| l.layer).max().unwrap_or(0);
            (
                Some(last + 1),
                Some(fit(mid, spec.seed ^ 0x3750, (last + 1) as u64)),
            )
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
        // The conversation's topic: its own, or one of the pool's (same pool for every seed).
        let topic_of = |layer_stream: u64| -> [f64; LATENT_DIMS] {
            if spec.topics == 0 {
                normal_vec(&mut Rng::new(
                    spec.seed,
                    0x7091_C000_0000 + ((conv as u64) << 16) + layer_stream,
                ))
            } else {
                let pick =
                    Rng::new(spec.seed, 0x7091_CB00 + conv as u64).next_u64() % spec.topics as u64;
                normal_vec(&mut Rng::new(
                    spec.topic_seed,
                    0x7091_C000_0000 + (pick << 16) + layer_stream,
                ))
            }
        };
        let columns: Vec<Vec<RoutedRow>> = self
            .models
            .par_iter()
            .enumerate()
            .map(|(li, model)| {
                let stream = ((conv as u64) << 20) | li as u64;
                let topic = topic_of(self.layers[li] as u64);
                let mut st = LayerState::new(self.experts, topic, Rng::new(spec.seed, stream));
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
            let topic = topic_of(self.mtp_layer.unwrap_or(0) as u64);
            let mut st = LayerState::new(self.experts, topic, Rng::new(spec.seed, stream));
            for &row in &mtp_rows {
                let (ids, _) = st.step(model, &knobs, false, k, None);
                trace.rows[row].experts.push(ids);
            }
        }
        debug_assert!(trace.rows[base..].iter().all(|r| !r.experts.is_empty()));
    }
}

pub use super::calibrate::{calibrate, measure, Targets, GLM52_TARGETS};
