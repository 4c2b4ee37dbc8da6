//! Store tests on small synthetic containers: byte-identical views across every mode, cache
//! size, pin set, worker count and prefetch mode; faults; budget accounting; prefetch
//! bookkeeping; the routing-history file; the container adapter.

mod budget;
mod faults;
mod history;
mod prefetch;
mod views;

use std::collections::BTreeMap;
use std::sync::Arc;
use std::time::Instant;

use super::source::{fnv1a, FNV_OFFSET};
use super::synth::{self, SynthSpec};
use super::*;
use crate::quant::QuantFormat;

const G64: QuantFormat = QuantFormat::Int4Grouped { group_size: 64 };

fn make(spec: &SynthSpec) -> (tempfile::TempDir, Arc<StaticSource>) {
    let dir = tempfile::tempdir().expect("tempdir");
    let src = synth::write(dir.path(), spec).expect("synth");
    (dir, Arc::new(src))
}

fn opts(io: IoMode, budget: u64) -> StoreOptions {
    StoreOptions {
        io,
        ram_budget_bytes: Some(budget),
        io_threads: 2,
        pin: PinPolicy::Off,
        prefetch: PrefetchMode::Off,
        prefetch_threads: 1,
        usage_file: false,
        ..Default::default()
    }
}

fn digest_mats(mats: [&crate::quant::QMatrix<'_>; 3]) -> u64 {
    let mut h = FNV_OFFSET;
    for m in mats {
        h = fnv1a(m.data(), h);
        h = fnv1a(bytemuck::cast_slice(m.scales()), h);
        h = fnv1a(&[m.rows() as u8, m.cols() as u8], h);
    }
    h
}

fn digest(v: &ExpertView<'_>) -> u64 {
    digest_mats([&v.gate, &v.up, &v.down])
}

/// The digest of an expert computed straight from the file bytes.
fn reference(src: &StaticSource, layer: usize, e: usize) -> u64 {
    let loc = src.locate(layer, e).expect("loc");
    let files: Vec<Vec<u8>> = src
        .files
        .iter()
        .map(|p| std::fs::read(p).expect("read"))
        .collect();
    let get = |r: ByteRange| &files[r.file][r.offset as usize..r.end() as usize];
    let scales: Vec<Vec<f32>> = loc
        .mats()
        .iter()
        .map(|m| {
            get(m.scales.expect("scales"))
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect()
        })
        .collect();
    let q: Vec<crate::quant::QMatrix<'_>> = loc
        .mats()
        .iter()
        .zip(&scales)
        .map(|(m, s)| {
            crate::quant::QMatrix::new(m.format, m.rows, m.cols, get(m.data), s).expect("q")
        })
        .collect();
    digest_mats([&q[0], &q[1], &q[2]])
}

/// A deterministic routing trace: (layer, ids, predicted ids for that layer).
fn trace(spec: &SynthSpec, calls: usize) -> Vec<(usize, Vec<usize>, Vec<usize>)> {
    let layers = spec.moe_layers();
    let n = spec.n_routed_experts;
    let mut x = 12345u64;
    let mut rnd = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    (0..calls)
        .map(|i| {
            let l = layers[i % layers.len()];
            // Skewed: low ids are hot.
            let ids: Vec<usize> = (0..3)
                .map(|_| (rnd() % n as u64).min(rnd() % n as u64) as usize)
                .collect();
            let mut pred = ids[..2].to_vec();
            pred.push((rnd() % n as u64) as usize);
            (l, ids, pred)
        })
        .collect()
}

type Seen = Vec<(usize, Vec<(usize, u64)>)>;

fn run(store: &ExpertStore, tr: &[(usize, Vec<usize>, Vec<usize>)], predict: bool) -> Seen {
    let mut out = Vec::new();
    for (l, ids, pred) in tr {
        if predict {
            store.prefetch(*l, pred);
            store.hint_previous(*l);
        }
        let mut got = Vec::new();
        store
            .with_experts(*l, ids, &mut |id, v| {
                got.push((id, digest(v)));
                Ok(())
            })
            .expect("with_experts");
        got.sort_unstable();
        let mut want: Vec<usize> = ids.clone();
        want.sort_unstable();
        want.dedup();
        assert_eq!(
            got.iter().map(|g| g.0).collect::<Vec<_>>(),
            want,
            "each id once"
        );
        out.push((*l, got));
    }
    out
}
