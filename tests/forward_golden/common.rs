//! What the golden tests share: the fixtures, a minimal reader of their golden files, and
//! the measures of how far logits are from the goldens.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use colibri::container::Container;
use colibri::model::{Model, ModelOptions};

pub const FIXTURES: [&str; 5] = ["dsv3_a", "dsv3_b", "glm_a", "glm_b", "glm_dsa"];

pub fn fixture_dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

/// A minimal safetensors reader for the golden files (independent of the container code).
pub struct Golden {
    tensors: HashMap<String, (String, Vec<usize>, Vec<u8>)>,
}

impl Golden {
    pub fn load(name: &str) -> Golden {
        Golden::load_file(name, "golden.safetensors")
    }
    /// Another golden file of the fixture (e.g. `golden_int4.safetensors`).
    pub fn load_file(name: &str, file: &str) -> Golden {
        let bytes = std::fs::read(fixture_dir(name).join(file)).unwrap();
        let n = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
        let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + n]).unwrap();
        let data = &bytes[8 + n..];
        let mut tensors = HashMap::new();
        for (k, v) in header.as_object().unwrap() {
            if k == "__metadata__" {
                continue;
            }
            let dtype = v["dtype"].as_str().unwrap().to_owned();
            let shape = v["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|d| d.as_u64().unwrap() as usize)
                .collect();
            let off = v["data_offsets"].as_array().unwrap();
            let (a, b) = (
                off[0].as_u64().unwrap() as usize,
                off[1].as_u64().unwrap() as usize,
            );
            tensors.insert(k.clone(), (dtype, shape, data[a..b].to_vec()));
        }
        Golden { tensors }
    }
    pub fn f32(&self, k: &str) -> (Vec<usize>, Vec<f32>) {
        let (dt, shape, b) = &self.tensors[k];
        assert_eq!(dt, "F32");
        (
            shape.clone(),
            b.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect(),
        )
    }
    pub fn ids(&self, k: &str) -> Vec<u32> {
        let (dt, _, b) = &self.tensors[k];
        assert_eq!(dt, "I64");
        b.chunks_exact(8)
            .map(|c| i64::from_le_bytes(c.try_into().unwrap()) as u32)
            .collect()
    }
    /// A selection golden ([rows, index_topk] I32, ascending, −1 padded) as one list per row.
    pub fn selection(&self, k: &str) -> Vec<Vec<u32>> {
        let (dt, shape, b) = &self.tensors[k];
        assert_eq!(dt, "I32");
        let vals: Vec<i32> = b
            .chunks_exact(4)
            .map(|c| i32::from_le_bytes(c.try_into().unwrap()))
            .collect();
        vals.chunks_exact(shape[1])
            .map(|r| r.iter().filter(|&&j| j >= 0).map(|&j| j as u32).collect())
            .collect()
    }
    /// prompt + greedy continuation minus its last token: the teacher-forced sequence, and
    /// transformers' logits at each of its rows.
    pub fn forced(&self) -> (Vec<u32>, Vec<f32>) {
        let mut ids = self.ids("prompt_ids");
        let greedy = self.ids("greedy_ids");
        ids.extend(&greedy[..greedy.len() - 1]);
        let (shape, mut want) = self.f32("logits");
        let (_, greedy_logits) = self.f32("greedy_logits");
        want.extend(&greedy_logits[shape[1]..]);
        (ids, want)
    }
}

pub fn load(name: &str) -> Model {
    let c = Arc::new(Container::open(&fixture_dir(name)).unwrap());
    Model::load(c, &ModelOptions::default()).unwrap()
}

pub fn max_abs(v: &[f32]) -> f32 {
    v.iter().fold(0.0f32, |m, x| m.max(x.abs()))
}

/// max |a − b| / max |b|.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let d = a
        .iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()));
    d / max_abs(b)
}

pub fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// The worst row's max |a − b| / max |b|, rows of `v`.
pub fn worst_row_rel_err(a: &[f32], b: &[f32], v: usize) -> f32 {
    (0..b.len() / v)
        .map(|r| rel_err(&a[r * v..(r + 1) * v], &b[r * v..(r + 1) * v]))
        .fold(0.0, f32::max)
}

/// Mean over rows of KL(p‖q) in nats, p = softmax(want), q = softmax(got), rows of `v`.
pub fn mean_kl(want: &[f32], got: &[f32], v: usize) -> f64 {
    let log_softmax = |row: &[f32]| -> Vec<f64> {
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &x| m.max(x as f64));
        let z = row.iter().map(|&x| (x as f64 - m).exp()).sum::<f64>().ln();
        row.iter().map(|&x| x as f64 - m - z).collect()
    };
    let rows = want.len() / v;
    let mut total = 0.0;
    for r in 0..rows {
        let lp = log_softmax(&want[r * v..(r + 1) * v]);
        let lq = log_softmax(&got[r * v..(r + 1) * v]);
        total += lp
            .iter()
            .zip(&lq)
            .map(|(a, b)| a.exp() * (a - b))
            .sum::<f64>();
    }
    total / rows as f64
}

/// Fraction of rows of `v` logits whose argmax agrees.
pub fn top1_agreement(a: &[f32], b: &[f32], v: usize) -> f64 {
    let rows = a.len() / v;
    let same = (0..rows)
        .filter(|&r| argmax(&a[r * v..(r + 1) * v]) == argmax(&b[r * v..(r + 1) * v]))
        .count();
    same as f64 / rows as f64
}
