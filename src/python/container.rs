//! Bindings for the container reader (`Container`), the parsed config (`model_config`), the
//! converter (`ConvertJob`) and the FP8 decoder (for tests against an independent numpy
//! implementation).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};

use numpy::ndarray::Array2;
use numpy::{IntoPyArray, PyArray1, PyArray2, PyReadonlyArray1, PyReadonlyArray2};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::config::ModelConfig;
use crate::container::{expected_shape, Container};
use crate::convert::{fp8, plan, ConvertOptions, Plan, ShardStatus};
use crate::error::Error;
use crate::python::run;

/// An opened model directory (headers parsed; tensors are read when asked for).
#[pyclass(name = "Container", module = "colibri._core", frozen)]
pub struct PyContainer {
    inner: Arc<Container>,
}

#[pymethods]
impl PyContainer {
    #[new]
    fn new(py: Python<'_>, path: PathBuf) -> PyResult<Self> {
        let inner = run(py, move || Container::open(&path))?;
        Ok(PyContainer {
            inner: Arc::new(inner),
        })
    }

    /// The model directory.
    #[getter]
    fn dir(&self) -> PathBuf {
        self.inner.dir().to_path_buf()
    }

    /// `model_type` of the config.
    #[getter]
    fn family(&self) -> &'static str {
        self.inner.config().family.model_type()
    }

    /// KV-cache bytes per token of a model opened from this directory: latents and roped
    /// keys, GLM DSA indexer keys when the checkpoint has indexers, and the MTP layer's row
    /// when `mtp_loaded` and the checkpoint has one.
    #[pyo3(signature = (mtp_loaded=true))]
    fn kv_bytes_per_token(&self, mtp_loaded: bool) -> usize {
        use crate::model::forward::{has_mtp_head, uses_dsa};
        let mtp = mtp_loaded && has_mtp_head(&self.inner);
        self.inner
            .config()
            .kv_bytes_per_token(uses_dsa(&self.inner), mtp)
    }

    /// Every tensor name (scales included) in shard and offset order.
    fn names(&self) -> Vec<String> {
        self.inner.names().map(str::to_owned).collect()
    }

    fn __len__(&self) -> usize {
        self.inner.names().count()
    }

    fn __contains__(&self, name: &str) -> bool {
        self.inner.contains(name)
    }

    /// Facts about one tensor: dtype, shape, file, byte range, and for weights their format
    /// and logical [O, I].
    fn info<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyDict>> {
        let name = name.to_owned();
        let c = self.inner.clone();
        let t = run(py, move || c.info(&name).cloned())?;
        let d = PyDict::new(py);
        d.set_item("name", &t.name)?;
        d.set_item("dtype", t.dtype.name())?;
        d.set_item("shape", t.shape.clone())?;
        d.set_item("file", t.file.clone())?;
        d.set_item("start", t.range.start)?;
        d.set_item("end", t.range.end)?;
        d.set_item("format", t.format.map(|f| f.name()))?;
        d.set_item("logical_shape", t.logical)?;
        Ok(d)
    }

    /// The weight's format name ("int4_g64", "int8", "bf16", ...), or None for tensors that
    /// are not 2-D weights.
    fn format(&self, py: Python<'_>, name: &str) -> PyResult<Option<String>> {
        let name = name.to_owned();
        let c = self.inner.clone();
        run(py, move || Ok(c.info(&name)?.format.map(|f| f.name())))
    }

    /// The logical [O, I] the config gives this tensor name, if it is a known 2-D weight.
    fn expected_shape(&self, name: &str) -> Option<(usize, usize)> {
        expected_shape(self.inner.config(), name)
    }

    /// A 2-D weight dequantised to float32 [O, I] (reference dequantiser).
    fn dequantize<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyArray2<f32>>> {
        let name = name.to_owned();
        let c = self.inner.clone();
        let arr = run(py, move || {
            let w = c.weight(&name)?;
            Array2::from_shape_vec((w.rows(), w.cols()), w.to_f32())
                .map_err(|e| Error::Internal(e.to_string()))
        })?;
        Ok(arr.into_pyarray(py))
    }

    /// A 1-D F32/BF16/F16 tensor as float32.
    fn vector<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyArray1<f32>>> {
        let name = name.to_owned();
        let c = self.inner.clone();
        let v = run(py, move || c.vector(&name))?;
        Ok(PyArray1::from_vec(py, v))
    }

    /// Why a forward produced a non-finite value, from a bounded scan of the stored floats
    /// (see `Container::diagnose_non_finite`).
    #[pyo3(signature = (max_bytes=4 << 30))]
    fn diagnose_non_finite(&self, py: Python<'_>, max_bytes: u64) -> String {
        let c = self.inner.clone();
        py.detach(move || c.diagnose_non_finite(max_bytes))
    }

    /// The raw stored bytes of a tensor.
    fn raw<'py>(&self, py: Python<'py>, name: &str) -> PyResult<Bound<'py, PyBytes>> {
        let name = name.to_owned();
        let c = self.inner.clone();
        let v = run(py, move || c.bytes(&name))?;
        Ok(PyBytes::new(py, &v))
    }
}

/// A planned conversion (see `colibri.convert`). Shards are written one call at a time so
/// Python can show progress and stop between them.
#[pyclass(name = "ConvertJob", module = "colibri._core", frozen)]
pub struct PyConvertJob {
    plan: Plan,
}

#[pymethods]
impl PyConvertJob {
    #[new]
    #[pyo3(signature = (src, dst, *, expert_bits=4, group_size=64, dense_bits=4, mtp_bits=8,
                        embed_bits=8, lm_head_bits=8, indexer_bits=8,
                        max_shard_bytes=4 << 30, chunk_bytes=64 << 20))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        src: PathBuf,
        dst: PathBuf,
        expert_bits: u32,
        group_size: usize,
        dense_bits: u32,
        mtp_bits: u32,
        embed_bits: u32,
        lm_head_bits: u32,
        indexer_bits: u32,
        max_shard_bytes: u64,
        chunk_bytes: usize,
    ) -> PyResult<Self> {
        let options = ConvertOptions {
            expert_bits,
            dense_bits,
            mtp_bits,
            embed_bits,
            lm_head_bits,
            indexer_bits,
            group_size,
            max_shard_bytes,
            chunk_bytes,
        };
        let plan = run(py, move || plan(&src, &dst, &options))?;
        Ok(PyConvertJob { plan })
    }

    /// (file name, total bytes) of every planned output shard.
    fn shards(&self) -> Vec<(String, u64)> {
        self.plan
            .shards
            .iter()
            .map(|s| (s.file_name.clone(), s.total_bytes))
            .collect()
    }

    /// Whether shard `i` already exists complete in DST, made from the sources as they are
    /// now (it will be skipped).
    fn is_done(&self, py: Python<'_>, i: usize) -> PyResult<bool> {
        let plan = &self.plan;
        run(py, move || plan.is_done(i))
    }

    /// (done, why): whether shard `i` will be skipped, and, for a finished shard made from
    /// source contents that have changed since, why it will be converted again.
    fn status(&self, py: Python<'_>, i: usize) -> PyResult<(bool, Option<String>)> {
        let plan = &self.plan;
        run(py, move || {
            Ok(match plan.status(i)? {
                ShardStatus::Done => (true, None),
                ShardStatus::Missing => (false, None),
                ShardStatus::Stale(why) => (false, Some(why)),
            })
        })
    }

    /// Write shard `i`; `progress(n_bytes)` is called after each tensor (with the GIL).
    /// Ctrl-C (or an exception from `progress`) stops the write; the partial file is left
    /// under a temporary name and never mistaken for a finished shard.
    #[pyo3(signature = (i, progress=None))]
    fn write_shard(&self, py: Python<'_>, i: usize, progress: Option<Py<PyAny>>) -> PyResult<()> {
        let plan = &self.plan;
        let raised: Mutex<Option<PyErr>> = Mutex::new(None);
        let result = run(py, || {
            plan.write_shard(i, &mut |n| {
                Python::attach(|py| {
                    let r = py.check_signals().and_then(|_| match &progress {
                        Some(cb) => cb.call1(py, (n,)).map(|_| ()),
                        None => Ok(()),
                    });
                    r.map_err(|e| {
                        if let Ok(mut slot) = raised.lock() {
                            *slot = Some(e);
                        }
                        Error::Cancelled
                    })
                })
            })
        });
        if let Some(e) = raised.lock().ok().and_then(|mut s| s.take()) {
            return Err(e);
        }
        result
    }

    /// Copy tokenizer/sidecar files, write config.json, and check the output opens.
    fn finish(&self, py: Python<'_>) -> PyResult<()> {
        let plan = &self.plan;
        run(py, move || plan.finish())
    }

    /// Output tensors per format name.
    fn format_counts(&self) -> std::collections::BTreeMap<String, usize> {
        self.plan.format_counts()
    }
}

/// Decode FP8 e4m3fn bytes to float32.
#[pyfunction]
fn decode_fp8_e4m3<'py>(
    py: Python<'py>,
    raw: PyReadonlyArray1<'py, u8>,
) -> PyResult<Bound<'py, PyArray1<f32>>> {
    let table = fp8::e4m3_table();
    let v: Vec<f32> = raw.as_array().iter().map(|b| table[*b as usize]).collect();
    Ok(PyArray1::from_vec(py, v))
}

/// Dequantise an FP8 e4m3 weight [O, I] with block scales `scale_inv`
/// [ceil(O/bo), ceil(I/bi)]: w = fp8 · scale_inv[o/bo, i/bi] (the converter's decoder).
#[pyfunction]
#[pyo3(signature = (raw, scale_inv, block=(128, 128)))]
fn dequant_fp8_blocks<'py>(
    py: Python<'py>,
    raw: PyReadonlyArray2<'py, u8>,
    scale_inv: PyReadonlyArray2<'py, f32>,
    block: (usize, usize),
) -> PyResult<Bound<'py, PyArray2<f32>>> {
    let (rows, cols) = raw.as_array().dim();
    let (so, si) = scale_inv.as_array().dim();
    let raw_v: Vec<u8> = raw.as_array().iter().copied().collect();
    let s_v: Vec<f32> = scale_inv.as_array().iter().copied().collect();
    let arr = run(py, move || {
        if block.0 == 0 || block.1 == 0 {
            return Err(Error::invalid("block", "block sizes must be > 0"));
        }
        if (so, si) != (rows.div_ceil(block.0), cols.div_ceil(block.1)) {
            return Err(Error::invalid(
                "scale_inv",
                format!(
                    "shape ({so}, {si}) does not match a ({rows}, {cols}) weight with {}×{} blocks",
                    block.0, block.1
                ),
            ));
        }
        let mut out = vec![0.0f32; rows * cols];
        if cols > 0 {
            fp8::dequant_block_rows(&fp8::e4m3_table(), &raw_v, 0, cols, &s_v, block, &mut out);
        }
        Array2::from_shape_vec((rows, cols), out).map_err(|e| Error::Internal(e.to_string()))
    })?;
    Ok(arr.into_pyarray(py))
}

/// The model's `config.json` as the engine reads it (`ModelConfig`: aliases resolved, family
/// defaults filled in, validated): the fields the Python package reads, by their
/// transformers names, so that no field is read from the JSON a second way.
#[pyfunction]
fn model_config(py: Python<'_>, dir: PathBuf) -> PyResult<Bound<'_, PyDict>> {
    let c = run(py, move || ModelConfig::from_file(dir.join("config.json")))?;
    let sizes = [
        ("vocab_size", c.vocab_size),
        ("hidden_size", c.hidden_size),
        ("intermediate_size", c.intermediate_size),
        ("moe_intermediate_size", c.moe_intermediate_size),
        ("num_hidden_layers", c.num_hidden_layers),
        ("num_attention_heads", c.num_attention_heads),
        ("kv_lora_rank", c.kv_lora_rank),
        ("qk_nope_head_dim", c.qk_nope_head_dim),
        ("qk_rope_head_dim", c.qk_rope_head_dim),
        ("v_head_dim", c.v_head_dim),
        ("n_routed_experts", c.n_routed_experts),
        ("num_experts_per_tok", c.num_experts_per_tok),
        ("n_shared_experts", c.n_shared_experts),
        ("first_k_dense_replace", c.first_k_dense_replace),
        ("max_position_embeddings", c.max_position_embeddings),
        ("num_nextn_predict_layers", c.num_nextn_predict_layers),
    ];
    let d = PyDict::new(py);
    d.set_item("model_type", c.family.model_type())?;
    for (name, value) in sizes {
        d.set_item(name, value)?;
    }
    for (name, value) in [("q_lora_rank", c.q_lora_rank), ("index_topk", c.index_topk)] {
        d.set_item(name, value)?;
    }
    d.set_item("tie_word_embeddings", c.tie_word_embeddings)?;
    d.set_item("eos_token_ids", c.eos_token_ids)?;
    Ok(d)
}

/// Register this module's classes and functions in `colibri._core`.
pub(crate) fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<PyContainer>()?;
    m.add_class::<PyConvertJob>()?;
    m.add_function(wrap_pyfunction!(model_config, m)?)?;
    m.add_function(wrap_pyfunction!(decode_fp8_e4m3, m)?)?;
    m.add_function(wrap_pyfunction!(dequant_fp8_blocks, m)?)?;
    Ok(())
}
