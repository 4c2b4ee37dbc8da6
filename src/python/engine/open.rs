//! Opening an engine from Python: the options of `Engine(...)`'s arguments, with a load
//! progress callback that also lets Ctrl-C stop a long load.

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use pyo3::prelude::*;

use super::options::{engine_options, EngineArgs};
use super::PyEngine;
use crate::engine::{Engine, LoadProgress};
use crate::python::{run, to_py_err};

impl PyEngine {
    /// The engine at `path` opened with `args`; `load_progress(done, total)` is called
    /// after each resident tensor.
    pub(super) fn open(
        py: Python<'_>,
        path: PathBuf,
        args: &EngineArgs<'_>,
        load_progress: Option<Py<PyAny>>,
    ) -> PyResult<Self> {
        let raised: Arc<Mutex<Option<PyErr>>> = Arc::default();
        let report = load_progress_report(load_progress, raised.clone());
        let mut opts = engine_options(args).map_err(to_py_err)?;
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
}

/// Told after each resident tensor: checks for Ctrl-C (a long load stops within a
/// tensor) and calls the caller's callback; an error of either stops the open and is kept
/// in `raised`.
fn load_progress_report(
    load_progress: Option<Py<PyAny>>,
    raised: Arc<Mutex<Option<PyErr>>>,
) -> LoadProgress {
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
}
