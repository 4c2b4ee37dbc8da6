//! Synthetic expert containers: safetensors shards of random int4/int8 experts in the layout
//! of our converter (gate, up, down and their `.qs` scales adjacent, one expert after the
//! other), plus a `config.json` that [`Container::open`](crate::container::Container::open)
//! accepts. Not used by inference: the store's tests, `tools/make_synthetic.rs`, the
//! replay and `benches/` write them (GLM-5.2 expert shapes: hidden
//! 6144, moe_intermediate 2048, int4-gs64 = 21,233,664 bytes per expert).
//!
//! The bytes are a deterministic function of (seed, layer, expert, tensor), so two
//! containers written with the same spec are identical.

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use super::source::{fnv1a, ByteRange, ExpertLoc, MatrixLoc, StaticSource, FNV_OFFSET};
use crate::container::names::expert_tensor_name;
use crate::container::safetensors::{write_header, TensorSpec};
use crate::container::{Dtype, Proj, SCALES_SUFFIX};
use crate::error::{Error, Result};
use crate::quant::QuantFormat;

/// What to write.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthSpec {
    pub hidden: usize,
    pub moe_intermediate: usize,
    pub n_routed_experts: usize,
    /// Main decoder layers; the first `first_k_dense_replace` are dense (no experts).
    pub num_hidden_layers: usize,
    pub first_k_dense_replace: usize,
    /// Add an MTP layer (index `num_hidden_layers`) with its own experts.
    pub mtp: bool,
    /// A quantised format (int8 / int4 / int4 grouped).
    pub format: QuantFormat,
    pub experts_per_shard: usize,
    pub seed: u64,
    /// Put a 2-byte tensor first so that every scale is 4-byte misaligned in the file.
    pub misalign: bool,
    /// Also write the dense part (embeddings, attention, norms, routers, shared experts, dense
    /// MLPs, MTP head) with random weights, so the directory is a complete loadable model.
    pub dense: bool,
    /// GLM-5.2 attention and dense dimensions in `config.json` (64 heads, q_lora 2048,
    /// kv_lora 512, intermediate 12288...); otherwise tiny ones.
    pub glm_dims: bool,
    /// Vocabulary size in `config.json` (small: the synthetic model has no tokenizer).
    pub vocab_size: usize,
    /// GLM DSA `index_topk_freq`: 1 gives every layer its own indexer; GLM-5.2 has 4 (21 full
    /// and 57 shared of 78 layers).
    pub index_topk_freq: usize,
    /// GLM DSA `index_skip_topk_offset` (transformers' default 2).
    pub index_skip_topk_offset: usize,
    /// `max_position_embeddings` in `config.json`.
    pub max_position_embeddings: usize,
}

impl SynthSpec {
    /// GLM-5.2 expert shapes at int4-gs64, `moe_layers` MoE layers of `experts` experts.
    pub fn glm52(moe_layers: usize, experts: usize) -> Self {
        SynthSpec {
            hidden: 6144,
            moe_intermediate: 2048,
            n_routed_experts: experts,
            num_hidden_layers: moe_layers,
            first_k_dense_replace: 0,
            mtp: false,
            format: QuantFormat::Int4Grouped { group_size: 64 },
            experts_per_shard: 64,
            seed: 1,
            misalign: false,
            dense: false,
            glm_dims: true,
            vocab_size: 1024,
            index_topk_freq: 1,
            index_skip_topk_offset: 2,
            max_position_embeddings: 4096,
        }
    }

    /// A small spec for tests.
    pub fn tiny(format: QuantFormat) -> Self {
        SynthSpec {
            hidden: 64,
            moe_intermediate: 32,
            n_routed_experts: 8,
            num_hidden_layers: 3,
            first_k_dense_replace: 1,
            mtp: true,
            format,
            experts_per_shard: 5,
            seed: 7,
            misalign: false,
            dense: false,
            glm_dims: false,
            vocab_size: 256,
            index_topk_freq: 1,
            index_skip_topk_offset: 2,
            max_position_embeddings: 4096,
        }
    }

    /// Layer indices with routed experts.
    pub fn moe_layers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = (self.first_k_dense_replace..self.num_hidden_layers).collect();
        if self.mtp {
            v.push(self.num_hidden_layers);
        }
        v
    }

    /// A `config.json` for these shapes (GLM-5 family, `glm_moe_dsa`).
    pub fn config_json(&self) -> String {
        // (heads, q_lora, kv_lora, nope, rope, v, intermediate, index_head_dim, index_heads)
        let d = if self.glm_dims {
            (64, 2048, 512, 192, 64, 256, 12288, 128, 32)
        } else {
            (2, 32, 32, 16, 8, 16, 2 * self.moe_intermediate, 16, 2)
        };
        serde_json::json!({
            "model_type": "glm_moe_dsa",
            "architectures": ["GlmMoeDsaForCausalLM"],
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden,
            "intermediate_size": d.6,
            "moe_intermediate_size": self.moe_intermediate,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": d.0,
            "num_key_value_heads": d.0,
            "q_lora_rank": d.1,
            "kv_lora_rank": d.2,
            "qk_nope_head_dim": d.3,
            "qk_rope_head_dim": d.4,
            "v_head_dim": d.5,
            "n_routed_experts": self.n_routed_experts,
            "num_experts_per_tok": self.n_routed_experts.min(8),
            "n_shared_experts": 1,
            "n_group": 1,
            "topk_group": 1,
            "norm_topk_prob": true,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": self.first_k_dense_replace,
            "num_nextn_predict_layers": usize::from(self.mtp),
            "index_head_dim": d.7,
            "index_n_heads": d.8,
            "index_topk": 2048,
            "index_topk_freq": self.index_topk_freq,
            "index_skip_topk_offset": self.index_skip_topk_offset,
            "rms_norm_eps": 1e-5,
            "rope_theta": 1000000.0,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": false,
            "bos_token_id": 0,
            "eos_token_id": 1
        })
        .to_string()
    }
}

/// Deterministic pseudo-random bytes (splitmix64).
struct Rng(u64);

impl Rng {
    fn new(seed: u64, layer: usize, expert: usize, which: usize) -> Self {
        let k = [seed, layer as u64, expert as u64, which as u64];
        let mut h = FNV_OFFSET;
        for x in k {
            h = fnv1a(&x.to_le_bytes(), h);
        }
        Rng(h)
    }
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn fill(&mut self, out: &mut [u8]) {
        let mut chunks = out.chunks_exact_mut(8);
        for c in &mut chunks {
            c.copy_from_slice(&self.next().to_le_bytes());
        }
        let rest = chunks.into_remainder();
        let last = self.next().to_le_bytes();
        let n = rest.len();
        rest.copy_from_slice(&last[..n]);
    }
    /// Positive finite scales in [1e-3, 1.1e-2).
    fn fill_scales(&mut self, out: &mut [u8]) {
        for c in out.chunks_exact_mut(4) {
            let s = 1e-3 + (self.next() % 10_000) as f32 * 1e-6;
            c.copy_from_slice(&s.to_le_bytes());
        }
    }
}

/// (rows, cols) of an expert's gate, up and down projections, in that order.
type ExpertShapes = [(Proj, usize, usize); 3];

/// Which bytes a shard's tensor holds: `None` for the misalignment pad, else
/// (layer, expert, which) with which = 2·projection + is_scales.
type TensorFill = Option<(usize, usize, usize)>;

/// Each (layer, expert)'s byte ranges in one shard, in tensor order.
type ExpertRanges = BTreeMap<(usize, usize), Vec<ByteRange>>;

/// Write `config.json` and the expert shards into `dir` (created if needed). Returns the
/// table of where every expert is.
pub fn write(dir: &Path, spec: &SynthSpec) -> Result<StaticSource> {
    let f = spec.format;
    if !f.is_quantized() {
        return Err(Error::invalid(
            "format",
            "synthetic experts must be quantised",
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| Error::io(dir, e))?;
    let cfg_path = dir.join("config.json");
    std::fs::write(&cfg_path, spec.config_json()).map_err(|e| Error::io(&cfg_path, e))?;
    let shapes: ExpertShapes = [
        (Proj::Gate, spec.moe_intermediate, spec.hidden),
        (Proj::Up, spec.moe_intermediate, spec.hidden),
        (Proj::Down, spec.hidden, spec.moe_intermediate),
    ];
    let all: Vec<(usize, usize)> = spec
        .moe_layers()
        .into_iter()
        .flat_map(|l| (0..spec.n_routed_experts).map(move |e| (l, e)))
        .collect();
    let mut files = Vec::new();
    let mut layers: BTreeMap<usize, Vec<ExpertLoc>> = BTreeMap::new();
    let mut fp = fnv1a(spec.config_json().as_bytes(), FNV_OFFSET);
    for (si, chunk) in all.chunks(spec.experts_per_shard.max(1)).enumerate() {
        let path: PathBuf = dir.join(format!("experts-{si:05}.safetensors"));
        let (specs, fills) = shard_tensors(spec, chunk, &shapes);
        let (size, locs) = write_shard(&path, spec, &specs, &fills, files.len())?;
        fp = fnv1a(&size.to_le_bytes(), fp);
        for ((l, e), r) in locs {
            let v = layers.entry(l).or_default();
            debug_assert_eq!(v.len(), e);
            v.push(expert_loc(l, e, &r, f, &shapes));
        }
        files.push(path);
    }
    if spec.dense {
        write_dense(dir, spec)?;
        write_tokenizer(dir, spec.vocab_size)?;
    }
    Ok(StaticSource {
        dir: dir.to_path_buf(),
        files,
        fingerprint: format!("{fp:016x}"),
        num_layers: spec.num_hidden_layers + usize::from(spec.mtp),
        layers,
    })
}

/// The tensors of one shard holding `chunk`'s (layer, expert) pairs: each projection's
/// packed data and its scales, after a 2-byte pad when the spec asks for misalignment.
fn shard_tensors(
    spec: &SynthSpec,
    chunk: &[(usize, usize)],
    shapes: &ExpertShapes,
) -> (Vec<TensorSpec>, Vec<TensorFill>) {
    let f = spec.format;
    let mut specs = Vec::new();
    let mut fills = Vec::new();
    if spec.misalign {
        specs.push(TensorSpec {
            name: "colibri.synthetic.pad".into(),
            dtype: Dtype::U8,
            shape: vec![2],
        });
        fills.push(None);
    }
    for &(l, e) in chunk {
        for (p, (proj, rows, cols)) in shapes.iter().enumerate() {
            let name = expert_tensor_name(l, e, *proj);
            let nbytes = f.data_bytes(*rows, *cols).unwrap_or(0);
            let nscales = f.scale_count(*rows, *cols).unwrap_or(0);
            specs.push(TensorSpec {
                name: name.clone(),
                dtype: Dtype::U8,
                shape: vec![nbytes],
            });
            fills.push(Some((l, e, 2 * p)));
            specs.push(TensorSpec {
                name: format!("{name}{SCALES_SUFFIX}"),
                dtype: Dtype::F32,
                shape: vec![nscales],
            });
            fills.push(Some((l, e, 2 * p + 1)));
        }
    }
    (specs, fills)
}

/// The shard header's metadata: the container format version, and each packed tensor's
/// quantisation format.
fn shard_metadata(specs: &[TensorSpec], f: QuantFormat) -> BTreeMap<String, String> {
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    meta.insert(
        crate::container::FORMAT_VERSION_KEY.to_string(),
        crate::container::FORMAT_VERSION.to_string(),
    );
    for s in specs {
        if s.dtype == Dtype::U8 && !s.name.starts_with("colibri.") {
            meta.insert(s.name.clone(), f.name());
        }
    }
    meta
}

/// Write one shard: the header, then every tensor's seeded bytes, synced to disk. Returns the
/// file's size and each expert's byte ranges (gate, gate scales, up, …, in tensor order).
fn write_shard(
    path: &Path,
    spec: &SynthSpec,
    specs: &[TensorSpec],
    fills: &[TensorFill],
    file_idx: usize,
) -> Result<(u64, ExpertRanges)> {
    let header = write_header(specs, &shard_metadata(specs, spec.format));
    let file = std::fs::File::create(path).map_err(|e| Error::io(path, e))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
    w.write_all(&header).map_err(|e| Error::io(path, e))?;
    let mut offset = header.len() as u64;
    let mut buf = Vec::new();
    let mut locs = ExpertRanges::new();
    for (s, g) in specs.iter().zip(fills) {
        let n = s.nbytes();
        buf.resize(n, 0);
        match g {
            None => buf.fill(0),
            Some((l, e, which)) => {
                let mut rng = Rng::new(spec.seed, *l, *e, *which);
                if which % 2 == 0 {
                    rng.fill(&mut buf);
                } else {
                    rng.fill_scales(&mut buf);
                }
                locs.entry((*l, *e)).or_default().push(ByteRange {
                    file: file_idx,
                    offset,
                    len: n as u64,
                });
            }
        }
        w.write_all(&buf).map_err(|e| Error::io(path, e))?;
        offset += n as u64;
    }
    let file = w
        .into_inner()
        .map_err(|e| Error::io(path, e.into_error()))?;
    // Durable and clean, so cold-cache benches can drop the pages (DONTNEED skips dirty ones).
    file.sync_all().map_err(|e| Error::io(path, e))?;
    Ok((offset, locs))
}

/// Where expert `e` of layer `l` is, from its six byte ranges in tensor order.
fn expert_loc(
    l: usize,
    e: usize,
    r: &[ByteRange],
    f: QuantFormat,
    shapes: &ExpertShapes,
) -> ExpertLoc {
    let m = |i: usize| {
        let (proj, rows, cols) = shapes[i];
        MatrixLoc {
            name: expert_tensor_name(l, e, proj),
            format: f,
            rows,
            cols,
            data: r[2 * i],
            scales: Some(r[2 * i + 1]),
        }
    };
    ExpertLoc {
        gate: m(0),
        up: m(1),
        down: m(2),
    }
}

/// Standard normal samples (Box-Muller on the splitmix stream).
fn normals(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    let mut v = Vec::with_capacity(n + 1);
    while v.len() < n {
        let u1 = ((rng.next() >> 11) as f64 + 1.0) / (1u64 << 53) as f64;
        let u2 = (rng.next() >> 11) as f64 / (1u64 << 53) as f64;
        let r = (-2.0 * u1.ln()).sqrt();
        let t = std::f64::consts::TAU * u2;
        v.push((r * t.cos()) as f32 * scale);
        v.push((r * t.sin()) as f32 * scale);
    }
    v.truncate(n);
    v
}

/// The dense part of the model in one shard `dense-00000.safetensors`: random weights with
/// std 1/sqrt(I) (int8 per-row for embeddings, lm_head, the DSA indexers and the MTP layer,
/// int4-gs64 otherwise), norms 1, router weights F32, correction bias and norm biases 0.
fn write_dense(dir: &Path, spec: &SynthSpec) -> Result<()> {
    use crate::config::ModelConfig;
    use crate::container::names::{classify, expected_len, expected_names, expected_shape};
    use crate::container::Role;
    let cfg = ModelConfig::from_json_str(&spec.config_json(), dir.join("config.json"))?;
    let path = dir.join("dense-00000.safetensors");
    let mut specs = Vec::new();
    let mut blobs: Vec<Vec<u8>> = Vec::new();
    let mut meta = BTreeMap::new();
    meta.insert("format".to_string(), "pt".to_string());
    meta.insert(
        crate::container::FORMAT_VERSION_KEY.to_string(),
        crate::container::FORMAT_VERSION.to_string(),
    );
    for (k, name) in expected_names(&cfg).into_iter().enumerate() {
        let role = classify(&cfg, &name);
        if role.role == Role::RoutedExpert {
            continue;
        }
        let mut rng = Rng::new(spec.seed ^ 0xd5e5, k, 0, 0);
        let f32_bytes = |v: &[f32]| -> Vec<u8> { bytemuck::cast_slice(v).to_vec() };
        match (role.role, expected_shape(&cfg, &name)) {
            (Role::Router, Some((o, i))) => {
                let w = normals(&mut rng, o * i, 1.0 / (i as f32).sqrt());
                specs.push(TensorSpec {
                    name: name.clone(),
                    dtype: Dtype::F32,
                    shape: vec![o, i],
                });
                blobs.push(f32_bytes(&w));
            }
            (_, Some((o, i))) => {
                let int8 = matches!(role.role, Role::Embed | Role::LmHead | Role::Indexer)
                    || role.layer.is_some_and(|l| cfg.is_mtp_layer(l));
                let f = if int8 {
                    QuantFormat::Int8PerRow
                } else {
                    QuantFormat::Int4Grouped { group_size: 64 }
                };
                let w = normals(&mut rng, o * i, 1.0 / (i as f32).sqrt());
                let p = crate::quant::pack::quantize(f, &name, &w, o, i)?;
                meta.insert(name.clone(), f.name());
                specs.push(TensorSpec {
                    name: name.clone(),
                    dtype: Dtype::U8,
                    shape: vec![p.data.len()],
                });
                blobs.push(p.data);
                specs.push(TensorSpec {
                    name: format!("{name}{SCALES_SUFFIX}"),
                    dtype: Dtype::F32,
                    shape: vec![p.scales.len()],
                });
                blobs.push(f32_bytes(&p.scales));
            }
            (r, None) => {
                let n = expected_len(&cfg, &name).ok_or_else(|| {
                    Error::Internal(format!("synthetic model: no shape known for '{name}'"))
                })?;
                let v: Vec<f32> = if r == Role::RouterBias || name.ends_with(".bias") {
                    vec![0.0; n]
                } else {
                    vec![1.0; n]
                };
                specs.push(TensorSpec {
                    name: name.clone(),
                    dtype: Dtype::F32,
                    shape: vec![n],
                });
                blobs.push(f32_bytes(&v));
            }
        }
    }
    let header = write_header(&specs, &meta);
    let file = std::fs::File::create(&path).map_err(|e| Error::io(&path, e))?;
    let mut w = std::io::BufWriter::with_capacity(8 << 20, file);
    w.write_all(&header).map_err(|e| Error::io(&path, e))?;
    for b in &blobs {
        w.write_all(b).map_err(|e| Error::io(&path, e))?;
    }
    let file = w
        .into_inner()
        .map_err(|e| Error::io(&path, e.into_error()))?;
    file.sync_all().map_err(|e| Error::io(&path, e))
}

/// A word-level `tokenizer.json` for the synthetic vocabulary: `<s>` (0, bos), `</s>` (1,
/// eos), `<unk>` (2) and `t3` … `t{vocab-1}`, split on whitespace — enough for the Python
/// API to encode prompts like "t5 t17 t300" and decode ids.
fn write_tokenizer(dir: &Path, vocab: usize) -> Result<()> {
    let mut v = serde_json::Map::new();
    for i in 0..vocab {
        let tok = match i {
            0 => "<s>".to_string(),
            1 => "</s>".to_string(),
            2 => "<unk>".to_string(),
            _ => format!("t{i}"),
        };
        v.insert(tok, serde_json::Value::from(i));
    }
    let tj = serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": [],
        "normalizer": null,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": null,
        "decoder": null,
        "model": {"type": "WordLevel", "vocab": v, "unk_token": "<unk>"}
    });
    let path = dir.join("tokenizer.json");
    std::fs::write(&path, tj.to_string()).map_err(|e| Error::io(&path, e))?;
    let cfg = serde_json::json!({"bos_token": "<s>", "eos_token": "</s>", "unk_token": "<unk>"});
    let path = dir.join("tokenizer_config.json");
    std::fs::write(&path, cfg.to_string()).map_err(|e| Error::io(&path, e))
}
