//! The demand path: a forward's experts for one layer, resolved against the pinned set → the
//! layer's LRU → a load in flight (a prefetch, waited for and never repeated) → a new load
//! on the I/O pool, at most `2 × io_threads` outstanding. Resident experts are handed over
//! at once, the others as each load completes.

use std::collections::VecDeque;
use std::panic::AssertUnwindSafe;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Instant;

use super::cache::{self, Evicted, HitKind, InFlight, Lookup, Origin};
use super::file_io::Resident;
use super::stats::LayerCounters;
use super::{bad_id, lock, ExpertBatch, ExpertStore, ExpertView, Inner, LayerState};
use crate::error::{Error, Result};

impl ExpertStore {
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
        self.with_expert_batches(layer, ids, &mut |batch| {
            batch.iter().try_for_each(|(id, view)| f(*id, view))
        })
    }

    /// [`ExpertStore::with_experts`] handing the experts over in batches: every resident one
    /// in the first, then each load as it completes (the MoE runs a batch as one).
    pub fn with_expert_batches(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(&ExpertBatch<'_>) -> Result<()>,
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
        ls.record_routing(&ids);
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
                        wait_for_in_flight(c, &fl, id, &tx);
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
        if !ready.is_empty() {
            let views = ready
                .iter()
                .map(|(id, v)| Ok((*id, v.view()?)))
                .collect::<Result<Vec<_>>>()?;
            f(&views)?;
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
            f(&[(id, v.view()?)])?;
        }
    }
}

impl Inner {
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
                    wait_for_in_flight(c, &fl, id, tx);
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
    pub(super) fn run_load(&self, layer: usize, id: usize, fl: &Arc<InFlight<Resident>>) {
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

/// Wait for a load already in flight (its result arrives on `tx`); a prefetch's load is
/// claimed, so it counts as used rather than wasted.
fn wait_for_in_flight(
    c: &LayerCounters,
    fl: &InFlight<Resident>,
    id: usize,
    tx: &mpsc::Sender<cache::Completion<Resident>>,
) {
    if fl.origin == Origin::Prefetch {
        fl.claim();
        c.hits_inflight.fetch_add(1, Relaxed);
        c.prefetch_useful.fetch_add(1, Relaxed);
    }
    fl.listen(id, tx.clone());
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

pub(super) fn count_evicted(c: &LayerCounters, ev: Vec<Evicted<Resident>>) {
    for e in ev {
        c.evictions.fetch_add(1, Relaxed);
        if e.wasted_prefetch {
            c.prefetch_wasted.fetch_add(1, Relaxed);
        }
    }
}
