//! Options at the boundary: `Engine(...)`'s keyword arguments as [`EngineOptions`], and a
//! request dict as the engine's `GenerateOptions` (every value checked, its grammar
//! compiled against the vocabulary).

use std::path::PathBuf;

use pyo3::prelude::*;
use pyo3::types::PyDict;

use super::PyEngine;
use crate::decode::{Grammar, GrammarSpec};
use crate::engine::EngineOptions;
use crate::error::Error;
use crate::python::{request, to_py_err};

/// `Engine(...)`'s keyword arguments (its `#[pyo3(signature)]` holds their defaults).
pub(super) struct EngineArgs<'a> {
    pub(super) threads: usize,
    pub(super) io: &'a str,
    pub(super) ram_budget: Option<u64>,
    pub(super) prefetch: &'a str,
    pub(super) prefetch_top_k: usize,
    pub(super) mtp: bool,
    pub(super) usage_file: bool,
    pub(super) cache_dir: Option<PathBuf>,
    pub(super) pin: &'a str,
    pub(super) resident_layers: Option<Vec<usize>>,
    pub(super) max_context: Option<usize>,
    pub(super) idle_session_bytes: Option<u64>,
    pub(super) spill_dir: Option<PathBuf>,
    pub(super) prefill: &'a str,
    pub(super) decode: &'a str,
    pub(super) trace_routing: Option<PathBuf>,
    pub(super) experts_per_token: Option<usize>,
}

/// The engine's options of `Engine(...)`'s arguments ("auto" and 0 mean the engine decides).
pub(super) fn engine_options(a: &EngineArgs<'_>) -> crate::Result<EngineOptions> {
    Ok(EngineOptions {
        threads: a.threads,
        io: EngineOptions::parse_io(a.io)?,
        ram_budget: a.ram_budget,
        prefetch: EngineOptions::parse_prefetch(a.prefetch)?,
        prefetch_top_k: (a.prefetch_top_k > 0).then_some(a.prefetch_top_k),
        experts_per_token: a.experts_per_token,
        load_mtp: a.mtp,
        usage_file: a.usage_file,
        cache_dir: a.cache_dir.clone(),
        pin: EngineOptions::parse_pin(a.pin)?,
        resident_layers: a.resident_layers.clone().unwrap_or_default(),
        max_context: a.max_context,
        idle_session_bytes: a.idle_session_bytes,
        spill_dir: a.spill_dir.clone(),
        trace_routing: a.trace_routing.clone(),
        prefill: EngineOptions::parse_prefill(a.prefill)?,
        decode: EngineOptions::parse_decode(a.decode)?,
        load_progress: None,
    })
}

impl PyEngine {
    /// A structured-output constraint, `(kind, text)`, compiled against the vocabulary.
    pub(super) fn compile_grammar(&self, kind: &str, text: &str) -> crate::Result<Grammar> {
        let spec = GrammarSpec::parse(kind, text)?;
        let vocabulary = self.vocabulary.get().ok_or_else(|| {
            Error::invalid(
                spec.param(),
                "the engine has no vocabulary: call load_vocabulary first",
            )
        })?;
        vocabulary.compile(&spec)
    }

    /// The engine's options for a request (the engine's EOS ids and context limit where
    /// the request sets none), every value checked.
    pub(super) fn options(
        &self,
        r: &crate::decode::request::GenerateRequest,
    ) -> PyResult<crate::decode::GenerateOptions> {
        r.options(self.engine.default_generate_options(), |kind, text| {
            self.compile_grammar(kind, text)
        })
        .map_err(to_py_err)
    }

    /// A batch request dict: its prompt (`"ids"`) and its options.
    pub(super) fn batch_request(
        &self,
        r: &Bound<'_, PyDict>,
    ) -> PyResult<(Vec<u32>, crate::decode::GenerateOptions)> {
        let (request, ids) = request::from_dict(r, true)?;
        let ids =
            ids.ok_or_else(|| to_py_err(Error::invalid("requests", "a request has no 'ids'")))?;
        Ok((ids, self.options(&request)?))
    }
}
