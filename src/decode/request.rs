//! A generation request as a caller states it: every field, its default, and how it becomes
//! the loop's [`GenerateOptions`] (whose `validate` is the one check of every value, with
//! one message per mistake). The Python layer fills it from a dict (`python::request`), so a
//! new field is declared here, read there by name, and acted on in the sampler.

use super::{DraftDepth, DraftSource, GenerateOptions, Grammar, PromptLogprobs, SamplingParams};
use crate::Result;

/// Every field a caller can set on one generation. Unset fields keep [`Default`]'s values,
/// the engine's (`temperature` 0 is greedy; penalties, bias and `min_tokens` off).
#[derive(Clone, Debug, PartialEq)]
pub struct GenerateRequest {
    /// At least 1; the engine ends earlier at its context limit.
    pub max_new_tokens: usize,
    pub temperature: f32,
    pub top_k: usize,
    pub top_p: f32,
    pub min_p: f32,
    /// The sampling stream's seed (the Python layer draws a random one when none is given).
    pub seed: u64,
    pub repetition_penalty: f32,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// (token id, value added to its logit); −inf bans the token.
    pub logit_bias: Vec<(u32, f32)>,
    pub min_tokens: usize,
    /// Report each generated token's log-probability with this many alternatives.
    pub logprobs: Option<usize>,
    /// Score the prompt's tokens with this many alternatives (vLLM's `prompt_logprobs`).
    pub prompt_logprobs: Option<usize>,
    /// The tokens that end the generation; `None`: the model's EOS ids.
    pub stop_ids: Option<Vec<u32>>,
    /// Structured output: (kind, text), kind one of `constraint::GRAMMAR_KINDS`.
    pub grammar: Option<(String, String)>,
    /// "auto", "mtp", "ngram" or "off".
    pub draft: String,
    /// Tokens drafted per step; 0 = automatic.
    pub draft_depth: usize,
}

impl Default for GenerateRequest {
    fn default() -> Self {
        let sampling = SamplingParams::default();
        GenerateRequest {
            max_new_tokens: GenerateOptions::default().max_new_tokens,
            temperature: sampling.temperature,
            top_k: sampling.top_k,
            top_p: sampling.top_p,
            min_p: sampling.min_p,
            seed: 0,
            repetition_penalty: sampling.repetition_penalty,
            presence_penalty: sampling.presence_penalty,
            frequency_penalty: sampling.frequency_penalty,
            logit_bias: Vec::new(),
            min_tokens: sampling.min_tokens,
            logprobs: None,
            prompt_logprobs: None,
            stop_ids: None,
            grammar: None,
            draft: DraftSource::Auto.as_str().to_owned(),
            draft_depth: 0,
        }
    }
}

impl GenerateRequest {
    /// The names of the fields, as a caller spells them.
    pub const FIELDS: &'static [&'static str] = &[
        "max_new_tokens",
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "stop_ids",
        "grammar",
        "draft",
        "draft_depth",
    ];

    /// The loop's options for this request over `base` (the engine's: its EOS ids, context
    /// limit, prefill chunk), the grammar compiled by `compile`; every value checked.
    pub fn options(
        &self,
        base: GenerateOptions,
        compile: impl FnOnce(&str, &str) -> Result<Grammar>,
    ) -> Result<GenerateOptions> {
        let constraint = match &self.grammar {
            None => None,
            Some((kind, text)) => Some(compile(kind, text)?),
        };
        let opts = GenerateOptions {
            max_new_tokens: self.max_new_tokens,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                seed: Some(self.seed),
                repetition_penalty: self.repetition_penalty,
                presence_penalty: self.presence_penalty,
                frequency_penalty: self.frequency_penalty,
                logit_bias: self.logit_bias.clone(),
                min_tokens: self.min_tokens,
                constraint,
                prompt_logprobs: self.prompt_logprobs.map(PromptLogprobs::new),
            },
            stop_tokens: self.stop_ids.clone().unwrap_or(base.stop_tokens),
            draft: DraftSource::parse(&self.draft)?,
            depth: match self.draft_depth {
                0 => DraftDepth::Auto,
                d => DraftDepth::Fixed(d),
            },
            logprobs: self.logprobs,
            ..base
        };
        opts.validate()?;
        Ok(opts)
    }

    /// [`options`](Self::options)' checks without a model: every value but the token ids
    /// against a vocabulary and the grammar's compilation.
    pub fn check(&self) -> Result<()> {
        let unconstrained = GenerateRequest {
            grammar: None,
            ..self.clone()
        };
        unconstrained
            .options(GenerateOptions::default(), |_, _| unreachable_grammar())
            .map(|_| ())
    }
}

/// `check` clears the grammar before it builds options, so no compile is asked for.
fn unreachable_grammar() -> Result<Grammar> {
    Err(crate::Error::Internal(
        "a grammar was compiled by a check that has none".into(),
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_default_request_gives_the_default_options() {
        let got = GenerateRequest::default()
            .options(GenerateOptions::default(), |_, _| unreachable_grammar())
            .unwrap();
        let want = GenerateOptions::default();
        assert_eq!(got.max_new_tokens, want.max_new_tokens);
        assert_eq!(
            got.sampling,
            SamplingParams {
                seed: Some(0),
                ..want.sampling
            }
        );
        assert_eq!(got.draft, want.draft);
        assert_eq!(got.depth, want.depth);
        assert_eq!(got.logprobs, want.logprobs);
    }

    #[test]
    fn each_bad_value_is_named_once() {
        let cases: [(&str, GenerateRequest); 7] = [
            (
                "max_new_tokens",
                GenerateRequest {
                    max_new_tokens: 0,
                    ..Default::default()
                },
            ),
            (
                "temperature",
                GenerateRequest {
                    temperature: -1.0,
                    ..Default::default()
                },
            ),
            (
                "top_p",
                GenerateRequest {
                    top_p: 0.0,
                    ..Default::default()
                },
            ),
            (
                "min_p",
                GenerateRequest {
                    min_p: 1.5,
                    ..Default::default()
                },
            ),
            (
                "repetition_penalty",
                GenerateRequest {
                    repetition_penalty: 0.0,
                    ..Default::default()
                },
            ),
            (
                "draft",
                GenerateRequest {
                    draft: "sometimes".into(),
                    ..Default::default()
                },
            ),
            (
                "logprobs",
                GenerateRequest {
                    logprobs: Some(1000),
                    ..Default::default()
                },
            ),
        ];
        for (name, request) in cases {
            match request.check() {
                Err(crate::Error::InvalidArgument { param, .. }) => assert_eq!(param, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        assert!(GenerateRequest::default().check().is_ok());
    }
}
