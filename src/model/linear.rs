//! A weight matrix from the container applied to S activation rows through the kernels.

use crate::container::{Container, Weight};
use crate::error::{Error, Result};
use crate::quant::kernels;

/// `y[S, O] = x[S, I] · Wᵀ` through the dispatched kernel.
pub fn apply(
    w: &Weight,
    x: &[f32],
    s: usize,
    pool: Option<&rayon::ThreadPool>,
) -> Result<Vec<f32>> {
    let v = w.view();
    let mut y = vec![0.0f32; s * v.rows()];
    kernels::matmul(&v, x, s, &mut y, pool)?;
    Ok(y)
}

/// Load a 2-D weight and check its logical shape against what the model code expects.
pub fn load(c: &Container, name: &str, rows: usize, cols: usize) -> Result<Weight> {
    let w = c.weight(name)?;
    if w.rows() != rows || w.cols() != cols {
        return Err(Error::container(
            c.dir().join("*.safetensors"),
            Some(name),
            format!(
                "has logical shape [{}, {}] but the config implies [{rows}, {cols}]",
                w.rows(),
                w.cols()
            ),
        ));
    }
    Ok(w)
}

/// Load a 1-D f32 vector (norm weight, bias) of the expected length.
pub fn load_vector(c: &Container, name: &str, len: usize) -> Result<Vec<f32>> {
    let v = c.vector(name)?;
    if v.len() != len {
        return Err(Error::container(
            c.dir().join("*.safetensors"),
            Some(name),
            format!("has {} values but the config implies {len}", v.len()),
        ));
    }
    Ok(v)
}
