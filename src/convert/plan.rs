//! The plan: every output tensor's kind and format and every shard's exact header, decided
//! from the source headers before any data is read.

use std::collections::{BTreeMap, HashMap};
use std::path::{Component, Path, PathBuf};
use std::sync::Mutex;

use serde_json::Value;

use super::record::Record;
use super::source::Source;
use super::tensor_plan::{is_block_scales, plan_tensor};
use super::ConvertOptions;
use crate::config::ModelConfig;
use crate::container::names::{classify, Proj, Role};
use crate::container::safetensors::{write_header, Dtype, TensorSpec};
use crate::container::{shard_paths, FORMAT_VERSION, FORMAT_VERSION_KEY, SCALES_SUFFIX};
use crate::error::{Error, Result};
use crate::quant::format::QuantFormat;

/// How one source tensor becomes output.
#[derive(Debug, Clone, PartialEq)]
pub(super) enum OutKind {
    /// Quantised: `NAME` (U8 bytes) + `NAME.qs` (F32 scales).
    Quant {
        format: QuantFormat,
        rows: usize,
        cols: usize,
    },
    /// Re-encoded float (F32/BF16/F16) with the source shape.
    Float {
        format: QuantFormat,
        shape: Vec<usize>,
    },
    /// Bytes copied unchanged.
    Copy { dtype: Dtype, shape: Vec<usize> },
}

/// One output tensor and where its data comes from.
#[derive(Debug, Clone)]
pub struct PlannedTensor {
    pub name: String,
    pub(super) kind: OutKind,
    /// `weight_scale_inv` of an FP8 source.
    pub(super) scale_inv: Option<String>,
}

impl PlannedTensor {
    /// The output format, or `None` for copied tensors.
    pub fn format(&self) -> Option<QuantFormat> {
        match &self.kind {
            OutKind::Quant { format, .. } | OutKind::Float { format, .. } => Some(*format),
            OutKind::Copy { .. } => None,
        }
    }

    fn specs(&self) -> Vec<TensorSpec> {
        match &self.kind {
            OutKind::Quant { format, rows, cols } => vec![
                TensorSpec {
                    name: self.name.clone(),
                    dtype: Dtype::U8,
                    shape: vec![format.data_bytes(*rows, *cols).unwrap_or(0)],
                },
                TensorSpec {
                    name: format!("{}{SCALES_SUFFIX}", self.name),
                    dtype: Dtype::F32,
                    shape: vec![format.scale_count(*rows, *cols).unwrap_or(0)],
                },
            ],
            OutKind::Float { format, shape } => vec![TensorSpec {
                name: self.name.clone(),
                dtype: match format {
                    QuantFormat::Bf16 => Dtype::Bf16,
                    QuantFormat::F16 => Dtype::F16,
                    _ => Dtype::F32,
                },
                shape: shape.clone(),
            }],
            OutKind::Copy { dtype, shape } => vec![TensorSpec {
                name: self.name.clone(),
                dtype: *dtype,
                shape: shape.clone(),
            }],
        }
    }

    fn out_bytes(&self) -> u64 {
        self.specs().iter().map(|s| s.nbytes() as u64).sum()
    }
}

/// One output shard: its file name, tensors in write order, and the exact header bytes.
#[derive(Debug, Clone)]
pub struct PlannedShard {
    pub file_name: String,
    pub tensors: Vec<PlannedTensor>,
    pub(super) header: Vec<u8>,
    /// Total file length: header plus data.
    pub total_bytes: u64,
}

/// A planned conversion; write its shards (in any order, any number of times), then
/// [`Plan::finish`].
pub struct Plan {
    pub(super) src: Source,
    pub(super) dst: PathBuf,
    pub(super) options: ConvertOptions,
    pub(super) config_json: Value,
    pub config: ModelConfig,
    pub shards: Vec<PlannedShard>,
    /// DST's progress record (what each finished shard was made from).
    pub(super) record: Mutex<Record>,
}

/// `p` made absolute and lexically normalised (`.` and `..` removed), with its existing
/// prefix canonicalised (so symlinks resolve) even when the tail does not exist yet.
fn resolve(p: &Path) -> Result<PathBuf> {
    let abs = if p.is_absolute() {
        p.to_path_buf()
    } else {
        std::env::current_dir()
            .map_err(|e| Error::io(p, e))?
            .join(p)
    };
    let mut norm = PathBuf::new();
    for c in abs.components() {
        match c {
            Component::ParentDir => {
                norm.pop();
            }
            Component::CurDir => {}
            other => norm.push(other),
        }
    }
    let mut existing = norm.clone();
    let mut tail = Vec::new();
    while !existing.exists() {
        match (existing.file_name(), existing.parent()) {
            (Some(name), Some(parent)) => {
                tail.push(name.to_os_string());
                existing = parent.to_path_buf();
            }
            _ => break,
        }
    }
    let mut out = existing
        .canonicalize()
        .map_err(|e| Error::io(&existing, e))?;
    for part in tail.iter().rev() {
        out.push(part);
    }
    Ok(out)
}

/// Plan converting `src` into `dst`. Reads only config.json and the shard headers.
pub fn plan(src: &Path, dst: &Path, options: &ConvertOptions) -> Result<Plan> {
    options.validate()?;
    check_dst_outside_src(src, dst)?;
    let (config, config_json) = read_config(src)?;
    let source = Source::open(src, &config_json)?;
    let units = plan_units(&source, &config, options)?;
    let shards = pack_shards(units, options.max_shard_bytes);
    check_dst_holds_no_other_weights(dst, &shards)?;
    Ok(Plan {
        src: source,
        dst: dst.to_path_buf(),
        options: options.clone(),
        config_json,
        config,
        shards,
        record: Mutex::new(Record::load(dst)),
    })
}

/// The converter never writes into SRC: DST (resolved) must not be SRC or below it.
fn check_dst_outside_src(src: &Path, dst: &Path) -> Result<()> {
    let src_abs = resolve(src)?;
    let dst_abs = resolve(dst)?;
    if dst_abs == src_abs || dst_abs.starts_with(&src_abs) {
        return Err(Error::invalid(
            "dst",
            format!(
                "{} is inside the source {}; the converter never writes into SRC, pick another directory",
                dst.display(),
                src.display()
            ),
        ));
    }
    Ok(())
}

/// SRC's `config.json`, validated and as JSON (copied into DST with the format added).
fn read_config(src: &Path) -> Result<(ModelConfig, Value)> {
    let config_path = src.join("config.json");
    let text = std::fs::read_to_string(&config_path).map_err(|e| Error::io(&config_path, e))?;
    let config = ModelConfig::from_json_str(&text, &config_path)?;
    let config_json: Value = serde_json::from_str(&text).map_err(|e| Error::Config {
        path: config_path.clone(),
        msg: e.to_string(),
    })?;
    Ok((config, config_json))
}

/// What goes into a shard together: one tensor, or all projections of one routed expert (so
/// an expert's bytes are adjacent, one read per expert).
enum Unit {
    One(PlannedTensor),
    Expert(BTreeMap<Proj, PlannedTensor>),
}

/// Phase 1: decide each source tensor's output, in source order, grouping each routed
/// expert's projections into one unit.
fn plan_units(
    source: &Source,
    config: &ModelConfig,
    options: &ConvertOptions,
) -> Result<Vec<Unit>> {
    let mut units: Vec<Unit> = Vec::new();
    let mut expert_unit: HashMap<(usize, usize), usize> = HashMap::new();
    for name in &source.order {
        if is_block_scales(source, name)? {
            continue; // consumed by its FP8 weight
        }
        let pt = plan_tensor(source, config, options, name)?;
        let role = classify(config, name);
        match (role.role, role.layer, role.expert, role.proj) {
            (Role::RoutedExpert, Some(l), Some(e), Some(p)) => {
                let idx = *expert_unit.entry((l, e)).or_insert_with(|| {
                    units.push(Unit::Expert(BTreeMap::new()));
                    units.len() - 1
                });
                if let Unit::Expert(m) = &mut units[idx] {
                    m.insert(p, pt);
                }
            }
            _ => units.push(Unit::One(pt)),
        }
    }
    Ok(units)
}

/// Phase 2: pack units into shards of at most `max_shard_bytes` (at least one unit each),
/// each with its exact header.
fn pack_shards(units: Vec<Unit>, max_shard_bytes: u64) -> Vec<PlannedShard> {
    let mut groups: Vec<Vec<PlannedTensor>> = Vec::new();
    let mut current: Vec<PlannedTensor> = Vec::new();
    let mut current_bytes = 0u64;
    for unit in units {
        let tensors: Vec<PlannedTensor> = match unit {
            Unit::One(t) => vec![t],
            Unit::Expert(m) => m.into_values().collect(),
        };
        let bytes: u64 = tensors.iter().map(PlannedTensor::out_bytes).sum();
        if !current.is_empty() && current_bytes + bytes > max_shard_bytes {
            groups.push(std::mem::take(&mut current));
            current_bytes = 0;
        }
        current.extend(tensors);
        current_bytes += bytes;
    }
    if !current.is_empty() {
        groups.push(current);
    }
    let n = groups.len();
    groups
        .into_iter()
        .enumerate()
        .map(|(i, tensors)| {
            let specs: Vec<TensorSpec> = tensors.iter().flat_map(PlannedTensor::specs).collect();
            let mut meta = BTreeMap::new();
            meta.insert(FORMAT_VERSION_KEY.to_string(), FORMAT_VERSION.to_string());
            for t in &tensors {
                if let Some(f) = t.format() {
                    meta.insert(t.name.clone(), f.name());
                }
            }
            let header = write_header(&specs, &meta);
            let data: u64 = specs.iter().map(|s| s.nbytes() as u64).sum();
            PlannedShard {
                file_name: format!("model-{:05}-of-{:05}.safetensors", i + 1, n),
                total_bytes: header.len() as u64 + data,
                tensors,
                header,
            }
        })
        .collect()
}

/// Phase 3: DST must not hold other weight files (they would be read as part of the model).
fn check_dst_holds_no_other_weights(dst: &Path, shards: &[PlannedShard]) -> Result<()> {
    if !dst.exists() {
        return Ok(());
    }
    let planned: Vec<&str> = shards.iter().map(|s| s.file_name.as_str()).collect();
    for p in shard_paths(dst)? {
        let name = p.file_name().and_then(|n| n.to_str()).unwrap_or("");
        if !planned.contains(&name) {
            return Err(Error::invalid(
                "dst",
                format!(
                    "{} already holds {name}, which this conversion would not write; \
                     use an empty directory",
                    dst.display()
                ),
            ));
        }
    }
    Ok(())
}
