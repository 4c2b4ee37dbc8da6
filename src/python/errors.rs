//! Engine errors as `colibri.errors` exceptions, with the error's fields as attributes:
//! `filename` (the file a config, container, saved-context or I/O error is about), `errno`
//! (an OS error's code), `param` (the argument an `InvalidArgumentError` names) and `tensor`
//! (the tensor a container or non-finite-weight error names), each `None` when the error has
//! none. The classes are looked up once, at module init: a missing one is an import error,
//! never a silent `RuntimeError`. Engine warnings go to the `colibri` logger.

use std::sync::Mutex;

use pyo3::exceptions::{PyKeyboardInterrupt, PySystemError};
use pyo3::prelude::*;
use pyo3::sync::PyOnceLock;
use pyo3::types::PyType;

use crate::error::Error;

/// The `colibri.errors` classes the engine raises.
struct Classes {
    io: Py<PyType>,
    file_not_found: Py<PyType>,
    permission: Py<PyType>,
    config: Py<PyType>,
    unsupported: Py<PyType>,
    container: Py<PyType>,
    missing_tensor: Py<PyType>,
    invalid_argument: Py<PyType>,
    non_finite_weight: Py<PyType>,
    saved_context: Py<PyType>,
    forked_process: Py<PyType>,
    internal: Py<PyType>,
}

static CLASSES: PyOnceLock<Classes> = PyOnceLock::new();

/// Warnings given on engine threads, logged by the next binding call that returns (on the
/// calling thread, holding the GIL: an engine thread never waits for the GIL, so a thread
/// that holds it while joining engine threads cannot deadlock with one that warns).
static PENDING: Mutex<Vec<String>> = Mutex::new(Vec::new());

fn queue_warning(msg: &str) {
    PENDING
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(msg.to_owned());
}

/// Import the exception classes and route engine warnings to Python; run once from the
/// module's init.
pub(crate) fn init(py: Python<'_>) -> PyResult<()> {
    let m = py.import("colibri.errors")?;
    let class = |name: &str| -> PyResult<Py<PyType>> {
        Ok(m.getattr(name)?.cast_into::<PyType>()?.unbind())
    };
    let classes = Classes {
        io: class("ColibriIOError")?,
        file_not_found: class("ColibriFileNotFoundError")?,
        permission: class("ColibriPermissionError")?,
        config: class("ConfigError")?,
        unsupported: class("UnsupportedModelError")?,
        container: class("ContainerError")?,
        missing_tensor: class("MissingTensorError")?,
        invalid_argument: class("InvalidArgumentError")?,
        non_finite_weight: class("NonFiniteWeightError")?,
        saved_context: class("SavedContextError")?,
        forked_process: class("ForkedProcessError")?,
        internal: class("InternalError")?,
    };
    // A second init (a subinterpreter, a reload) keeps the first set.
    let _ = CLASSES.set(py, classes);
    crate::diagnostics::set_sink(queue_warning);
    Ok(())
}

/// Log the warnings queued since the last call to the `colibri` logger.
pub(crate) fn flush_warnings(py: Python<'_>) {
    let pending = std::mem::take(&mut *PENDING.lock().unwrap_or_else(|e| e.into_inner()));
    if pending.is_empty() {
        return;
    }
    let logger = py
        .import("logging")
        .and_then(|l| l.call_method1("getLogger", ("colibri",)));
    for msg in pending {
        match &logger {
            Ok(logger) => {
                if let Err(e) = logger.call_method1("warning", (msg,)) {
                    e.write_unraisable(py, None);
                }
            }
            Err(_) => eprintln!("colibri: warning: {msg}"),
        }
    }
}

/// The error's fields as (filename, errno, param, tensor).
fn fields(err: &Error) -> (Option<String>, Option<i32>, Option<&str>, Option<&str>) {
    let name = |p: &std::path::Path| Some(p.display().to_string());
    match err {
        Error::Io { path, source } => (name(path), source.raw_os_error(), None, None),
        Error::Config { path, .. } | Error::SavedContext { path, .. } => {
            (name(path), None, None, None)
        }
        Error::Container { file, tensor, .. } => (name(file), None, None, tensor.as_deref()),
        Error::MissingTensor { dir, tensor, .. } => (name(dir), None, None, Some(tensor)),
        Error::InvalidArgument { param, .. } => (None, None, Some(param), None),
        Error::NonFinite { tensor, .. } => (None, None, None, Some(tensor)),
        Error::NonFiniteWeight { file, tensor, .. } => {
            (name(file), None, None, Some(tensor.as_str()))
        }
        Error::Unsupported(_)
        | Error::NonFiniteOutput(_)
        | Error::Cancelled
        | Error::ForkedProcess { .. }
        | Error::Internal(_) => (None, None, None, None),
    }
}

/// Build the Python exception for an engine error, as a `colibri.errors` class with the
/// error's fields as attributes (`Cancelled` is a `KeyboardInterrupt`).
pub(crate) fn to_py_err(err: Error) -> PyErr {
    if matches!(err, Error::Cancelled) {
        return PyKeyboardInterrupt::new_err(err.to_string());
    }
    Python::attach(|py| {
        let Some(c) = CLASSES.get(py) else {
            return PySystemError::new_err(format!(
                "colibri._core raised before its module init imported colibri.errors: {err}"
            ));
        };
        let class = match &err {
            Error::Io { source, .. } => match source.kind() {
                std::io::ErrorKind::NotFound => &c.file_not_found,
                std::io::ErrorKind::PermissionDenied => &c.permission,
                _ => &c.io,
            },
            Error::Config { .. } => &c.config,
            Error::Unsupported(_) => &c.unsupported,
            Error::Container { .. } => &c.container,
            Error::MissingTensor { .. } => &c.missing_tensor,
            Error::InvalidArgument { .. } => &c.invalid_argument,
            Error::NonFinite { .. } | Error::NonFiniteWeight { .. } | Error::NonFiniteOutput(_) => {
                &c.non_finite_weight
            }
            Error::SavedContext { .. } => &c.saved_context,
            Error::ForkedProcess { .. } => &c.forked_process,
            Error::Cancelled | Error::Internal(_) => &c.internal,
        };
        let (filename, errno, param, tensor) = fields(&err);
        let built = class.bind(py).call1((err.to_string(),)).and_then(|exc| {
            exc.setattr("filename", filename)?;
            exc.setattr("errno", errno)?;
            exc.setattr("param", param)?;
            exc.setattr("tensor", tensor)?;
            Ok(exc)
        });
        match built {
            Ok(exc) => PyErr::from_value(exc),
            // Constructing one of our own classes failed: that error says why.
            Err(e) => e,
        }
    })
}
