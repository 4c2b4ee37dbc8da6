//! One sequence's KV caches, apart from the model's weights.

use std::sync::atomic::{AtomicU64, Ordering};

use crate::model::attention::LayerKv;

/// One sequence's KV caches (every main layer's and the MTP layer's). The model holds only
/// weights: a session owns its caches and each forward is given the caches of the
/// sequences it computes ([`Model::new_caches`](super::Model::new_caches) makes them).
#[derive(Clone)]
pub struct KvCaches {
    pub(super) layers: Vec<LayerKv>,
    pub(super) mtp: LayerKv,
    /// Names the sequence to a routing observer ([`super::RoutingSink`]); a clone keeps it.
    id: u64,
}

impl KvCaches {
    /// Caches of these layers, with a new [`id`](Self::id).
    pub(super) fn new(layers: Vec<LayerKv>, mtp: LayerKv) -> Self {
        static NEXT: AtomicU64 = AtomicU64::new(1);
        KvCaches {
            layers,
            mtp,
            id: NEXT.fetch_add(1, Ordering::Relaxed),
        }
    }
    /// A number that tells these caches from every other made in this process.
    pub fn id(&self) -> u64 {
        self.id
    }
    /// Bytes held (main layers and MTP layer).
    pub fn bytes(&self) -> usize {
        self.layers.iter().map(LayerKv::bytes).sum::<usize>() + self.mtp.bytes()
    }
    /// Rows in the main caches.
    pub fn len(&self) -> usize {
        self.layers.first().map_or(0, LayerKv::len)
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Forget every row.
    pub fn clear(&mut self) {
        for kv in self.all_mut() {
            kv.truncate(0);
        }
    }
    /// Keep the first `len` rows (of the main layers; the MTP layer's at most as many).
    pub fn truncate(&mut self, len: usize) {
        for kv in self.all_mut() {
            kv.truncate(len);
        }
    }
    /// Keep the first `len` rows of the main layers (roll back rejected positions).
    pub fn truncate_main(&mut self, len: usize) {
        for kv in &mut self.layers {
            kv.truncate(len);
        }
    }
    /// Keep the first `len` rows of the MTP layer.
    pub fn truncate_mtp(&mut self, len: usize) {
        self.mtp.truncate(len);
    }
    /// Forget every row and give the memory back (an evicted session's).
    pub fn release(&mut self) {
        for kv in self.all_mut() {
            kv.release();
        }
    }
    /// Rows in the MTP layer's cache.
    pub fn mtp_len(&self) -> usize {
        self.mtp.len()
    }
    /// Every cache, main layers in order then the MTP layer's: the layout a saved context
    /// records (their row widths) and the order its payload follows.
    pub fn all(&self) -> impl Iterator<Item = &LayerKv> {
        self.layers.iter().chain(std::iter::once(&self.mtp))
    }
    pub fn all_mut(&mut self) -> impl Iterator<Item = &mut LayerKv> {
        self.layers.iter_mut().chain(std::iter::once(&mut self.mtp))
    }
    /// Benchmarks only: append `rows` rows of random values to every cache (main layers,
    /// indexer keys, the MTP layer), so that a decode step can be timed at a long context
    /// without prefilling it. The rows are not a real context; what follows computes
    /// nothing meaningful, at the cost of a real one.
    pub fn append_synthetic(&mut self, rows: usize, seed: u64) {
        let mut state = seed | 1;
        // xorshift64 → two uniforms → one Box-Muller normal.
        let mut uniform = move || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            ((state >> 11) as f64 + 0.5) / (1u64 << 53) as f64
        };
        let mut normal = move || {
            let (u, v) = (uniform(), uniform());
            ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos()) as f32
        };
        for kv in self.all_mut() {
            kv.append_random(rows, &mut normal);
        }
    }

    /// Bytes held by the main layers' caches (latents, roped keys and DSA indexer keys).
    pub fn main_bytes(&self) -> usize {
        self.layers.iter().map(LayerKv::bytes).sum()
    }

    /// Bytes held by the MTP layer's cache.
    pub fn mtp_bytes(&self) -> usize {
        self.mtp.bytes()
    }
}
