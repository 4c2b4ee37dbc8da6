//! What an [`Engine`](super::Engine) is built from: one options struct, the vocabulary of its
//! string choices, and the rules that turn "auto" into a decision. Every front end (Python,
//! the CLI, a server) passes these through; none re-states a default.

use std::path::PathBuf;

use crate::container::Container;
use crate::experts::{IoMode, PinPolicy, PrefetchMode, StoreOptions};
use crate::model::ModelOptions;
use crate::quant::kernels::{self, int8act, Arithmetic};
use crate::{Error, Result};

/// The accepted values of each string option, "auto" first where it exists. Front ends list
/// these in their help and validate against them (`_core.choices()` in Python).
pub const CHOICES: &[(&str, &[&str])] = &[
    ("io", &["auto", "mmap", "pread", "direct"]),
    ("prefetch", &["auto", "off", "hint", "real"]),
    ("pin", &["auto", "history", "off"]),
    ("draft", &["auto", "mtp", "ngram", "off"]),
    ("prefill", &["auto", "exact", "int8"]),
    ("decode", &["auto", "exact", "int8"]),
];

/// The choices of option `name` (empty for an unknown name).
pub fn choices(name: &str) -> &'static [&'static str] {
    CHOICES
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(&[], |(_, c)| c)
}

/// `value` if it is one of option `name`'s [`CHOICES`], else an error listing them.
pub fn check_choice(name: &str, value: &str) -> Result<()> {
    let allowed = choices(name);
    if allowed.contains(&value) {
        Ok(())
    } else {
        Err(Error::invalid(
            name,
            format!("'{value}'; expected one of {}", allowed.join(", ")),
        ))
    }
}

/// How the pinned hot set is chosen.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PinChoice {
    /// The store's default: the routing history's most-routed experts.
    #[default]
    Auto,
    /// The routing history's most-routed experts (what "auto" is today).
    History,
    /// No pins.
    Off,
}

/// Everything [`Engine::open`](super::Engine::open) takes besides the model path. `Default`
/// is what a user who sets nothing gets (`colibri.Model()`, `_core.Engine(path)`: the MTP
/// head loaded, the routing history kept); `None`/`Auto` fields are decided at open by the
/// rules documented on each field (and nowhere else).
#[derive(Debug, Clone)]
pub struct EngineOptions {
    /// Compute threads; 0 = one per core.
    pub threads: usize,
    /// How expert bytes are read; `None` = the store's default ([`IoMode::default`]).
    pub io: Option<IoMode>,
    /// RAM for the routed-expert cache in bytes; `None` = half of `MemAvailable` at open.
    pub ram_budget: Option<u64>,
    /// Router-lookahead prefetch; `None` = the store's default ([`PrefetchMode::default`]).
    pub prefetch: Option<PrefetchMode>,
    /// Experts the lookahead predicts per layer; `None` = 1.5 × the routed top-k in effect
    /// (`experts_per_token`; 0 with prefetch off).
    pub prefetch_top_k: Option<usize>,
    /// Routed experts per token (the speed dial): `None` = the model's own
    /// `num_experts_per_tok` (k); 1..=k routes each token, in the main and the MTP layers, to
    /// the best of the same choice with the weights normalised as the model's own. Fewer
    /// experts read fewer bytes per token and change the model's output (docs/expert-store.md,
    /// "Fewer experts per token"); a value outside 1..=k is refused at open.
    pub experts_per_token: Option<usize>,
    /// Load the MTP head when the checkpoint has one (`false` saves its memory).
    pub load_mtp: bool,
    /// Read and save the routing history that picks the pinned set.
    pub usage_file: bool,
    /// Where per-model state is kept; `None` = `usage::default_cache_dir()`.
    pub cache_dir: Option<PathBuf>,
    pub pin: PinChoice,
    /// Layers whose routed experts stay resident beyond the budget (e.g. the MTP layer).
    pub resident_layers: Vec<usize>,
    /// The arithmetic of prompt forwards; `None` = the decode arithmetic when `decode` is set
    /// (every row then computed from its own tokens alone: the same seed gives the same text
    /// whatever the caches hold), else [`EngineOptions::default_prefill`]. One that differs
    /// from the decode arithmetic applies to prompt forwards of at least
    /// [`int8act::PREFILL_MIN_ROWS`] rows.
    pub prefill: Option<Arithmetic>,
    /// The arithmetic of decode steps, verifies and drafts; `None` =
    /// [`EngineOptions::default_decode`].
    pub decode: Option<Arithmetic>,
    /// Longest context in tokens; `None` = [`context::default_max_context`](crate::model::context::default_max_context).
    pub max_context: Option<usize>,
    /// RAM that idle sessions' KV caches may hold together; beyond it the least recently
    /// used are written to disk and read back when next used. `None` = one full context
    /// (`max_context` × the KV bytes of a token).
    pub idle_session_bytes: Option<u64>,
    /// Where evicted sessions are written; `None` = `sessions/` in `cache_dir` (or the
    /// default cache directory; when there is none, a private directory made for the
    /// engine in the system temporary directory). It must be this user's and writable by
    /// no one else (`engine::spill`).
    pub spill_dir: Option<PathBuf>,
    /// Write every forward's routing to this file as a routing trace (JSON lines,
    /// docs/expert-store.md), which the replay reads (`tools/replay_routing.rs --trace`);
    /// `None` = off.
    pub trace_routing: Option<PathBuf>,
    /// Told the load's progress (bytes of resident weights read, bytes to read) after each
    /// tensor; the last call has both equal. The total before it is the container's
    /// resident bytes, an upper bound (the MTP layer's copies of the embedding and LM head
    /// are not read). Returning false stops the open with `Error::Cancelled`.
    pub load_progress: Option<LoadProgress>,
}

/// The callback of [`EngineOptions::load_progress`].
#[derive(Clone)]
pub struct LoadProgress(pub crate::container::LoadReport);

impl std::fmt::Debug for LoadProgress {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("LoadProgress(..)")
    }
}

impl Default for EngineOptions {
    fn default() -> Self {
        EngineOptions {
            threads: 0,
            io: None,
            ram_budget: None,
            prefetch: None,
            prefetch_top_k: None,
            experts_per_token: None,
            load_mtp: true,
            usage_file: true,
            cache_dir: None,
            pin: PinChoice::Auto,
            resident_layers: Vec::new(),
            prefill: None,
            decode: None,
            max_context: None,
            idle_session_bytes: None,
            spill_dir: None,
            trace_routing: None,
            load_progress: None,
        }
    }
}

impl EngineOptions {
    /// Parse the string form of `io` ("auto" → `None`).
    pub fn parse_io(value: &str) -> Result<Option<IoMode>> {
        check_choice("io", value)?;
        match value {
            "auto" => Ok(None),
            other => IoMode::parse(other).map(Some),
        }
    }

    /// Parse the string form of `prefetch` ("auto" → `None`).
    pub fn parse_prefetch(value: &str) -> Result<Option<PrefetchMode>> {
        check_choice("prefetch", value)?;
        match value {
            "auto" => Ok(None),
            other => PrefetchMode::parse(other).map(Some),
        }
    }

    /// Parse the string form of `prefill` ("auto" → `None`).
    pub fn parse_prefill(value: &str) -> Result<Option<Arithmetic>> {
        check_choice("prefill", value)?;
        Ok(match value {
            "exact" => Some(Arithmetic::Exact),
            "int8" => Some(Arithmetic::Int8),
            _ => None,
        })
    }

    /// Parse the string form of `decode` ("auto" → `None`).
    pub fn parse_decode(value: &str) -> Result<Option<Arithmetic>> {
        check_choice("decode", value)?;
        Ok(match value {
            "exact" => Some(Arithmetic::Exact),
            "int8" => Some(Arithmetic::Int8),
            _ => None,
        })
    }

    /// What "auto" means for `decode`: int8 activations where an int8 decode kernel runs
    /// (AVX-512 VNNI, or AVX2 with FMA), exact elsewhere (NEON, scalar). Measured end to end
    /// on the shipped models (hidden size 256), greedy, `draft="off"`, on an Intel Xeon with
    /// AMX (2026-12-07): on AVX-512 VNNI int8 1.07–1.13× exact on the GLM-like one and
    /// 1.14–1.20× on the tiny one at 2 threads, 1.35× and 1.39× at one; on the AVX2 kernels
    /// (`COLIBRI_KERNEL=avx2`, both arithmetics) int8 1.21–1.35× exact on the GLM-like one
    /// and 1.21–1.27× on the tiny one at 2 threads, 1.21–1.26× and 1.23× in CPU time at one
    /// (medians of alternating pairs in two runs; docs/benchmarks.md, "Int8 decode on the
    /// shipped models" and "Int8 decode on AVX2").
    pub fn default_decode() -> Arithmetic {
        #[cfg(target_arch = "x86_64")]
        if matches!(
            kernels::int8_kernel(),
            Ok(int8act::Int8Kernel::Vnni | int8act::Int8Kernel::Avx2)
        ) {
            return Arithmetic::Int8;
        }
        Arithmetic::Exact
    }

    /// What "auto" means for `prefill` when `decode` is "auto" too: int8 activations where the
    /// active kernel path runs a SIMD int8 kernel (AVX-512 VNNI: 1.5–2× the exact prefill;
    /// AVX2: about 3×; both in docs/benchmarks.md), exact elsewhere (the int8 arithmetic's
    /// scalar reference would be slower than the exact kernels). With `decode` set, "auto"
    /// follows it, so every row is computed the same way.
    pub fn default_prefill() -> Arithmetic {
        match kernels::int8_kernel() {
            Ok(int8act::Int8Kernel::Vnni | int8act::Int8Kernel::Avx2) => Arithmetic::Int8,
            _ => Arithmetic::Exact,
        }
    }

    /// Parse the string form of `pin`.
    pub fn parse_pin(value: &str) -> Result<PinChoice> {
        check_choice("pin", value)?;
        Ok(match value {
            "history" => PinChoice::History,
            "off" => PinChoice::Off,
            _ => PinChoice::Auto,
        })
    }

    /// The expert store's options these decide.
    pub fn store_options(&self) -> StoreOptions {
        let defaults = StoreOptions::default();
        StoreOptions {
            io: self.io.unwrap_or(defaults.io),
            ram_budget_bytes: self.ram_budget,
            prefetch: self.prefetch.unwrap_or(defaults.prefetch),
            usage_file: self.usage_file,
            cache_dir: self.cache_dir.clone(),
            pin: match self.pin {
                PinChoice::Off => PinPolicy::Off,
                PinChoice::Auto | PinChoice::History => defaults.pin.clone(),
            },
            resident_layers: self.resident_layers.clone(),
            ..defaults
        }
    }

    /// The decode arithmetic these options decide.
    pub fn decode_arithmetic(&self) -> Arithmetic {
        self.decode.unwrap_or_else(Self::default_decode)
    }

    /// The routed experts per token these choose for `container`'s model: `experts_per_token`
    /// when it is in 1..=k, k when it is `None`, else an error naming the allowed range.
    pub fn experts_per_token(&self, container: &Container) -> Result<usize> {
        crate::model::moe::experts_per_token(
            self.experts_per_token,
            container.config().num_experts_per_tok,
        )
    }

    /// The model's options these decide for `container`, given the store's prefetch mode.
    pub fn model_options(
        &self,
        container: &Container,
        prefetch: PrefetchMode,
    ) -> Result<ModelOptions> {
        let top_k = self.experts_per_token(container)?;
        let prefetch_top_k = match (prefetch, self.prefetch_top_k) {
            (PrefetchMode::Off, _) => 0,
            // Measured on the trained tiny model (docs/benchmarks.md): 1.5× the routed top-k
            // lifts the lookahead's recall from 0.72 to 0.81 while keeping its precision
            // above the store's prefetch gate. The top-k is the one in effect: with fewer
            // experts per token the lookahead predicts fewer.
            (_, None | Some(0)) => (top_k * 3).div_ceil(2),
            (_, Some(k)) => k,
        };
        Ok(ModelOptions {
            threads: self.threads,
            load_mtp: self.load_mtp,
            prefetch_top_k,
            decode_arithmetic: self.decode_arithmetic(),
            prefill_arithmetic: self.prefill.unwrap_or_else(|| match self.decode {
                Some(decode) => decode,
                None => Self::default_prefill(),
            }),
            experts_per_token: Some(top_k),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn choices_parse_and_reject_with_the_list() {
        assert_eq!(EngineOptions::parse_io("auto").unwrap(), None);
        assert_eq!(
            EngineOptions::parse_io("direct").unwrap(),
            Some(IoMode::Direct)
        );
        assert_eq!(EngineOptions::parse_pin("off").unwrap(), PinChoice::Off);
        let err = EngineOptions::parse_prefetch("sometimes").unwrap_err();
        let msg = err.to_string();
        assert!(
            msg.contains("'prefetch'") && msg.contains("auto, off, hint, real"),
            "{msg}"
        );
        assert!(choices("nope").is_empty());
    }

    #[test]
    fn the_lookahead_width_follows_the_experts_per_token_in_effect() {
        let dir =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("python/colibri/models/tiny");
        let c = Container::open(&dir).unwrap();
        assert_eq!(c.config().num_experts_per_tok, 2);
        let mut o = EngineOptions::default();
        let m = o.model_options(&c, PrefetchMode::Real).unwrap();
        assert_eq!((m.prefetch_top_k, m.experts_per_token), (3, Some(2)));
        o.experts_per_token = Some(1);
        let m = o.model_options(&c, PrefetchMode::Real).unwrap();
        assert_eq!((m.prefetch_top_k, m.experts_per_token), (2, Some(1)));
        assert_eq!(
            o.model_options(&c, PrefetchMode::Off)
                .unwrap()
                .prefetch_top_k,
            0
        );
        o.prefetch_top_k = Some(5);
        assert_eq!(
            o.model_options(&c, PrefetchMode::Real)
                .unwrap()
                .prefetch_top_k,
            5
        );
        o.experts_per_token = Some(3);
        let err = o.model_options(&c, PrefetchMode::Real).unwrap_err();
        assert!(err.to_string().contains("1..=2"), "{err}");
    }

    #[test]
    fn store_options_follow_the_choices() {
        let mut o = EngineOptions::default();
        assert_eq!(o.store_options(), StoreOptions::default());
        o.pin = PinChoice::Off;
        o.io = Some(IoMode::Direct);
        let s = o.store_options();
        assert_eq!((s.pin, s.io), (PinPolicy::Off, IoMode::Direct));
    }
}
