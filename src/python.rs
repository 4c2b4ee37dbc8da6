//! PyO3 bindings, and the only module that knows about Python. Each binding extracts plain
//! Rust values, runs the engine with the GIL released through [`run`], and converts the
//! result. Errors map to the `colibri.errors` hierarchy with their fields as attributes
//! (`errors.rs`); a panic becomes `InternalError`.

use std::panic::{catch_unwind, AssertUnwindSafe};

mod container;
mod engine;
mod errors;
mod kernels;
mod plan;
pub(crate) mod remote;
mod request;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::error::Error;
pub(crate) use errors::to_py_err;

/// Run engine work with the GIL released; a panic is caught here and reported as an
/// `InternalError` rather than crossing into Python.
pub(crate) fn run<T: Send>(
    py: Python<'_>,
    work: impl FnOnce() -> crate::Result<T> + Send,
) -> PyResult<T> {
    let outcome = py.detach(|| catch_panic(work));
    errors::flush_warnings(py);
    outcome.map_err(to_py_err)
}

/// `work()`, with a panic turned into [`Error::Internal`] carrying its message.
fn catch_panic<T>(work: impl FnOnce() -> crate::Result<T>) -> crate::Result<T> {
    catch_unwind(AssertUnwindSafe(work)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| panic.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into());
        Err(Error::Internal(what))
    })
}

/// CPU features the kernels can dispatch on, e.g. `["avx2", "fma", "avx512f"]`.
#[pyfunction]
fn cpu_features() -> Vec<&'static str> {
    crate::cpu::features().names()
}

/// Facts about this build and machine: version, architecture, CPU features.
#[pyfunction]
fn build_info(py: Python<'_>) -> PyResult<Bound<'_, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("version", crate::VERSION)?;
    d.set_item("arch", crate::cpu::arch())?;
    d.set_item("cpu_features", crate::cpu::features().names())?;
    d.set_item("kernel_path", crate::quant::kernels::selected_path().name())?;
    d.set_item("debug_assertions", cfg!(debug_assertions))?;
    Ok(d)
}

/// Every `finish_reason` a generation's result dict can hold, as the engine spells them.
#[pyfunction]
fn finish_reasons() -> Vec<&'static str> {
    crate::decode::FinishReason::ALL
        .iter()
        .map(|r| r.as_str())
        .collect()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    errors::init(m.py())?;
    m.add("__version__", crate::VERSION)?;
    m.add_function(wrap_pyfunction!(cpu_features, m)?)?;
    m.add_function(wrap_pyfunction!(build_info, m)?)?;
    m.add_function(wrap_pyfunction!(finish_reasons, m)?)?;
    m.add_class::<engine::PyEngine>()?;
    m.add_class::<engine::PySession>()?;
    m.add_function(wrap_pyfunction!(engine::choices, m)?)?;
    m.add_function(wrap_pyfunction!(engine::limits, m)?)?;
    m.add_function(wrap_pyfunction!(request::check_request, m)?)?;
    m.add_function(wrap_pyfunction!(request::request_fields, m)?)?;
    m.add_function(wrap_pyfunction!(engine::generation_stats_fields, m)?)?;
    container::register(m)?;
    kernels::register(m)?;
    plan::register(m)?;
    remote::register(m)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A panic in engine work never crosses into Python as a panic: it is an
    /// `Error::Internal` with the panic's message (raised as `colibri.InternalError`).
    #[test]
    fn a_panic_becomes_an_internal_error() {
        let err = catch_panic::<()>(|| panic!("deliberate test panic")).unwrap_err();
        assert!(
            matches!(&err, Error::Internal(m) if m == "deliberate test panic"),
            "{err}"
        );
        let n = 7;
        let err = catch_panic::<()>(|| panic!("formatted {n}")).unwrap_err();
        assert!(
            matches!(&err, Error::Internal(m) if m == "formatted 7"),
            "{err}"
        );
        assert_eq!(catch_panic(|| Ok(3)).unwrap(), 3);
        let err = catch_panic::<()>(|| Err(Error::Cancelled)).unwrap_err();
        assert!(matches!(err, Error::Cancelled));
    }
}
