//! How to pick tokens: [`SamplingParams`], their defaults and the checks of their values.

use super::logprob::MAX_TOP_LOGPROBS;
use crate::decode::constraint::Grammar;
use crate::decode::prompt::PromptLogprobs;
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

    /// Whether any step of [`History::process`](super::History::process) changes logits.
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
