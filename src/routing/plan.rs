//! `colibri plan`: predict decode speed and hit rate for a model, a RAM size, a disk and a
//! compute speed, by replaying the calibrated workload (or the user's own routing history)
//! through the store's policy, and recommend the Model keywords that do best.
//!
//! The time model, per decode forward (docs/expert-store.md, "colibri plan"), as the store
//! runs it (measured against the real store by tools/replay_routing.rs):
//!
//! ```text
//! per call:  C = rows · top_k · expert / compute_speed,   c = C / experts in the call
//!            m = demand misses (prefetch off: all; on: those the lookahead did not predict)
//!            t_call = C                                  if m = 0
//!                   = max(C, m · expert / disk_speed + min(m, io_threads) · c)  otherwise
//! forward:   t = max(rows · dense / compute_speed + Σ t_call,  all reads / disk_speed)
//! ```
//!
//! A call computes its resident experts while its misses load (io_threads at a time) and the
//! last batch after it arrives; prefetched reads run in the background, so only the disk's
//! total time bounds them, wrong guesses included. Every verify row costs a full row of
//! compute (today's exact decode). The sampled layers (16, spaced over the model's) stand for
//! all of them.

use serde::Serialize;

use super::histogram::Histogram;
use super::sim::{self, calls, history, top_pins};
use super::trace::{RowKind, Trace};
use super::workload::{Workload, WorkloadSpec};
use crate::error::{Error, Result};

/// What the planner needs to know of a model.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct ModelShape {
    pub name: String,
    pub moe_layers: usize,
    pub experts: usize,
    pub top_k: usize,
    pub hidden: usize,
    pub moe_inter: usize,
    /// Bytes of one routed expert as stored.
    pub expert_bytes: u64,
    /// Bytes of the weights every token reads besides routed experts (attention, shared
    /// experts, embeddings' rows aside): resident in RAM.
    pub dense_bytes: u64,
    /// Whether the model has an MTP head to draft with.
    pub mtp: bool,
}

/// int4 with an f32 scale per 64 weights: 0.5625 bytes per weight.
fn int4_bytes(params: u64) -> u64 {
    params / 2 + params / 64 * 4
}

impl ModelShape {
    /// The built-in shapes, `glm-5.2` and `deepseek-v3`, at int4 (64-wide groups) throughout.
    /// Dense bytes are total minus routed parameters (GLM-5.2: 744 B total, 75 MoE layers of
    /// 256 experts of 3 × 6144 × 2048; DeepSeek-V3: 671 B, 58 of 256 of 3 × 7168 × 2048).
    pub fn known(name: &str) -> Result<Self> {
        let shape = |name: &str, layers: usize, hidden: usize, inter: usize, total: u64| {
            let expert = 3 * hidden as u64 * inter as u64;
            let routed = expert * 256 * layers as u64;
            ModelShape {
                name: name.into(),
                moe_layers: layers,
                experts: 256,
                top_k: 8,
                hidden,
                moe_inter: inter,
                expert_bytes: int4_bytes(expert),
                dense_bytes: int4_bytes(total.saturating_sub(routed)),
                mtp: true,
            }
        };
        match name.to_ascii_lowercase().as_str() {
            "glm-5.2" | "glm-5" | "glm5" => Ok(shape("glm-5.2", 75, 6144, 2048, 744_000_000_000)),
            "deepseek-v3" | "deepseek-r1" => Ok(shape("deepseek-v3", 58, 7168, 2048, 671_000_000_000)),
            other => Err(Error::invalid(
                "model",
                format!("{other:?} is neither a container directory nor a known config (glm-5.2, deepseek-v3)"),
            )),
        }
    }

    fn mtp_compute_bytes(&self) -> f64 {
        self.dense_bytes as f64 / (self.moe_layers + 3) as f64
            + self.top_k as f64 * self.expert_bytes as f64
    }
}

/// The planner's inputs.
#[derive(Debug, Clone)]
pub struct PlanInput {
    pub shape: ModelShape,
    /// RAM the process may use in all, bytes.
    pub ram_bytes: u64,
    /// Reserved besides dense weights and experts (KV caches, activations, the runtime).
    pub reserve_bytes: u64,
    pub disk_bytes_per_second: f64,
    pub compute_bytes_per_second: f64,
    /// The user's routing history, replacing the shipped GLM-5.2 histogram.
    pub history: Option<Histogram>,
    pub seed: u64,
    /// Layers simulated (spaced over the model's).
    pub sample_layers: usize,
}

/// One setting replayed.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Scenario {
    pub pin_share: f64,
    pub draft_depth: usize,
    pub prefetch: bool,
    pub hit_rate: f64,
    /// Expert bytes read from disk per generated token (prefetch's wrong guesses included).
    pub bytes_per_token: f64,
    pub tokens_per_forward: f64,
    pub tokens_per_second: f64,
    /// Share of decode time spent waiting on reads.
    pub io_share: f64,
}

/// The planner's answer.
#[derive(Debug, Clone, Serialize)]
pub struct Plan {
    pub model: ModelShape,
    pub expert_budget_bytes: u64,
    /// Share of all routed expert bytes the budget holds.
    pub budget_share: f64,
    pub workload: String,
    pub best: Scenario,
    /// The store's defaults (pins at half the budget, prefetch and MTP drafting at depth 3).
    pub defaults: Scenario,
    pub scenarios: Vec<Scenario>,
}

const PIN_SHARES: [f64; 5] = [0.0, 0.25, 0.5, 0.75, 0.9];

/// A forward's calls in the simulated trace, flattened as [`sim::calls`] orders them.
pub(crate) struct ForwardCalls {
    pub(crate) decode: bool,
    pub(crate) rows: usize,
    pub(crate) mtp_rows: usize,
    pub(crate) tokens: u64,
    pub(crate) calls: usize,
}

pub(crate) fn forward_calls(t: &Trace) -> Vec<ForwardCalls> {
    let nl = t.header.layers.len();
    t.forwards()
        .iter()
        .map(|f| {
            let rows = &t.rows[f.start..f.end];
            let mtp_rows = rows.iter().filter(|r| r.kind == RowKind::Mtp).count();
            let main = rows.len() - mtp_rows;
            ForwardCalls {
                decode: rows.iter().any(|r| r.kind == RowKind::Decode),
                rows: main,
                mtp_rows,
                tokens: rows
                    .iter()
                    .filter(|r| r.kind == RowKind::Decode || r.accepted == Some(true))
                    .count() as u64,
                calls: mtp_rows + if main > 0 { nl } else { 0 },
            }
        })
        .collect()
}

/// Per call of the trace, the experts the router lookahead predicted (the union over the
/// forward's rows of each row's prediction for that layer); none for prompt and MTP calls.
pub(crate) fn predicted(t: &Trace) -> Vec<Vec<u16>> {
    let nl = t.header.layers.len();
    let mut out = Vec::new();
    for f in t.forwards() {
        let rows = &t.rows[f.start..f.end];
        let mtp = rows.iter().filter(|r| r.kind == RowKind::Mtp).count();
        out.extend(std::iter::repeat_n(Vec::new(), mtp));
        let main: Vec<_> = rows.iter().filter(|r| r.kind != RowKind::Mtp).collect();
        if main.is_empty() {
            continue;
        }
        for l in 0..nl {
            let mut u: Vec<u16> = main
                .iter()
                .filter_map(|r| r.lookahead.as_ref().and_then(|p| p.get(l)))
                .flatten()
                .copied()
                .collect();
            u.sort_unstable();
            u.dedup();
            out.push(u);
        }
    }
    out
}

impl PlanInput {
    fn expert_budget(&self) -> Result<u64> {
        let fixed = self.shape.dense_bytes + self.reserve_bytes;
        let budget = self.ram_bytes.saturating_sub(fixed);
        if budget < self.shape.expert_bytes * (self.shape.moe_layers * self.shape.top_k) as u64 / 4
        {
            return Err(Error::invalid(
                "ram",
                format!(
                    "{} needs {:.1} GB for its dense weights and {:.1} GB reserved, and room for \
                     experts beyond that: give more than {:.1} GB",
                    self.shape.name,
                    self.shape.dense_bytes as f64 / 1e9,
                    self.reserve_bytes as f64 / 1e9,
                    (fixed
                        + self.shape.expert_bytes
                            * (self.shape.moe_layers * self.shape.top_k) as u64)
                        as f64
                        / 1e9
                ),
            ));
        }
        Ok(budget)
    }

    fn spec(&self, seed: u64, conversations: usize, depth: usize) -> WorkloadSpec {
        WorkloadSpec {
            seed,
            layers: self.sample_layers,
            conversations,
            prompt_tokens: 32,
            decode_tokens: 256,
            draft_depth: depth,
            mtp: depth > 0 && self.shape.mtp,
            ..WorkloadSpec::default()
        }
    }

    /// The learning and test traces [`PlanInput::plan`] replays at draft `depth`.
    pub fn traces(&self, hist: &Histogram, depth: usize) -> Result<(Trace, Trace)> {
        let learn = Workload::new(hist, self.spec(self.seed + 100, 5, depth))?.generate();
        let test = Workload::new(hist, self.spec(self.seed, 3, depth))?.generate();
        Ok((learn, test))
    }

    /// The predicted scenarios of one draft depth at `budget_share` of the expert bytes,
    /// on the traces of [`PlanInput::traces`].
    pub fn scenarios(
        &self,
        learn: &Trace,
        test: &Trace,
        budget_share: f64,
        depth: usize,
    ) -> Result<Vec<Scenario>> {
        self.replay(learn, test, budget_share, depth)
    }

    /// Replay every setting and pick the fastest.
    pub fn plan(&self) -> Result<Plan> {
        if !(self.disk_bytes_per_second > 0.0 && self.compute_bytes_per_second > 0.0) {
            return Err(Error::invalid(
                "plan",
                "disk and compute speeds must be positive",
            ));
        }
        let budget = self.expert_budget()?;
        let s = &self.shape;
        let total_experts = (s.moe_layers * s.experts) as u64;
        let budget_share = (budget as f64 / (total_experts * s.expert_bytes) as f64).min(1.0);
        let hist = match &self.history {
            Some(h) => h.clone(),
            None => Histogram::glm52().resized(s.experts, s.top_k)?,
        };
        let depths: Vec<usize> = if s.mtp { vec![0, 1, 2, 3] } else { vec![0] };
        let mut scenarios = Vec::new();
        for &depth in &depths {
            let (learn, test) = self.traces(&hist, depth)?;
            scenarios.extend(self.replay(&learn, &test, budget_share, depth)?);
        }
        let best = scenarios
            .iter()
            .max_by(|a, b| a.tokens_per_second.total_cmp(&b.tokens_per_second))
            .cloned()
            .ok_or_else(|| Error::Internal("no scenario".into()))?;
        let want_depth = *depths.last().unwrap_or(&0);
        let defaults = scenarios
            .iter()
            .find(|x| x.pin_share == 0.5 && x.prefetch && x.draft_depth == want_depth)
            .cloned()
            .unwrap_or_else(|| best.clone());
        Ok(Plan {
            model: s.clone(),
            expert_budget_bytes: budget,
            budget_share,
            workload: hist.source.clone(),
            best,
            defaults,
            scenarios,
        })
    }

    /// The scenarios of one draft depth: each pin share, prefetch off and on.
    fn replay(
        &self,
        learn: &Trace,
        test: &Trace,
        budget_share: f64,
        depth: usize,
    ) -> Result<Vec<Scenario>> {
        let s = &self.shape;
        let nl = test.header.layers.len() + test.header.mtp_layer.is_some() as usize;
        let scale = s.moe_layers as f64 / test.header.layers.len() as f64;
        let slots = (budget_share * (nl * s.experts) as f64).floor() as usize;
        let c = calls(test);
        let pred = predicted(test);
        let fw = forward_calls(test);
        let hist = history(learn);
        let cs = self.compute_bytes_per_second;
        // Per row: the resident dense part, then each routed layer's top-k experts.
        let dense_s = s.dense_bytes as f64 / cs;
        let mtp_dense_s = (s.mtp_compute_bytes() - s.top_k as f64 * s.expert_bytes as f64) / cs;
        let expert_s = s.expert_bytes as f64 / cs;
        let eb = s.expert_bytes as f64;
        let bw = self.disk_bytes_per_second;
        let mut out = Vec::new();
        for &share in &PIN_SHARES {
            let pins = top_pins(&hist, (slots as f64 * share) as usize);
            let lru = (slots - pins.len()) / nl;
            let r = sim::original(&c, nl, s.experts, &pins, lru);
            let miss_rate = 1.0 - r.hits as f64 / r.lookups.max(1) as f64;
            for prefetch in [false, true] {
                let (mut t, mut io, mut tokens, mut forwards) = (0.0, 0.0, 0u64, 0u64);
                let (mut hits, mut lookups, mut read) = (0u64, 0u64, 0.0);
                let mut at = 0usize;
                let mut bit = 0usize;
                for f in &fw {
                    // Calls run one after another; the background reads share the disk.
                    let (mut calls_t, mut compute, mut background, mut demand_b) =
                        (0.0, 0.0, 0.0, 0.0);
                    for (ci, call) in c[at..at + f.calls].iter().enumerate() {
                        let p = &pred[at + ci];
                        let main = call.0 < test.header.layers.len();
                        let w = if main { scale } else { 1.0 };
                        let (mut h, mut demand, mut ahead) = (0usize, 0usize, 0usize);
                        for e in &call.1 {
                            let hit = r.hit_bits[bit];
                            bit += 1;
                            h += hit as usize;
                            if !hit {
                                if prefetch && p.contains(e) {
                                    ahead += 1;
                                } else {
                                    demand += 1;
                                }
                            }
                        }
                        if f.decode {
                            hits += h as u64;
                            lookups += call.1.len() as u64;
                        }
                        if !f.decode {
                            continue;
                        }
                        // Every verify row costs a full row of each of its experts; the MTP
                        // layer runs one row per call.
                        let rows = if main { f.rows as f64 } else { 1.0 };
                        let call_compute = rows * s.top_k as f64 * expert_s;
                        let per_expert = call_compute / call.1.len().max(1) as f64;
                        calls_t += w * call_time(call_compute, per_expert, demand, eb / bw);
                        compute += w * call_compute;
                        let wasted = if prefetch {
                            // Predicted, not routed, and not resident (at the sim's hit rate).
                            p.iter().filter(|e| !call.1.contains(e)).count() as f64 * miss_rate
                        } else {
                            0.0
                        };
                        background += w * (ahead as f64 + wasted) * eb;
                        demand_b += w * demand as f64 * eb;
                        read += w * (demand + ahead) as f64 * eb + w * wasted * eb;
                    }
                    at += f.calls;
                    if !f.decode {
                        continue;
                    }
                    let dense = f.rows as f64 * dense_s + f.mtp_rows as f64 * mtp_dense_s;
                    let all_reads = (background + demand_b) / bw;
                    let ft = (dense + calls_t).max(all_reads);
                    io += ft - dense - compute;
                    t += ft;
                    tokens += f.tokens;
                    forwards += 1;
                }
                let tokens = tokens.max(1) as f64;
                out.push(Scenario {
                    pin_share: share,
                    draft_depth: depth,
                    prefetch,
                    hit_rate: hits as f64 / lookups.max(1) as f64,
                    bytes_per_token: read / tokens,
                    tokens_per_forward: tokens / forwards.max(1) as f64,
                    tokens_per_second: tokens / t.max(1e-12),
                    io_share: io / t.max(1e-12),
                });
            }
        }
        Ok(out)
    }
}

/// The store's demand I/O threads (`StoreOptions::io_threads`'s default): a call's misses are
/// read this many at a time.
const IO_THREADS: usize = 4;

/// One routed call with `demand` misses of `read_s` seconds each: the store computes the
/// resident experts while the misses load, then the last batch of loads after it arrives.
fn call_time(compute: f64, per_expert: f64, demand: usize, read_s: f64) -> f64 {
    if demand == 0 {
        return compute;
    }
    compute.max(demand as f64 * read_s + demand.min(IO_THREADS) as f64 * per_expert)
}

/// A model to plan for: its shape, the files a disk probe reads, its routing history.
#[derive(Debug, Clone)]
pub struct PlanModel {
    pub shape: ModelShape,
    /// The container's files (empty for a known config).
    pub files: Vec<std::path::PathBuf>,
    pub history: Option<Histogram>,
}

/// `model` is a container directory (its shape read from it, its routing history from
/// `cache_dir` or the default cache) or a known config name ([`ModelShape::known`]).
pub fn open_model(model: &str, cache_dir: Option<&std::path::Path>) -> Result<PlanModel> {
    use crate::experts::source::{ContainerSource, ExpertLocator};
    use crate::experts::usage;
    let dir = std::path::Path::new(model);
    if !dir.is_dir() {
        return Ok(PlanModel {
            shape: ModelShape::known(model)?,
            files: Vec::new(),
            history: None,
        });
    }
    let container = std::sync::Arc::new(crate::container::Container::open(dir)?);
    let cfg = container.config().clone();
    let source = ContainerSource::new(container)?;
    let moe: Vec<usize> = (0..source.num_layers())
        .filter(|&l| source.num_experts(l) > 0 && !cfg.is_mtp_layer(l))
        .collect();
    let Some(&first) = moe.first() else {
        return Err(Error::invalid(
            "model",
            format!("{model} has no routed experts: nothing to plan"),
        ));
    };
    let expert_bytes = source.locate(first, 0)?.bytes();
    let experts = source.num_experts(first);
    let files = source.files().to_vec();
    let file_bytes: u64 = files
        .iter()
        .filter_map(|p| std::fs::metadata(p).ok())
        .map(|m| m.len())
        .sum();
    let all_experts: u64 = (0..source.num_layers())
        .map(|l| source.num_experts(l) as u64)
        .sum();
    let shape = ModelShape {
        name: model.to_string(),
        moe_layers: moe.len(),
        experts,
        top_k: cfg.num_experts_per_tok,
        hidden: cfg.hidden_size,
        moe_inter: cfg.moe_intermediate_size,
        expert_bytes,
        dense_bytes: file_bytes.saturating_sub(all_experts * expert_bytes),
        mtp: cfg
            .mtp_layer_index()
            .is_some_and(|l| source.num_experts(l) > 0),
    };
    let shape_list: Vec<(usize, usize)> = (0..source.num_layers())
        .map(|l| (l, source.num_experts(l)))
        .filter(|&(_, n)| n > 0)
        .collect();
    let cache = cache_dir
        .map(|p| p.to_path_buf())
        .or_else(usage::default_cache_dir);
    let history = cache.and_then(|c| {
        let fp = source.fingerprint();
        let (mut counts, _) = usage::load(&usage::history_path(&c, &fp), &fp, &shape_list);
        // The MTP layer routes like the others but is not one of the planned main layers.
        if let Some(m) = cfg.mtp_layer_index() {
            counts.layers.remove(&m);
        }
        (counts.total() > 0)
            .then(|| Histogram::from_usage(&counts, shape.top_k).ok())
            .flatten()
    });
    Ok(PlanModel {
        shape,
        files,
        history,
    })
}
