//! `config.json` → [`ModelConfig`]: the two supported families (`deepseek_v3`,
//! `glm_moe_dsa`), their defaults (taken from transformers' `configuration_deepseek_v3.py`
//! and `configuration_glm_moe_dsa.py`), validation, and the derived quantities the forward
//! pass needs (head dims, MoE layer pattern, MTP index).
//!
//! The JSON is read through a serde schema of the Hugging Face config ([`HfConfig`], in
//! `hf.rs`; every error names the offending field and the file) and turned into a validated
//! [`ModelConfig`] by `TryFrom`. YaRN's math lives with the rope, in `model/rope.rs`.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

mod hf;

pub use hf::HfConfig;
use hf::{IndexerType, MlpLayerType};

/// The model families colibri runs, by their `model_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum ModelFamily {
    /// `deepseek_v3` (DeepSeek-V3 / R1 / V3.1 and their tiny test variants).
    DeepseekV3,
    /// `glm_moe_dsa` (GLM-5.x: DeepSeek-V3 layout plus the DSA lightning indexer).
    GlmMoeDsa,
}

/// The `model_type` strings colibri accepts, for error messages.
pub const SUPPORTED_MODEL_TYPES: [&str; 2] = ["deepseek_v3", "glm_moe_dsa"];

impl ModelFamily {
    /// Family for a `model_type` string.
    pub fn from_model_type(model_type: &str) -> Option<Self> {
        match model_type {
            "deepseek_v3" => Some(ModelFamily::DeepseekV3),
            "glm_moe_dsa" => Some(ModelFamily::GlmMoeDsa),
            _ => None,
        }
    }

    /// The `model_type` string of this family.
    pub fn model_type(self) -> &'static str {
        match self {
            ModelFamily::DeepseekV3 => "deepseek_v3",
            ModelFamily::GlmMoeDsa => "glm_moe_dsa",
        }
    }
}

impl std::fmt::Display for ModelFamily {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.model_type())
    }
}

/// How router logits become scores. Only `sigmoid` (both families) is implemented;
/// other values are refused at load time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScoringFunc {
    Sigmoid,
}

/// How experts are chosen. Only `noaux_tc` (bias-corrected, group-limited top-k; both
/// families) is implemented; other values are refused at load time.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TopkMethod {
    NoauxTc,
}

/// YaRN rope scaling (`rope_scaling` / `rope_parameters` with `rope_type: "yarn"`).
/// `mscale` and `mscale_all_dim` are 0.0 when absent (transformers treats 0 and absent alike).
#[derive(Debug, Clone, PartialEq)]
pub struct RopeScaling {
    pub factor: f64,
    pub original_max_position_embeddings: usize,
    /// Default 32.
    pub beta_fast: f64,
    /// Default 1.
    pub beta_slow: f64,
    pub mscale: f64,
    pub mscale_all_dim: f64,
    /// Explicit cos/sin scaling; when `None` use [`RopeScaling::attention_factor`] (in
    /// `model/rope.rs`, with the rest of YaRN's math).
    pub attention_factor: Option<f64>,
    /// Whether the correction range is floored/ceiled (transformers default true).
    pub truncate: bool,
}

/// A validated model configuration. Field names follow the Hugging Face `config.json`.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub family: ModelFamily,
    /// Where the config was read from (for error messages); empty when parsed from a string
    /// without a path.
    pub path: PathBuf,
    pub vocab_size: usize,
    pub hidden_size: usize,
    /// Dense MLP width (layers < `first_k_dense_replace`).
    pub intermediate_size: usize,
    /// Width of one routed (and each shared) expert.
    pub moe_intermediate_size: usize,
    /// Width of the MTP layers' experts when it differs from `moe_intermediate_size`
    /// (`colibri_mtp_moe_intermediate_size`). Real checkpoints never set it: only the disk
    /// stand-ins of `tools/make_standin.py`, whose main experts are padded to full size while
    /// the MTP layer keeps its own, so that a draft step costs what it costs in GLM-5 (one
    /// layer of ~79) and not a quarter of a token (one of 5). Use [`Self::moe_intermediate`].
    pub mtp_moe_intermediate_size: Option<usize>,
    /// Main decoder layers (the MTP layers come after, at index `num_hidden_layers`…).
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    /// `None` when `q_lora_rank` is null: attention uses a plain `q_proj`.
    pub q_lora_rank: Option<usize>,
    pub kv_lora_rank: usize,
    pub qk_nope_head_dim: usize,
    pub qk_rope_head_dim: usize,
    pub v_head_dim: usize,
    pub n_routed_experts: usize,
    pub num_experts_per_tok: usize,
    pub n_shared_experts: usize,
    pub first_k_dense_replace: usize,
    /// Always 1 (other values are refused, as transformers ignores the field).
    pub moe_layer_freq: usize,
    pub n_group: usize,
    pub topk_group: usize,
    pub norm_topk_prob: bool,
    pub routed_scaling_factor: f32,
    pub rms_norm_eps: f32,
    pub rope_theta: f64,
    pub rope_scaling: Option<RopeScaling>,
    /// Interleaved rope pairs (x0,x1),(x2,x3)… when true, half-split when false. GLM-MoE-DSA
    /// always interleaves (transformers ignores the field for it).
    pub rope_interleave: bool,
    pub tie_word_embeddings: bool,
    pub max_position_embeddings: usize,
    /// Number of MTP layers in the checkpoint (`num_nextn_predict_layers`, alias `num_mtp_layers`).
    pub num_nextn_predict_layers: usize,
    pub scoring_func: ScoringFunc,
    pub topk_method: TopkMethod,
    /// GLM DSA: keys selected per query by the lightning indexer; `None` for DeepSeek-V3.
    pub index_topk: Option<usize>,
    /// GLM DSA indexer head dim (default 128); 0 for DeepSeek-V3.
    pub index_head_dim: usize,
    /// GLM DSA indexer heads (default 32); 0 for DeepSeek-V3.
    pub index_n_heads: usize,
    /// GLM: per-layer MLP kind from `mlp_layer_types` (true = MoE), when the config lists it.
    pub mlp_layer_types: Option<Vec<bool>>,
    /// GLM DSA: per main layer, whether it runs its own indexer ("full", true) or reuses the
    /// previous full layer's selection ("shared"), derived as transformers does. Empty for
    /// DeepSeek-V3.
    pub indexer_full: Vec<bool>,
    pub bos_token_id: Option<u32>,
    /// One or more end-of-sequence ids (`eos_token_id` may be an int or a list).
    pub eos_token_ids: Vec<u32>,
    pub pad_token_id: Option<u32>,
}

/// Upper bound on every size field (far above any real model; keeps shape products in range).
pub const MAX_DIM: usize = 1 << 24;

/// Family-specific defaults (transformers' config classes).
struct Defaults {
    q_lora_rank: Option<usize>,
    n_group: usize,
    topk_group: usize,
    first_k_dense_replace: usize,
    rms_norm_eps: f64,
    max_position_embeddings: usize,
    num_nextn_predict_layers: usize,
    rope_interleave: bool,
}

fn defaults(family: ModelFamily) -> Defaults {
    match family {
        ModelFamily::DeepseekV3 => Defaults {
            q_lora_rank: Some(1536),
            n_group: 8,
            topk_group: 4,
            first_k_dense_replace: 3,
            rms_norm_eps: 1e-6,
            max_position_embeddings: 4096,
            num_nextn_predict_layers: 1,
            rope_interleave: true,
        },
        ModelFamily::GlmMoeDsa => Defaults {
            q_lora_rank: Some(2048),
            n_group: 1,
            topk_group: 1,
            first_k_dense_replace: 3,
            rms_norm_eps: 1e-5,
            max_position_embeddings: 202752,
            num_nextn_predict_layers: 0,
            rope_interleave: true,
        },
    }
}

/// An [`Error::Config`] naming `field` of the config at `path`.
fn field_error(path: &Path, field: &str, msg: impl std::fmt::Display) -> Error {
    Error::Config {
        path: path.to_path_buf(),
        msg: format!("field '{field}': {msg}"),
    }
}

/// An [`Error::Unsupported`] for something the config at `path` asks for.
fn unsupported(path: &Path, what: impl std::fmt::Display) -> Error {
    Error::Unsupported(format!("{}: {what}", path.display()))
}

/// The HF schema → a validated [`ModelConfig`]: the family's defaults for absent fields, the
/// aliases resolved (`n_routed_experts` before `num_local_experts`, `num_nextn_predict_layers`
/// before `num_mtp_layers`, `rope_parameters` before `rope_scaling`), unsupported features
/// refused, then [`ModelConfig::validate`].
impl TryFrom<HfConfig> for ModelConfig {
    type Error = Error;

    fn try_from(h: HfConfig) -> Result<Self> {
        let path = h.path.as_path();
        let required = |field: &str, v: Option<usize>| {
            v.ok_or_else(|| field_error(path, field, "missing (required)"))
        };
        let model_type = h.model_type.as_deref().ok_or_else(|| {
            field_error(
                path,
                "model_type",
                format!(
                    "missing; colibri supports {}",
                    SUPPORTED_MODEL_TYPES.join(", ")
                ),
            )
        })?;
        let family = ModelFamily::from_model_type(model_type).ok_or_else(|| {
            unsupported(
                path,
                format!(
                    "model_type '{model_type}' is not supported; colibri runs {}",
                    SUPPORTED_MODEL_TYPES.join(" and ")
                ),
            )
        })?;
        let d = defaults(family);
        let max_position_embeddings = h
            .max_position_embeddings
            .unwrap_or(d.max_position_embeddings);
        let (rope_theta, rope_scaling) = rope(&h, max_position_embeddings)?;

        let scoring_func = match h.scoring_func.as_deref().unwrap_or("sigmoid") {
            "sigmoid" => ScoringFunc::Sigmoid,
            other => {
                return Err(unsupported(
                    path,
                    format!("scoring_func '{other}' is not supported (only 'sigmoid')"),
                ))
            }
        };
        let topk_method = match h.topk_method.as_deref().unwrap_or("noaux_tc") {
            "noaux_tc" => TopkMethod::NoauxTc,
            other => {
                return Err(unsupported(
                    path,
                    format!("topk_method '{other}' is not supported (only 'noaux_tc')"),
                ))
            }
        };
        if let Some(act) = h.hidden_act.as_deref().filter(|&a| a != "silu") {
            return Err(unsupported(
                path,
                format!("hidden_act '{act}' is not supported (only 'silu')"),
            ));
        }
        if h.attention_bias == Some(true) {
            return Err(unsupported(path, "attention_bias = true is not supported"));
        }

        let num_hidden_layers = required("num_hidden_layers", h.num_hidden_layers)?;
        let is_glm = family == ModelFamily::GlmMoeDsa;
        let indexer_full = if is_glm {
            indexer_kinds(&h, num_hidden_layers)?
        } else {
            Vec::new()
        };
        let cfg = ModelConfig {
            family,
            path: h.path.clone(),
            vocab_size: required("vocab_size", h.vocab_size)?,
            hidden_size: required("hidden_size", h.hidden_size)?,
            intermediate_size: required("intermediate_size", h.intermediate_size)?,
            moe_intermediate_size: required("moe_intermediate_size", h.moe_intermediate_size)?,
            mtp_moe_intermediate_size: h.colibri_mtp_moe_intermediate_size,
            num_hidden_layers,
            num_attention_heads: required("num_attention_heads", h.num_attention_heads)?,
            // Explicit null → plain q_proj; absent → the family's default.
            q_lora_rank: h.q_lora_rank.unwrap_or(d.q_lora_rank),
            kv_lora_rank: required("kv_lora_rank", h.kv_lora_rank)?,
            qk_nope_head_dim: required("qk_nope_head_dim", h.qk_nope_head_dim)?,
            qk_rope_head_dim: required("qk_rope_head_dim", h.qk_rope_head_dim)?,
            v_head_dim: required("v_head_dim", h.v_head_dim)?,
            n_routed_experts: required(
                "n_routed_experts",
                h.n_routed_experts.or(h.num_local_experts),
            )?,
            num_experts_per_tok: required("num_experts_per_tok", h.num_experts_per_tok)?,
            n_shared_experts: h.n_shared_experts.unwrap_or(1),
            first_k_dense_replace: h.first_k_dense_replace.unwrap_or(d.first_k_dense_replace),
            moe_layer_freq: h.moe_layer_freq.unwrap_or(1),
            n_group: h.n_group.unwrap_or(d.n_group),
            topk_group: h.topk_group.unwrap_or(d.topk_group),
            norm_topk_prob: h.norm_topk_prob.unwrap_or(true),
            routed_scaling_factor: h.routed_scaling_factor.unwrap_or(2.5) as f32,
            rms_norm_eps: h.rms_norm_eps.unwrap_or(d.rms_norm_eps) as f32,
            rope_theta,
            rope_scaling,
            // GLM-MoE-DSA always interleaves (transformers ignores the field for it).
            rope_interleave: is_glm || h.rope_interleave.unwrap_or(d.rope_interleave),
            tie_word_embeddings: h.tie_word_embeddings.unwrap_or(false),
            max_position_embeddings,
            num_nextn_predict_layers: h
                .num_nextn_predict_layers
                .or(h.num_mtp_layers)
                .unwrap_or(d.num_nextn_predict_layers),
            scoring_func,
            topk_method,
            index_topk: is_glm.then(|| h.index_topk.unwrap_or(2048)),
            index_head_dim: if is_glm {
                h.index_head_dim.unwrap_or(128)
            } else {
                0
            },
            index_n_heads: if is_glm {
                h.index_n_heads.unwrap_or(32)
            } else {
                0
            },
            mlp_layer_types: h
                .mlp_layer_types
                .map(|t| t.iter().map(|&k| k == MlpLayerType::Sparse).collect()),
            indexer_full,
            bos_token_id: h.bos_token_id,
            eos_token_ids: h.eos_token_id.unwrap_or_default(),
            pad_token_id: h.pad_token_id,
        };
        cfg.validate()?;
        Ok(cfg)
    }
}

/// `rope_theta` and the YaRN parameters. transformers ≥ 5 writes `rope_parameters` (with
/// `rope_theta` and `rope_type` inside); older configs write `rope_scaling` plus a top-level
/// `rope_theta`. `max_position_embeddings` gives YaRN's factor when the config has none.
fn rope(h: &HfConfig, max_position_embeddings: usize) -> Result<(f64, Option<RopeScaling>)> {
    let path = h.path.as_path();
    let (field, r) = match (&h.rope_parameters, &h.rope_scaling) {
        (Some(r), _) => ("rope_parameters", Some(r)),
        (None, r) => ("rope_scaling", r.as_ref()),
    };
    let rope_theta = r.and_then(|r| r.rope_theta).or(h.rope_theta);
    let rope_theta = rope_theta.unwrap_or(10_000.0);
    let Some(r) = r else {
        return Ok((rope_theta, None));
    };
    match r
        .rope_type
        .as_deref()
        .or(r.legacy_type.as_deref())
        .unwrap_or("default")
    {
        "default" => Ok((rope_theta, None)),
        "yarn" => {
            let original = r.original_max_position_embeddings.ok_or_else(|| {
                field_error(
                    path,
                    &format!("{field}.original_max_position_embeddings"),
                    "missing (required for yarn)",
                )
            })?;
            let factor = match r.factor {
                Some(x) => x,
                None if original > 0 => max_position_embeddings as f64 / original as f64,
                None => 0.0,
            };
            if factor <= 0.0 || original == 0 {
                return Err(field_error(
                    path,
                    &format!("{field}.factor"),
                    "yarn needs factor > 0 and original_max_position_embeddings > 0",
                ));
            }
            // transformers treats 0 and absent alike for the betas.
            let nonzero_or =
                |x: Option<f64>, default: f64| x.filter(|&v| v != 0.0).unwrap_or(default);
            Ok((
                rope_theta,
                Some(RopeScaling {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: nonzero_or(r.beta_fast, 32.0),
                    beta_slow: nonzero_or(r.beta_slow, 1.0),
                    mscale: r.mscale.unwrap_or(0.0),
                    mscale_all_dim: r.mscale_all_dim.unwrap_or(0.0),
                    attention_factor: r.attention_factor,
                    truncate: r.truncate.unwrap_or(true),
                }),
            ))
        }
        other => Err(unsupported(
            path,
            format!("{field}.rope_type '{other}' is not supported (only 'default' and 'yarn')"),
        )),
    }
}

/// GLM DSA's per-layer indexer kinds (true = "full"), as transformers'
/// `GlmMoeDsaConfig.__post_init__` derives them: an explicit `indexer_types` list, else
/// `index_topk_pattern` (a string of `F`/`S` or a list), else the schedule
/// `full ⇔ max(i − index_skip_topk_offset + 1, 0) mod max(index_topk_freq, 1) = 0`
/// (defaults: freq 1, offset 2, i.e. every layer full). GLM-5.2: freq 4 → 21 full, 57 shared.
fn indexer_kinds(h: &HfConfig, layers: usize) -> Result<Vec<bool>> {
    let (field, kinds) = match (&h.indexer_types, &h.index_topk_pattern) {
        (Some(k), _) => ("indexer_types", k),
        (None, Some(k)) => ("index_topk_pattern", k),
        (None, None) => {
            let freq = h.index_topk_freq.unwrap_or(1).max(1);
            let offset = h.index_skip_topk_offset.unwrap_or(2);
            return Ok((0..layers)
                .map(|i| (i + 1).saturating_sub(offset).is_multiple_of(freq))
                .collect());
        }
    };
    if kinds.len() < layers {
        return Err(field_error(
            &h.path,
            field,
            format!(
                "has {} entries for num_hidden_layers = {layers}",
                kinds.len()
            ),
        ));
    }
    Ok(kinds[..layers]
        .iter()
        .map(|&k| k == IndexerType::Full)
        .collect())
}

impl ModelConfig {
    /// Width of one routed (and each shared) expert of `layer`: the MTP layers
    /// (`layer >= num_hidden_layers`) may have their own (see `mtp_moe_intermediate_size`).
    pub fn moe_intermediate(&self, layer: usize) -> usize {
        match self.mtp_moe_intermediate_size {
            Some(w) if layer >= self.num_hidden_layers => w,
            _ => self.moe_intermediate_size,
        }
    }

    /// Read and validate `config.json` at `path`.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|e| Error::io(path, e))?;
        Self::from_json_str(&text, path)
    }

    /// Parse and validate a `config.json` text; `path` is only used in error messages.
    pub fn from_json_str(s: &str, path: impl AsRef<Path>) -> Result<Self> {
        HfConfig::parse(s, path.as_ref())?.try_into()
    }

    fn bad(&self, field: &str, msg: impl std::fmt::Display) -> Error {
        field_error(&self.path, field, msg)
    }

    fn validate(&self) -> Result<()> {
        for (name, v) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            (
                "colibri_mtp_moe_intermediate_size",
                self.mtp_moe_intermediate_size.unwrap_or(1),
            ),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("n_routed_experts", self.n_routed_experts),
            ("num_experts_per_tok", self.num_experts_per_tok),
            ("n_group", self.n_group),
            ("topk_group", self.topk_group),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return Err(self.bad(name, "must be > 0"));
            }
        }
        // Bound every size so that shape products can never overflow (a hostile or corrupt
        // config must give an error, not wrapped arithmetic).
        for (name, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("moe_intermediate_size", self.moe_intermediate_size),
            (
                "colibri_mtp_moe_intermediate_size",
                self.mtp_moe_intermediate_size.unwrap_or(1),
            ),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("q_lora_rank", self.q_lora_rank.unwrap_or(1)),
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_nope_head_dim", self.qk_nope_head_dim),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("n_routed_experts", self.n_routed_experts),
            ("n_shared_experts", self.n_shared_experts),
            ("num_nextn_predict_layers", self.num_nextn_predict_layers),
            ("index_head_dim", self.index_head_dim),
            ("index_n_heads", self.index_n_heads),
            ("index_topk", self.index_topk.unwrap_or(1)),
        ] {
            if v > MAX_DIM {
                return Err(self.bad(name, format!("{v} exceeds the limit of {MAX_DIM}")));
            }
        }
        if self.q_lora_rank == Some(0) {
            return Err(self.bad("q_lora_rank", "must be > 0 or null"));
        }
        if u32::try_from(self.vocab_size).is_err() {
            return Err(self.bad("vocab_size", "must fit in 32 bits"));
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) {
            return Err(self.bad(
                "qk_rope_head_dim",
                format!(
                    "must be even (rope rotates pairs), got {}",
                    self.qk_rope_head_dim
                ),
            ));
        }
        if self.num_experts_per_tok > self.n_routed_experts {
            return Err(self.bad(
                "num_experts_per_tok",
                format!(
                    "{} exceeds n_routed_experts = {}",
                    self.num_experts_per_tok, self.n_routed_experts
                ),
            ));
        }
        if !self.n_routed_experts.is_multiple_of(self.n_group) {
            return Err(self.bad(
                "n_group",
                format!(
                    "n_routed_experts = {} is not divisible by n_group = {}",
                    self.n_routed_experts, self.n_group
                ),
            ));
        }
        if self.topk_group > self.n_group {
            return Err(self.bad(
                "topk_group",
                format!("{} exceeds n_group = {}", self.topk_group, self.n_group),
            ));
        }
        let per_group = self.n_routed_experts / self.n_group;
        if self.n_group > 1 && per_group < 2 {
            return Err(self.bad(
                "n_group",
                "group-limited routing scores a group by its top-2 experts, so each group needs ≥ 2",
            ));
        }
        if self.num_experts_per_tok > self.topk_group * per_group {
            return Err(self.bad(
                "num_experts_per_tok",
                format!(
                    "{} exceeds the {} experts left in the best topk_group = {} groups",
                    self.num_experts_per_tok,
                    self.topk_group * per_group,
                    self.topk_group
                ),
            ));
        }
        if self.first_k_dense_replace > self.num_hidden_layers {
            return Err(self.bad(
                "first_k_dense_replace",
                format!(
                    "{} exceeds num_hidden_layers = {}",
                    self.first_k_dense_replace, self.num_hidden_layers
                ),
            ));
        }
        if self.moe_layer_freq != 1 {
            return Err(Error::Unsupported(format!(
                "{}: moe_layer_freq = {} is not supported (only 1)",
                self.path.display(),
                self.moe_layer_freq
            )));
        }
        if let Some(types) = &self.mlp_layer_types {
            if types.len() != self.num_hidden_layers {
                return Err(self.bad(
                    "mlp_layer_types",
                    format!(
                        "has {} entries for num_hidden_layers = {}",
                        types.len(),
                        self.num_hidden_layers
                    ),
                ));
            }
        }
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(self.bad("rms_norm_eps", "must be a finite number > 0"));
        }
        if !(self.routed_scaling_factor > 0.0 && self.routed_scaling_factor.is_finite()) {
            return Err(self.bad("routed_scaling_factor", "must be a finite number > 0"));
        }
        if self.rope_theta <= 0.0 {
            return Err(self.bad("rope_theta", "must be > 0"));
        }
        if self.index_topk == Some(0) {
            return Err(self.bad("index_topk", "must be > 0"));
        }
        if self.family == ModelFamily::GlmMoeDsa {
            if self.index_head_dim == 0 || self.index_n_heads == 0 {
                return Err(self.bad(
                    "index_head_dim",
                    "index_head_dim and index_n_heads must be > 0",
                ));
            }
            if self.index_head_dim < self.qk_rope_head_dim {
                return Err(self.bad(
                    "index_head_dim",
                    format!(
                        "{} is smaller than qk_rope_head_dim = {} (the indexer ropes its first \
                         qk_rope_head_dim dims)",
                        self.index_head_dim, self.qk_rope_head_dim
                    ),
                ));
            }
            // transformers raises on a shared layer with no full layer before it; the MTP
            // layer (built as layer 0 of its own stack) takes the first entry too.
            if self.indexer_full.first() == Some(&false) {
                return Err(self.bad(
                    "indexer_types",
                    "layer 0 is 'shared' but no earlier full layer exists to share from",
                ));
            }
        }
        for (field, id) in self
            .bos_token_id
            .iter()
            .map(|i| ("bos_token_id", i))
            .chain(self.eos_token_ids.iter().map(|i| ("eos_token_id", i)))
            .chain(self.pad_token_id.iter().map(|i| ("pad_token_id", i)))
        {
            if *id as usize >= self.vocab_size {
                return Err(self.bad(
                    field,
                    format!(
                        "token id {id} is outside the vocabulary ({})",
                        self.vocab_size
                    ),
                ));
            }
        }
        Ok(())
    }

    /// Query/key head dim: qk_nope_head_dim + qk_rope_head_dim.
    pub fn q_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// Total decoder layers stored in the checkpoint: main layers plus MTP layers.
    pub fn total_layers(&self) -> usize {
        self.num_hidden_layers + self.num_nextn_predict_layers
    }

    /// Whether `layer` has a routed-expert MoE block (else a dense MLP). MTP layers
    /// (index ≥ num_hidden_layers) are MoE, as in transformers.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        if layer >= self.num_hidden_layers {
            return true;
        }
        match &self.mlp_layer_types {
            Some(types) => types[layer],
            None => layer >= self.first_k_dense_replace,
        }
    }

    /// GLM DSA: whether `layer` runs its own lightning indexer (else it reuses the previous
    /// full layer's selection). The MTP layer is built by transformers as layer 0 of its own
    /// stack, so it takes layer 0's kind, which is always "full" (validated). False for
    /// DeepSeek-V3.
    pub fn indexer_is_full(&self, layer: usize) -> bool {
        let index = if layer >= self.num_hidden_layers {
            0
        } else {
            layer
        };
        self.indexer_full.get(index).copied().unwrap_or(false)
    }

    /// Index of the (first) MTP layer, when the checkpoint has one.
    pub fn mtp_layer_index(&self) -> Option<usize> {
        (self.num_nextn_predict_layers > 0).then_some(self.num_hidden_layers)
    }

    /// Whether `layer` belongs to the MTP head.
    pub fn is_mtp_layer(&self, layer: usize) -> bool {
        layer >= self.num_hidden_layers && layer < self.total_layers()
    }

    /// KV-cache bytes per token per layer: f32 latent (kv_lora_rank) plus roped key
    /// (qk_rope_head_dim). DSA indexer keys come on top (see `kv_bytes_per_token`).
    pub fn kv_bytes_per_token_per_layer(&self) -> usize {
        (self.kv_lora_rank + self.qk_rope_head_dim) * std::mem::size_of::<f32>()
    }

    /// KV-cache bytes one more token adds: every main layer's latent and roped key, the
    /// indexer key of each DSA full layer when the indexers are in use (`dsa`), and the MTP
    /// layer's row (with its indexer key under DSA) when it is loaded (`mtp`).
    pub fn kv_bytes_per_token(&self, dsa: bool, mtp: bool) -> usize {
        let index_key = self.index_head_dim * std::mem::size_of::<f32>();
        let row = |layer: usize| {
            self.kv_bytes_per_token_per_layer()
                + if dsa && self.indexer_is_full(layer) {
                    index_key
                } else {
                    0
                }
        };
        let main: usize = (0..self.num_hidden_layers).map(row).sum();
        main + if mtp { row(self.num_hidden_layers) } else { 0 }
    }

    /// Output width of `q_b_proj` / `q_proj`: heads × q_head_dim.
    pub fn q_out_dim(&self) -> usize {
        self.num_attention_heads * self.q_head_dim()
    }
}

#[cfg(test)]
mod tests;
