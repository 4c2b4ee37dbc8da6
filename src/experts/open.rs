//! Opening a store: locate and check every routed expert, read the routing history, plan the
//! budget (pins, resident layers, LRU shares), start the I/O pool and the prefetch threads,
//! and load the resident layers.

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};
use std::sync::{Arc, Mutex};

use super::budget::BudgetPlan;
use super::cache::LayerCache;
use super::file_io::Files;
use super::io_pool::IoPool;
use super::options::StoreOptions;
use super::persistence::open_history;
use super::predictor_gate::Predictions;
use super::prefetch::start_prefetch_threads;
use super::prefetch_queue::{PrefetchMode, PrefetchQueue};
use super::read_costs::ReadCosts;
use super::source::{ContainerSource, ExpertLoc, ExpertLocator};
use super::stats::{BusyClock, LayerCounters};
use super::{ExpertStore, Inner, LayerState};
use crate::error::{Error, Result};

/// One MoE layer's expert locations and the bytes each is charged when resident.
type LayerLocs = (Vec<ExpertLoc>, Vec<u64>);

impl ExpertStore {
    /// Open the routed experts of a container.
    pub fn open(container: Arc<crate::container::Container>, opts: StoreOptions) -> Result<Self> {
        Self::open_source(Arc::new(ContainerSource::new(container)?), opts)
    }

    /// Open the experts described by any [`ExpertLocator`].
    pub fn open_source(source: Arc<dyn ExpertLocator>, opts: StoreOptions) -> Result<Self> {
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
        let mut locs_by_layer: Vec<Option<LayerLocs>> = Vec::with_capacity(source.num_layers());
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
        let (usage_path, base) = open_history(source.as_ref(), &opts, &fingerprint, &shape);
        let charged = |l: usize, e: usize| -> Option<u64> {
            locs_by_layer
                .get(l)?
                .as_ref()
                .and_then(|(_, est)| est.get(e).copied())
        };
        let plan = BudgetPlan::new(&opts, &shape, charged, &base)?;
        let layers = locs_by_layer
            .into_iter()
            .enumerate()
            .map(|(l, x)| {
                x.map(|(locs, est)| {
                    let n = locs.len();
                    let pinned = (plan.pinned_of(l, n).into_iter())
                        .zip(&est)
                        .map(|(pinned, &bytes)| pinned.then_some(bytes))
                        .collect();
                    LayerState {
                        cache: Mutex::new(LayerCache::new(
                            n,
                            plan.lru_capacity(l),
                            pinned,
                            opts.guard_tokens,
                        )),
                        est,
                        counters: LayerCounters::default(),
                        usage: (0..n).map(|_| AtomicU64::new(0)).collect(),
                        pred: Mutex::new(Predictions::new(n, opts.prefetch_min_precision)),
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
            budget: plan.budget + plan.resident_bytes,
            pin_set_bytes: plan.pin_set_bytes + plan.resident_bytes,
            pin_set_len: plan.pins.len(),
            resident_bytes: plan.resident_bytes,
            busy: BusyClock::default(),
            read_costs: Mutex::new(ReadCosts::default()),
        });
        let workers = match &inner.queue {
            Some(q) => start_prefetch_threads(&inner, q, opts.prefetch_threads)?,
            None => Vec::new(),
        };
        let store = ExpertStore {
            inner,
            workers,
            pid: std::process::id(),
        };
        // Resident layers are loaded now, so their first use waits on nothing.
        for &(l, n) in store
            .inner
            .shape
            .iter()
            .filter(|&&(l, _)| plan.is_resident(l))
        {
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
}
