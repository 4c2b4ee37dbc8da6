//! The container index: a model directory of a fixed small config (or, when the input
//! starts with `{`, a config taken from the input up to the first NUL) and one shard of
//! arbitrary bytes. Opening must be Ok or a typed error; an opened container's weights,
//! vectors, raw bytes, expert index and non-finite scan must be too — never a panic.
#![no_main]

use std::cell::RefCell;
use std::sync::Arc;

use colibri::container::Container;
use colibri::experts::{ContainerSource, ExpertLocator};
use libfuzzer_sys::fuzz_target;

const CONFIG: &str = r#"{"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 128,
 "intermediate_size": 96, "moe_intermediate_size": 64, "num_hidden_layers": 2,
 "num_attention_heads": 2, "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
 "qk_rope_head_dim": 8, "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
 "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
 "num_nextn_predict_layers": 1}"#;

thread_local! {
    static DIR: RefCell<Option<tempfile::TempDir>> = const { RefCell::new(None) };
}

fuzz_target!(|data: &[u8]| {
    let (config, shard) = match data.first() {
        Some(b'{') => match data.iter().position(|&b| b == 0) {
            Some(i) => (&data[..i], &data[i + 1..]),
            None => (data, &[][..]),
        },
        _ => (CONFIG.as_bytes(), data),
    };
    DIR.with(|d| {
        let mut d = d.borrow_mut();
        let dir = d.get_or_insert_with(|| tempfile::tempdir().expect("tempdir"));
        let p = dir.path();
        std::fs::write(p.join("config.json"), config).expect("write config");
        std::fs::write(p.join("model.safetensors"), shard).expect("write shard");
        let Ok(c) = Container::open(p) else {
            return;
        };
        let names: Vec<String> = c.names().map(str::to_owned).collect();
        for n in &names {
            if let Ok(w) = c.weight(n) {
                let _ = w.view();
            }
            let _ = c.vector(n);
            let _ = c.bytes(n);
        }
        let _ = c.find_non_finite(1 << 20);
        let _ = c.largest_magnitude(1 << 20);
        let c = Arc::new(c);
        if let Ok(src) = ContainerSource::new(c.clone()) {
            for l in 0..src.num_layers().min(8) {
                for e in 0..src.num_experts(l).min(8) {
                    let _ = src.locate(l, e);
                }
            }
        }
    });
});
