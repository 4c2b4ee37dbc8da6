//! `Engine.generate`: one request, with its `on_tokens` and `prefill_progress` callbacks
//! run with the GIL held. Both check for Ctrl-C; an error either raises stops the call and
//! is raised once the engine returns.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::convert::{completion_dict, emitted_args};
use super::PyEngine;
use crate::decode::request::GenerateRequest;
use crate::decode::{Emitted, PrefillProgress};
use crate::engine::Session;
use crate::python::run;

impl PyEngine {
    /// `request` generated after `ids` (in `session` when given), as `generate`'s dict.
    pub(super) fn generate_request<'py>(
        &self,
        py: Python<'py>,
        ids: Vec<u32>,
        request: &GenerateRequest,
        session: Option<Arc<Session>>,
        on_tokens: Option<Py<PyAny>>,
        prefill_progress: Option<Py<PyAny>>,
    ) -> PyResult<Bound<'py, PyDict>> {
        let e = &self.engine;
        let mut opts = self.options(request)?;
        let cancel = Arc::new(AtomicBool::new(false));
        let progress_error: Arc<Mutex<Option<PyErr>>> = Arc::default();
        opts.prefill_progress = Some(prefill_progress_report(
            prefill_progress,
            cancel.clone(),
            progress_error.clone(),
        ));
        let mut pending: Option<PyErr> = None;
        let completion = run(py, || {
            let mut on = |emitted: Emitted<'_>| -> bool {
                Python::attach(|py| {
                    if let Err(e) = py.check_signals() {
                        pending = Some(e);
                        return false;
                    }
                    let Some(cb) = &on_tokens else { return true };
                    match emitted_args(py, emitted).and_then(|args| cb.call1(py, args)) {
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
}

/// Told after every prefill chunk: checks for Ctrl-C (so a long prompt stops within one
/// chunk) and calls the user's callback; an error of either is kept in `error` and sets
/// `cancel`.
fn prefill_progress_report(
    prefill_progress: Option<Py<PyAny>>,
    cancel: Arc<AtomicBool>,
    error: Arc<Mutex<Option<PyErr>>>,
) -> PrefillProgress {
    PrefillProgress(Arc::new(move |done, total| {
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
    }))
}
