//! Structured output: a JSON schema, a regular expression or a Lark grammar, compiled by the
//! `llguidance` crate into a token mask over the model's vocabulary (docs/python-api.md,
//! "Structured output").
//!
//! The mask is one more step of [`History::process`](super::History::process): a row's
//! constraint state is the generation's (advanced by `push` per emitted token) followed by the
//! drafts before the row, so every verify row is masked exactly as plain decoding masks the
//! same position, and speculation stays lossless (docs/speculative.md, "Acceptance").
//!
//! The grammar's end is a sentinel token one past the model's vocabulary: where the grammar
//! may end, the generation's stop tokens are allowed; once it is complete they are all that
//! is.

use std::sync::{Arc, Mutex, MutexGuard};

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{ApproximateTokEnv, SimpleVob, TokEnv, TokRxInfo, TokTrie};
use llguidance::{Matcher, ParserFactory};

use crate::{Error, Result};

/// What a generation's text must match.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GrammarSpec {
    /// A JSON schema (its text). Generated compact (no whitespace between JSON tokens) unless
    /// the schema's `"x-guidance"` options say otherwise.
    JsonSchema(String),
    /// A regular expression (Rust `regex` syntax) the whole text matches.
    Regex(String),
    /// A grammar in llguidance's Lark syntax (which also takes GBNF-style `{m,n}` repeats).
    Lark(String),
}

/// The kinds [`GrammarSpec::parse`] takes, as the Python API names them.
pub const GRAMMAR_KINDS: &[&str] = &["json", "regex", "grammar"];

impl GrammarSpec {
    /// `kind` is one of [`GRAMMAR_KINDS`]; `text` the schema, pattern or grammar.
    pub fn parse(kind: &str, text: &str) -> Result<Self> {
        let spec = match kind {
            "json" => GrammarSpec::JsonSchema(text.to_owned()),
            "regex" => GrammarSpec::Regex(text.to_owned()),
            "grammar" => GrammarSpec::Lark(text.to_owned()),
            _ => {
                return Err(Error::invalid(
                    "grammar",
                    format!("kind '{kind}'; expected one of {GRAMMAR_KINDS:?}"),
                ))
            }
        };
        if text.trim().is_empty() {
            return Err(Error::invalid(spec.param(), "is empty"));
        }
        Ok(spec)
    }

    /// The Python keyword that gives this kind (errors name it).
    pub fn param(&self) -> &'static str {
        match self {
            GrammarSpec::JsonSchema(_) => "guided_json",
            GrammarSpec::Regex(_) => "guided_regex",
            GrammarSpec::Lark(_) => "guided_grammar",
        }
    }

    fn top_level(&self) -> Result<TopLevelGrammar> {
        let schema = match self {
            GrammarSpec::Regex(rx) => return Ok(TopLevelGrammar::from_regex(rx)),
            GrammarSpec::Lark(g) => return Ok(TopLevelGrammar::from_lark(g.clone())),
            GrammarSpec::JsonSchema(text) => serde_json::from_str(text)
                .map_err(|e| Error::invalid(self.param(), format!("is not valid JSON: {e}")))?,
        };
        Ok(TopLevelGrammar::from_json_schema(compact(schema)))
    }
}

/// `schema` with llguidance told to generate compact JSON, unless it says how itself:
/// flexible whitespace lets a model pad its output with spaces and newlines indefinitely.
fn compact(mut schema: serde_json::Value) -> serde_json::Value {
    if let Some(obj) = schema.as_object_mut() {
        obj.entry("x-guidance")
            .or_insert_with(|| serde_json::json!({"whitespace_flexible": false}));
    }
    schema
}

/// Bytes of the end sentinel (0xFF marks a special token, which no grammar text matches).
const END_MARKER: &[u8] = b"\xFF<|colibri-end|>";

/// The model's vocabulary as the grammar engine sees it (every token's bytes); built once
/// per model, it compiles any number of grammars.
pub struct Vocabulary {
    factory: ParserFactory,
    vocab: usize,
}

impl std::fmt::Debug for Vocabulary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Vocabulary({} tokens)", self.vocab)
    }
}

/// Runs llguidance code that asserts on its input: a panic there is a bad vocabulary, not
/// a crash.
fn guarded<T>(what: &str, f: impl FnOnce() -> T) -> Result<T> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).map_err(|p| {
        let msg = p
            .downcast_ref::<String>()
            .cloned()
            .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
            .unwrap_or_default();
        Error::invalid("vocabulary", format!("{what}: {msg}"))
    })
}

impl Vocabulary {
    /// From every token's bytes, by id (special tokens prefixed with 0xFF); padded with
    /// empty (never allowed) tokens, or cut, to the model's `vocab` rows.
    pub fn new(mut tokens: Vec<Vec<u8>>, vocab: usize) -> Result<Self> {
        if vocab == 0 || vocab >= u32::MAX as usize {
            return Err(Error::invalid("vocabulary", format!("{vocab} tokens")));
        }
        tokens.resize(vocab, Vec::new());
        tokens.push(END_MARKER.to_vec());
        let info = TokRxInfo::new(vocab as u32 + 1, vocab as u32);
        let trie = guarded("building the token trie", || TokTrie::from(&info, &tokens))?;
        let env: TokEnv = Arc::new(ApproximateTokEnv::new(trie));
        let mut factory = guarded("building the grammar engine", || {
            ParserFactory::new_simple(&env)
        })?
        .map_err(|e| Error::invalid("vocabulary", e.to_string()))?;
        factory.quiet();
        Ok(Vocabulary { factory, vocab })
    }

    /// From the text of a Hugging Face `tokenizer.json` (byte-level BPE, or SentencePiece
    /// with byte fallback), through llguidance's reader of that format.
    pub fn from_tokenizer_json(text: &str, vocab: usize) -> Result<Self> {
        let json: serde_json::Value = serde_json::from_str(text)
            .map_err(|e| Error::invalid("tokenizer.json", format!("is not JSON: {e}")))?;
        let tokens = guarded("reading tokenizer.json", || {
            llguidance::token_bytes_from_tokenizer_json(&json)
        })?
        .map_err(|e| Error::invalid("tokenizer.json", e.to_string()))?;
        Self::new(tokens, vocab)
    }

    /// Tokens (rows of the logits) the grammars constrain.
    pub fn vocab_size(&self) -> usize {
        self.vocab
    }

    /// Compile `spec`; a bad schema, pattern or grammar is an `InvalidArgument` naming its
    /// keyword.
    pub fn compile(&self, spec: &GrammarSpec) -> Result<Grammar> {
        let top = spec.top_level()?;
        let matcher = guarded("compiling the grammar", || {
            Matcher::new(self.factory.create_parser(top))
        })
        .map_err(|e| Error::invalid(spec.param(), e.to_string()))?;
        if let Some(e) = matcher.get_error() {
            return Err(Error::invalid(spec.param(), e));
        }
        Ok(Grammar(Arc::new(GrammarInner {
            spec: spec.clone(),
            start: Mutex::new(matcher),
            vocab: self.vocab,
            #[cfg(test)]
            mask_verify_rows: true,
        })))
    }
}

/// A compiled grammar at its start, shared by the generations that use it.
#[derive(Clone)]
pub struct Grammar(Arc<GrammarInner>);

struct GrammarInner {
    spec: GrammarSpec,
    start: Mutex<Matcher>,
    vocab: usize,
    /// Negative control of the lossless tests: `false` leaves verify rows unmasked.
    #[cfg(test)]
    mask_verify_rows: bool,
}

impl PartialEq for Grammar {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}

impl std::fmt::Debug for Grammar {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Grammar({:?})", self.0.spec)
    }
}

fn lock(m: &Mutex<Matcher>) -> MutexGuard<'_, Matcher> {
    // A panic while holding it (caught by llguidance or `run`) leaves a matcher in an error
    // state at worst, which the mask reports as "no token allowed".
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Grammar {
    pub fn spec(&self) -> &GrammarSpec {
        &self.0.spec
    }

    /// The vocabulary size it was compiled for.
    pub fn vocab_size(&self) -> usize {
        self.0.vocab
    }

    /// The state of a generation that starts here and ends at any of `stop_tokens`.
    pub(crate) fn start(&self, stop_tokens: &[u32]) -> ConstraintState {
        ConstraintState {
            grammar: self.clone(),
            matcher: Mutex::new(lock(&self.0.start).clone()),
            stop_tokens: stop_tokens.to_vec(),
            ended: false,
        }
    }

    /// The same grammar with the negative control of the lossless tests switched on.
    #[cfg(test)]
    pub(crate) fn without_verify_masks(&self) -> Self {
        Grammar(Arc::new(GrammarInner {
            spec: self.0.spec.clone(),
            start: Mutex::new(lock(&self.0.start).clone()),
            vocab: self.0.vocab,
            mask_verify_rows: false,
        }))
    }
}

/// One generation's position in its grammar.
pub(crate) struct ConstraintState {
    grammar: Grammar,
    /// Behind a mutex because masking a row borrows the history shared (it advances the
    /// matcher over the drafts before the row and rolls it back).
    matcher: Mutex<Matcher>,
    stop_tokens: Vec<u32>,
    /// A stop token was emitted: the rows after it are never used.
    ended: bool,
}

impl Clone for ConstraintState {
    fn clone(&self) -> Self {
        ConstraintState {
            grammar: self.grammar.clone(),
            matcher: Mutex::new(lock(&self.matcher).clone()),
            stop_tokens: self.stop_tokens.clone(),
            ended: self.ended,
        }
    }
}

impl std::fmt::Debug for ConstraintState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ConstraintState")
            .field("grammar", &self.grammar)
            .field("ended", &self.ended)
            .finish_non_exhaustive()
    }
}

/// The mask of the state after `extra`, leaving `m` where it was; `None` when the matcher
/// fails (an internal limit, or a token the grammar does not allow).
fn mask_after(m: &mut Matcher, extra: &[u32]) -> Option<SimpleVob> {
    if !extra.is_empty() {
        m.consume_tokens(extra).ok()?;
    }
    let mask = m.compute_mask_or_eos().ok();
    if !extra.is_empty() {
        m.rollback(extra.len()).ok()?;
    }
    mask
}

impl ConstraintState {
    /// `token` was emitted.
    pub(crate) fn push(&mut self, token: u32) {
        if self.ended {
            return;
        }
        if self.stop_tokens.contains(&token) {
            self.ended = true;
            return;
        }
        // A token the mask did not allow puts the matcher in its error state: every later
        // row is then fully masked, which the sampler reports.
        let m = self
            .matcher
            .get_mut()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let _ = m.consume_token(token);
    }

    /// Set to −inf the logits of the tokens the grammar does not allow after this state and
    /// `extra`. Returns whether the grammar is complete (only a stop token may follow).
    pub(crate) fn mask(&self, x: &mut [f32], extra: &[u32]) -> bool {
        // A row after a stop token is past the end of the generation: it is never emitted.
        if self.ended || extra.iter().any(|t| self.stop_tokens.contains(t)) {
            return false;
        }
        #[cfg(test)]
        if !extra.is_empty() && !self.grammar.0.mask_verify_rows {
            return false;
        }
        let Some(allowed) = mask_after(&mut lock(&self.matcher), extra) else {
            x.fill(f32::NEG_INFINITY);
            return false;
        };
        let end = self.grammar.0.vocab;
        let may_end = allowed.len() > end && allowed.get(end);
        let saved: Vec<(usize, f32)> = if may_end {
            self.stop_tokens
                .iter()
                .filter_map(|&t| x.get(t as usize).map(|&v| (t as usize, v)))
                .collect()
        } else {
            Vec::new()
        };
        let limit = allowed.len().min(end);
        for (i, v) in x.iter_mut().enumerate() {
            if i >= limit || !allowed.get(i) {
                *v = f32::NEG_INFINITY;
            }
        }
        for (i, v) in saved {
            x[i] = v;
        }
        may_end && allowed.num_set() == 1
    }
}
