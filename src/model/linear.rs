//! A weight matrix from the container applied to S activation rows through the kernels, in
//! the arithmetic of the forward running on this thread.

use std::cell::Cell;

use crate::container::{Container, Weight};
use crate::error::{Error, Result};
use crate::quant::kernels::{self, Arithmetic};

thread_local! {
    /// The arithmetic of the forward this thread is running ([`with_arithmetic`]).
    static ARITHMETIC: Cell<Arithmetic> = const { Cell::new(Arithmetic::Exact) };
}

/// Restores the previous arithmetic when dropped (also when `f` unwinds).
struct Restore(Arithmetic);

impl Drop for Restore {
    fn drop(&mut self) {
        ARITHMETIC.with(|a| a.set(self.0));
    }
}

/// Run `f` (a whole forward) with the matmuls it makes on this thread through [`apply`] and
/// `moe::ffn` in `arith`. Per thread, and set by the forward's own thread, so a forward
/// decides its arithmetic once and nothing else is affected. Code that runs inside pool tasks
/// (the attention heads) calls the kernels directly, always exactly: a task may run on this
/// thread while it waits, and must compute the same whichever thread runs it.
pub fn with_arithmetic<R>(arith: Arithmetic, f: impl FnOnce() -> R) -> R {
    let _restore = Restore(ARITHMETIC.with(|a| a.replace(arith)));
    f()
}

thread_local! {
    /// Whether the forward this thread is running may change the attention's form by its row
    /// count ([`with_row_dependent_attention`]).
    static ROW_DEPENDENT_ATTENTION: Cell<bool> = const { Cell::new(false) };
}

/// Run `f` (a prefill forward) with attention allowed to take the decompressed form where it
/// is faster for the rows at hand (`mla_decompressed::pays`). That form sums in another order,
/// so a row's values then depend on its chunk: only the legacy `prefill="int8"` with
/// `decode="exact"` allows it. Restored when `f` returns or unwinds.
pub fn with_row_dependent_attention<R>(f: impl FnOnce() -> R) -> R {
    struct Back(bool);
    impl Drop for Back {
        fn drop(&mut self) {
            ROW_DEPENDENT_ATTENTION.with(|a| a.set(self.0));
        }
    }
    let _back = Back(ROW_DEPENDENT_ATTENTION.with(|a| a.replace(true)));
    f()
}

/// Whether [`with_row_dependent_attention`] is in force on this thread.
pub fn row_dependent_attention() -> bool {
    ROW_DEPENDENT_ATTENTION.with(|a| a.get())
}

/// The arithmetic [`apply`] uses on this thread now.
pub fn arithmetic() -> Arithmetic {
    ARITHMETIC.with(|a| a.get())
}

/// `y[S, O] = x[S, I] · Wᵀ` through the dispatched kernel, in this thread's [`arithmetic`].
pub fn apply(
    w: &Weight,
    x: &[f32],
    s: usize,
    pool: Option<&rayon::ThreadPool>,
) -> Result<Vec<f32>> {
    let v = w.view();
    let mut y = vec![0.0f32; s * v.rows()];
    kernels::matmul_in(arithmetic(), &v, x, s, &mut y, pool)?;
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
