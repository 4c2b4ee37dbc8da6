//! Bindings for the kernel dispatch (which path runs, forcing one) and a test entry point that
//! runs one dequant-matmul, so the kernels can be checked against numpy.

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray2, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;

use crate::error::Error;
use crate::python::run;
use crate::quant::kernels::{self, KernelPath};
use crate::quant::{QMatrix, QuantFormat};

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

/// `Y[S, O] = X[S, I] · Wᵀ` for a packed weight (`format` as in container metadata, e.g.
/// "int4_g64"), on `path` (None: the selected path). For tests against numpy.
#[pyfunction]
#[pyo3(signature = (format, rows, cols, data, scales, x, path=None, threads=1))]
#[allow(clippy::too_many_arguments)]
fn _matmul<'py>(
    py: Python<'py>,
    format: &str,
    rows: usize,
    cols: usize,
    data: PyReadonlyArray1<'py, u8>,
    scales: PyReadonlyArray1<'py, f32>,
    x: PyReadonlyArray2<'py, f32>,
    path: Option<String>,
    threads: usize,
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let format = format.to_owned();
    let data: Vec<u8> = data.as_array().iter().copied().collect();
    let scales: Vec<f32> = scales.as_array().iter().copied().collect();
    let (s, xc) = x.as_array().dim();
    let xv: Vec<f32> = x.as_array().iter().copied().collect();
    let arr = run(py, move || {
        let f = QuantFormat::parse(&format)?;
        let w = QMatrix::new(f, rows, cols, &data, &scales)?;
        if xc != cols {
            return Err(Error::invalid(
                "x",
                format!("x has {xc} columns, the weight {cols}"),
            ));
        }
        let path = match path {
            Some(p) => KernelPath::parse(&p)?,
            None => kernels::active_path()?,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads.max(1))
            .build()
            .map_err(|e| Error::Internal(e.to_string()))?;
        let mut y = vec![0.0f32; s * rows];
        kernels::matmul_with(path, &w, &xv, s, &mut y, Some(&pool))?;
        Array2::from_shape_vec((s, rows), y).map_err(|e| Error::Internal(e.to_string()))
    })?;
    Ok(arr.into_pyarray(py))
}

pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(kernel_path, m)?)?;
    m.add_function(wrap_pyfunction!(kernel_paths, m)?)?;
    m.add_function(wrap_pyfunction!(set_kernel_path, m)?)?;
    m.add_function(wrap_pyfunction!(_matmul, m)?)?;
    Ok(())
}
