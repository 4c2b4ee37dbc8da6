//! `colibri._core.Engine`: a loaded model plus the decode loop, driven from Python.
//!
//! One Engine serialises its callers with a mutex (the KV cache is per sequence); compute runs
//! with the GIL released. The `on_tokens` callback is called with the GIL held after every
//! forward that emitted tokens; it also checks for Ctrl-C, so KeyboardInterrupt stops
//! generation within one forward and leaves the engine usable.

use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, MutexGuard};

use numpy::{PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::container::Container;
use crate::decode::{self, CacheState, DraftDepth, DraftSource, GenerateOptions, SamplingParams};
use crate::error::Error;
use crate::experts::{ExpertStore, IoMode, PinPolicy, PrefetchMode, StoreOptions};
use crate::model::{context, KvCaches, Model, ModelOptions};
use crate::python::{run, to_py_err};

static NEXT_ENGINE_ID: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);

/// One conversation's KV caches and what they hold, kept apart from the engine's own; an
/// engine's `generate(..., session=s)` swaps them in for the call.
#[pyclass(name = "Session", module = "colibri._core", frozen)]
pub struct PySession {
    engine: u64,
    state: Mutex<(KvCaches, CacheState)>,
}

#[pymethods]
impl PySession {
    /// Bytes its KV caches hold (waits for a generation running on it).
    #[getter]
    fn kv_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.0.bytes())
    }

    /// Tokens its KV caches hold (waits for a generation running on it).
    #[getter]
    fn kv_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.lock(py)?.0.len())
    }

    /// Forget the conversation: the next call prefills from scratch.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        let mut st = self.lock(py)?;
        st.0.clear();
        st.1.clear();
        Ok(())
    }
}

impl PySession {
    fn lock(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, (KvCaches, CacheState)>> {
        lock_detached(py, &self.state, "session")
    }
}

#[pyclass(name = "Engine", module = "colibri._core", frozen)]
pub struct PyEngine {
    model: Mutex<Model>,
    /// What the model's caches hold (the last generation's tokens, the MTP layer's pending
    /// hidden states), so the next generation prefills only past the common prefix. Locked
    /// only while `model` is, after it.
    cache: Mutex<CacheState>,
    /// Tells this engine's sessions from another's (their caches are shaped for one model).
    id: u64,
    store: Arc<ExpertStore>,
    config_json: String,
    // Fixed at load, so reading them never waits for a running generation.
    has_mtp: bool,
    max_context: usize,
    vocab_size: usize,
    eos_token_ids: Vec<u32>,
}

impl PyEngine {
    fn cache_lock(&self) -> PyResult<MutexGuard<'_, CacheState>> {
        self.cache
            .lock()
            .map_err(|_| to_py_err(Error::Internal("engine cache lock poisoned".into())))
    }

    /// Refuse to run in a forked child: the rayon and I/O worker threads exist only in the
    /// parent, so work handed to them would wait forever (and a lock held by one of them at
    /// the fork stays held).
    fn same_process(&self) -> PyResult<()> {
        let (created_in, current) = (self.store.owner_pid(), std::process::id());
        if current == created_in {
            Ok(())
        } else {
            Err(to_py_err(Error::ForkedProcess {
                created_in,
                current,
            }))
        }
    }

    /// Take the model lock without holding the GIL while waiting (see [`lock_detached`]).
    fn lock(&self, py: Python<'_>) -> PyResult<MutexGuard<'_, Model>> {
        self.same_process()?;
        lock_detached(py, &self.model, "engine")
    }
}

/// Take `mutex` without holding the GIL while waiting: a running generation holds its locks
/// with the GIL released and its callback needs the GIL, so blocking on the mutex with the
/// GIL held would deadlock.
fn lock_detached<'a, T>(
    py: Python<'_>,
    mutex: &'a Mutex<T>,
    what: &str,
) -> PyResult<MutexGuard<'a, T>> {
    loop {
        match mutex.try_lock() {
            Ok(guard) => return Ok(guard),
            Err(std::sync::TryLockError::WouldBlock) => {
                py.detach(|| std::thread::sleep(std::time::Duration::from_micros(200)));
                py.check_signals()?;
            }
            Err(std::sync::TryLockError::Poisoned(_)) => {
                return Err(to_py_err(Error::Internal(format!("{what} lock poisoned"))))
            }
        }
    }
}

fn parse_choice(param: &str, value: &str, choices: &[&str]) -> crate::Result<()> {
    if choices.contains(&value) {
        Ok(())
    } else {
        Err(Error::invalid(
            param,
            format!("'{value}'; expected one of {}", choices.join(", ")),
        ))
    }
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (path, *, threads=0, io="auto", ram_budget=None, prefetch="auto", prefetch_top_k=0, mtp=true, usage_file=true, cache_dir=None, pin="auto", resident_layers=None, max_context=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: String,
        threads: usize,
        io: &str,
        ram_budget: Option<u64>,
        prefetch: &str,
        prefetch_top_k: usize,
        mtp: bool,
        usage_file: bool,
        cache_dir: Option<std::path::PathBuf>,
        pin: &str,
        resident_layers: Option<Vec<usize>>,
        max_context: Option<usize>,
    ) -> PyResult<Self> {
        let (io, prefetch, pin) = (io.to_owned(), prefetch.to_owned(), pin.to_owned());
        run(py, move || {
            parse_choice("io", &io, &["auto", "mmap", "pread", "direct"])?;
            parse_choice("prefetch", &prefetch, &["auto", "off", "hint", "real"])?;
            parse_choice("pin", &pin, &["auto", "history", "off"])?;
            let container = Arc::new(Container::open(std::path::Path::new(&path))?);
            let config_json = std::fs::read_to_string(container.dir().join("config.json"))
                .map_err(|e| Error::io(container.dir().join("config.json"), e))?;
            let defaults = StoreOptions::default();
            let prefetch_mode = match prefetch.as_str() {
                "auto" => defaults.prefetch,
                other => PrefetchMode::parse(other)?,
            };
            let store_opts = StoreOptions {
                io: match io.as_str() {
                    "auto" => defaults.io,
                    other => IoMode::parse(other)?,
                },
                ram_budget_bytes: ram_budget,
                prefetch: prefetch_mode,
                usage_file,
                cache_dir,
                pin: match pin.as_str() {
                    "off" => PinPolicy::Off,
                    _ => defaults.pin.clone(),
                },
                resident_layers: resident_layers.unwrap_or_default(),
                ..defaults
            };
            let store = Arc::new(ExpertStore::open(container.clone(), store_opts)?);
            let top_k = match (prefetch_mode, prefetch_top_k) {
                (PrefetchMode::Off, _) => 0,
                // Measured on the trained tiny model (docs/benchmarks.md): 1.5× the routed
                // top-k lifts the lookahead's recall from 0.72 to 0.81 while keeping its
                // precision above the store's prefetch gate.
                (_, 0) => (container.config().num_experts_per_tok * 3).div_ceil(2),
                (_, k) => k,
            };
            let opts = ModelOptions {
                threads,
                load_mtp: mtp,
                prefetch_top_k: top_k,
            };
            let available = crate::experts::mem_available();
            let model = Model::load_with_experts(container.clone(), &opts, store.clone())?;
            let exact = model.max_exact_context();
            let max_context = match max_context {
                Some(n) => context::check_max_context(n, exact, model.context_limit_reason())?,
                None => context::default_max_context(
                    exact,
                    model.kv_bytes_per_token(),
                    available,
                    container.resident_bytes(),
                    store.budget_bytes(),
                ),
            };
            Ok(PyEngine {
                has_mtp: model.has_mtp(),
                max_context,
                vocab_size: model.config().vocab_size,
                eos_token_ids: model.config().eos_token_ids.clone(),
                model: Mutex::new(model),
                cache: Mutex::new(CacheState::default()),
                id: NEXT_ENGINE_ID.fetch_add(1, std::sync::atomic::Ordering::Relaxed),
                store,
                config_json,
            })
        })
    }

    /// Where the routing history is saved (the cache directory's file for this model), or
    /// None when it is not saved.
    #[getter]
    fn usage_path(&self) -> Option<std::path::PathBuf> {
        self.store.usage_path().map(std::path::Path::to_path_buf)
    }

    /// The model's `config.json` text.
    fn config_json(&self) -> String {
        self.config_json.clone()
    }

    #[getter]
    fn has_mtp(&self) -> bool {
        self.has_mtp
    }

    #[getter]
    fn max_context(&self) -> usize {
        self.max_context
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    #[getter]
    fn eos_token_ids(&self) -> Vec<u32> {
        self.eos_token_ids.clone()
    }

    /// A new conversation with its own KV caches (empty; they grow as it is used).
    fn new_session(&self, py: Python<'_>) -> PyResult<PySession> {
        let model = self.lock(py)?;
        Ok(PySession {
            engine: self.id,
            state: Mutex::new((model.new_caches(), CacheState::default())),
        })
    }

    /// Logits of one forward over `ids` as a fresh sequence: float32 [len(ids), vocab].
    fn logits<'py>(&self, py: Python<'py>, ids: Vec<u32>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let mut model = self.lock(py)?;
        self.cache_lock()?.clear();
        let vocab = model.config().vocab_size;
        let m: &mut Model = &mut model;
        let logits = run(py, || {
            m.reset();
            let f = m.step(&ids, 0, true);
            m.reset();
            Ok(f?.logits)
        })?;
        let rows = logits.len() / vocab.max(1);
        numpy::PyArray1::from_vec(py, logits)
            .reshape([rows, vocab])
            .map_err(|e| to_py_err(Error::Internal(e.to_string())))
    }

    /// Generate after `ids`; returns {"tokens", "finish_reason", "stats"}.
    #[pyo3(signature = (ids, *, max_new_tokens, temperature=0.0, top_k=0, top_p=1.0, seed=0, draft="auto", draft_depth=0, stop_ids=None, on_tokens=None, session=None))]
    #[allow(clippy::too_many_arguments)]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        max_new_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        seed: u64,
        draft: &str,
        draft_depth: usize,
        stop_ids: Option<Vec<u32>>,
        on_tokens: Option<Py<PyAny>>,
        session: Option<PyRef<'py, PySession>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let draft = DraftSource::parse(draft).map_err(to_py_err)?;
        let depth = if draft_depth == 0 {
            DraftDepth::Auto
        } else {
            DraftDepth::Fixed(draft_depth)
        };
        let mut model = self.lock(py)?;
        let opts = GenerateOptions {
            max_new_tokens,
            sampling: SamplingParams {
                temperature,
                top_k,
                top_p,
                seed: Some(seed),
            },
            stop_tokens: stop_ids.unwrap_or_else(|| model.config().eos_token_ids.clone()),
            draft,
            depth,
            max_context: Some(self.max_context),
            ..GenerateOptions::default()
        };
        if let Some(sess) = &session {
            if sess.engine != self.id {
                return Err(to_py_err(Error::invalid(
                    "session",
                    "belongs to another model; make it with this model's session()",
                )));
            }
        }
        let mut cache = self.cache_lock()?;
        let mut session_state = match &session {
            Some(sess) => Some(sess.lock(py)?),
            None => None,
        };
        // A session's caches are swapped in for the call and back out after it, whatever
        // the outcome; the engine's own stay aside meanwhile.
        if let Some(st) = session_state.as_mut() {
            model.swap_caches(&mut st.0);
        }
        let state: &mut CacheState = match session_state.as_mut() {
            Some(st) => &mut st.1,
            None => &mut cache,
        };
        let m: &mut Model = &mut model;
        self.store.reset_stats();
        let cancel = AtomicBool::new(false);
        let mut pending: Option<PyErr> = None;
        let generation = run(py, || {
            let mut on = |toks: &[u32]| -> bool {
                Python::attach(|py| {
                    if let Err(e) = py.check_signals() {
                        pending = Some(e);
                        return false;
                    }
                    let Some(cb) = &on_tokens else { return true };
                    match cb.call1(py, (toks.to_vec(),)) {
                        Ok(v) => v.extract::<bool>(py).unwrap_or(true),
                        Err(e) => {
                            pending = Some(e);
                            false
                        }
                    }
                })
            };
            decode::generate_after(m, state, &ids, &opts, &mut on, &cancel)
                .map_err(|e| explain_non_finite(e, m.container()))
        });
        if let Some(st) = session_state.as_mut() {
            model.swap_caches(&mut st.0);
        }
        drop(session_state);
        drop(cache);
        let generation = generation?;
        // The routing history teaches the pinned set; failing to save it (read-only cache
        // directory) must not fail the generation, and the store already warns about it.
        let _ = self.store.save_usage();
        if let Some(e) = pending {
            return Err(e);
        }
        let d = PyDict::new(py);
        d.set_item("tokens", generation.tokens)?;
        d.set_item("finish_reason", generation.finish.as_str())?;
        let stats = stats_dict(py, &generation.stats)?;
        add_store_stats(&stats, &self.store)?;
        d.set_item("stats", stats)?;
        Ok(d)
    }

    /// Evict the model's expert bytes from the OS page cache (cold-start benchmarks).
    fn drop_page_cache(&self, py: Python<'_>) -> PyResult<()> {
        self.same_process()?;
        let store = &self.store;
        py.detach(|| store.drop_page_cache());
        Ok(())
    }

    /// Expert-store counters since the last generation started: totals and per layer.
    fn expert_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.same_process()?;
        let st = self.store.stats();
        let d = PyDict::new(py);
        d.set_item("io_mode", st.io_mode.name())?;
        d.set_item("budget_bytes", st.budget_bytes)?;
        d.set_item("pinned_bytes", st.pinned_bytes)?;
        d.set_item("lru_bytes", st.lru_bytes)?;
        d.set_item("pin_set_len", st.pin_set_len)?;
        d.set_item("peak_owned_bytes", st.peak_owned_bytes)?;
        d.set_item("io_busy_seconds", st.io_busy_ns as f64 / 1e9)?;
        let total = PyDict::new(py);
        for (k, v) in st.total.fields() {
            total.set_item(k, v)?;
        }
        d.set_item("total", total)?;
        let layers = PyDict::new(py);
        for (l, ls) in &st.layers {
            let ld = PyDict::new(py);
            for (k, v) in ls.fields() {
                ld.set_item(k, v)?;
            }
            ld.set_item("recall_router", ls.recall_router())?;
            ld.set_item("recall_previous", ls.recall_previous())?;
            layers.set_item(l, ld)?;
        }
        d.set_item("layers", layers)?;
        Ok(d)
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

fn add_store_stats(d: &Bound<'_, PyDict>, store: &ExpertStore) -> PyResult<()> {
    let st = store.stats();
    d.set_item("expert_hits", st.total.hits())?;
    d.set_item("expert_misses", st.total.misses)?;
    d.set_item("expert_bytes_read", st.total.bytes_read)?;
    d.set_item("expert_wait_seconds", st.total.wait_s())?;
    let recall = st.total.recall_router();
    d.set_item(
        "prefetch_recall",
        if recall.is_nan() { None } else { Some(recall) },
    )?;
    d.set_item("prefetch_useful", st.total.prefetch_useful)?;
    d.set_item("prefetch_wasted", st.total.prefetch_wasted)?;
    d.set_item("io_mode", st.io_mode.name())?;
    Ok(())
}

fn stats_dict<'py>(py: Python<'py>, s: &decode::DecodeStats) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    let decode_tokens = s.generated_tokens.saturating_sub(1);
    let decode_secs = (s.total_secs - s.prefill_secs).max(0.0);
    d.set_item("prompt_tokens", s.prompt_tokens)?;
    d.set_item("prompt_cached_tokens", s.prompt_cached_tokens)?;
    d.set_item("generated_tokens", s.generated_tokens)?;
    d.set_item("forwards", s.forwards)?;
    d.set_item("decode_forwards", s.decode_forwards)?;
    d.set_item("mtp_forwards", s.mtp_forwards)?;
    d.set_item("tokens_per_forward", s.tokens_per_forward)?;
    d.set_item(
        "tokens_per_second",
        if decode_secs > 0.0 {
            decode_tokens as f64 / decode_secs
        } else {
            0.0
        },
    )?;
    d.set_item("prefill_seconds", s.prefill_secs)?;
    d.set_item("decode_seconds", decode_secs)?;
    d.set_item("drafts_proposed", s.proposed_per_depth.clone())?;
    d.set_item("drafts_accepted", s.accepted_per_depth.clone())?;
    d.set_item("acceptance_rate", s.acceptance_rate)?;
    d.set_item("draft_seconds", s.draft_secs)?;
    d.set_item("verify_seconds", s.verify_secs)?;
    d.set_item("guard_pauses", s.guard_pauses)?;
    d.set_item("depth_histogram", s.depth_histogram.clone())?;
    Ok(d)
}
