use super::options::{engine_options, EngineArgs};
use crate::engine::EngineOptions;

/// `Engine(path)` with no options is `EngineOptions::default()`: the arguments below are
/// the `#[pyo3(signature)]`'s defaults (tests/test_api.py holds `colibri.Model`'s to the
/// same signature).
#[test]
fn an_engine_opened_with_no_options_gets_the_default_options() {
    let no_options = EngineArgs {
        threads: 0,
        io: "auto",
        ram_budget: None,
        prefetch: "auto",
        prefetch_top_k: 0,
        mtp: true,
        usage_file: true,
        cache_dir: None,
        pin: "auto",
        resident_layers: None,
        max_context: None,
        idle_session_bytes: None,
        spill_dir: None,
        prefill: "auto",
        decode: "auto",
        trace_routing: None,
        experts_per_token: None,
    };
    let got = engine_options(&no_options).unwrap();
    assert_eq!(
        format!("{got:?}"),
        format!("{:?}", EngineOptions::default())
    );
    let other = engine_options(&EngineArgs {
        mtp: false,
        ..no_options
    })
    .unwrap();
    assert_ne!(
        format!("{other:?}"),
        format!("{:?}", EngineOptions::default())
    );
}
