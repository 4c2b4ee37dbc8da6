//! The checks every [`ModelConfig`] passes before anything is built from it: sizes in range,
//! routing that can choose its experts, family-specific fields, token ids in the vocabulary.

use super::{field_error, ModelConfig, ModelFamily, MAX_DIM};
use crate::error::{Error, Result};

impl ModelConfig {
    /// An error naming `field` of this config.
    fn bad(&self, field: &str, msg: impl std::fmt::Display) -> Error {
        field_error(&self.path, field, msg)
    }

    /// Every check, in this order: the first that fails is the error.
    pub(super) fn validate(&self) -> Result<()> {
        self.check_sizes()?;
        self.check_routing()?;
        self.check_layers()?;
        self.check_numbers()?;
        self.check_dsa()?;
        self.check_token_ids()
    }

    /// Sizes: present, within [`MAX_DIM`], and of the shape the forward pass needs.
    fn check_sizes(&self) -> Result<()> {
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
        Ok(())
    }

    /// Routing: the experts per token can be chosen from the groups the router keeps.
    fn check_routing(&self) -> Result<()> {
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
        Ok(())
    }

    /// The layer pattern: dense layers, MoE frequency, per-layer MLP kinds.
    fn check_layers(&self) -> Result<()> {
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
        Ok(())
    }

    /// Float parameters: finite and positive.
    fn check_numbers(&self) -> Result<()> {
        if !(self.rms_norm_eps > 0.0 && self.rms_norm_eps.is_finite()) {
            return Err(self.bad("rms_norm_eps", "must be a finite number > 0"));
        }
        if !(self.routed_scaling_factor > 0.0 && self.routed_scaling_factor.is_finite()) {
            return Err(self.bad("routed_scaling_factor", "must be a finite number > 0"));
        }
        if self.rope_theta <= 0.0 {
            return Err(self.bad("rope_theta", "must be > 0"));
        }
        Ok(())
    }

    /// GLM DSA's indexer fields (`index_topk` for every family).
    fn check_dsa(&self) -> Result<()> {
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
        Ok(())
    }

    /// Special token ids: inside the vocabulary.
    fn check_token_ids(&self) -> Result<()> {
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
}
