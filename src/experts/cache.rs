//! One layer's resident experts: a byte-budgeted LRU plus a pinned set, and the loads in
//! flight. Pure bookkeeping (no I/O), generic over the resident value so it is unit-tested
//! without files. The caller holds the layer's mutex around every method and never does I/O
//! under it.
//!
//! Budget: `used` counts the bytes of resident LRU entries *and* the bytes reserved by loads
//! in flight that will be inserted, so `used <= capacity` always holds. Pinned entries are
//! accounted separately (`pinned_used`); the pin set was sized to its own share of the budget
//! when the store opened. A demand load that finds no room (everything resident is needed by
//! the current call) becomes *transient*: served to the caller, then dropped.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::Sender;
use std::sync::{Arc, Mutex};

use super::lock;
use crate::error::Error;

/// A finished load: the value, or the error shared by everyone who waited for it.
pub(crate) type Shared<T> = std::result::Result<Arc<T>, Arc<Error>>;
/// What a waiter receives: (expert id, result).
pub(crate) type Completion<T> = (usize, Shared<T>);

/// Who started a load.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Origin {
    Demand,
    Prefetch,
}

/// Where a finished load goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Dest {
    /// Into the pinned set (never evicted).
    Pinned,
    /// Into the LRU, its bytes already reserved.
    Lru,
    /// To the waiting caller only; not cached.
    Transient,
}

/// A load in flight; waiters register a channel and get the result when it completes.
pub(crate) struct InFlight<T> {
    pub origin: Origin,
    pub dest: Dest,
    pub bytes: u64,
    /// A demand request is waiting for this prefetch (so it is not "unused" when it lands).
    claimed: AtomicBool,
    state: Mutex<FlightState<T>>,
}

struct FlightState<T> {
    done: Option<Shared<T>>,
    listeners: Vec<(usize, Sender<Completion<T>>)>,
}

impl<T> InFlight<T> {
    fn new(origin: Origin, dest: Dest, bytes: u64) -> Self {
        InFlight {
            origin,
            dest,
            bytes,
            claimed: AtomicBool::new(false),
            state: Mutex::new(FlightState {
                done: None,
                listeners: Vec::new(),
            }),
        }
    }

    /// Send `(id, result)` to `tx` when the load completes (at once if it already has).
    pub fn listen(&self, id: usize, tx: Sender<Completion<T>>) {
        let mut s = lock(&self.state);
        match &s.done {
            Some(done) => {
                // A dropped receiver means the caller gave up; nothing to do.
                let _ = tx.send((id, done.clone()));
            }
            None => s.listeners.push((id, tx)),
        }
    }

    /// Publish the result to every listener (present and future).
    pub fn finish(&self, res: Shared<T>) {
        let listeners = {
            let mut s = lock(&self.state);
            s.done = Some(res.clone());
            std::mem::take(&mut s.listeners)
        };
        for (id, tx) in listeners {
            let _ = tx.send((id, res.clone()));
        }
    }

    /// Mark a prefetch as awaited by demand.
    pub fn claim(&self) {
        self.claimed.store(true, Ordering::Relaxed);
    }
}

/// A resident expert.
pub(crate) struct Entry<T> {
    pub value: Arc<T>,
    pub bytes: u64,
    pub pinned: bool,
    /// LRU order: larger = used more recently.
    stamp: u64,
    /// The layer tick (token) that last used this expert; 0 = never.
    last_tick: u64,
    /// Set while a prefetched expert has not been used: the tick it was prefetched at.
    prefetched_at: Option<u64>,
}

pub(crate) enum Slot<T> {
    Empty,
    Loading(Arc<InFlight<T>>),
    Resident(Entry<T>),
}

/// How a hit was served.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum HitKind {
    Pinned,
    Lru,
    Prefetched,
}

pub(crate) enum Lookup<T> {
    Hit(Arc<T>, HitKind),
    Loading(Arc<InFlight<T>>),
    Missing,
}

/// An evicted value (dropped by the caller outside the lock).
pub(crate) struct Evicted<T> {
    #[allow(dead_code)] // held only so the value drops outside the layer lock
    pub value: Arc<T>,
    /// A prefetched expert that was never used.
    pub wasted_prefetch: bool,
}

pub(crate) struct LayerCache<T> {
    slots: Vec<Slot<T>>,
    pinned: Vec<bool>,
    capacity: u64,
    used: u64,
    pinned_used: u64,
    tick: u64,
    clock: u64,
    guard_tokens: u64,
}

impl<T> LayerCache<T> {
    /// `n` experts, `capacity` bytes for the LRU, `pinned[e]` for the pin set; a prefetch may
    /// not evict an expert used within the last `guard_tokens` calls of this layer.
    pub fn new(n: usize, capacity: u64, pinned: Vec<bool>, guard_tokens: u64) -> Self {
        debug_assert_eq!(pinned.len(), n);
        LayerCache {
            slots: (0..n).map(|_| Slot::Empty).collect(),
            pinned,
            capacity,
            used: 0,
            pinned_used: 0,
            tick: 0,
            clock: 0,
            guard_tokens,
        }
    }

    pub fn capacity(&self) -> u64 {
        self.capacity
    }
    /// Bytes of LRU entries resident or reserved.
    pub fn used(&self) -> u64 {
        self.used
    }
    /// Bytes of pinned entries resident or reserved.
    pub fn pinned_used(&self) -> u64 {
        self.pinned_used
    }

    /// Start a new call (token) of this layer that routes to `ids`: they become protected
    /// from eviction by this call's own loads.
    pub fn begin(&mut self, ids: &[usize]) -> u64 {
        self.tick += 1;
        for &id in ids {
            if let Slot::Resident(e) = &mut self.slots[id] {
                e.last_tick = self.tick;
            }
        }
        self.tick
    }

    /// Use `id` now: a hit, a load to wait for, or a miss.
    pub fn lookup(&mut self, id: usize) -> Lookup<T> {
        self.clock += 1;
        let (clock, tick) = (self.clock, self.tick);
        match &mut self.slots[id] {
            Slot::Resident(e) => {
                e.stamp = clock;
                e.last_tick = tick;
                let kind = if e.pinned {
                    HitKind::Pinned
                } else if e.prefetched_at.take().is_some() {
                    HitKind::Prefetched
                } else {
                    HitKind::Lru
                };
                Lookup::Hit(e.value.clone(), kind)
            }
            Slot::Loading(fl) => Lookup::Loading(fl.clone()),
            Slot::Empty => Lookup::Missing,
        }
    }

    /// True when nothing is resident or loading for `id`.
    pub fn is_empty(&self, id: usize) -> bool {
        matches!(self.slots[id], Slot::Empty)
    }

    /// Begin loading `id` (which must be empty) of `bytes`, making room by evicting into
    /// `evicted`. `None` when the slot is busy, or for a prefetch the guard refuses.
    pub fn start(
        &mut self,
        id: usize,
        bytes: u64,
        origin: Origin,
        evicted: &mut Vec<Evicted<T>>,
    ) -> Option<Arc<InFlight<T>>> {
        if !self.is_empty(id) {
            return None;
        }
        let dest = if self.pinned[id] {
            self.pinned_used += bytes;
            Dest::Pinned
        } else if self.make_room(bytes, origin, evicted) {
            self.used += bytes;
            Dest::Lru
        } else if origin == Origin::Demand {
            Dest::Transient
        } else {
            return None;
        };
        let fl = Arc::new(InFlight::new(origin, dest, bytes));
        self.slots[id] = Slot::Loading(fl.clone());
        Some(fl)
    }

    fn evictable(&self, e: &Entry<T>, origin: Origin) -> bool {
        if e.pinned {
            return false;
        }
        match origin {
            // Anything the current call does not use.
            Origin::Demand => e.last_tick < self.tick,
            // The guard: not used within the last `guard_tokens` calls, and not itself a
            // prediction made since the last call that is still waiting to be used.
            Origin::Prefetch => {
                e.last_tick + self.guard_tokens <= self.tick
                    && e.prefetched_at.is_none_or(|t| t < self.tick)
            }
        }
    }

    /// Evict least-recently-used entries until `bytes` more fit; evicts nothing and returns
    /// false when they cannot be made to fit.
    fn make_room(&mut self, bytes: u64, origin: Origin, evicted: &mut Vec<Evicted<T>>) -> bool {
        if bytes > self.capacity {
            return false;
        }
        let need = (self.used + bytes).saturating_sub(self.capacity);
        if need == 0 {
            return true;
        }
        let mut victims: Vec<(u64, usize, u64)> = self
            .slots
            .iter()
            .enumerate()
            .filter_map(|(i, s)| match s {
                Slot::Resident(e) if self.evictable(e, origin) => Some((e.stamp, i, e.bytes)),
                _ => None,
            })
            .collect();
        if victims.iter().map(|v| v.2).sum::<u64>() < need {
            return false;
        }
        victims.sort_unstable();
        let mut freed = 0;
        for (_, i, _) in victims {
            if freed >= need {
                break;
            }
            if let Slot::Resident(e) = std::mem::replace(&mut self.slots[i], Slot::Empty) {
                freed += e.bytes;
                self.used -= e.bytes;
                evicted.push(Evicted {
                    value: e.value,
                    wasted_prefetch: e.prefetched_at.is_some(),
                });
            }
        }
        true
    }

    /// A load of `id` finished: insert it (or release its reservation).
    pub fn complete(&mut self, id: usize, fl: &Arc<InFlight<T>>, res: &Shared<T>) {
        let ours = matches!(&self.slots[id], Slot::Loading(cur) if Arc::ptr_eq(cur, fl));
        debug_assert!(ours, "completion for a slot that is not loading it");
        if !ours {
            return;
        }
        match (fl.dest, res) {
            (Dest::Pinned | Dest::Lru, Ok(value)) => {
                self.clock += 1;
                let used_now = fl.origin == Origin::Demand || fl.claimed.load(Ordering::Relaxed);
                self.slots[id] = Slot::Resident(Entry {
                    value: value.clone(),
                    bytes: fl.bytes,
                    pinned: fl.dest == Dest::Pinned,
                    stamp: self.clock,
                    last_tick: if used_now { self.tick } else { 0 },
                    prefetched_at: (!used_now).then_some(self.tick),
                });
            }
            (dest, _) => {
                match dest {
                    Dest::Pinned => self.pinned_used -= fl.bytes,
                    Dest::Lru => self.used -= fl.bytes,
                    Dest::Transient => {}
                }
                self.slots[id] = Slot::Empty;
            }
        }
    }

    /// Resident expert ids (for tests and reports).
    #[cfg(test)]
    pub fn resident_ids(&self) -> Vec<usize> {
        (0..self.slots.len())
            .filter(|&i| matches!(self.slots[i], Slot::Resident(_)))
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn load(c: &mut LayerCache<usize>, id: usize, bytes: u64, origin: Origin) -> Option<Dest> {
        let mut ev = Vec::new();
        let fl = c.start(id, bytes, origin, &mut ev)?;
        c.complete(id, &fl, &Ok(Arc::new(id)));
        Some(fl.dest)
    }

    fn call(c: &mut LayerCache<usize>, ids: &[usize], bytes: u64) -> Vec<(usize, &'static str)> {
        c.begin(ids);
        let mut out = Vec::new();
        for &id in ids {
            match c.lookup(id) {
                Lookup::Hit(v, k) => {
                    assert_eq!(*v, id);
                    out.push((id, if k == HitKind::Pinned { "pin" } else { "hit" }));
                }
                Lookup::Loading(_) => out.push((id, "wait")),
                Lookup::Missing => {
                    let d = load(c, id, bytes, Origin::Demand);
                    out.push((
                        id,
                        if d == Some(Dest::Transient) {
                            "transient"
                        } else {
                            "miss"
                        },
                    ));
                }
            }
        }
        out
    }

    #[test]
    fn lru_evicts_least_recent_within_byte_budget() {
        let mut c = LayerCache::new(8, 30, vec![false; 8], 1);
        call(&mut c, &[0, 1, 2], 10);
        assert_eq!(c.used(), 30);
        call(&mut c, &[0], 10); // 1 is now least recent
        call(&mut c, &[3], 10);
        assert_eq!(c.resident_ids(), vec![0, 2, 3]);
        assert!(c.used() <= c.capacity());
        // A call needing more than fits: the rest of its experts stay protected → transient.
        let r = call(&mut c, &[4, 5, 6, 7], 10);
        assert_eq!(r.iter().filter(|x| x.1 == "transient").count(), 1);
        assert_eq!(c.resident_ids(), vec![4, 5, 6]);
        assert_eq!(c.used(), 30);
    }

    #[test]
    fn zero_capacity_makes_every_load_transient() {
        let mut c = LayerCache::new(4, 0, vec![false; 4], 1);
        let r = call(&mut c, &[0, 1], 10);
        assert!(r.iter().all(|x| x.1 == "transient"));
        assert!(c.resident_ids().is_empty());
        assert_eq!(c.used(), 0);
    }

    #[test]
    fn pinned_experts_are_never_evicted() {
        let mut pinned = vec![false; 6];
        pinned[5] = true;
        let mut c = LayerCache::new(6, 20, pinned, 0);
        call(&mut c, &[5], 10);
        assert_eq!(c.pinned_used(), 10);
        for i in 0..5 {
            call(&mut c, &[i], 10);
        }
        assert!(c.resident_ids().contains(&5));
        assert_eq!(call(&mut c, &[5], 10), vec![(5, "pin")]);
        assert_eq!(c.used(), 20);
    }

    #[test]
    fn guard_keeps_recent_experts_from_prefetch() {
        let mut c = LayerCache::new(8, 20, vec![false; 8], 1);
        call(&mut c, &[0, 1], 10); // both used by the latest call
        assert_eq!(load(&mut c, 2, 10, Origin::Prefetch), None, "guard refused");
        assert_eq!(c.resident_ids(), vec![0, 1]);
        call(&mut c, &[0], 10); // 1 is now one call old → evictable by a prefetch
        assert_eq!(load(&mut c, 2, 10, Origin::Prefetch), Some(Dest::Lru));
        assert_eq!(c.resident_ids(), vec![0, 2]);
        // A fresh prediction (2) is not evicted by another prediction before it is used.
        assert_eq!(load(&mut c, 3, 10, Origin::Prefetch), None);
        // The next call uses it: counted as a prefetched hit.
        c.begin(&[2]);
        assert!(matches!(c.lookup(2), Lookup::Hit(_, HitKind::Prefetched)));
        // A demand load may evict anything the current call does not use.
        let mut c = LayerCache::new(8, 20, vec![false; 8], 5);
        call(&mut c, &[0, 1], 10);
        assert_eq!(call(&mut c, &[2], 10), vec![(2, "miss")]);
    }

    #[test]
    fn waiters_get_the_result_and_failed_loads_release_their_bytes() {
        let mut c = LayerCache::new(4, 20, vec![false; 4], 1);
        let mut ev = Vec::new();
        c.begin(&[1]);
        let fl = c.start(1, 10, Origin::Prefetch, &mut ev).expect("room");
        assert!(
            c.start(1, 10, Origin::Demand, &mut ev).is_none(),
            "no double load"
        );
        assert!(matches!(c.lookup(1), Lookup::Loading(_)));
        let (tx, rx) = std::sync::mpsc::channel();
        fl.listen(1, tx.clone());
        let err: Shared<usize> = Err(Arc::new(Error::Internal("boom".into())));
        c.complete(1, &fl, &err);
        fl.finish(err);
        let (id, r) = rx.recv().expect("completion");
        assert_eq!(id, 1);
        assert!(r.is_err());
        assert_eq!(c.used(), 0);
        assert!(c.is_empty(1));
        // Listening after completion still delivers.
        fl.listen(1, tx);
        assert!(rx.recv().expect("late completion").1.is_err());
    }

    #[test]
    fn claimed_prefetch_counts_as_used() {
        let mut c = LayerCache::new(4, 20, vec![false; 4], 1);
        let mut ev = Vec::new();
        let fl = c.start(3, 10, Origin::Prefetch, &mut ev).expect("room");
        c.begin(&[3]);
        fl.claim();
        c.complete(3, &fl, &Ok(Arc::new(3)));
        assert!(matches!(c.lookup(3), Lookup::Hit(_, HitKind::Lru)));
    }
}
