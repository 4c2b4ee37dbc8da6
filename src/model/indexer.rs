//! GLM-5's DeepSeek Sparse Attention (DSA) lightning indexer: which earlier keys each query
//! attends to.
//!
//! Per row at cache position p, as transformers' `GlmMoeDsaIndexer` computes it
//! (docs/architecture.md, "Sparse attention"):
//! ```text
//! q_h  = rope_first(wq_b · q_a)[h]                 (heads × index_head_dim; q_a = the
//!                                                   attention's normed q_a_proj output)
//! k_j  = rope_first(LayerNorm(wk · x_j))           (one index_head_dim key per token, cached)
//! w_h  = weights_proj(x)_h · heads^-½
//! I_j  = Σ_h w_h · relu(q_h · k_j · index_head_dim^-½)      for j ≤ p
//! keys = the index_topk largest I_j (all j ≤ p when there are fewer)
//! ```
//! `rope_first` rotates the first `qk_rope_head_dim` dims (interleaved pairs, written
//! de-interleaved as transformers does; queries and keys get the same permutation) and passes
//! the rest. Ties at the selection boundary go to the lower position: torch's CPU `topk`
//! breaks them in an order that depends on the row length (libstdc++'s nth_element and
//! partial_sort), so transformers' own prefill and cached decode can disagree there; a fixed
//! rule keeps every S (prefill, decode, verify, chunked prefill) selecting the same keys.

use std::cmp::Ordering;
use std::sync::atomic::{AtomicU64, Ordering as AtomicOrdering};
use std::time::Instant;

use rayon::prelude::*;

use crate::config::ModelConfig;
use crate::container::{Container, Weight};
use crate::error::{Error, Result};
use crate::model::linear;
use crate::model::rope::Rope;
use crate::quant::kernels::vecops::{VecOps, BATCH};

/// The keys each row of a forward attends to: ascending cache positions, one list per row.
pub type Selection = Vec<Vec<u32>>;

/// transformers builds the indexer's `k_norm` as `nn.LayerNorm(index_head_dim, eps=1e-6)`.
const K_NORM_EPS: f32 = 1e-6;

/// Keys scored per task on the pool: large enough that a fork pays for itself.
const KEYS_PER_TASK: usize = 512;

pub struct Indexer {
    /// [heads · dim, q_lora_rank]
    wq_b: Weight,
    /// [dim, hidden]
    wk: Weight,
    k_norm_weight: Vec<f32>,
    k_norm_bias: Vec<f32>,
    /// [heads, hidden]
    weights_proj: Weight,
    heads: usize,
    dim: usize,
    rope_dim: usize,
    topk: usize,
    /// Nanoseconds spent in `select` (the indexer's share of a step, for benchmarks).
    busy_ns: AtomicU64,
}

impl Indexer {
    fn name(prefix: &str, n: &str) -> String {
        format!("{prefix}.self_attn.indexer.{n}")
    }

    /// Whether the checkpoint ships an indexer for the layer at `prefix` (`model.layers.L`).
    pub fn present(c: &Container, prefix: &str) -> bool {
        c.contains(&Self::name(prefix, "wq_b.weight"))
    }

    pub fn load(c: &Container, cfg: &ModelConfig, prefix: &str) -> Result<Self> {
        let (h, heads, dim) = (cfg.hidden_size, cfg.index_n_heads, cfg.index_head_dim);
        let q_lora = cfg.q_lora_rank.ok_or_else(|| {
            Error::Unsupported("the DSA indexer needs q_lora_rank (its query is q_a's)".into())
        })?;
        let topk = cfg
            .index_topk
            .ok_or_else(|| Error::Internal("DSA indexer loaded without index_topk".into()))?;
        let n = |s: &str| Self::name(prefix, s);
        Ok(Indexer {
            wq_b: linear::load(c, &n("wq_b.weight"), heads * dim, q_lora)?,
            wk: linear::load(c, &n("wk.weight"), dim, h)?,
            k_norm_weight: linear::load_vector(c, &n("k_norm.weight"), dim)?,
            k_norm_bias: linear::load_vector(c, &n("k_norm.bias"), dim)?,
            weights_proj: linear::load(c, &n("weights_proj.weight"), heads, h)?,
            heads,
            dim,
            rope_dim: cfg.qk_rope_head_dim,
            topk,
            busy_ns: AtomicU64::new(0),
        })
    }

    /// Seconds spent selecting keys since load.
    pub fn busy_seconds(&self) -> f64 {
        self.busy_ns.load(AtomicOrdering::Relaxed) as f64 * 1e-9
    }

    /// Width of one cached indexer key.
    pub fn key_dim(&self) -> usize {
        self.dim
    }

    /// The indexer over `s` rows at cache positions `start..start+s` (rope positions
    /// `rope_start..`): appends the rows' keys to `keys` (which holds `start` keys) and
    /// returns each row's selection among positions `0..=start+r`.
    ///
    /// `xn` is the attention's normed input [s, hidden], `q_a` its normed `q_a_proj` output
    /// [s, q_lora_rank].
    #[allow(clippy::too_many_arguments)]
    pub fn select(
        &self,
        xn: &[f32],
        q_a: &[f32],
        s: usize,
        start: usize,
        rope_start: usize,
        keys: &mut Vec<f32>,
        rope: &Rope,
        pool: Option<&rayon::ThreadPool>,
    ) -> Result<Selection> {
        let _timing = BusyTimer::start(&self.busy_ns);
        let (heads, dim, rd) = (self.heads, self.dim, self.rope_dim);
        debug_assert_eq!(keys.len(), start * dim);
        let mut k = linear::apply(&self.wk, xn, s, pool)?;
        for (r, row) in k.chunks_exact_mut(dim).enumerate() {
            layer_norm(row, &self.k_norm_weight, &self.k_norm_bias);
            rope.apply(&mut row[..rd], rope_start + r);
        }
        keys.extend_from_slice(&k);

        // Rows whose visible keys all fit are dense: no scores needed.
        if start + s <= self.topk {
            return Ok((0..s).map(|r| (0..=(start + r) as u32).collect()).collect());
        }
        let mut q = linear::apply(&self.wq_b, q_a, s, pool)?;
        for r in 0..s {
            for hh in 0..heads {
                let at = (r * heads + hh) * dim;
                rope.apply(&mut q[at..at + rd], rope_start + r);
            }
        }
        let head_weight = (heads as f32).powf(-0.5);
        let mut w = linear::apply(&self.weights_proj, xn, s, pool)?;
        w.iter_mut().for_each(|v| *v *= head_weight);

        let ops = VecOps::active()?;
        let scale = (dim as f32).powf(-0.5);
        let keys: &[f32] = keys;
        let mut selection = Vec::with_capacity(s);
        for r in 0..s {
            let visible = start + r + 1;
            if visible <= self.topk {
                selection.push((0..visible as u32).collect());
                continue;
            }
            let qr = &q[r * heads * dim..(r + 1) * heads * dim];
            let wr = &w[r * heads..(r + 1) * heads];
            let mut scores = vec![0.0f32; visible];
            let score_chunk = |(c, out): (usize, &mut [f32])| {
                let j0 = c * KEYS_PER_TASK;
                for (i, o) in out.iter_mut().enumerate() {
                    let kj = &keys[(j0 + i) * dim..(j0 + i + 1) * dim];
                    *o = index_score(&ops, kj, qr, wr, dim, scale);
                }
            };
            match pool {
                Some(p) if visible > KEYS_PER_TASK => p.install(|| {
                    scores
                        .par_chunks_mut(KEYS_PER_TASK)
                        .enumerate()
                        .for_each(score_chunk)
                }),
                _ => scores
                    .chunks_mut(KEYS_PER_TASK)
                    .enumerate()
                    .for_each(score_chunk),
            }
            selection.push(top_k(&scores, self.topk));
        }
        Ok(selection)
    }
}

/// Adds the nanoseconds from `start` to its drop to a counter (every return path counts).
struct BusyTimer<'a> {
    total: &'a AtomicU64,
    since: Instant,
}

impl<'a> BusyTimer<'a> {
    fn start(total: &'a AtomicU64) -> Self {
        BusyTimer {
            total,
            since: Instant::now(),
        }
    }
}

impl Drop for BusyTimer<'_> {
    fn drop(&mut self) {
        let ns = u64::try_from(self.since.elapsed().as_nanos()).unwrap_or(u64::MAX);
        self.total.fetch_add(ns, AtomicOrdering::Relaxed);
    }
}

/// `Σ_h w_h · relu(q_h · k · scale)` over the heads of `q` ([heads, dim]), summed in head
/// order; dot products four heads per call (the key is read once for the four).
fn index_score(ops: &VecOps, k: &[f32], q: &[f32], w: &[f32], dim: usize, scale: f32) -> f32 {
    let heads = w.len();
    let head = |h: usize| &q[h * dim..(h + 1) * dim];
    let mut sum = 0.0f32;
    let mut h = 0;
    while h + BATCH <= heads {
        let d = ops.dots(k, std::array::from_fn(|i| head(h + i)));
        for (i, v) in d.iter().enumerate() {
            sum += w[h + i] * (v * scale).max(0.0);
        }
        h += BATCH;
    }
    for (h, wh) in w.iter().enumerate().skip(h) {
        sum += wh * (ops.dot(k, head(h)) * scale).max(0.0);
    }
    sum
}

/// Scalar reference of [`index_score`] (tests compare the two).
#[cfg(test)]
fn index_score_reference(k: &[f32], q: &[f32], w: &[f32], dim: usize, scale: f32) -> f32 {
    let mut sum = 0.0f32;
    for (h, wh) in w.iter().enumerate() {
        let d: f32 = q[h * dim..(h + 1) * dim]
            .iter()
            .zip(k)
            .map(|(a, b)| a * b)
            .sum();
        sum += wh * (d * scale).max(0.0);
    }
    sum
}

/// The positions of the `k` largest scores, ascending. Larger score first, ties to the lower
/// position; NaN ranks above every number, as in torch's `topk`.
pub fn top_k(scores: &[f32], k: usize) -> Vec<u32> {
    let mut idx: Vec<u32> = (0..scores.len() as u32).collect();
    if k < idx.len() {
        let rank = |a: &u32, b: &u32| -> Ordering {
            let (x, y) = (scores[*a as usize], scores[*b as usize]);
            match (x.is_nan(), y.is_nan()) {
                (true, false) => Ordering::Less,
                (false, true) => Ordering::Greater,
                _ => y.partial_cmp(&x).unwrap_or(Ordering::Equal).then(a.cmp(b)),
            }
        };
        if k == 0 {
            return Vec::new();
        }
        idx.select_nth_unstable_by(k - 1, rank);
        idx.truncate(k);
    }
    idx.sort_unstable();
    idx
}

/// `nn.LayerNorm` in place: (x − mean) / sqrt(var + eps) · w + b, biased variance, in f32.
fn layer_norm(x: &mut [f32], w: &[f32], b: &[f32]) {
    let n = x.len() as f32;
    let mean = x.iter().sum::<f32>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n;
    let inv = 1.0 / (var + K_NORM_EPS).sqrt();
    for ((v, g), c) in x.iter_mut().zip(w).zip(b) {
        *v = (*v - mean) * inv * g + c;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn top_k_takes_the_largest_ties_to_the_lower_position() {
        let s = [0.5, 2.0, 1.0, 2.0, 1.0, -3.0, 1.0];
        assert_eq!(top_k(&s, 2), vec![1, 3]);
        // 1.0 three times for two places: positions 2 and 4, not 6.
        assert_eq!(top_k(&s, 4), vec![1, 2, 3, 4]);
        assert_eq!(top_k(&s, 7), (0..7).collect::<Vec<_>>());
        assert_eq!(top_k(&s, 10), (0..7).collect::<Vec<_>>());
        assert_eq!(top_k(&[1.0, f32::NAN, 3.0], 1), vec![1]);
        assert!(top_k(&s, 0).is_empty());
        // Any order of the same scores selects the same set.
        let zeros = [0.0f32; 100];
        assert_eq!(top_k(&zeros, 5), vec![0, 1, 2, 3, 4]);
    }

    #[test]
    fn simd_index_score_matches_the_scalar_reference() {
        let ops = VecOps::active().unwrap();
        let mut state = 0x2545_f491u32;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 17;
            state ^= state << 5;
            (state as f32 / u32::MAX as f32) - 0.5
        };
        for (heads, dim) in [(1, 8), (4, 16), (6, 24), (32, 128)] {
            let q: Vec<f32> = (0..heads * dim).map(|_| next()).collect();
            let k: Vec<f32> = (0..dim).map(|_| next()).collect();
            let w: Vec<f32> = (0..heads).map(|_| next()).collect();
            let scale = (dim as f32).powf(-0.5);
            let a = index_score(&ops, &k, &q, &w, dim, scale);
            let b = index_score_reference(&k, &q, &w, dim, scale);
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{heads}×{dim}: {a} vs {b}"
            );
        }
    }

    #[test]
    fn layer_norm_is_zero_mean_unit_variance_before_the_affine() {
        let mut x = [1.0f32, 2.0, 3.0, 6.0];
        layer_norm(&mut x, &[1.0; 4], &[0.0; 4]);
        let mean: f32 = x.iter().sum::<f32>() / 4.0;
        let var: f32 = x.iter().map(|v| v * v).sum::<f32>() / 4.0;
        assert!(
            mean.abs() < 1e-6 && (var - 1.0).abs() < 1e-5,
            "{mean} {var}"
        );
        let mut y = [1.0f32, 2.0, 3.0, 6.0];
        layer_norm(&mut y, &[2.0; 4], &[0.5; 4]);
        for (a, b) in x.iter().zip(&y) {
            assert!((a * 2.0 + 0.5 - b).abs() < 1e-6);
        }
    }
}
