//! The engine on real models (the embedded tiny model, the GLM DSA fixture): sessions reuse
//! their prefix with outputs identical to a fresh prefill, saved contexts round-trip and
//! refuse damaged or foreign files with a typed error, idle sessions are evicted to disk
//! and come back intact.

mod batch;
mod routing_trace;
mod saved;
mod spill;

use std::os::unix::fs::FileTypeExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

use super::*;
use crate::decode::{DraftDepth, DraftSource, SamplingParams};
use crate::quant::kernels::Arithmetic;

fn model_dir(rel: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(rel)
}

fn open(rel: &str, spill: &Path, idle: Option<u64>) -> Engine {
    open_in(rel, spill, idle, EngineOptions::default_decode())
}

/// [`open`] with `arith` for prompts and decode alike. These tests compare a reused prefix, a
/// batch lane and a restored context with a fresh prefill bit for bit, which one arithmetic for
/// both gives (each row computed from its own tokens alone); [`open`] takes the default decode
/// arithmetic (int8 where its decode kernel runs), so the defaults are what is tested.
fn open_in(rel: &str, spill: &Path, idle: Option<u64>, arith: Arithmetic) -> Engine {
    let opts = EngineOptions {
        usage_file: false,
        threads: 2,
        idle_session_bytes: idle,
        spill_dir: Some(spill.to_path_buf()),
        decode: Some(arith),
        prefill: Some(arith),
        ..EngineOptions::default()
    };
    Engine::open(&model_dir(rel), &opts).expect("the model opens")
}

fn options(e: &Engine, sampled: bool) -> GenerateOptions {
    let mut o = e.default_generate_options();
    o.max_new_tokens = 12;
    o.draft = DraftSource::Mtp;
    o.stop_tokens.clear();
    if sampled {
        o.sampling = SamplingParams {
            temperature: 0.9,
            top_k: 20,
            top_p: 0.95,
            seed: Some(7),
            ..SamplingParams::default()
        };
    }
    o
}

fn run(e: &Engine, s: Option<&Session>, prompt: &[u32], sampled: bool) -> Completion {
    e.generate(
        s,
        prompt,
        &options(e, sampled),
        &mut |_| true,
        &AtomicBool::new(false),
    )
    .expect("generation runs")
}

const PROMPT: [u32; 9] = [1, 345, 67, 890, 12, 3456, 78, 901, 23];

/// Turn 2's prompt: turn 1's prompt and output, then new tokens.
fn follow_up(first: &Completion) -> Vec<u32> {
    let mut p = PROMPT.to_vec();
    p.extend(&first.tokens);
    p.extend([44, 555, 6]);
    p
}

#[test]
fn the_load_reports_its_progress_up_to_every_resident_byte_and_can_be_stopped() {
    let calls: Arc<std::sync::Mutex<Vec<(u64, u64)>>> = Arc::default();
    let seen = calls.clone();
    let opts = EngineOptions {
        usage_file: false,
        threads: 2,
        load_progress: Some(LoadProgress(Arc::new(move |done, total| {
            seen.lock().unwrap().push((done, total));
            true
        }))),
        ..EngineOptions::default()
    };
    let dir = model_dir("python/colibri/models/tiny");
    let e = Engine::open(&dir, &opts).expect("the model opens");
    let calls = calls.lock().unwrap().clone();
    assert!(calls.len() > 10, "one call per tensor: {}", calls.len());
    assert!(
        calls.windows(2).all(|w| w[0].0 <= w[1].0),
        "done only grows"
    );
    assert!(calls.iter().all(|&(d, t)| d <= t));
    let (done, total) = *calls.last().unwrap();
    assert_eq!(done, total, "the last call ends the bar full");
    // Every byte of every tensor the model keeps resident: all but the routed experts and
    // the MTP layer's copies of the embedding and LM head (the head uses the main model's).
    let container = Container::open(&dir).unwrap();
    let loaded: u64 = container
        .names()
        .filter(|n| {
            let r = crate::container::names::classify(container.config(), n);
            use crate::container::names::Role;
            r.role != Role::RoutedExpert
                && !(matches!(r.role, Role::Embed | Role::LmHead) && r.layer.is_some())
        })
        .map(|n| container.info(n).unwrap().nbytes() as u64)
        .sum();
    assert_eq!(done, loaded);
    assert!(
        loaded < container.resident_bytes(),
        "the tiny model has an MTP layer"
    );
    drop(e);
    // A callback returning false stops the open.
    let stopping = EngineOptions {
        usage_file: false,
        load_progress: Some(LoadProgress(Arc::new(|done, _| done == 0))),
        ..EngineOptions::default()
    };
    assert!(matches!(
        Engine::open(&dir, &stopping),
        Err(Error::Cancelled)
    ));
}
