//! The expert store (docs/expert-store.md): routed experts live on disk and are brought into memory on
//! demand, per layer, under a RAM budget.
//!
//! - [`ExpertStore::with_experts`] resolves a forward's batch-union of experts against the
//!   pinned set → the layer's LRU → disk. Resident experts are handed to the caller at once;
//!   misses load on the I/O pool meanwhile and are handed over as each completes. Each
//!   expert is read at most once per call, and a load already in flight (a prefetch) is
//!   waited for, never repeated.
//! - [`ExpertStore::prefetch`] / [`ExpertStore::hint_previous`] take predictions (router
//!   lookahead / the previous token's experts) into a bounded queue served by prefetch
//!   threads: real loads into the layer's cache under an eviction guard, or page-cache hints.
//! - The routing history (`colibri-usage.json` in the user cache directory, keyed by the
//!   model's fingerprint; see [`usage`]) picks the pinned set and is merged back by
//!   [`ExpertStore::save_usage`]. Nothing is ever written into the model directory.
//!
//! Results never depend on the mode, cache size, pins, worker count or prefetch: the bytes
//! handed to the caller are the file's bytes, and the caller sums per-expert outputs in a
//! fixed order. See `docs/expert-store.md`.

mod cache;
pub mod fault;
mod io_pool;
mod prefetch;
pub mod source;
pub mod stats;
mod store;
pub mod synth;
pub mod usage;

#[cfg(test)]
mod tests;

use std::collections::{HashSet, VecDeque};
use std::panic::AssertUnwindSafe;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::mpsc;
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::error::{Error, Result};
use crate::quant::QMatrix;

use cache::{Evicted, HitKind, InFlight, LayerCache, Lookup, Origin};
use io_pool::IoPool;
use prefetch::{PrefetchQueue, Pushed};
use stats::LayerCounters;
use store::{Files, Resident};
use usage::UsageCounts;

pub use fault::{FaultInjector, FaultKind};
pub use prefetch::PrefetchMode;
pub use source::{ByteRange, ContainerSource, ExpertLoc, ExpertSource, MatrixLoc, StaticSource};
pub use stats::{LayerStats, StoreStats};
pub use store::IoMode;
pub use usage::{SaveOutcome, USAGE_FILE};

/// Lock a mutex, recovering from poisoning (a panicking holder leaves consistent state: every
/// critical section here is a few field updates).
pub(crate) fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Print a warning to stderr once per `key` per process.
pub(crate) fn warn_once(key: &str, msg: &str) {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    if lock(SEEN.get_or_init(Default::default)).insert(key.to_owned()) {
        eprintln!("colibri: warning: {msg}");
    }
}

/// Rebuild an error shared by several waiters (errors are not `Clone`).
fn replay(e: &Error) -> Error {
    match e {
        Error::Io { path, source } => Error::io(
            path.clone(),
            match source.raw_os_error() {
                Some(code) => std::io::Error::from_raw_os_error(code),
                None => std::io::Error::new(source.kind(), source.to_string()),
            },
        ),
        Error::Container { file, tensor, msg } => Error::Container {
            file: file.clone(),
            tensor: tensor.clone(),
            msg: msg.clone(),
        },
        Error::InvalidArgument { param, msg } => Error::invalid(param.clone(), msg.clone()),
        Error::NonFiniteWeight {
            file,
            tensor,
            what,
            index,
        } => Error::NonFiniteWeight {
            file: file.clone(),
            tensor: tensor.clone(),
            what: what.clone(),
            index: *index,
        },
        other => Error::Internal(other.to_string()),
    }
}

/// The three matrices of one expert, borrowed from the store for the duration of a callback.
#[derive(Debug, Clone, Copy)]
pub struct ExpertView<'a> {
    /// [moe_intermediate, hidden]
    pub gate: QMatrix<'a>,
    /// [moe_intermediate, hidden]
    pub up: QMatrix<'a>,
    /// [hidden, moe_intermediate]
    pub down: QMatrix<'a>,
}

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
    /// Read and save the routing history (see [`usage`]). Default true.
    pub usage_file: bool,
    /// The cache directory the routing history is kept in (under
    /// `models/<fingerprint>/`). Default `None`: [`usage::default_cache_dir`]
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

/// `MemAvailable` from /proc/meminfo in bytes, where it can be read.
pub fn mem_available() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    })
}

/// Half of `MemAvailable` from /proc/meminfo (4 GiB where it cannot be read).
pub fn auto_budget() -> u64 {
    mem_available().map_or(4 << 30, |b| b / 2)
}

/// Which predictor made a prediction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Predictor {
    Router = 0,
    Previous = 1,
}

/// Predictions for a layer's next call, and its latest routing.
struct Predictions {
    router: Vec<bool>,
    previous: Vec<bool>,
    hinted: Vec<bool>,
    /// The predictions each predictor made of experts that were not resident (what its
    /// prefetches would read): [router, previous].
    cold: [Vec<bool>; 2],
    last: Vec<usize>,
    /// Running precision of each predictor in this layer, starting at the gate
    /// (`prefetch_min_precision`, or `PRECISION_START` when the gate is off): [router, previous]. An EWMA of |cold ∩ routed| / |cold| per call: the share of the
    /// reads its prefetches would start that the call then uses. Predictions of resident
    /// experts do not count: they cost nothing and save nothing, and with a warm cache they
    /// are the easy, right ones (the previous token's experts), which hid that the reads
    /// actually issued were mostly wasted (measured: 0.10 of issued prefetches used at a
    /// 25% budget while 0.5 of all predictions were right).
    precision: [f64; 2],
}

/// Weight of the latest call in the running precision.
const PRECISION_ALPHA: f64 = 0.25;
/// Starting precision when the gate is off (0); otherwise a predictor starts at the gate, so
/// one poor call closes it (short generations cannot afford a long learning phase).
const PRECISION_START: f64 = 0.5;

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
    busy: stats::BusyClock,
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

    /// Open the routed experts of a container.
    pub fn open(container: Arc<crate::container::Container>, opts: StoreOptions) -> Result<Self> {
        Self::open_source(Arc::new(ContainerSource::new(container)?), opts)
    }

    /// Open the experts described by any [`ExpertSource`].
    pub fn open_source(source: Arc<dyn ExpertSource>, opts: StoreOptions) -> Result<Self> {
        if opts.io_threads == 0 {
            return Err(Error::invalid("io_threads", "must be at least 1"));
        }
        if opts.prefetch != PrefetchMode::Off && opts.prefetch_threads == 0 {
            return Err(Error::invalid(
                "prefetch_threads",
                "must be at least 1 when prefetch is on (or set prefetch to off)",
            ));
        }
        // Free slabs kept for reuse: the demand window plus one per prefetch thread.
        let pool_slabs = 2 * opts.io_threads.max(1) + opts.prefetch_threads + 1;
        let (files, lens) = Files::open(source.files(), opts.io, pool_slabs)?;
        let mut locs_by_layer = Vec::with_capacity(source.num_layers());
        let mut shape = Vec::new();
        for l in 0..source.num_layers() {
            let n = source.num_experts(l);
            if n == 0 {
                locs_by_layer.push(None);
                continue;
            }
            let locs = (0..n)
                .map(|e| source.locate(l, e))
                .collect::<Result<Vec<_>>>()?;
            for loc in &locs {
                loc.validate(source.files(), &lens)?;
            }
            let est: Vec<u64> = locs.iter().map(|loc| files.expected_bytes(loc)).collect();
            shape.push((l, n));
            locs_by_layer.push(Some((locs, est)));
        }
        if shape.is_empty() {
            return Err(Error::invalid(
                "model",
                "the container has no routed experts (no MoE layer)",
            ));
        }
        let fingerprint = source.fingerprint();
        let legacy = source.model_dir().join(USAGE_FILE);
        let cache_dir = if opts.usage_file {
            let dir = opts.cache_dir.clone().or_else(usage::default_cache_dir);
            if dir.is_none() {
                warn_once(
                    "usage-no-cache-dir",
                    &format!(
                        "no cache directory for the routing history (set {} or HOME); it \
                         will not be saved",
                        usage::CACHE_DIR_ENV
                    ),
                );
            }
            dir
        } else {
            None
        };
        let usage_path = cache_dir.map(|d| usage::history_path(&d, &fingerprint));
        let base = if !opts.usage_file {
            UsageCounts::zeros(&shape)
        } else {
            let (c, warning) = match &usage_path {
                Some(p) => usage::load_or_migrate(p, Some(&legacy), &fingerprint, &shape),
                None => usage::load(&legacy, &fingerprint, &shape),
            };
            if let Some(w) = warning {
                let key = usage_path.as_deref().unwrap_or(&legacy).display();
                warn_once(&format!("usage-load:{key}"), &w);
            }
            c
        };
        let budget = opts.ram_budget_bytes.unwrap_or_else(auto_budget);
        let est_of = |l: usize, e: usize| -> Option<u64> {
            locs_by_layer
                .get(l)?
                .as_ref()
                .and_then(|(_, est)| est.get(e).copied())
        };
        let mut resident = opts.resident_layers.clone();
        resident.sort_unstable();
        resident.dedup();
        if let Some(&bad) = resident
            .iter()
            .find(|&&l| !shape.iter().any(|&(sl, _)| sl == l))
        {
            return Err(Error::invalid(
                "resident_layers",
                format!(
                    "layer {bad} has no routed experts (MoE layers: {:?})",
                    shape.iter().map(|&(l, _)| l).collect::<Vec<_>>()
                ),
            ));
        }
        let is_resident = |l: usize| resident.binary_search(&l).is_ok();
        let mut pins: Vec<(usize, usize)> = match &opts.pin {
            PinPolicy::Off => Vec::new(),
            PinPolicy::History { fraction } => {
                let share = (budget as f64 * fraction.clamp(0.0, 1.0)) as u64;
                // Experts of resident layers are pinned anyway; never spend budget on them.
                let bytes = |l: usize, e: usize| match is_resident(l) {
                    true => u64::MAX,
                    false => est_of(l, e).unwrap_or(u64::MAX),
                };
                usage::select_pins(&base, bytes, share)
            }
            PinPolicy::Explicit(v) => {
                let mut v = v.clone();
                v.retain(|&(l, _)| !is_resident(l));
                v
            }
        };
        let mut pin_set_bytes = 0u64;
        for &(l, e) in &pins {
            pin_set_bytes += est_of(l, e).ok_or_else(|| {
                Error::invalid("pin", format!("layer {l} has no routed expert {e}"))
            })?;
        }
        if pin_set_bytes > budget {
            return Err(Error::invalid(
                "pin",
                format!(
                    "the pinned experts take {pin_set_bytes} bytes, over the {budget}-byte budget"
                ),
            ));
        }
        let lru_layers = shape.iter().filter(|&&(l, _)| !is_resident(l)).count();
        let lru_per_layer = (budget - pin_set_bytes) / lru_layers.max(1) as u64;
        let mut resident_bytes = 0u64;
        for &(l, n) in shape.iter().filter(|&&(l, _)| is_resident(l)) {
            for e in 0..n {
                resident_bytes += est_of(l, e).unwrap_or(0);
                pins.push((l, e));
            }
        }
        pins.sort_unstable();
        pins.dedup();
        let start_precision = match opts.prefetch_min_precision {
            p if p > 0.0 => p.min(1.0),
            _ => PRECISION_START,
        };
        let layers = locs_by_layer
            .into_iter()
            .enumerate()
            .map(|(l, x)| {
                x.map(|(locs, est)| {
                    let n = locs.len();
                    let mut pinned = vec![false; n];
                    for &(pl, e) in &pins {
                        if pl == l {
                            pinned[e] = true;
                        }
                    }
                    LayerState {
                        est,
                        cache: Mutex::new(LayerCache::new(
                            n,
                            if is_resident(l) { 0 } else { lru_per_layer },
                            pinned,
                            opts.guard_tokens,
                        )),
                        counters: LayerCounters::default(),
                        usage: (0..n).map(|_| AtomicU64::new(0)).collect(),
                        pred: Mutex::new(Predictions {
                            router: vec![false; n],
                            previous: vec![false; n],
                            hinted: vec![false; n],
                            cold: [vec![false; n], vec![false; n]],
                            last: Vec::new(),
                            precision: [start_precision; 2],
                        }),
                        locs,
                    }
                })
            })
            .collect();
        let io = IoPool::new(opts.io_threads)?;
        let queue = (opts.prefetch != PrefetchMode::Off)
            .then(|| Arc::new(PrefetchQueue::new(opts.prefetch_queue)));
        let inner = Arc::new(Inner {
            files,
            layers,
            io,
            queue,
            prefetch: opts.prefetch,
            min_precision: opts.prefetch_min_precision,
            window: (2 * opts.io_threads).max(2),
            fingerprint,
            usage_path,
            usage_base: Mutex::new(base),
            shape,
            budget: budget + resident_bytes,
            pin_set_bytes: pin_set_bytes + resident_bytes,
            pin_set_len: pins.len(),
            busy: stats::BusyClock::default(),
        });
        let mut workers = Vec::new();
        if let Some(q) = &inner.queue {
            for i in 0..opts.prefetch_threads {
                let (inner, q) = (inner.clone(), q.clone());
                let h = std::thread::Builder::new()
                    .name(format!("colibri-prefetch-{i}"))
                    .spawn(move || {
                        while let Some((layer, id, hint)) = q.pop() {
                            let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
                                Inner::run_prefetch(&inner, layer, id, hint)
                            }));
                        }
                    })
                    .map_err(|e| Error::Internal(format!("cannot start a prefetch thread: {e}")))?;
                workers.push(h);
            }
        }
        let store = ExpertStore {
            inner,
            workers,
            pid: std::process::id(),
        };
        // Resident layers are loaded now, so their first use waits on nothing.
        for &(l, n) in store.inner.shape.iter().filter(|&&(l, _)| is_resident(l)) {
            let all: Vec<usize> = (0..n).collect();
            store.with_experts(l, &all, &mut |_, _| Ok(()))?;
            // Loading is not routing: keep it out of the history.
            if let Ok(ls) = store.inner.layer(l) {
                ls.usage.iter().for_each(|u| u.store(0, Relaxed));
            }
        }
        store.reset_stats();
        Ok(store)
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

    /// Make experts `ids` of `layer` resident and call `f(id, &view)` for each distinct id:
    /// resident ones at once, missing ones as their loads complete (loads run on the I/O
    /// pool meanwhile, at most `2 × io_threads` outstanding). The call order may vary; the
    /// views do not. Records the routing history and the predictors' recall. On error (a
    /// failed read, or `f` failing) returns it; the store stays usable.
    pub fn with_experts(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(usize, &ExpertView<'_>) -> Result<()>,
    ) -> Result<()> {
        let inner = &self.inner;
        let ls = inner.layer(layer)?;
        let n = ls.locs.len();
        let mut ids = ids.to_vec();
        ids.sort_unstable();
        ids.dedup();
        if let Some(&bad) = ids.iter().find(|&&i| i >= n) {
            return Err(bad_id(layer, bad, n));
        }
        inner.record_routing(ls, &ids);
        let c = &ls.counters;
        c.calls.fetch_add(1, Relaxed);
        c.routed.fetch_add(ids.len() as u64, Relaxed);

        let mut ready = Vec::new();
        let mut missing = VecDeque::new();
        let (tx, rx) = mpsc::channel();
        let mut outstanding = 0usize;
        {
            let mut cache = lock(&ls.cache);
            cache.begin(&ids);
            for &id in &ids {
                match cache.lookup(id) {
                    Lookup::Hit(v, kind) => {
                        count_hit(c, kind);
                        ready.push((id, v));
                    }
                    Lookup::Loading(fl) => {
                        if fl.origin == Origin::Prefetch {
                            fl.claim();
                            c.hits_inflight.fetch_add(1, Relaxed);
                            c.prefetch_useful.fetch_add(1, Relaxed);
                        }
                        fl.listen(id, tx.clone());
                        outstanding += 1;
                    }
                    Lookup::Missing => missing.push_back(id),
                }
            }
        }
        // Start the first window of misses before computing with the resident experts.
        let mut next_miss = |outstanding: &mut usize| -> Result<()> {
            while *outstanding < inner.window {
                let Some(id) = missing.pop_front() else { break };
                Inner::start_demand(inner, layer, ls, id, &tx)?;
                *outstanding += 1;
            }
            Ok(())
        };
        next_miss(&mut outstanding)?;
        for (id, v) in ready {
            f(id, &v.view()?)?;
        }
        loop {
            next_miss(&mut outstanding)?;
            if outstanding == 0 {
                return Ok(());
            }
            let t = Instant::now();
            let got = rx.recv();
            c.wait_ns.fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
            let (id, res) = got.map_err(|_| Error::Internal("an I/O worker vanished".into()))?;
            outstanding -= 1;
            let v = res.map_err(|e| replay(&e))?;
            f(id, &v.view()?)?;
        }
    }

    /// Predicted experts of `layer` (router lookahead): counted for recall, and loaded or
    /// hinted in the background by the prefetch threads. Never blocks on I/O; invalid ids
    /// are ignored.
    pub fn prefetch(&self, layer: usize, ids: &[usize]) {
        self.inner.predict(layer, ids, Predictor::Router);
    }

    /// Start-of-layer prediction "the experts the previous token used in this layer":
    /// counted for recall and, unless prefetch is off, given a page-cache hint (never a real
    /// load: the demand for this layer follows at once).
    pub fn hint_previous(&self, layer: usize) {
        let Ok(ls) = self.inner.layer(layer) else {
            return;
        };
        let ids = lock(&ls.pred).last.clone();
        self.inner.predict(layer, &ids, Predictor::Previous);
    }

    /// Counters, totals and per layer, plus memory gauges.
    pub fn stats(&self) -> StoreStats {
        let inner = &self.inner;
        let mut s = StoreStats {
            io_mode: inner.files.mode(),
            budget_bytes: inner.budget,
            pin_set_bytes: inner.pin_set_bytes,
            pin_set_len: inner.pin_set_len,
            live_owned_bytes: inner.files.pool.gauge.live(),
            peak_owned_bytes: inner.files.pool.gauge.peak(),
            io_busy_ns: inner.busy.busy_ns(),
            ..Default::default()
        };
        for (l, ls) in inner.layers.iter().enumerate() {
            let Some(ls) = ls else { continue };
            let snap = ls.counters.snapshot();
            s.total.add(&snap);
            s.layers.push((l, snap));
            let c = lock(&ls.cache);
            s.lru_bytes += c.used();
            s.lru_capacity_bytes += c.capacity();
            s.pinned_bytes += c.pinned_used();
        }
        s
    }

    /// Zero the counters (per generation); resident experts stay.
    pub fn reset_stats(&self) {
        for ls in self.inner.layers.iter().flatten() {
            ls.counters.reset();
        }
        self.inner.files.pool.gauge.reset_peak();
        self.inner.busy.reset();
    }

    /// Where the routing history is saved (in the cache directory), or `None` when it is
    /// not (`usage_file` off, or no cache directory could be determined).
    pub fn usage_path(&self) -> Option<&std::path::Path> {
        self.inner.usage_path.as_deref()
    }

    /// Merge this session's routing counts into the history file (atomic write). A failure to
    /// write (read-only directory...) warns once and returns `Skipped`; it is never an error.
    pub fn save_usage(&self) -> Result<SaveOutcome> {
        let inner = &self.inner;
        let Some(path) = &inner.usage_path else {
            return Ok(SaveOutcome::Skipped(
                "the routing history is not saved (usage_file off, or no cache directory)".into(),
            ));
        };
        let delta = UsageCounts {
            layers: inner
                .layers
                .iter()
                .enumerate()
                .filter_map(|(l, ls)| {
                    ls.as_ref()
                        .map(|ls| (l, ls.usage.iter().map(|a| a.load(Relaxed)).collect()))
                })
                .collect(),
        };
        let mut base = lock(&inner.usage_base);
        match usage::save(path, &inner.fingerprint, &inner.shape, &base, &delta) {
            Ok(merged) => {
                for (l, counts) in &delta.layers {
                    if let Some(Some(ls)) = inner.layers.get(*l) {
                        for (a, &d) in ls.usage.iter().zip(counts) {
                            a.fetch_sub(d, Relaxed);
                        }
                    }
                }
                *base = merged;
                Ok(SaveOutcome::Written(path.clone()))
            }
            Err(msg) => {
                warn_once(&format!("usage-save:{}", path.display()), &msg);
                Ok(SaveOutcome::Skipped(msg))
            }
        }
    }

    /// Fault injection for tests: rules that make reads of chosen files fail.
    pub fn faults(&self) -> &FaultInjector {
        &self.inner.files.faults
    }

    /// Drop the shards from the page cache (`posix_fadvise(DONTNEED)`), for cold-cache
    /// measurements. Resident experts stay resident.
    pub fn drop_page_cache(&self) {
        self.inner.files.drop_page_cache();
    }

    /// The RAM budget in effect, bytes.
    /// The model's fingerprint (its config and shard sizes): what per-model state on disk
    /// is keyed by and checked against.
    pub fn fingerprint(&self) -> &str {
        &self.inner.fingerprint
    }

    pub fn budget_bytes(&self) -> u64 {
        self.inner.budget
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

fn count_hit(c: &LayerCounters, kind: HitKind) {
    match kind {
        HitKind::Pinned => c.hits_pinned.fetch_add(1, Relaxed),
        HitKind::Lru => c.hits_lru.fetch_add(1, Relaxed),
        HitKind::Prefetched => {
            c.prefetch_useful.fetch_add(1, Relaxed);
            c.hits_prefetched.fetch_add(1, Relaxed)
        }
    };
}

fn count_evicted(c: &LayerCounters, ev: Vec<Evicted<Resident>>) {
    for e in ev {
        c.evictions.fetch_add(1, Relaxed);
        if e.wasted_prefetch {
            c.prefetch_wasted.fetch_add(1, Relaxed);
        }
    }
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

    /// Routing history, predictor recall and hint usefulness for one call.
    fn record_routing(&self, ls: &LayerState, ids: &[usize]) {
        for &id in ids {
            ls.usage[id].fetch_add(1, Relaxed);
        }
        let c = &ls.counters;
        let mut p = lock(&ls.pred);
        let routed = ids.len() as u64;
        let n_router = p.router.iter().filter(|&&b| b).count() as u64;
        let n_prev = p.previous.iter().filter(|&&b| b).count() as u64;
        let n_hinted = p.hinted.iter().filter(|&&b| b).count() as u64;
        let n_cold = [0, 1].map(|i| p.cold[i].iter().filter(|&&b| b).count() as u64);
        let (mut hr, mut hp, mut ha, mut hh) = (0u64, 0u64, 0u64, 0u64);
        let mut hit_cold = [0u64; 2];
        for &id in ids {
            hr += p.router[id] as u64;
            hp += p.previous[id] as u64;
            ha += (p.router[id] || p.previous[id]) as u64;
            hh += p.hinted[id] as u64;
            hit_cold[0] += p.cold[0][id] as u64;
            hit_cold[1] += p.cold[1][id] as u64;
        }
        c.predicted_router.fetch_add(n_router, Relaxed);
        c.predicted_previous.fetch_add(n_prev, Relaxed);
        if n_router > 0 {
            c.routed_router.fetch_add(routed, Relaxed);
            c.recalled_router.fetch_add(hr, Relaxed);
        }
        if n_prev > 0 {
            c.routed_previous.fetch_add(routed, Relaxed);
            c.recalled_previous.fetch_add(hp, Relaxed);
        }
        if n_router + n_prev > 0 {
            c.routed_any.fetch_add(routed, Relaxed);
            c.recalled_any.fetch_add(ha, Relaxed);
        }
        c.prefetch_useful.fetch_add(hh, Relaxed);
        c.prefetch_wasted.fetch_add(n_hinted - hh, Relaxed);
        p.router.fill(false);
        p.previous.fill(false);
        p.hinted.fill(false);
        for i in 0..2 {
            if n_cold[i] > 0 {
                let now = hit_cold[i] as f64 / n_cold[i] as f64;
                p.precision[i] = (1.0 - PRECISION_ALPHA) * p.precision[i] + PRECISION_ALPHA * now;
            }
            p.cold[i].fill(false);
        }
        p.last = ids.to_vec();
    }

    /// Resolve one miss of a call: a hit after all, a load in flight to wait for, or a new
    /// load on the I/O pool. The result arrives on `tx` in every case.
    fn start_demand(
        this: &Arc<Inner>,
        layer: usize,
        ls: &LayerState,
        id: usize,
        tx: &mpsc::Sender<cache::Completion<Resident>>,
    ) -> Result<()> {
        let c = &ls.counters;
        let mut ev = Vec::new();
        let fl = {
            let mut cache = lock(&ls.cache);
            match cache.lookup(id) {
                Lookup::Hit(v, kind) => {
                    count_hit(c, kind);
                    let _ = tx.send((id, Ok(v)));
                    return Ok(());
                }
                Lookup::Loading(fl) => {
                    if fl.origin == Origin::Prefetch {
                        fl.claim();
                        c.hits_inflight.fetch_add(1, Relaxed);
                        c.prefetch_useful.fetch_add(1, Relaxed);
                    }
                    fl.listen(id, tx.clone());
                    return Ok(());
                }
                Lookup::Missing => cache
                    .start(id, ls.est[id], Origin::Demand, &mut ev)
                    .ok_or_else(|| Error::Internal("a demand load was refused".into()))?,
            }
        };
        count_evicted(c, ev);
        c.misses.fetch_add(1, Relaxed);
        fl.listen(id, tx.clone());
        let inner = this.clone();
        this.io
            .spawn(move || Inner::run_load(&inner, layer, id, &fl));
        Ok(())
    }

    /// Load `id` of `layer` for the in-flight record `fl`, insert it and notify waiters.
    fn run_load(&self, layer: usize, id: usize, fl: &Arc<InFlight<Resident>>) {
        let Ok(ls) = self.layer(layer) else { return };
        self.busy.begin();
        let res = std::panic::catch_unwind(AssertUnwindSafe(|| self.files.load(&ls.locs[id])))
            .unwrap_or_else(|_| Err(Error::Internal("an expert load panicked".into())));
        self.busy.end();
        let shared = match res {
            Ok((r, n)) => {
                ls.counters.bytes_read.fetch_add(n, Relaxed);
                ls.counters.loads.fetch_add(1, Relaxed);
                Ok(Arc::new(r))
            }
            Err(e) => Err(Arc::new(e)),
        };
        lock(&ls.cache).complete(id, fl, &shared);
        fl.finish(shared);
    }

    fn predict(&self, layer: usize, ids: &[usize], who: Predictor) {
        let Ok(ls) = self.layer(layer) else { return };
        let n = ls.locs.len();
        let cold: Vec<usize> = {
            let cache = lock(&ls.cache);
            ids.iter()
                .copied()
                .filter(|&i| i < n && cache.is_empty(i))
                .collect()
        };
        let precision = {
            let mut p = lock(&ls.pred);
            let set = match who {
                Predictor::Router => &mut p.router,
                Predictor::Previous => &mut p.previous,
            };
            for &id in ids.iter().filter(|&&i| i < n) {
                set[id] = true;
            }
            for &id in &cold {
                p.cold[who as usize][id] = true;
            }
            p.precision[who as usize]
        };
        let Some(q) = &self.queue else { return };
        let hint_only = who == Predictor::Previous || self.prefetch == PrefetchMode::Hint;
        if hint_only && self.files.mode() == IoMode::Direct {
            // A page-cache hint cannot help O_DIRECT reads, which bypass the page cache, yet
            // the kernel still reads the bytes: on a disk-bound run every hint is a wasted
            // expert read (measured: 0.65x plain at a 0% budget before this check).
            return;
        }
        let c = &ls.counters;
        if precision < self.min_precision {
            c.prefetch_gated
                .fetch_add(ids.iter().filter(|&&i| i < n).count() as u64, Relaxed);
            return;
        }
        // Resident or in flight when predicted: nothing to read (the cold set says which).
        let valid = ids.iter().filter(|&&i| i < n).count();
        c.prefetch_redundant
            .fetch_add((valid - cold.len()) as u64, Relaxed);
        for &id in &cold {
            match q.push((layer, id, who == Predictor::Previous)) {
                Pushed::Queued => {}
                Pushed::Duplicate => {
                    c.prefetch_redundant.fetch_add(1, Relaxed);
                }
                Pushed::DroppedOldest(l) => {
                    if let Ok(old) = self.layer(l) {
                        old.counters.prefetch_dropped.fetch_add(1, Relaxed);
                    }
                }
            }
        }
    }

    /// One prefetch request, on a prefetch thread.
    fn run_prefetch(this: &Arc<Inner>, layer: usize, id: usize, hint_only: bool) {
        let Ok(ls) = this.layer(layer) else { return };
        let c = &ls.counters;
        let mode = match this.prefetch {
            PrefetchMode::Real if hint_only => PrefetchMode::Hint,
            m => m,
        };
        match mode {
            PrefetchMode::Off => {}
            PrefetchMode::Hint => {
                if !lock(&ls.cache).is_empty(id) {
                    c.prefetch_redundant.fetch_add(1, Relaxed);
                    return;
                }
                this.files.hint(&ls.locs[id]);
                lock(&ls.pred).hinted[id] = true;
                c.prefetch_issued.fetch_add(1, Relaxed);
            }
            PrefetchMode::Real => {
                let mut ev = Vec::new();
                let fl = {
                    let mut cache = lock(&ls.cache);
                    if !cache.is_empty(id) {
                        c.prefetch_redundant.fetch_add(1, Relaxed);
                        return;
                    }
                    cache.start(id, ls.est[id], Origin::Prefetch, &mut ev)
                };
                count_evicted(c, ev);
                let Some(fl) = fl else {
                    c.prefetch_guarded.fetch_add(1, Relaxed);
                    return;
                };
                c.prefetch_issued.fetch_add(1, Relaxed);
                this.run_load(layer, id, &fl);
            }
        }
    }
}
