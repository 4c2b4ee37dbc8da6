//! Cache policies replayed on a trace, without I/O: which of each forward's experts each
//! policy already holds. Every expert is the same size, so a budget is a number of slots.
//! A hit is counted per distinct expert of a forward's union per layer (the original engine's
//! count and ours), pinned hits included.

use std::collections::BTreeSet;

use super::trace::{RowKind, Trace};

/// The calls of a trace in order: (layer position in the header, the forward's union).
/// MTP rows are the MTP layer's own calls (position = the header's layer count).
pub fn calls(t: &Trace) -> Vec<(usize, Vec<u16>)> {
    calls_top(t, usize::MAX)
}

/// [`calls`] with each row cut to its first `k` experts (the router's best, when the trace
/// lists them best first): what routing to fewer experts per token would read.
pub fn calls_top(t: &Trace, k: usize) -> Vec<(usize, Vec<u16>)> {
    let nl = t.header.layers.len();
    let mut out = Vec::new();
    for f in t.forwards() {
        let rows = &t.rows[f.start..f.end];
        for r in rows.iter().filter(|r| r.kind == RowKind::Mtp) {
            let mut u: Vec<u16> = r.experts[0].iter().take(k).copied().collect();
            u.sort_unstable();
            out.push((nl, u));
        }
        let main: Vec<_> = rows.iter().filter(|r| r.kind != RowKind::Mtp).collect();
        if main.is_empty() {
            continue;
        }
        for l in 0..nl {
            let mut u: Vec<u16> = main
                .iter()
                .flat_map(|r| r.experts[l].iter().take(k).copied())
                .collect();
            u.sort_unstable();
            u.dedup();
            out.push((l, u));
        }
    }
    out
}

/// Per-(layer, expert) selection counts of a trace (every row, as a routing history counts).
pub fn history(t: &Trace) -> Vec<Vec<u64>> {
    let nl = t.header.layers.len() + t.header.mtp_layer.is_some() as usize;
    let mut h = vec![vec![0u64; t.header.experts]; nl];
    for r in &t.rows {
        let base = if r.kind == RowKind::Mtp {
            t.header.layers.len()
        } else {
            0
        };
        for (l, ids) in r.experts.iter().enumerate() {
            for &e in ids {
                h[base + l][e as usize] += 1;
            }
        }
    }
    h
}

/// The `slots` most-selected (layer, expert) pairs of `hist`, ranked over all layers together
/// (ties: lower layer, lower id).
pub fn top_pins(hist: &[Vec<u64>], slots: usize) -> Vec<(usize, usize)> {
    let mut c: Vec<(u64, usize, usize)> = hist
        .iter()
        .enumerate()
        .flat_map(|(l, v)| {
            v.iter()
                .enumerate()
                .filter(|(_, &n)| n > 0)
                .map(move |(e, &n)| (n, l, e))
        })
        .collect();
    c.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    c.into_iter().take(slots).map(|(_, l, e)| (l, e)).collect()
}

/// Hits and lookups of a replay, and which lookups hit (for determinism checks).
#[derive(Debug, Clone, PartialEq)]
pub struct SimResult {
    pub hits: u64,
    pub lookups: u64,
    pub hit_bits: Vec<bool>,
}

impl SimResult {
    pub fn hit_rate(&self) -> f64 {
        self.hits as f64 / self.lookups.max(1) as f64
    }
    fn record(&mut self, hit: bool) {
        self.hits += hit as u64;
        self.lookups += 1;
        self.hit_bits.push(hit);
    }
    fn new() -> Self {
        SimResult {
            hits: 0,
            lookups: 0,
            hit_bits: Vec::new(),
        }
    }
}

/// The original engine's policy: pins loaded at start and never released, then an equal
/// LRU of `lru_slots` per layer; every miss is admitted.
pub fn original(
    calls: &[(usize, Vec<u16>)],
    layers: usize,
    experts: usize,
    pins: &[(usize, usize)],
    lru_slots: usize,
) -> SimResult {
    let mut pinned = vec![vec![false; experts]; layers];
    for &(l, e) in pins {
        if l < layers {
            pinned[l][e] = true;
        }
    }
    let mut stamp = vec![vec![0u64; experts]; layers];
    let mut resident: Vec<Vec<u16>> = vec![Vec::new(); layers];
    let mut r = SimResult::new();
    let mut clock = 0u64;
    for (l, ids) in calls {
        let l = *l;
        for &e in ids {
            clock += 1;
            let eu = e as usize;
            if pinned[l][eu] {
                r.record(true);
                continue;
            }
            let hit = stamp[l][eu] > 0;
            r.record(hit);
            if !hit && lru_slots > 0 {
                if resident[l].len() >= lru_slots {
                    // Evict the least recent that this call does not use.
                    let victim = resident[l]
                        .iter()
                        .enumerate()
                        .filter(|(_, &x)| !ids.contains(&x))
                        .min_by_key(|(_, &x)| stamp[l][x as usize])
                        .map(|(i, _)| i);
                    match victim {
                        Some(i) => {
                            let x = resident[l].swap_remove(i);
                            stamp[l][x as usize] = 0;
                        }
                        None => continue,
                    }
                }
                resident[l].push(e);
            }
            if stamp[l][eu] > 0 || resident[l].contains(&e) {
                stamp[l][eu] = clock;
            }
        }
    }
    r
}

/// A scored cache: each layer keeps the experts with the highest
/// `prior(e) + frequency(e) + recency(e)`, where `prior` is the history's selections per call
/// (a learned popularity, pinned in effect while it wins), `frequency` the selections per call
/// seen since the start with a half-life, and `recency` a bonus while the expert was used in the
/// last `recent` calls of its layer (the working set that consecutive tokens share).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scored {
    /// Weight of the history's popularity.
    pub prior: f64,
    /// Half-life of the online frequency, in calls of the layer (0: no online frequency).
    pub half_life: f64,
    /// Calls an expert stays "recent" after a use.
    pub recent: u64,
    /// The recency bonus (in selections per call; 1 outranks any popularity).
    pub bonus: f64,
    /// Weight of the learned next-call affinity of the layer's last call ([`transitions`]).
    pub affinity: f64,
}

pub fn scored(
    calls: &[(usize, Vec<u16>)],
    layers: usize,
    experts: usize,
    prior: &[Vec<f64>],
    trans: Option<&[Vec<f32>]>,
    slots: &[usize],
    p: Scored,
) -> SimResult {
    let mut aff = vec![0.0f64; experts];
    let mut prev_call: Vec<Option<&Vec<u16>>> = vec![None; layers];
    let mut tick = vec![0u64; layers];
    let mut freq = vec![vec![(0.0f64, 0u64); experts]; layers];
    let mut last = vec![vec![0u64; experts]; layers];
    let mut resident: Vec<Vec<u16>> = vec![Vec::new(); layers];
    let mut is_res = vec![vec![false; experts]; layers];
    let mut r = SimResult::new();
    let decay = |f: (f64, u64), now: u64| -> f64 {
        if p.half_life <= 0.0 {
            0.0
        } else {
            f.0 * (-((now - f.1) as f64) * std::f64::consts::LN_2 / p.half_life).exp()
        }
    };
    let rate = if p.half_life > 0.0 {
        std::f64::consts::LN_2 / p.half_life
    } else {
        0.0
    };
    for (l, ids) in calls {
        let l = *l;
        tick[l] += 1;
        let now = tick[l];
        // The affinity of this call's experts to the layer's previous call (known before the
        // router runs).
        aff.fill(0.0);
        if let (Some(t), Some(prev)) = (trans.and_then(|t| t.get(l)), prev_call[l]) {
            for &j in prev {
                let row = &t[j as usize * experts..(j as usize + 1) * experts];
                for (x, &v) in aff.iter_mut().zip(row) {
                    *x += v as f64;
                }
            }
        }
        prev_call[l] = Some(ids);
        let aff = &aff;
        let score = |e: usize, freq: &[(f64, u64)], last: &[u64]| {
            let pr = prior.get(l).and_then(|v| v.get(e)).copied().unwrap_or(0.0);
            let recent = last[e] > 0 && now - last[e] <= p.recent;
            p.prior * pr
                + rate * decay(freq[e], now)
                + if recent { p.bonus } else { 0.0 }
                + p.affinity * aff[e]
        };
        for &e in ids {
            let eu = e as usize;
            let hit = is_res[l][eu];
            r.record(hit);
            freq[l][eu] = (decay(freq[l][eu], now) + 1.0, now);
            last[l][eu] = now;
            if hit || slots[l] == 0 {
                continue;
            }
            if resident[l].len() < slots[l] {
                resident[l].push(e);
                is_res[l][eu] = true;
                continue;
            }
            let victim = resident[l]
                .iter()
                .enumerate()
                .filter(|(_, &x)| !ids.contains(&x))
                .map(|(i, &x)| (i, score(x as usize, &freq[l], &last[l])))
                .min_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((i, _)) = victim {
                let x = resident[l][i];
                is_res[l][x as usize] = false;
                resident[l][i] = e;
                is_res[l][eu] = true;
            }
        }
    }
    r
}

/// The offline optimum (Belady with bypass): on a miss with the cache full, evict the resident
/// expert used farthest in the future, unless the missing one is used even later (then it
/// is not admitted). `slots[l]` per layer, or one pool of `global` slots shared by all layers
/// when given.
pub fn belady(
    calls: &[(usize, Vec<u16>)],
    layers: usize,
    experts: usize,
    slots: &[usize],
    global: Option<usize>,
) -> SimResult {
    let n = calls.iter().map(|c| c.1.len()).sum::<usize>();
    // next[i]: the index of the next lookup of the same (layer, expert) after lookup i.
    let mut next = vec![usize::MAX; n];
    let mut last = vec![vec![usize::MAX; experts]; layers];
    let mut flat: Vec<(usize, u16)> = Vec::with_capacity(n);
    for (l, ids) in calls {
        for &e in ids {
            flat.push((*l, e));
        }
    }
    for i in (0..n).rev() {
        let (l, e) = flat[i];
        next[i] = last[l][e as usize];
        last[l][e as usize] = i;
    }
    let pools = if global.is_some() { 1 } else { layers };
    let cap = |l: usize| global.unwrap_or_else(|| slots.get(l).copied().unwrap_or(0));
    let mut sets: Vec<BTreeSet<(usize, usize, u16)>> = vec![BTreeSet::new(); pools];
    let mut when = vec![vec![usize::MAX; experts]; layers];
    let mut resident = vec![vec![false; experts]; layers];
    let mut r = SimResult::new();
    for (i, &(l, e)) in flat.iter().enumerate() {
        let p = if global.is_some() { 0 } else { l };
        let eu = e as usize;
        let hit = resident[l][eu];
        r.record(hit);
        let nx = next[i];
        if hit {
            sets[p].remove(&(when[l][eu], l, e));
        } else {
            if cap(l) == 0 {
                continue;
            }
            if sets[p].len() >= cap(l) {
                let &(far, fl, fe) = sets[p].iter().next_back().expect("full set");
                if far <= nx {
                    continue; // bypass: the newcomer is needed later than every resident
                }
                sets[p].remove(&(far, fl, fe));
                resident[fl][fe as usize] = false;
            }
            resident[l][eu] = true;
        }
        when[l][eu] = nx;
        sets[p].insert((nx, l, e));
    }
    r
}

/// A frequency cache over one pool shared by every layer (hot layers hold more): each
/// (layer, expert) scores `prior·history + decayed frequency` (selections per call of its
/// layer, half-life `half_life` calls), and a miss is admitted in place of the lowest-scored
/// resident the call does not use, only when it scores higher after this use (a frequency
/// admission filter: a one-off cold expert does not evict a recurring one).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Pooled {
    /// Weight of the history's popularity (selections per call).
    pub prior: f64,
    /// Half-life of the online frequency, in calls of the layer.
    pub half_life: f64,
    /// Weight of the learned next-call affinity of the layer's last call (0: none).
    pub affinity: f64,
}

/// Per layer, how much more likely each expert is in a layer's next call given one expert of
/// its last call: `P(e next | j now) − P(e)`, row-major `j · experts + e`, learned from a
/// history's calls (the routing is a process; its transitions are as learnable as its
/// popularity).
pub fn transitions(calls: &[(usize, Vec<u16>)], layers: usize, experts: usize) -> Vec<Vec<f32>> {
    let mut joint = vec![vec![0u32; experts * experts]; layers];
    let mut seen = vec![vec![0u32; experts]; layers];
    let mut next = vec![vec![0u32; experts]; layers];
    let mut n = vec![0u32; layers];
    let mut last: Vec<Option<&Vec<u16>>> = vec![None; layers];
    for (l, ids) in calls {
        let l = *l;
        if let Some(prev) = last[l] {
            n[l] += 1;
            for &j in prev {
                seen[l][j as usize] += 1;
                for &e in ids {
                    joint[l][j as usize * experts + e as usize] += 1;
                }
            }
            for &e in ids {
                next[l][e as usize] += 1;
            }
        }
        last[l] = Some(ids);
    }
    (0..layers)
        .map(|l| {
            let total = n[l].max(1) as f32;
            let mut t = vec![0.0f32; experts * experts];
            for j in 0..experts {
                let sj = seen[l][j] as f32;
                for e in 0..experts {
                    let base = next[l][e] as f32 / total;
                    // Shrunk toward no affinity when j was seen rarely.
                    let cond = (joint[l][j * experts + e] as f32 + base) / (sj + 1.0);
                    t[j * experts + e] = cond - base;
                }
            }
            t
        })
        .collect()
}

pub fn pooled(
    calls: &[(usize, Vec<u16>)],
    layers: usize,
    experts: usize,
    prior: &[Vec<f64>],
    trans: Option<&[Vec<f32>]>,
    slots: usize,
    p: Pooled,
) -> SimResult {
    let mut aff = vec![vec![0.0f64; experts]; layers];
    let rate = std::f64::consts::LN_2 / p.half_life.max(1e-9);
    let mut tick = vec![0u64; layers];
    // (frequency, at tick) per (layer, expert).
    let mut freq = vec![vec![(0.0f64, 0u64); experts]; layers];
    let mut is_res = vec![vec![false; experts]; layers];
    let mut resident: Vec<(usize, u16)> = Vec::new();
    let mut r = SimResult::new();
    let score = |l: usize, e: usize, f: (f64, u64), now: &[u64], aff: &[Vec<f64>]| {
        let pr = prior.get(l).and_then(|v| v.get(e)).copied().unwrap_or(0.0);
        let age = now[l].saturating_sub(f.1) as f64;
        p.prior * pr + rate * f.0 * (-age * rate).exp() + p.affinity * aff[l][e]
    };
    let mut last: Vec<Option<&Vec<u16>>> = vec![None; layers];
    for (l, ids) in calls {
        let l = *l;
        tick[l] += 1;
        let now = tick[l];
        // This call's affinity: from the layer's previous call (known before the router
        // runs), for choosing what this call's misses evict.
        if let (Some(t), Some(prev)) = (trans.and_then(|t| t.get(l)), last[l]) {
            let a = &mut aff[l];
            a.fill(0.0);
            for &j in prev {
                let row = &t[j as usize * experts..(j as usize + 1) * experts];
                for (x, &v) in a.iter_mut().zip(row) {
                    *x += v as f64;
                }
            }
        }
        last[l] = Some(ids);
        for &e in ids {
            let eu = e as usize;
            let hit = is_res[l][eu];
            r.record(hit);
            let f = freq[l][eu];
            let age = now.saturating_sub(f.1) as f64;
            freq[l][eu] = (f.0 * (-age * rate).exp() + 1.0, now);
            if hit || slots == 0 {
                continue;
            }
            if resident.len() < slots {
                resident.push((l, e));
                is_res[l][eu] = true;
                continue;
            }
            let mine = score(l, eu, freq[l][eu], &tick, &aff);
            let victim = resident
                .iter()
                .enumerate()
                .filter(|(_, &(rl, re))| !(rl == l && ids.contains(&re)))
                .map(|(i, &(rl, re))| {
                    let f = freq[rl][re as usize];
                    (i, score(rl, re as usize, f, &tick, &aff))
                })
                .min_by(|a, b| a.1.total_cmp(&b.1));
            if let Some((i, s)) = victim {
                if s < mine {
                    let (vl, ve) = resident[i];
                    is_res[vl][ve as usize] = false;
                    resident[i] = (l, e);
                    is_res[l][eu] = true;
                }
            }
        }
    }
    r
}
