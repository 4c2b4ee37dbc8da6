//! A model directory: `config.json` plus `*.safetensors` shards (docs/container.md). Opening it
//! parses every shard header (headers only: the data stays on disk), indexes the tensors,
//! and resolves each quantised weight's format from its byte counts against the config's
//! logical shape, cross-checked with the `__metadata__` our writer records. A weight is read
//! (`pread`) into owned memory when it is loaded and its floats are checked then (NaN, Inf,
//! implausible magnitudes are an error naming the tensor), so a shard that changes while a
//! model runs can fail a load but never fault the process.
//!
//! Layout of a quantised weight `NAME`: a 1-D `U8` tensor of packed bytes and `NAME.qs`, a
//! 1-D `F32` tensor of scales. Float weights (F32/BF16/F16, any 2-D shape) are accepted too.

pub mod finite;
pub mod names;
pub mod safetensors;
pub mod shard;

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::quant::format::{QMatrix, QuantFormat};

pub use names::{
    classify, expected_len, expected_names, expected_shape, expert_tensor_name, Proj, Role,
    TensorRole,
};
pub use safetensors::Dtype;
pub use shard::ShardFile;

/// Suffix of the scales tensor of a quantised weight.
pub const SCALES_SUFFIX: &str = ".qs";
/// `__metadata__` key with the container format version our writer records.
pub const FORMAT_VERSION_KEY: &str = "colibri_format_version";
/// The container format version this build writes and reads.
pub const FORMAT_VERSION: &str = "1";

/// One tensor of the container.
#[derive(Debug, Clone)]
pub struct TensorInfo {
    pub name: String,
    pub dtype: Dtype,
    pub shape: Vec<usize>,
    /// Index into the container's shard list.
    pub shard: usize,
    /// The shard file.
    pub file: PathBuf,
    /// Absolute byte range in the file.
    pub range: Range<usize>,
    /// The resolved weight format, for quantised weights (U8 + `.qs`) and 2-D float weights.
    pub format: Option<QuantFormat>,
    /// Logical [O, I] for weights whose `format` is set.
    pub logical: Option<(usize, usize)>,
}

impl TensorInfo {
    pub fn nbytes(&self) -> usize {
        self.range.len()
    }
}

/// A 2-D weight in any format, in owned memory; cheap to clone (its storage is shared),
/// `Send + Sync`.
#[derive(Clone)]
pub struct Weight {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    data: Arc<Vec<u8>>,
    /// f32 scales (empty for float formats).
    scales: Arc<Vec<f32>>,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weight")
            .field("format", &self.format)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl Weight {
    /// An owned weight (e.g. freshly quantised), validated like a mapped one.
    pub fn from_owned(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
        scales: Vec<f32>,
    ) -> Result<Self> {
        QMatrix::new(format, rows, cols, &data, &scales)?;
        Ok(Weight {
            format,
            rows,
            cols,
            data: Arc::new(data),
            scales: Arc::new(scales),
        })
    }

    /// The borrowed matrix the kernels take.
    pub fn view(&self) -> QMatrix<'_> {
        QMatrix::new(self.format, self.rows, self.cols, &self.data, &self.scales)
            .expect("Weight lengths are validated when it is built")
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }
    /// O: output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// I: input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes of data plus scales.
    pub fn nbytes(&self) -> usize {
        self.data.len() + 4 * self.scales.len()
    }
    /// Dequantise to row-major f32 [rows, cols] (reference path).
    pub fn to_f32(&self) -> Vec<f32> {
        crate::quant::pack::dequantize(&self.view())
    }
}

/// An opened model directory. `Send + Sync`; share it behind an `Arc`.
#[derive(Debug)]
pub struct Container {
    dir: PathBuf,
    config: ModelConfig,
    shards: Vec<Arc<ShardFile>>,
    tensors: HashMap<String, TensorInfo>,
    /// Names in (shard, offset) order.
    order: Vec<String>,
    /// Shard `__metadata__` maps.
    metadata: Vec<BTreeMap<String, String>>,
    /// Told of every resident tensor read while a model loads ([`Container::report_loads`]).
    load_progress: std::sync::Mutex<Option<LoadCounter>>,
}

/// Called with (bytes read, bytes to read) while a model loads its resident weights;
/// returning false stops the load with [`Error::Cancelled`].
pub type LoadReport = std::sync::Arc<dyn Fn(u64, u64) -> bool + Send + Sync>;

struct LoadCounter {
    done: u64,
    total: u64,
    report: LoadReport,
}

impl std::fmt::Debug for LoadCounter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "LoadCounter({} of {} bytes)", self.done, self.total)
    }
}

/// The `*.safetensors` files of `dir`, sorted by name.
pub fn shard_paths(dir: &Path) -> Result<Vec<PathBuf>> {
    let rd = std::fs::read_dir(dir).map_err(|e| Error::io(dir, e))?;
    let mut out = Vec::new();
    for entry in rd {
        let entry = entry.map_err(|e| Error::io(dir, e))?;
        let p = entry.path();
        if p.extension().is_some_and(|e| e == "safetensors") && p.is_file() {
            out.push(p);
        }
    }
    out.sort();
    Ok(out)
}

impl Container {
    /// Open a model directory: read `config.json`, parse and validate every shard header
    /// and resolve every weight's format. No tensor data is read.
    pub fn open(dir: &Path) -> Result<Container> {
        let config = ModelConfig::from_file(dir.join("config.json"))?;
        Self::open_with_config(dir, config)
    }

    /// Like [`Container::open`] with an already parsed config.
    pub fn open_with_config(dir: &Path, config: ModelConfig) -> Result<Container> {
        let paths = shard_paths(dir)?;
        if paths.is_empty() {
            return Err(Error::container(
                dir,
                None,
                "no *.safetensors shards in the model directory",
            ));
        }
        let mut c = Container {
            dir: dir.to_path_buf(),
            config,
            shards: Vec::new(),
            tensors: HashMap::new(),
            order: Vec::new(),
            metadata: Vec::new(),
            load_progress: std::sync::Mutex::new(None),
        };
        for path in paths {
            let file = ShardFile::open(&path)?;
            let header = file.header()?;
            if let Some(v) = header.metadata.get(FORMAT_VERSION_KEY) {
                if v != FORMAT_VERSION {
                    return Err(Error::container(
                        &path,
                        None,
                        format!(
                            "{FORMAT_VERSION_KEY} is '{v}' but this colibri reads version \
                             {FORMAT_VERSION}; upgrade colibri or re-convert the model"
                        ),
                    ));
                }
            }
            let shard = c.shards.len();
            for t in header.tensors {
                if let Some(prev) = c.tensors.get(&t.name) {
                    return Err(Error::container(
                        &path,
                        Some(&t.name),
                        format!("tensor also present in {}", prev.file.display()),
                    ));
                }
                c.order.push(t.name.clone());
                c.tensors.insert(
                    t.name.clone(),
                    TensorInfo {
                        name: t.name,
                        dtype: t.dtype,
                        shape: t.shape,
                        shard,
                        file: path.clone(),
                        range: t.start..t.end,
                        format: None,
                        logical: None,
                    },
                );
            }
            c.shards.push(file);
            c.metadata.push(header.metadata);
        }
        c.resolve_formats()?;
        Ok(c)
    }

    /// Decide the format of every weight: quantised (U8 + `.qs`) from byte counts against
    /// the logical shape, float 2-D from dtype and shape; check 1-D tensors the config
    /// knows against their length.
    fn resolve_formats(&mut self) -> Result<()> {
        let mut resolved = Vec::new();
        for name in &self.order {
            let t = &self.tensors[name];
            if let Some(base) = name.strip_suffix(SCALES_SUFFIX) {
                if !self.tensors.contains_key(base) {
                    return Err(Error::container(
                        &t.file,
                        Some(name),
                        format!("scales tensor without its weight '{base}'"),
                    ));
                }
                continue;
            }
            if let Some((f, shape)) = self.resolve_one(t)? {
                resolved.push((name.clone(), f, shape));
            }
        }
        for (name, f, shape) in resolved {
            if let Some(t) = self.tensors.get_mut(&name) {
                t.format = Some(f);
                t.logical = Some(shape);
            }
        }
        Ok(())
    }

    fn resolve_one(&self, t: &TensorInfo) -> Result<Option<(QuantFormat, (usize, usize))>> {
        let name = t.name.as_str();
        let err = |msg: String| Error::container(&t.file, Some(name), msg);
        let expected = expected_shape(&self.config, name);
        let meta = self.metadata[t.shard].get(name);
        let meta_fmt = meta
            .map(|m| QuantFormat::parse(m))
            .transpose()
            .map_err(|_| {
                err(format!(
                    "__metadata__ names format '{}', which colibri does not know",
                    meta.map(String::as_str).unwrap_or("")
                ))
            })?;
        let scales_name = format!("{name}{SCALES_SUFFIX}");
        if let Some(qs) = self.tensors.get(&scales_name) {
            if t.dtype != Dtype::U8 {
                return Err(err(format!(
                    "has scales '{scales_name}' so it must be U8 packed bytes, but is {}",
                    t.dtype
                )));
            }
            if qs.dtype != Dtype::F32 {
                return Err(Error::container(
                    &qs.file,
                    Some(&scales_name),
                    format!("scales must be F32, found {}", qs.dtype),
                ));
            }
            let (rows, cols) = expected.ok_or_else(|| {
                err(
                    "a quantised tensor whose logical shape the config does not define; \
                     colibri cannot tell its [O, I]"
                        .into(),
                )
            })?;
            let nbytes = t.nbytes();
            let nscales = qs.shape.iter().product::<usize>();
            let inferred = QuantFormat::infer(rows, cols, nbytes, nscales);
            let format = match (meta_fmt, inferred) {
                (Some(m), _)
                    if m.is_quantized()
                        && m.data_bytes(rows, cols) == Some(nbytes)
                        && m.scale_count(rows, cols) == Some(nscales) =>
                {
                    m
                }
                (Some(m), _) => {
                    return Err(err(format!(
                        "__metadata__ says {m}, but {nbytes} bytes and {nscales} scales do not \
                         fit {m} for the logical shape [{rows}, {cols}] from config.json"
                    )))
                }
                (None, Some(f)) => f,
                (None, None) => {
                    return Err(err(format!(
                        "{nbytes} bytes and {nscales} scales match no format (int8, int4, \
                         int4_g{{16..256}}) for the logical shape [{rows}, {cols}] from \
                         config.json; wrong scale count, or a checkpoint for another config"
                    )))
                }
            };
            return Ok(Some((format, (rows, cols))));
        }
        if t.dtype == Dtype::U8 && expected.is_some() {
            return Err(err(format!(
                "U8 weight without its scales tensor '{scales_name}'"
            )));
        }
        let float = match t.dtype {
            Dtype::F32 => Some(QuantFormat::F32),
            Dtype::Bf16 => Some(QuantFormat::Bf16),
            Dtype::F16 => Some(QuantFormat::F16),
            _ => None,
        };
        if t.shape.len() == 2 {
            if let Some(f) = float {
                let shape = (t.shape[0], t.shape[1]);
                if let Some(e) = expected {
                    if e != shape {
                        return Err(err(format!(
                            "shape [{}, {}] disagrees with [{}, {}] from config.json",
                            shape.0, shape.1, e.0, e.1
                        )));
                    }
                }
                if let Some(m) = meta_fmt {
                    if m != f {
                        return Err(err(format!("__metadata__ says {m} but the tensor is {f}")));
                    }
                }
                return Ok(Some((f, shape)));
            }
        }
        if expected.is_some() {
            return Err(err(format!(
                "a weight of shape {:?} and dtype {}; expected a 2-D F32/BF16/F16 tensor or U8 \
                 bytes with F32 '.qs' scales",
                t.shape, t.dtype
            )));
        }
        if let Some(n) = expected_len(&self.config, name) {
            if t.shape.iter().product::<usize>() != n || t.shape.len() != 1 {
                return Err(err(format!(
                    "shape {:?} disagrees with [{n}] from config.json",
                    t.shape
                )));
            }
        }
        Ok(None)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.config
    }
    pub fn dir(&self) -> &Path {
        &self.dir
    }
    /// Bytes of every tensor that is not a routed expert: what stays resident (dense
    /// weights, norms, routers, shared experts, embeddings, the LM head).
    pub fn resident_bytes(&self) -> u64 {
        self.names()
            .filter(|n| names::classify(self.config(), n).role != names::Role::RoutedExpert)
            .filter_map(|n| self.info(n).ok())
            .map(|t| t.nbytes() as u64)
            .sum()
    }

    /// Report every [`weight`](Self::weight) and [`vector`](Self::vector) read to `report`
    /// with the running total against [`resident_bytes`](Self::resident_bytes) (a model's
    /// load); `None` stops reporting. [`finish_loads`](Self::finish_loads) ends it.
    pub fn report_loads(&self, report: Option<LoadReport>) {
        let counter = report.map(|report| LoadCounter {
            done: 0,
            total: self.resident_bytes(),
            report,
        });
        if let Ok(mut slot) = self.load_progress.lock() {
            *slot = counter;
        }
    }

    /// End the reporting of [`report_loads`](Self::report_loads) with a last call whose
    /// total is what was read (tensors a load skips, such as a disabled MTP head, are not
    /// waited for), so a progress bar ends full.
    pub fn finish_loads(&self) {
        let counter = self.load_progress.lock().ok().and_then(|mut s| s.take());
        if let Some(c) = counter {
            (c.report)(c.done, c.done);
        }
    }

    fn loaded(&self, bytes: usize) -> Result<()> {
        let Ok(mut slot) = self.load_progress.lock() else {
            return Ok(());
        };
        let Some(c) = slot.as_mut() else {
            return Ok(());
        };
        c.done += bytes as u64;
        c.total = c.total.max(c.done);
        let (done, total, report) = (c.done, c.total, c.report.clone());
        drop(slot);
        if report(done, total) {
            Ok(())
        } else {
            Err(Error::Cancelled)
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }
    /// Every tensor name (scales included), in shard and offset order.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.order.iter().map(String::as_str)
    }
    /// Shard files, in the order `TensorInfo::shard` indexes.
    pub fn shards(&self) -> &[Arc<ShardFile>] {
        &self.shards
    }
    /// The `__metadata__` of shard `i`.
    pub fn shard_metadata(&self, i: usize) -> Option<&BTreeMap<String, String>> {
        self.metadata.get(i)
    }

    fn missing(&self, name: &str) -> Error {
        Error::MissingTensor {
            tensor: name.to_owned(),
            dir: self.dir.clone(),
            family: self.config.family.to_string(),
        }
    }

    pub fn info(&self, name: &str) -> Result<&TensorInfo> {
        self.tensors.get(name).ok_or_else(|| self.missing(name))
    }

    /// Raw bytes of a tensor, read from its shard.
    pub fn bytes(&self, name: &str) -> Result<Vec<u8>> {
        let t = self.info(name)?;
        self.shards[t.shard].read(t.range.clone(), name)
    }

    /// The shard holding `name` and the tensor's absolute byte range in it.
    pub fn location(&self, name: &str) -> Result<(&Arc<ShardFile>, Range<usize>)> {
        let t = self.info(name)?;
        Ok((&self.shards[t.shard], t.range.clone()))
    }

    /// A 2-D weight in any format, read into owned memory. Its floats (the scales of a
    /// quantised weight, every value of a float one) are checked: NaN, Inf or a magnitude
    /// beyond [`finite::MAX_MAGNITUDE`] is [`Error::NonFiniteWeight`] naming the tensor.
    pub fn weight(&self, name: &str) -> Result<Weight> {
        let t = self.info(name)?;
        let (Some(format), Some((rows, cols))) = (t.format, t.logical) else {
            return Err(Error::container(
                &t.file,
                Some(name),
                format!(
                    "not a 2-D weight (dtype {}, shape {:?}); use vector() for 1-D tensors",
                    t.dtype, t.shape
                ),
            ));
        };
        // Check the byte ranges before allocating for them.
        let file = &self.shards[t.shard];
        file.check_range(&t.range, name)?;
        let qs = if format.is_quantized() {
            let qs_name = format!("{name}{SCALES_SUFFIX}");
            let qs = self.info(&qs_name)?;
            self.shards[qs.shard].check_range(&qs.range, &qs_name)?;
            Some((qs_name, qs))
        } else {
            None
        };
        let data = file.read(t.range.clone(), name)?;
        self.loaded(data.len())?;
        check_floats(&t.file, name, finite::scan_raw(&data, t.dtype))?;
        let scales: Vec<f32> = match qs {
            Some((qs_name, qs)) => {
                let raw = self.shards[qs.shard].read(qs.range.clone(), &qs_name)?;
                self.loaded(raw.len())?;
                let v: Vec<f32> = raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                check_floats(&qs.file, &qs_name, finite::scan_f32(&v))?;
                v
            }
            None => Vec::new(),
        };
        QMatrix::new(format, rows, cols, &data, &scales)
            .map_err(|e| Error::container(&t.file, Some(name), e.to_string()))?;
        Ok(Weight {
            format,
            rows,
            cols,
            data: Arc::new(data),
            scales: Arc::new(scales),
        })
    }

    /// A 1-D F32/BF16/F16 tensor as f32 (norm weights, `e_score_correction_bias`), checked
    /// like [`Container::weight`]'s floats.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.info(name)?;
        if t.shape.len() != 1 {
            return Err(Error::container(
                &t.file,
                Some(name),
                format!("expected a 1-D tensor, found shape {:?}", t.shape),
            ));
        }
        let raw = self.bytes(name)?;
        self.loaded(raw.len())?;
        let v = decode_floats(&raw, t.dtype).ok_or_else(|| {
            Error::container(
                &t.file,
                Some(name),
                format!("expected F32/BF16/F16, found {}", t.dtype),
            )
        })?;
        check_floats(&t.file, name, finite::scan_f32(&v))?;
        Ok(v)
    }
}

/// `Error::NonFiniteWeight` for a bad value a scan found.
fn check_floats(file: &Path, tensor: &str, bad: Option<finite::BadValue>) -> Result<()> {
    match bad {
        None => Ok(()),
        Some(b) => Err(Error::NonFiniteWeight {
            file: file.to_path_buf(),
            tensor: tensor.to_owned(),
            what: b.describe(),
            index: b.index,
        }),
    }
}

/// The first NaN/Inf found by [`Container::find_non_finite`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NonFiniteTensor {
    pub tensor: String,
    pub file: PathBuf,
    /// "NaN", "Inf", or the implausible value ([`finite::BadValue::describe`]).
    pub what: String,
    pub index: usize,
}

impl Container {
    /// Look for a NaN, Inf or implausible magnitude among the float tensors (F32/BF16/F16, quantised weights'
    /// scales included): the resident tensors first, then the routed experts, reading at
    /// most `max_bytes`. `Ok(None)` when none was found within that bound (the second value
    /// says whether every float tensor was read). Only for diagnosing a non-finite output:
    /// loading never scans.
    pub fn find_non_finite(&self, max_bytes: u64) -> (Option<NonFiniteTensor>, bool) {
        let cfg = self.config();
        let is_expert = |n: &str| names::classify(cfg, n).role == names::Role::RoutedExpert;
        let order = self
            .names()
            .filter(|n| !is_expert(n))
            .chain(self.names().filter(|n| is_expert(n)));
        let mut read = 0u64;
        for name in order {
            let Ok(t) = self.info(name) else { continue };
            let width = match t.dtype {
                Dtype::F32 => 4,
                Dtype::Bf16 | Dtype::F16 => 2,
                _ => continue,
            };
            if read + t.nbytes() as u64 > max_bytes {
                return (None, false);
            }
            read += t.nbytes() as u64;
            // In bounded pieces: a tensor may be large.
            const PIECE: usize = 1 << 22;
            let step = PIECE * width;
            let mut start = t.range.start;
            while start < t.range.end {
                let end = (start + step).min(t.range.end);
                let Ok(raw) = self.shards[t.shard].read(start..end, name) else {
                    break;
                };
                if let Some(b) = finite::scan_raw(&raw, t.dtype) {
                    return (
                        Some(NonFiniteTensor {
                            tensor: name.to_owned(),
                            file: t.file.clone(),
                            what: b.describe(),
                            index: (start - t.range.start) / width + b.index,
                        }),
                        true,
                    );
                }
                start = end;
            }
        }
        (None, true)
    }
}

impl Container {
    /// The stored float with the largest magnitude among the float tensors (resident ones
    /// first), reading at most `max_bytes`: (tensor, file, value, flat index).
    pub fn largest_magnitude(&self, max_bytes: u64) -> Option<(String, PathBuf, f32, usize)> {
        let cfg = self.config();
        let is_expert = |n: &str| names::classify(cfg, n).role == names::Role::RoutedExpert;
        let order = self
            .names()
            .filter(|n| !is_expert(n))
            .chain(self.names().filter(|n| is_expert(n)));
        let mut best: Option<(String, PathBuf, f32, usize)> = None;
        let mut read = 0u64;
        for name in order {
            let Ok(t) = self.info(name) else { continue };
            if !matches!(t.dtype, Dtype::F32 | Dtype::Bf16 | Dtype::F16) {
                continue;
            }
            read += t.nbytes() as u64;
            if read > max_bytes {
                break;
            }
            let Ok(v) = self.bytes(name).map(|raw| decode_floats(&raw, t.dtype)) else {
                continue;
            };
            let Some((i, x)) = v.unwrap_or_default().into_iter().enumerate().fold(
                None,
                |m: Option<(usize, f32)>, (i, x)| match m {
                    Some((_, y)) if x.is_nan() || x.abs() <= y.abs() => m,
                    _ => Some((i, x)),
                },
            ) else {
                continue;
            };
            if best.as_ref().is_none_or(|b| x.abs() > b.2.abs()) {
                best = Some((name.to_owned(), t.file.clone(), x, i));
            }
        }
        best
    }

    /// Why the model computed a non-finite value, as far as a bounded scan (`max_bytes` of
    /// float tensors) of the stored weights can tell: the tensor holding NaN/Inf or an
    /// implausible magnitude, else the largest stored value (an overflow's likely source).
    pub fn diagnose_non_finite(&self, max_bytes: u64) -> String {
        let (found, complete) = self.find_non_finite(max_bytes);
        if let Some(t) = found {
            return format!(
                "tensor '{}' in {} contains {} at flat index {}; the checkpoint is damaged or \
                 was saved with non-finite values: download or export it again",
                t.tensor,
                t.file.display(),
                t.what,
                t.index
            );
        }
        let scope = if complete {
            "no stored float is NaN/Inf".to_owned()
        } else {
            format!(
                "the first {} MiB of stored floats are finite",
                max_bytes >> 20
            )
        };
        match self.largest_magnitude(max_bytes) {
            Some((tensor, file, v, i)) => format!(
                "{scope}, so the computation overflows float32; the largest stored value is \
                 {v:e} in tensor '{tensor}' ({}, flat index {i}): weights far outside any \
                 trained range; check the checkpoint against its source",
                file.display()
            ),
            None => format!("{scope}, so the computation overflows float32"),
        }
    }
}

/// Little-endian F32/BF16/F16 bytes → f32; `None` for other dtypes.
pub fn decode_floats(raw: &[u8], dtype: Dtype) -> Option<Vec<f32>> {
    Some(match dtype {
        Dtype::F32 => raw
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect(),
        Dtype::Bf16 => raw
            .chunks_exact(2)
            .map(|b| half::bf16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        Dtype::F16 => raw
            .chunks_exact(2)
            .map(|b| half::f16::from_le_bytes([b[0], b[1]]).to_f32())
            .collect(),
        _ => return None,
    })
}

#[cfg(test)]
pub(crate) mod tests;
