//! Owned read buffers (page-aligned anonymous mappings), recycled between loads, and the
//! gauge of the owned bytes alive.

use std::sync::atomic::{AtomicU64, Ordering};

use memmap2::{MmapMut, MmapOptions};

use super::PAGE;
use crate::experts::lock;

/// Bytes of owned buffers alive (the real allocation of pread/direct slabs and copied scales).
#[derive(Debug, Default)]
pub(crate) struct Gauge {
    live: AtomicU64,
    peak: AtomicU64,
}

impl Gauge {
    pub(super) fn add(&self, n: u64) {
        let v = self.live.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(v, Ordering::Relaxed);
    }
    pub(super) fn sub(&self, n: u64) {
        self.live.fetch_sub(n, Ordering::Relaxed);
    }
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::Relaxed);
    }
}

/// Slab sizes are rounded up (to 64 KiB from 1 MiB up, else to pages) so that the experts of
/// one layer share slab sizes whatever their alignment slack.
pub(crate) fn slab_len(len: usize) -> usize {
    let round = if len >= 1 << 20 { 64 << 10 } else { PAGE };
    len.div_ceil(round).max(1) * round
}

/// Owned read buffers, recycled: a fresh anonymous mapping per load costs a page fault and a
/// zeroed page per 4 KiB (measured 3-4× slower loads under CPU load), so freed slabs wait in
/// a small free list (at most `max_free`, a fixed overhead) for the next load of that size.
/// New slabs are pre-faulted (`MAP_POPULATE`).
pub(crate) struct SlabPool {
    free: std::sync::Mutex<Vec<MmapMut>>,
    max_free: usize,
    /// Every owned byte alive: slabs in use or free, and copied scales.
    pub gauge: Gauge,
}

impl SlabPool {
    pub fn new(max_free: usize) -> Self {
        SlabPool {
            free: std::sync::Mutex::new(Vec::new()),
            max_free,
            gauge: Gauge::default(),
        }
    }

    pub(super) fn take(&self, len: usize) -> std::io::Result<MmapMut> {
        let len = slab_len(len);
        {
            let mut free = lock(&self.free);
            if let Some(i) = free.iter().position(|m| m.len() == len) {
                return Ok(free.swap_remove(i));
            }
        }
        let m = MmapOptions::new().len(len).populate().map_anon()?;
        self.gauge.add(len as u64);
        Ok(m)
    }

    pub(super) fn give(&self, m: MmapMut) {
        let mut free = lock(&self.free);
        if free.len() < self.max_free {
            free.push(m);
        } else {
            drop(free);
            self.gauge.sub(m.len() as u64);
        }
    }
}
