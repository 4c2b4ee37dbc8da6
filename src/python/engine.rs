//! `colibri._core.Engine` and `Session`: the Rust [`Engine`](crate::engine::Engine) driven
//! from Python. This layer only converts types; what options mean, defaults and stats live
//! in `crate::engine`.
//!
//! Engine calls run with the GIL released (they may wait for another thread's generation).
//! The `on_tokens` callback is called with the GIL held after every forward that emitted
//! tokens; it also checks for Ctrl-C, so KeyboardInterrupt stops generation within one
//! forward and leaves the engine usable.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use numpy::{PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::decode::{Grammar, GrammarSpec, PrefillProgress, Vocabulary};
use crate::engine::{BatchIo, BatchRequest, Engine, EngineOptions, LoadProgress, Session};
use crate::error::Error;
use crate::python::{request, run, to_py_err};

/// One conversation's KV caches and the tokens they hold; an engine's
/// `generate(..., session=s)` continues it.
#[pyclass(name = "Session", module = "colibri._core", frozen)]
pub struct PySession {
    inner: Arc<Session>,
}

#[pymethods]
impl PySession {
    /// Bytes its KV caches hold in RAM (0 while evicted to disk).
    #[getter]
    fn kv_bytes(&self, py: Python<'_>) -> PyResult<usize> {
        let s = &self.inner;
        run(py, || s.kv_bytes())
    }

    /// Tokens of context it holds.
    #[getter]
    fn kv_tokens(&self, py: Python<'_>) -> PyResult<usize> {
        let s = &self.inner;
        run(py, || s.kv_tokens())
    }

    /// The tokens of context it holds.
    fn tokens(&self, py: Python<'_>) -> PyResult<Vec<u32>> {
        let s = &self.inner;
        run(py, || s.tokens())
    }

    /// Whether its caches were written to disk under the idle-session budget.
    #[getter]
    fn evicted(&self, py: Python<'_>) -> PyResult<bool> {
        let s = &self.inner;
        run(py, || s.is_evicted())
    }

    /// Forget the conversation: the next call prefills from scratch.
    fn reset(&self, py: Python<'_>) -> PyResult<()> {
        let s = &self.inner;
        run(py, || s.reset())
    }
}

#[pyclass(name = "Engine", module = "colibri._core", frozen)]
pub struct PyEngine {
    engine: Engine,
    /// The vocabulary structured output compiles grammars against, once it was given
    /// (`load_vocabulary`).
    vocabulary: std::sync::OnceLock<Vocabulary>,
}

/// A Rust value as the Python object of its JSON form (the stats struct's fields).
fn to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(a) => {
            let items = a
                .iter()
                .map(|x| to_py(py, x))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

fn json_to_py<'py, T: serde::Serialize>(py: Python<'py>, v: &T) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(v).map_err(|e| to_py_err(Error::Internal(e.to_string())))?;
    to_py(py, &value)
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (path, *, threads=0, io="auto", ram_budget=None, prefetch="auto", prefetch_top_k=0, mtp=true, usage_file=true, cache_dir=None, pin="auto", resident_layers=None, max_context=None, idle_session_bytes=None, spill_dir=None, prefill="auto", load_progress=None, trace_routing=None))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        threads: usize,
        io: &str,
        ram_budget: Option<u64>,
        prefetch: &str,
        prefetch_top_k: usize,
        mtp: bool,
        usage_file: bool,
        cache_dir: Option<PathBuf>,
        pin: &str,
        resident_layers: Option<Vec<usize>>,
        max_context: Option<usize>,
        idle_session_bytes: Option<u64>,
        spill_dir: Option<PathBuf>,
        prefill: &str,
        load_progress: Option<Py<PyAny>>,
        trace_routing: Option<PathBuf>,
    ) -> PyResult<Self> {
        // Told after each resident tensor: checks for Ctrl-C (a long load stops within a
        // tensor) and calls the caller's callback; an error of either stops the open.
        let raised: Arc<Mutex<Option<PyErr>>> = Arc::default();
        let report = {
            let raised = raised.clone();
            LoadProgress(Arc::new(move |done: u64, total: u64| {
                Python::attach(|py| {
                    let outcome = py.check_signals().and_then(|()| match &load_progress {
                        Some(cb) => cb.call1(py, (done, total)).map(|_| ()),
                        None => Ok(()),
                    });
                    match outcome {
                        Ok(()) => true,
                        Err(e) => {
                            if let Ok(mut slot) = raised.lock() {
                                slot.get_or_insert(e);
                            }
                            false
                        }
                    }
                })
            }))
        };
        let mut opts = engine_options(&EngineArgs {
            threads,
            io,
            ram_budget,
            prefetch,
            prefetch_top_k,
            mtp,
            usage_file,
            cache_dir,
            pin,
            resident_layers,
            max_context,
            idle_session_bytes,
            spill_dir,
            prefill,
            trace_routing,
        })
        .map_err(to_py_err)?;
        opts.load_progress = Some(report);
        let engine = run(py, move || Engine::open(&path, &opts));
        if let Some(err) = raised.lock().ok().and_then(|mut e| e.take()) {
            return Err(err);
        }
        let engine = engine?;
        Ok(PyEngine {
            engine,
            vocabulary: std::sync::OnceLock::new(),
        })
    }

    /// Give the model's vocabulary, as the text of its `tokenizer.json`, to structured
    /// output (the `grammar` keyword of `generate`). Built once: later calls do nothing.
    fn load_vocabulary(&self, py: Python<'_>, tokenizer_json: &str) -> PyResult<()> {
        if self.vocabulary.get().is_some() {
            return Ok(());
        }
        let vocab = self.engine.info().vocab_size;
        let built = run(py, || {
            Vocabulary::from_tokenizer_json(tokenizer_json, vocab)
        })?;
        let _ = self.vocabulary.set(built);
        Ok(())
    }

    /// Compile a structured-output constraint, `(kind, text)` as `generate`'s `grammar`, and
    /// drop it: a stream checks its constraint when it is created, not at its first chunk.
    fn check_grammar(&self, py: Python<'_>, kind: &str, text: &str) -> PyResult<()> {
        run(py, || self.compile_grammar(kind, text).map(drop))
    }

    /// Whether `load_vocabulary` was done.
    #[getter]
    fn has_vocabulary(&self) -> bool {
        self.vocabulary.get().is_some()
    }

    /// Where the routing history is saved (the cache directory's file for this model), or
    /// None when it is not saved.
    #[getter]
    fn usage_path(&self) -> Option<PathBuf> {
        self.engine
            .store()
            .usage_path()
            .map(std::path::Path::to_path_buf)
    }

    /// The model's `config.json` text.
    fn config_json(&self) -> String {
        self.engine.info().config_json.clone()
    }

    /// Facts fixed at load: has_mtp, uses_dsa, max_context, vocab_size, hidden_size,
    /// eos_token_ids, kv_bytes_per_token, idle_session_bytes, fingerprint, prefill, lookahead.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let i = self.engine.info();
        let d = PyDict::new(py);
        d.set_item("has_mtp", i.has_mtp)?;
        d.set_item("uses_dsa", i.uses_dsa)?;
        d.set_item("max_context", i.max_context)?;
        d.set_item("vocab_size", i.vocab_size)?;
        d.set_item("hidden_size", i.hidden_size)?;
        d.set_item("eos_token_ids", i.eos_token_ids.clone())?;
        d.set_item("kv_bytes_per_token", i.kv_bytes_per_token)?;
        d.set_item("idle_session_bytes", i.idle_session_bytes)?;
        d.set_item("fingerprint", i.fingerprint.clone())?;
        d.set_item("prefill", i.prefill)?;
        d.set_item("lookahead", i.lookahead)?;
        Ok(d)
    }

    /// A new conversation with its own KV caches (empty; they grow as it is used).
    fn new_session(&self, py: Python<'_>) -> PyResult<PySession> {
        let e = &self.engine;
        let inner = run(py, || e.new_session())?;
        Ok(PySession { inner })
    }

    /// Write a session's context (the engine's own conversation when None) to `path`
    /// atomically; returns the bytes written.
    #[pyo3(signature = (path, session=None))]
    fn save_session(
        &self,
        py: Python<'_>,
        path: PathBuf,
        session: Option<PyRef<'_, PySession>>,
    ) -> PyResult<u64> {
        let (e, s) = (&self.engine, session.as_ref().map(|s| s.inner.clone()));
        run(py, move || e.save_session(s.as_deref(), &path))
    }

    /// A new session holding the context saved at `path`.
    fn load_session(&self, py: Python<'_>, path: PathBuf) -> PyResult<PySession> {
        let e = &self.engine;
        let inner = run(py, move || e.load_session(&path))?;
        Ok(PySession { inner })
    }

    /// Logits of one forward over `ids` as a fresh sequence: float32 [len(ids), vocab].
    fn logits<'py>(&self, py: Python<'py>, ids: Vec<u32>) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let e = &self.engine;
        let vocab = e.info().vocab_size;
        let logits = run(py, || e.logits(&ids))?;
        let rows = logits.len() / vocab.max(1);
        numpy::PyArray1::from_vec(py, logits)
            .reshape([rows, vocab])
            .map_err(|e| to_py_err(Error::Internal(e.to_string())))
    }

    /// Generate after `ids` with `request` (a dict of `GenerateRequest`'s fields, or the
    /// same as keywords; those left out keep their defaults); returns {"tokens",
    /// "finish_reason", "stats"}.
    #[pyo3(signature = (ids, request=None, *, on_tokens=None, session=None, prefill_progress=None, **fields))]
    #[allow(clippy::too_many_arguments)]
    fn generate<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        request: Option<Bound<'py, PyDict>>,
        on_tokens: Option<Py<PyAny>>,
        session: Option<PyRef<'py, PySession>>,
        prefill_progress: Option<Py<PyAny>>,
        fields: Option<Bound<'py, PyDict>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let e = &self.engine;
        let request = request::from_parts(py, request.as_ref(), fields.as_ref())?;
        let mut opts = self.options(&request)?;
        let session = session.as_ref().map(|s| s.inner.clone());
        let cancel = Arc::new(AtomicBool::new(false));
        // Told after every prefill chunk: checks for Ctrl-C (so a long prompt stops within
        // one chunk) and calls the user's callback; an error of either cancels the call.
        let progress_error: Arc<std::sync::Mutex<Option<PyErr>>> = Arc::default();
        {
            let (cancel, error) = (cancel.clone(), progress_error.clone());
            opts.prefill_progress = Some(PrefillProgress(Arc::new(move |done, total| {
                Python::attach(|py| {
                    let outcome = py.check_signals().and_then(|()| match &prefill_progress {
                        Some(cb) => cb.call1(py, (done, total)).map(|_| ()),
                        None => Ok(()),
                    });
                    if let Err(e) = outcome {
                        if let Ok(mut slot) = error.lock() {
                            slot.get_or_insert(e);
                        }
                        cancel.store(true, Ordering::Relaxed);
                    }
                })
            })));
        }
        let mut pending: Option<PyErr> = None;
        let completion = run(py, || {
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
            e.generate(session.as_deref(), &ids, &opts, &mut on, &cancel)
        });
        if let Some(err) = progress_error.lock().ok().and_then(|mut e| e.take()) {
            return Err(err);
        }
        if let Some(err) = pending {
            return Err(err);
        }
        completion_dict(py, completion?, &opts)
    }

    /// Generate for several sessions at once, their decode forwards shared (batched decode:
    /// an expert any of them routes to is read once for all). `requests[i]` is a dict of
    /// `generate`'s keywords (every one given) plus "ids"; `sessions[i]` its session.
    /// `on_tokens(i, tokens)` gets request i's emitted tokens (False stops it). Returns one
    /// result dict per request, or the error of that request as an exception object.
    #[pyo3(signature = (requests, sessions, on_tokens=None))]
    fn generate_batch<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<Bound<'py, PyDict>>,
        sessions: Vec<PyRef<'py, PySession>>,
        on_tokens: Option<Py<PyAny>>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        if requests.len() != sessions.len() {
            return Err(to_py_err(Error::invalid(
                "sessions",
                "give one session per request",
            )));
        }
        let mut parsed = Vec::with_capacity(requests.len());
        for r in &requests {
            parsed.push(self.batch_request(r)?);
        }
        let batch: Vec<BatchRequest> = parsed
            .iter()
            .zip(&sessions)
            .map(|((ids, opts), s)| BatchRequest {
                session: s.inner.clone(),
                prompt: ids.clone(),
                options: opts.clone(),
            })
            .collect();
        let e = &self.engine;
        let cancel = AtomicBool::new(false);
        let mut pending: Option<PyErr> = None;
        let results = run(py, || {
            let mut on = |i: usize, toks: &[u32]| -> bool {
                Python::attach(|py| {
                    if let Err(e) = py.check_signals() {
                        pending = Some(e);
                        cancel.store(true, Ordering::Relaxed);
                        return false;
                    }
                    let Some(cb) = &on_tokens else { return true };
                    match cb.call1(py, (i, toks.to_vec())) {
                        Ok(v) => v.extract::<bool>(py).unwrap_or(true),
                        Err(e) => {
                            pending = Some(e);
                            cancel.store(true, Ordering::Relaxed);
                            false
                        }
                    }
                })
            };
            e.generate_batch(batch, &mut on, &cancel)
        });
        if let Some(err) = pending {
            return Err(err);
        }
        results?
            .into_iter()
            .zip(&parsed)
            .map(|(r, (_, opts))| match r {
                Ok(c) => Ok(completion_dict(py, c, opts)?.into_any().unbind()),
                Err(err) => Ok(to_py_err(err).into_value(py).into_any()),
            })
            .collect()
    }

    /// A continuous batch (a server's): `admit(live)` is called before every forward with
    /// the number of requests running and returns a list of `(id, request, session)` to
    /// start (`request` as in `generate_batch`); `on_tokens(id, tokens)` gets each request's
    /// emitted tokens (False stops it); `on_done(id, result)` its result dict, or its error
    /// as an exception object. Returns once nothing runs and `admit` gives nothing; an
    /// exception raised by a callback cancels every running request and is raised here.
    fn run_batch(
        &self,
        py: Python<'_>,
        admit: Py<PyAny>,
        on_tokens: Py<PyAny>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let cancel = AtomicBool::new(false);
        let raised: Mutex<Option<PyErr>> = Mutex::new(None);
        // Per running request: what its result dict holds besides the tokens.
        let scoring: Mutex<HashMap<u64, crate::decode::GenerateOptions>> = Mutex::default();
        let fail = |e: PyErr| {
            if let Ok(mut slot) = raised.lock() {
                slot.get_or_insert(e);
            }
            cancel.store(true, Ordering::Relaxed);
        };
        let done = |py: Python<'_>, id: u64, result: crate::Result<crate::engine::Completion>| {
            let opts = scoring
                .lock()
                .ok()
                .and_then(|mut m| m.remove(&id))
                .unwrap_or_default();
            let value = match result {
                Ok(c) => completion_dict(py, c, &opts).map(|d| d.into_any().unbind()),
                Err(err) => Ok(to_py_err(err).into_value(py).into_any()),
            };
            if let Err(e) = value.and_then(|v| on_done.call1(py, (id, v))) {
                fail(e);
            }
        };
        let outcome = run(py, || {
            let mut admit_requests = |live: usize| -> Vec<(u64, BatchRequest)> {
                Python::attach(|py| {
                    let listed = admit
                        .call1(py, (live,))
                        .and_then(|v| v.extract::<Vec<(u64, Py<PyDict>, Py<PySession>)>>(py));
                    let listed = match listed {
                        Ok(l) => l,
                        Err(e) => {
                            fail(e);
                            return Vec::new();
                        }
                    };
                    let mut out = Vec::with_capacity(listed.len());
                    for (id, request, session) in listed {
                        let request = request.bind(py);
                        let parsed = self.batch_request(request);
                        match parsed {
                            Ok((prompt, options)) => {
                                if let Ok(mut m) = scoring.lock() {
                                    m.insert(id, options.clone());
                                }
                                out.push((
                                    id,
                                    BatchRequest {
                                        session: session.borrow(py).inner.clone(),
                                        prompt,
                                        options,
                                    },
                                ));
                            }
                            Err(e) => {
                                let exc = e.into_value(py).into_any();
                                if let Err(e) = on_done.call1(py, (id, exc)) {
                                    fail(e);
                                }
                            }
                        }
                    }
                    out
                })
            };
            let mut tokens = |id: u64, toks: &[u32]| -> bool {
                Python::attach(|py| match on_tokens.call1(py, (id, toks.to_vec())) {
                    Ok(v) => v.extract::<bool>(py).unwrap_or(true),
                    Err(e) => {
                        fail(e);
                        false
                    }
                })
            };
            let mut finished = |id: u64, result: crate::Result<crate::engine::Completion>| {
                Python::attach(|py| done(py, id, result))
            };
            self.engine.run_batch(
                BatchIo {
                    admit: &mut admit_requests,
                    on_tokens: &mut tokens,
                    on_done: &mut finished,
                },
                &cancel,
            )
        });
        if let Some(err) = raised.lock().ok().and_then(|mut e| e.take()) {
            return Err(err);
        }
        outcome
    }

    /// Evict the model's expert bytes from the OS page cache (cold-start benchmarks).
    fn drop_page_cache(&self, py: Python<'_>) -> PyResult<()> {
        let e = &self.engine;
        run(py, || {
            e.check_process()?;
            e.store().drop_page_cache();
            Ok(())
        })
    }

    /// Expert-store counters since the last generation started: totals and per layer.
    fn expert_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        self.engine.check_process().map_err(to_py_err)?;
        let st = self.engine.store().stats();
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

impl PyEngine {
    /// A structured-output constraint, `(kind, text)`, compiled against the vocabulary.
    fn compile_grammar(&self, kind: &str, text: &str) -> crate::Result<Grammar> {
        let spec = GrammarSpec::parse(kind, text)?;
        let vocabulary = self.vocabulary.get().ok_or_else(|| {
            Error::invalid(
                spec.param(),
                "the engine has no vocabulary: call load_vocabulary first",
            )
        })?;
        vocabulary.compile(&spec)
    }

    /// The engine's options for a request (the engine's EOS ids and context limit where
    /// the request sets none), every value checked.
    fn options(
        &self,
        r: &crate::decode::request::GenerateRequest,
    ) -> PyResult<crate::decode::GenerateOptions> {
        r.options(self.engine.default_generate_options(), |kind, text| {
            self.compile_grammar(kind, text)
        })
        .map_err(to_py_err)
    }

    /// A batch request dict: its prompt (`"ids"`) and its options.
    fn batch_request(
        &self,
        r: &Bound<'_, PyDict>,
    ) -> PyResult<(Vec<u32>, crate::decode::GenerateOptions)> {
        let (request, ids) = request::from_dict(r, true)?;
        let ids =
            ids.ok_or_else(|| to_py_err(Error::invalid("requests", "a request has no 'ids'")))?;
        Ok((ids, self.options(&request)?))
    }
}

/// A completion of a generation with `opts` as the dict `Engine.generate` returns.
fn completion_dict<'py>(
    py: Python<'py>,
    completion: crate::engine::Completion,
    opts: &crate::decode::GenerateOptions,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tokens", completion.tokens)?;
    d.set_item("finish_reason", completion.finish.as_str())?;
    d.set_item("stats", json_to_py(py, &completion.stats)?)?;
    if opts.logprobs.is_some() {
        d.set_item("logprobs", logprob_rows(py, &completion.logprobs)?)?;
    }
    if let Some(sink) = &opts.sampling.prompt_logprobs {
        d.set_item("prompt_logprobs", logprob_rows(py, &sink.take())?)?;
    }
    Ok(d)
}

/// `[{"token", "logprob", "top"}]`, built directly: a −inf log-probability has no JSON form.
fn logprob_rows<'py>(
    py: Python<'py>,
    scored: &[crate::decode::TokenLogprob],
) -> PyResult<Bound<'py, PyList>> {
    let rows = PyList::empty(py);
    for lp in scored {
        let row = PyDict::new(py);
        row.set_item("token", lp.token)?;
        row.set_item("logprob", lp.logprob)?;
        row.set_item("top", lp.top.clone())?;
        rows.append(row)?;
    }
    Ok(rows)
}

/// The accepted values of each string option (`{"io": [...], ...}`), "auto" first.
#[pyfunction]
pub fn choices(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    for (name, values) in crate::engine::CHOICES {
        d.set_item(*name, values.to_vec())?;
    }
    Ok(d)
}

/// Limits the engine enforces: `max_draft_depth`, `max_top_logprobs`.
#[pyfunction]
pub fn limits(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("max_draft_depth", crate::decode::stats::MAX_DEPTH)?;
    d.set_item(
        "max_top_logprobs",
        crate::decode::sampling::MAX_TOP_LOGPROBS,
    )?;
    Ok(d)
}

/// The names of the fields a generation's stats carry (the Rust `GenerationStats`).
#[pyfunction]
pub fn generation_stats_fields() -> Vec<String> {
    crate::engine::GenerationStats::field_names()
}

/// `Engine(...)`'s keyword arguments (its `#[pyo3(signature)]` holds their defaults).
struct EngineArgs<'a> {
    threads: usize,
    io: &'a str,
    ram_budget: Option<u64>,
    prefetch: &'a str,
    prefetch_top_k: usize,
    mtp: bool,
    usage_file: bool,
    cache_dir: Option<PathBuf>,
    pin: &'a str,
    resident_layers: Option<Vec<usize>>,
    max_context: Option<usize>,
    idle_session_bytes: Option<u64>,
    spill_dir: Option<PathBuf>,
    prefill: &'a str,
    trace_routing: Option<PathBuf>,
}

/// The engine's options of `Engine(...)`'s arguments ("auto" and 0 mean the engine decides).
fn engine_options(a: &EngineArgs<'_>) -> crate::Result<EngineOptions> {
    Ok(EngineOptions {
        threads: a.threads,
        io: EngineOptions::parse_io(a.io)?,
        ram_budget: a.ram_budget,
        prefetch: EngineOptions::parse_prefetch(a.prefetch)?,
        prefetch_top_k: (a.prefetch_top_k > 0).then_some(a.prefetch_top_k),
        load_mtp: a.mtp,
        usage_file: a.usage_file,
        cache_dir: a.cache_dir.clone(),
        pin: EngineOptions::parse_pin(a.pin)?,
        resident_layers: a.resident_layers.clone().unwrap_or_default(),
        max_context: a.max_context,
        idle_session_bytes: a.idle_session_bytes,
        spill_dir: a.spill_dir.clone(),
        trace_routing: a.trace_routing.clone(),
        prefill: EngineOptions::parse_prefill(a.prefill)?,
        load_progress: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `Engine(path)` with no options is `EngineOptions::default()`: the arguments below are
    /// the `#[pyo3(signature)]`'s defaults (tests/test_api.py holds `colibri.Model`'s to the
    /// same signature).
    #[test]
    fn an_engine_opened_with_no_options_gets_the_default_options() {
        let no_options = EngineArgs {
            threads: 0,
            io: "auto",
            ram_budget: None,
            prefetch: "auto",
            prefetch_top_k: 0,
            mtp: true,
            usage_file: true,
            cache_dir: None,
            pin: "auto",
            resident_layers: None,
            max_context: None,
            idle_session_bytes: None,
            spill_dir: None,
            prefill: "auto",
            trace_routing: None,
        };
        let got = engine_options(&no_options).unwrap();
        assert_eq!(
            format!("{got:?}"),
            format!("{:?}", EngineOptions::default())
        );
        let other = engine_options(&EngineArgs {
            mtp: false,
            ..no_options
        })
        .unwrap();
        assert_ne!(
            format!("{other:?}"),
            format!("{:?}", EngineOptions::default())
        );
    }
}
