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
//!
//! Idle pins: a pinned expert not routed for longer than the LRU keeps an unused entry (the
//! age of its latest victim) would already have been evicted had it been an LRU entry, so
//! it is not earning its slot here: it becomes an LRU entry and its share of the budget
//! joins the LRU's capacity (docs/expert-store.md, "Cache, pins, history").

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
    /// The LRU stamp, taken when the load starts: entries of one call are ordered by the
    /// order their loads were issued in, not by which read finished first, so the same
    /// calls evict the same experts however the disk schedules the reads.
    stamp: u64,
    /// A demand request is waiting for this prefetch (so it is not "unused" when it lands).
    claimed: AtomicBool,
    state: Mutex<FlightState<T>>,
}

struct FlightState<T> {
    done: Option<Shared<T>>,
    listeners: Vec<(usize, Sender<Completion<T>>)>,
}

impl<T> InFlight<T> {
    fn new(origin: Origin, dest: Dest, bytes: u64, stamp: u64) -> Self {
        InFlight {
            origin,
            dest,
            bytes,
            stamp,
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
    /// The pin set still in force: each pinned expert's charged bytes.
    pinned: Vec<Option<u64>>,
    /// How many entries of `pinned` are `Some`.
    pins_left: usize,
    /// The layer tick that last routed to each expert (resident or not); 0 = never.
    routed_at: Vec<u64>,
    /// How many calls the LRU's latest victim had gone unused (`None`: no eviction yet).
    horizon: Option<u64>,
    capacity: u64,
    used: u64,
    pinned_used: u64,
    tick: u64,
    clock: u64,
    guard_tokens: u64,
}

impl<T> LayerCache<T> {
    /// `n` experts, `capacity` bytes for the LRU, `pinned[e]` the charged bytes of each expert
    /// of the pin set (whose share of the budget is not in `capacity`); a prefetch may not
    /// evict an expert used within the last `guard_tokens` calls of this layer.
    pub fn new(n: usize, capacity: u64, pinned: Vec<Option<u64>>, guard_tokens: u64) -> Self {
        debug_assert_eq!(pinned.len(), n);
        LayerCache {
            slots: (0..n).map(|_| Slot::Empty).collect(),
            pins_left: pinned.iter().flatten().count(),
            pinned,
            routed_at: vec![0; n],
            horizon: None,
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
    /// Bytes the pin set still in force holds when all of it is resident.
    pub fn pin_set_bytes(&self) -> u64 {
        self.pinned.iter().flatten().sum()
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
    /// from eviction by this call's own loads, and pins idle past the LRU's horizon become
    /// LRU entries (the module docs).
    pub fn begin(&mut self, ids: &[usize]) -> u64 {
        self.tick += 1;
        for &id in ids {
            self.routed_at[id] = self.tick;
            if let Slot::Resident(e) = &mut self.slots[id] {
                e.last_tick = self.tick;
            }
        }
        if let (Some(horizon), 1..) = (self.horizon, self.pins_left) {
            for id in 0..self.pinned.len() {
                if self.pinned[id].is_some() && self.tick - self.routed_at[id] > horizon {
                    self.unpin(id);
                }
            }
        }
        self.tick
    }

    /// Move `id` from the pin set to the LRU, with its share of the budget (later, when a
    /// pinned load of it is still in flight).
    fn unpin(&mut self, id: usize) {
        let Some(charged) = self.pinned[id] else {
            return;
        };
        match &mut self.slots[id] {
            Slot::Loading(_) => return,
            Slot::Resident(e) => {
                // The entry's own bytes move, so `used <= capacity` still holds.
                e.pinned = false;
                self.pinned_used -= e.bytes;
                self.used += e.bytes;
                self.capacity += e.bytes;
            }
            Slot::Empty => self.capacity += charged,
        }
        self.pinned[id] = None;
        self.pins_left -= 1;
    }

    /// Experts of the pin set still pinned.
    #[cfg(test)]
    pub fn pinned_ids(&self) -> Vec<usize> {
        (0..self.pinned.len())
            .filter(|&i| self.pinned[i].is_some())
            .collect()
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
        let dest = if self.pinned[id].is_some() {
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
        self.clock += 1;
        let fl = Arc::new(InFlight::new(origin, dest, bytes, self.clock));
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
                self.horizon = Some(self.tick.saturating_sub(e.last_tick));
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
                let used_now = fl.origin == Origin::Demand || fl.claimed.load(Ordering::Relaxed);
                self.slots[id] = Slot::Resident(Entry {
                    value: value.clone(),
                    bytes: fl.bytes,
                    pinned: fl.dest == Dest::Pinned,
                    stamp: fl.stamp,
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
        let mut c = LayerCache::new(8, 30, vec![None; 8], 1);
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
        let mut c = LayerCache::new(4, 0, vec![None; 4], 1);
        let r = call(&mut c, &[0, 1], 10);
        assert!(r.iter().all(|x| x.1 == "transient"));
        assert!(c.resident_ids().is_empty());
        assert_eq!(c.used(), 0);
    }

    #[test]
    fn pinned_experts_are_never_evicted() {
        let mut pinned = vec![None; 6];
        pinned[5] = Some(10);
        let mut c = LayerCache::new(6, 20, pinned, 0);
        call(&mut c, &[5], 10);
        assert_eq!(c.pinned_used(), 10);
        for i in 0..5 {
            call(&mut c, &[i, 5], 10);
        }
        assert!(c.resident_ids().contains(&5));
        assert_eq!(call(&mut c, &[5], 10), vec![(5, "pin")]);
        assert_eq!(c.used(), 20);
        assert_eq!(c.pinned_ids(), vec![5]);
    }

    #[test]
    fn pins_idle_past_the_lru_horizon_become_lru_entries() {
        // Two pins of 10 bytes (their 20 outside the LRU's 20), the LRU under pressure.
        let mut pinned = vec![None; 8];
        pinned[6] = Some(10);
        pinned[7] = Some(10);
        let mut c = LayerCache::new(8, 20, pinned, 0);
        assert_eq!(call(&mut c, &[7], 10), vec![(7, "miss")]);
        assert_eq!((c.pinned_used(), c.pinned_ids()), (10, vec![6, 7]));
        // No eviction yet: no horizon, nothing unpinned however long the pins idle.
        call(&mut c, &[0], 10);
        call(&mut c, &[1], 10);
        assert_eq!(c.pinned_ids(), vec![6, 7]);
        // Evicting 0 (unused for 2 calls) sets the horizon to 2.
        call(&mut c, &[2], 10);
        assert_eq!(c.resident_ids(), vec![1, 2, 7]);
        // Call 5: pin 6 (never routed) and pin 7 (routed at call 1) are idle 5 and 4 > 2.
        call(&mut c, &[1], 10);
        assert_eq!((c.pinned_ids(), c.pins_left), (Vec::<usize>::new(), 0));
        // 7 was resident: its bytes moved to the LRU; 6 was not: its share did.
        assert_eq!((c.pinned_used(), c.used(), c.capacity()), (0, 30, 40));
        // Now ordinary entries: the least recent (7) is evicted first.
        call(&mut c, &[3, 4], 10);
        assert_eq!(c.resident_ids(), vec![1, 2, 3, 4]);
        assert!(c.used() <= c.capacity());
    }

    #[test]
    fn pins_in_use_stay_pinned() {
        let mut pinned = vec![None; 8];
        pinned[7] = Some(10);
        let mut c = LayerCache::new(8, 10, pinned, 0);
        for i in 0..6 {
            // Each call evicts the previous one's expert (horizon 1); 7 is routed every call.
            assert_eq!(
                call(&mut c, &[i, 7], 10)[1].1,
                if i == 0 { "miss" } else { "pin" }
            );
        }
        assert_eq!((c.pinned_ids(), c.pins_left), (vec![7], 1));
        // Idle for two calls (> 1): unpinned, its bytes and share now the LRU's, and as the
        // least recent entry it makes room for the call's miss.
        call(&mut c, &[0], 10);
        assert_eq!(call(&mut c, &[1], 10), vec![(1, "miss")]);
        assert_eq!(c.pinned_ids(), Vec::<usize>::new());
        assert_eq!(c.resident_ids(), vec![0, 1]);
        assert_eq!((c.pinned_used(), c.used(), c.capacity()), (0, 20, 20));
    }

    #[test]
    fn guard_keeps_recent_experts_from_prefetch() {
        let mut c = LayerCache::new(8, 20, vec![None; 8], 1);
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
        let mut c = LayerCache::new(8, 20, vec![None; 8], 5);
        call(&mut c, &[0, 1], 10);
        assert_eq!(call(&mut c, &[2], 10), vec![(2, "miss")]);
    }

    #[test]
    fn waiters_get_the_result_and_failed_loads_release_their_bytes() {
        let mut c = LayerCache::new(4, 20, vec![None; 4], 1);
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
        let mut c = LayerCache::new(4, 20, vec![None; 4], 1);
        let mut ev = Vec::new();
        let fl = c.start(3, 10, Origin::Prefetch, &mut ev).expect("room");
        c.begin(&[3]);
        fl.claim();
        c.complete(3, &fl, &Ok(Arc::new(3)));
        assert!(matches!(c.lookup(3), Lookup::Hit(_, HitKind::Lru)));
    }
}
