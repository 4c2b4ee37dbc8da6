//! The speculative decode loop: prefill, then cycles of draft → verify in one `step_all` →
//! accept → roll back (docs/speculative.md).
//!
//! Every verified row picks the target's token exactly as plain decoding would (greedy argmax,
//! or an inverse-CDF draw from the processed distribution with that position's uniform), and a
//! draft is accepted iff it equals that pick. So the emitted tokens are the plain-decoding
//! tokens, whatever the drafter proposes; sampled output is identical to plain sampling with
//! the same seed.

mod cache_state;
mod cycle;
mod prefill;

use std::sync::atomic::AtomicBool;
use std::time::Instant;

use super::depth::DepthController;
use super::guard::{GuardConfig, PauseGuard};
use super::mtp::MtpDrafter;
use super::ngram::NgramDrafter;
use super::pricing::DraftPricing;
use super::rng::Rng;
use super::sampling::{
    pick, token_logprob, History, SamplingParams, TokenLogprob, MAX_TOP_LOGPROBS,
};
use super::stats::{DecodeStats, MAX_DEPTH};
use super::{Drafter, Target};
use crate::{Error, Result};

pub use cache_state::CacheState;
use cache_state::{reusable_prefix, DraftMemory};
use prefill::check_prompt;

/// What one forward emitted, as a generation's `on_tokens` callback sees it: the tokens
/// and, when [`GenerateOptions::logprobs`] asked for them, their log-probabilities (one per
/// token, the entries [`Generation::logprobs`] ends with; empty otherwise), so that a stream
/// can carry each token's log-probability with it.
#[derive(Clone, Copy, Debug)]
pub struct Emitted<'a> {
    pub tokens: &'a [u32],
    pub logprobs: &'a [TokenLogprob],
}

/// Where drafts come from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftSource {
    /// Plain decoding: one token per forward.
    Off,
    /// The model's MTP head (an error if the model has none).
    Mtp,
    /// Prompt lookup (n-gram).
    Ngram,
    /// `Mtp` when the model has a head, else `Ngram`.
    Auto,
}

impl DraftSource {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "off" => Ok(DraftSource::Off),
            "mtp" => Ok(DraftSource::Mtp),
            "ngram" => Ok(DraftSource::Ngram),
            "auto" => Ok(DraftSource::Auto),
            _ => Err(Error::invalid(
                "draft",
                format!("got '{s}'; expected one of 'auto', 'mtp', 'ngram', 'off'"),
            )),
        }
    }

    pub fn as_str(self) -> &'static str {
        match self {
            DraftSource::Off => "off",
            DraftSource::Mtp => "mtp",
            DraftSource::Ngram => "ngram",
            DraftSource::Auto => "auto",
        }
    }
}

/// Draft depth G: drafts proposed per verify.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DraftDepth {
    /// Always G (1..=8), less where max_new_tokens or the context limit leave less room.
    Fixed(usize),
    /// Chosen online by [`DepthController`] (0..=8).
    Auto,
}

impl DraftDepth {
    /// "auto" or an integer 1..=8.
    pub fn parse(s: &str) -> Result<Self> {
        if s == "auto" {
            return Ok(DraftDepth::Auto);
        }
        match s.parse::<usize>() {
            Ok(g) => {
                let d = DraftDepth::Fixed(g);
                d.validate()?;
                Ok(d)
            }
            Err(_) => Err(Error::invalid(
                "draft_depth",
                format!("got '{s}'; expected 'auto' or an integer 1..={MAX_DEPTH}"),
            )),
        }
    }

    pub fn validate(self) -> Result<()> {
        match self {
            DraftDepth::Fixed(g) if !(1..=MAX_DEPTH).contains(&g) => Err(Error::invalid(
                "draft_depth",
                format!("got {g}; expected 'auto' or 1..={MAX_DEPTH} (use draft='off' for none)"),
            )),
            _ => Ok(()),
        }
    }
}

/// Called after each prefill chunk with (prompt tokens processed, prompt tokens to
/// process): the progress of long prompts, for a bar or a log line.
#[derive(Clone)]
pub struct PrefillProgress(pub std::sync::Arc<dyn Fn(usize, usize) + Send + Sync>);

impl std::fmt::Debug for PrefillProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("PrefillProgress(..)")
    }
}

/// Prompt tokens per prefill forward when progress is reported and no chunk size was set:
/// large enough that re-reading the weights per chunk costs little (a forward reads them
/// once whatever its rows), small enough to report every few seconds on a large model.
pub const PROGRESS_CHUNK: usize = 512;

/// Everything `generate` needs besides the model and the prompt.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// At least 1. A stop token counts as generated.
    pub max_new_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends after emitting any of these (the stop token is kept in the output).
    pub stop_tokens: Vec<u32>,
    pub draft: DraftSource,
    pub depth: DraftDepth,
    pub guard: GuardConfig,
    /// Most tokens (prompt + generated) the sequence may reach; `None` = unlimited. A prompt that
    /// leaves no room is an error; reaching it later ends with [`FinishReason::ContextFull`].
    pub max_context: Option<usize>,
    /// Rows per prefill `step_all` and per MTP absorb batch (0 = the whole prompt at once).
    pub prefill_chunk: usize,
    /// Report each generated token's log-probability with this many most likely
    /// alternatives ([`Generation::logprobs`]); `None` computes none.
    pub logprobs: Option<usize>,
    /// Told the prefill's progress after each chunk (chunks of [`PROGRESS_CHUNK`] when
    /// `prefill_chunk` is 0).
    pub prefill_progress: Option<PrefillProgress>,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_new_tokens: 128,
            sampling: SamplingParams::default(),
            stop_tokens: Vec::new(),
            draft: DraftSource::Auto,
            depth: DraftDepth::Auto,
            guard: GuardConfig::default(),
            max_context: None,
            prefill_chunk: 0,
            logprobs: None,
            prefill_progress: None,
        }
    }
}

impl GenerateOptions {
    pub fn validate(&self) -> Result<()> {
        if self.max_new_tokens == 0 {
            return Err(Error::invalid("max_new_tokens", "must be at least 1"));
        }
        self.sampling.validate()?;
        if let Some(k) = self.logprobs.filter(|&k| k > MAX_TOP_LOGPROBS) {
            return Err(Error::invalid(
                "logprobs",
                format!("{k} alternatives; at most {MAX_TOP_LOGPROBS}"),
            ));
        }
        self.depth.validate()?;
        self.guard.validate()
    }
}

/// Why generation ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub enum FinishReason {
    /// max_new_tokens reached.
    Length,
    /// A stop token was emitted.
    Stop,
    /// The `on_tokens` callback returned false.
    Cancelled,
    /// The sequence reached `max_context`.
    ContextFull,
}

impl FinishReason {
    /// Every reason (the tests hold it to the enum: a new variant must be listed here).
    pub const ALL: [FinishReason; 4] = [
        FinishReason::Length,
        FinishReason::Stop,
        FinishReason::Cancelled,
        FinishReason::ContextFull,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Length => "length",
            FinishReason::Stop => "stop",
            FinishReason::Cancelled => "cancelled",
            FinishReason::ContextFull => "context_full",
        }
    }
}

/// The result of [`generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// Generated tokens (without the prompt).
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub stats: DecodeStats,
    /// One per generated token when [`GenerateOptions::logprobs`] asked for them.
    pub logprobs: Vec<TokenLogprob>,
}

impl Generation {
    /// The tokens whose KV rows the target holds after this generation of `prompt`: the
    /// prompt and every generated token but the last (which no forward has consumed).
    pub fn kv_tokens(&self, prompt: &[u32]) -> Vec<u32> {
        let mut t = prompt.to_vec();
        t.extend(&self.tokens[..self.tokens.len().saturating_sub(1)]);
        t
    }
}

/// How verified rows decide on drafts. Only `Exact` is lossless; the other exists to show
/// that the tests can tell.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Acceptance {
    Exact,
    /// Negative control: accept every draft unconditionally.
    #[cfg(test)]
    AcceptAll,
}

/// Generate up to `opts.max_new_tokens` tokens after `prompt`.
///
/// Starts from empty caches (truncates the target's main and MTP KV to 0). `on_tokens` gets
/// every burst of emitted tokens; returning false ends generation with
/// [`FinishReason::Cancelled`]. `cancel` is checked before every forward: once set, the call
/// returns `Err(Error::Cancelled)`. On every return, error or not, the target is left
/// consistent: `kv_len() == prompt.len() + emitted − 1` (the last emitted token is not fed;
/// 0 if nothing was emitted) and the MTP KV holds only rows built from true hidden states, at
/// most `kv_len()` of them.
pub fn generate(
    target: &mut dyn Target,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
    cancel: &AtomicBool,
) -> Result<Generation> {
    generate_after(
        target,
        &mut CacheState::default(),
        prompt,
        opts,
        on_tokens,
        cancel,
    )
}

/// [`generate`] on a target whose caches hold what `state` says (an earlier generation on
/// it): the longest common prefix of `state.tokens` and `prompt` is kept and only the rest of
/// the prompt is prefilled ([`DecodeStats::prompt_cached_tokens`] says how many were kept);
/// `state` then describes the new contents. The output is the one a fresh prefill gives
/// (every forward is S-invariant), token for token under greedy and seeded sampling, with or
/// without drafting.
///
/// With MTP drafting the MTP layer's cache is kept too, with the hidden states it had not
/// absorbed; when the prompt diverges before the MTP layer's last row, the kept prefix ends
/// one token before the divergence (that row pairs a position with the next token). A
/// generation without MTP drafting leaves the MTP layer's cache empty, so the next MTP one
/// keeps no prefix. On error `state` is cleared.
pub fn generate_after(
    target: &mut dyn Target,
    state: &mut CacheState,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
    cancel: &AtomicBool,
) -> Result<Generation> {
    let epoch = Instant::now();
    let clock = move || epoch.elapsed().as_secs_f64();
    generate_timed(target, state, prompt, opts, on_tokens, cancel, &clock)
}

/// [`generate_after`] timed by `clock` (tests pass the mock's virtual clock).
pub(crate) fn generate_timed(
    target: &mut dyn Target,
    state: &mut CacheState,
    prompt: &[u32],
    opts: &GenerateOptions,
    on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
    cancel: &AtomicBool,
    clock: Clock<'_>,
) -> Result<Generation> {
    let previous = std::mem::take(state);
    let mut decoding = Decoding::start(target, previous, prompt, opts, clock)?;
    let finish = decoding.run(target, on_tokens, cancel);
    let (generation, next) = decoding.end(target, finish)?;
    *state = next;
    Ok(generation)
}

/// The parts of the loop that tests replace: the drafter, the acceptance rule, the clock.
#[cfg(test)]
pub(crate) struct Hooks<'d, 'c> {
    pub drafter: Option<&'d mut dyn Drafter>,
    pub acceptance: Acceptance,
    pub clock: Clock<'c>,
}

/// The automatic depth re-reads what a draft's bytes cost ([`Target::byte_costs`]) every this
/// many cycles.
pub const BYTE_COSTS_EVERY: usize = 16;

/// Seconds on a monotonic clock; the loop times forwards and drafting with it (tests pass a
/// virtual clock that the mock model advances).
pub(crate) type Clock<'a> = &'a dyn Fn() -> f64;

/// The loop behind [`generate`] with explicit [`Hooks`] (tests plug in forced drafters, the
/// negative control and a virtual clock here). Starts from empty caches.
#[cfg(test)]
pub(crate) fn run(
    target: &mut dyn Target,
    prompt: &[u32],
    opts: &GenerateOptions,
    hooks: Hooks<'_, '_>,
    on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
    cancel: &AtomicBool,
) -> Result<Generation> {
    let Hooks {
        drafter,
        acceptance,
        clock,
    } = hooks;
    let drafter = drafter.map(|d| Box::new(d) as Box<dyn Drafter + '_>);
    let mut decoding = Decoding::new(target, 0, 0, prompt, opts, drafter, clock)?;
    decoding.acceptance = acceptance;
    let finish = decoding.run(target, on_tokens, cancel);
    decoding.end(target, finish).map(|(g, _)| g)
}

/// One generation in progress, as a state machine over a [`Target`] it does not own:
/// [`start`](Self::start) (prefix reuse, the drafter) → [`prefill`](Self::prefill) →
/// cycles of [`plan`](Self::plan) (draft; the rows to verify are [`feed`](Self::feed)) → one
/// forward over them → [`verified`](Self::verified) (accept, roll back, emit) →
/// [`end`](Self::end). [`generate_after`] runs the cycle with `step_all`; the engine's
/// batched decode runs the same steps for several sequences with the forward shared
/// (`Model::step_batch`), so both paths pick, accept and emit through this code.
pub(crate) struct Decoding<'d, 'c> {
    opts: GenerateOptions,
    drafter: Option<Box<dyn Drafter + 'd>>,
    pub(crate) acceptance: Acceptance,
    vocab: usize,
    hidden: usize,
    prompt_len: usize,
    /// Prompt + emitted tokens. Invariant between cycles: kv_len() == ctx.len() − 1.
    ctx: Vec<u32>,
    /// What the logit processing of the next row depends on (`ctx` as the sampler sees it).
    history: History,
    /// One per emitted token, when asked for.
    logprobs: Vec<TokenLogprob>,
    /// Those of the burst being picked, moved to `logprobs` as `emit` keeps its tokens.
    burst_logprobs: Vec<TokenLogprob>,
    rng: Rng,
    stats: DecodeStats,
    guard: PauseGuard,
    depth: DepthController,
    /// Drafting was priced out on these caches before this generation (it runs without).
    mtp_priced_out: bool,
    /// The price check of the default drafter (`None`: not priced).
    pricing: Option<DraftPricing>,
    /// What earlier generations on these caches learned about drafting, where this one drafts
    /// otherwise (or not at all): handed on to the next generation as it came.
    passed_on_memory: Option<DraftMemory>,
    /// Whether the previous cycle drafted: only then is a draft's time typical (after a
    /// cycle without drafts the MTP drafter also absorbs the rows it skipped).
    drafted_last_cycle: bool,
    /// Cycles of the automatic depth since the byte costs were last read from the target
    /// (`None`: never; re-read every [`BYTE_COSTS_EVERY`] cycles).
    byte_costs_age: Option<usize>,
    clock: Clock<'c>,
    /// First prompt position the prefill computes (the ones before were kept in the cache).
    prefilled_from: usize,
    /// The next prompt position to prefill (= `prompt_len` once the prefill is done).
    prefill_at: usize,
    /// When the prefill's first forward began.
    prefill_started: Option<f64>,
    /// When the generation started (its `clock`).
    started: f64,
    /// The cycle between `plan` and `verified`: the KV length before it, its drafts, and the
    /// rows to verify (the last context token, then the drafts).
    planned: Option<Planned>,
}

/// The rows of a prefill forward ([`Decoding::prefill_rows`]).
pub(crate) struct PrefillRows<'a> {
    pub tokens: &'a [u32],
    pub start: usize,
    /// Every row's logits are needed (the prompt's log-probabilities), not only the last.
    pub all_logits: bool,
}

struct Planned {
    kv: usize,
    drafts: Vec<u32>,
    feed: Vec<u32>,
    /// The drafts are a probe's (free, not the drafter's).
    probe: bool,
    started: f64,
}

impl<'c> Decoding<'static, 'c> {
    /// A generation of `prompt` on a target whose caches hold what `previous` says (see
    /// [`generate_after`]): validates the options, keeps the reusable prefix, makes the
    /// drafter. Nothing is computed yet.
    pub(crate) fn start(
        target: &mut dyn Target,
        previous: CacheState,
        prompt: &[u32],
        opts: &GenerateOptions,
        clock: Clock<'c>,
    ) -> Result<Self> {
        opts.validate()?;
        // The defaults price MTP drafting before paying for it (docs/speculative.md, "Priced
        // drafting"); once priced out on these caches it stays off for them.
        let priced =
            opts.draft == DraftSource::Auto && opts.depth == DraftDepth::Auto && target.has_mtp();
        let priced_out = priced && previous.mtp_priced_out;
        let source = match opts.draft {
            _ if priced_out => DraftSource::Off,
            DraftSource::Auto if target.has_mtp() => DraftSource::Mtp,
            DraftSource::Auto => DraftSource::Ngram,
            DraftSource::Mtp if !target.has_mtp() => {
                return Err(Error::invalid(
                    "draft",
                    "'mtp' needs a model with an MTP head and this one has none (or it was disabled); use 'auto', 'ngram' or 'off'",
                ))
            }
            s => s,
        };
        let memory = previous.draft_memory.clone();
        let (keep, mtp_keep, pending) = reusable_prefix(target, previous, prompt, source);
        let drafter: Option<Box<dyn Drafter>> = match source {
            DraftSource::Mtp => Some(Box::new(MtpDrafter::resume(
                target,
                opts.prefill_chunk,
                pending,
            ))),
            DraftSource::Ngram => Some(Box::new(NgramDrafter)),
            _ => None,
        };
        let mut decoding = Decoding::new(target, keep, mtp_keep, prompt, opts, drafter, clock)?;
        // What earlier generations on these caches learned serves this one where it drafts the
        // same way; otherwise it is passed on untouched to the next.
        let drafts_alike = |m: &DraftMemory| {
            opts.depth == DraftDepth::Auto
                && source != DraftSource::Off
                && m.mtp == (source == DraftSource::Mtp)
        };
        let (memory, passed_on) = match memory {
            Some(m) if drafts_alike(&m) => (Some(m), None),
            other => (None, other),
        };
        if priced_out {
            decoding.mtp_priced_out = true;
        } else if priced {
            let share = target.mtp_draft_share();
            let probes = memory
                .as_ref()
                .map(|m| m.probes.clone())
                .unwrap_or_default();
            decoding.pricing = Some(DraftPricing::with_probes(share, probes));
        }
        if let Some(m) = memory {
            decoding.depth = m.depth;
        }
        decoding.passed_on_memory = passed_on;
        Ok(decoding)
    }
}

impl<'d, 'c> Decoding<'d, 'c> {
    /// A generation keeping the first `keep` main KV rows (they hold `prompt[..keep]`) and
    /// `mtp_keep` MTP rows (the drafter holds the hidden states between them).
    pub(crate) fn new(
        target: &mut dyn Target,
        keep: usize,
        mtp_keep: usize,
        prompt: &[u32],
        opts: &GenerateOptions,
        drafter: Option<Box<dyn Drafter + 'd>>,
        clock: Clock<'c>,
    ) -> Result<Self> {
        opts.validate()?;
        let vocab = target.vocab_size();
        check_prompt(prompt, vocab, opts.max_context)?;
        opts.sampling.validate_tokens(vocab)?;
        let keep = keep.min(prompt.len() - 1).min(target.kv_len());
        target.truncate(keep);
        target.mtp_truncate(mtp_keep.min(keep).min(target.mtp_kv_len()));
        let seed = opts.sampling.seed.unwrap_or_else(Rng::entropy_seed);
        Ok(Decoding {
            vocab,
            hidden: target.hidden_size(),
            opts: opts.clone(),
            drafter,
            acceptance: Acceptance::Exact,
            prompt_len: prompt.len(),
            ctx: prompt.to_vec(),
            history: History::new(prompt, &opts.sampling, &opts.stop_tokens),
            logprobs: Vec::new(),
            burst_logprobs: Vec::new(),
            rng: Rng::from_seed(seed),
            stats: DecodeStats::new(prompt.len(), keep),
            prefilled_from: keep,
            prefill_at: keep,
            prefill_started: None,
            guard: PauseGuard::new(opts.guard.clone()),
            depth: DepthController::new(MAX_DEPTH),
            mtp_priced_out: false,
            pricing: None,
            passed_on_memory: None,
            drafted_last_cycle: false,
            byte_costs_age: None,
            started: clock(),
            clock,
            planned: None,
        })
    }

    fn now(&self) -> f64 {
        (self.clock)()
    }

    /// The token for a row whose context is `ctx` + `extra`: the pick of the processed row
    /// (or `draft`, under the negative control), with its log-probability when asked for.
    fn choose(&mut self, row: &[f32], extra: &[u32], draft: Option<u32>) -> Result<u32> {
        let params = &self.opts.sampling;
        let processed = self.history.process(row, params, extra);
        let picked = pick(&processed, params, self.rng.next_f64())?;
        let tok = match draft {
            Some(d) if self.accept_all() => d,
            _ => picked,
        };
        if let Some(top) = self.opts.logprobs {
            self.burst_logprobs
                .push(token_logprob(&processed, params, tok, top)?);
        }
        Ok(tok)
    }

    fn accept_all(&self) -> bool {
        match self.acceptance {
            Acceptance::Exact => false,
            #[cfg(test)]
            Acceptance::AcceptAll => true,
        }
    }
}
