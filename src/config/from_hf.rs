//! The Hugging Face schema ([`HfConfig`]) → a [`ModelConfig`]: the family's defaults, the
//! aliases resolved, unsupported features refused.

use super::hf::{HfConfig, IndexerType, MlpLayerType};
use super::{
    field_error, unsupported, ModelConfig, ModelFamily, RopeScaling, ScoringFunc, TopkMethod,
    SUPPORTED_MODEL_TYPES,
};
use crate::error::{Error, Result};

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
        let family = family(&h)?;
        let d = defaults(family);
        let max_position_embeddings = h
            .max_position_embeddings
            .unwrap_or(d.max_position_embeddings);
        let (rope_theta, rope_scaling) = rope(&h, max_position_embeddings)?;

        let (scoring_func, topk_method) = routing_methods(&h)?;

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

/// The family `model_type` names (an error naming the supported ones otherwise).
fn family(h: &HfConfig) -> Result<ModelFamily> {
    let path = h.path.as_path();
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
    ModelFamily::from_model_type(model_type).ok_or_else(|| {
        unsupported(
            path,
            format!(
                "model_type '{model_type}' is not supported; colibri runs {}",
                SUPPORTED_MODEL_TYPES.join(" and ")
            ),
        )
    })
}

/// How the router scores and picks experts; the activation and attention bias checked too
/// (only what both families use is implemented).
fn routing_methods(h: &HfConfig) -> Result<(ScoringFunc, TopkMethod)> {
    let path = h.path.as_path();
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
    Ok((scoring_func, topk_method))
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
