//! Routed experts in other processes (`colibri.distributed`): the head's side, a Python object
//! as the engine's [`RemoteExperts`] (`Engine.set_remote_experts`), and the worker's side,
//! [`PyExpertShard`], a shard of a container's routed experts resident in this process that
//! runs them with the engine's own kernels (`ExpertShard.run`).

use std::collections::{HashMap, HashSet};
use std::path::PathBuf;
use std::sync::Arc;

use numpy::{
    IntoPyArray, PyArray1, PyArrayMethods, PyReadonlyArray1, PyReadonlyArray2,
    PyUntypedArrayMethods,
};
use pyo3::prelude::*;

use crate::container::{Container, Weight};
use crate::error::{Error, Result};
use crate::model::linear;
use crate::model::remote::{ExpertRows, RemoteExperts, RemoteOutputs, RemotePending};
use crate::python::{run, to_py_err};
use crate::quant::kernels::{self, Arithmetic};

/// A Python object with `submit(layer, arithmetic, h, want) -> (ticket, taken) | None` and
/// `collect(ticket) -> [(expert, y)]` (`colibri.distributed.RayExperts`), and the experts it
/// holds (for the prefetcher). Its errors never reach the forward: a failed submit takes
/// nothing, a failed collect answers nothing, and the experts run locally.
pub struct PyRemote {
    obj: Py<PyAny>,
    held: HashSet<(usize, usize)>,
}

impl PyRemote {
    pub fn new(obj: Py<PyAny>, held: Vec<(usize, usize)>) -> Self {
        PyRemote {
            obj,
            held: held.into_iter().collect(),
        }
    }
}

/// A submitted layer: the Python ticket and the experts it took.
struct PyPending {
    obj: Py<PyAny>,
    ticket: Py<PyAny>,
    taken: Vec<usize>,
}

/// Say a remote call's error (once per message) and go on without it.
fn report(what: &str, err: &PyErr) {
    let msg = format!("remote experts: {what} failed ({err}); those experts run locally");
    crate::diagnostics::warn_once(&msg, &msg);
}

impl RemoteExperts for PyRemote {
    fn submit(
        &self,
        layer: usize,
        arith: Arithmetic,
        h: &[f32],
        s: usize,
        want: &[ExpertRows],
    ) -> Option<Box<dyn RemotePending>> {
        let hidden = h.len() / s.max(1);
        Python::attach(|py| {
            let outcome = (|| -> PyResult<Option<(Py<PyAny>, Vec<usize>)>> {
                let x = h.to_vec().into_pyarray(py).reshape([s, hidden])?;
                let want: Vec<(usize, Vec<usize>)> =
                    want.iter().map(|w| (w.expert, w.rows.clone())).collect();
                let got = self
                    .obj
                    .call_method1(py, "submit", (layer, arith.name(), x, want))?;
                got.extract(py)
            })();
            match outcome {
                Ok(Some((ticket, taken))) => Some(Box::new(PyPending {
                    obj: self.obj.clone_ref(py),
                    ticket,
                    taken,
                }) as Box<dyn RemotePending>),
                Ok(None) => None,
                Err(e) => {
                    report("submit", &e);
                    None
                }
            }
        })
    }

    fn holds(&self, layer: usize, id: usize) -> bool {
        self.held.contains(&(layer, id))
    }
}

impl RemotePending for PyPending {
    fn taken(&self) -> &[usize] {
        &self.taken
    }

    fn collect(self: Box<Self>) -> RemoteOutputs {
        Python::attach(|py| {
            let outcome = (|| -> PyResult<Vec<(usize, Vec<f32>)>> {
                let got = self.obj.call_method1(py, "collect", (&self.ticket,))?;
                let rows: Vec<(usize, PyReadonlyArray1<'_, f32>)> = got.extract(py)?;
                Ok(rows
                    .into_iter()
                    .map(|(id, y)| (id, y.as_array().iter().copied().collect()))
                    .collect())
            })();
            match outcome {
                Ok(done) => RemoteOutputs { done },
                Err(e) => {
                    report("collect", &e);
                    RemoteOutputs::default()
                }
            }
        })
    }
}

/// Part of a container's routed experts, resident in this process's RAM, run on request with
/// the engine's kernels (a worker's side of `colibri.distributed`).
#[pyclass(name = "ExpertShard", module = "colibri._core", frozen)]
pub struct PyExpertShard {
    experts: HashMap<(usize, usize), [Weight; 3]>,
    held: Vec<(usize, usize)>,
    hidden: usize,
    nbytes: u64,
    pool: rayon::ThreadPool,
}

/// Load experts `held` (`(layer, expert)`) of the container at `path`.
fn load_shard(
    path: &std::path::Path,
    held: &[(usize, usize)],
    threads: usize,
) -> Result<PyExpertShard> {
    let c = Arc::new(Container::open(path)?);
    let cfg = c.config();
    let h = cfg.hidden_size;
    let mtp = cfg.mtp_layer_index();
    let mut experts = HashMap::with_capacity(held.len());
    let mut nbytes = 0u64;
    for &(l, e) in held {
        let routed = l < cfg.num_hidden_layers && cfg.is_moe_layer(l) || Some(l) == mtp;
        if !routed || e >= cfg.n_routed_experts {
            return Err(Error::invalid(
                "experts",
                format!(
                    "({l}, {e}): the model has no routed expert {e} in layer {l} ({} routed \
                     experts per MoE layer)",
                    cfg.n_routed_experts
                ),
            ));
        }
        let mi = cfg.moe_intermediate(l);
        let p = format!("model.layers.{l}.mlp.experts.{e}");
        let w = [
            linear::load(&c, &format!("{p}.gate_proj.weight"), mi, h)?,
            linear::load(&c, &format!("{p}.up_proj.weight"), mi, h)?,
            linear::load(&c, &format!("{p}.down_proj.weight"), h, mi)?,
        ];
        nbytes += w.iter().map(|w| w.nbytes() as u64).sum::<u64>();
        experts.insert((l, e), w);
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .thread_name(|i| format!("colibri-experts-{i}"))
        .build()
        .map_err(|e| Error::Internal(format!("cannot start the compute pool: {e}")))?;
    let mut held = held.to_vec();
    held.sort_unstable();
    held.dedup();
    Ok(PyExpertShard {
        experts,
        held,
        hidden: h,
        nbytes,
        pool,
    })
}

impl PyExpertShard {
    /// Each of `want`'s experts on its rows of `h` (`[s, hidden]`), in `arith`, as the MoE
    /// runs them (one batch through `experts_ffn_in`); unweighted, `[rows, hidden]` each.
    fn compute(
        &self,
        layer: usize,
        arith: Arithmetic,
        h: &[f32],
        s: usize,
        want: &[(usize, Vec<usize>)],
    ) -> Result<Vec<Vec<f32>>> {
        let hidden = self.hidden;
        if h.len() != s * hidden {
            return Err(Error::invalid(
                "h",
                format!("{} values for {s} rows of {hidden}", h.len()),
            ));
        }
        let mut views = Vec::with_capacity(want.len());
        let mut xs = Vec::with_capacity(want.len());
        for (e, rows) in want {
            let w = self.experts.get(&(layer, *e)).ok_or_else(|| {
                Error::invalid(
                    "want",
                    format!("expert {e} of layer {layer} is not held here"),
                )
            })?;
            let mut x = Vec::with_capacity(rows.len() * hidden);
            for &r in rows {
                if r >= s {
                    return Err(Error::invalid("want", format!("row {r} of {s}")));
                }
                x.extend_from_slice(&h[r * hidden..(r + 1) * hidden]);
            }
            views.push(w);
            xs.push(x);
        }
        let calls: Vec<kernels::ExpertCall<'_>> = views
            .iter()
            .zip(&xs)
            .zip(want)
            .map(|((w, x), (_, rows))| {
                let [g, u, d] = w.each_ref().map(Weight::view);
                kernels::ExpertCall::new(&g, &u, &d, x, rows.len())
            })
            .collect();
        let mut ys: Vec<Vec<f32>> = calls.iter().map(|c| vec![0.0f32; c.s * hidden]).collect();
        let mut outs: Vec<&mut [f32]> = ys.iter_mut().map(|y| &mut y[..]).collect();
        kernels::experts_ffn_in(arith, &calls, &mut outs, Some(&self.pool))?;
        Ok(ys)
    }
}

fn parse_arith(name: &str) -> Result<Arithmetic> {
    match name {
        "exact" => Ok(Arithmetic::Exact),
        "int8" => Ok(Arithmetic::Int8),
        other => Err(Error::invalid(
            "arithmetic",
            format!("{other:?}; expected 'exact' or 'int8'"),
        )),
    }
}

#[pymethods]
impl PyExpertShard {
    /// Load routed experts `experts` (`(layer, expert)` pairs) of the container at `path`
    /// into this process's RAM; they run on `threads` threads (0: one per core).
    #[new]
    #[pyo3(signature = (path, experts, *, threads=0))]
    fn new(
        py: Python<'_>,
        path: PathBuf,
        experts: Vec<(usize, usize)>,
        threads: usize,
    ) -> PyResult<Self> {
        run(py, || load_shard(&path, &experts, threads))
    }

    /// Run experts of `layer` on rows of `h` (float32 `[s, hidden]`): `want` is a list of
    /// `(expert, rows)`; returns `[(expert, y)]`, y float32 `[len(rows) * hidden]` (unweighted),
    /// in `arithmetic` ("exact" or "int8", the head's).
    fn run<'py>(
        &self,
        py: Python<'py>,
        layer: usize,
        arithmetic: &str,
        h: PyReadonlyArray2<'py, f32>,
        want: Vec<(usize, Vec<usize>)>,
    ) -> PyResult<Vec<(usize, Bound<'py, PyArray1<f32>>)>> {
        let arith = parse_arith(arithmetic).map_err(to_py_err)?;
        let s = h.shape()[0];
        let x: Vec<f32> = h.as_array().iter().copied().collect();
        let ys = run(py, || self.compute(layer, arith, &x, s, &want))?;
        Ok(want
            .iter()
            .zip(ys)
            .map(|((e, _), y)| (*e, y.into_pyarray(py)))
            .collect())
    }

    /// The `(layer, expert)` pairs held, sorted.
    #[getter]
    fn experts(&self) -> Vec<(usize, usize)> {
        self.held.clone()
    }

    /// Bytes of expert weights held.
    #[getter]
    fn nbytes(&self) -> u64 {
        self.nbytes
    }

    /// The model's hidden size (the width of every row).
    #[getter]
    fn hidden_size(&self) -> usize {
        self.hidden
    }
}

pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyExpertShard>()
}
