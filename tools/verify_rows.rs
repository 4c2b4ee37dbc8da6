//! What a verify forward of S rows costs against a one-row decode step, on any container held
//! in RAM: after a context of C tokens, a forward of S new rows (S = 1, 2, 4, 8: a decode
//! step, and verifies of 1, 3 and 7 drafts), rolled back and repeated; the median time per S
//! and its ratio to S = 1, beside the routed experts the forward read (the union over its
//! rows, per MoE layer, against one row's top-k), which bounds the ratio from below when
//! decode streams its weights at the memory's bandwidth.
//!
//! ```text
//! cargo run --release --example verify_rows -- --container DIR \
//!     [--decode int8|exact] [--threads 2] [--context 8,512] [--repeats 15] [--seed 1]
//! ```
//!
//! The rows' tokens are random ids; with a random-weight model their routing is independent
//! from row to row (a trained model's drafts share more of their experts).

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use colibri::container::Container;
use colibri::engine::EngineOptions;
use colibri::model::{ForwardKind, Model, ModelOptions, RoutedRows, RoutingSink, Sequence};
use colibri::quant::kernels::Arithmetic;

fn main() {
    if let Err(e) = run() {
        eprintln!("verify_rows: {e}");
        std::process::exit(2);
    }
}

/// The routed experts of the last decode forward: the union per MoE layer, and one row's.
#[derive(Default)]
struct LastUnion(Mutex<(usize, usize)>);

impl RoutingSink for LastUnion {
    fn forward(&self, kind: ForwardKind, rows: &[RoutedRows]) {
        if kind != ForwardKind::Decode {
            return;
        }
        let Some(seq) = rows.first() else { return };
        let layers = seq.experts.first().map_or(0, Vec::len);
        let (mut union, mut one) = (0, 0);
        for l in 0..layers {
            let mut ids: Vec<u16> = seq.experts.iter().flat_map(|r| r[l].clone()).collect();
            one += seq.experts[0][l].len();
            ids.sort_unstable();
            ids.dedup();
            union += ids.len();
        }
        if let Ok(mut last) = self.0.lock() {
            *last = (union, one);
        }
    }
    fn truncated(&self, _sequence: u64, _len: usize) {}
}

fn run() -> Result<(), String> {
    let mut dir: Option<PathBuf> = None;
    let mut decode = EngineOptions::default_decode();
    let mut threads = 2usize;
    let mut contexts = vec![8usize, 512];
    let (mut repeats, mut seed) = (15usize, 1u64);
    let mut args = std::env::args().skip(1);
    let value = |v: Option<String>, flag: &str| v.ok_or(format!("{flag} needs a value"));
    while let Some(a) = args.next() {
        match a.as_str() {
            "--container" => dir = Some(PathBuf::from(value(args.next(), &a)?)),
            "--decode" => {
                decode = match value(args.next(), &a)?.as_str() {
                    "int8" => Arithmetic::Int8,
                    "exact" => Arithmetic::Exact,
                    other => return Err(format!("--decode: int8 or exact, not {other:?}")),
                }
            }
            "--threads" => threads = parse(value(args.next(), &a)?, &a)?,
            "--context" => {
                contexts = value(args.next(), &a)?
                    .split(',')
                    .map(|c| parse(c.to_string(), "--context"))
                    .collect::<Result<_, _>>()?
            }
            "--repeats" => repeats = parse(value(args.next(), &a)?, &a)?,
            "--seed" => seed = parse(value(args.next(), &a)?, &a)? as u64,
            other => return Err(format!("unknown argument {other:?}")),
        }
    }
    let dir = dir.ok_or("--container DIR is required")?;
    if repeats == 0 {
        return Err("--repeats must be at least 1".into());
    }
    let container = Arc::new(Container::open(&dir).map_err(|e| e.to_string())?);
    let opts = ModelOptions {
        threads,
        load_mtp: false,
        decode_arithmetic: decode,
        prefill_arithmetic: decode,
        ..ModelOptions::default()
    };
    let t = Instant::now();
    let model = Model::load(container, &opts).map_err(|e| e.to_string())?;
    eprintln!(
        "loaded {} in {:.1} s",
        dir.display(),
        t.elapsed().as_secs_f64()
    );
    let sink = Arc::new(LastUnion::default());
    model.set_routing_sink(Some(sink.clone()));
    let vocab = model.config().vocab_size as u64;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut token = move || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        (x % vocab) as u32
    };
    println!("decode {decode:?}, {threads} threads, {repeats} repeats per cell (median)");
    println!("| context | rows | ms | × 1 row | routed experts read × 1 row |");
    println!("|---|---|---|---|---|");
    for &context in &contexts {
        let mut seq = Sequence::owned(&model);
        let prompt: Vec<u32> = (0..context.max(1)).map(|_| token()).collect();
        seq.prefill(&prompt, 0, false).map_err(|e| e.to_string())?;
        let mut one_row = None;
        for rows in [1usize, 2, 4, 8] {
            let (mut times, mut unions) = (Vec::new(), Vec::new());
            // One unmeasured forward first (caches and pages warm).
            for r in 0..=repeats {
                let tokens: Vec<u32> = (0..rows).map(|_| token()).collect();
                let len = seq.kv_len();
                let t = Instant::now();
                seq.step(&tokens, len, true).map_err(|e| e.to_string())?;
                let dt = t.elapsed().as_secs_f64();
                seq.truncate(len);
                if r > 0 {
                    times.push(dt);
                    let (union, one) = *sink.0.lock().map_err(|e| e.to_string())?;
                    unions.push(union as f64 / one.max(1) as f64);
                }
            }
            let ms = median(&mut times) * 1e3;
            let base = *one_row.get_or_insert(ms);
            println!(
                "| {context} | {rows} | {ms:.2} | {:.2} | {:.2} |",
                ms / base,
                median(&mut unions)
            );
        }
    }
    Ok(())
}

fn parse(v: String, flag: &str) -> Result<usize, String> {
    v.parse().map_err(|e| format!("{flag}: {e}"))
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}
