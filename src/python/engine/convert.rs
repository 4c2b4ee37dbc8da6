//! Rust results as Python objects: JSON-shaped values, a generation's result dict, the
//! engine's facts and its expert-store counters.

use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

use crate::engine::Engine;
use crate::error::Error;
use crate::python::to_py_err;

/// A Rust value as the Python object of its JSON form (the stats struct's fields).
fn to_py<'py>(py: Python<'py>, v: &serde_json::Value) -> PyResult<Bound<'py, PyAny>> {
    use serde_json::Value;
    Ok(match v {
        Value::Null => py.None().into_bound(py),
        Value::Bool(b) => b.into_pyobject(py)?.to_owned().into_any(),
        Value::Number(n) => match (n.as_u64(), n.as_i64()) {
            (Some(u), _) => u.into_pyobject(py)?.into_any(),
            (None, Some(i)) => i.into_pyobject(py)?.into_any(),
            _ => n.as_f64().unwrap_or(f64::NAN).into_pyobject(py)?.into_any(),
        },
        Value::String(s) => s.into_pyobject(py)?.into_any(),
        Value::Array(a) => {
            let items = a
                .iter()
                .map(|x| to_py(py, x))
                .collect::<PyResult<Vec<_>>>()?;
            PyList::new(py, items)?.into_any()
        }
        Value::Object(m) => {
            let d = PyDict::new(py);
            for (k, x) in m {
                d.set_item(k, to_py(py, x)?)?;
            }
            d.into_any()
        }
    })
}

fn json_to_py<'py, T: serde::Serialize>(py: Python<'py>, v: &T) -> PyResult<Bound<'py, PyAny>> {
    let value = serde_json::to_value(v).map_err(|e| to_py_err(Error::Internal(e.to_string())))?;
    to_py(py, &value)
}

/// A completion of a generation with `opts` as the dict `Engine.generate` returns.
pub(super) fn completion_dict<'py>(
    py: Python<'py>,
    completion: crate::engine::Completion,
    opts: &crate::decode::GenerateOptions,
) -> PyResult<Bound<'py, PyDict>> {
    let d = PyDict::new(py);
    d.set_item("tokens", completion.tokens)?;
    d.set_item("finish_reason", completion.finish.as_str())?;
    d.set_item("stats", json_to_py(py, &completion.stats)?)?;
    if opts.logprobs.is_some() {
        d.set_item("logprobs", logprob_rows(py, &completion.logprobs)?)?;
    }
    if let Some(sink) = &opts.sampling.prompt_logprobs {
        d.set_item("prompt_logprobs", logprob_rows(py, &sink.take())?)?;
    }
    Ok(d)
}

/// The arguments `on_tokens` callbacks get for a burst: its token ids and their
/// log-probability rows (as the result's `"logprobs"`), or `None` when the request asked
/// for none.
pub(super) fn emitted_args<'py>(
    py: Python<'py>,
    emitted: crate::decode::Emitted<'_>,
) -> PyResult<(Vec<u32>, Bound<'py, PyAny>)> {
    let rows = if emitted.logprobs.is_empty() {
        py.None().into_bound(py)
    } else {
        logprob_rows(py, emitted.logprobs)?.into_any()
    };
    Ok((emitted.tokens.to_vec(), rows))
}

/// `[{"token", "logprob", "top"}]`, built directly: a −inf log-probability has no JSON form.
fn logprob_rows<'py>(
    py: Python<'py>,
    scored: &[crate::decode::TokenLogprob],
) -> PyResult<Bound<'py, PyList>> {
    let rows = PyList::empty(py);
    for lp in scored {
        let row = PyDict::new(py);
        row.set_item("token", lp.token)?;
        row.set_item("logprob", lp.logprob)?;
        row.set_item("top", lp.top.clone())?;
        rows.append(row)?;
    }
    Ok(rows)
}

/// The dict `Engine.info()` returns: the engine's facts fixed at load.
pub(super) fn info_dict<'py>(py: Python<'py>, engine: &Engine) -> PyResult<Bound<'py, PyDict>> {
    let i = engine.info();
    let d = PyDict::new(py);
    d.set_item("has_mtp", i.has_mtp)?;
    d.set_item("uses_dsa", i.uses_dsa)?;
    d.set_item("max_context", i.max_context)?;
    d.set_item("vocab_size", i.vocab_size)?;
    d.set_item("hidden_size", i.hidden_size)?;
    d.set_item("eos_token_ids", i.eos_token_ids.clone())?;
    d.set_item("kv_bytes_per_token", i.kv_bytes_per_token)?;
    d.set_item("idle_session_bytes", i.idle_session_bytes)?;
    d.set_item("fingerprint", i.fingerprint.clone())?;
    d.set_item("prefill", i.prefill)?;
    d.set_item("decode", i.decode)?;
    d.set_item("row_invariant", i.row_invariant)?;
    d.set_item("lookahead", i.lookahead)?;
    d.set_item("experts_per_token", i.experts_per_token)?;
    d.set_item("model_experts_per_token", i.model_experts_per_token)?;
    Ok(d)
}

/// The dict `Engine.expert_stats()` returns: the store's counters, totals and per layer.
pub(super) fn expert_stats_dict<'py>(
    py: Python<'py>,
    engine: &Engine,
) -> PyResult<Bound<'py, PyDict>> {
    let st = engine.store().stats();
    let d = PyDict::new(py);
    d.set_item("io_mode", st.io_mode.name())?;
    d.set_item("budget_bytes", st.budget_bytes)?;
    d.set_item("pinned_bytes", st.pinned_bytes)?;
    d.set_item("lru_bytes", st.lru_bytes)?;
    d.set_item("pin_set_len", st.pin_set_len)?;
    d.set_item("resident_bytes", st.resident_bytes)?;
    d.set_item("peak_owned_bytes", st.peak_owned_bytes)?;
    d.set_item("io_busy_seconds", st.io_busy_ns as f64 / 1e9)?;
    let total = PyDict::new(py);
    for (k, v) in st.total.fields() {
        total.set_item(k, v)?;
    }
    d.set_item("total", total)?;
    let layers = PyDict::new(py);
    for (l, ls) in &st.layers {
        let ld = PyDict::new(py);
        for (k, v) in ls.fields() {
            ld.set_item(k, v)?;
        }
        ld.set_item("recall_router", ls.recall_router())?;
        ld.set_item("recall_previous", ls.recall_previous())?;
        layers.set_item(l, ld)?;
    }
    d.set_item("layers", layers)?;
    Ok(d)
}
