//! The engine: what composes container, expert store, model and decode loop into running
//! generations, for every front end (the Python bindings, the CLI, a server). It owns the
//! options and their "auto" rules ([`options`]), sessions with their KV caches and prefix
//! reuse ([`session`]), saved contexts ([`saved`]) and the stats a generation reports
//! ([`stats`]). docs/architecture.md, "The engine and sessions", describes the model.
//!
//! The model holds only weights (shared, `Arc<Model>`); each session owns its caches. Calls
//! are still serialised: one generation (or batch) runs at a time, because they share the
//! compute pool and the store's counters. Every method takes `&self`; an `Engine` is `Sync`.

pub mod batch;
pub mod options;
pub mod routing_trace;
pub mod saved;
pub mod session;
mod spill;
pub mod stats;
mod target;

#[cfg(test)]
mod tests;

use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

use crate::container::Container;
use crate::decode::{self, Emitted, FinishReason, GenerateOptions};
use crate::experts::{self, ExpertStore, PrefetchMode};
use crate::model::{context, KvCaches, Model, Sequence};
use crate::{Error, Result};
use routing_trace::RoutingTraceWriter;

pub use batch::{BatchIo, BatchRequest};
pub use options::{check_choice, choices, EngineOptions, LoadProgress, PinChoice, CHOICES};
pub use session::Session;
pub use stats::GenerationStats;

static NEXT_ENGINE_ID: AtomicU64 = AtomicU64::new(1);

/// Facts about the loaded model, fixed at open (reading them never waits for a generation).
#[derive(Debug, Clone)]
pub struct EngineInfo {
    pub has_mtp: bool,
    pub uses_dsa: bool,
    /// Longest context (prompt + generated tokens) a session may reach.
    pub max_context: usize,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub eos_token_ids: Vec<u32>,
    /// KV bytes one token of context adds (main layers and, when loaded, the MTP layer).
    pub kv_bytes_per_token: usize,
    /// RAM idle sessions' caches may hold together before the oldest go to disk.
    pub idle_session_bytes: u64,
    /// The model's fingerprint (config and shard sizes).
    pub fingerprint: String,
    /// The text of the model's `config.json`.
    pub config_json: String,
    /// The arithmetic of prompt forwards, decided at open ("exact" or "int8").
    pub prefill: &'static str,
    /// The arithmetic of decode steps, verifies and drafts, decided at open.
    pub decode: &'static str,
    /// Whether every forward computes each row from its own tokens alone (prefill and
    /// decode in one arithmetic): the same seed then gives the same text whatever the
    /// caches hold.
    pub row_invariant: bool,
    /// Whether decode runs the router lookahead (predicting the next layer's experts to
    /// prefetch them): off when `prefetch` is "off", or "auto" and every expert fits the
    /// budget or a streamed layer's LRU share holds fewer than 2·k experts.
    pub lookahead: bool,
    /// Routed experts per token in effect (the `experts_per_token` option, else the model's).
    pub experts_per_token: usize,
    /// The model's own routed experts per token (`num_experts_per_tok`).
    pub model_experts_per_token: usize,
}

/// What one [`Engine::generate`] produced.
#[derive(Debug, Clone)]
pub struct Completion {
    /// Generated tokens (a final stop token included).
    pub tokens: Vec<u32>,
    pub finish: FinishReason,
    pub stats: GenerationStats,
    /// One per token when the options asked for log-probabilities.
    pub logprobs: Vec<decode::TokenLogprob>,
}

/// A loaded model ready to generate: container, expert store (with its I/O and prefetch
/// threads), model, and the sessions made on it.
pub struct Engine {
    model: Arc<Model>,
    /// Held while a generation, a batch or a session operation that must not overlap one
    /// runs (a batch keeps its sessions' caches out of them while it decodes).
    generating: Mutex<()>,
    store: Arc<ExpertStore>,
    info: EngineInfo,
    id: u64,
    /// The engine's own conversation: what a generation without a session continues.
    own: Arc<Session>,
    /// Every live session (for the idle budget); dead ones are pruned as found.
    sessions: Mutex<Vec<Weak<Session>>>,
    next_session: AtomicU64,
    /// Ticks of use, for least-recently-used eviction.
    tick: AtomicU64,
    spill_dir: spill::SpillDir,
    /// Empty caches shaped for the model: a new session's.
    empty_caches: KvCaches,
}

/// The `trace_routing` writer of `model`: its MoE layers, routed experts, top-k and MTP layer.
fn routing_trace_writer(model: &Model, path: &Path) -> Result<RoutingTraceWriter> {
    let cfg = model.config();
    let layers = (0..cfg.num_hidden_layers)
        .filter(|&l| cfg.is_moe_layer(l))
        .collect();
    let mtp_layer = cfg.mtp_layer_index().filter(|_| model.has_mtp());
    let header = crate::routing::TraceHeader::new(
        layers,
        cfg.n_routed_experts,
        model.experts_per_token(),
        mtp_layer,
    );
    RoutingTraceWriter::create(path, &header)
}

impl Engine {
    /// Open the container at `path` with `opts`: the store, its threads and the model.
    pub fn open(path: &Path, opts: &EngineOptions) -> Result<Self> {
        // Checked first: an unsafe spill directory fails the open before the weights load.
        let spill_dir = spill::SpillDir::resolve(
            opts.spill_dir.as_deref(),
            opts.cache_dir
                .clone()
                .or_else(experts::usage::default_cache_dir),
        )?;
        let container = Arc::new(Container::open(path)?);
        // Checked before the store starts its threads.
        let routed_per_token = opts.experts_per_token(&container)?;
        let config_path = container.dir().join("config.json");
        let config_json =
            std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
        let store_opts = opts.store_options();
        let prefetch = store_opts.prefetch;
        let store = Arc::new(ExpertStore::open(container.clone(), store_opts)?);
        // "auto" drops the router lookahead when the budget holds every expert: once each is
        // resident a prediction can only repeat the next router's work and split the shared
        // experts from the routed batch (decode +2.5% on the side-by-side model,
        // docs/benchmarks.md, "The router lookahead when every expert fits"). It drops it
        // too when a streamed layer's LRU share holds fewer than 2·k experts: no room for a
        // prefetch beside the current token's experts (at 0 and 10% budgets on the disk
        // stand-ins the lookahead ran 0.91× plain; docs/benchmarks.md, disk-bound decode).
        let lookahead = match opts.prefetch {
            None if store.holds_every_expert() => PrefetchMode::Off,
            None if !store.has_room_to_prefetch(routed_per_token) => PrefetchMode::Off,
            _ => prefetch,
        };
        let model_opts = opts.model_options(&container, lookahead)?;
        // Read before the model's dense weights are mapped and touched.
        let available = experts::mem_available();
        container.report_loads(opts.load_progress.as_ref().map(|p| p.0.clone()));
        let model = Model::load_with_experts(container.clone(), &model_opts, store.clone());
        match &model {
            Ok(_) => container.finish_loads(),
            Err(_) => container.report_loads(None),
        }
        let model = model?;
        if let Some(path) = &opts.trace_routing {
            model.set_routing_sink(Some(Arc::new(routing_trace_writer(&model, path)?)));
        }
        let exact = model.max_exact_context();
        let max_context = match opts.max_context {
            Some(n) => context::check_max_context(n, exact, model.context_limit_reason())?,
            None => context::default_max_context(
                exact,
                model.kv_bytes_per_token(),
                available,
                container.resident_bytes(),
                store.budget_bytes(),
            ),
        };
        let kv_bytes_per_token = model.kv_bytes_per_token();
        let idle_session_bytes = opts
            .idle_session_bytes
            .unwrap_or((max_context as u64).saturating_mul(kv_bytes_per_token as u64));
        let info = EngineInfo {
            has_mtp: model.has_mtp(),
            uses_dsa: model.uses_dsa(),
            max_context,
            vocab_size: model.config().vocab_size,
            hidden_size: model.config().hidden_size,
            eos_token_ids: model.config().eos_token_ids.clone(),
            kv_bytes_per_token,
            idle_session_bytes,
            fingerprint: store.fingerprint().to_owned(),
            config_json,
            prefill: model.prefill_arithmetic().name(),
            decode: model.decode_arithmetic().name(),
            row_invariant: model.row_invariant(),
            lookahead: model_opts.prefetch_top_k > 0,
            experts_per_token: model.experts_per_token(),
            model_experts_per_token: model.config().num_experts_per_tok,
        };
        let id = NEXT_ENGINE_ID.fetch_add(1, Ordering::Relaxed);
        let own = Arc::new(Session::new(
            id,
            0,
            model.new_caches(),
            spill::spill_file(&spill_dir.path, id, 0),
        ));
        let empty_caches = model.new_caches();
        Ok(Engine {
            model: Arc::new(model),
            generating: Mutex::new(()),
            store,
            info,
            id,
            sessions: Mutex::new(vec![Arc::downgrade(&own)]),
            own,
            next_session: AtomicU64::new(1),
            tick: AtomicU64::new(0),
            spill_dir,
            empty_caches,
        })
    }

    pub fn info(&self) -> &EngineInfo {
        &self.info
    }

    /// Compute routed experts on `remote` where it holds them (`model::remote`); None: all
    /// from the store again.
    pub fn set_remote_experts(&self, remote: Option<Arc<dyn crate::model::remote::RemoteExperts>>) {
        self.model.set_remote_experts(remote);
    }

    pub fn store(&self) -> &Arc<ExpertStore> {
        &self.store
    }

    /// The options of a generation with this model's defaults: its EOS tokens as stop tokens
    /// and its context limit. Callers change what their user set.
    pub fn default_generate_options(&self) -> GenerateOptions {
        GenerateOptions {
            stop_tokens: self.info.eos_token_ids.clone(),
            max_context: Some(self.info.max_context),
            ..GenerateOptions::default()
        }
    }

    /// Refuse to run in a forked child: the rayon and I/O worker threads exist only in the
    /// parent, so work handed to them would wait forever (and a lock held by one of them at
    /// the fork stays held).
    pub fn check_process(&self) -> Result<()> {
        let (created_in, current) = (self.store.owner_pid(), std::process::id());
        if current == created_in {
            Ok(())
        } else {
            Err(Error::ForkedProcess {
                created_in,
                current,
            })
        }
    }

    /// Wait for the running generation, if any, and hold off the next.
    fn lock_generating(&self) -> Result<MutexGuard<'_, ()>> {
        self.check_process()?;
        self.generating
            .lock()
            .map_err(|_| Error::Internal("engine lock poisoned".into()))
    }

    /// The loaded model (weights only).
    pub fn model(&self) -> &Arc<Model> {
        &self.model
    }

    /// A new conversation with its own (empty) KV caches.
    pub fn new_session(&self) -> Result<Arc<Session>> {
        self.check_process()?;
        Ok(self.register(self.empty_caches.clone()))
    }

    fn register(&self, caches: KvCaches) -> Arc<Session> {
        let n = self.next_session.fetch_add(1, Ordering::Relaxed);
        let s = Arc::new(Session::new(
            self.id,
            n,
            caches,
            spill::spill_file(&self.spill_dir.path, self.id, n),
        ));
        if let Ok(mut all) = self.sessions.lock() {
            all.retain(|w| w.strong_count() > 0);
            all.push(Arc::downgrade(&s));
        }
        s
    }

    fn check_session(&self, session: &Session) -> Result<()> {
        if session.engine == self.id {
            Ok(())
        } else {
            Err(Error::invalid(
                "session",
                "belongs to another model; make it with this model's session()",
            ))
        }
    }

    fn context_checks(&self) -> saved::Expect<'_> {
        saved::Expect {
            fingerprint: &self.info.fingerprint,
            hidden_size: self.info.hidden_size,
            vocab_size: self.info.vocab_size,
            max_context: self.info.max_context,
            mtp_head: self.info.has_mtp,
            experts_per_token: (self.info.experts_per_token < self.info.model_experts_per_token)
                .then_some(self.info.experts_per_token),
        }
    }

    /// Generate after `prompt` on `session` (the engine's own conversation when `None`),
    /// reusing the longest prefix its caches hold. `on_tokens` gets every burst of emitted
    /// tokens (returning false stops with `FinishReason::Cancelled`); `cancel` is checked
    /// before every forward. `opts.max_context` is capped at the engine's.
    pub fn generate(
        &self,
        session: Option<&Session>,
        prompt: &[u32],
        opts: &GenerateOptions,
        on_tokens: &mut dyn FnMut(Emitted<'_>) -> bool,
        cancel: &AtomicBool,
    ) -> Result<Completion> {
        let session = session.unwrap_or(&self.own);
        self.check_session(session)?;
        let opts = self.capped(opts);
        let generating = self.lock_generating()?;
        let mut guard = session.lock()?;
        let st = &mut *guard;
        self.restore(session, st);
        if opts.sampling.prompt_logprobs.is_some() {
            // Every prompt row must be computed to be scored: no cached prefix.
            st.cache.clear();
        }
        self.store.reset_stats();
        let mut seq = Sequence::new(&self.model, &mut st.caches);
        let result =
            decode::generate_after(&mut seq, &mut st.cache, prompt, &opts, on_tokens, cancel)
                .map_err(|e| explain_non_finite(e, self.model.container()));
        st.last_used = self.tick.fetch_add(1, Ordering::Relaxed) + 1;
        drop(guard);
        // The routing history teaches the pinned set; failing to save it (read-only cache
        // directory) must not fail the generation, and the store already warns about it.
        let _ = self.store.save_usage();
        self.enforce_idle_budget(session);
        drop(generating);
        let generation = result?;
        Ok(Completion {
            stats: GenerationStats::new(&generation.stats, &self.store.stats()),
            tokens: generation.tokens,
            finish: generation.finish,
            logprobs: generation.logprobs,
        })
    }

    /// `opts` with `max_context` capped at the engine's.
    fn capped(&self, opts: &GenerateOptions) -> GenerateOptions {
        let mut opts = opts.clone();
        opts.max_context = Some(
            opts.max_context
                .map_or(self.info.max_context, |m| m.min(self.info.max_context)),
        );
        opts
    }

    /// Logits of one forward over `ids` as a fresh sequence: [len(ids), vocab], row-major.
    /// Sessions are untouched (the forward runs on caches of its own).
    pub fn logits(&self, ids: &[u32]) -> Result<Vec<f32>> {
        let _generating = self.lock_generating()?;
        let mut caches = self.model.new_caches();
        Sequence::new(&self.model, &mut caches)
            .step(ids, 0, true)
            .map(|f| f.logits)
            .map_err(|e| explain_non_finite(e, self.model.container()))
    }

    /// Write `session`'s context (the engine's own when `None`) to `path` atomically; returns
    /// the bytes written. Load it with [`load_session`](Self::load_session), here or in
    /// another process with the same model.
    pub fn save_session(&self, session: Option<&Session>, path: &Path) -> Result<u64> {
        let session = session.unwrap_or(&self.own);
        self.check_session(session)?;
        // Held so that no generation runs meanwhile: a batch keeps its sessions' caches
        // out of them while it decodes.
        let _generating = self.lock_generating()?;
        let mut st = session.lock()?;
        self.restore(session, &mut st);
        saved::save(path, &self.context_checks(), &st.caches, &st.cache)
    }

    /// A new session holding the context saved at `path` by [`save_session`](Self::save_session).
    pub fn load_session(&self, path: &Path) -> Result<Arc<Session>> {
        self.check_process()?;
        let mut caches = self.empty_caches.clone();
        let cache = saved::load(path, &self.context_checks(), &mut caches)?;
        let session = self.register(caches);
        {
            let mut st = session.lock()?;
            st.cache = cache;
            st.last_used = self.tick.fetch_add(1, Ordering::Relaxed) + 1;
        }
        let _generating = self.lock_generating()?;
        self.enforce_idle_budget(&session);
        Ok(session)
    }

    /// Bring an evicted session's caches back into RAM. A spill file that cannot be read
    /// (removed behind our back, disk error) costs only the reuse: the session then starts
    /// from scratch, which gives the same output.
    fn restore(&self, session: &Session, st: &mut session::SessionState) {
        if !st.evicted {
            return;
        }
        st.evicted = false;
        let mut caches = self.empty_caches.clone();
        match saved::load(&session.spill_path, &self.context_checks(), &mut caches) {
            Ok(cache) => {
                st.caches = caches;
                st.cache = cache;
            }
            Err(e) => {
                crate::diagnostics::warn_once(
                    "session-restore",
                    &format!("an evicted session could not be read back ({e}); it prefills again"),
                );
                st.caches = caches;
                st.cache.clear();
            }
        }
        let _ = std::fs::remove_file(&session.spill_path);
    }

    /// Keep the idle sessions' caches (every session but `active`) within the budget by
    /// writing the least recently used to disk. Called with the generation lock held, so no
    /// generation is running; a session another thread is reading is skipped.
    fn enforce_idle_budget(&self, active: &Session) {
        let live: Vec<Arc<Session>> = match self.sessions.lock() {
            Ok(mut all) => {
                all.retain(|w| w.strong_count() > 0);
                all.iter().filter_map(Weak::upgrade).collect()
            }
            Err(_) => return,
        };
        let mut idle: Vec<(u64, usize, &Arc<Session>)> = live
            .iter()
            .filter(|s| s.id != active.id)
            .filter_map(|s| {
                let st = s.state.try_lock().ok()?;
                (!st.evicted && st.caches.bytes() > 0).then(|| (st.last_used, st.caches.bytes(), s))
            })
            .collect();
        let mut total: u64 = idle.iter().map(|(_, b, _)| *b as u64).sum();
        if total <= self.info.idle_session_bytes {
            return;
        }
        idle.sort_by_key(|(used, _, _)| *used);
        for (_, bytes, s) in idle {
            if total <= self.info.idle_session_bytes {
                break;
            }
            let Ok(mut st) = s.state.try_lock() else {
                continue;
            };
            match self.evict(s, &mut st) {
                Ok(()) => total -= bytes as u64,
                Err(e) => crate::diagnostics::warn_once(
                    "session-evict",
                    &format!(
                        "idle sessions hold more than their RAM budget and one could not be \
                         written to disk ({e}); it stays in RAM"
                    ),
                ),
            }
        }
    }

    fn evict(&self, s: &Session, st: &mut session::SessionState) -> Result<()> {
        self.spill_dir.ensure()?;
        saved::save(&s.spill_path, &self.context_checks(), &st.caches, &st.cache)?;
        st.caches.release();
        st.cache = decode::CacheState::from_parts(
            std::mem::take(&mut st.cache.tokens),
            Default::default(),
        );
        st.evicted = true;
        Ok(())
    }
}

/// Bytes of float tensors a non-finite output's diagnosis reads at most (the resident
/// weights of a small model, the norms and scales of a large one), so the error comes quickly.
const NON_FINITE_SCAN_BYTES: u64 = 4 << 30;

/// A NaN/Inf logit is not a colibri bug but the weights': name the tensor that holds it when
/// a bounded scan of the float tensors finds one, and say what to do either way.
fn explain_non_finite(err: Error, container: &Container) -> Error {
    let Error::NonFiniteOutput(what) = err else {
        return err;
    };
    let (found, complete) = container.find_non_finite(NON_FINITE_SCAN_BYTES);
    Error::NonFiniteOutput(match found {
        Some(t) => format!(
            "{what}: tensor '{}' in {} contains {} at flat index {}; the checkpoint is \
             damaged or was saved with non-finite values: download or export it again",
            t.tensor,
            t.file.display(),
            t.what,
            t.index
        ),
        None if complete => format!(
            "{what}: no float tensor holds NaN/Inf, so the computation overflows float32 \
             (weights far outside their trained range?); check the checkpoint against its \
             source (`colibri convert` refuses non-finite source weights, naming the tensor)"
        ),
        None => format!(
            "{what}: the weights contain NaN/Inf or produce it (the first {} GiB of float \
             tensors are finite); `colibri convert` checks every source tensor and names the \
             first non-finite one",
            NON_FINITE_SCAN_BYTES >> 30
        ),
    })
}
