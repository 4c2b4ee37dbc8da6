//! Token selection: greedy argmax, and sampling from the *processed* distribution.
//!
//! A row's logits are first *processed* by what the context decides ([`History`]: the
//! logit bias, the repetition / presence / frequency penalties, the structured-output mask
//! of a [`Grammar`], `min_tokens`' mask of the stop tokens), then picked: argmax when greedy, else a draw from the *processed
//! distribution* (temperature, then top-k, then top-p, then min-p, renormalised).
//!
//! Sampling is inverse-CDF over token ids in ascending order with one uniform draw `u` per
//! emitted token. The speculative loop relies on that: it picks the target's token for every
//! verified row exactly as plain decoding would (the row's history being the context plus
//! the drafts before it, which are the tokens plain decoding emitted if they are accepted)
//! and accepts a draft iff the pick equals it (docs/speculative.md, "Acceptance"). So every
//! processing step here keeps speculation lossless, as long as it depends only on the
//! tokens before the row.

use std::collections::{HashMap, HashSet};

use super::constraint::{ConstraintState, Grammar};
use super::prompt::PromptLogprobs;
use crate::{Error, Result};

/// How to pick tokens. `temperature == 0` is greedy (then `top_k`/`top_p`/`min_p` are
/// ignored; the bias, the penalties and `min_tokens` still apply). vLLM's names and meanings.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    /// 0 = greedy; otherwise logits are divided by it. Finite, ≥ 0.
    pub temperature: f32,
    /// Keep only the `top_k` most likely tokens; 0 = off.
    pub top_k: usize,
    /// Keep the smallest most-likely prefix whose mass reaches `top_p`; 1.0 = off. In (0, 1].
    pub top_p: f32,
    /// Keep only tokens at least `min_p` times as likely as the most likely one; 0 = off.
    /// In [0, 1].
    pub min_p: f32,
    /// Seed of the sampling stream; `None` draws one from the clock.
    pub seed: Option<u64>,
    /// Above 1 discourages every token already in the prompt or the output (a positive logit is
    /// divided by it, a negative one multiplied), as transformers and vLLM do; 1 = off.
    pub repetition_penalty: f32,
    /// Subtracted from the logit of every token the output already holds (OpenAI); 0 = off.
    pub presence_penalty: f32,
    /// Subtracted from a token's logit once per time the output holds it; 0 = off.
    pub frequency_penalty: f32,
    /// Added to the logits of these tokens before anything else (OpenAI's `logit_bias`;
    /// −inf bans a token).
    pub logit_bias: Vec<(u32, f32)>,
    /// The stop tokens cannot be picked before this many tokens were generated (unless a
    /// complete `constraint` allows nothing else).
    pub min_tokens: usize,
    /// Structured output: only tokens that keep the text within this grammar can be picked,
    /// and a stop token only where the grammar may end.
    pub constraint: Option<Grammar>,
    /// Score the prompt's tokens in the prefill (vLLM's `prompt_logprobs`), into this sink.
    pub prompt_logprobs: Option<PromptLogprobs>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            seed: None,
            repetition_penalty: 1.0,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logit_bias: Vec::new(),
            min_tokens: 0,
            constraint: None,
            prompt_logprobs: None,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        Self::default()
    }

    pub fn is_greedy(&self) -> bool {
        self.temperature == 0.0
    }

    /// Whether any step of [`History::process`] changes logits.
    pub fn processes_logits(&self) -> bool {
        self.repetition_penalty != 1.0
            || self.presence_penalty != 0.0
            || self.frequency_penalty != 0.0
            || !self.logit_bias.is_empty()
            || self.min_tokens > 0
            || self.constraint.is_some()
    }

    pub fn validate(&self) -> Result<()> {
        let t = self.temperature;
        if !t.is_finite() || t < 0.0 {
            return Err(Error::invalid(
                "temperature",
                format!(
                    "got {t}; use 0 for greedy decoding or a finite positive value such as 1.0"
                ),
            ));
        }
        let p = self.top_p;
        if !p.is_finite() || p <= 0.0 || p > 1.0 {
            return Err(Error::invalid(
                "top_p",
                format!("got {p}; it must lie in (0, 1] (1.0 turns nucleus filtering off)"),
            ));
        }
        let m = self.min_p;
        if !m.is_finite() || !(0.0..=1.0).contains(&m) {
            return Err(Error::invalid(
                "min_p",
                format!("got {m}; it must lie in [0, 1] (0 turns it off)"),
            ));
        }
        let r = self.repetition_penalty;
        if !r.is_finite() || r <= 0.0 {
            return Err(Error::invalid(
                "repetition_penalty",
                format!("got {r}; it must be a finite positive number (1.0 turns it off)"),
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !v.is_finite() {
                return Err(Error::invalid(
                    name,
                    format!("got {v}; it must be a finite number (0 turns it off)"),
                ));
            }
        }
        if let Some(k) = self
            .prompt_logprobs
            .as_ref()
            .map(|p| p.top)
            .filter(|&k| k > MAX_TOP_LOGPROBS)
        {
            return Err(Error::invalid(
                "prompt_logprobs",
                format!("{k} alternatives; at most {MAX_TOP_LOGPROBS}"),
            ));
        }
        if let Some((t, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| b.is_nan() || *b == f32::INFINITY)
        {
            return Err(Error::invalid(
                "logit_bias",
                format!("token {t}: bias {b}; use a finite number, or -inf to ban the token"),
            ));
        }
        Ok(())
    }

    /// Check the token ids the parameters name against the vocabulary.
    pub fn validate_tokens(&self, vocab: usize) -> Result<()> {
        if let Some(g) = self.constraint.as_ref().filter(|g| g.vocab_size() != vocab) {
            return Err(Error::invalid(
                g.spec().param(),
                format!(
                    "the grammar was compiled for {} tokens and this model has {vocab}",
                    g.vocab_size()
                ),
            ));
        }
        match self.logit_bias.iter().find(|(t, _)| *t as usize >= vocab) {
            Some((t, _)) => Err(Error::invalid(
                "logit_bias",
                format!("token id {t} is outside the vocabulary (size {vocab})"),
            )),
            None => Ok(()),
        }
    }
}

/// What the logit processing of a row depends on: the prompt and the tokens generated
/// before it. Kept incrementally by the decode loop ([`push`](Self::push) per emitted token).
#[derive(Clone, Debug, Default)]
pub struct History {
    /// Every token of the prompt and the output (repetition penalty).
    seen: HashSet<u32>,
    /// Occurrences of each token in the output (presence and frequency penalties).
    output: HashMap<u32, u32>,
    generated: usize,
    /// Masked while fewer than `min_tokens` were generated.
    stop_tokens: Vec<u32>,
    /// Where the output stands in the structured-output grammar.
    constraint: Option<ConstraintState>,
}

impl History {
    /// The history at the first generated token of `prompt`.
    pub fn new(prompt: &[u32], params: &SamplingParams, stop_tokens: &[u32]) -> Self {
        History {
            seen: if params.repetition_penalty != 1.0 {
                prompt.iter().copied().collect()
            } else {
                HashSet::new()
            },
            output: HashMap::new(),
            generated: 0,
            stop_tokens: if params.min_tokens > 0 {
                stop_tokens.to_vec()
            } else {
                Vec::new()
            },
            constraint: params.constraint.as_ref().map(|g| g.start(stop_tokens)),
        }
    }

    /// `token` was emitted.
    pub fn push(&mut self, token: u32, params: &SamplingParams) {
        self.generated += 1;
        if let Some(c) = &mut self.constraint {
            c.push(token);
        }
        if params.repetition_penalty != 1.0 {
            self.seen.insert(token);
        }
        if params.presence_penalty != 0.0 || params.frequency_penalty != 0.0 {
            *self.output.entry(token).or_default() += 1;
        }
    }

    /// The processed logits of a row whose context is this history followed by `extra`
    /// (the drafts before a verified row): `row` itself when nothing applies.
    pub fn process<'a>(
        &self,
        row: &'a [f32],
        params: &SamplingParams,
        extra: &[u32],
    ) -> std::borrow::Cow<'a, [f32]> {
        if !params.processes_logits() {
            return std::borrow::Cow::Borrowed(row);
        }
        let mut x = row.to_vec();
        for &(t, b) in &params.logit_bias {
            if let Some(v) = x.get_mut(t as usize) {
                *v += b;
            }
        }
        let r = params.repetition_penalty;
        if r != 1.0 {
            let penalise = |v: &mut f32| *v = if *v > 0.0 { *v / r } else { *v * r };
            for &t in &self.seen {
                if let Some(v) = x.get_mut(t as usize) {
                    penalise(v);
                }
            }
            for (i, &t) in extra.iter().enumerate() {
                // Once per token, whether the history or an earlier draft holds it.
                if !self.seen.contains(&t) && !extra[..i].contains(&t) {
                    if let Some(v) = x.get_mut(t as usize) {
                        penalise(v);
                    }
                }
            }
        }
        let (presence, frequency) = (params.presence_penalty, params.frequency_penalty);
        if presence != 0.0 || frequency != 0.0 {
            let mut counts = self.output.clone();
            for &t in extra {
                *counts.entry(t).or_default() += 1;
            }
            for (&t, &c) in &counts {
                if let Some(v) = x.get_mut(t as usize) {
                    *v -= presence + frequency * c as f32;
                }
            }
        }
        let complete = match &self.constraint {
            Some(c) => c.mask(&mut x, extra),
            None => false,
        };
        // A complete grammar allows only the stop tokens: it ends the output, min_tokens or not.
        if self.generated + extra.len() < params.min_tokens && !complete {
            for &t in &self.stop_tokens {
                if let Some(v) = x.get_mut(t as usize) {
                    *v = f32::NEG_INFINITY;
                }
            }
        }
        std::borrow::Cow::Owned(x)
    }
}

/// Index of the largest logit; ties go to the lowest id. NaN or +Inf anywhere is an
/// [`Error::NonFiniteOutput`] (non-finite weights, or an overflow); -Inf is a masked token.
pub fn argmax(logits: &[f32]) -> Result<u32> {
    let mut best: Option<(usize, f32)> = None;
    for (i, &x) in logits.iter().enumerate() {
        if x.is_nan() {
            return Err(nan_logits(i));
        }
        if x == f32::INFINITY {
            return Err(inf_logit(i));
        }
        match best {
            Some((_, b)) if x <= b => {}
            _ => best = Some((i, x)),
        }
    }
    best.map(|(i, _)| i as u32)
        .ok_or_else(|| Error::Internal("argmax over an empty logits row".into()))
}

fn inf_logit(index: usize) -> Error {
    Error::NonFiniteOutput(format!(
        "the model produced an infinite logit (token id {index})"
    ))
}

fn nan_logits(index: usize) -> Error {
    Error::NonFiniteOutput(format!("the model produced a NaN logit (token id {index})"))
}

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

/// Inverse-CDF draw from `probs` with a uniform `u ∈ [0, 1)`, scanning ids in ascending order.
/// Only tokens with positive probability can be returned.
pub fn sample(probs: &[f64], u: f64) -> Result<u32> {
    let total: f64 = probs.iter().sum();
    let target = u * total;
    let mut cum = 0.0;
    let mut last_positive = None;
    for (i, &p) in probs.iter().enumerate() {
        if p > 0.0 {
            cum += p;
            last_positive = Some(i as u32);
            if target < cum {
                return Ok(i as u32);
            }
        }
    }
    // Rounding can leave `target` at the very top of the range: the last positive token.
    last_positive.ok_or_else(|| Error::Internal("sampling from an all-zero distribution".into()))
}

/// The token for one (processed) logits row: argmax when greedy, else a draw with the
/// uniform `u`.
pub fn pick(logits: &[f32], params: &SamplingParams, u: f64) -> Result<u32> {
    let best = argmax(logits)?;
    if logits[best as usize] == f32::NEG_INFINITY {
        return Err(nothing_allowed());
    }
    if params.is_greedy() {
        return Ok(best);
    }
    sample(&processed_distribution(logits, params)?, u)
}

/// Every logit of a processed row is −inf: the processing left no token to pick (the model's
/// own logits are never −inf everywhere in practice; `argmax` reports NaN and +inf).
fn nothing_allowed() -> Error {
    Error::invalid(
        "sampling_params",
        "no token can be picked: logit_bias, min_tokens and the structured-output constraint \
         (guided_json / guided_regex / guided_grammar) together mask every token, or the \
         constraint failed (a grammar too complex for its limits)",
    )
}

/// Most alternatives a token's log-probability may list (OpenAI's and vLLM's default cap).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// The log-probability of a generated token and, when asked, the most likely alternatives.
#[derive(Clone, Debug, PartialEq, serde::Serialize)]
pub struct TokenLogprob {
    pub token: u32,
    pub logprob: f32,
    /// (token, logprob) of the `top_logprobs` most likely tokens, most likely first (ties:
    /// lower id first).
    pub top: Vec<(u32, f32)>,
}

/// The log-probabilities the sampler's distribution gives a (processed) row: when sampling,
/// the processed distribution itself (temperature, top-k, top-p, min-p; a cut token is
/// −inf); when greedy, whose distribution is a point mass, the softmax of the processed logits
/// at temperature 1 (what OpenAI's API reports at temperature 0).
pub fn token_logprob(
    logits: &[f32],
    params: &SamplingParams,
    token: u32,
    top: usize,
) -> Result<TokenLogprob> {
    let probs = if params.is_greedy() {
        let unit = SamplingParams {
            temperature: 1.0,
            ..SamplingParams::default()
        };
        processed_distribution(logits, &unit)?
    } else {
        processed_distribution(logits, params)?
    };
    let ln = |p: f64| {
        if p > 0.0 {
            p.ln() as f32
        } else {
            f32::NEG_INFINITY
        }
    };
    let mut best: Vec<(u32, f32)> = Vec::new();
    if top > 0 {
        let mut ids: Vec<u32> = (0..probs.len() as u32).collect();
        let order = |a: &u32, b: &u32| {
            probs[*b as usize]
                .total_cmp(&probs[*a as usize])
                .then(a.cmp(b))
        };
        let k = top.min(ids.len());
        if k < ids.len() {
            ids.select_nth_unstable_by(k - 1, order);
            ids.truncate(k);
        }
        ids.sort_unstable_by(order);
        best = ids
            .into_iter()
            .map(|t| (t, ln(probs[t as usize])))
            .collect();
    }
    Ok(TokenLogprob {
        token,
        logprob: ln(probs.get(token as usize).copied().unwrap_or(0.0)),
        top: best,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: usize, top_p: f32) -> SamplingParams {
        SamplingParams {
            temperature,
            top_k,
            top_p,
            seed: Some(0),
            ..SamplingParams::default()
        }
    }

    fn close(a: &[f64], b: &[f64]) -> bool {
        a.len() == b.len() && a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-12)
    }

    #[test]
    fn min_p_keeps_tokens_at_least_that_share_of_the_top_one() {
        // Weights relative to the top: 1, e^-1 = 0.37, e^-2 = 0.14, e^-3 = 0.05.
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let sp = SamplingParams {
            min_p: 0.2,
            ..params(1.0, 0, 1.0)
        };
        let got = processed_distribution(&logits, &sp).unwrap();
        let (a, b) = (1.0f64, (-1.0f64).exp());
        assert!(
            close(&got, &[a / (a + b), b / (a + b), 0.0, 0.0]),
            "{got:?}"
        );
        let bad = SamplingParams {
            min_p: 1.5,
            ..params(1.0, 0, 1.0)
        };
        assert!(bad.validate().unwrap_err().to_string().contains("'min_p'"));
    }

    #[test]
    fn history_applies_bias_penalties_and_min_tokens_with_the_drafts_before_a_row() {
        let sp = SamplingParams {
            repetition_penalty: 2.0,
            presence_penalty: 0.5,
            frequency_penalty: 0.25,
            logit_bias: vec![(0, 1.0)],
            min_tokens: 2,
            ..params(1.0, 0, 1.0)
        };
        let row = [1.0f32, 2.0, -2.0, 4.0, 0.5];
        let mut h = History::new(&[1, 2], &sp, &[4]);
        // Prompt tokens 1 and 2: repetition only (2/2, -2*2); stop token 4 masked.
        let x = h.process(&row, &sp, &[]);
        assert_eq!(&x[..], &[2.0, 1.0, -4.0, 4.0, f32::NEG_INFINITY]);
        h.push(3, &sp);
        // Output holds 3 once; the drafts add 3 again and 0: repetition once per token,
        // frequency per occurrence; two tokens before the row lift the min_tokens mask.
        let x = h.process(&row, &sp, &[3, 0]);
        let t3 = 4.0 / 2.0 - 0.5 - 0.25 * 2.0;
        let t0 = (1.0 + 1.0) / 2.0 - 0.5 - 0.25;
        assert_eq!(&x[..], &[t0, 1.0, -4.0, t3, 0.5]);
        // Nothing to do: the row itself.
        let plain = params(1.0, 0, 1.0);
        assert!(matches!(
            History::new(&[1], &plain, &[4]).process(&row, &plain, &[1]),
            std::borrow::Cow::Borrowed(_)
        ));
        assert!(sp.validate_tokens(4).is_ok() && sp.validate_tokens(0).is_err());
    }

    #[test]
    fn logprobs_are_the_sampled_law_or_the_unit_temperature_softmax_when_greedy() {
        let logits = [0.0f32, 1.0, 2.0];
        let z: f64 = [0.0f64, 1.0, 2.0].iter().map(|x| x.exp()).sum();
        let g = token_logprob(&logits, &params(0.0, 0, 1.0), 2, 2).unwrap();
        assert!((f64::from(g.logprob) - (2.0 - z.ln())).abs() < 1e-6);
        assert_eq!(g.top.iter().map(|t| t.0).collect::<Vec<_>>(), [2, 1]);
        // Sampling with top-k 2 cuts token 0: its logprob is -inf.
        let s = token_logprob(&logits, &params(1.0, 2, 1.0), 0, 3).unwrap();
        assert_eq!(s.logprob, f32::NEG_INFINITY);
        assert_eq!(s.top[2], (0, f32::NEG_INFINITY));
    }

    #[test]
    fn validation_rejects_bad_values_with_named_parameter() {
        for t in [-0.5, f32::NAN, f32::INFINITY] {
            let e = params(t, 0, 1.0).validate().unwrap_err().to_string();
            assert!(e.contains("'temperature'"), "{e}");
        }
        for p in [0.0, -0.1, 1.5, f32::NAN] {
            let e = params(1.0, 0, p).validate().unwrap_err().to_string();
            assert!(e.contains("'top_p'"), "{e}");
        }
        assert!(params(0.0, 0, 1.0).validate().is_ok());
        assert!(params(0.7, 40, 0.95).validate().is_ok());
    }

    #[test]
    fn argmax_breaks_ties_by_lowest_id_and_rejects_nan() {
        assert_eq!(argmax(&[1.0, 3.0, 3.0, 2.0]).unwrap(), 1);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]).unwrap(), 0);
        assert!(matches!(
            argmax(&[1.0, f32::NAN]),
            Err(Error::NonFiniteOutput(m)) if m.contains("NaN logit (token id 1)")
        ));
        assert!(argmax(&[]).is_err());
    }

    #[test]
    fn temperature_one_is_softmax() {
        let logits = [0.0f32, 1.0, 2.0];
        let e: Vec<f64> = [0.0f64, 1.0, 2.0].iter().map(|x| x.exp()).collect();
        let s: f64 = e.iter().sum();
        let want: Vec<f64> = e.iter().map(|x| x / s).collect();
        let got = processed_distribution(&logits, &params(1.0, 0, 1.0)).unwrap();
        assert!(close(&got, &want), "{got:?}");
        // Temperature 2 halves the logits.
        let e2: Vec<f64> = [0.0f64, 0.5, 1.0].iter().map(|x| x.exp()).collect();
        let s2: f64 = e2.iter().sum();
        let want2: Vec<f64> = e2.iter().map(|x| x / s2).collect();
        let got2 = processed_distribution(&logits, &params(2.0, 0, 1.0)).unwrap();
        assert!(close(&got2, &want2), "{got2:?}");
    }

    #[test]
    fn top_k_keeps_k_largest_with_lowest_id_on_ties() {
        // ids 1 and 2 tie for second place: top-2 keeps 3 (the largest) and 1 (the lower id).
        let logits = [0.0f32, 1.0, 1.0, 2.0];
        let got = processed_distribution(&logits, &params(1.0, 2, 1.0)).unwrap();
        let (a, b) = (2.0f64.exp(), 1.0f64.exp());
        assert!(
            close(&got, &[0.0, b / (a + b), 0.0, a / (a + b)]),
            "{got:?}"
        );
    }

    #[test]
    fn top_p_keeps_smallest_prefix_reaching_the_mass() {
        // Probabilities 0.5, 0.3, 0.2 (by construction through log-probs).
        let logits = [0.5f64.ln() as f32, 0.3f64.ln() as f32, 0.2f64.ln() as f32];
        let got = processed_distribution(&logits, &params(1.0, 0, 0.75)).unwrap();
        assert!((got[0] - 0.5 / 0.8).abs() < 1e-6 && (got[1] - 0.3 / 0.8).abs() < 1e-6);
        assert_eq!(got[2], 0.0);
        // top_p below the largest probability keeps just the argmax.
        let got = processed_distribution(&logits, &params(1.0, 0, 0.1)).unwrap();
        assert_eq!(got, vec![1.0, 0.0, 0.0]);
    }

    #[test]
    fn top_p_ties_cut_the_higher_id() {
        let logits = [0.0f32; 4];
        let got = processed_distribution(&logits, &params(1.0, 0, 0.5)).unwrap();
        assert_eq!(got, vec![0.5, 0.5, 0.0, 0.0]);
    }

    #[test]
    fn top_k_then_top_p_compose() {
        // Uniform over 6; top-k 4 → 0.25 each; top-p 0.6 keeps 3 of them (0.75 ≥ 0.6).
        let logits = [0.0f32; 6];
        let got = processed_distribution(&logits, &params(1.0, 4, 0.6)).unwrap();
        let third = 1.0 / 3.0;
        assert!(
            close(&got, &[third, third, third, 0.0, 0.0, 0.0]),
            "{got:?}"
        );
    }

    #[test]
    fn greedy_distribution_is_a_point_mass() {
        let got = processed_distribution(&[0.1, 0.9, 0.9], &params(0.0, 0, 1.0)).unwrap();
        assert_eq!(got, vec![0.0, 1.0, 0.0]);
    }

    #[test]
    fn neg_inf_logits_get_zero_mass_and_bad_rows_error() {
        let got = processed_distribution(&[f32::NEG_INFINITY, 0.0], &params(1.0, 0, 1.0)).unwrap();
        assert_eq!(got, vec![0.0, 1.0]);
        assert!(processed_distribution(&[f32::NEG_INFINITY; 3], &params(1.0, 0, 1.0)).is_err());
        assert!(processed_distribution(&[0.0, f32::NAN], &params(1.0, 0, 1.0)).is_err());
        assert!(processed_distribution(&[0.0, f32::INFINITY], &params(1.0, 0, 1.0)).is_err());
    }

    /// Issue 24: an overflowing forward is the weights' fault, never a silent pick or an
    /// internal error: +Inf under greedy, and all -Inf under sampling, are NonFiniteOutput.
    #[test]
    fn infinite_logits_are_non_finite_output_errors() {
        assert!(matches!(
            argmax(&[0.0, f32::INFINITY, 1.0]),
            Err(Error::NonFiniteOutput(m)) if m.contains("infinite logit (token id 1)")
        ));
        assert_eq!(argmax(&[f32::NEG_INFINITY, 0.5]).ok(), Some(1));
        assert!(matches!(
            processed_distribution(&[f32::NEG_INFINITY; 3], &params(1.0, 0, 1.0)),
            Err(Error::NonFiniteOutput(_))
        ));
    }

    /// The textbook version: sort everything, cut, renormalise.
    fn reference(logits: &[f32], t: f64, top_k: usize, top_p: f64) -> Vec<f64> {
        let mut ids: Vec<usize> = (0..logits.len()).collect();
        ids.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
        if top_k > 0 {
            ids.truncate(top_k);
        }
        let max = f64::from(logits[ids[0]]);
        let w: Vec<f64> = ids
            .iter()
            .map(|&i| ((f64::from(logits[i]) - max) / t).exp())
            .collect();
        let total: f64 = w.iter().sum();
        let mut keep = ids.len();
        let mut cum = 0.0;
        for (j, x) in w.iter().enumerate() {
            cum += x;
            if cum >= top_p * total {
                keep = j + 1;
                break;
            }
        }
        let kept: f64 = w[..keep].iter().sum();
        let mut p = vec![0.0; logits.len()];
        for (&i, &x) in ids[..keep].iter().zip(&w) {
            p[i] = x / kept;
        }
        p
    }

    #[test]
    fn matches_the_full_sort_reference_on_large_vocabularies() {
        let mut rng = crate::decode::rng::Rng::from_seed(5);
        for case in 0..24 {
            let v = [50, 1000, 5000][case % 3];
            let spread = [0.5, 4.0, 12.0][(case / 3) % 3];
            // Quantised logits so ties occur.
            let logits: Vec<f32> = (0..v)
                .map(|_| ((rng.next_f64() * spread * 8.0).round() / 8.0) as f32)
                .collect();
            let t = [0.7f32, 1.0, 1.5][case % 3];
            let top_k = [0, 0, 40, 300][case % 4];
            let top_p = [0.5f32, 0.9, 0.99, 1.0][(case / 4) % 4];
            let got = processed_distribution(&logits, &params(t, top_k, top_p)).unwrap();
            let want = reference(&logits, f64::from(t), top_k, f64::from(top_p));
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert!((g - w).abs() < 1e-9, "case {case} id {i}: {g} vs {w}");
                assert_eq!(*g == 0.0, *w == 0.0, "case {case} id {i}: support differs");
            }
        }
    }

    #[test]
    fn sample_is_inverse_cdf_in_id_order() {
        let p = [0.25, 0.0, 0.5, 0.25];
        assert_eq!(sample(&p, 0.0).unwrap(), 0);
        assert_eq!(sample(&p, 0.2499).unwrap(), 0);
        assert_eq!(sample(&p, 0.25).unwrap(), 2);
        assert_eq!(sample(&p, 0.7499).unwrap(), 2);
        assert_eq!(sample(&p, 0.75).unwrap(), 3);
        assert_eq!(sample(&p, 0.999_999_999).unwrap(), 3);
        assert!(sample(&[0.0, 0.0], 0.5).is_err());
    }
}
