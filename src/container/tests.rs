//! Container reader tests on small files written here (community layout and ours).

use super::*;
use crate::container::safetensors::{write_header, TensorSpec};
use crate::quant::pack::quantize;

/// (name, dtype, shape, bytes) of a tensor to write.
pub(crate) type Entry = (String, Dtype, Vec<usize>, Vec<u8>);

pub(crate) fn tiny_config_json() -> serde_json::Value {
    serde_json::json!({
        "model_type": "deepseek_v3",
        "vocab_size": 64, "hidden_size": 128, "intermediate_size": 96,
        "moe_intermediate_size": 192, "num_hidden_layers": 2, "num_attention_heads": 2,
        "q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_head_dim": 16, "qk_rope_head_dim": 8,
        "v_head_dim": 16, "n_routed_experts": 4, "num_experts_per_tok": 2,
        "n_shared_experts": 1, "first_k_dense_replace": 1, "n_group": 2, "topk_group": 1,
        "num_nextn_predict_layers": 0
    })
}

/// Write one safetensors file from (name, dtype, shape, bytes).
pub(crate) fn write_file(path: &Path, tensors: &[Entry], meta: &BTreeMap<String, String>) {
    let specs: Vec<TensorSpec> = tensors
        .iter()
        .map(|(n, d, s, _)| TensorSpec {
            name: n.clone(),
            dtype: *d,
            shape: s.clone(),
        })
        .collect();
    let mut out = write_header(&specs, meta);
    for (_, _, _, b) in tensors {
        out.extend_from_slice(b);
    }
    std::fs::write(path, out).unwrap();
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn lcg(seed: u64, n: usize) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0
        })
        .collect()
}

/// A quantised weight in the community layout: U8 bytes + `.qs` F32 scales.
fn quantised(name: &str, f: QuantFormat, rows: usize, cols: usize) -> (Vec<Entry>, Vec<f32>) {
    let w = lcg(name.len() as u64 * 7 + rows as u64, rows * cols);
    let p = quantize(f, name, &w, rows, cols).unwrap();
    let n = p.data.len();
    let s = p.scales.len();
    (
        vec![
            (name.to_string(), Dtype::U8, vec![n], p.data),
            (
                format!("{name}.qs"),
                Dtype::F32,
                vec![s],
                f32_bytes(&p.scales),
            ),
        ],
        w,
    )
}

struct Dir(tempfile::TempDir);

fn setup(config: &serde_json::Value) -> Dir {
    let d = tempfile::tempdir().unwrap();
    std::fs::write(d.path().join("config.json"), config.to_string()).unwrap();
    Dir(d)
}

#[test]
fn community_layout_reads_back() {
    let dir = setup(&tiny_config_json());
    let g64 = QuantFormat::Int4Grouped { group_size: 64 };
    let mut tensors = Vec::new();
    let mut originals = Vec::new();
    for (name, f, r, c) in [
        (
            "model.layers.1.mlp.experts.0.gate_proj.weight",
            g64,
            192,
            128,
        ),
        (
            "model.layers.1.mlp.experts.0.down_proj.weight",
            g64,
            128,
            192,
        ),
        (
            "model.embed_tokens.weight",
            QuantFormat::Int8PerRow,
            64,
            128,
        ),
        (
            "model.layers.0.self_attn.o_proj.weight",
            QuantFormat::Int4PerRow,
            128,
            32,
        ),
        (
            "model.layers.0.mlp.up_proj.weight",
            QuantFormat::Int4Grouped { group_size: 32 },
            96,
            128,
        ),
    ] {
        let (t, w) = quantised(name, f, r, c);
        tensors.extend(t);
        originals.push((name, f, r, c, w));
    }
    let norm: Vec<f32> = (0..128).map(|i| i as f32 / 8.0).collect();
    let bf: Vec<u8> = norm
        .iter()
        .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
        .collect();
    tensors.push(("model.norm.weight".into(), Dtype::Bf16, vec![128], bf));
    write_file(
        &dir.0.path().join("model-00001.safetensors"),
        &tensors[..4],
        &BTreeMap::new(),
    );
    write_file(
        &dir.0.path().join("model-00002.safetensors"),
        &tensors[4..],
        &BTreeMap::new(),
    );

    let c = Container::open(dir.0.path()).unwrap();
    for (name, f, r, col, w) in originals {
        let wt = c.weight(name).unwrap();
        assert_eq!((wt.format(), wt.rows(), wt.cols()), (f, r, col), "{name}");
        let back = wt.to_f32();
        let gs = f.group_size(col);
        let scales = wt.view().scales().to_vec();
        for o in 0..r {
            for i in 0..col {
                let s = scales[o * f.scales_per_row(col) + i / gs];
                assert!((back[o * col + i] - w[o * col + i]).abs() <= 0.5 * s * 1.0001);
            }
        }
    }
    assert_eq!(c.vector("model.norm.weight").unwrap(), norm);
    assert!(c.contains("model.embed_tokens.weight.qs"));
    assert_eq!(c.names().count(), 11);
    assert_eq!(
        c.info("model.layers.0.mlp.up_proj.weight").unwrap().format,
        Some(QuantFormat::Int4Grouped { group_size: 32 })
    );
    let e = c.weight("lm_head.weight").unwrap_err();
    assert!(matches!(e, Error::MissingTensor { .. }), "{e}");
    assert!(e.to_string().contains("lm_head.weight"));
    let e = c.weight("model.norm.weight").unwrap_err().to_string();
    assert!(e.contains("not a 2-D weight"), "{e}");
}

#[test]
fn metadata_is_cross_checked() {
    let dir = setup(&tiny_config_json());
    let name = "model.layers.1.mlp.experts.0.gate_proj.weight";
    let (t, _) = quantised(name, QuantFormat::Int4Grouped { group_size: 64 }, 192, 128);
    let path = dir.0.path().join("a.safetensors");
    let mut meta = BTreeMap::new();
    meta.insert(name.to_string(), "int4_g64".to_string());
    meta.insert(FORMAT_VERSION_KEY.to_string(), FORMAT_VERSION.to_string());
    write_file(&path, &t, &meta);
    assert!(Container::open(dir.0.path()).is_ok());
    meta.insert(name.to_string(), "int8".to_string());
    write_file(&path, &t, &meta);
    let e = Container::open(dir.0.path()).unwrap_err().to_string();
    assert!(
        e.contains("__metadata__ says int8") && e.contains(name) && e.contains("a.safetensors"),
        "{e}"
    );
    meta.insert(name.to_string(), "q4_k".to_string());
    write_file(&path, &t, &meta);
    assert!(Container::open(dir.0.path()).is_err());
    meta.insert(name.to_string(), "int4_g64".to_string());
    meta.insert(FORMAT_VERSION_KEY.to_string(), "99".to_string());
    write_file(&path, &t, &meta);
    let e = Container::open(dir.0.path()).unwrap_err().to_string();
    assert!(e.contains("99"), "{e}");
}

fn open_err(tensors: &[Entry], config: &serde_json::Value) -> Error {
    let dir = setup(config);
    write_file(
        &dir.0.path().join("s.safetensors"),
        tensors,
        &BTreeMap::new(),
    );
    Container::open(dir.0.path()).unwrap_err()
}

#[test]
fn inconsistent_containers_are_errors_naming_file_and_tensor() {
    let cfg = tiny_config_json();
    let name = "model.layers.1.mlp.experts.0.gate_proj.weight";
    let (mut t, _) = quantised(name, QuantFormat::Int4Grouped { group_size: 64 }, 192, 128);
    // Wrong scale count: drop one scale.
    t[1].2 = vec![383];
    t[1].3.truncate(383 * 4);
    let e = open_err(&t, &cfg);
    let s = e.to_string();
    assert!(
        matches!(e, Error::Container { .. }) && s.contains(name) && s.contains("s.safetensors"),
        "{s}"
    );
    assert!(s.contains("383 scales"), "{s}");

    // Logical shape disagreeing with the config: a config with a different hidden size.
    let (t, _) = quantised(name, QuantFormat::Int4Grouped { group_size: 64 }, 192, 128);
    let mut other = cfg.clone();
    other["hidden_size"] = 256.into();
    let s = open_err(&t, &other).to_string();
    assert!(s.contains("[192, 256]") && s.contains(name), "{s}");

    // Float weight with a shape the config disagrees with.
    let w = (
        "model.layers.0.self_attn.o_proj.weight".to_string(),
        Dtype::F32,
        vec![16, 32],
        vec![0u8; 16 * 32 * 4],
    );
    let s = open_err(&[w], &cfg).to_string();
    assert!(s.contains("disagrees") && s.contains("o_proj"), "{s}");

    // U8 without scales; scales without weight; scales of the wrong dtype.
    let (t, _) = quantised(name, QuantFormat::Int8PerRow, 192, 128);
    let s = open_err(&t[..1], &cfg).to_string();
    assert!(s.contains("without its scales"), "{s}");
    let s = open_err(&t[1..], &cfg).to_string();
    assert!(s.contains("without its weight"), "{s}");
    let mut t2 = t.clone();
    t2[1].1 = Dtype::I32;
    let s = open_err(&t2, &cfg).to_string();
    assert!(s.contains("scales must be F32") && s.contains(".qs"), "{s}");

    // Norm of the wrong length.
    let n = (
        "model.norm.weight".to_string(),
        Dtype::F32,
        vec![7],
        vec![0u8; 28],
    );
    let s = open_err(&[n], &cfg).to_string();
    assert!(
        s.contains("model.norm.weight") && s.contains("[128]"),
        "{s}"
    );
}

#[test]
fn truncated_and_garbage_shards_are_errors() {
    let cfg = tiny_config_json();
    let dir = setup(&cfg);
    let name = "model.layers.1.mlp.experts.0.gate_proj.weight";
    let (t, _) = quantised(name, QuantFormat::Int8PerRow, 192, 128);
    let path = dir.0.path().join("s.safetensors");
    write_file(&path, &t, &BTreeMap::new());
    let full = std::fs::read(&path).unwrap();
    for cut in [0, 3, 8, 20, full.len() - 1] {
        std::fs::write(&path, &full[..cut]).unwrap();
        let e = Container::open(dir.0.path()).unwrap_err();
        let s = e.to_string();
        assert!(matches!(e, Error::Container { .. }), "cut {cut}: {s}");
        assert!(s.contains("s.safetensors"), "cut {cut}: {s}");
    }
    std::fs::remove_file(&path).unwrap();
    let e = Container::open(dir.0.path()).unwrap_err().to_string();
    assert!(e.contains("no *.safetensors"), "{e}");
}

#[test]
fn weight_is_send_sync_and_cheap_to_clone() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Weight>();
    assert_send_sync::<Container>();
    let w = Weight::from_owned(QuantFormat::F32, 1, 2, f32_bytes(&[1.0, 2.0]), vec![]).unwrap();
    assert_eq!(w.clone().to_f32(), vec![1.0, 2.0]);
    assert!(Weight::from_owned(QuantFormat::Int8PerRow, 1, 2, vec![1, 2], vec![]).is_err());
}

#[test]
fn corrupted_bytes_never_panic() {
    // Flip bytes all over a valid two-tensor file (header and data): opening and reading
    // must return Ok or an error, never panic.
    let cfg = tiny_config_json();
    let dir = setup(&cfg);
    let name = "model.layers.1.mlp.experts.0.gate_proj.weight";
    let (t, _) = quantised(name, QuantFormat::Int4Grouped { group_size: 64 }, 192, 128);
    let path = dir.0.path().join("s.safetensors");
    write_file(&path, &t, &BTreeMap::new());
    let good = std::fs::read(&path).unwrap();
    let mut x = 12345u64;
    for _ in 0..400 {
        let mut bad = good.clone();
        for _ in 0..3 {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            // Mostly in the header, where structure lives.
            let limit = if x.is_multiple_of(4) {
                bad.len()
            } else {
                8 + 200
            };
            let pos = (x >> 33) as usize % limit.min(bad.len());
            bad[pos] = (x >> 20) as u8;
        }
        std::fs::write(&path, &bad).unwrap();
        if let Ok(c) = Container::open(dir.0.path()) {
            let _ = c.weight(name).map(|w| w.to_f32());
        }
    }
}

/// A weight read after its shard shrank is `Error::Container` naming the file and
/// tensor (through the old mapping it was a SIGBUS that killed the test binary), and a weight
/// read before the truncation stays valid (it is owned memory).
#[test]
fn a_shard_truncated_after_open_fails_the_read_not_the_process() {
    let dir = setup(&tiny_config_json());
    let name = "model.layers.0.self_attn.o_proj.weight";
    let (mut tensors, _) = quantised(name, QuantFormat::Int4PerRow, 128, 32);
    let (more, _) = quantised(
        "model.embed_tokens.weight",
        QuantFormat::Int8PerRow,
        64,
        128,
    );
    tensors.extend(more);
    let path = dir.0.path().join("model-00001.safetensors");
    write_file(&path, &tensors, &BTreeMap::new());
    let c = Container::open(dir.0.path()).unwrap();
    let kept = c.weight(name).unwrap();
    let before = kept.to_f32();
    let data_start = c.info(name).unwrap().range.start;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(data_start as u64 + 10)
        .unwrap();
    for result in [
        c.weight(name).map(|_| ()),
        c.weight("model.embed_tokens.weight").map(|_| ()),
        c.bytes(name).map(|_| ()),
    ] {
        match result {
            Err(Error::Container { file, tensor, msg }) => {
                assert_eq!(file, path);
                assert!(tensor.is_some_and(|t| t.starts_with("model.")));
                assert!(msg.contains("truncated or replaced"), "{msg}");
            }
            other => panic!("expected a container error, got {other:?}"),
        }
    }
    assert_eq!(kept.to_f32(), before);
}

/// Stored floats are checked as a weight or vector is read: NaN, Inf and ±3e38 in scales,
/// float weights and vectors are `Error::NonFiniteWeight` naming the tensor and index.
#[test]
fn bad_stored_floats_are_refused_when_read() {
    for bad in [f32::NAN, f32::INFINITY, -3e38] {
        let dir = setup(&tiny_config_json());
        let q = "model.layers.0.self_attn.o_proj.weight";
        let (mut tensors, _) = quantised(q, QuantFormat::Int4PerRow, 128, 32);
        // Scales of `q`: poke element 5.
        tensors[1].3[20..24].copy_from_slice(&bad.to_le_bytes());
        let mut norm = vec![1.0f32; 128];
        norm[9] = bad;
        tensors.push((
            "model.norm.weight".into(),
            Dtype::F32,
            vec![128],
            f32_bytes(&norm),
        ));
        let mut router = vec![0.5f32; 4 * 128];
        router[77] = bad;
        let bf: Vec<u8> = router
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect();
        tensors.push((
            "model.layers.1.mlp.gate.weight".into(),
            Dtype::Bf16,
            vec![4, 128],
            bf,
        ));
        write_file(
            &dir.0.path().join("m.safetensors"),
            &tensors,
            &BTreeMap::new(),
        );
        let c = Container::open(dir.0.path()).unwrap();
        for (tensor_want, index_want, got) in [
            (format!("{q}.qs"), 5, c.weight(q).map(|_| ())),
            (
                "model.norm.weight".into(),
                9,
                c.vector("model.norm.weight").map(|_| ()),
            ),
            (
                "model.layers.1.mlp.gate.weight".into(),
                77,
                c.weight("model.layers.1.mlp.gate.weight").map(|_| ()),
            ),
        ] {
            match got {
                Err(Error::NonFiniteWeight { tensor, index, .. }) => {
                    assert_eq!((tensor, index), (tensor_want, index_want), "{bad}");
                }
                other => panic!("{bad}: expected NonFiniteWeight, got {other:?}"),
            }
        }
        let (found, complete) = c.find_non_finite(u64::MAX);
        assert!(complete);
        assert!(found.is_some(), "{bad}");
    }
}
