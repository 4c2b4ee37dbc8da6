//! `config.json` parsing on arbitrary text: Ok or `Error::Config`/`Unsupported`, never a
//! panic; and whatever it accepts, the shape helpers the container uses stay panic-free.
#![no_main]

use colibri::config::ModelConfig;
use colibri::container::{expected_len, expected_shape, names::classify};
use libfuzzer_sys::fuzz_target;

const NAMES: &[&str] = &[
    "model.embed_tokens.weight",
    "lm_head.weight",
    "model.norm.weight",
    "model.layers.0.self_attn.q_a_proj.weight",
    "model.layers.0.self_attn.kv_b_proj.weight",
    "model.layers.1.mlp.experts.3.down_proj.weight",
    "model.layers.1.mlp.gate.weight",
    "model.layers.1.mlp.gate.e_score_correction_bias",
    "model.layers.1.mlp.shared_experts.up_proj.weight",
    "model.layers.4294967295.mlp.experts.4294967295.gate_proj.weight",
    "model.layers.3.eh_proj.weight",
    "model.layers.0.self_attn.indexer.wq_b.weight",
];

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(cfg) = ModelConfig::from_json_str(text, "config.json") else {
        return;
    };
    for n in NAMES {
        let _ = expected_shape(&cfg, n);
        let _ = expected_len(&cfg, n);
        let _ = classify(&cfg, n);
    }
    let _ = cfg.kv_bytes_per_token(true, true);
    let _ = cfg.mtp_layer_index();
    for l in 0..cfg.total_layers().min(64) {
        let _ = cfg.is_moe_layer(l);
    }
});
