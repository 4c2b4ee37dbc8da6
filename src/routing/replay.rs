//! Replay a routing trace through the real [`ExpertStore`]: its budget split, pins, LRU,
//! demand I/O pool, prefetch threads and eviction guard, with each layer's compute replaced
//! by a busy wait of the duration our int4 kernels measure at the expert's shape
//! ([`probe_compute`](super::host::probe_compute)). What the store does is real; only the
//! arithmetic is stood in for, so the replay measures hit rate, bytes read, I/O wait, disk
//! busy share and tokens/s of a model whose experts are these files.
//!
//! Trace layer positions map onto the store's routed layers in order; the trace's MTP layer
//! (position = its layer count) onto the store's last layer, which must then exist.

use std::time::{Duration, Instant};

use serde::Serialize;

use super::plan::{forward_calls, predicted};
use super::sim::calls;
use super::trace::Trace;
use crate::error::{Error, Result};
use crate::experts::ExpertStore;

/// How the replay stands in for compute, and whether it prefetches.
#[derive(Debug, Clone, PartialEq)]
pub struct ReplayOptions {
    /// Weight bytes the expert kernels process per second (busy-waited for).
    pub compute_bytes_per_second: f64,
    /// Seconds of dense compute per main-model row (attention, shared experts), busy-waited
    /// at the start of each decode forward; 0 for an experts-only stand-in.
    pub dense_seconds_per_row: f64,
    /// Call `prefetch` with the trace's router-lookahead predictions one layer ahead.
    pub prefetch: bool,
}

/// What a replay measured over the trace's decode forwards.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ReplayResult {
    /// Distinct experts requested per call, summed (the hit-rate denominator).
    pub lookups: u64,
    pub hits: u64,
    pub hit_rate: f64,
    /// Bytes read from disk (demand and prefetch) per generated token.
    pub bytes_per_token: f64,
    /// Share of decode wall time the forward spent blocked on reads.
    pub io_wait_share: f64,
    /// Share of decode wall time at least one read was in flight.
    pub disk_busy_share: f64,
    /// Bytes read over the time reads were in flight.
    pub read_bytes_per_second: f64,
    pub tokens: u64,
    pub forwards: u64,
    pub tokens_per_forward: f64,
    pub tokens_per_second: f64,
    pub seconds: f64,
    /// Router-lookahead recall (routed experts it predicted) and precision (predicted experts
    /// that were routed) over the decode calls; NaN without prefetch.
    pub prefetch_recall: f64,
    pub prefetch_precision: f64,
    /// Hits per call, in order (decode calls only): identical seeds and no prefetch threads
    /// give identical sequences.
    #[serde(skip)]
    pub hits_per_call: Vec<u32>,
}

fn busy_wait(seconds: f64) {
    if seconds <= 0.0 {
        return;
    }
    let end = Instant::now() + Duration::from_secs_f64(seconds);
    while Instant::now() < end {
        std::hint::spin_loop();
    }
}

/// The store layer of each trace position (the MTP position last).
fn layer_map(store: &ExpertStore, trace: &Trace) -> Result<Vec<usize>> {
    let layers: Vec<usize> = store.layers().iter().map(|&(l, _)| l).collect();
    let nl = trace.header.layers.len();
    let want = nl + trace.header.mtp_layer.is_some() as usize;
    if layers.len() < want {
        return Err(Error::invalid(
            "trace",
            format!(
                "the trace routes {want} layers ({nl} main{}), the store has {} routed layers",
                if want > nl { " and an MTP layer" } else { "" },
                layers.len()
            ),
        ));
    }
    if let Some(&(l, n)) = store
        .layers()
        .iter()
        .find(|&&(_, n)| n < trace.header.experts)
    {
        return Err(Error::invalid(
            "trace",
            format!(
                "the trace routes {} experts per layer, store layer {l} has {n}",
                trace.header.experts
            ),
        ));
    }
    let mut map: Vec<usize> = layers[..nl].to_vec();
    if want > nl {
        map.push(*layers.last().unwrap_or(&0));
    }
    Ok(map)
}

/// Replay `trace` through `store` (whose stats are reset first).
pub fn replay(store: &ExpertStore, trace: &Trace, opts: &ReplayOptions) -> Result<ReplayResult> {
    let positive = opts.compute_bytes_per_second.is_finite() && opts.compute_bytes_per_second > 0.0;
    let dense_ok = opts.dense_seconds_per_row.is_finite() && opts.dense_seconds_per_row >= 0.0;
    if !positive || !dense_ok {
        return Err(Error::invalid(
            "replay",
            "compute speed must be positive and dense time non-negative",
        ));
    }
    trace.validate()?;
    let map = layer_map(store, trace)?;
    let nl = trace.header.layers.len();
    let c = calls(trace);
    let pred = predicted(trace);
    let fw = forward_calls(trace);
    let top_k = trace.header.top_k as f64;
    store.reset_stats();
    let (mut t, mut tokens, mut forwards, mut bytes, mut wait_ns, mut busy_ns) =
        (0.0, 0u64, 0u64, 0u64, 0u64, 0u64);
    let (mut hits, mut lookups) = (0u64, 0u64);
    let (mut predicted_n, mut routed_r, mut recalled_r) = (0u64, 0u64, 0u64);
    let mut hits_per_call = Vec::new();
    let mut at = 0usize;
    for f in &fw {
        let before = store.stats();
        let start = Instant::now();
        if f.decode {
            busy_wait(f.rows as f64 * opts.dense_seconds_per_row);
        }
        for i in at..at + f.calls {
            let (pos, ids) = &c[i];
            let layer = map[*pos];
            if opts.prefetch && f.decode && *pos == 0 && !pred[i].is_empty() {
                // The first layer's lookahead comes with the forward's start.
                let ids: Vec<usize> = pred[i].iter().map(|&e| e as usize).collect();
                store.prefetch(layer, &ids);
            }
            if opts.prefetch && f.decode && *pos < nl {
                // The lookahead for the next main layer is known while this one computes.
                if let Some(next) = (i + 1 < at + f.calls).then(|| &pred[i + 1]) {
                    if c[i + 1].0 < nl && !next.is_empty() {
                        let ids: Vec<usize> = next.iter().map(|&e| e as usize).collect();
                        store.prefetch(map[c[i + 1].0], &ids);
                    }
                }
            }
            // Decode and verify rows each cost a full row of every routed expert (today's
            // exact decode); a prompt chunk runs each expert once over all its rows.
            let rows = if *pos == nl {
                1.0
            } else if f.decode {
                f.rows as f64
            } else {
                ids.len() as f64 / top_k
            };
            let call_s = rows * top_k * store_expert_bytes(store, layer)? as f64
                / opts.compute_bytes_per_second;
            let per_expert = call_s / ids.len().max(1) as f64;
            let ids: Vec<usize> = ids.iter().map(|&e| e as usize).collect();
            let h0 = layer_hits(store, layer);
            store.with_expert_batches(layer, &ids, &mut |batch| {
                busy_wait(per_expert * batch.len() as f64);
                Ok(())
            })?;
            if f.decode {
                let h = layer_hits(store, layer) - h0;
                hits += h;
                lookups += ids.len() as u64;
                hits_per_call.push(h as u32);
            }
        }
        at += f.calls;
        if f.decode {
            t += start.elapsed().as_secs_f64();
            let after = store.stats();
            bytes += after.total.bytes_read - before.total.bytes_read;
            wait_ns += after.total.wait_ns - before.total.wait_ns;
            busy_ns += after.io_busy_ns - before.io_busy_ns;
            predicted_n += after.total.predicted_router - before.total.predicted_router;
            routed_r += after.total.routed_router - before.total.routed_router;
            recalled_r += after.total.recalled_router - before.total.recalled_router;
            tokens += f.tokens;
            forwards += 1;
        }
    }
    let ratio = |a: u64, b: u64| {
        if b == 0 {
            f64::NAN
        } else {
            a as f64 / b as f64
        }
    };
    let tf = tokens.max(1) as f64;
    Ok(ReplayResult {
        lookups,
        hits,
        hit_rate: ratio(hits, lookups),
        bytes_per_token: bytes as f64 / tf,
        io_wait_share: wait_ns as f64 * 1e-9 / t.max(1e-12),
        disk_busy_share: busy_ns as f64 * 1e-9 / t.max(1e-12),
        read_bytes_per_second: bytes as f64 / (busy_ns as f64 * 1e-9).max(1e-12),
        tokens,
        forwards,
        tokens_per_forward: tokens as f64 / forwards.max(1) as f64,
        tokens_per_second: tokens as f64 / t.max(1e-12),
        seconds: t,
        prefetch_recall: ratio(recalled_r, routed_r),
        prefetch_precision: ratio(recalled_r, predicted_n),
        hits_per_call,
    })
}

fn store_expert_bytes(store: &ExpertStore, layer: usize) -> Result<u64> {
    store.charged_bytes(layer, 0)
}

fn layer_hits(store: &ExpertStore, layer: usize) -> u64 {
    store
        .stats()
        .layers
        .iter()
        .find(|(l, _)| *l == layer)
        .map_or(0, |(_, s)| s.hits())
}
