//! Counters of the expert store, kept per layer as relaxed atomics (no lock on the hot path)
//! and read as plain snapshots ([`LayerStats`], [`StoreStats`]).

use std::sync::atomic::{AtomicU64, Ordering::Relaxed};

use super::{lock, ExpertStore, IoMode};

macro_rules! counters {
    ($($(#[$m:meta])* $name:ident),* $(,)?) => {
        /// Live counters of one layer.
        #[derive(Debug, Default)]
        pub(crate) struct LayerCounters { $(pub(crate) $name: AtomicU64,)* }

        /// A snapshot of one layer's counters (or their sum over layers).
        #[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
        pub struct LayerStats { $($(#[$m])* pub $name: u64,)* }

        impl LayerCounters {
            pub(crate) fn snapshot(&self) -> LayerStats {
                LayerStats { $($name: self.$name.load(Relaxed),)* }
            }
            pub(crate) fn reset(&self) {
                $(self.$name.store(0, Relaxed);)*
            }
        }

        impl LayerStats {
            /// Add another snapshot into this one.
            pub fn add(&mut self, o: &LayerStats) {
                $(self.$name += o.$name;)*
            }
            /// (name, value) pairs, for bindings and reports.
            pub fn fields(&self) -> Vec<(&'static str, u64)> {
                vec![$((stringify!($name), self.$name),)*]
            }
        }
    };
}

counters! {
    /// `with_experts` calls (forwards through this layer).
    calls,
    /// Distinct experts requested over all calls (the batch-union size, summed).
    routed,
    /// Requests served by a pinned expert already in memory.
    hits_pinned,
    /// Requests served from the LRU part of the cache.
    hits_lru,
    /// First use of an expert that a real prefetch brought in.
    hits_prefetched,
    /// Requests that found a prefetch of the same expert still in flight and waited for it.
    hits_inflight,
    /// Requests that had to start a load.
    misses,
    /// Loads completed (demand and prefetch).
    loads,
    /// Bytes read from the shards (demand and prefetch; O_DIRECT alignment slack included).
    bytes_read,
    /// Nanoseconds `with_experts` spent blocked waiting for loads.
    wait_ns,
    /// Experts evicted from the LRU.
    evictions,
    /// Prefetches that started a real load or issued a page-cache hint.
    prefetch_issued,
    /// Prefetched (or hinted) experts that the layer then routed to.
    prefetch_useful,
    /// Prefetched experts evicted unused, or hinted experts the layer did not route to.
    prefetch_wasted,
    /// Real prefetches refused by the eviction guard (no victim less valuable than the newcomer).
    prefetch_guarded,
    /// Prefetch/hint requests skipped because the predictor's running precision in this
    /// layer is below `prefetch_min_precision`.
    prefetch_gated,
    /// Prefetch requests dropped because the bounded queue was full (oldest dropped first).
    prefetch_dropped,
    /// Prefetch requests for experts already resident or in flight (nothing to do).
    prefetch_redundant,
    /// Experts predicted by the router lookahead (`prefetch`) before a call.
    predicted_router,
    /// Routed experts in calls that had router-lookahead predictions (recall denominator).
    routed_router,
    /// Of those, how many the router lookahead predicted.
    recalled_router,
    /// Experts predicted by "the previous token's experts" (`hint_previous`) before a call.
    predicted_previous,
    /// Routed experts in calls that had previous-token predictions (recall denominator).
    routed_previous,
    /// Of those, how many the previous-token predictor predicted.
    recalled_previous,
    /// Routed experts in calls that had any prediction.
    routed_any,
    /// Of those, how many either predictor predicted.
    recalled_any,
}

impl LayerStats {
    /// Hits of every kind.
    pub fn hits(&self) -> u64 {
        self.hits_pinned + self.hits_lru + self.hits_prefetched + self.hits_inflight
    }
    /// Share of the routed experts that the router lookahead predicted, over calls that had a
    /// prediction (NaN when none had).
    pub fn recall_router(&self) -> f64 {
        ratio(self.recalled_router, self.routed_router)
    }
    /// Share of the routed experts that the previous-token predictor predicted.
    pub fn recall_previous(&self) -> f64 {
        ratio(self.recalled_previous, self.routed_previous)
    }
    /// Share of the routed experts that either predictor predicted.
    pub fn recall_any(&self) -> f64 {
        ratio(self.recalled_any, self.routed_any)
    }
    /// Seconds spent waiting for I/O.
    pub fn wait_s(&self) -> f64 {
        self.wait_ns as f64 * 1e-9
    }
}

fn ratio(a: u64, b: u64) -> f64 {
    if b == 0 {
        f64::NAN
    } else {
        a as f64 / b as f64
    }
}

/// A snapshot of the whole store.
#[derive(Debug, Clone, Default)]
pub struct StoreStats {
    /// Sum over layers.
    pub total: LayerStats,
    /// (layer index, that layer's counters) for every layer with routed experts.
    pub layers: Vec<(usize, LayerStats)>,
    /// The I/O mode in effect (`Direct` becomes `Pread` after a refused O_DIRECT read).
    pub io_mode: IoMode,
    /// RAM budget for resident experts, bytes.
    pub budget_bytes: u64,
    /// Bytes of pinned experts currently resident.
    pub pinned_bytes: u64,
    /// Bytes of LRU experts resident or reserved for loads in flight.
    pub lru_bytes: u64,
    /// The LRU's share of the budget, summed over layers (budget − pin set, split evenly,
    /// plus the shares of pins released since for idling: docs/expert-store.md).
    pub lru_capacity_bytes: u64,
    /// Bytes of experts chosen to be pinned at open (resident once first used).
    pub pin_set_bytes: u64,
    /// Number of experts chosen to be pinned.
    pub pin_set_len: usize,
    /// Bytes of the resident layers' experts, loaded at open on top of the RAM budget the
    /// user gave (`budget_bytes` and `pin_set_bytes` include them).
    pub resident_bytes: u64,
    /// Bytes of owned expert buffers alive right now (pread/direct slabs in use or waiting in
    /// the recycling pool, and copied scales): the real allocation, for budget accounting.
    pub live_owned_bytes: u64,
    /// Peak of `live_owned_bytes` since the store opened (or the last `reset_stats`).
    pub peak_owned_bytes: u64,
    /// Wall time during which at least one expert read was in flight (demand or prefetch)
    /// since the last `reset_stats`: `bytes_read / io_busy_ns` is the rate the store moved
    /// bytes while it was reading, to compare with the disk's own bandwidth.
    pub io_busy_ns: u64,
}

/// The union of the intervals during which reads are in flight, over all I/O threads.
#[derive(Debug, Default)]
pub(crate) struct BusyClock {
    state: std::sync::Mutex<(usize, Option<std::time::Instant>)>,
    busy_ns: AtomicU64,
}

impl BusyClock {
    /// A read starts.
    pub(crate) fn begin(&self) {
        let mut s = lock(&self.state);
        if s.0 == 0 {
            s.1 = Some(std::time::Instant::now());
        }
        s.0 += 1;
    }

    /// A read ends (every `begin` is paired with one `end`).
    pub(crate) fn end(&self) {
        let mut s = lock(&self.state);
        s.0 = s.0.saturating_sub(1);
        if s.0 == 0 {
            if let Some(t) = s.1.take() {
                self.busy_ns
                    .fetch_add(t.elapsed().as_nanos() as u64, Relaxed);
            }
        }
    }

    /// Busy nanoseconds so far (intervals still open are not counted yet).
    pub(crate) fn busy_ns(&self) -> u64 {
        self.busy_ns.load(Relaxed)
    }

    pub(crate) fn reset(&self) {
        self.busy_ns.store(0, Relaxed);
    }
}

impl ExpertStore {
    /// Counters, totals and per layer, plus memory gauges.
    pub fn stats(&self) -> StoreStats {
        let inner = &self.inner;
        let mut s = StoreStats {
            io_mode: inner.files.mode(),
            budget_bytes: inner.budget,
            pin_set_bytes: inner.pin_set_bytes,
            pin_set_len: inner.pin_set_len,
            resident_bytes: inner.resident_bytes,
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
}
