//! `config.json` → [`ModelConfig`]: the two supported families (`deepseek_v3`,
//! `glm_moe_dsa`), their defaults (taken from transformers' `configuration_deepseek_v3.py`
//! and `configuration_glm_moe_dsa.py`), validation, and the derived quantities the forward
//! pass needs (head dims, MoE layer pattern, MTP index).
//!
//! The JSON is read through a serde schema of the Hugging Face config ([`HfConfig`], in
//! `hf.rs`; every error names the offending field and the file) and turned into a validated
//! [`ModelConfig`] by `TryFrom` (`from_hf.rs`) and its checks (`validate.rs`). YaRN's math lives with the rope, in `model/rope.rs`.

use std::path::{Path, PathBuf};

use crate::error::{Error, Result};

mod from_hf;
mod hf;
mod validate;

pub use hf::HfConfig;

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

    /// Weights one token uses in `layer`: attention projections, and the dense MLP or the
    /// routed experts it picks plus the shared ones (a count, not bytes: formats differ by
    /// role, but a draft's price only needs the ratio of like to like).
    pub fn weights_per_token(&self, layer: usize) -> usize {
        let h = self.hidden_size;
        let heads = self.num_attention_heads;
        let q = match self.q_lora_rank {
            Some(r) => h * r + r * self.q_out_dim(),
            None => h * self.q_out_dim(),
        };
        let kv = h * (self.kv_lora_rank + self.qk_rope_head_dim)
            + self.kv_lora_rank * heads * (self.qk_nope_head_dim + self.v_head_dim);
        let o = heads * self.v_head_dim * h;
        let mlp = if self.is_moe_layer(layer) {
            let experts = self.num_experts_per_tok + self.n_shared_experts;
            3 * h * self.moe_intermediate(layer) * experts
        } else {
            3 * h * self.intermediate_size
        };
        q + kv + o + mlp
    }

    /// What an MTP draft token costs against a plain decode step, by the weights each uses:
    /// the MTP layer, its input projection and the LM head, over every main layer and the
    /// LM head. 0 for a model without an MTP layer.
    pub fn mtp_draft_share(&self) -> f64 {
        let Some(mtp) = self.mtp_layer_index() else {
            return 0.0;
        };
        let h = self.hidden_size;
        let head = self.vocab_size * h;
        let draft = self.weights_per_token(mtp) + 2 * h * h + head;
        let main: usize = (0..self.num_hidden_layers)
            .map(|l| self.weights_per_token(l))
            .sum::<usize>()
            + head;
        draft as f64 / main.max(1) as f64
    }
}

#[cfg(test)]
mod tests;
