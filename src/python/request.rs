//! A generation request from a Python dict: each key read into its
//! [`GenerateRequest`] field by name, a value of the wrong type or an unknown key an
//! `InvalidArgumentError` that names it.

use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::decode::request::GenerateRequest;
use crate::error::Error;
use crate::python::to_py_err;

/// `request`'s fields over the defaults; the key `"ids"`, when `with_ids`, is the prompt
/// (a batch request's), returned beside it.
pub fn from_dict(
    request: &Bound<'_, PyDict>,
    with_ids: bool,
) -> PyResult<(GenerateRequest, Option<Vec<u32>>)> {
    let mut r = GenerateRequest::default();
    let mut ids = None;
    for (key, value) in request.iter() {
        let name: String = key.extract().map_err(|_| {
            to_py_err(Error::invalid(
                "request",
                format!("a key is not a string: {key}"),
            ))
        })?;
        if with_ids && name == "ids" {
            ids = Some(field(&name, &value, "a list of token ids")?);
            continue;
        }
        match name.as_str() {
            "max_new_tokens" => r.max_new_tokens = field(&name, &value, "an integer >= 1")?,
            "temperature" => r.temperature = field(&name, &value, "a number")?,
            "top_k" => r.top_k = field(&name, &value, "an integer >= 0")?,
            "top_p" => r.top_p = field(&name, &value, "a number")?,
            "min_p" => r.min_p = field(&name, &value, "a number")?,
            "seed" => r.seed = field(&name, &value, "an integer in [0, 2**64)")?,
            "repetition_penalty" => r.repetition_penalty = field(&name, &value, "a number")?,
            "presence_penalty" => r.presence_penalty = field(&name, &value, "a number")?,
            "frequency_penalty" => r.frequency_penalty = field(&name, &value, "a number")?,
            "logit_bias" => {
                r.logit_bias =
                    field::<Option<_>>(&name, &value, "(token id, bias) pairs")?.unwrap_or_default()
            }
            "min_tokens" => r.min_tokens = field(&name, &value, "an integer >= 0")?,
            "logprobs" => r.logprobs = field(&name, &value, "None or an integer >= 0")?,
            "prompt_logprobs" => {
                r.prompt_logprobs = field(&name, &value, "None or an integer >= 0")?
            }
            "stop_ids" => r.stop_ids = field(&name, &value, "None or a list of token ids")?,
            "grammar" => r.grammar = field(&name, &value, "None or (kind, text)")?,
            "draft" => r.draft = field(&name, &value, "a string")?,
            "draft_depth" => r.draft_depth = field(&name, &value, "an integer >= 0")?,
            _ => {
                return Err(to_py_err(Error::invalid(
                    "request",
                    format!(
                        "unknown field '{name}'; the fields are {}",
                        GenerateRequest::FIELDS.join(", ")
                    ),
                )))
            }
        }
    }
    Ok((r, ids))
}

/// A request given as a dict, as keywords, or both (a field given twice is an error).
pub fn from_parts(
    py: Python<'_>,
    request: Option<&Bound<'_, PyDict>>,
    keywords: Option<&Bound<'_, PyDict>>,
) -> PyResult<GenerateRequest> {
    let merged = match request {
        Some(d) => d.copy()?,
        None => PyDict::new(py),
    };
    if let Some(k) = keywords {
        for (key, value) in k.iter() {
            if merged.contains(&key)? {
                return Err(to_py_err(Error::invalid(
                    "request",
                    format!("{key} is given both in the request and as a keyword; give it once"),
                )));
            }
            merged.set_item(key, value)?;
        }
    }
    Ok(from_dict(&merged, false)?.0)
}

/// `value` as a `T`, or an error naming the field and what it takes.
fn field<'py, T: FromPyObjectOwned<'py>>(
    name: &str,
    value: &Bound<'py, PyAny>,
    expected: &str,
) -> PyResult<T> {
    value.extract().map_err(|_| {
        to_py_err(Error::invalid(
            name,
            format!("{}; expected {expected}", repr(value)),
        ))
    })
}

fn repr(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "a value".into())
}

/// Check a request's values as far as no model is needed (`SamplingParams` does at
/// construction): an `InvalidArgumentError` naming the first bad one.
#[pyfunction]
pub fn check_request(request: &Bound<'_, PyDict>) -> PyResult<()> {
    let (r, _) = from_dict(request, false)?;
    r.check().map_err(to_py_err)
}

/// The fields a request dict may hold, in `GenerateRequest`'s order.
#[pyfunction]
pub fn request_fields() -> Vec<&'static str> {
    GenerateRequest::FIELDS.to_vec()
}
