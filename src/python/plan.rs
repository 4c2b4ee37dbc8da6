//! Binding of `colibri plan`: the whole request runs in Rust (`routing::request`); Python
//! gets its report as JSON.

use std::path::PathBuf;

use pyo3::prelude::*;

use crate::python::run;
use crate::routing::request::{self, PlanRequest};

/// Plan `model` (a container directory or "glm-5.2" / "deepseek-v3") for `ram_bytes` of RAM;
/// returns the report as a JSON string (see docs/cli.md, "colibri plan").
#[pyfunction]
#[pyo3(signature = (model, ram_bytes, disk_bytes_per_second=None, compute_bytes_per_second=None, cache_dir=None, probe_dir=None, reserve_bytes=4<<30, seed=1, probe_seconds=2.0))]
#[allow(clippy::too_many_arguments)]
fn plan_model(
    py: Python<'_>,
    model: String,
    ram_bytes: u64,
    disk_bytes_per_second: Option<f64>,
    compute_bytes_per_second: Option<f64>,
    cache_dir: Option<PathBuf>,
    probe_dir: Option<PathBuf>,
    reserve_bytes: u64,
    seed: u64,
    probe_seconds: f64,
) -> PyResult<String> {
    let req = PlanRequest {
        model,
        ram_bytes,
        disk_bytes_per_second,
        compute_bytes_per_second,
        cache_dir,
        probe_dir,
        reserve_bytes,
        seed,
        probe_seconds,
    };
    run(py, move || {
        let report = request::run(&req)?;
        serde_json::to_string(&report)
            .map_err(|e| crate::Error::Internal(format!("plan report: {e}")))
    })
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(plan_model, m)?)?;
    Ok(())
}
