//! A generation request from a Python dict: each value converted by its Python type alone
//! ([`FieldValue`]) and set on the [`GenerateRequest`] by name, which knows the fields.

use pyo3::prelude::*;
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};

use crate::decode::request::{FieldValue, GenerateRequest};
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
            let prompt = value
                .extract()
                .map_err(|_| to_py_err(Error::invalid("ids", "expected a list of token ids")))?;
            ids = Some(prompt);
            continue;
        }
        let v = field_value(&name, &value)?;
        r.set(&name, &v).map_err(to_py_err)?;
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

/// `value` by its Python type: None, bool, int, float (numpy's too, through `__float__`
/// and `__index__`), str, or a list/tuple of those.
fn field_value(name: &str, value: &Bound<'_, PyAny>) -> PyResult<FieldValue> {
    if value.is_none() {
        return Ok(FieldValue::None);
    }
    if value.is_instance_of::<PyBool>() {
        return Ok(FieldValue::Bool(value.extract()?));
    }
    if value.is_instance_of::<PyInt>() {
        return match value.extract::<i128>() {
            Ok(i) => Ok(FieldValue::Int(i)),
            Err(_) => Err(to_py_err(Error::invalid(
                name,
                format!("{value} is too large"),
            ))),
        };
    }
    if value.is_instance_of::<PyFloat>() {
        return Ok(FieldValue::Float(value.extract()?));
    }
    if value.is_instance_of::<PyString>() {
        return Ok(FieldValue::Str(value.extract()?));
    }
    if value.is_instance_of::<PyList>() || value.is_instance_of::<PyTuple>() {
        let items = value
            .try_iter()?
            .map(|item| field_value(name, &item?))
            .collect::<PyResult<Vec<_>>>()?;
        return Ok(FieldValue::List(items));
    }
    if let Ok(i) = value
        .call_method0("__index__")
        .and_then(|i| i.extract::<i128>())
    {
        return Ok(FieldValue::Int(i)); // numpy integers
    }
    if value.hasattr("__float__")? {
        return Ok(FieldValue::Float(
            value.call_method0("__float__")?.extract()?,
        ));
    }
    Err(to_py_err(Error::invalid(
        name,
        format!(
            "{}: a {} is not a request value",
            repr(value),
            type_name(value)
        ),
    )))
}

fn repr(value: &Bound<'_, PyAny>) -> String {
    value
        .repr()
        .map(|r| r.to_string())
        .unwrap_or_else(|_| "a value".into())
}

fn type_name(value: &Bound<'_, PyAny>) -> String {
    value
        .get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "value".into())
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
