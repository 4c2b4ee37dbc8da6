//! Per-layer expert popularity: the public GLM-5.2 decode histogram shipped with the crate
//! (`data/glm52-routing-stats.json`, a copy of the file the routing figures cite: 75 MoE
//! layers × 256 experts, top-8, 1,270 greedy decode tokens over 10 prompts in 10 topics, and
//! each layer's 300 most co-activated pairs), or a user's own routing history
//! (`colibri-usage.json`, [`crate::experts::usage`]).

use serde::Deserialize;

use crate::error::{Error, Result};
use crate::experts::usage::UsageCounts;

const GLM52_JSON: &str = include_str!("data/glm52-routing-stats.json");

/// One MoE layer of a routing histogram.
#[derive(Debug, Clone, PartialEq)]
pub struct LayerHistogram {
    /// The model's layer index.
    pub layer: usize,
    /// Tokens (rows) whose top-k held each expert.
    pub heat: Vec<u64>,
    /// Co-activated pairs `(i, j, count, lift, topic_support)` when the source has them.
    pub pairs: Vec<(usize, usize, u64, f64, u32)>,
}

/// Routing counts per MoE layer, and how many rows they were counted over.
#[derive(Debug, Clone, PartialEq)]
pub struct Histogram {
    pub experts: usize,
    pub top_k: usize,
    /// Rows counted (decode tokens for the GLM-5.2 file).
    pub rows: u64,
    pub layers: Vec<LayerHistogram>,
    /// Where the counts come from, for reports.
    pub source: String,
    /// Whether the counts are a short sample of a few topics (the shipped file: 10 topics ×
    /// 127 tokens), whose skew the topics inflate over the population's; a user's history,
    /// counted over their whole workload, is taken as the population.
    pub topic_sample: bool,
}

#[derive(Deserialize)]
struct StatsJson {
    decode_tokens: u64,
    experts_per_layer: usize,
    top_k: usize,
    layers: Vec<LayerJson>,
}

#[derive(Deserialize)]
struct LayerJson {
    layer: usize,
    heat: Vec<u64>,
    pairs: Vec<(usize, usize, u64, f64, u32)>,
}

impl Histogram {
    /// The shipped GLM-5.2 decode histogram.
    pub fn glm52() -> Self {
        // The file is part of the crate and checked by the tests: parsing cannot fail on it.
        let j: StatsJson = match serde_json::from_str(GLM52_JSON) {
            Ok(j) => j,
            Err(e) => unreachable!("the embedded GLM-5.2 routing stats do not parse: {e}"),
        };
        Histogram {
            experts: j.experts_per_layer,
            top_k: j.top_k,
            rows: j.decode_tokens,
            layers: j
                .layers
                .into_iter()
                .map(|l| LayerHistogram {
                    layer: l.layer,
                    heat: l.heat,
                    pairs: l.pairs,
                })
                .collect(),
            source: "GLM-5.2 public decode histogram (1,270 tokens, 10 topics)".into(),
            topic_sample: true,
        }
    }

    /// This histogram's skew carried to a model with `experts` experts per layer routing
    /// `top_k` of them: each layer's popularity curve (sorted counts) resampled at `experts`
    /// evenly spaced ranks and rescaled to `top_k` selections per row. The identity at the
    /// histogram's own shape. Co-activation pairs do not carry over.
    pub fn resized(&self, experts: usize, top_k: usize) -> Result<Self> {
        if experts == self.experts && top_k == self.top_k {
            return Ok(self.clone());
        }
        if experts == 0 || top_k == 0 || top_k >= experts {
            return Err(Error::invalid(
                "history",
                format!("cannot route top-{top_k} of {experts} experts"),
            ));
        }
        let layers = self
            .layers
            .iter()
            .map(|l| {
                let mut sorted = l.heat.clone();
                sorted.sort_unstable_by(|a, b| b.cmp(a));
                let per_row =
                    |v: &[u64]| v.iter().sum::<u64>().max(1) as f64 / self.rows.max(1) as f64;
                // Each new expert takes the mean heat of its slice of the ranks, which keeps
                // the Lorenz curve (the skew) at the slice boundaries.
                let n = sorted.len();
                let picked: Vec<u64> = (0..experts)
                    .map(|i| {
                        let lo = (i * n) / experts;
                        let hi = (((i + 1) * n) / experts).max(lo + 1);
                        sorted[lo..hi].iter().sum::<u64>() / (hi - lo) as u64
                    })
                    .collect();
                let scale = top_k as f64 / per_row(&picked).max(1e-9);
                // Spread the ranks over the ids (a fixed odd stride), as a router's are.
                let mut heat = vec![0u64; experts];
                let gcd = |mut a: usize, mut b: usize| {
                    while b != 0 {
                        (a, b) = (b, a % b);
                    }
                    a
                };
                let stride = (((experts / 2) | 1)..)
                    .step_by(2)
                    .find(|&s| gcd(s, experts) == 1)
                    .unwrap_or(1);
                for (rank, &c) in picked.iter().enumerate() {
                    let id = (rank * stride + l.layer) % experts;
                    heat[id] = (c as f64 * scale).round() as u64;
                }
                LayerHistogram {
                    layer: l.layer,
                    heat,
                    pairs: Vec::new(),
                }
            })
            .collect();
        Ok(Histogram {
            experts,
            top_k,
            rows: self.rows,
            layers,
            source: format!("{}, resized to top-{top_k} of {experts}", self.source),
            topic_sample: self.topic_sample,
        })
    }

    /// A user's routing history as a histogram (`top_k` the model's experts per token). Its
    /// rows are estimated as the largest layer total over `top_k` (the history counts each
    /// expert once per forward that routed to it).
    pub fn from_usage(usage: &UsageCounts, top_k: usize) -> Result<Self> {
        let layers: Vec<LayerHistogram> = usage
            .layers
            .iter()
            .filter(|(_, c)| c.iter().any(|&n| n > 0))
            .map(|(&layer, c)| LayerHistogram {
                layer,
                heat: c.clone(),
                pairs: Vec::new(),
            })
            .collect();
        let Some(first) = layers.first() else {
            return Err(Error::invalid(
                "history",
                "the routing history has no counts yet: generate with the model first, or use \
                 the built-in GLM-5.2 histogram",
            ));
        };
        let experts = first.heat.len();
        if layers.iter().any(|l| l.heat.len() != experts) || top_k == 0 || top_k > experts {
            return Err(Error::invalid(
                "history",
                format!("layers of different sizes, or top_k {top_k} not in 1..={experts}"),
            ));
        }
        let rows = layers
            .iter()
            .map(|l| l.heat.iter().sum::<u64>())
            .max()
            .unwrap_or(0)
            .div_ceil(top_k as u64);
        Ok(Histogram {
            experts,
            top_k,
            rows,
            layers,
            source: "the model's routing history".into(),
            topic_sample: false,
        })
    }

    /// `n` of the layers, evenly spaced from first to last (all of them when `n` is at least
    /// their count): a short stand-in keeps the spread of skews of the whole model.
    pub fn spaced_layers(&self, n: usize) -> Vec<&LayerHistogram> {
        let total = self.layers.len();
        if n >= total || n == 0 {
            return self.layers.iter().collect();
        }
        (0..n)
            .map(|i| &self.layers[if n == 1 { 0 } else { i * (total - 1) / (n - 1) }])
            .collect()
    }

    /// Each expert's probability of being in a row's top-k (they sum to `top_k`), smoothed by
    /// half a count so an expert never seen in a short sample is rare, not impossible.
    pub fn inclusion(&self, layer: &LayerHistogram) -> Vec<f64> {
        let raw: Vec<f64> = layer.heat.iter().map(|&h| h as f64 + 0.5).collect();
        let total: f64 = raw.iter().sum();
        let k = self.top_k as f64;
        let mut p: Vec<f64> = raw.iter().map(|&x| x / total * k).collect();
        // A probability above 1 cannot be an inclusion probability: cap and redistribute.
        for _ in 0..8 {
            let over: f64 = p.iter().filter(|&&x| x > 0.99).map(|&x| x - 0.99).sum();
            if over <= 0.0 {
                break;
            }
            let under: f64 = p.iter().filter(|&&x| x <= 0.99).sum();
            for x in p.iter_mut() {
                *x = if *x > 0.99 {
                    0.99
                } else {
                    *x * (1.0 + over / under)
                };
            }
        }
        p
    }
}

/// Skew figures of one layer's counts, as `../shared/routing/README.md` states them.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Skew {
    /// Share of the experts that hold half of the selections.
    pub half_share: f64,
    /// Share of the selections held by the top 10% of experts.
    pub top10_share: f64,
    pub gini: f64,
    /// The hottest expert's selections over the rows counted.
    pub hottest_rate: f64,
}

impl Skew {
    /// The skew of `counts` (selections per expert) over `rows` rows.
    pub fn of(counts: &[u64], rows: u64) -> Skew {
        let mut h: Vec<u64> = counts.to_vec();
        h.sort_unstable_by(|a, b| b.cmp(a));
        let n = h.len().max(1);
        let total: u64 = h.iter().sum::<u64>().max(1);
        let mut acc = 0u64;
        let mut half = n;
        for (i, &x) in h.iter().enumerate() {
            acc += x;
            if 2 * acc >= total {
                half = i + 1;
                break;
            }
        }
        let top10 = h.iter().take(n.div_ceil(10)).sum::<u64>() as f64 / total as f64;
        // Gini over the ascending order: Σ (2i − n − 1) x_i / (n Σ x).
        let gini = h
            .iter()
            .rev()
            .enumerate()
            .map(|(i, &x)| (2.0 * (i + 1) as f64 - n as f64 - 1.0) * x as f64)
            .sum::<f64>()
            / (n as f64 * total as f64);
        Skew {
            half_share: half as f64 / n as f64,
            top10_share: top10,
            gini,
            hottest_rate: h.first().copied().unwrap_or(0) as f64 / rows.max(1) as f64,
        }
    }
}

/// The median of `xs` (0 for none).
pub fn median(mut xs: Vec<f64>) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    xs.sort_unstable_by(f64::total_cmp);
    let m = xs.len() / 2;
    if xs.len() % 2 == 1 {
        xs[m]
    } else {
        0.5 * (xs[m - 1] + xs[m])
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_shipped_histogram_has_the_published_skew() {
        let h = Histogram::glm52();
        assert_eq!(
            (h.layers.len(), h.experts, h.top_k, h.rows),
            (75, 256, 8, 1270)
        );
        let skews: Vec<Skew> = h.layers.iter().map(|l| Skew::of(&l.heat, h.rows)).collect();
        let med = |f: fn(&Skew) -> f64| median(skews.iter().map(f).collect());
        // ../shared/routing/README.md: 49 of 256 hold half, top 10% hold 34%, Gini 0.47,
        // hottest expert fires on 21% of tokens (median over layers).
        assert!((med(|s| s.half_share) * 256.0 - 49.0).abs() <= 1.0);
        assert!((med(|s| s.top10_share) - 0.34).abs() < 0.01);
        assert!((med(|s| s.gini) - 0.47).abs() < 0.035);
        assert!((med(|s| s.hottest_rate) - 0.21).abs() < 0.01);
        assert!(h
            .layers
            .iter()
            .all(|l| l.heat.iter().sum::<u64>() == 1270 * 8));
    }

    #[test]
    fn inclusion_probabilities_sum_to_top_k_and_stay_below_one() {
        let h = Histogram::glm52();
        for l in &h.layers {
            let p = h.inclusion(l);
            assert!((p.iter().sum::<f64>() - 8.0).abs() < 1e-6);
            assert!(p.iter().all(|&x| x > 0.0 && x < 1.0));
        }
    }

    #[test]
    fn resizing_keeps_the_skew_and_the_selections_per_row() {
        let h = Histogram::glm52();
        for (n, k) in [(64, 6), (18, 2), (256, 8)] {
            let r = h.resized(n, k).expect("resized");
            for (a, b) in h.layers.iter().zip(&r.layers) {
                assert_eq!(b.heat.len(), n);
                let per_row = b.heat.iter().sum::<u64>() as f64 / r.rows as f64;
                assert!((per_row - k as f64).abs() < 0.05 * k as f64, "{per_row}");
                let (sa, sb) = (Skew::of(&a.heat, h.rows), Skew::of(&b.heat, r.rows));
                assert!(
                    (sa.half_share - sb.half_share).abs() < 0.06,
                    "{n}: {sa:?} {sb:?}"
                );
            }
        }
        assert!(h.resized(8, 8).is_err());
    }

    #[test]
    fn spaced_layers_keep_first_and_last() {
        let h = Histogram::glm52();
        let l: Vec<usize> = h.spaced_layers(4).iter().map(|l| l.layer).collect();
        assert_eq!(l, vec![3, 27, 52, 77]);
    }
}
