//! colibri: run DeepSeek-V3-family Mixture-of-Experts models on one machine.
//!
//! Data flows one way: `container` (files) → `experts` (store, cache, prefetch) → `model`
//! (forward pass) and `decode` (sampling, speculative decoding, model-independent) →
//! `engine` (composes them: options, sessions, saved contexts, stats) → `python`
//! (bindings that only convert types). Only `python` knows about Python.

pub mod carried;
pub mod config;
pub mod container;
pub mod convert;
pub mod cpu;
pub mod decode;
pub mod diagnostics;
pub mod engine;
pub mod error;
pub mod experts;
pub mod model;
pub mod quant;
pub mod routing;

mod python;

pub use error::{Error, Result};

/// The crate version; the Python package reports the same string as `colibri.__version__`.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
