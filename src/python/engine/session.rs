//! `colibri._core.Session`: one conversation's KV caches, as an engine's `new_session`
//! and `load_session` return it.

use std::sync::Arc;

use pyo3::prelude::*;

use crate::engine::Session;
use crate::python::run;

/// One conversation's KV caches and the tokens they hold; an engine's
/// `generate(..., session=s)` continues it.
#[pyclass(name = "Session", module = "colibri._core", frozen)]
pub struct PySession {
    pub(super) inner: Arc<Session>,
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
