//! What a read costs, as the store measured it: seconds per byte read (the wall time during
//! which reads were in flight, per byte: the rate the store moves bytes with its I/O threads
//! in parallel, what an extra expert of a verify's union adds) and each layer's miss rate, for the decode loop to price a draft by the bytes it will read
//! (docs/speculative.md, "Priced drafting"). Updated from the store's counters each time it
//! is asked (the decode loop asks every 16 cycles): the change since the last ask, blended
//! into a running estimate, so a cache that warms up is priced as it now is.

use super::stats::{LayerStats, StoreStats};

/// Seconds per byte assumed before any read was measured: 1 GB/s, a virtual or SATA disk.
pub const PRIOR_SECS_PER_BYTE: f64 = 1e-9;
/// Weight of the newest interval in the running estimates.
const BLEND: f64 = 0.5;
/// An interval counts for the per-byte cost once this many bytes were read in it (small
/// models' experts are a few KiB: they are measured too, not left at the prior).
const MIN_BYTES: u64 = 64 << 10;
/// An interval counts for a layer's miss rate once this many experts were routed in it.
const MIN_ROUTED: u64 = 8;

/// What a draft's reads cost, for the `k` routed experts per token in effect.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct ReadPrice {
    /// Measured seconds per byte read: `io_busy_ns / bytes_read` (demand and prefetch).
    pub secs_per_byte: f64,
    /// Expected bytes one more row of a verify reads in the main layers: per layer, its
    /// `k` experts less those the batch's other row already routes (k/n of them on
    /// average), times the layer's miss rate and mean expert size.
    pub main_row_bytes: f64,
    /// Expected bytes one row through the MTP layer reads (its `k` experts' misses).
    pub mtp_row_bytes: f64,
    /// Bytes of the MTP layer's experts not in RAM: the most an absorb of many rows reads.
    pub mtp_missing_bytes: f64,
}

/// One layer's shape and what the cache can hold of it.
#[derive(Clone, Copy, Debug)]
pub struct LayerShape {
    pub layer: usize,
    pub experts: usize,
    /// Bytes of all its experts.
    pub bytes: u64,
    /// Bytes of it the cache can hold (its LRU share plus its pins), capped at `bytes`.
    pub holds: u64,
}

impl LayerShape {
    /// The miss rate assumed before one was measured: the share the cache cannot hold.
    fn prior_miss(&self) -> f64 {
        if self.bytes == 0 {
            return 0.0;
        }
        1.0 - (self.holds.min(self.bytes) as f64 / self.bytes as f64)
    }
}

/// The running estimates (one per store).
#[derive(Debug, Default)]
pub struct ReadCosts {
    secs_per_byte: Option<f64>,
    /// (layer, miss rate) estimates.
    miss: Vec<(usize, f64)>,
    /// The counters at the last update: totals (bytes read, I/O busy ns) and per layer
    /// (routed, misses).
    last_total: (u64, u64),
    last_layers: Vec<(usize, u64, u64)>,
}

impl ReadCosts {
    /// Update from `stats` and price a row for `k` experts per token; `shapes` are the
    /// layers' sizes and what the cache holds of them; `mtp_layer` is the MTP layer's index.
    pub fn update(
        &mut self,
        stats: &StoreStats,
        shapes: &[LayerShape],
        k: usize,
        mtp_layer: Option<usize>,
    ) -> ReadPrice {
        let (bytes, wait) = (stats.total.bytes_read, stats.io_busy_ns);
        // Counters go back to 0 on `reset_stats`: start the interval again.
        let (b0, w0) = if bytes < self.last_total.0 || wait < self.last_total.1 {
            (0, 0)
        } else {
            self.last_total
        };
        if bytes - b0 >= MIN_BYTES {
            let now = (wait - w0) as f64 * 1e-9 / (bytes - b0) as f64;
            self.secs_per_byte = Some(match self.secs_per_byte {
                Some(old) => old + BLEND * (now - old),
                None => now,
            });
            self.last_total = (bytes, wait);
        } else if (b0, w0) == (0, 0) {
            self.last_total = (0, 0);
        }
        let mut price = ReadPrice {
            secs_per_byte: self.secs_per_byte.unwrap_or(PRIOR_SECS_PER_BYTE),
            ..ReadPrice::default()
        };
        for s in shapes {
            let miss = self.layer_miss(s, layer_of(stats, s.layer));
            if s.experts == 0 {
                continue;
            }
            let mean = s.bytes as f64 / s.experts as f64;
            let k = k.min(s.experts) as f64;
            if Some(s.layer) == mtp_layer {
                price.mtp_row_bytes = k * miss * mean;
                price.mtp_missing_bytes = miss * s.bytes as f64;
            } else {
                let new = k * (1.0 - k / s.experts as f64);
                price.main_row_bytes += new * miss * mean;
            }
        }
        price
    }

    /// The layer's miss rate: the prior, then blended with each interval's measured rate. A
    /// layer the cache holds whole (resident, or a budget that fits it) reads each expert at
    /// most once, never again for a draft: its rate is 0.
    fn layer_miss(&mut self, s: &LayerShape, now: Option<&LayerStats>) -> f64 {
        if s.holds >= s.bytes {
            return 0.0;
        }
        let i = match self.miss.iter().position(|&(l, _)| l == s.layer) {
            Some(i) => i,
            None => {
                self.miss.push((s.layer, s.prior_miss()));
                self.last_layers.push((s.layer, 0, 0));
                self.miss.len() - 1
            }
        };
        let Some(now) = now else {
            return self.miss[i].1;
        };
        let (_, r0, m0) = self.last_layers[i];
        let (r0, m0) = if now.routed < r0 || now.misses < m0 {
            (0, 0)
        } else {
            (r0, m0)
        };
        let routed = now.routed - r0;
        if routed >= MIN_ROUTED {
            let rate = ((now.misses - m0) as f64 / routed as f64).clamp(0.0, 1.0);
            let old = self.miss[i].1;
            self.miss[i].1 = old + BLEND * (rate - old);
            self.last_layers[i] = (s.layer, now.routed, now.misses);
        }
        self.miss[i].1
    }
}

fn layer_of(stats: &StoreStats, layer: usize) -> Option<&LayerStats> {
    stats
        .layers
        .iter()
        .find(|(l, _)| *l == layer)
        .map(|(_, s)| s)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn stats(bytes: u64, busy_ns: u64, layers: &[(usize, u64, u64)]) -> StoreStats {
        let mut s = StoreStats::default();
        s.total.bytes_read = bytes;
        s.io_busy_ns = busy_ns;
        for &(l, routed, misses) in layers {
            let ls = LayerStats {
                routed,
                misses,
                ..LayerStats::default()
            };
            s.layers.push((l, ls));
        }
        s
    }

    fn shape(layer: usize, holds: u64) -> LayerShape {
        LayerShape {
            layer,
            experts: 16,
            bytes: 16 << 20,
            holds,
        }
    }

    #[test]
    fn a_layer_held_whole_costs_nothing() {
        let mut c = ReadCosts::default();
        let shapes = [shape(1, 16 << 20), shape(4, 16 << 20)];
        let p = c.update(&stats(0, 0, &[]), &shapes, 2, Some(4));
        assert_eq!(p.main_row_bytes, 0.0);
        assert_eq!(p.mtp_row_bytes, 0.0);
        assert_eq!(p.mtp_missing_bytes, 0.0);
        // Its warm-up misses (each expert read once) are not a draft's cost.
        let p = c.update(&stats(32 << 20, 0, &[(1, 16, 16)]), &shapes, 2, Some(4));
        assert_eq!(p.main_row_bytes, 0.0);
    }

    #[test]
    fn the_prior_is_the_share_the_cache_cannot_hold_then_the_measured_rate() {
        let mut c = ReadCosts::default();
        let shapes = [shape(1, 4 << 20), shape(4, 0)];
        let p = c.update(&stats(0, 0, &[]), &shapes, 2, Some(4));
        // 2 experts of 1 MiB, 2·(1 − 2/16) new per extra row, 3/4 of them missing.
        let mib = (1u64 << 20) as f64;
        assert!((p.main_row_bytes - 2.0 * (1.0 - 2.0 / 16.0) * 0.75 * mib).abs() < 1.0);
        assert!((p.mtp_row_bytes - 2.0 * mib).abs() < 1.0);
        assert_eq!(p.mtp_missing_bytes, 16.0 * mib);
        assert_eq!(p.secs_per_byte, PRIOR_SECS_PER_BYTE);
        // Measured: every other request missed; reads in flight for 8 ms to read 4 MiB.
        let s = stats(4 << 20, 8_000_000, &[(1, 100, 50), (4, 100, 100)]);
        let p = c.update(&s, &shapes, 2, Some(4));
        let spb = 8e-3 / (4u64 << 20) as f64;
        assert!((p.secs_per_byte - spb).abs() < 1e-15, "{p:?}");
        let miss = 0.75 + BLEND * (0.5 - 0.75);
        assert!((p.main_row_bytes - 2.0 * (1.0 - 2.0 / 16.0) * miss * mib).abs() < 1.0);
    }
}
