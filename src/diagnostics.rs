//! The engine's warnings (a routing history that cannot be saved, a filesystem that refuses
//! O_DIRECT...), each given once per key per process. Where they go is the caller's choice:
//! plain Rust (tests, benches, tools) prints them to stderr; the Python module installs a
//! sink ([`set_sink`]) that hands them to Python's `logging` (docs/architecture.md).

use std::collections::HashSet;
use std::sync::{Mutex, OnceLock};

static SINK: OnceLock<fn(&str)> = OnceLock::new();

/// Send every later warning to `sink` instead of stderr (the first call wins).
pub fn set_sink(sink: fn(&str)) {
    let _ = SINK.set(sink);
}

/// Give the warning `msg` once per `key` per process.
pub fn warn_once(key: &str, msg: &str) {
    static SEEN: OnceLock<Mutex<HashSet<String>>> = OnceLock::new();
    let first = SEEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(key.to_owned());
    if first {
        match SINK.get() {
            Some(sink) => sink(msg),
            None => eprintln!("colibri: warning: {msg}"),
        }
    }
}
