//! Bindings for the kernel dispatch: which path runs, forcing one. (The kernels themselves
//! are tested in Rust: `src/quant/kernels/tests.rs`, `tests/kernel_layout.rs`.)

use pyo3::prelude::*;

use crate::python::run;
use crate::quant::kernels::{self, KernelPath};

/// The kernel path calls use now: "scalar", "avx2", "avx512" or "neon".
#[pyfunction]
fn kernel_path() -> &'static str {
    kernels::selected_path().name()
}

/// The kernel paths this machine can run.
#[pyfunction]
fn kernel_paths() -> Vec<&'static str> {
    KernelPath::available().iter().map(|p| p.name()).collect()
}

/// Force every later call onto `path` (None: back to `COLIBRI_KERNEL` / auto-detection).
/// Forcing a path this CPU cannot run raises `InvalidArgumentError`.
#[pyfunction]
#[pyo3(signature = (path))]
fn set_kernel_path(py: Python<'_>, path: Option<String>) -> PyResult<()> {
    run(py, move || {
        let p = path.as_deref().map(KernelPath::parse).transpose()?;
        kernels::set_forced_path(p)
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(kernel_path, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_paths, m)?)?;
    m.add_function(wrap_pyfunction!(set_kernel_path, m)?)?;
    Ok(())
}
