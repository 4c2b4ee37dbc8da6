//! Prefetch execution: predictions that pass the predictor gate go into the bounded
//! [`PrefetchQueue`]; the prefetch threads (`colibri-prefetch-N`, started at open) drain it,
//! each request becoming a real load into the layer's cache under the eviction guard, or a
//! page-cache hint (docs/expert-store.md).

use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;
use std::thread::JoinHandle;

use super::cache::Origin;
use super::demand::count_evicted;
use super::file_io::IoMode;
use super::predictor_gate::Predictor;
use super::prefetch_queue::{PrefetchMode, PrefetchQueue, Pushed};
use super::{lock, ExpertStore, Inner};
use crate::error::{Error, Result};

impl ExpertStore {
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
}

/// Start `threads` prefetch threads draining `queue` for the store `inner`.
pub(super) fn start_prefetch_threads(
    inner: &Arc<Inner>,
    queue: &Arc<PrefetchQueue>,
    threads: usize,
) -> Result<Vec<JoinHandle<()>>> {
    (0..threads)
        .map(|i| {
            let (inner, q) = (inner.clone(), queue.clone());
            std::thread::Builder::new()
                .name(format!("colibri-prefetch-{i}"))
                .spawn(move || {
                    while let Some((layer, id, hint)) = q.pop() {
                        let _ = std::panic::catch_unwind(AssertUnwindSafe(|| {
                            Inner::run_prefetch(&inner, layer, id, hint)
                        }));
                    }
                })
                .map_err(|e| Error::Internal(format!("cannot start a prefetch thread: {e}")))
        })
        .collect()
}

impl Inner {
    /// Record a prediction and queue the reads it would start, unless prefetch is off, the
    /// predictor is gated in this layer, or a hint could not help.
    fn predict(&self, layer: usize, ids: &[usize], who: Predictor) {
        let Ok(ls) = self.layer(layer) else { return };
        let n = ls.locs.len();
        let (cold, precision) = ls.note_prediction(ids, who);
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
