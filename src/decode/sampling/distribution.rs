//! The distribution sampling draws from: temperature, then the top-k, top-p and min-p cuts,
//! renormalised.

use super::pick::{argmax, inf_logit, nan_logits};
use super::SamplingParams;
use crate::{Error, Result};

/// The distribution sampling draws from: softmax(logits / temperature), restricted to the
/// `top_k` largest logits, then to the smallest prefix (by descending probability) whose mass
/// reaches `top_p`, then to the tokens at least `min_p` times as likely as the top one,
/// renormalised. Ties in either cut keep the lowest token ids. Greedy
/// (`temperature == 0`) gives the point mass at [`argmax`]. Returns one probability per token id.
pub fn processed_distribution(logits: &[f32], params: &SamplingParams) -> Result<Vec<f64>> {
    let v = logits.len();
    let mut probs = vec![0.0f64; v];
    if params.is_greedy() {
        probs[argmax(logits)? as usize] = 1.0;
        return Ok(probs);
    }
    let mut max = f32::NEG_INFINITY;
    for (i, &x) in logits.iter().enumerate() {
        if x.is_nan() {
            return Err(nan_logits(i));
        }
        if x == f32::INFINITY {
            return Err(inf_logit(i));
        }
        max = max.max(x);
    }
    if max == f32::NEG_INFINITY {
        return Err(Error::NonFiniteOutput(
            "the model produced -inf for every logit: no token can be sampled".into(),
        ));
    }
    let t = f64::from(params.temperature);
    let max = f64::from(max);
    let weight = |x: f32| ((f64::from(x) - max) / t).exp();
    // Unnormalised weights, dense by id (zero outside the candidates).
    let finite = logits.iter().filter(|&&x| x > f32::NEG_INFINITY).count();
    let k = params.top_k;
    let mut cand: Vec<Cand> = Vec::new();
    if k > 0 && k < finite {
        cand = candidates(logits);
        cand.select_nth_unstable_by(k - 1, cut_order);
        cand.truncate(k);
        for c in &cand {
            probs[c.1 as usize] = weight(c.0);
        }
    } else {
        for (p, &x) in probs.iter_mut().zip(logits) {
            *p = weight(x);
        }
    }
    if params.top_p < 1.0 {
        if cand.is_empty() {
            cand = candidates(logits);
        }
        let total: f64 = probs.iter().sum();
        let keep = nucleus(&mut cand, weight, f64::from(params.top_p) * total);
        for c in &cand[keep..] {
            probs[c.1 as usize] = 0.0;
        }
    }
    if params.min_p > 0.0 {
        // Relative to the most likely token, whose weight is 1 and which every cut keeps,
        // so this cut commutes with the others.
        let floor = f64::from(params.min_p);
        for p in probs.iter_mut() {
            if *p < floor {
                *p = 0.0;
            }
        }
    }
    let kept_total: f64 = probs.iter().sum();
    if !(kept_total > 0.0 && kept_total.is_finite()) {
        return Err(Error::Internal(
            "sampling distribution has no finite positive mass".into(),
        ));
    }
    for p in &mut probs {
        *p /= kept_total;
    }
    Ok(probs)
}

/// A candidate token: (logit, id). Kept together so sorting reads contiguous memory.
type Cand = (f32, u32);

/// The order of the top-k and top-p cuts: descending logit (= descending probability), then
/// ascending id.
fn cut_order(a: &Cand, b: &Cand) -> std::cmp::Ordering {
    b.0.total_cmp(&a.0).then(a.1.cmp(&b.1))
}

fn candidates(logits: &[f32]) -> Vec<Cand> {
    logits
        .iter()
        .enumerate()
        .filter(|(_, &x)| x > f32::NEG_INFINITY)
        .map(|(i, &x)| (x, i as u32))
        .collect()
}

/// Reorders `cand` so that its first `keep` entries are the smallest prefix in [`cut_order`]
/// whose weights reach `target`; returns `keep`. Sorts only a growing head of the candidates
/// (64, 256, …) and the whole set once that head would pass a quarter of it, so a peaked
/// distribution over a large vocabulary costs O(V), not O(V log V).
fn nucleus(cand: &mut [Cand], weight: impl Fn(f32) -> f64, target: f64) -> usize {
    let n = cand.len();
    let mut m = n.min(64);
    loop {
        if m * 4 > n {
            m = n;
        }
        if m < n {
            cand.select_nth_unstable_by(m - 1, cut_order);
        }
        cand[..m].sort_unstable_by(cut_order);
        let mut cum = 0.0;
        for (j, c) in cand[..m].iter().enumerate() {
            cum += weight(c.0);
            if cum >= target {
                return j + 1;
            }
        }
        if m == n {
            return n;
        }
        m *= 4;
    }
}
