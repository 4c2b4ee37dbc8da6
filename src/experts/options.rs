//! What [`ExpertStore::open`](super::ExpertStore::open) takes: the pin policy and the store's
//! options, each with its documented default.

use std::path::PathBuf;

use super::file_io::IoMode;
use super::prefetch_queue::PrefetchMode;

/// Which experts stay in memory for good.
#[derive(Debug, Clone, PartialEq)]
pub enum PinPolicy {
    /// No pins: every expert competes in its layer's LRU.
    Off,
    /// The most-routed experts of the routing history, up to `fraction` of the RAM budget.
    History { fraction: f64 },
    /// Exactly these (layer, expert) pairs (tests, experiments).
    Explicit(Vec<(usize, usize)>),
}

impl Default for PinPolicy {
    fn default() -> Self {
        PinPolicy::History { fraction: 0.5 }
    }
}

/// Options of [`ExpertStore::open`]. Every field has a documented default ([`Default`]).
#[derive(Debug, Clone, PartialEq)]
pub struct StoreOptions {
    /// How bytes get from disk to memory. Default: `Pread` (see docs/benchmarks.md).
    pub io: IoMode,
    /// RAM for resident experts, bytes; `None` = half of `MemAvailable` at open.
    pub ram_budget_bytes: Option<u64>,
    /// I/O worker threads for demand loads. Default 4.
    pub io_threads: usize,
    /// Pinned hot set. Default: history, half the budget.
    pub pin: PinPolicy,
    /// Prefetch policy. Default `Real`.
    pub prefetch: PrefetchMode,
    /// Prefetch worker threads. Default 2.
    pub prefetch_threads: usize,
    /// Capacity of the prefetch queue (requests); the oldest is dropped when full. Default 64.
    pub prefetch_queue: usize,
    /// The guard: a prefetch never evicts an expert used within this many of the layer's
    /// latest calls (nor a pinned one, nor a prediction still waiting to be used). Default 1.
    pub guard_tokens: u64,
    /// Read and save the routing history (see [`usage`](super::usage)). Default true.
    pub usage_file: bool,
    /// The cache directory the routing history is kept in (under
    /// `models/<fingerprint>/`). Default `None`:
    /// [`usage::default_cache_dir`](super::usage::default_cache_dir)
    /// (`$COLIBRI_CACHE_DIR`, `$XDG_CACHE_HOME/colibri`, `~/.cache/colibri`).
    pub cache_dir: Option<PathBuf>,
    /// Layers whose routed experts are all loaded at open and never evicted, in RAM *beyond*
    /// `ram_budget_bytes` (a user with memory to spare pins a whole layer, typically the MTP
    /// layer: its experts are read on every draft step). Default: none.
    pub resident_layers: Vec<usize>,
    /// Prefetching only pays when most predictions are right: a wrong one costs a whole
    /// expert read r (disk bandwidth, and CPU on a small machine), a right one saves only the
    /// wait w its demand would have had, which is less than r because demand loads already
    /// overlap compute. Break-even precision is r / (r + w): measured on the disk stand-ins
    /// 0.62 at a 0% budget, 0.71 at 25%, 0.74 at 50% (docs/benchmarks.md), so the default
    /// is 0.7. Below this running precision of a predictor in a layer its prefetches/hints
    /// there are skipped (`prefetch_gated`) until its predictions improve. 0 disables the gate.
    pub prefetch_min_precision: f64,
}

impl Default for StoreOptions {
    fn default() -> Self {
        StoreOptions {
            io: IoMode::default(),
            ram_budget_bytes: None,
            io_threads: 4,
            pin: PinPolicy::default(),
            prefetch: PrefetchMode::default(),
            prefetch_threads: 2,
            prefetch_queue: 64,
            guard_tokens: 1,
            usage_file: true,
            cache_dir: None,
            prefetch_min_precision: 0.7,
            resident_layers: Vec::new(),
        }
    }
}
