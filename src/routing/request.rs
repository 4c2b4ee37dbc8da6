//! One `colibri plan` request end to end: open the model, measure what was not given, replay,
//! and answer with the Model keywords to use.

use std::path::PathBuf;
use std::time::Instant;

use serde::Serialize;

use super::host::{probe_compute, probe_disk, probe_disk_in, ComputeProbe, DiskProbe};
use super::plan::{open_model, Plan, PlanInput, Scenario};
use crate::error::{Error, Result};

/// What the user asked.
#[derive(Debug, Clone)]
pub struct PlanRequest {
    /// A container directory or a known config name.
    pub model: String,
    pub ram_bytes: u64,
    /// Given disk read speed (bytes/s); `None`: probe.
    pub disk_bytes_per_second: Option<f64>,
    /// Given kernel speed (weight bytes/s); `None`: probe this host.
    pub compute_bytes_per_second: Option<f64>,
    pub cache_dir: Option<PathBuf>,
    /// Where a known config's disk probe writes its scratch file (default: the cache dir).
    pub probe_dir: Option<PathBuf>,
    pub reserve_bytes: u64,
    pub seed: u64,
    pub probe_seconds: f64,
}

/// The Model keywords the plan recommends.
#[derive(Debug, Clone, Serialize)]
pub struct Recommended {
    pub ram_budget: u64,
    pub prefetch: &'static str,
    pub draft: &'static str,
    /// `"auto"` or a depth.
    pub draft_depth: serde_json::Value,
}

/// The answer (`colibri plan --json` prints it).
#[derive(Debug, Clone, Serialize)]
pub struct PlanReport {
    pub predicted_tokens_per_second: f64,
    pub hit_rate: f64,
    pub bytes_per_token: f64,
    pub recommended: Recommended,
    /// The store's pin share the best setting used (the store's own default is 0.5; Model
    /// has no keyword for it yet).
    pub pin_share: f64,
    /// The same figures with the defaults (pins at half the budget, prefetch, MTP drafts).
    pub defaults: Scenario,
    pub disk_bytes_per_second: f64,
    pub disk: Option<DiskProbe>,
    pub compute_bytes_per_second: f64,
    pub compute: Option<ComputeProbe>,
    pub plan: Plan,
    pub seconds: f64,
}

pub fn run(req: &PlanRequest) -> Result<PlanReport> {
    let start = Instant::now();
    if !(req.probe_seconds > 0.0 && req.probe_seconds <= 60.0) {
        return Err(Error::invalid("probe_seconds", "must be in (0, 60]"));
    }
    for (name, v) in [
        ("disk_bw", req.disk_bytes_per_second),
        ("compute", req.compute_bytes_per_second),
    ] {
        if v.is_some_and(|x| !(x.is_finite() && x > 0.0)) {
            return Err(Error::invalid(
                name,
                "must be a positive rate, e.g. '3.2GB/s'",
            ));
        }
    }
    let model = open_model(&req.model, req.cache_dir.as_deref())?;
    let shape = &model.shape;
    let disk = match req.disk_bytes_per_second {
        Some(_) => None,
        None if !model.files.is_empty() => Some(probe_disk(
            &model.files,
            shape.expert_bytes as usize,
            req.probe_seconds,
        )?),
        None => {
            let dir = req
                .probe_dir
                .clone()
                .or_else(|| req.cache_dir.clone())
                .or_else(crate::experts::usage::default_cache_dir)
                .ok_or_else(|| {
                    Error::invalid("disk_bw", "no directory to probe: give --disk-bw")
                })?;
            Some(probe_disk_in(
                &dir,
                shape.expert_bytes as usize,
                req.probe_seconds,
            )?)
        }
    };
    let compute = match req.compute_bytes_per_second {
        Some(_) => None,
        None => Some(probe_compute(
            shape.hidden,
            shape.moe_inter,
            req.probe_seconds.min(2.0),
        )?),
    };
    let disk_bps = req
        .disk_bytes_per_second
        .or(disk.as_ref().map(|d| d.bytes_per_second))
        .unwrap_or(0.0);
    let compute_bps = req
        .compute_bytes_per_second
        .or(compute.as_ref().map(|c| c.weight_bytes_per_second))
        .unwrap_or(0.0);
    let plan = PlanInput {
        shape: shape.clone(),
        ram_bytes: req.ram_bytes,
        reserve_bytes: req.reserve_bytes,
        disk_bytes_per_second: disk_bps,
        compute_bytes_per_second: compute_bps,
        history: model.history.clone(),
        seed: req.seed,
        sample_layers: 16,
    }
    .plan()?;
    let best = &plan.best;
    Ok(PlanReport {
        predicted_tokens_per_second: best.tokens_per_second,
        hit_rate: best.hit_rate,
        bytes_per_token: best.bytes_per_token,
        recommended: Recommended {
            ram_budget: plan.expert_budget_bytes,
            prefetch: if best.prefetch { "real" } else { "off" },
            draft: if best.draft_depth == 0 { "off" } else { "mtp" },
            draft_depth: if best.draft_depth == 0 {
                serde_json::Value::from("auto")
            } else {
                serde_json::Value::from(best.draft_depth)
            },
        },
        pin_share: best.pin_share,
        defaults: plan.defaults.clone(),
        disk_bytes_per_second: disk_bps,
        disk,
        compute_bytes_per_second: compute_bps,
        compute,
        plan,
        seconds: start.elapsed().as_secs_f64(),
    })
}
