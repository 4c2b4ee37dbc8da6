//! The Hugging Face `config.json` as written by transformers' `configuration_deepseek_v3.py`
//! and `configuration_glm_moe_dsa.py`: every field colibri reads, typed, each `Option` because
//! a field may be absent or `null` (both mean "the family's default", applied by
//! [`TryFrom<HfConfig> for ModelConfig`](super::ModelConfig)). Unknown fields are ignored.
//! [`HfConfig::parse`] names the offending field (`rope_scaling.factor`,
//! `mlp_layer_types[2]`) and the file in every error.

use std::path::{Path, PathBuf};

use serde::de::{Deserializer, Error as _};
use serde::Deserialize;
use serde_json::Value;

use crate::error::{Error, Result};

/// `config.json`, as far as colibri reads it.
#[derive(Debug, Clone, Default, Deserialize)]
pub struct HfConfig {
    /// Where the text was read from (error messages only; set by [`HfConfig::parse`]).
    #[serde(skip)]
    pub path: PathBuf,
    pub model_type: Option<String>,
    pub vocab_size: Option<usize>,
    pub hidden_size: Option<usize>,
    pub intermediate_size: Option<usize>,
    pub moe_intermediate_size: Option<usize>,
    /// colibri's own field (the disk stand-ins of `tools/make_standin.py`).
    pub colibri_mtp_moe_intermediate_size: Option<usize>,
    pub num_hidden_layers: Option<usize>,
    pub num_attention_heads: Option<usize>,
    /// Absent: the family's default; `null`: no query LoRA (a plain `q_proj`).
    #[serde(default, deserialize_with = "present")]
    pub q_lora_rank: Option<Option<usize>>,
    pub kv_lora_rank: Option<usize>,
    pub qk_nope_head_dim: Option<usize>,
    pub qk_rope_head_dim: Option<usize>,
    pub v_head_dim: Option<usize>,
    pub n_routed_experts: Option<usize>,
    /// Another name of `n_routed_experts`, used when that one is absent.
    pub num_local_experts: Option<usize>,
    pub num_experts_per_tok: Option<usize>,
    pub n_shared_experts: Option<usize>,
    pub first_k_dense_replace: Option<usize>,
    pub moe_layer_freq: Option<usize>,
    pub n_group: Option<usize>,
    pub topk_group: Option<usize>,
    pub norm_topk_prob: Option<bool>,
    pub routed_scaling_factor: Option<f64>,
    pub rms_norm_eps: Option<f64>,
    pub rope_theta: Option<f64>,
    /// transformers ≥ 5 (with `rope_theta` and `rope_type` inside); takes precedence over
    /// `rope_scaling`.
    pub rope_parameters: Option<HfRope>,
    /// Older configs (with a top-level `rope_theta`).
    pub rope_scaling: Option<HfRope>,
    pub rope_interleave: Option<bool>,
    pub tie_word_embeddings: Option<bool>,
    pub max_position_embeddings: Option<usize>,
    pub num_nextn_predict_layers: Option<usize>,
    /// Another name of `num_nextn_predict_layers`, used when that one is absent.
    pub num_mtp_layers: Option<usize>,
    pub scoring_func: Option<String>,
    pub topk_method: Option<String>,
    pub hidden_act: Option<String>,
    pub attention_bias: Option<bool>,
    pub index_topk: Option<usize>,
    pub index_head_dim: Option<usize>,
    pub index_n_heads: Option<usize>,
    pub mlp_layer_types: Option<Vec<MlpLayerType>>,
    pub indexer_types: Option<Vec<IndexerType>>,
    /// A string of `F`/`S`, or a list of `full`/`shared`.
    #[serde(default, deserialize_with = "topk_pattern")]
    pub index_topk_pattern: Option<Vec<IndexerType>>,
    pub index_topk_freq: Option<usize>,
    pub index_skip_topk_offset: Option<usize>,
    pub bos_token_id: Option<u32>,
    /// One id or a list of them.
    #[serde(default, deserialize_with = "token_ids")]
    pub eos_token_id: Option<Vec<u32>>,
    pub pad_token_id: Option<u32>,
}

/// `rope_parameters` / `rope_scaling`.
#[derive(Debug, Clone, Default, Deserialize)]
#[serde(expecting = "an object")]
pub struct HfRope {
    pub rope_type: Option<String>,
    /// The older name of `rope_type`.
    #[serde(rename = "type")]
    pub legacy_type: Option<String>,
    pub rope_theta: Option<f64>,
    pub factor: Option<f64>,
    pub original_max_position_embeddings: Option<usize>,
    pub beta_fast: Option<f64>,
    pub beta_slow: Option<f64>,
    pub mscale: Option<f64>,
    pub mscale_all_dim: Option<f64>,
    pub attention_factor: Option<f64>,
    pub truncate: Option<bool>,
}

/// An entry of `mlp_layer_types`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MlpLayerType {
    Dense,
    Sparse,
}

/// An entry of `indexer_types` (GLM DSA): a layer runs its own indexer, or reuses the
/// previous full layer's selection.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum IndexerType {
    Full,
    Shared,
}

impl HfConfig {
    /// Parse a `config.json` text; `path` is only used in error messages. A syntax error is
    /// "not valid JSON"; a field of the wrong type is named with its path.
    pub fn parse(text: &str, path: &Path) -> Result<Self> {
        let err = |msg: String| Error::Config {
            path: path.to_path_buf(),
            msg,
        };
        let value: Value =
            serde_json::from_str(text).map_err(|e| err(format!("not valid JSON: {e}")))?;
        let Some(obj) = value.as_object() else {
            return Err(err("expected a JSON object at the top level".into()));
        };
        // serde reads a struct from a list too (field by field, in order); transformers never
        // writes one, so a list where an object belongs is refused by name.
        for field in ["rope_parameters", "rope_scaling"] {
            if let Some(v) = obj.get(field).filter(|v| !v.is_null() && !v.is_object()) {
                return Err(err(format!("field '{field}': expected an object, got {v}")));
            }
        }
        let mut cfg: HfConfig = serde_path_to_error::deserialize(&value).map_err(|e| {
            let field = e.path().to_string();
            err(format!("field '{field}': {}", e.into_inner()))
        })?;
        cfg.path = path.to_path_buf();
        Ok(cfg)
    }
}

/// A field that may be absent (`None`) or `null` (`Some(None)`).
fn present<'de, D: Deserializer<'de>, T: Deserialize<'de>>(
    d: D,
) -> std::result::Result<Option<Option<T>>, D::Error> {
    Option::<T>::deserialize(d).map(Some)
}

/// `index_topk_pattern`: `"FSS…"` or `["full", "shared", …]`.
fn topk_pattern<'de, D: Deserializer<'de>>(
    d: D,
) -> std::result::Result<Option<Vec<IndexerType>>, D::Error> {
    match Option::<Value>::deserialize(d)? {
        None => Ok(None),
        Some(Value::String(p)) => p
            .chars()
            .map(|c| match c {
                'F' => Ok(IndexerType::Full),
                'S' => Ok(IndexerType::Shared),
                _ => Err(D::Error::custom(format!(
                    "characters must be 'F' or 'S', got {c:?}"
                ))),
            })
            .collect::<std::result::Result<_, _>>()
            .map(Some),
        Some(v @ Value::Array(_)) => Vec::<IndexerType>::deserialize(v)
            .map(Some)
            .map_err(D::Error::custom),
        Some(v) => Err(D::Error::custom(format!(
            "expected a string or a list, got {v}"
        ))),
    }
}

/// `eos_token_id`: one id or a list of ids.
fn token_ids<'de, D: Deserializer<'de>>(d: D) -> std::result::Result<Option<Vec<u32>>, D::Error> {
    let id = |v: &Value| {
        v.as_u64()
            .and_then(|u| u32::try_from(u).ok())
            .ok_or_else(|| D::Error::custom(format!("bad token id {v} (a 32-bit id expected)")))
    };
    match Option::<Value>::deserialize(d)? {
        None => Ok(None),
        Some(Value::Array(items)) => items
            .iter()
            .map(id)
            .collect::<std::result::Result<_, _>>()
            .map(Some),
        Some(v) => id(&v).map(|i| Some(vec![i])),
    }
}
