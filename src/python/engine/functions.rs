//! Module-level functions of `colibri._core` that describe the engine: its string
//! options' values, its limits and its stats' field names.

use pyo3::prelude::*;
use pyo3::types::PyDict;

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
