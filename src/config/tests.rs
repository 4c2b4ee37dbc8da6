//! `config.json` parsing: both families, the rope forms, DSA indexer kinds (against
//! transformers' answers), defaults, and errors that name the field.

use serde_json::Value;

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
    assert!((crate::model::rope::softmax_scale(&c) as f64 - want).abs() < 1e-7);
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
    assert_eq!(crate::model::rope::softmax_scale(&c), (24f32).powf(-0.5));
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

#[test]
fn nested_and_listed_fields_are_named_with_their_path() {
    let cases: Vec<(&str, serde_json::Value, &str)> = vec![
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": "big", "original_max_position_embeddings": 4096}),
            "rope_scaling.factor",
        ),
        (
            "rope_scaling",
            serde_json::json!({"type": "yarn", "factor": 4.0}),
            "rope_scaling.original_max_position_embeddings",
        ),
        ("rope_scaling", "yarn".into(), "rope_scaling"),
        (
            "rope_scaling",
            serde_json::json!(["yarn", 4.0]),
            "rope_scaling",
        ),
        (
            "mlp_layer_types",
            serde_json::json!(["dense", "moe", "sparse"]),
            "mlp_layer_types[1]",
        ),
        ("eos_token_id", serde_json::json!([1, -2]), "eos_token_id"),
        ("bos_token_id", (1u64 << 33).into(), "bos_token_id"),
        ("norm_topk_prob", "yes".into(), "norm_topk_prob"),
    ];
    for (field, val, want) in cases {
        let mut v = tiny_deepseek();
        v[field] = val.clone();
        let e = parse(&v).unwrap_err();
        assert!(matches!(e, Error::Config { .. }), "{field} = {val}: {e}");
        let s = e.to_string();
        assert!(
            s.contains(&format!("field '{want}'")),
            "{field} = {val}: {s}"
        );
        assert!(s.contains("config.json"), "{s}");
    }
    let e = ModelConfig::from_json_str("[1]", "x/config.json").unwrap_err();
    assert!(e.to_string().contains("JSON object"), "{e}");
    // An alias is read when the main name is absent, and the main name wins over it.
    let mut v = tiny_deepseek();
    let o = v.as_object_mut().unwrap();
    o.remove("n_routed_experts");
    o.insert("num_local_experts".into(), 8.into());
    o.remove("num_nextn_predict_layers");
    o.insert("num_mtp_layers".into(), 1.into());
    let c = parse(&v).unwrap();
    assert_eq!((c.n_routed_experts, c.num_nextn_predict_layers), (8, 1));
    v["n_routed_experts"] = 16.into();
    v["num_nextn_predict_layers"] = 0.into();
    let c = parse(&v).unwrap();
    assert_eq!((c.n_routed_experts, c.num_nextn_predict_layers), (16, 0));
}
