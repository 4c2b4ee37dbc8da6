//! Hugging Face checkpoint (BF16/F16/F32, or FP8 e4m3 with 128×128 `weight_scale_inv`
//! block scales) → colibri container (docs/container.md).
//!
//! The conversion is planned up front from the source headers alone: every output tensor's
//! format and size follow from its role and shape, so each output shard's header is known
//! before any data is read. A shard is then written by streaming: read a block of rows of
//! one source tensor with positioned reads (no mmap, so the source never inflates RSS),
//! dequantise to f32, quantise the rows in parallel (rayon), append. Memory stays bounded by
//! one row block (`chunk_bytes`) whatever the shard or tensor size.
//!
//! Each shard is written to `.NAME.partial` and renamed when complete; a shard whose final
//! file already exists with exactly the planned header and length is skipped, so an
//! interrupted conversion resumes where it stopped. Nothing is ever written into SRC.

pub mod fp8;

use std::collections::{BTreeMap, HashMap};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Component, Path, PathBuf};
use std::sync::Arc;

use rayon::prelude::*;
use serde_json::Value;

use crate::config::ModelConfig;
use crate::container::names::{classify, expected_len, expected_shape, Proj, Role};
use crate::container::safetensors::{self, write_header, Dtype, TensorSpec, MAX_HEADER_BYTES};
use crate::container::{
    decode_floats, shard_paths, FORMAT_VERSION, FORMAT_VERSION_KEY, SCALES_SUFFIX,
};
use crate::error::{Error, Result};
use crate::quant::format::{QuantFormat, GROUP_SIZES};
use crate::quant::pack::quantize;

/// Suffix DeepSeek-V3 / GLM-5 FP8 checkpoints give the block scales of `NAME.weight`:
/// `NAME.weight_scale_inv`.
pub const SCALE_INV_SUFFIX: &str = "_scale_inv";

/// What to produce for each tensor role. Bits: 4 → int4 (grouped by `group_size`, or
/// per-row when `group_size` is 0), 8 → int8 per-row, 16 → BF16, 32 → F32.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertOptions {
    /// Routed experts of the main layers.
    pub expert_bits: u32,
    /// Attention projections, shared experts and dense MLPs of the main layers.
    pub dense_bits: u32,
    /// Every 2-D weight of the MTP layer(s) except the router.
    pub mtp_bits: u32,
    /// `model.embed_tokens`.
    pub embed_bits: u32,
    /// `lm_head`.
    pub lm_head_bits: u32,
    /// GLM DSA indexer projections (wq_b, wk, weights_proj) of the main layers.
    pub indexer_bits: u32,
    /// int4 group size (one of 16, 32, 48, 64, 96, 128, 192, 256), or 0 for per-row.
    pub group_size: usize,
    /// Largest output shard, in bytes (a shard holds at least one tensor or expert).
    pub max_shard_bytes: u64,
    /// Working-set bound: f32 bytes of source rows processed at once.
    pub chunk_bytes: usize,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            expert_bits: 4,
            dense_bits: 4,
            mtp_bits: 8,
            embed_bits: 8,
            lm_head_bits: 8,
            indexer_bits: 8,
            group_size: 64,
            max_shard_bytes: 4 << 30,
            chunk_bytes: 64 << 20,
        }
    }
}

impl ConvertOptions {
    /// Check every option; errors name the option.
    pub fn validate(&self) -> Result<()> {
        for (p, b) in self.bits() {
            self.format(p, b)?;
        }
        if self.group_size != 0 && !GROUP_SIZES.contains(&self.group_size) {
            return Err(Error::invalid(
                "group_size",
                format!(
                    "{} is not one of 0 (per-row), {}",
                    self.group_size,
                    GROUP_SIZES.map(|g| g.to_string()).join(", ")
                ),
            ));
        }
        if self.max_shard_bytes == 0 {
            return Err(Error::invalid("max_shard_bytes", "must be > 0"));
        }
        if self.chunk_bytes == 0 {
            return Err(Error::invalid("chunk_bytes", "must be > 0"));
        }
        Ok(())
    }

    fn bits(&self) -> [(&'static str, u32); 6] {
        [
            ("expert_bits", self.expert_bits),
            ("dense_bits", self.dense_bits),
            ("mtp_bits", self.mtp_bits),
            ("embed_bits", self.embed_bits),
            ("lm_head_bits", self.lm_head_bits),
            ("indexer_bits", self.indexer_bits),
        ]
    }

    /// The output format for a bit width.
    pub fn format(&self, param: &str, bits: u32) -> Result<QuantFormat> {
        Ok(match bits {
            4 if self.group_size == 0 => QuantFormat::Int4PerRow,
            4 => QuantFormat::Int4Grouped {
                group_size: self.group_size,
            },
            8 => QuantFormat::Int8PerRow,
            16 => QuantFormat::Bf16,
            32 => QuantFormat::F32,
            other => {
                return Err(Error::invalid(
                    param,
                    format!("{other} bits is not supported; use 4, 8, 16 (bf16) or 32 (f32)"),
                ))
            }
        })
    }
}

/// One tensor of a source shard.
#[derive(Debug, Clone)]
struct SrcTensor {
    dtype: Dtype,
    shape: Vec<usize>,
    shard: usize,
    start: u64,
    end: u64,
}

/// A source checkpoint opened for positioned reads.
struct Source {
    dir: PathBuf,
    files: Vec<(PathBuf, Arc<File>)>,
    tensors: HashMap<String, SrcTensor>,
    /// Names in shard, offset order.
    order: Vec<String>,
    block: (usize, usize),
}

fn read_exact_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        file.read_exact_at(buf, offset)
            .map_err(|e| Error::io(path, e))
    }
    #[cfg(not(unix))]
    {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = file.try_clone().map_err(|e| Error::io(path, e))?;
        f.seek(SeekFrom::Start(offset))
            .and_then(|_| f.read_exact(buf))
            .map_err(|e| Error::io(path, e))
    }
}

/// Read and validate the header of one safetensors file without mapping it.
fn read_header(path: &Path, file: &File) -> Result<safetensors::Header> {
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut len8 = [0u8; 8];
    if len < 8 {
        return safetensors::parse_header(path, &[], len);
    }
    read_exact_at(file, path, &mut len8, 0)?;
    let n = u64::from_le_bytes(len8);
    if n > MAX_HEADER_BYTES || n.saturating_add(8) > len {
        return safetensors::parse_header(path, &len8, len);
    }
    let mut prefix = vec![0u8; 8 + n as usize];
    read_exact_at(file, path, &mut prefix, 0)?;
    safetensors::parse_header(path, &prefix, len)
}

impl Source {
    fn open(dir: &Path, config: &Value) -> Result<Source> {
        let paths = shard_paths(dir)?;
        if paths.is_empty() {
            return Err(Error::container(
                dir,
                None,
                "no *.safetensors shards to convert",
            ));
        }
        let block = match config
            .get("quantization_config")
            .and_then(|q| q.get("weight_block_size"))
            .and_then(Value::as_array)
        {
            Some(b) if b.len() == 2 => {
                let v: Vec<usize> = b
                    .iter()
                    .filter_map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()))
                    .filter(|&x| x > 0)
                    .collect();
                if v.len() != 2 {
                    return Err(Error::Config {
                        path: dir.join("config.json"),
                        msg: "quantization_config.weight_block_size must be two positive integers"
                            .into(),
                    });
                }
                (v[0], v[1])
            }
            _ => (128, 128),
        };
        let mut src = Source {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            tensors: HashMap::new(),
            order: Vec::new(),
            block,
        };
        for path in paths {
            let file = File::open(&path).map_err(|e| Error::io(&path, e))?;
            let header = read_header(&path, &file)?;
            let shard = src.files.len();
            for t in header.tensors {
                if src.tensors.contains_key(&t.name) {
                    return Err(Error::container(
                        &path,
                        Some(&t.name),
                        "tensor appears in more than one shard",
                    ));
                }
                src.order.push(t.name.clone());
                src.tensors.insert(
                    t.name,
                    SrcTensor {
                        dtype: t.dtype,
                        shape: t.shape,
                        shard,
                        start: t.start as u64,
                        end: t.end as u64,
                    },
                );
            }
            src.files.push((path, Arc::new(file)));
        }
        Ok(src)
    }

    fn read(&self, t: &SrcTensor, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (path, file) = &self.files[t.shard];
        read_exact_at(file, path, buf, t.start + offset)
    }

    fn path(&self, t: &SrcTensor) -> &Path {
        &self.files[t.shard].0
    }
}

/// How one source tensor becomes output.
#[derive(Debug, Clone, PartialEq)]
enum OutKind {
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
    kind: OutKind,
    /// `weight_scale_inv` of an FP8 source.
    scale_inv: Option<String>,
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
    header: Vec<u8>,
    /// Total file length: header plus data.
    pub total_bytes: u64,
}

/// A planned conversion; write its shards (in any order, any number of times), then
/// [`Plan::finish`].
pub struct Plan {
    src: Source,
    dst: PathBuf,
    options: ConvertOptions,
    config_json: Value,
    pub config: ModelConfig,
    pub shards: Vec<PlannedShard>,
}

/// What a conversion did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConvertReport {
    pub shards_written: usize,
    pub shards_skipped: usize,
    pub bytes_written: u64,
    /// Output tensors per format name ("int4_g64", "int8", "f32", "copy", ...).
    pub formats: BTreeMap<String, usize>,
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

fn is_fp8(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F8E4M3 | Dtype::F8E5M2)
}

fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::Bf16 | Dtype::F16)
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

/// Whether `name` is the block scales of an FP8 weight (an error when it names no FP8
/// weight).
fn is_block_scales(source: &Source, name: &str) -> Result<bool> {
    let Some(weight) = name.strip_suffix(SCALE_INV_SUFFIX) else {
        return Ok(false);
    };
    match source.tensors.get(weight) {
        Some(w) if is_fp8(w.dtype) => Ok(true),
        _ => Err(Error::container(
            source.path(&source.tensors[name]),
            Some(name),
            format!("block scales without an FP8 weight '{weight}'"),
        )),
    }
}

/// One source tensor's output: refused layouts, its FP8 block scales, its kind and format.
fn plan_tensor(
    source: &Source,
    config: &ModelConfig,
    options: &ConvertOptions,
    name: &str,
) -> Result<PlannedTensor> {
    let t = &source.tensors[name];
    let path = source.path(t);
    let err = |msg: String| Error::container(path, Some(name), msg);
    if name.contains(".mlp.experts.gate_up_proj") || name.ends_with(".mlp.experts.down_proj") {
        return Err(Error::Unsupported(format!(
            "{}: tensor '{name}' stores all experts fused; convert a checkpoint with \
             per-expert tensors (transformers' save_pretrained writes those)",
            path.display()
        )));
    }
    if t.dtype == Dtype::F8E5M2 {
        return Err(Error::Unsupported(format!(
            "{}: tensor '{name}' is F8_E5M2; only F8_E4M3 with block scales is supported",
            path.display()
        )));
    }
    let scale_inv = if t.dtype == Dtype::F8E4M3 {
        Some(fp8_block_scales(source, name, t)?)
    } else {
        None
    };
    let role = classify(config, name);
    let mtp = role.layer.is_some_and(|l| config.is_mtp_layer(l));
    let kind = if let Some((rows, cols)) = expected_shape(config, name) {
        if t.shape != [rows, cols] || !(is_float(t.dtype) || t.dtype == Dtype::F8E4M3) {
            return Err(err(format!(
                "expected a float or FP8 weight of shape [{rows}, {cols}] from config.json, \
                 found {} {:?}",
                t.dtype, t.shape
            )));
        }
        let format = weight_format(options, role.role, mtp)?;
        if format.is_quantized() {
            OutKind::Quant { format, rows, cols }
        } else {
            OutKind::Float {
                format,
                shape: t.shape.clone(),
            }
        }
    } else if let Some(n) = expected_len(config, name) {
        if t.shape != [n] || !is_float(t.dtype) {
            return Err(err(format!(
                "expected a float vector of length {n} from config.json, found {} {:?}",
                t.dtype, t.shape
            )));
        }
        OutKind::Float {
            format: QuantFormat::F32,
            shape: t.shape.clone(),
        }
    } else if t.dtype == Dtype::F8E4M3 {
        // Unrecognised FP8 weight: keep it exact, dequantised to BF16.
        OutKind::Float {
            format: QuantFormat::Bf16,
            shape: t.shape.clone(),
        }
    } else {
        // Unrecognised tensor: copied unchanged.
        OutKind::Copy {
            dtype: t.dtype,
            shape: t.shape.clone(),
        }
    };
    Ok(PlannedTensor {
        name: name.to_owned(),
        kind,
        scale_inv,
    })
}

/// The recipe, role → output format of a 2-D weight, in one place: which option sets each
/// role's bits. Routers stay F32 everywhere; every other weight of the MTP layer(s) takes
/// `mtp_bits`. The match is exhaustive so that a new role has to be given a line here.
fn weight_format(options: &ConvertOptions, role: Role, mtp: bool) -> Result<QuantFormat> {
    let (param, bits) = match (role, mtp) {
        (Role::Router, _) => return Ok(QuantFormat::F32),
        (_, true) => ("mtp_bits", options.mtp_bits),
        (Role::Embed, false) => ("embed_bits", options.embed_bits),
        (Role::LmHead, false) => ("lm_head_bits", options.lm_head_bits),
        (Role::RoutedExpert, false) => ("expert_bits", options.expert_bits),
        (Role::Indexer, false) => ("indexer_bits", options.indexer_bits),
        (
            Role::Attention
            | Role::DenseMlp
            | Role::SharedExpert
            | Role::MtpProj
            | Role::RouterBias
            | Role::Norm
            | Role::Unknown,
            false,
        ) => ("dense_bits", options.dense_bits),
    };
    options.format(param, bits)
}

/// The name of an FP8 weight's block scales, checked: present, float, and of the shape the
/// checkpoint's block size gives.
fn fp8_block_scales(source: &Source, name: &str, t: &SrcTensor) -> Result<String> {
    let err = |msg: String| Error::container(source.path(t), Some(name), msg);
    let s = format!("{name}{SCALE_INV_SUFFIX}");
    let st = source
        .tensors
        .get(&s)
        .ok_or_else(|| err(format!("FP8 weight without its block scales '{s}'")))?;
    let (bo, bi) = source.block;
    let want = match t.shape.as_slice() {
        [o, i] => vec![o.div_ceil(bo), i.div_ceil(bi)],
        _ => return Err(err(format!("FP8 weight must be 2-D, found {:?}", t.shape))),
    };
    if st.shape != want || !is_float(st.dtype) {
        return Err(Error::container(
            source.path(st),
            Some(&s),
            format!(
                "block scales must be a float tensor of shape {want:?} for a {:?} weight \
                 with {bo}×{bi} blocks, found {} {:?}",
                t.shape, st.dtype, st.shape
            ),
        ));
    }
    Ok(s)
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

impl Plan {
    pub fn dst(&self) -> &Path {
        &self.dst
    }
    pub fn src(&self) -> &Path {
        &self.src.dir
    }

    /// Whether shard `i` already exists complete (same header, same length) in DST.
    pub fn is_done(&self, i: usize) -> bool {
        let Some(s) = self.shards.get(i) else {
            return false;
        };
        let path = self.dst.join(&s.file_name);
        let Ok(file) = File::open(&path) else {
            return false;
        };
        if file.metadata().map(|m| m.len()).ok() != Some(s.total_bytes) {
            return false;
        }
        let mut head = vec![0u8; s.header.len()];
        read_exact_at(&file, &path, &mut head, 0).is_ok() && head == s.header
    }

    /// Write shard `i` (to a temporary name, renamed when complete). `progress` receives
    /// the bytes written after each tensor; an error from it (e.g. Ctrl-C) stops the write.
    pub fn write_shard(&self, i: usize, progress: &mut dyn FnMut(u64) -> Result<()>) -> Result<()> {
        let s = self
            .shards
            .get(i)
            .ok_or_else(|| Error::invalid("shard", format!("no shard {i}")))?;
        std::fs::create_dir_all(&self.dst).map_err(|e| Error::io(&self.dst, e))?;
        let final_path = self.dst.join(&s.file_name);
        let tmp = self.dst.join(format!(".{}.partial", s.file_name));
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        let w =
            |out: &mut BufWriter<File>, b: &[u8]| out.write_all(b).map_err(|e| Error::io(&tmp, e));
        w(&mut out, &s.header)?;
        progress(s.header.len() as u64)?;
        for t in &s.tensors {
            let n = self.write_tensor(t, &mut |b| w(&mut out, b))?;
            progress(n)?;
        }
        let file = out
            .into_inner()
            .map_err(|e| Error::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(&tmp, e))?;
        let len = file.metadata().map_err(|e| Error::io(&tmp, e))?.len();
        if len != s.total_bytes {
            return Err(Error::Internal(format!(
                "{}: wrote {len} bytes, planned {}",
                tmp.display(),
                s.total_bytes
            )));
        }
        drop(file);
        std::fs::rename(&tmp, &final_path).map_err(|e| Error::io(&final_path, e))
    }

    /// Stream one planned tensor through `sink`; returns the bytes written.
    fn write_tensor(
        &self,
        t: &PlannedTensor,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<u64> {
        let st = &self.src.tensors[&t.name];
        let path = self.src.path(st);
        if let OutKind::Copy { .. } = t.kind {
            let total = st.end - st.start;
            let mut buf = vec![0u8; (self.options.chunk_bytes as u64).min(total) as usize];
            let mut off = 0u64;
            while off < total {
                let n = ((total - off) as usize).min(buf.len());
                self.src.read(st, off, &mut buf[..n])?;
                sink(&buf[..n])?;
                off += n as u64;
            }
            return Ok(total);
        }
        let (format, rows, cols) = match &t.kind {
            OutKind::Quant { format, rows, cols } => (*format, *rows, *cols),
            OutKind::Float { format, shape } => match shape.as_slice() {
                [r, c] => (*format, *r, *c),
                _ => (*format, 1, shape.iter().product()),
            },
            OutKind::Copy { .. } => unreachable!("handled above"),
        };
        // FP8 block scales, read whole (they are 1/16384 of the weight).
        let scale_inv = match &t.scale_inv {
            Some(s) => {
                let sst = &self.src.tensors[s];
                let mut raw = vec![0u8; (sst.end - sst.start) as usize];
                self.src.read(sst, 0, &mut raw)?;
                let v = decode_floats(&raw, sst.dtype).unwrap_or_default();
                Some(v)
            }
            None => None,
        };
        let table = fp8::e4m3_table();
        let esize = st.dtype.size();
        let row_bytes = cols * esize;
        let chunk_rows = (self.options.chunk_bytes / (cols.max(1) * 4)).clamp(1, rows.max(1));
        let mut raw = vec![0u8; chunk_rows * row_bytes];
        let mut vals = vec![0.0f32; chunk_rows * cols];
        let mut scales: Vec<f32> = Vec::with_capacity(format.scale_count(rows, cols).unwrap_or(0));
        let mut written = 0u64;
        let threads = rayon::current_num_threads().max(1);
        let mut r0 = 0;
        while r0 < rows {
            let nr = chunk_rows.min(rows - r0);
            let raw = &mut raw[..nr * row_bytes];
            self.src.read(st, (r0 * row_bytes) as u64, raw)?;
            let vals = &mut vals[..nr * cols];
            match (&scale_inv, st.dtype) {
                (Some(s), _) => {
                    fp8::dequant_block_rows(&table, raw, r0, cols, s, self.src.block, vals)
                }
                (None, dtype) => {
                    let v = decode_floats(raw, dtype).ok_or_else(|| {
                        Error::container(path, Some(&t.name), format!("cannot convert {dtype}"))
                    })?;
                    vals.copy_from_slice(&v);
                }
            }
            // Quantise row blocks in parallel; rows are independent, so this is bit-exact
            // with quantising the whole tensor at once.
            let per_task = nr.div_ceil(threads * 4).max(1);
            let packed: Vec<Result<_>> = vals
                .par_chunks(per_task * cols.max(1))
                .enumerate()
                .map(|(k, block)| {
                    let br = block.len() / cols.max(1);
                    quantize(format, &t.name, block, br, cols).map_err(|e| match e {
                        Error::NonFinite {
                            tensor,
                            what,
                            index,
                        } => Error::NonFinite {
                            tensor,
                            what,
                            index: index + (r0 + k * per_task) * cols,
                        },
                        other => other,
                    })
                })
                .collect();
            for p in packed {
                let p = p?;
                sink(&p.data)?;
                written += p.data.len() as u64;
                scales.extend_from_slice(&p.scales);
            }
            r0 += nr;
        }
        if format.is_quantized() {
            let bytes: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
            sink(&bytes)?;
            written += bytes.len() as u64;
        }
        Ok(written)
    }

    /// Copy the files a container needs besides its weights ([`is_container_sidecar`]: the
    /// tokenizer, generation config, chat template, license), write config.json (without
    /// the source's `quantization_config`), and check that the result opens as a container.
    pub fn finish(&self) -> Result<()> {
        std::fs::create_dir_all(&self.dst).map_err(|e| Error::io(&self.dst, e))?;
        let rd = std::fs::read_dir(&self.src.dir).map_err(|e| Error::io(&self.src.dir, e))?;
        for entry in rd {
            let entry = entry.map_err(|e| Error::io(&self.src.dir, e))?;
            let p = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if !is_container_sidecar(&name) || !p.is_file() {
                continue;
            }
            let to = self.dst.join(&name);
            std::fs::copy(&p, &to).map_err(|e| Error::io(&to, e))?;
        }
        let mut cfg = self.config_json.clone();
        if let Some(o) = cfg.as_object_mut() {
            o.remove("quantization_config");
        }
        let text = serde_json::to_string_pretty(&cfg)
            .map_err(|e| Error::Internal(format!("serialising config.json: {e}")))?;
        let tmp = self.dst.join(".config.json.partial");
        std::fs::write(&tmp, text + "\n").map_err(|e| Error::io(&tmp, e))?;
        let to = self.dst.join("config.json");
        std::fs::rename(&tmp, &to).map_err(|e| Error::io(&to, e))?;
        crate::container::Container::open(&self.dst).map(|_| ())
    }

    /// Output tensors per format name.
    pub fn format_counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for s in &self.shards {
            for t in &s.tensors {
                let k = t.format().map_or_else(|| "copy".to_string(), |f| f.name());
                *m.entry(k).or_insert(0) += 1;
            }
        }
        m
    }
}

/// Convert `src` into `dst` in one call (skipping shards already complete).
pub fn convert(src: &Path, dst: &Path, options: &ConvertOptions) -> Result<ConvertReport> {
    let plan = plan(src, dst, options)?;
    let mut report = ConvertReport {
        formats: plan.format_counts(),
        ..ConvertReport::default()
    };
    for i in 0..plan.shards.len() {
        if plan.is_done(i) {
            report.shards_skipped += 1;
            continue;
        }
        let mut n = 0;
        plan.write_shard(i, &mut |b| {
            n += b;
            Ok(())
        })?;
        report.bytes_written += n;
        report.shards_written += 1;
    }
    plan.finish()?;
    Ok(report)
}

/// Whether a file of a source checkpoint belongs in the container: what loading and
/// prompting the model reads (the tokenizer in any of its Hugging Face forms, the generation
/// config, the chat template) and its license. Everything else stays behind: the weights
/// are rewritten, `config.json` is written separately, and other files (a README describing
/// the source's format, a routing history of another container, notes, numpy dumps) are
/// not the container's.
pub fn is_container_sidecar(name: &str) -> bool {
    const EXACT: [&str; 8] = [
        "generation_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.json",
        "preprocessor_config.json",
    ];
    !name.starts_with('.')
        && (EXACT.contains(&name)
            || name.starts_with("tokenizer")
            || name.ends_with(".jinja")
            || name.starts_with("LICENSE")
            || name.starts_with("LICENCE"))
}

#[cfg(test)]
mod tests;
