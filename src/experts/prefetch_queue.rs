//! The prefetch queue: a bounded FIFO of (layer, expert) requests drained by dedicated
//! prefetch threads. `push` never blocks on I/O (it takes one short lock); when the queue is
//! full the *oldest* request is dropped, since predictions for earlier layers go stale first.
//! A request already queued is not queued again. What a worker does with a request (a real
//! load into the layer's cache under the eviction guard, or a page-cache hint) lives in the
//! store.

use std::collections::{HashSet, VecDeque};
use std::sync::{Condvar, Mutex};

use super::lock;

/// The prefetch policy.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum PrefetchMode {
    /// Predictions are only counted (recall stats); nothing is loaded.
    Off,
    /// Predicted experts get a page-cache hint (`madvise`/`posix_fadvise` WILLNEED).
    Hint,
    /// Predicted experts are loaded into their layer's cache by the prefetch threads.
    #[default]
    Real,
}

impl PrefetchMode {
    pub fn parse(s: &str) -> crate::Result<Self> {
        match s {
            "off" => Ok(PrefetchMode::Off),
            "hint" => Ok(PrefetchMode::Hint),
            "real" => Ok(PrefetchMode::Real),
            _ => Err(crate::Error::invalid(
                "prefetch",
                format!("unknown prefetch mode '{s}'; expected one of off, hint, real"),
            )),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            PrefetchMode::Off => "off",
            PrefetchMode::Hint => "hint",
            PrefetchMode::Real => "real",
        }
    }
}

/// What `push` did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Pushed {
    Queued,
    /// Already waiting in the queue.
    Duplicate,
    /// Queued, and the oldest request (this layer) was dropped to make room.
    DroppedOldest(usize),
}

/// (layer, expert, hint only).
pub(crate) type Job = (usize, usize, bool);

struct State {
    jobs: VecDeque<Job>,
    queued: HashSet<Job>,
    shutdown: bool,
}

pub(crate) struct PrefetchQueue {
    state: Mutex<State>,
    ready: Condvar,
    capacity: usize,
}

impl PrefetchQueue {
    pub fn new(capacity: usize) -> Self {
        PrefetchQueue {
            state: Mutex::new(State {
                jobs: VecDeque::new(),
                queued: HashSet::new(),
                shutdown: false,
            }),
            ready: Condvar::new(),
            capacity: capacity.max(1),
        }
    }

    pub fn push(&self, job: Job) -> Pushed {
        let mut s = lock(&self.state);
        if s.shutdown {
            return Pushed::Duplicate;
        }
        if !s.queued.insert(job) {
            return Pushed::Duplicate;
        }
        let mut out = Pushed::Queued;
        if s.jobs.len() >= self.capacity {
            if let Some(old) = s.jobs.pop_front() {
                s.queued.remove(&old);
                out = Pushed::DroppedOldest(old.0);
            }
        }
        s.jobs.push_back(job);
        drop(s);
        self.ready.notify_one();
        out
    }

    /// The next request; blocks until one arrives. `None` after `shutdown`.
    pub fn pop(&self) -> Option<Job> {
        let mut s = lock(&self.state);
        loop {
            if s.shutdown {
                return None;
            }
            if let Some(j) = s.jobs.pop_front() {
                s.queued.remove(&j);
                return Some(j);
            }
            s = self.ready.wait(s).unwrap_or_else(|e| e.into_inner());
        }
    }

    pub fn shutdown(&self) {
        let mut s = lock(&self.state);
        s.shutdown = true;
        s.jobs.clear();
        s.queued.clear();
        drop(s);
        self.ready.notify_all();
    }

    #[cfg(test)]
    fn len(&self) -> usize {
        lock(&self.state).jobs.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn bounded_fifo_drops_oldest_and_dedupes() {
        let q = PrefetchQueue::new(2);
        assert_eq!(q.push((1, 0, false)), Pushed::Queued);
        assert_eq!(q.push((1, 0, false)), Pushed::Duplicate);
        assert_eq!(q.push((1, 1, false)), Pushed::Queued);
        assert_eq!(q.push((2, 5, true)), Pushed::DroppedOldest(1));
        assert_eq!(q.len(), 2);
        assert_eq!(q.pop(), Some((1, 1, false)));
        assert_eq!(q.pop(), Some((2, 5, true)));
        // Dropped jobs may be queued again.
        assert_eq!(q.push((1, 0, false)), Pushed::Queued);
    }

    #[test]
    fn shutdown_wakes_blocked_workers() {
        let q = Arc::new(PrefetchQueue::new(4));
        let q2 = q.clone();
        let h = std::thread::spawn(move || {
            let mut got = Vec::new();
            while let Some(j) = q2.pop() {
                got.push(j);
            }
            got
        });
        q.push((0, 1, false));
        // Wait until the worker took it, then shut down while it blocks on an empty queue.
        while q.len() > 0 {
            std::thread::yield_now();
        }
        q.shutdown();
        assert_eq!(h.join().expect("worker"), vec![(0, 1, false)]);
        assert_eq!(q.pop(), None);
    }

    #[test]
    fn modes_parse() {
        for m in [PrefetchMode::Off, PrefetchMode::Hint, PrefetchMode::Real] {
            assert_eq!(PrefetchMode::parse(m.name()).expect("parse"), m);
        }
        assert!(PrefetchMode::parse("on").is_err());
    }
}
