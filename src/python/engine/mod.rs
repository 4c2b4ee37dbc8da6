//! `colibri._core.Engine` and `Session`: the Rust [`Engine`](crate::engine::Engine) driven
//! from Python. This layer only converts types; what options mean, defaults and stats live
//! in `crate::engine`.
//!
//! Engine calls run with the GIL released (they may wait for another thread's generation).
//! The `on_tokens` callback is called with the GIL held after every forward that emitted
//! tokens, with their ids and their log-probability rows (`None` unless the request asked
//! for `logprobs`); it also checks for Ctrl-C, so KeyboardInterrupt stops generation within one
//! forward and leaves the engine usable.
//!
//! PyO3 takes one `#[pymethods]` block per class, so the methods are declared here (their
//! doc comments are the Python docstrings) and the longer ones call into a file by job:
//! `open` (opening with load progress), `options` (arguments and request dicts as
//! options), `generate`, `batch` (batched and continuous generation), `convert` (results
//! as Python objects), `session` (the `Session` class) and `functions` (module-level
//! functions).

use std::path::PathBuf;

use numpy::{PyArray2, PyArrayMethods};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::decode::Vocabulary;
use crate::engine::Engine;
use crate::error::Error;
use crate::python::{request, run, to_py_err};

mod batch;
mod convert;
mod functions;
mod generate;
mod open;
mod options;
mod session;
#[cfg(test)]
mod tests;

pub use functions::{choices, generation_stats_fields, limits};
pub use session::PySession;

#[pyclass(name = "Engine", module = "colibri._core", frozen)]
pub struct PyEngine {
    engine: Engine,
    /// The vocabulary structured output compiles grammars against, once it was given
    /// (`load_vocabulary`).
    vocabulary: std::sync::OnceLock<Vocabulary>,
}

#[pymethods]
impl PyEngine {
    #[new]
    #[pyo3(signature = (path, *, threads=0, io="auto", ram_budget=None, prefetch="auto", prefetch_top_k=0, mtp=true, usage_file=true, cache_dir=None, pin="auto", resident_layers=None, max_context=None, idle_session_bytes=None, spill_dir=None, prefill="auto", decode="auto", load_progress=None, trace_routing=None, experts_per_token=None))]
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
        decode: &str,
        load_progress: Option<Py<PyAny>>,
        trace_routing: Option<PathBuf>,
        experts_per_token: Option<usize>,
    ) -> PyResult<Self> {
        let args = options::EngineArgs {
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
            decode,
            trace_routing,
            experts_per_token,
        };
        Self::open(py, path, &args, load_progress)
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
    /// eos_token_ids, kv_bytes_per_token, idle_session_bytes, fingerprint, prefill, decode, row_invariant,
    /// lookahead.
    fn info<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        convert::info_dict(py, &self.engine)
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
    /// "finish_reason", "stats"}. `on_tokens(tokens, logprobs)` gets every burst of
    /// emitted tokens and their log-probability rows (None without `logprobs`; False stops).
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
        let request = request::from_parts(py, request.as_ref(), fields.as_ref())?;
        let session = session.as_ref().map(|s| s.inner.clone());
        self.generate_request(py, ids, &request, session, on_tokens, prefill_progress)
    }

    /// Generate for several sessions at once, their decode forwards shared (batched decode:
    /// an expert any of them routes to is read once for all). `requests[i]` is a dict of
    /// `generate`'s keywords (every one given) plus "ids"; `sessions[i]` its session.
    /// `on_tokens(i, tokens, logprobs)` gets request i's emitted tokens and their
    /// log-probability rows (None without `logprobs`; False stops it). Returns one
    /// result dict per request, or the error of that request as an exception object.
    #[pyo3(signature = (requests, sessions, on_tokens=None))]
    fn generate_batch<'py>(
        &self,
        py: Python<'py>,
        requests: Vec<Bound<'py, PyDict>>,
        sessions: Vec<PyRef<'py, PySession>>,
        on_tokens: Option<Py<PyAny>>,
    ) -> PyResult<Vec<Py<PyAny>>> {
        self.generate_requests(py, requests, sessions, on_tokens)
    }

    /// A continuous batch (a server's): `admit(live)` is called before every forward with
    /// the number of requests running and returns a list of `(id, request, session)` to
    /// start (`request` as in `generate_batch`); `on_tokens(id, tokens, logprobs)` gets
    /// each request's emitted tokens and their log-probability rows (False stops it); `on_done(id, result)` its result dict, or its error
    /// as an exception object. Returns once nothing runs and `admit` gives nothing; an
    /// exception raised by a callback cancels every running request and is raised here.
    fn run_batch(
        &self,
        py: Python<'_>,
        admit: Py<PyAny>,
        on_tokens: Py<PyAny>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        self.run_continuous_batch(py, admit, on_tokens, on_done)
    }

    /// Compute routed experts on `remote` (`colibri.distributed.RayExperts`: `submit` and
    /// `collect`) where it holds them, `held` the `(layer, expert)` pairs it holds; None puts
    /// every expert back on the local store.
    #[pyo3(signature = (remote, held=Vec::new()))]
    fn set_remote_experts(&self, remote: Option<Py<PyAny>>, held: Vec<(usize, usize)>) {
        let remote = remote.map(|obj| {
            std::sync::Arc::new(crate::python::remote::PyRemote::new(obj, held))
                as std::sync::Arc<dyn crate::model::remote::RemoteExperts>
        });
        self.engine.set_remote_experts(remote);
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
        convert::expert_stats_dict(py, &self.engine)
    }
}
