//! Converter tests on synthetic checkpoints written here (BF16 and FP8 block-scaled).

use std::collections::HashMap;

use serde_json::Value;

use super::*;
use crate::config::ModelConfig;
use crate::container::names::{classify, expected_len, expected_shape, Proj, Role};
use crate::container::safetensors::Dtype;
use crate::container::tests::{write_file, Entry};
use crate::container::{
    expected_names, shard_paths, Container, FORMAT_VERSION, FORMAT_VERSION_KEY,
};
use crate::error::Error;
use crate::quant::format::QuantFormat;

fn cfg_json() -> Value {
    serde_json::json!({
        "model_type": "deepseek_v3",
        "vocab_size": 50, "hidden_size": 160, "intermediate_size": 80,
        "moe_intermediate_size": 96, "num_hidden_layers": 2, "num_attention_heads": 2,
        "q_lora_rank": 48, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "num_nextn_predict_layers": 1, "eos_token_id": 1
    })
}

fn lcg(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_add(99);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        })
        .collect()
}

fn bf16_round(v: &[f32]) -> Vec<f32> {
    v.iter()
        .map(|x| half::bf16::from_f32(*x).to_f32())
        .collect()
}

/// The FP8 byte nearest to `x` (reference encoder for tests: search the table).
fn e4m3_encode(table: &[f32; 256], x: f32) -> u8 {
    let mut best = 0u8;
    for b in 0..=255u8 {
        let v = table[b as usize];
        if v.is_finite() && (v - x).abs() < (table[best as usize] - x).abs() {
            best = b;
        }
    }
    best
}

/// A synthetic checkpoint in `dir`: returns the original f32 values of every tensor
/// (for FP8 sources: the decoded values, what the converter must reproduce).
pub(super) fn write_source(dir: &Path, fp8_block: Option<usize>) -> HashMap<String, Vec<f32>> {
    let mut cfg = cfg_json();
    if let Some(b) = fp8_block {
        cfg["quantization_config"] =
            serde_json::json!({"quant_method": "fp8", "weight_block_size": [b, b]});
    }
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), cfg.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), "{\"fake\": true}").unwrap();
    std::fs::write(dir.join("model.safetensors.index.json"), "{}").unwrap();
    let c = ModelConfig::from_json_str(&cfg.to_string(), "config.json").unwrap();
    let table = fp8::e4m3_table();
    let mut values = HashMap::new();
    let mut entries: Vec<Entry> = Vec::new();
    for (k, name) in expected_names(&c).into_iter().enumerate() {
        if let Some((o, i)) = expected_shape(&c, &name) {
            let w = lcg(k as u64, o * i, 0.05 + (k % 5) as f32);
            match fp8_block {
                Some(b) => {
                    let (so, si) = (o.div_ceil(b), i.div_ceil(b));
                    let scale: Vec<f32> = (0..so * si).map(|j| 0.01 * (j + 1) as f32).collect();
                    let mut bytes = Vec::with_capacity(o * i);
                    let mut dec = Vec::with_capacity(o * i);
                    for r in 0..o {
                        for col in 0..i {
                            let s = scale[(r / b) * si + col / b];
                            let q = e4m3_encode(&table, w[r * i + col] / s);
                            bytes.push(q);
                            dec.push(table[q as usize] * s);
                        }
                    }
                    entries.push((name.clone(), Dtype::F8E4M3, vec![o, i], bytes));
                    entries.push((
                        format!("{name}_scale_inv"),
                        Dtype::F32,
                        vec![so, si],
                        scale.iter().flat_map(|v| v.to_le_bytes()).collect(),
                    ));
                    values.insert(name, dec);
                }
                None => {
                    let w = bf16_round(&w);
                    let bytes = w
                        .iter()
                        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                        .collect();
                    entries.push((name.clone(), Dtype::Bf16, vec![o, i], bytes));
                    values.insert(name, w);
                }
            }
        } else {
            let n = expected_len(&c, &name).unwrap();
            let w = bf16_round(&lcg(k as u64, n, 1.0));
            let bytes = w
                .iter()
                .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
                .collect();
            entries.push((name.clone(), Dtype::Bf16, vec![n], bytes));
            values.insert(name, w);
        }
    }
    // An unrecognised tensor, copied unchanged.
    entries.push((
        "extra.step".into(),
        Dtype::I64,
        vec![1],
        7i64.to_le_bytes().to_vec(),
    ));
    // Split so that expert 1 of layer 1 straddles the two shards.
    let split = entries
        .iter()
        .position(|e| e.0 == "model.layers.1.mlp.experts.1.up_proj.weight")
        .unwrap();
    write_file(
        &dir.join("model-00001-of-00002.safetensors"),
        &entries[..split],
        &BTreeMap::new(),
    );
    write_file(
        &dir.join("model-00002-of-00002.safetensors"),
        &entries[split..],
        &BTreeMap::new(),
    );
    values
}

fn expected_format(c: &ModelConfig, name: &str) -> QuantFormat {
    let r = classify(c, name);
    let g64 = QuantFormat::Int4Grouped { group_size: 64 };
    match r.role {
        Role::Router => QuantFormat::F32,
        _ if r.layer.is_some_and(|l| c.is_mtp_layer(l)) => QuantFormat::Int8PerRow,
        Role::Embed | Role::LmHead => QuantFormat::Int8PerRow,
        _ => g64,
    }
}

fn check_output(dst: &Path, values: &HashMap<String, Vec<f32>>) {
    let out = Container::open(dst).unwrap();
    let c = out.config().clone();
    assert!(c.mtp_layer_index() == Some(2));
    for name in expected_names(&c) {
        let orig = &values[&name];
        if expected_shape(&c, &name).is_some() {
            let w = out.weight(&name).unwrap();
            assert_eq!(w.format(), expected_format(&c, &name), "{name}");
            let back = w.to_f32();
            let f = w.format();
            let (rows, cols) = (w.rows(), w.cols());
            let view = w.view();
            for o in 0..rows {
                for i in 0..cols {
                    let bound = if f.is_quantized() {
                        0.5 * view.row_scales(o)[i / f.group_size(cols)] * 1.0001
                    } else {
                        0.0
                    };
                    let err = (back[o * cols + i] - orig[o * cols + i]).abs();
                    assert!(err <= bound, "{name}[{o},{i}]: err {err} > {bound}");
                }
            }
        } else {
            assert_eq!(out.info(&name).unwrap().dtype, Dtype::F32, "{name}");
            assert_eq!(&out.vector(&name).unwrap(), orig, "{name}");
        }
    }
    assert_eq!(out.bytes("extra.step").unwrap(), 7i64.to_le_bytes());
    // Each expert's projections sit in one file, back to back (with their scales).
    for l in [1, 2] {
        for e in 0..c.n_routed_experts {
            let infos: Vec<_> = [Proj::Gate, Proj::Up, Proj::Down]
                .iter()
                .flat_map(|&p| {
                    let n = crate::container::expert_tensor_name(l, e, p);
                    [
                        out.info(&n).unwrap().clone(),
                        out.info(&format!("{n}.qs")).unwrap().clone(),
                    ]
                })
                .collect();
            for pair in infos.windows(2) {
                assert_eq!(pair[0].shard, pair[1].shard, "layer {l} expert {e}");
                assert_eq!(
                    pair[0].range.end, pair[1].range.start,
                    "layer {l} expert {e}"
                );
            }
        }
    }
    // Sidecars: tokenizer copied, index not, config without quantization_config.
    assert!(dst.join("tokenizer.json").exists());
    assert!(!dst.join("model.safetensors.index.json").exists());
    let cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dst.join("config.json")).unwrap()).unwrap();
    assert!(cfg.get("quantization_config").is_none());
    // Formats recorded in the metadata.
    let meta = out.shard_metadata(0).unwrap();
    assert_eq!(
        meta.get(FORMAT_VERSION_KEY).map(String::as_str),
        Some(FORMAT_VERSION)
    );
}

#[test]
fn bf16_checkpoint_converts_with_default_formats() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    let values = write_source(&src, None);
    let opts = ConvertOptions {
        max_shard_bytes: 40_000,
        chunk_bytes: 1000, // several row blocks per tensor
        ..ConvertOptions::default()
    };
    let report = convert(&src, &dst, &opts).unwrap();
    assert!(report.shards_written >= 3, "{report:?}");
    assert_eq!(report.shards_skipped, 0);
    check_output(&dst, &values);

    // Chunking does not change a byte: a single-block conversion gives identical shards.
    let dst2 = tmp.path().join("dst2");
    let big = ConvertOptions {
        chunk_bytes: 1 << 30,
        ..opts.clone()
    };
    convert(&src, &dst2, &big).unwrap();
    for p in shard_paths(&dst).unwrap() {
        let q = dst2.join(p.file_name().unwrap());
        assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
    }

    // Resume: everything complete is skipped; a damaged shard is rewritten.
    let again = convert(&src, &dst, &opts).unwrap();
    assert_eq!(again.shards_written, 0);
    assert_eq!(again.shards_skipped, report.shards_written);
    let victim = shard_paths(&dst).unwrap()[1].clone();
    let bytes = std::fs::read(&victim).unwrap();
    std::fs::write(&victim, &bytes[..bytes.len() / 2]).unwrap();
    let again = convert(&src, &dst, &opts).unwrap();
    assert_eq!(again.shards_written, 1);
    assert_eq!(std::fs::read(&victim).unwrap(), bytes);
    // Different options: shards holding experts are planned differently, so they are not
    // "done" — or, when the shard count changes, DST holds shards the new plan would not
    // write and the conversion is refused rather than mixing two conversions.
    let int8 = ConvertOptions {
        expert_bits: 8,
        ..opts.clone()
    };
    match plan(&src, &dst, &int8) {
        Ok(p) => {
            for (i, s) in p.shards.iter().enumerate() {
                if s.tensors.iter().any(|t| t.name.contains(".mlp.experts.1.")) {
                    assert!(!p.is_done(i).unwrap(), "{}", s.file_name);
                }
            }
        }
        Err(e) => assert!(e.to_string().contains("already holds"), "{e}"),
    }
}

#[test]
fn fp8_block_scaled_checkpoint_converts() {
    let tmp = tempfile::tempdir().unwrap();
    let (src, dst) = (tmp.path().join("src"), tmp.path().join("dst"));
    let values = write_source(&src, Some(32));
    let report = convert(&src, &dst, &ConvertOptions::default()).unwrap();
    assert_eq!(report.shards_written, 1);
    check_output(&dst, &values);
}

#[test]
fn refuses_to_write_into_src() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    write_source(&src, None);
    for dst in [
        src.clone(),
        src.join("out"),
        src.join("a/../b"),
        tmp.path().join("src/."),
    ] {
        let e = plan(&src, &dst, &ConvertOptions::default()).err().unwrap();
        assert!(
            matches!(e, Error::InvalidArgument { .. }),
            "{}: {e}",
            dst.display()
        );
    }
    // A DST holding unrelated weights is refused too.
    let dst = tmp.path().join("other");
    std::fs::create_dir_all(&dst).unwrap();
    std::fs::write(dst.join("foreign.safetensors"), b"x").unwrap();
    let e = plan(&src, &dst, &ConvertOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("foreign.safetensors"), "{e}");
    let bad = ConvertOptions {
        group_size: 65,
        ..ConvertOptions::default()
    };
    assert!(plan(&src, &tmp.path().join("x"), &bad)
        .err()
        .unwrap()
        .to_string()
        .contains("group_size"));
    let bad = ConvertOptions {
        expert_bits: 3,
        ..ConvertOptions::default()
    };
    assert!(plan(&src, &tmp.path().join("x"), &bad)
        .err()
        .unwrap()
        .to_string()
        .contains("expert_bits"));
}

#[test]
fn non_finite_source_names_tensor_and_index() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), cfg_json().to_string()).unwrap();
    let name = "model.layers.0.self_attn.o_proj.weight";
    let mut w = vec![half::bf16::from_f32(0.5); 160 * 32];
    w[5 * 32 + 3] = half::bf16::from_f32(f32::NAN);
    let bytes = w.iter().flat_map(|v| v.to_le_bytes()).collect();
    write_file(
        &src.join("m.safetensors"),
        &[(name.to_string(), Dtype::Bf16, vec![160, 32], bytes)],
        &BTreeMap::new(),
    );
    let opts = ConvertOptions {
        chunk_bytes: 32 * 4 * 2, // two rows per block: the NaN is in the third block
        ..ConvertOptions::default()
    };
    let e = convert(&src, &tmp.path().join("dst"), &opts).unwrap_err();
    match e {
        Error::NonFinite {
            tensor,
            what,
            index,
        } => {
            assert_eq!((tensor.as_str(), what, index), (name, "NaN", 5 * 32 + 3));
        }
        other => panic!("{other}"),
    }
    // The failed shard left only its temporary file, never a final one.
    assert!(shard_paths(&tmp.path().join("dst")).unwrap().is_empty());
}

#[test]
fn bad_sources_are_errors_naming_file_and_tensor() {
    let tmp = tempfile::tempdir().unwrap();
    let src = tmp.path().join("src");
    std::fs::create_dir_all(&src).unwrap();
    std::fs::write(src.join("config.json"), cfg_json().to_string()).unwrap();
    let name = "model.layers.0.self_attn.o_proj.weight";
    let cases: Vec<(Vec<Entry>, &str)> = vec![
        (
            vec![(
                name.into(),
                Dtype::Bf16,
                vec![32, 160],
                vec![0; 32 * 160 * 2],
            )],
            "[160, 32]",
        ),
        (
            vec![(name.into(), Dtype::F8E4M3, vec![160, 32], vec![0; 160 * 32])],
            "_scale_inv",
        ),
        (
            vec![(
                format!("{name}_scale_inv"),
                Dtype::F32,
                vec![2, 1],
                vec![0; 8],
            )],
            "without an FP8 weight",
        ),
        (
            vec![
                (name.into(), Dtype::F8E4M3, vec![160, 32], vec![0; 160 * 32]),
                (
                    format!("{name}_scale_inv"),
                    Dtype::F32,
                    vec![1, 1],
                    vec![0; 4],
                ),
            ],
            "[2, 1]",
        ),
        (
            vec![("model.norm.weight".into(), Dtype::Bf16, vec![3], vec![0; 6])],
            "length 160",
        ),
    ];
    for (entries, want) in cases {
        write_file(&src.join("m.safetensors"), &entries, &BTreeMap::new());
        let e = plan(&src, &tmp.path().join("dst"), &ConvertOptions::default())
            .err()
            .unwrap()
            .to_string();
        assert!(e.contains(want) && e.contains("m.safetensors"), "{e}");
    }
    std::fs::write(src.join("m.safetensors"), [1u8, 0, 0]).unwrap();
    let e = plan(&src, &tmp.path().join("dst"), &ConvertOptions::default())
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("truncated"), "{e}");
}

#[test]
fn only_container_sidecars_are_copied() {
    for keep in [
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "generation_config.json",
        "chat_template.jinja",
        "special_tokens_map.json",
        "LICENSE",
    ] {
        assert!(is_container_sidecar(keep), "{keep}");
    }
    for drop in [
        "config.json",
        "model-00001-of-00002.safetensors",
        "model.safetensors.index.json",
        "pytorch_model.bin",
        "colibri-usage.json",
        "activations.npz",
        "README.md",
        ".gitattributes",
        "notes.txt",
    ] {
        assert!(!is_container_sidecar(drop), "{drop}");
    }
}
