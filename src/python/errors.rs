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

/// The `colibri.errors` classes the engine raises, by name; [`class_name`] says which one an
/// error is raised as.
const CLASS_NAMES: [&str; 12] = [
    "ColibriIOError",
    "ColibriFileNotFoundError",
    "ColibriPermissionError",
    "ConfigError",
    "UnsupportedModelError",
    "ContainerError",
    "MissingTensorError",
    "InvalidArgumentError",
    "NonFiniteWeightError",
    "SavedContextError",
    "ForkedProcessError",
    "InternalError",
];

/// The classes of [`CLASS_NAMES`], in that order.
struct Classes(Vec<Py<PyType>>);

impl Classes {
    fn get(&self, name: &str) -> Option<&Py<PyType>> {
        let i = CLASS_NAMES.iter().position(|n| *n == name)?;
        Some(&self.0[i])
    }
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
    let classes = CLASS_NAMES
        .iter()
        .map(|name| Ok(m.getattr(*name)?.cast_into::<PyType>()?.unbind()))
        .collect::<PyResult<Vec<_>>>()?;
    let classes = Classes(classes);
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

/// The `colibri.errors` class `err` is raised as (`Cancelled`, raised as `KeyboardInterrupt`,
/// aside): one of [`CLASS_NAMES`].
fn class_name(err: &Error) -> &'static str {
    match err {
        Error::Io { source, .. } => match source.kind() {
            std::io::ErrorKind::NotFound => "ColibriFileNotFoundError",
            std::io::ErrorKind::PermissionDenied => "ColibriPermissionError",
            _ => "ColibriIOError",
        },
        Error::Config { .. } => "ConfigError",
        Error::Unsupported(_) => "UnsupportedModelError",
        Error::Container { .. } => "ContainerError",
        Error::MissingTensor { .. } => "MissingTensorError",
        Error::InvalidArgument { .. } => "InvalidArgumentError",
        Error::NonFinite { .. } | Error::NonFiniteWeight { .. } | Error::NonFiniteOutput(_) => {
            "NonFiniteWeightError"
        }
        Error::SavedContext { .. } => "SavedContextError",
        Error::ForkedProcess { .. } => "ForkedProcessError",
        Error::Cancelled | Error::Internal(_) => "InternalError",
    }
}

/// Build the Python exception for an engine error, as a `colibri.errors` class with the
/// error's fields as attributes (`Cancelled` is a `KeyboardInterrupt`).
pub(crate) fn to_py_err(err: Error) -> PyErr {
    if matches!(err, Error::Cancelled) {
        return PyKeyboardInterrupt::new_err(err.to_string());
    }
    Python::attach(|py| {
        let Some(class) = CLASSES.get(py).and_then(|c| c.get(class_name(&err))) else {
            return PySystemError::new_err(format!(
                "colibri._core raised before its module init imported colibri.errors: {err}"
            ));
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

#[cfg(test)]
mod tests {
    use super::*;

    fn io(kind: std::io::ErrorKind) -> Error {
        Error::io("/nonexistent", std::io::Error::from(kind))
    }

    /// Every variant is raised as a class the module init looks up (a name missing from
    /// `CLASS_NAMES` would raise `SystemError` instead), and as the one its docs promise.
    #[test]
    fn every_error_maps_to_its_class() {
        let cases = [
            (io(std::io::ErrorKind::NotFound), "ColibriFileNotFoundError"),
            (
                io(std::io::ErrorKind::PermissionDenied),
                "ColibriPermissionError",
            ),
            (io(std::io::ErrorKind::UnexpectedEof), "ColibriIOError"),
            (
                Error::Config {
                    path: "config.json".into(),
                    msg: "bad".into(),
                },
                "ConfigError",
            ),
            (Error::Unsupported("x".into()), "UnsupportedModelError"),
            (
                Error::container("a.safetensors", Some("w"), "truncated"),
                "ContainerError",
            ),
            (
                Error::MissingTensor {
                    tensor: "w".into(),
                    dir: "/m".into(),
                    family: "deepseek_v3".into(),
                },
                "MissingTensorError",
            ),
            (
                Error::invalid("temperature", "must be >= 0"),
                "InvalidArgumentError",
            ),
            (
                Error::NonFinite {
                    tensor: "w".into(),
                    what: "NaN",
                    index: 0,
                },
                "NonFiniteWeightError",
            ),
            (
                Error::NonFiniteWeight {
                    file: "a.safetensors".into(),
                    tensor: "w".into(),
                    what: "NaN".into(),
                    index: 0,
                },
                "NonFiniteWeightError",
            ),
            (Error::NonFiniteOutput("x".into()), "NonFiniteWeightError"),
            (
                Error::SavedContext {
                    path: "s.ctx".into(),
                    msg: "bad".into(),
                },
                "SavedContextError",
            ),
            (
                Error::ForkedProcess {
                    created_in: 1,
                    current: 2,
                },
                "ForkedProcessError",
            ),
            (Error::Internal("x".into()), "InternalError"),
        ];
        for (err, want) in &cases {
            assert_eq!(class_name(err), *want, "{err}");
            assert!(CLASS_NAMES.contains(want), "{want}");
        }
        let mapped: std::collections::BTreeSet<_> =
            cases.iter().map(|(e, _)| class_name(e)).collect();
        let declared: std::collections::BTreeSet<_> = CLASS_NAMES.into_iter().collect();
        assert_eq!(mapped, declared, "a class no error is raised as");
    }

    #[test]
    fn errors_carry_their_fields() {
        let enoent = Error::io(
            "/nonexistent",
            std::io::Error::from_raw_os_error(libc::ENOENT),
        );
        assert_eq!(
            fields(&enoent),
            (Some("/nonexistent".into()), Some(libc::ENOENT), None, None)
        );
        let config = Error::Config {
            path: "config.json".into(),
            msg: "bad".into(),
        };
        assert_eq!(
            fields(&config),
            (Some("config.json".into()), None, None, None)
        );
        let container = Error::container("a.safetensors", Some("w"), "truncated");
        assert_eq!(
            fields(&container),
            (Some("a.safetensors".into()), None, None, Some("w"))
        );
        let invalid = Error::invalid("temperature", "must be >= 0");
        assert_eq!(fields(&invalid), (None, None, Some("temperature"), None));
        let internal = Error::Internal("x".into());
        assert_eq!(fields(&internal), (None, None, None, None));
    }
}
