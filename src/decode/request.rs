//! A generation request as a caller states it: every field, its default, how it is set by
//! name from a [`FieldValue`] (the Python layer's dict, converted by type alone), and how it
//! becomes the loop's [`GenerateOptions`] (whose `validate` is the one check of every value,
//! with one message per mistake). A new field is declared, named and mapped here, and acted
//! on in the sampler.

use super::{DraftDepth, DraftSource, GenerateOptions, Grammar, PromptLogprobs, SamplingParams};
use crate::{Error, Result};

/// A field's value as a caller gives it, before it is read as the field's type.
#[derive(Clone, Debug, PartialEq)]
pub enum FieldValue {
    None,
    Bool(bool),
    Int(i128),
    Float(f64),
    Str(String),
    /// A list or tuple of values.
    List(Vec<FieldValue>),
}

impl std::fmt::Display for FieldValue {
    /// Python's spelling of the value (what the caller wrote).
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FieldValue::None => f.write_str("None"),
            FieldValue::Bool(b) => f.write_str(if *b { "True" } else { "False" }),
            FieldValue::Int(i) => write!(f, "{i}"),
            FieldValue::Float(x) => write!(f, "{x:?}"),
            FieldValue::Str(s) => write!(f, "{s:?}"),
            FieldValue::List(items) => {
                f.write_str("[")?;
                for (k, item) in items.iter().enumerate() {
                    if k > 0 {
                        f.write_str(", ")?;
                    }
                    write!(f, "{item}")?;
                }
                f.write_str("]")
            }
        }
    }
}

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

    /// Set the field `name` from `value`; an unknown name or a value of another type is an
    /// error naming the field.
    pub fn set(&mut self, name: &str, value: &FieldValue) -> Result<()> {
        let v = value;
        match name {
            "max_new_tokens" => self.max_new_tokens = uint(name, v)?,
            "temperature" => self.temperature = number(name, v)?,
            "top_k" => self.top_k = uint(name, v)?,
            "top_p" => self.top_p = number(name, v)?,
            "min_p" => self.min_p = number(name, v)?,
            "seed" => self.seed = uint(name, v)?,
            "repetition_penalty" => self.repetition_penalty = number(name, v)?,
            "presence_penalty" => self.presence_penalty = number(name, v)?,
            "frequency_penalty" => self.frequency_penalty = number(name, v)?,
            "logit_bias" => self.logit_bias = optional(v, |v| bias(name, v))?.unwrap_or_default(),
            "min_tokens" => self.min_tokens = uint(name, v)?,
            "logprobs" => self.logprobs = optional(v, |v| uint(name, v))?,
            "prompt_logprobs" => self.prompt_logprobs = optional(v, |v| uint(name, v))?,
            "stop_ids" => self.stop_ids = optional(v, |v| list(name, v, uint))?,
            "grammar" => self.grammar = optional(v, |v| text_pair(name, v))?,
            "draft" => self.draft = text(name, v)?,
            "draft_depth" => self.draft_depth = uint(name, v)?,
            _ => {
                return Err(Error::invalid(
                    "request",
                    format!(
                        "unknown field '{name}'; the fields are {}",
                        Self::FIELDS.join(", ")
                    ),
                ))
            }
        }
        Ok(())
    }

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

fn wrong(name: &str, v: &FieldValue, expected: &str) -> Error {
    Error::invalid(name, format!("{v}; expected {expected}"))
}

/// A non-negative integer that fits the field's type.
fn uint<T: TryFrom<i128>>(name: &str, v: &FieldValue) -> Result<T> {
    match v {
        FieldValue::Int(i) => T::try_from(*i).map_err(|_| match *i < 0 {
            true => Error::invalid(name, format!("{i}; expected an integer >= 0")),
            false => Error::invalid(name, format!("{i} is too large")),
        }),
        _ => Err(wrong(name, v, "an integer >= 0")),
    }
}

/// A number (an integer or a float; its range is `validate`'s).
fn number(name: &str, v: &FieldValue) -> Result<f32> {
    match v {
        FieldValue::Int(i) => Ok(*i as f32),
        FieldValue::Float(x) => Ok(*x as f32),
        _ => Err(wrong(name, v, "a number")),
    }
}

fn text(name: &str, v: &FieldValue) -> Result<String> {
    match v {
        FieldValue::Str(s) => Ok(s.clone()),
        _ => Err(wrong(name, v, "a string")),
    }
}

fn optional<T>(v: &FieldValue, read: impl FnOnce(&FieldValue) -> Result<T>) -> Result<Option<T>> {
    match v {
        FieldValue::None => Ok(None),
        v => read(v).map(Some),
    }
}

fn list<T>(
    name: &str,
    v: &FieldValue,
    item: impl Fn(&str, &FieldValue) -> Result<T>,
) -> Result<Vec<T>> {
    match v {
        FieldValue::List(items) => items.iter().map(|x| item(name, x)).collect(),
        _ => Err(wrong(name, v, "a list")),
    }
}

/// `[(token id, bias)]`.
fn bias(name: &str, v: &FieldValue) -> Result<Vec<(u32, f32)>> {
    list(name, v, |name, pair| match pair {
        FieldValue::List(p) if p.len() == 2 => Ok((uint(name, &p[0])?, number(name, &p[1])?)),
        _ => Err(wrong(name, pair, "a (token id, bias) pair")),
    })
}

/// `(kind, text)`.
fn text_pair(name: &str, v: &FieldValue) -> Result<(String, String)> {
    match v {
        FieldValue::List(p) if p.len() == 2 => Ok((text(name, &p[0])?, text(name, &p[1])?)),
        _ => Err(wrong(name, v, "(kind, text)")),
    }
}

/// `check` clears the grammar before it builds options, so no compile is asked for.
fn unreachable_grammar() -> Result<Grammar> {
    Err(Error::Internal(
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
    fn fields_are_set_by_name_and_a_wrong_type_names_the_field() {
        let mut r = GenerateRequest::default();
        r.set("temperature", &FieldValue::Int(1)).unwrap();
        r.set("top_k", &FieldValue::Int(5)).unwrap();
        let pair = FieldValue::List(vec![FieldValue::Int(3), FieldValue::Float(-1.5)]);
        r.set("logit_bias", &FieldValue::List(vec![pair])).unwrap();
        r.set("logprobs", &FieldValue::None).unwrap();
        let kind_text = vec![
            FieldValue::Str("regex".into()),
            FieldValue::Str("a+".into()),
        ];
        r.set("grammar", &FieldValue::List(kind_text)).unwrap();
        assert_eq!((r.temperature, r.top_k), (1.0, 5));
        assert_eq!(r.logit_bias, vec![(3, -1.5)]);
        assert_eq!(r.grammar, Some(("regex".into(), "a+".into())));
        for (name, v) in [
            ("top_k", FieldValue::Int(-1)),
            ("top_k", FieldValue::Str("3".into())),
            ("seed", FieldValue::Int(1 << 64)),
            ("temperature", FieldValue::Str("hot".into())),
            ("stop_ids", FieldValue::Int(3)),
        ] {
            match r.set(name, &v) {
                Err(Error::InvalidArgument { param, .. }) => assert_eq!(param, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        let unknown = r.set("temprature", &FieldValue::Float(1.0)).unwrap_err();
        assert!(unknown.to_string().contains("unknown field 'temprature'"));
        // Every field has a name `set` knows.
        for name in GenerateRequest::FIELDS {
            let e = GenerateRequest::default().set(name, &FieldValue::Bool(true));
            assert!(
                !e.unwrap_err().to_string().contains("unknown field"),
                "{name}"
            );
        }
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
                Err(Error::InvalidArgument { param, .. }) => assert_eq!(param, name),
                other => panic!("{name}: {other:?}"),
            }
        }
        assert!(GenerateRequest::default().check().is_ok());
    }
}
