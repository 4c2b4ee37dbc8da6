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
pub mod regular_file;
pub mod safetensors;
pub mod shard;

mod diagnose;
mod formats;
mod load_progress;
mod weight;

use std::collections::{BTreeMap, HashMap};
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::config::ModelConfig;
use crate::error::{Error, Result};
use crate::quant::format::QuantFormat;

pub use diagnose::NonFiniteTensor;
pub use load_progress::LoadReport;
pub use names::{
    classify, expected_len, expected_names, expected_shape, expert_tensor_name, Proj, Role,
    TensorRole,
};
pub use safetensors::Dtype;
pub use shard::ShardFile;
pub use weight::Weight;

use load_progress::LoadCounter;

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
