//! The expert store (docs/expert-store.md): routed experts live on disk and are brought into memory on
//! demand, per layer, under a RAM budget.
//!
//! - [`ExpertStore::with_experts`] ([`demand`]) resolves a forward's batch-union of experts
//!   against the pinned set → the layer's LRU → disk. Resident experts are handed to the
//!   caller at once; misses load on the I/O pool meanwhile and are handed over as each
//!   completes. Each expert is read at most once per call, and a load already in flight (a
//!   prefetch) is waited for, never repeated.
//! - [`ExpertStore::prefetch`] / [`ExpertStore::hint_previous`] ([`prefetch`]) take
//!   predictions (router lookahead / the previous token's experts), scored and gated per
//!   layer by [`predictor_gate`], into a bounded queue ([`prefetch_queue`]) served by
//!   prefetch threads: real loads into the layer's cache under an eviction guard, or
//!   page-cache hints.
//! - The routing history (`colibri-usage.json` in the user cache directory, keyed by the
//!   model's fingerprint; see [`usage`], and [`persistence`] for the store's side) picks the
//!   pinned set ([`budget`]) and is merged back by [`ExpertStore::save_usage`]. Nothing is
//!   ever written into the model directory.
//! - [`open`] puts it together; [`file_io`] reads the bytes from the container files
//!   (mmap / pread / O_DIRECT), [`cache`] is the per-layer LRU with pins and loads in flight.
//!
//! Results never depend on the mode, cache size, pins, worker count or prefetch: the bytes
//! handed to the caller are the file's bytes, and the caller sums per-expert outputs in a
//! fixed order. See `docs/expert-store.md`.

mod budget;
mod cache;
mod demand;
#[cfg(any(test, feature = "testing"))]
pub mod fault;
mod file_io;
mod io_pool;
mod open;
mod options;
mod persistence;
mod predictor_gate;
mod prefetch;
mod prefetch_queue;
pub mod read_costs;
pub mod source;
pub mod stats;
/// Synthetic containers of real shapes (stand-ins for benchmarks and replays): always
/// built, so `cargo bench` and `make_synthetic` need no feature.
pub mod synth;
pub mod usage;

#[cfg(test)]
mod tests;

use std::path::PathBuf;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;

pub(crate) use crate::diagnostics::warn_once;
use crate::error::{Error, Result};
use crate::quant::QMatrix;

use cache::LayerCache;
use file_io::{Files, Resident};
use io_pool::IoPool;
use predictor_gate::Predictions;
use prefetch_queue::PrefetchQueue;
use read_costs::{LayerShape, ReadCosts};
use stats::{BusyClock, LayerCounters};
use usage::UsageCounts;

pub use budget::{auto_budget, mem_available};
#[cfg(any(test, feature = "testing"))]
pub use fault::{FaultInjector, FaultKind};
pub use file_io::IoMode;
pub use options::{PinPolicy, StoreOptions};
pub use prefetch_queue::PrefetchMode;
pub use read_costs::ReadPrice;
pub use source::{ByteRange, ContainerSource, ExpertLoc, ExpertLocator, MatrixLoc, StaticSource};
pub use stats::{LayerStats, StoreStats};
pub use usage::{SaveOutcome, USAGE_FILE};

/// Lock a mutex, recovering from poisoning (a panicking holder leaves consistent state: every
/// critical section here is a few field updates).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// The three matrices of one routed expert, borrowed for the duration of a callback: from the
/// store, or from the resident copies (`model::moe::ResidentExperts`); the one type every
/// `model::moe::ExpertProvider` hands the MoE.
#[derive(Debug, Clone, Copy)]
pub struct ExpertView<'a> {
    /// [moe_intermediate, hidden]
    pub gate: QMatrix<'a>,
    /// [moe_intermediate, hidden]
    pub up: QMatrix<'a>,
    /// [hidden, moe_intermediate]
    pub down: QMatrix<'a>,
}

/// Experts handed over together: `(id, view)` pairs, each id once
/// ([`ExpertStore::with_expert_batches`], `model::moe::ExpertProvider`).
pub type ExpertBatch<'a> = [(usize, ExpertView<'a>)];

/// One MoE layer of the store.
struct LayerState {
    locs: Vec<ExpertLoc>,
    /// Bytes each expert is charged when resident.
    est: Vec<u64>,
    cache: Mutex<LayerCache<Resident>>,
    counters: LayerCounters,
    /// Routing counts since the last save.
    usage: Vec<AtomicU64>,
    pred: Mutex<Predictions>,
}

struct Inner {
    files: Files,
    layers: Vec<Option<LayerState>>,
    io: IoPool,
    queue: Option<Arc<PrefetchQueue>>,
    prefetch: PrefetchMode,
    min_precision: f64,
    /// Demand loads a call keeps outstanding (bounds its transient memory).
    window: usize,
    fingerprint: String,
    usage_path: Option<PathBuf>,
    usage_base: Mutex<UsageCounts>,
    shape: Vec<(usize, usize)>,
    budget: u64,
    pin_set_bytes: u64,
    pin_set_len: usize,
    /// Bytes of the resident layers' experts (inside `budget` and `pin_set_bytes`).
    resident_bytes: u64,
    busy: BusyClock,
    /// The measured read costs a draft is priced by ([`ExpertStore::read_price`]).
    read_costs: Mutex<ReadCosts>,
}

/// The expert store. `Send + Sync`; share it behind an `Arc`.
pub struct ExpertStore {
    inner: Arc<Inner>,
    workers: Vec<JoinHandle<()>>,
    /// The process that started the workers: a forked child has none of them.
    pid: u32,
}

impl ExpertStore {
    /// The process that opened the store (and runs its workers); a forked child differs.
    pub fn owner_pid(&self) -> u32 {
        self.pid
    }

    /// Layer indices that have routed experts, and how many each has.
    pub fn layers(&self) -> Vec<(usize, usize)> {
        self.inner.shape.clone()
    }

    /// Where expert `expert` of `layer` is (tests, tools).
    pub fn location(&self, layer: usize, expert: usize) -> Result<&ExpertLoc> {
        let ls = self.inner.layer(layer)?;
        ls.locs
            .get(expert)
            .ok_or_else(|| bad_id(layer, expert, ls.locs.len()))
    }

    /// Bytes expert `expert` of `layer` is charged against the budget while resident.
    pub fn charged_bytes(&self, layer: usize, expert: usize) -> Result<u64> {
        let ls = self.inner.layer(layer)?;
        ls.est
            .get(expert)
            .copied()
            .ok_or_else(|| bad_id(layer, expert, ls.locs.len()))
    }

    /// Fault injection for tests (feature `testing`): rules that make reads of chosen files
    /// fail.
    #[cfg(any(test, feature = "testing"))]
    pub fn faults(&self) -> &FaultInjector {
        &self.inner.files.faults
    }

    /// Drop the shards from the page cache (`posix_fadvise(DONTNEED)`), for cold-cache
    /// measurements. Resident experts stay resident.
    pub fn drop_page_cache(&self) {
        self.inner.files.drop_page_cache();
    }

    /// The model's fingerprint (its config and shard sizes): what per-model state on disk
    /// is keyed by and checked against.
    pub fn fingerprint(&self) -> &str {
        &self.inner.fingerprint
    }

    /// The RAM budget in effect, bytes.
    pub fn budget_bytes(&self) -> u64 {
        self.inner.budget
    }

    /// What a draft's reads cost now, for `k` routed experts per token with the MTP layer at
    /// `mtp_layer` (see [`read_costs`]): updated from the counters since the last call.
    pub fn read_price(&self, k: usize, mtp_layer: Option<usize>) -> ReadPrice {
        let stats = self.stats();
        let shapes: Vec<LayerShape> = self
            .inner
            .shape
            .iter()
            .filter_map(|&(layer, experts)| {
                let ls = self.inner.layer(layer).ok()?;
                let bytes: u64 = ls.est.iter().sum();
                let cache = lock(&ls.cache);
                let holds = (cache.capacity() + cache.pin_set_bytes()).min(bytes);
                Some(LayerShape {
                    layer,
                    experts,
                    bytes,
                    holds,
                })
            })
            .collect();
        lock(&self.inner.read_costs).update(&stats, &shapes, k, mtp_layer)
    }

    /// Whether every streamed layer's LRU share holds at least `2·k` of its experts: room
    /// for a prefetched token's `k` beside the `k` the current token uses (the eviction
    /// guard protects those). With less, a prefetch can only be refused or evict what the
    /// next token needs, and on a disk-bound host its reads compete with the demand reads
    /// (docs/benchmarks.md, disk-bound decode).
    pub fn has_room_to_prefetch(&self, k: usize) -> bool {
        self.inner.layers.iter().flatten().all(|ls| {
            let cache = lock(&ls.cache);
            let bytes: u64 = ls.est.iter().sum();
            if cache.capacity() + cache.pin_set_bytes() >= bytes || ls.est.is_empty() {
                return true; // held whole (resident, or a budget that fits it)
            }
            let mean = bytes / ls.est.len() as u64;
            cache.capacity() >= 2 * k as u64 * mean
        })
    }

    /// Whether every routed expert can be resident at once: each layer's LRU share and pins
    /// hold all of its experts, so once each has been read no expert is ever read again.
    pub fn holds_every_expert(&self) -> bool {
        self.inner.layers.iter().flatten().all(|ls| {
            let cache = lock(&ls.cache);
            cache.capacity() + cache.pin_set_bytes() >= ls.est.iter().sum::<u64>()
        })
    }
}

impl Drop for ExpertStore {
    fn drop(&mut self) {
        if std::process::id() != self.pid {
            // A forked child: the workers exist only in the parent, so joining them (or taking
            // a queue lock one of them held at the fork) would never return. Leave them be.
            return;
        }
        if let Some(q) = &self.inner.queue {
            q.shutdown();
        }
        for h in self.workers.drain(..) {
            let _ = h.join();
        }
    }
}

fn bad_id(layer: usize, id: usize, n: usize) -> Error {
    Error::invalid(
        "expert",
        format!("expert id {id} is out of range for layer {layer} ({n} routed experts)"),
    )
}

impl Inner {
    fn layer(&self, layer: usize) -> Result<&LayerState> {
        self.layers
            .get(layer)
            .and_then(Option::as_ref)
            .ok_or_else(|| {
                Error::invalid(
                    "layer",
                    format!("layer {layer} has no routed experts in this model"),
                )
            })
    }
}
