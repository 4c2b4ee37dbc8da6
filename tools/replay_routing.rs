//! Replay the GLM-5.2-calibrated routing workload through the real expert store on a
//! disk-scale container, and set the measured hit rate, bytes per token, I/O wait, disk busy
//! share and tokens/s beside what `colibri plan`'s time model predicts for the same setup
//! (docs/expert-store.md, "Replay through the store").
//!
//! The container is a GLM-5.2-shaped stand-in (256 experts of 21,233,664 bytes per layer)
//! from `make_synthetic`, with an MTP layer when drafting is replayed:
//!
//! ```text
//! cargo run --release --example make_synthetic -- \
//!     --out /work/synth/glm52x4 --moe-layers 4 --dense-layers 0 --mtp --experts-only
//! cargo run --release --example replay_routing -- --container /work/synth/glm52x4 \
//!     [--budgets 0,0.13,0.5] [--pin-shares 0.5,0.75] [--prefetch off,on] [--depths 0] \
//!     [--compute RATE_BYTES_PER_S] [--disk-bw RATE_BYTES_PER_S] [--seed 1] [--trace FILE] \
//!     [--write-trace FILE] [--stats-only]
//! ```
//!
//! stdout gets the replayed trace's statistics (one JSON object per draft depth), then one
//! JSON object per setting. `--trace FILE` replays a JSON-lines trace (docs/expert-store.md)
//! instead of the generated one, without predictions; `--write-trace FILE` saves the trace
//! replayed (the last depth's), `--stats-only` stops after the statistics. Reads use
//! `io="direct"`, so the page cache holds nothing between settings.

use std::path::PathBuf;
use std::sync::Arc;

use colibri::container::Container;
use colibri::experts::{ExpertStore, IoMode, PinPolicy, PrefetchMode, StoreOptions};
use colibri::routing::histogram::Histogram;
use colibri::routing::host::{probe_compute, probe_disk};
use colibri::routing::plan::{ModelShape, PlanInput, Scenario};
use colibri::routing::replay::{replay, ReplayOptions};
use colibri::routing::sim::{history, top_pins};
use colibri::routing::trace::Trace;
use colibri::routing::TraceStats;

fn main() {
    if let Err(e) = run() {
        eprintln!("replay_routing: {e}");
        std::process::exit(2);
    }
}

fn list(v: Option<String>, flag: &str) -> Result<Vec<f64>, String> {
    v.ok_or(format!("{flag} needs a value"))?
        .split(',')
        .map(|x| match x.trim() {
            "off" => Ok(0.0),
            "on" => Ok(1.0),
            t => t.parse::<f64>().map_err(|e| format!("{flag}: {t:?}: {e}")),
        })
        .collect()
}

struct Args {
    container: PathBuf,
    budgets: Vec<f64>,
    pin_shares: Vec<f64>,
    prefetch: Vec<bool>,
    depths: Vec<usize>,
    compute: Option<f64>,
    disk_bw: Option<f64>,
    seed: u64,
    trace: Option<PathBuf>,
    write_trace: Option<PathBuf>,
    stats_only: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        container: PathBuf::new(),
        budgets: vec![0.0, 0.13, 0.5],
        pin_shares: vec![0.5, 0.75],
        prefetch: vec![false, true],
        depths: vec![0],
        compute: None,
        disk_bw: None,
        seed: 1,
        trace: None,
        write_trace: None,
        stats_only: false,
    };
    let mut it = std::env::args().skip(1);
    let one = |v: Option<String>, flag: &str| -> Result<f64, String> {
        Ok(*list(v, flag)?
            .first()
            .ok_or(format!("{flag} needs a value"))?)
    };
    while let Some(f) = it.next() {
        match f.as_str() {
            "--container" => a.container = it.next().map(PathBuf::from).unwrap_or_default(),
            "--budgets" => a.budgets = list(it.next(), "--budgets")?,
            "--pin-shares" => a.pin_shares = list(it.next(), "--pin-shares")?,
            "--prefetch" => {
                a.prefetch = list(it.next(), "--prefetch")?
                    .iter()
                    .map(|&x| x > 0.0)
                    .collect()
            }
            "--depths" => {
                a.depths = list(it.next(), "--depths")?
                    .iter()
                    .map(|&x| x as usize)
                    .collect()
            }
            "--compute" => a.compute = Some(one(it.next(), "--compute")?),
            "--disk-bw" => a.disk_bw = Some(one(it.next(), "--disk-bw")?),
            "--seed" => a.seed = one(it.next(), "--seed")? as u64,
            "--trace" => a.trace = it.next().map(PathBuf::from),
            "--write-trace" => a.write_trace = it.next().map(PathBuf::from),
            "--stats-only" => a.stats_only = true,
            "-h" | "--help" => {
                println!("see the header of tools/replay_routing.rs");
                std::process::exit(0);
            }
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    if a.container.as_os_str().is_empty() {
        return Err("--container DIR is required".into());
    }
    Ok(a)
}

/// A `colibri::Error` as this tool reports it.
fn err(e: colibri::Error) -> String {
    e.to_string()
}

/// The container and what every setting is replayed and predicted with.
struct Setup {
    container: Arc<Container>,
    /// Direct reads, nothing pinned or prefetched: the options each setting's store varies.
    probe_opts: StoreOptions,
    /// (layer, experts) of the store's routed layers, the MTP layer's last.
    layers: Vec<(usize, usize)>,
    /// Bytes the store charges for one expert.
    expert_bytes: u64,
    /// Experts per routed layer.
    experts: usize,
    /// Compute rate (weight bytes per second) the replay and the predictions assume.
    compute: f64,
    /// The plan's input for the predictions.
    input: PlanInput,
}

/// Open the container, measure (or take from the arguments) the compute and disk rates, and
/// describe the model to the plan.
fn setup(a: &Args) -> Result<Setup, String> {
    let container = Arc::new(Container::open(&a.container).map_err(err)?);
    let files: Vec<PathBuf> = colibri::container::shard_paths(&a.container).map_err(err)?;
    let probe_opts = StoreOptions {
        io: IoMode::Direct,
        ram_budget_bytes: Some(1 << 30),
        pin: PinPolicy::Off,
        prefetch: PrefetchMode::Off,
        usage_file: false,
        ..StoreOptions::default()
    };
    let (layers, eb) = {
        let s = ExpertStore::open(container.clone(), probe_opts.clone()).map_err(err)?;
        let layers: Vec<(usize, usize)> = s.layers();
        let eb = s.charged_bytes(layers[0].0, 0).map_err(err)?;
        (layers, eb)
    };
    let experts = layers[0].1;
    let main_layers = layers.len() - 1;
    let compute = match a.compute {
        Some(c) => c,
        None => {
            probe_compute(6144, 2048, 2.0)
                .map_err(err)?
                .weight_bytes_per_second
        }
    };
    let disk = match a.disk_bw {
        Some(d) => d,
        None => {
            probe_disk(&files, 21_233_664, 3.0)
                .map_err(err)?
                .bytes_per_second
        }
    };
    eprintln!(
        "{} routed layers x {experts} experts of {eb} B; compute {:.2} GB/s, disk {:.2} GB/s",
        layers.len(),
        compute / 1e9,
        disk / 1e9
    );
    let shape = ModelShape {
        name: "glm-5.2 stand-in".into(),
        moe_layers: main_layers,
        experts,
        top_k: 8,
        hidden: 6144,
        moe_inter: 2048,
        expert_bytes: eb,
        dense_bytes: 0,
        mtp: true,
    };
    let input = PlanInput {
        shape,
        ram_bytes: 0,
        reserve_bytes: 0,
        disk_bytes_per_second: disk,
        compute_bytes_per_second: compute,
        history: None,
        seed: a.seed,
        sample_layers: main_layers,
    };
    Ok(Setup {
        container,
        probe_opts,
        layers,
        expert_bytes: eb,
        experts,
        compute,
        input,
    })
}

fn run() -> Result<(), String> {
    let a = parse()?;
    let s = setup(&a)?;
    let hist = Histogram::glm52().resized(s.experts, 8).map_err(err)?;
    for &depth in &a.depths {
        replay_depth(&a, &s, &hist, depth)?;
    }
    Ok(())
}

/// One draft depth: the trace's statistics, then every budget, pin share and prefetch
/// setting replayed (unless `--stats-only`).
fn replay_depth(a: &Args, s: &Setup, hist: &Histogram, depth: usize) -> Result<(), String> {
    let (layers, experts) = (&s.layers, s.experts);
    let (learn, test) = match &a.trace {
        Some(p) => {
            let t = Trace::load(p).map_err(err)?;
            (t.clone(), t)
        }
        None => s.input.traces(hist, depth).map_err(err)?,
    };
    // The replayed trace's statistics against GLM-5.2's figures, then the trace itself.
    let stats = serde_json::json!({ "draft_depth": depth, "trace_stats": TraceStats::of(&test) });
    println!("{stats}");
    if let Some(p) = &a.write_trace {
        test.save(p).map_err(err)?;
    }
    if a.stats_only {
        return Ok(());
    }
    let nl = test.header.layers.len() + test.header.mtp_layer.is_some() as usize;
    let store_layer = |pos: usize| {
        if pos < test.header.layers.len() {
            layers[pos].0
        } else {
            layers[layers.len() - 1].0
        }
    };
    for &share in &a.budgets {
        let predicted = if a.trace.is_none() {
            s.input
                .scenarios(&learn, &test, share, depth)
                .map_err(err)?
        } else {
            Vec::new()
        };
        let slots = (share * (nl * experts) as f64).floor() as usize;
        for &pin_share in &a.pin_shares {
            let pins: Vec<(usize, usize)> =
                top_pins(&history(&learn), (slots as f64 * pin_share) as usize)
                    .into_iter()
                    .map(|(p, x)| (store_layer(p), x))
                    .collect();
            // The store splits what the pins leave evenly over all its routed layers;
            // a trace that routes fewer (no MTP layer at depth 0) gets the share of the
            // unused ones on top, so each replayed layer's LRU matches the plan's.
            let lru_slots = (slots - pins.len()) * layers.len() / nl;
            let budget = (pins.len() + lru_slots) as u64 * s.expert_bytes;
            for &prefetch in &a.prefetch {
                let setting = Setting {
                    depth,
                    share,
                    pin_share,
                    prefetch,
                };
                replay_setting(s, &test, &setting, &pins, budget, &predicted)?;
            }
        }
    }
    Ok(())
}

/// One replayed setting, as its output row names it.
struct Setting {
    depth: usize,
    /// Share of the expert bytes the RAM budget holds.
    share: f64,
    /// Share of that budget pinned.
    pin_share: f64,
    prefetch: bool,
}

/// Replay `test` through a store of `budget` bytes with `pins` pinned, and print the row: the
/// replay's figures beside the prediction for the same setting (when there are any).
fn replay_setting(
    s: &Setup,
    test: &Trace,
    setting: &Setting,
    pins: &[(usize, usize)],
    budget: u64,
    predicted: &[Scenario],
) -> Result<(), String> {
    let (share, pin_share, prefetch) = (setting.share, setting.pin_share, setting.prefetch);
    let opts = StoreOptions {
        ram_budget_bytes: Some(budget),
        pin: PinPolicy::Explicit(pins.to_vec()),
        prefetch: if prefetch {
            PrefetchMode::Real
        } else {
            PrefetchMode::Off
        },
        ..s.probe_opts.clone()
    };
    let store = ExpertStore::open(s.container.clone(), opts).map_err(err)?;
    let r = replay(
        &store,
        test,
        &ReplayOptions {
            compute_bytes_per_second: s.compute,
            dense_seconds_per_row: 0.0,
            prefetch,
        },
    )
    .map_err(err)?;
    let p = predicted
        .iter()
        .find(|s| (s.pin_share - pin_share).abs() < 1e-9 && s.prefetch == prefetch);
    let fingerprint = r.hits_per_call.iter().fold(0xcbf29ce484222325u64, |h, &x| {
        (h ^ x as u64).wrapping_mul(0x100000001b3)
    });
    let row = serde_json::json!({
        "budget_share": share,
        "pin_share": pin_share,
        "prefetch": prefetch,
        "draft_depth": setting.depth,
        "replay": r,
        "hit_sequence_fnv": format!("{fingerprint:016x}"),
        "predicted": p,
        "predicted_over_replay": p.map(|p| p.tokens_per_second / r.tokens_per_second),
    });
    println!("{row}");
    Ok(())
}
