//! The GLM-5.2-calibrated routing workload's statistics and the cache policies replayed on it
//! without I/O (docs/expert-store.md, "The routing workload"):
//!
//! ```text
//! cargo run --release --example routing_policies -- [--calibrate | --sweep | --mtp]
//!     [--layers 16] [--conversations 8] [--topics 4] [--budgets 0.13,0.5]
//! ```
//!
//! `--calibrate` refits the generator's knobs to GLM-5.2's published figures and prints them
//! (minutes); `--sweep` reads knob sets from stdin and prints each one's fit and the
//! original engine's hit rates; `--mtp` prints drafting in the plan's time model. Otherwise it prints the public-sample statistics on the test seeds (7, 8), then
//! per budget the hit rate of each policy on a test trace (seed 1), with pins learned on
//! another trace (seed 101) of the same topic pool.

use colibri::routing::histogram::Histogram;
use colibri::routing::plan::{ModelShape, PlanInput};
use colibri::routing::sim::{self, calls, history, top_pins};
use colibri::routing::workload::{calibrate, measure, GLM52_TARGETS};
use colibri::routing::{Knobs, TraceStats, Workload, WorkloadSpec};

fn arg<T: std::str::FromStr>(args: &[String], flag: &str, default: T) -> T {
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1))
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let hist = Histogram::glm52();
    if args.iter().any(|a| a == "--calibrate") {
        let k = calibrate(&hist, GLM52_TARGETS, Knobs::default(), 8, 2);
        println!("{k:?}");
        println!("{:?}", measure(&hist, k, 8, 2));
        return;
    }
    if args.iter().any(|a| a == "--sweep") {
        sweep(&hist);
        return;
    }
    if args.iter().any(|a| a == "--mtp") {
        mtp(&hist);
        return;
    }
    let knobs = Knobs::default();
    for seed in [7u64, 8] {
        let spec = WorkloadSpec::public_sample(seed, 8, knobs);
        let t = Workload::new(&hist, spec).expect("workload").generate();
        println!("public sample, seed {seed}:\n{}", TraceStats::of(&t));
    }
    let layers: usize = arg(&args, "--layers", 16);
    let conversations: usize = arg(&args, "--conversations", 8);
    let topics: usize = arg(&args, "--topics", 4);
    let budgets: String = arg(&args, "--budgets", "0.13,0.5".to_string());
    let gen = |seed: u64| {
        let spec = WorkloadSpec {
            seed,
            layers,
            conversations,
            topics,
            prompt_tokens: 0,
            decode_tokens: 256,
            knobs,
            ..WorkloadSpec::default()
        };
        Workload::new(&hist, spec).expect("workload").generate()
    };
    let (learn, test) = (gen(101), gen(1));
    let c = calls(&test);
    let n = hist.experts;
    let h = history(&learn);
    println!(
        "policies: {layers} layers, {conversations} conversations x 256 decode tokens, topic pool {topics}"
    );
    for b in budgets.split(',').filter_map(|x| x.parse::<f64>().ok()) {
        let slots = (b * (layers * n) as f64).floor() as usize;
        let per = vec![slots / layers; layers];
        let row = |name: &str, r: sim::SimResult| {
            println!("  budget {b:.2}  {name:<44} {:.3}", r.hit_rate());
        };
        row(
            "original, fresh (LRU only)",
            sim::original(&c, layers, n, &[], slots / layers),
        );
        for share in [0.5, 0.75, 0.9] {
            let pins = top_pins(&h, (slots as f64 * share) as usize);
            let lru = (slots - pins.len()) / layers;
            row(
                &format!("original, learned pins {share}"),
                sim::original(&c, layers, n, &pins, lru),
            );
        }
        let prior: Vec<Vec<f64>> = h
            .iter()
            .map(|v| {
                let t = v.iter().sum::<u64>().max(1) as f64;
                v.iter().map(|&x| x as f64 / t * 8.0).collect()
            })
            .collect();
        // A budget split by each layer's spread in the history (effective experts, e^entropy,
        // raised to `pow`): flat layers get more slots than peaked ones.
        let split = |pow: f64| -> Vec<usize> {
            let eff: Vec<f64> = h
                .iter()
                .take(layers)
                .map(|v| {
                    let t = v.iter().sum::<u64>().max(1) as f64;
                    let ent: f64 = v
                        .iter()
                        .filter(|&&x| x > 0)
                        .map(|&x| -(x as f64 / t) * (x as f64 / t).ln())
                        .sum();
                    ent.exp().powf(pow)
                })
                .collect();
            let tot: f64 = eff.iter().sum();
            eff.iter()
                .map(|e| (e / tot * slots as f64).floor() as usize)
                .collect()
        };
        for pow in [1.0, 2.0, -1.0] {
            let p = sim::Scored {
                prior: 0.0,
                half_life: 32.0,
                recent: 1,
                bonus: 1.0,
                affinity: 0.0,
            };
            row(
                &format!("scored, budget split by layer spread^{pow}"),
                sim::scored(&c, layers, n, &prior, None, &split(pow), p),
            );
        }
        let trans = sim::transitions(&calls(&learn), layers, n);
        for (w, hl, rec, af) in [
            (1.0, 32.0, 1u64, 0.0),
            (0.0, 32.0, 1, 0.0),
            (2.0, 32.0, 1, 0.0),
            (1.0, 16.0, 1, 0.0),
            (1.0, 32.0, 0, 0.0),
            (1.0, 32.0, 1, 1.0),
            (1.0, 32.0, 1, 3.0),
            (1.0, 32.0, 0, 3.0),
        ] {
            let p = sim::Scored {
                prior: w,
                half_life: hl,
                recent: rec,
                bonus: 1.0,
                affinity: af,
            };
            row(
                &format!("scored prior {w} hl {hl} recent {rec} affinity {af}"),
                sim::scored(&c, layers, n, &prior, Some(&trans), &per, p),
            );
        }
        for (w, hl, af) in [
            (1.0, 16.0, 0.0),
            (1.0, 32.0, 0.0),
            (0.5, 16.0, 0.0),
            (1.0, 16.0, 1.0),
            (1.0, 16.0, 3.0),
            (1.0, 32.0, 3.0),
            (0.5, 16.0, 3.0),
        ] {
            let p = sim::Pooled {
                prior: w,
                half_life: hl,
                affinity: af,
            };
            row(
                &format!("pooled prior {w} hl {hl} affinity {af}"),
                sim::pooled(&c, layers, n, &prior, Some(&trans), slots, p),
            );
        }
        row("belady per layer", sim::belady(&c, layers, n, &per, None));
        row(
            "belady global",
            sim::belady(&c, layers, n, &per, Some(slots)),
        );
    }
}

/// One line per knob set read from stdin (`stickiness topic noise coactivation persistence
/// flatten [topics]`): the public-sample statistics (the fitting seeds 1, 2) and the original engine's
/// fresh and learned hit rates at 13% on 16 layers.
fn sweep(hist: &Histogram) {
    use std::io::BufRead;
    for line in std::io::stdin().lock().lines().map_while(Result::ok) {
        let v: Vec<f64> = line
            .split_whitespace()
            .filter_map(|x| x.parse().ok())
            .collect();
        if v.len() < 6 {
            continue;
        }
        let knobs = Knobs {
            stickiness: v[0],
            topic: v[1],
            lookahead_noise: v[2],
            coactivation: v[3],
            persistence: v[4],
            flatten: v[5],
        };
        let topics = v.get(6).map_or(4, |&x| x as usize);
        let mut acc = [0.0f64; 6];
        for seed in [1u64, 2] {
            let spec = WorkloadSpec::public_sample(seed, 8, knobs);
            let Ok(w) = Workload::new(hist, spec) else {
                continue;
            };
            let s = TraceStats::of(&w.generate());
            for (a, x) in acc.iter_mut().zip([
                s.consecutive_overlap,
                s.lookahead_recall,
                s.half_share,
                s.top10_share,
                s.gini,
                s.pair_lift,
            ]) {
                *a += x / 2.0;
            }
        }
        let gen = |seed: u64| {
            let spec = WorkloadSpec {
                seed,
                layers: 16,
                conversations: 8,
                topics,
                prompt_tokens: 0,
                decode_tokens: 256,
                knobs,
                ..WorkloadSpec::default()
            };
            Workload::new(hist, spec).map(|w| w.generate())
        };
        let (Ok(learn), Ok(test)) = (gen(101), gen(1)) else {
            continue;
        };
        let c = calls(&test);
        let slots = (0.13 * (16 * 256) as f64) as usize;
        let fresh = sim::original(&c, 16, 256, &[], slots / 16).hit_rate();
        let pins = top_pins(&history(&learn), slots / 2);
        let learned = sim::original(&c, 16, 256, &pins, (slots - pins.len()) / 16).hit_rate();
        let per = vec![slots / 16; 16];
        let bel = sim::belady(&c, 16, 256, &per, None).hit_rate();
        println!(
            "{line} | ov {:.3} rec {:.3} half {:.3} top10 {:.3} gini {:.3} lift {:.2} | fresh {fresh:.3} learned {learned:.3} belady {bel:.3}",
            acc[0], acc[1], acc[2], acc[3], acc[4], acc[5]
        );
    }
}

/// MTP drafting in the plan's model on GLM-5.2's shape (8 layers simulated, pins at half the
/// budget, prefetch off, disk 2.0 GB/s, int4 compute 19.4 GB/s): per budget share and draft
/// depth, tokens per forward, expert bytes read per generated token and predicted tok/s.
fn mtp(hist: &Histogram) {
    let Ok(shape) = ModelShape::known("glm-5.2") else {
        return;
    };
    let input = PlanInput {
        shape,
        ram_bytes: u64::MAX / 4,
        reserve_bytes: 0,
        disk_bytes_per_second: 2.0e9,
        compute_bytes_per_second: 19.4e9,
        history: None,
        seed: 1,
        sample_layers: 8,
    };
    for share in [0.0, 0.13, 0.5, 1.0] {
        let mut base = None;
        for depth in 0..=3usize {
            let Ok((learn, test)) = input.traces(hist, depth) else {
                continue;
            };
            let Ok(sc) = input.scenarios(&learn, &test, share, depth) else {
                continue;
            };
            let Some(x) = sc.iter().find(|x| x.pin_share == 0.5 && !x.prefetch) else {
                continue;
            };
            let b0 = *base.get_or_insert(x.bytes_per_token);
            println!(
                "budget {share:.2} depth {depth}: tokens/forward {:.2}  MB/token {:.0} ({:+.0}% vs depth 0)  hit {:.3}  tok/s {:.3}",
                x.tokens_per_forward,
                x.bytes_per_token / 1e6,
                100.0 * (x.bytes_per_token / b0.max(1.0) - 1.0),
                x.hit_rate,
                x.tokens_per_second
            );
        }
    }
}
