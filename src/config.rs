//! `config.json` → [`ModelConfig`]: the two supported families (`deepseek_v3`,
//! `glm_moe_dsa`), their defaults (taken from transformers' `configuration_deepseek_v3.py`
//! and `configuration_glm_moe_dsa.py`), validation, and the derived quantities the forward
//! pass needs (head dims, softmax scale with YaRN's mscale, MoE layer pattern, MTP index).
//!
//! The JSON is read field by field (not through a serde derive) so that every error names
//! the offending field and the file.

use std::path::{Path, PathBuf};

use serde_json::{Map, Value};

use crate::error::{Error, Result};

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
    /// Explicit cos/sin scaling; when `None` use [`RopeScaling::attention_factor`].
    pub attention_factor: Option<f64>,
    /// Whether the correction range is floored/ceiled (transformers default true).
    pub truncate: bool,
}

/// YaRN's `get_mscale`: 1 for scale ≤ 1, else 0.1·mscale·ln(scale) + 1.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The factor transformers multiplies cos/sin by (`attention_factor` in
    /// `_compute_yarn_parameters`): explicit if given, else
    /// get_mscale(factor, mscale)/get_mscale(factor, mscale_all_dim) when both are non-zero,
    /// else get_mscale(factor, 1).
    pub fn attention_factor(&self) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        if self.mscale != 0.0 && self.mscale_all_dim != 0.0 {
            yarn_get_mscale(self.factor, self.mscale)
                / yarn_get_mscale(self.factor, self.mscale_all_dim)
        } else {
            yarn_get_mscale(self.factor, 1.0)
        }
    }
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

/// Field reader over a JSON object that names the field and file in every error.
struct Fields<'a> {
    obj: &'a Map<String, Value>,
    path: &'a Path,
}

impl<'a> Fields<'a> {
    fn err(&self, field: &str, msg: impl std::fmt::Display) -> Error {
        Error::Config {
            path: self.path.to_path_buf(),
            msg: format!("field '{field}': {msg}"),
        }
    }

    /// The value of `field`, treating JSON null as absent.
    fn get(&self, field: &str) -> Option<&'a Value> {
        self.obj.get(field).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, field: &str) -> Result<Option<usize>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_u64().and_then(|u| usize::try_from(u).ok()) {
                Some(u) => Ok(Some(u)),
                None => Err(self.err(field, format!("expected a non-negative integer, got {v}"))),
            },
        }
    }

    fn usize_req(&self, field: &str) -> Result<usize> {
        self.usize_opt(field)?
            .ok_or_else(|| self.err(field, "missing (required)"))
    }

    fn usize_or(&self, field: &str, default: usize) -> Result<usize> {
        Ok(self.usize_opt(field)?.unwrap_or(default))
    }

    fn f64_opt(&self, field: &str) -> Result<Option<f64>> {
        match self.get(field) {
            None => Ok(None),
            Some(v) => match v.as_f64() {
                Some(f) if f.is_finite() => Ok(Some(f)),
                _ => Err(self.err(field, format!("expected a finite number, got {v}"))),
            },
        }
    }

    fn f64_or(&self, field: &str, default: f64) -> Result<f64> {
        Ok(self.f64_opt(field)?.unwrap_or(default))
    }

    fn bool_or(&self, field: &str, default: bool) -> Result<bool> {
        match self.get(field) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => Err(self.err(field, format!("expected true or false, got {v}"))),
        }
    }

    fn str_opt(&self, field: &str) -> Result<Option<&'a str>> {
        match self.get(field) {
            None => Ok(None),
            Some(Value::String(s)) => Ok(Some(s.as_str())),
            Some(v) => Err(self.err(field, format!("expected a string, got {v}"))),
        }
    }

    fn token_id(&self, field: &str) -> Result<Option<u32>> {
        match self.usize_opt(field)? {
            None => Ok(None),
            Some(u) => u32::try_from(u)
                .map(Some)
                .map_err(|_| self.err(field, "token id does not fit in 32 bits")),
        }
    }

    fn token_ids(&self, field: &str) -> Result<Vec<u32>> {
        match self.get(field) {
            None => Ok(Vec::new()),
            Some(Value::Array(items)) => items
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|u| u32::try_from(u).ok())
                        .ok_or_else(|| self.err(field, format!("bad token id {v}")))
                })
                .collect(),
            Some(_) => Ok(self.token_id(field)?.into_iter().collect()),
        }
    }
}

/// GLM DSA's per-layer indexer kinds (true = "full"), as transformers'
/// `GlmMoeDsaConfig.__post_init__` derives them: an explicit `indexer_types` list, else
/// `index_topk_pattern` (a string of `F`/`S` or a list), else the schedule
/// `full ⇔ max(i − index_skip_topk_offset + 1, 0) mod max(index_topk_freq, 1) = 0`
/// (defaults: freq 1, offset 2, i.e. every layer full). GLM-5.2: freq 4 → 21 full, 57 shared.
fn indexer_types(f: &Fields<'_>, layers: usize) -> Result<Vec<bool>> {
    let kinds = |field: &str, items: &[Value]| -> Result<Vec<bool>> {
        let kinds = items
            .iter()
            .map(|v| match v.as_str() {
                Some("full") => Ok(true),
                Some("shared") => Ok(false),
                _ => Err(f.err(
                    field,
                    format!("entries must be 'full' or 'shared', got {v}"),
                )),
            })
            .collect::<Result<Vec<bool>>>()?;
        if kinds.len() < layers {
            return Err(f.err(
                field,
                format!(
                    "has {} entries for num_hidden_layers = {layers}",
                    kinds.len()
                ),
            ));
        }
        Ok(kinds[..layers].to_vec())
    };
    if let Some(v) = f.get("indexer_types") {
        let Value::Array(items) = v else {
            return Err(f.err("indexer_types", format!("expected a list, got {v}")));
        };
        return kinds("indexer_types", items);
    }
    match f.get("index_topk_pattern") {
        Some(Value::String(p)) => {
            let items: Vec<Value> = p
                .chars()
                .map(|c| match c {
                    'F' => Ok(Value::from("full")),
                    'S' => Ok(Value::from("shared")),
                    _ => Err(f.err(
                        "index_topk_pattern",
                        format!("characters must be 'F' or 'S', got {c:?}"),
                    )),
                })
                .collect::<Result<_>>()?;
            return kinds("index_topk_pattern", &items);
        }
        Some(Value::Array(items)) => return kinds("index_topk_pattern", items),
        Some(v) => {
            return Err(f.err(
                "index_topk_pattern",
                format!("expected a string or a list, got {v}"),
            ))
        }
        None => {}
    }
    let freq = f.usize_or("index_topk_freq", 1)?.max(1);
    let offset = f.usize_or("index_skip_topk_offset", 2)?;
    Ok((0..layers)
        .map(|i| (i + 1).saturating_sub(offset).is_multiple_of(freq))
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
        let path = path.as_ref();
        let value: Value = serde_json::from_str(s).map_err(|e| Error::Config {
            path: path.to_path_buf(),
            msg: format!("not valid JSON: {e}"),
        })?;
        let obj = value.as_object().ok_or_else(|| Error::Config {
            path: path.to_path_buf(),
            msg: "expected a JSON object at the top level".into(),
        })?;
        let f = Fields { obj, path };

        let model_type = f.str_opt("model_type")?.ok_or_else(|| {
            f.err(
                "model_type",
                format!(
                    "missing; colibri supports {}",
                    SUPPORTED_MODEL_TYPES.join(", ")
                ),
            )
        })?;
        let family = ModelFamily::from_model_type(model_type).ok_or_else(|| {
            Error::Unsupported(format!(
                "{}: model_type '{model_type}' is not supported; colibri runs {}",
                path.display(),
                SUPPORTED_MODEL_TYPES.join(" and ")
            ))
        })?;
        let d = defaults(family);

        // Rope: transformers ≥ 5 writes `rope_parameters` (with rope_theta and rope_type
        // inside); older configs write `rope_scaling` plus a top-level `rope_theta`.
        let rope_field = if f.get("rope_parameters").is_some() {
            "rope_parameters"
        } else {
            "rope_scaling"
        };
        let rope_obj = match f.get(rope_field) {
            None => None,
            Some(Value::Object(m)) => Some(m),
            Some(v) => return Err(f.err(rope_field, format!("expected an object, got {v}"))),
        };
        let rope_fields = rope_obj.map(|m| Fields { obj: m, path });
        let mut rope_theta = f.f64_opt("rope_theta")?;
        let mut rope_scaling = None;
        if let Some(rf) = &rope_fields {
            if let Some(t) = rf.f64_opt("rope_theta")? {
                rope_theta = Some(t);
            }
            let rope_type = match rf.str_opt("rope_type")? {
                Some(t) => Some(t),
                None => rf.str_opt("type")?,
            }
            .unwrap_or("default");
            match rope_type {
                "default" => {}
                "yarn" => {
                    let max_pos = f.usize_or("max_position_embeddings", d.max_position_embeddings)?;
                    let original = rf
                        .usize_opt("original_max_position_embeddings")?
                        .ok_or_else(|| {
                            f.err(
                                &format!("{rope_field}.original_max_position_embeddings"),
                                "missing (required for yarn)",
                            )
                        })?;
                    let factor = match rf.f64_opt("factor")? {
                        Some(x) => x,
                        None if original > 0 => max_pos as f64 / original as f64,
                        None => 0.0,
                    };
                    if factor <= 0.0 || original == 0 {
                        return Err(f.err(
                            &format!("{rope_field}.factor"),
                            "yarn needs factor > 0 and original_max_position_embeddings > 0",
                        ));
                    }
                    let nz = |x: Option<f64>, dflt: f64| match x {
                        Some(v) if v != 0.0 => v,
                        _ => dflt,
                    };
                    rope_scaling = Some(RopeScaling {
                        factor,
                        original_max_position_embeddings: original,
                        beta_fast: nz(rf.f64_opt("beta_fast")?, 32.0),
                        beta_slow: nz(rf.f64_opt("beta_slow")?, 1.0),
                        mscale: rf.f64_or("mscale", 0.0)?,
                        mscale_all_dim: rf.f64_or("mscale_all_dim", 0.0)?,
                        attention_factor: rf.f64_opt("attention_factor")?,
                        truncate: rf.bool_or("truncate", true)?,
                    });
                }
                other => {
                    return Err(Error::Unsupported(format!(
                        "{}: {rope_field}.rope_type '{other}' is not supported (only 'default' and 'yarn')",
                        path.display()
                    )))
                }
            }
        }
        let rope_theta = rope_theta.unwrap_or(10_000.0);

        let scoring_func = match f.str_opt("scoring_func")?.unwrap_or("sigmoid") {
            "sigmoid" => ScoringFunc::Sigmoid,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: scoring_func '{other}' is not supported (only 'sigmoid')",
                    path.display()
                )))
            }
        };
        let topk_method = match f.str_opt("topk_method")?.unwrap_or("noaux_tc") {
            "noaux_tc" => TopkMethod::NoauxTc,
            other => {
                return Err(Error::Unsupported(format!(
                    "{}: topk_method '{other}' is not supported (only 'noaux_tc')",
                    path.display()
                )))
            }
        };
        if let Some(act) = f.str_opt("hidden_act")? {
            if act != "silu" {
                return Err(Error::Unsupported(format!(
                    "{}: hidden_act '{act}' is not supported (only 'silu')",
                    path.display()
                )));
            }
        }
        if f.bool_or("attention_bias", false)? {
            return Err(Error::Unsupported(format!(
                "{}: attention_bias = true is not supported",
                path.display()
            )));
        }

        let q_lora_rank = if obj.contains_key("q_lora_rank") {
            f.usize_opt("q_lora_rank")? // explicit null → plain q_proj
        } else {
            d.q_lora_rank
        };
        let num_nextn_predict_layers = match f.usize_opt("num_nextn_predict_layers")? {
            Some(n) => n,
            None => f.usize_or("num_mtp_layers", d.num_nextn_predict_layers)?,
        };
        let n_routed_experts = match f.usize_opt("n_routed_experts")? {
            Some(n) => n,
            None => f
                .usize_req("num_local_experts")
                .map_err(|_| f.err("n_routed_experts", "missing (required)"))?,
        };
        let num_hidden_layers = f.usize_req("num_hidden_layers")?;

        let mlp_layer_types = match f.get("mlp_layer_types") {
            None => None,
            Some(Value::Array(items)) => Some(
                items
                    .iter()
                    .map(|v| match v.as_str() {
                        Some("dense") => Ok(false),
                        Some("sparse") => Ok(true),
                        _ => Err(f.err(
                            "mlp_layer_types",
                            format!("entries must be 'dense' or 'sparse', got {v}"),
                        )),
                    })
                    .collect::<Result<Vec<bool>>>()?,
            ),
            Some(v) => return Err(f.err("mlp_layer_types", format!("expected a list, got {v}"))),
        };

        let is_glm = family == ModelFamily::GlmMoeDsa;
        let indexer_full = if is_glm {
            indexer_types(&f, num_hidden_layers)?
        } else {
            Vec::new()
        };
        let cfg = ModelConfig {
            family,
            path: path.to_path_buf(),
            vocab_size: f.usize_req("vocab_size")?,
            hidden_size: f.usize_req("hidden_size")?,
            intermediate_size: f.usize_req("intermediate_size")?,
            moe_intermediate_size: f.usize_req("moe_intermediate_size")?,
            mtp_moe_intermediate_size: f.usize_opt("colibri_mtp_moe_intermediate_size")?,
            num_hidden_layers,
            num_attention_heads: f.usize_req("num_attention_heads")?,
            q_lora_rank,
            kv_lora_rank: f.usize_req("kv_lora_rank")?,
            qk_nope_head_dim: f.usize_req("qk_nope_head_dim")?,
            qk_rope_head_dim: f.usize_req("qk_rope_head_dim")?,
            v_head_dim: f.usize_req("v_head_dim")?,
            n_routed_experts,
            num_experts_per_tok: f.usize_req("num_experts_per_tok")?,
            n_shared_experts: f.usize_or("n_shared_experts", 1)?,
            first_k_dense_replace: f.usize_or("first_k_dense_replace", d.first_k_dense_replace)?,
            moe_layer_freq: f.usize_or("moe_layer_freq", 1)?,
            n_group: f.usize_or("n_group", d.n_group)?,
            topk_group: f.usize_or("topk_group", d.topk_group)?,
            norm_topk_prob: f.bool_or("norm_topk_prob", true)?,
            routed_scaling_factor: f.f64_or("routed_scaling_factor", 2.5)? as f32,
            rms_norm_eps: f.f64_or("rms_norm_eps", d.rms_norm_eps)? as f32,
            rope_theta,
            rope_scaling,
            rope_interleave: if is_glm {
                true
            } else {
                f.bool_or("rope_interleave", d.rope_interleave)?
            },
            tie_word_embeddings: f.bool_or("tie_word_embeddings", false)?,
            max_position_embeddings: f
                .usize_or("max_position_embeddings", d.max_position_embeddings)?,
            num_nextn_predict_layers,
            scoring_func,
            topk_method,
            index_topk: if is_glm {
                Some(f.usize_or("index_topk", 2048)?)
            } else {
                None
            },
            index_head_dim: if is_glm {
                f.usize_or("index_head_dim", 128)?
            } else {
                0
            },
            index_n_heads: if is_glm {
                f.usize_or("index_n_heads", 32)?
            } else {
                0
            },
            mlp_layer_types,
            indexer_full,
            bos_token_id: f.token_id("bos_token_id")?,
            eos_token_ids: f.token_ids("eos_token_id")?,
            pad_token_id: f.token_id("pad_token_id")?,
        };
        cfg.validate()?;
        Ok(cfg)
    }

    fn bad(&self, field: &str, msg: impl std::fmt::Display) -> Error {
        Error::Config {
            path: self.path.clone(),
            msg: format!("field '{field}': {msg}"),
        }
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

    /// Attention softmax scale: q_head_dim^-1/2, times mscale² with
    /// mscale = get_mscale(factor, mscale_all_dim) when YaRN has a non-zero `mscale_all_dim`
    /// (transformers' `yarn_apply_mscale`).
    pub fn softmax_scale(&self) -> f32 {
        let mut scale = (self.q_head_dim() as f64).powf(-0.5);
        if let Some(r) = &self.rope_scaling {
            if r.mscale_all_dim != 0.0 {
                let m = yarn_get_mscale(r.factor, r.mscale_all_dim);
                scale *= m * m;
            }
        }
        scale as f32
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
mod tests {
    use super::*;

    fn tiny_deepseek() -> serde_json::Value {
        serde_json::json!({
            "model_type": "deepseek_v3",
            "vocab_size": 256, "hidden_size": 64, "intermediate_size": 96,
            "moe_intermediate_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
            "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
            "v_head_dim": 16, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 4, "topk_group": 2,
            "rope_scaling": {"type": "yarn", "factor": 40.0, "original_max_position_embeddings": 4096,
                             "beta_fast": 32, "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0},
            "rope_theta": 10000.0, "eos_token_id": 1, "bos_token_id": 0,
            "num_nextn_predict_layers": 1
        })
    }

    fn parse(v: &serde_json::Value) -> Result<ModelConfig> {
        ModelConfig::from_json_str(&v.to_string(), "config.json")
    }

    #[test]
    fn parses_deepseek_with_yarn() {
        let c = parse(&tiny_deepseek()).unwrap();
        assert_eq!(c.family, ModelFamily::DeepseekV3);
        assert_eq!(c.q_head_dim(), 24);
        let r = c.rope_scaling.as_ref().unwrap();
        assert_eq!(r.factor, 40.0);
        // mscale = 0.1·ln(40) + 1; softmax scale = 24^-0.5 · mscale².
        let m = 0.1 * 40f64.ln() + 1.0;
        let want = (24f64).powf(-0.5) * m * m;
        assert!((c.softmax_scale() as f64 - want).abs() < 1e-7);
        assert!(!c.is_moe_layer(0) && c.is_moe_layer(1) && c.is_moe_layer(3));
        assert_eq!(c.mtp_layer_index(), Some(3));
        assert_eq!(c.eos_token_ids, vec![1]);
        assert_eq!(c.kv_bytes_per_token_per_layer(), (32 + 8) * 4);
        assert!(c.rope_interleave);
    }

    #[test]
    fn rope_parameters_form_and_eos_list() {
        let mut v = tiny_deepseek();
        let o = v.as_object_mut().unwrap();
        o.remove("rope_scaling");
        o.remove("rope_theta");
        o.insert(
            "rope_parameters".into(),
            serde_json::json!({"rope_type": "default", "rope_theta": 50000.0}),
        );
        o.insert("eos_token_id".into(), serde_json::json!([1, 2]));
        o.insert("q_lora_rank".into(), Value::Null);
        let c = parse(&v).unwrap();
        assert_eq!(c.rope_theta, 50000.0);
        assert!(c.rope_scaling.is_none());
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert_eq!(c.q_lora_rank, None);
        assert_eq!(c.softmax_scale(), (24f32).powf(-0.5));
    }

    #[test]
    fn indexer_types_are_derived_as_transformers_does() {
        // tests/fixtures/dsa_indexer_types.json: what transformers' GlmMoeDsaConfig derives
        // (tools/make_fixtures.py --indexer-types-json).
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/fixtures/dsa_indexer_types.json"
        );
        let cases: Vec<serde_json::Value> =
            serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap();
        assert!(cases.len() >= 6);
        for case in cases {
            let mut v = tiny_deepseek();
            let o = v.as_object_mut().unwrap();
            o.insert("model_type".into(), "glm_moe_dsa".into());
            for (k, val) in case["config"].as_object().unwrap() {
                o.insert(k.clone(), val.clone());
            }
            let want: Vec<bool> = case["indexer_types"]
                .as_array()
                .unwrap()
                .iter()
                .map(|t| t == "full")
                .collect();
            let layers = o["num_hidden_layers"].as_u64().unwrap() as usize;
            o.insert("first_k_dense_replace".into(), 1.min(layers).into());
            match parse(&v) {
                Ok(c) => {
                    assert_eq!(c.indexer_full, want, "{}", case["config"]);
                    assert!((0..layers).all(|l| c.indexer_is_full(l) == want[l]));
                    assert!(
                        c.indexer_is_full(layers),
                        "the MTP layer takes layer 0's kind"
                    );
                }
                // transformers builds such a model but raises in its forward.
                Err(e) => {
                    assert!(!want[0], "{}: {e}", case["config"]);
                    assert!(e.to_string().contains("indexer_types"), "{e}");
                }
            }
        }
        let glm52 = {
            let mut v = tiny_deepseek();
            let o = v.as_object_mut().unwrap();
            o.insert("model_type".into(), "glm_moe_dsa".into());
            o.insert("num_hidden_layers".into(), 78.into());
            o.insert("index_topk_freq".into(), 4.into());
            parse(&v).unwrap()
        };
        let full = glm52.indexer_full.iter().filter(|f| **f).count();
        assert_eq!((full, 78 - full), (21, 57));
    }

    #[test]
    fn bad_indexer_types_name_the_field() {
        for (field, value) in [
            (
                "indexer_types",
                serde_json::json!(["full", "sparse", "full"]),
            ),
            ("indexer_types", serde_json::json!(["full", "shared"])),
            ("indexer_types", serde_json::json!("FSS")),
            ("index_topk_pattern", serde_json::json!("FXS")),
            ("index_topk_pattern", serde_json::json!(7)),
            ("index_topk_freq", serde_json::json!(-1)),
        ] {
            let mut v = tiny_deepseek();
            let o = v.as_object_mut().unwrap();
            o.insert("model_type".into(), "glm_moe_dsa".into());
            o.insert(field.into(), value.clone());
            let e = parse(&v).unwrap_err().to_string();
            assert!(e.contains(field), "{field} = {value}: {e}");
        }
    }

    #[test]
    fn glm_defaults() {
        let mut v = tiny_deepseek();
        let o = v.as_object_mut().unwrap();
        o.insert("model_type".into(), "glm_moe_dsa".into());
        o.remove("n_group");
        o.remove("topk_group");
        o.remove("num_nextn_predict_layers");
        o.insert("rope_interleave".into(), false.into());
        let c = parse(&v).unwrap();
        assert_eq!(c.family, ModelFamily::GlmMoeDsa);
        assert_eq!((c.n_group, c.topk_group), (1, 1));
        assert_eq!(c.index_topk, Some(2048));
        assert_eq!(c.mtp_layer_index(), None);
        assert!(c.rope_interleave, "GLM always interleaves");
    }

    #[test]
    fn unsupported_family_names_supported_ones() {
        let mut v = tiny_deepseek();
        v["model_type"] = "llama".into();
        let e = parse(&v).unwrap_err();
        assert!(matches!(e, Error::Unsupported(_)));
        let s = e.to_string();
        assert!(s.contains("llama") && s.contains("deepseek_v3") && s.contains("glm_moe_dsa"));
    }

    #[test]
    fn bad_values_name_the_field() {
        let cases: Vec<(&str, serde_json::Value, &str)> = vec![
            ("topk_group", 5.into(), "topk_group"),
            ("num_experts_per_tok", 9.into(), "num_experts_per_tok"),
            ("hidden_size", "big".into(), "hidden_size"),
            ("hidden_size", Value::Null, "hidden_size"),
            ("n_group", 3.into(), "n_group"),
            ("qk_rope_head_dim", 7.into(), "qk_rope_head_dim"),
            ("first_k_dense_replace", 4.into(), "first_k_dense_replace"),
            ("eos_token_id", 999.into(), "eos_token_id"),
            ("rms_norm_eps", (-1.0).into(), "rms_norm_eps"),
            ("bos_token_id", 256.into(), "bos_token_id"),
            ("hidden_size", (1u64 << 40).into(), "hidden_size"),
        ];
        for (field, val, want) in cases {
            let mut v = tiny_deepseek();
            v[field] = val;
            let e = parse(&v).unwrap_err();
            assert!(matches!(e, Error::Config { .. }), "{field}: {e}");
            assert!(e.to_string().contains(want), "{field}: {e}");
        }
        let e = ModelConfig::from_json_str("{not json", "x/config.json").unwrap_err();
        assert!(e.to_string().contains("x/config.json"), "{e}");
        let mut v = tiny_deepseek();
        v["scoring_func"] = "softmax".into();
        assert!(matches!(parse(&v).unwrap_err(), Error::Unsupported(_)));
    }
}
