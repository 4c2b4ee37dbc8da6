//! Batched generation: `Engine.generate_batch` (a fixed set of requests) and
//! `Engine.run_batch` (a server's continuous batch). The callbacks run with the GIL held;
//! an exception one raises cancels the batch and is raised once the engine returns.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::{completion_dict, emitted_args};
use super::{PyEngine, PySession};
use crate::decode::{Emitted, GenerateOptions};
use crate::engine::{BatchIo, BatchRequest, Completion};
use crate::error::Error;
use crate::python::{run, to_py_err};

impl PyEngine {
    /// `generate_batch`: one result dict (or exception object) per request.
    pub(super) fn generate_requests<'py>(
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
            let mut on = |i: usize, emitted: Emitted<'_>| -> bool {
                Python::attach(|py| {
                    if let Err(e) = py.check_signals() {
                        pending = Some(e);
                        cancel.store(true, Ordering::Relaxed);
                        return false;
                    }
                    let Some(cb) = &on_tokens else { return true };
                    let args = emitted_args(py, emitted);
                    match args.and_then(|(toks, rows)| cb.call1(py, (i, toks, rows))) {
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

    /// `run_batch`: requests admitted by `admit`, their tokens given to `on_tokens` and
    /// their results to `on_done`, until nothing runs and nothing is admitted.
    pub(super) fn run_continuous_batch(
        &self,
        py: Python<'_>,
        admit: Py<PyAny>,
        on_tokens: Py<PyAny>,
        on_done: Py<PyAny>,
    ) -> PyResult<()> {
        let cancel = AtomicBool::new(false);
        let raised: Mutex<Option<PyErr>> = Mutex::new(None);
        // Per running request: what its result dict holds besides the tokens.
        let scoring: Mutex<HashMap<u64, GenerateOptions>> = Mutex::default();
        let fail = |e: PyErr| {
            if let Ok(mut slot) = raised.lock() {
                slot.get_or_insert(e);
            }
            cancel.store(true, Ordering::Relaxed);
        };
        let done = |py: Python<'_>, id: u64, result: crate::Result<Completion>| {
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
                Python::attach(|py| self.admitted(py, &admit, live, &scoring, &on_done, &fail))
            };
            let mut tokens = |id: u64, emitted: Emitted<'_>| -> bool {
                let call = |py: Python<'_>| {
                    let (toks, rows) = emitted_args(py, emitted)?;
                    on_tokens.call1(py, (id, toks, rows))
                };
                Python::attach(|py| match call(py) {
                    Ok(v) => v.extract::<bool>(py).unwrap_or(true),
                    Err(e) => {
                        fail(e);
                        false
                    }
                })
            };
            let mut finished = |id: u64, result: crate::Result<Completion>| {
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

    /// The requests `admit(live)` lists, parsed, their options kept in `scoring`. A request
    /// that does not parse is done at once: its error goes to `on_done`. An exception from
    /// either callback goes to `fail`.
    fn admitted(
        &self,
        py: Python<'_>,
        admit: &Py<PyAny>,
        live: usize,
        scoring: &Mutex<HashMap<u64, GenerateOptions>>,
        on_done: &Py<PyAny>,
        fail: &impl Fn(PyErr),
    ) -> Vec<(u64, BatchRequest)> {
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
    }
}
