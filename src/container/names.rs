//! Hugging Face tensor names of the two families → role and logical shape. Quantised
//! containers store a weight as a flat `U8` tensor, so the logical [O, I] comes from here.

use crate::config::ModelConfig;

/// What a tensor is, for choosing its output format and for expert grouping.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Role {
    /// `model.embed_tokens.weight` (and the MTP layer's own `embed_tokens`).
    Embed,
    /// `lm_head.weight` (and the MTP layer's `shared_head.head`).
    LmHead,
    /// An MLA projection: q_a, q_b, q, kv_a_proj_with_mqa, kv_b, o.
    Attention,
    /// A dense MLP projection (layers < first_k_dense_replace).
    DenseMlp,
    /// A shared-expert projection.
    SharedExpert,
    /// A routed-expert projection.
    RoutedExpert,
    /// The router weight `mlp.gate.weight` [n_routed, hidden].
    Router,
    /// `mlp.gate.e_score_correction_bias`.
    RouterBias,
    /// An RMSNorm weight (or the indexer's LayerNorm weight/bias).
    Norm,
    /// The MTP layer's `eh_proj` [hidden, 2·hidden].
    MtpProj,
    /// A GLM DSA lightning-indexer projection (wq_b, wk, weights_proj).
    Indexer,
    /// Not recognised.
    Unknown,
}

/// Which projection of an expert (routed or shared) or dense MLP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Proj {
    Gate,
    Up,
    Down,
}

/// A classified tensor name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorRole {
    pub role: Role,
    /// Decoder layer index, when the name has one (MTP layers have index ≥ num_hidden_layers).
    pub layer: Option<usize>,
    /// Routed-expert id.
    pub expert: Option<usize>,
    pub proj: Option<Proj>,
}

impl TensorRole {
    fn new(role: Role, layer: Option<usize>) -> Self {
        TensorRole {
            role,
            layer,
            expert: None,
            proj: None,
        }
    }
}

fn proj_of(s: &str) -> Option<Proj> {
    match s {
        "gate_proj" => Some(Proj::Gate),
        "up_proj" => Some(Proj::Up),
        "down_proj" => Some(Proj::Down),
        _ => None,
    }
}

/// Classify a tensor name. Also accepts the names of a community container's `.qs`
/// companions (classified like their weight).
pub fn classify(cfg: &ModelConfig, name: &str) -> TensorRole {
    let name = name.strip_suffix(".qs").unwrap_or(name);
    let unknown = TensorRole::new(Role::Unknown, None);
    match name {
        "model.embed_tokens.weight" => return TensorRole::new(Role::Embed, None),
        "lm_head.weight" => return TensorRole::new(Role::LmHead, None),
        "model.norm.weight" => return TensorRole::new(Role::Norm, None),
        _ => {}
    }
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return unknown;
    };
    let Some((idx, rest)) = rest.split_once('.') else {
        return unknown;
    };
    let Ok(layer) = idx.parse::<usize>() else {
        return unknown;
    };
    if layer >= cfg.total_layers() || idx.starts_with('+') {
        return unknown;
    }
    let l = Some(layer);
    let mtp = cfg.is_mtp_layer(layer);
    let parts: Vec<&str> = rest.split('.').collect();
    let role = |r| TensorRole::new(r, l);
    match parts.as_slice() {
        ["input_layernorm" | "post_attention_layernorm", "weight"] => role(Role::Norm),
        ["self_attn", "q_a_layernorm", "weight"] if cfg.q_lora_rank.is_some() => role(Role::Norm),
        ["self_attn", "kv_a_layernorm", "weight"] => role(Role::Norm),
        ["self_attn", "q_a_proj" | "q_b_proj", "weight"] if cfg.q_lora_rank.is_some() => {
            role(Role::Attention)
        }
        ["self_attn", "q_proj", "weight"] if cfg.q_lora_rank.is_none() => role(Role::Attention),
        ["self_attn", "kv_a_proj_with_mqa" | "kv_b_proj" | "o_proj", "weight"] => {
            role(Role::Attention)
        }
        ["self_attn", "indexer", "wq_b" | "wk" | "weights_proj", "weight"]
            if cfg.index_topk.is_some() && cfg.q_lora_rank.is_some() =>
        {
            role(Role::Indexer)
        }
        ["self_attn", "indexer", "k_norm", "weight" | "bias"] if cfg.index_topk.is_some() => {
            role(Role::Norm)
        }
        ["mlp", p, "weight"] if !cfg.is_moe_layer(layer) => match proj_of(p) {
            Some(pr) => TensorRole {
                proj: Some(pr),
                ..role(Role::DenseMlp)
            },
            None => unknown,
        },
        ["mlp", "gate", "weight"] if cfg.is_moe_layer(layer) => role(Role::Router),
        ["mlp", "gate", "e_score_correction_bias"] if cfg.is_moe_layer(layer) => {
            role(Role::RouterBias)
        }
        ["mlp", "shared_experts", p, "weight"]
            if cfg.is_moe_layer(layer) && cfg.n_shared_experts > 0 =>
        {
            match proj_of(p) {
                Some(pr) => TensorRole {
                    proj: Some(pr),
                    ..role(Role::SharedExpert)
                },
                None => unknown,
            }
        }
        ["mlp", "experts", e, p, "weight"] if cfg.is_moe_layer(layer) => {
            match (e.parse::<usize>(), proj_of(p)) {
                (Ok(e), Some(pr)) if e < cfg.n_routed_experts && !e_has_sign(parts[2]) => {
                    TensorRole {
                        expert: Some(e),
                        proj: Some(pr),
                        ..role(Role::RoutedExpert)
                    }
                }
                _ => unknown,
            }
        }
        ["enorm" | "hnorm", "weight"] if mtp => role(Role::Norm),
        ["shared_head", "norm", "weight"] if mtp => role(Role::Norm),
        ["eh_proj", "weight"] if mtp => role(Role::MtpProj),
        ["shared_head", "head", "weight"] if mtp => role(Role::LmHead),
        ["embed_tokens", "weight"] if mtp => role(Role::Embed),
        _ => unknown,
    }
}

fn e_has_sign(s: &str) -> bool {
    s.starts_with('+')
}

/// Logical [O, I] of a 2-D weight, or `None` for names that are not known 2-D weights
/// (norms, biases, unknown names).
pub fn expected_shape(cfg: &ModelConfig, name: &str) -> Option<(usize, usize)> {
    let r = classify(cfg, name);
    let h = cfg.hidden_size;
    let leaf = name
        .strip_suffix(".qs")
        .unwrap_or(name)
        .rsplit('.')
        .nth(1)
        .unwrap_or("");
    let ffn = |inter: usize, p: Option<Proj>| match p? {
        Proj::Gate | Proj::Up => Some((inter, h)),
        Proj::Down => Some((h, inter)),
    };
    match r.role {
        Role::Embed | Role::LmHead => Some((cfg.vocab_size, h)),
        Role::Router => Some((cfg.n_routed_experts, h)),
        Role::MtpProj => Some((h, 2 * h)),
        Role::DenseMlp => ffn(cfg.intermediate_size, r.proj),
        Role::RoutedExpert => ffn(cfg.moe_intermediate(r.layer?), r.proj),
        Role::SharedExpert => ffn(
            cfg.moe_intermediate(r.layer?) * cfg.n_shared_experts,
            r.proj,
        ),
        Role::Attention => {
            let heads = cfg.num_attention_heads;
            match leaf {
                "q_a_proj" => Some((cfg.q_lora_rank?, h)),
                "q_b_proj" => Some((heads * cfg.q_head_dim(), cfg.q_lora_rank?)),
                "q_proj" => Some((heads * cfg.q_head_dim(), h)),
                "kv_a_proj_with_mqa" => Some((cfg.kv_lora_rank + cfg.qk_rope_head_dim, h)),
                "kv_b_proj" => Some((
                    heads * (cfg.qk_nope_head_dim + cfg.v_head_dim),
                    cfg.kv_lora_rank,
                )),
                "o_proj" => Some((h, heads * cfg.v_head_dim)),
                _ => None,
            }
        }
        Role::Indexer => match leaf {
            "wq_b" => Some((cfg.index_n_heads * cfg.index_head_dim, cfg.q_lora_rank?)),
            "wk" => Some((cfg.index_head_dim, h)),
            "weights_proj" => Some((cfg.index_n_heads, h)),
            _ => None,
        },
        Role::RouterBias | Role::Norm | Role::Unknown => None,
    }
}

/// Length of a known 1-D tensor (norm weights, the router bias), else `None`.
pub fn expected_len(cfg: &ModelConfig, name: &str) -> Option<usize> {
    let r = classify(cfg, name);
    match r.role {
        Role::RouterBias => Some(cfg.n_routed_experts),
        Role::Norm => {
            if name.contains("q_a_layernorm") {
                cfg.q_lora_rank
            } else if name.contains("kv_a_layernorm") {
                Some(cfg.kv_lora_rank)
            } else if name.contains("indexer.k_norm") {
                Some(cfg.index_head_dim)
            } else {
                Some(cfg.hidden_size)
            }
        }
        _ => None,
    }
}

/// Every tensor name a complete checkpoint of `cfg` holds (2-D weights and vectors), in
/// layer order, including the GLM DSA indexer of every full layer (and of the MTP layer).
/// `lm_head.weight` is omitted when the embeddings are tied.
pub fn expected_names(cfg: &ModelConfig) -> Vec<String> {
    let mut v = vec!["model.embed_tokens.weight".to_string()];
    for l in 0..cfg.total_layers() {
        let p = format!("model.layers.{l}");
        for n in ["input_layernorm", "post_attention_layernorm"] {
            v.push(format!("{p}.{n}.weight"));
        }
        let attn: &[&str] = if cfg.q_lora_rank.is_some() {
            &["q_a_proj", "q_a_layernorm", "q_b_proj"]
        } else {
            &["q_proj"]
        };
        for n in attn.iter().chain(&[
            "kv_a_proj_with_mqa",
            "kv_a_layernorm",
            "kv_b_proj",
            "o_proj",
        ]) {
            v.push(format!("{p}.self_attn.{n}.weight"));
        }
        if cfg.index_topk.is_some() && cfg.q_lora_rank.is_some() && cfg.indexer_is_full(l) {
            for n in ["wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias"] {
                v.push(format!("{p}.self_attn.indexer.{n}"));
            }
            v.push(format!("{p}.self_attn.indexer.weights_proj.weight"));
        }
        if cfg.is_moe_layer(l) {
            v.push(format!("{p}.mlp.gate.weight"));
            v.push(format!("{p}.mlp.gate.e_score_correction_bias"));
            if cfg.n_shared_experts > 0 {
                for n in ["gate_proj", "up_proj", "down_proj"] {
                    v.push(format!("{p}.mlp.shared_experts.{n}.weight"));
                }
            }
            for e in 0..cfg.n_routed_experts {
                for pr in [Proj::Gate, Proj::Up, Proj::Down] {
                    v.push(expert_tensor_name(l, e, pr));
                }
            }
        } else {
            for n in ["gate_proj", "up_proj", "down_proj"] {
                v.push(format!("{p}.mlp.{n}.weight"));
            }
        }
        if cfg.is_mtp_layer(l) {
            for n in [
                "enorm.weight",
                "hnorm.weight",
                "eh_proj.weight",
                "shared_head.norm.weight",
                "shared_head.head.weight",
                "embed_tokens.weight",
            ] {
                v.push(format!("{p}.{n}"));
            }
        }
    }
    v.push("model.norm.weight".to_string());
    if !cfg.tie_word_embeddings {
        v.push("lm_head.weight".to_string());
    }
    v
}

/// The HF name of a routed expert's projection.
pub fn expert_tensor_name(layer: usize, expert: usize, proj: Proj) -> String {
    let p = match proj {
        Proj::Gate => "gate_proj",
        Proj::Up => "up_proj",
        Proj::Down => "down_proj",
    };
    format!("model.layers.{layer}.mlp.experts.{expert}.{p}.weight")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> ModelConfig {
        let v = serde_json::json!({
            "model_type": "glm_moe_dsa",
            "vocab_size": 100, "hidden_size": 32, "intermediate_size": 48,
            "moe_intermediate_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "q_lora_rank": 24, "kv_lora_rank": 20, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
            "v_head_dim": 6, "n_routed_experts": 4, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "first_k_dense_replace": 1, "num_nextn_predict_layers": 1,
            "index_head_dim": 8, "index_n_heads": 2
        });
        ModelConfig::from_json_str(&v.to_string(), "config.json").unwrap()
    }

    #[test]
    fn shapes_of_every_role() {
        let c = cfg();
        let s = |n: &str| expected_shape(&c, n);
        assert_eq!(s("model.embed_tokens.weight"), Some((100, 32)));
        assert_eq!(s("lm_head.weight"), Some((100, 32)));
        assert_eq!(
            s("model.layers.0.self_attn.q_a_proj.weight"),
            Some((24, 32))
        );
        assert_eq!(
            s("model.layers.0.self_attn.q_b_proj.weight"),
            Some((24, 24))
        );
        assert_eq!(
            s("model.layers.0.self_attn.kv_a_proj_with_mqa.weight"),
            Some((24, 32))
        );
        assert_eq!(
            s("model.layers.0.self_attn.kv_b_proj.weight"),
            Some((28, 20))
        );
        assert_eq!(s("model.layers.0.self_attn.o_proj.weight"), Some((32, 12)));
        assert_eq!(s("model.layers.0.mlp.gate_proj.weight"), Some((48, 32)));
        assert_eq!(s("model.layers.0.mlp.down_proj.weight"), Some((32, 48)));
        assert_eq!(
            s("model.layers.1.mlp.gate_proj.weight"),
            None,
            "layer 1 is MoE"
        );
        assert_eq!(
            s("model.layers.1.mlp.experts.3.up_proj.weight"),
            Some((16, 32))
        );
        assert_eq!(
            s("model.layers.1.mlp.experts.3.down_proj.weight.qs"),
            Some((32, 16))
        );
        assert_eq!(s("model.layers.1.mlp.experts.4.up_proj.weight"), None);
        assert_eq!(
            s("model.layers.1.mlp.shared_experts.down_proj.weight"),
            Some((32, 16))
        );
        assert_eq!(s("model.layers.1.mlp.gate.weight"), Some((4, 32)));
        assert_eq!(s("model.layers.2.eh_proj.weight"), Some((32, 64)));
        assert_eq!(s("model.layers.2.shared_head.head.weight"), Some((100, 32)));
        assert_eq!(
            s("model.layers.2.mlp.experts.0.gate_proj.weight"),
            Some((16, 32))
        );
        assert_eq!(s("model.layers.1.eh_proj.weight"), None, "not an MTP layer");
        assert_eq!(
            s("model.layers.3.self_attn.o_proj.weight"),
            None,
            "past the MTP layer"
        );
        assert_eq!(
            s("model.layers.0.self_attn.indexer.wq_b.weight"),
            Some((16, 24))
        );
        assert_eq!(
            s("model.layers.0.self_attn.indexer.weights_proj.weight"),
            Some((2, 32))
        );
        assert_eq!(s("model.norm.weight"), None);
        assert_eq!(
            expected_len(&c, "model.layers.0.self_attn.kv_a_layernorm.weight"),
            Some(20)
        );
        assert_eq!(
            expected_len(&c, "model.layers.1.mlp.gate.e_score_correction_bias"),
            Some(4)
        );
        assert_eq!(expected_len(&c, "model.layers.2.hnorm.weight"), Some(32));
        // Every expected name is classified and has a shape or a length.
        for n in expected_names(&c) {
            assert!(classify(&c, &n).role != Role::Unknown, "{n}");
            assert!(
                expected_shape(&c, &n).is_some() != expected_len(&c, &n).is_some(),
                "{n}"
            );
        }
        let r = classify(&c, "model.layers.2.mlp.experts.1.down_proj.weight");
        assert_eq!(
            (r.role, r.layer, r.expert, r.proj),
            (Role::RoutedExpert, Some(2), Some(1), Some(Proj::Down))
        );
    }
}
