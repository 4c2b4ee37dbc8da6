//! The engine's `trace_routing` option: every forward's routing written as a routing trace
//! (`routing::trace`'s JSON-lines format, docs/expert-store.md), which `colibri plan`'s
//! replay and `tools/replay_routing.rs` read like a generated one.
//!
//! Rows are written as the forwards happen, each forward's once it is complete: a verify's
//! draft rows wait for the decode loop's roll-back, which says which were accepted (the
//! drafts kept). A prompt forward starts a new conversation (`conv`) for its sequence. An
//! MTP forward's rows are `mtp` rows, one per row, as the trace format counts them (a long
//! absorb through the MTP layer thus replays as one call per row: an overestimate of its
//! reads). A write that fails stops the trace with one warning; generation goes on.

use std::collections::HashMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::diagnostics::warn_once;
use crate::error::{Error, Result};
use crate::model::{ForwardKind, RoutedRows, RoutingSink};
use crate::routing::trace::{Row, RowKind, TraceHeader};

/// Writes the routing trace of every forward it is told of ([`RoutingSink`]).
pub struct RoutingTraceWriter {
    path: PathBuf,
    state: Mutex<State>,
}

struct State {
    /// `None` once a write failed.
    out: Option<BufWriter<File>>,
    next_forward: u64,
    next_conv: u32,
    /// Each sequence's current conversation.
    conv: HashMap<u64, u32>,
    /// The latest forward's rows, until its drafts are resolved.
    held: Vec<Row>,
    /// (index into `held`, sequence, cache position) of each draft row not yet resolved.
    pending: Vec<(usize, u64, usize)>,
}

impl RoutingTraceWriter {
    /// Create (or replace) the trace file at `path` and write its header.
    pub fn create(path: &Path, header: &TraceHeader) -> Result<Self> {
        let io = |e| Error::io(path.to_path_buf(), e);
        let mut out = BufWriter::new(File::create(path).map_err(io)?);
        serde_json::to_writer(&mut out, header).map_err(|e| io(e.into()))?;
        out.write_all(b"\n").map_err(io)?;
        out.flush().map_err(io)?;
        Ok(RoutingTraceWriter {
            path: path.to_path_buf(),
            state: Mutex::new(State {
                out: Some(out),
                next_forward: 0,
                next_conv: 0,
                conv: HashMap::new(),
                held: Vec::new(),
                pending: Vec::new(),
            }),
        })
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Write what is held (drafts still pending stay without `accepted`).
    pub fn flush(&self) {
        let mut state = self.lock();
        state.write_held(&self.path);
    }
}

impl State {
    fn write_held(&mut self, path: &Path) {
        self.pending.clear();
        let rows = std::mem::take(&mut self.held);
        let Some(out) = self.out.as_mut() else {
            return;
        };
        let written = rows
            .iter()
            .try_for_each(|row| {
                serde_json::to_writer(&mut *out, row)?;
                out.write_all(b"\n")
            })
            .and_then(|()| out.flush());
        if let Err(e) = written {
            warn_once(
                "routing-trace-write",
                &format!(
                    "the routing trace {} could not be written ({e}); it stops here",
                    path.display()
                ),
            );
            self.out = None;
        }
    }

    fn add(&mut self, kind: ForwardKind, seqs: &[RoutedRows]) {
        let forward = self.next_forward;
        self.next_forward += 1;
        for seq in seqs {
            if kind == ForwardKind::Prompt || !self.conv.contains_key(&seq.sequence) {
                self.conv.insert(seq.sequence, self.next_conv);
                self.next_conv += 1;
            }
            let conv = self.conv[&seq.sequence];
            for (i, experts) in seq.experts.iter().enumerate() {
                let kind = match kind {
                    ForwardKind::Prompt => RowKind::Prompt,
                    ForwardKind::Mtp => RowKind::Mtp,
                    ForwardKind::Decode if i == 0 => RowKind::Decode,
                    ForwardKind::Decode => {
                        self.pending
                            .push((self.held.len(), seq.sequence, seq.start + i));
                        RowKind::Draft
                    }
                };
                self.held.push(Row {
                    forward,
                    conv,
                    kind,
                    experts: experts.clone(),
                    lookahead: None,
                    accepted: None,
                });
            }
        }
    }
}

impl RoutingSink for RoutingTraceWriter {
    fn forward(&self, kind: ForwardKind, seqs: &[RoutedRows]) {
        let mut state = self.lock();
        if state.out.is_none() {
            return;
        }
        // A forward whose drafts were never resolved (its lane was dropped) goes out as is.
        state.write_held(&self.path);
        state.add(kind, seqs);
        if state.pending.is_empty() {
            state.write_held(&self.path);
        }
    }

    fn truncated(&self, sequence: u64, len: usize) {
        let mut state = self.lock();
        let State { held, pending, .. } = &mut *state;
        pending.retain(|&(row, seq, position)| {
            if seq != sequence {
                return true;
            }
            held[row].accepted = Some(position < len);
            false
        });
        if state.pending.is_empty() && !state.held.is_empty() {
            state.write_held(&self.path);
        }
    }
}

impl Drop for RoutingTraceWriter {
    fn drop(&mut self) {
        self.flush();
    }
}
