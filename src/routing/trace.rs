//! A routing trace: per row (token position) of each forward, its kind and each MoE layer's
//! routed experts. The replay ([`super::sim`], [`super::replay`]) reads it the same way
//! whether it came from the workload generator, from the engine (`trace_routing`), or from
//! another tool.
//!
//! File format (JSON lines, documented in docs/expert-store.md): a header object, then one
//! object per row, in order:
//!
//! ```text
//! {"format":"colibri-routing-trace","version":1,"layers":[3,4,...],"experts":256,"top_k":8,"mtp_layer":78}
//! {"forward":0,"conv":0,"kind":"prompt","experts":[[..8 ids..],[..],...]}
//! {"forward":9,"conv":0,"kind":"decode","experts":[[...],...],"lookahead":[[...],...]}
//! {"forward":9,"conv":0,"kind":"draft","experts":[[...],...]}
//! {"forward":9,"conv":0,"kind":"mtp","experts":[[...]]}
//! ```
//!
//! Rows of one forward share `forward` and are consecutive: each layer reads the union of
//! their experts once. `prompt` rows are prefill; `decode` is a forward's first row (the
//! token it generates from); `draft` rows are the drafts a verify checks (each with
//! `"accepted": true|false`); `mtp` rows are the MTP layer's own calls (one per draft step,
//! `experts` has one list, for `mtp_layer`). `lookahead` (optional, per layer) is what the
//! router lookahead predicted for that layer from the layer before. `conv` numbers
//! conversations (a new prompt); optional, 0 when absent.

use std::io::{BufRead, Write};
use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

pub const TRACE_FORMAT: &str = "colibri-routing-trace";
pub const TRACE_VERSION: u32 = 1;

/// What a row is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum RowKind {
    Prompt,
    Decode,
    Draft,
    Mtp,
}

/// One row of a trace.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Row {
    pub forward: u64,
    #[serde(default)]
    pub conv: u32,
    pub kind: RowKind,
    /// Routed expert ids per MoE layer (in the header's `layers` order); one list, for the
    /// MTP layer, on `mtp` rows.
    pub experts: Vec<Vec<u16>>,
    /// The router lookahead's prediction per layer (same shape), where one was made.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub lookahead: Option<Vec<Vec<u16>>>,
    /// Draft rows: whether the verify accepted this draft.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub accepted: Option<bool>,
}

/// The header line.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TraceHeader {
    pub format: String,
    pub version: u32,
    /// The model's MoE layer indices, in the order of each row's `experts`.
    pub layers: Vec<usize>,
    /// Routed experts per layer.
    pub experts: usize,
    pub top_k: usize,
    /// The MTP layer's index, when `mtp` rows are present.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub mtp_layer: Option<usize>,
}

/// A whole trace in memory.
#[derive(Debug, Clone, PartialEq)]
pub struct Trace {
    pub header: TraceHeader,
    pub rows: Vec<Row>,
}

/// One forward: a range of consecutive rows sharing `forward`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Forward {
    pub start: usize,
    pub end: usize,
}

impl TraceHeader {
    /// The header of this format's version for a model of these MoE layers, routed experts
    /// per layer, top-k and (when traced) MTP layer.
    pub fn new(layers: Vec<usize>, experts: usize, top_k: usize, mtp_layer: Option<usize>) -> Self {
        TraceHeader {
            format: TRACE_FORMAT.into(),
            version: TRACE_VERSION,
            layers,
            experts,
            top_k,
            mtp_layer,
        }
    }
}

impl Trace {
    pub fn new(layers: Vec<usize>, experts: usize, top_k: usize, mtp_layer: Option<usize>) -> Self {
        Trace {
            header: TraceHeader::new(layers, experts, top_k, mtp_layer),
            rows: Vec::new(),
        }
    }

    /// The forwards, in order.
    pub fn forwards(&self) -> Vec<Forward> {
        let mut out = Vec::new();
        let mut start = 0;
        for i in 1..=self.rows.len() {
            if i == self.rows.len() || self.rows[i].forward != self.rows[start].forward {
                out.push(Forward { start, end: i });
                start = i;
            }
        }
        out
    }

    /// Tokens the trace generates: decode rows plus accepted drafts.
    pub fn generated_tokens(&self) -> u64 {
        self.rows
            .iter()
            .filter(|r| r.kind == RowKind::Decode || r.accepted == Some(true))
            .count() as u64
    }

    /// Check the trace's shape: every id in range, every row the header's layer count (one
    /// layer for `mtp` rows), forwards consecutive.
    pub fn validate(&self) -> Result<()> {
        let h = &self.header;
        let bad = |i: usize, msg: String| Error::invalid("trace", format!("row {}: {msg}", i + 2));
        if h.format != TRACE_FORMAT || h.version != TRACE_VERSION {
            return Err(Error::invalid(
                "trace",
                format!(
                    "header says format '{}' version {}, expected '{TRACE_FORMAT}' version {TRACE_VERSION}",
                    h.format, h.version
                ),
            ));
        }
        if h.layers.is_empty() || h.experts == 0 || h.experts > u16::MAX as usize + 1 {
            return Err(Error::invalid(
                "trace",
                "the header needs at least one layer and 1..=65536 experts",
            ));
        }
        let mut seen = std::collections::HashSet::new();
        let mut last: Option<u64> = None;
        for (i, r) in self.rows.iter().enumerate() {
            if last != Some(r.forward) {
                if !seen.insert(r.forward) {
                    return Err(bad(i, format!("forward {} is not consecutive", r.forward)));
                }
                last = Some(r.forward);
            }
            let want = match r.kind {
                RowKind::Mtp if h.mtp_layer.is_none() => {
                    return Err(bad(i, "an mtp row, but the header has no mtp_layer".into()))
                }
                RowKind::Mtp => 1,
                _ => h.layers.len(),
            };
            let lists = std::iter::once(&r.experts).chain(r.lookahead.as_ref());
            for lists in lists {
                if lists.len() != want {
                    return Err(bad(
                        i,
                        format!("{} expert lists, expected {want}", lists.len()),
                    ));
                }
                if let Some(&id) = lists.iter().flatten().find(|&&e| e as usize >= h.experts) {
                    return Err(bad(
                        i,
                        format!("expert {id} is out of range (0..{})", h.experts),
                    ));
                }
            }
        }
        Ok(())
    }

    /// Write the trace as JSON lines.
    pub fn write(&self, out: &mut dyn Write) -> std::io::Result<()> {
        serde_json::to_writer(&mut *out, &self.header)?;
        out.write_all(b"\n")?;
        for r in &self.rows {
            serde_json::to_writer(&mut *out, r)?;
            out.write_all(b"\n")?;
        }
        out.flush()
    }

    /// Write the trace to `path` (atomically: a temporary file renamed over it).
    pub fn save(&self, path: &Path) -> Result<()> {
        let tmp = path.with_extension(format!("tmp.{}", std::process::id()));
        let io = |e| Error::io(path.to_path_buf(), e);
        {
            let f = std::fs::File::create(&tmp).map_err(io)?;
            let mut w = std::io::BufWriter::new(f);
            self.write(&mut w).map_err(io)?;
        }
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// Read a trace written in the format above.
    pub fn read(input: &mut dyn BufRead, name: &str) -> Result<Self> {
        let mut lines = input.lines().enumerate();
        let parse_err = |line: usize, e: String| {
            Error::invalid("trace", format!("{name}, line {}: {e}", line + 1))
        };
        let header: TraceHeader = loop {
            match lines.next() {
                None => return Err(Error::invalid("trace", format!("{name} is empty"))),
                Some((i, l)) => {
                    let l = l.map_err(|e| parse_err(i, e.to_string()))?;
                    if l.trim().is_empty() {
                        continue;
                    }
                    break serde_json::from_str(&l).map_err(|e| parse_err(i, e.to_string()))?;
                }
            }
        };
        let mut rows = Vec::new();
        for (i, l) in lines {
            let l = l.map_err(|e| parse_err(i, e.to_string()))?;
            if l.trim().is_empty() {
                continue;
            }
            rows.push(serde_json::from_str(&l).map_err(|e| parse_err(i, e.to_string()))?);
        }
        let t = Trace { header, rows };
        t.validate()?;
        Ok(t)
    }

    /// Read the trace at `path`.
    pub fn load(path: &Path) -> Result<Self> {
        let f = crate::container::regular_file::open_read(path)
            .map_err(|e| Error::io(path.to_path_buf(), e))?;
        Self::read(&mut std::io::BufReader::new(f), &path.display().to_string())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sample() -> Trace {
        let mut t = Trace::new(vec![3, 4], 16, 2, Some(5));
        let row = |forward, kind, e: [[u16; 2]; 2]| Row {
            forward,
            conv: 0,
            kind,
            experts: e.iter().map(|x| x.to_vec()).collect(),
            lookahead: None,
            accepted: None,
        };
        t.rows.push(row(0, RowKind::Prompt, [[1, 2], [3, 4]]));
        t.rows.push(row(0, RowKind::Prompt, [[1, 5], [3, 6]]));
        let mut d = row(1, RowKind::Decode, [[1, 2], [7, 8]]);
        d.lookahead = Some(vec![vec![1, 2], vec![7, 9]]);
        t.rows.push(d);
        let mut dr = row(1, RowKind::Draft, [[2, 3], [7, 8]]);
        dr.accepted = Some(true);
        t.rows.push(dr);
        t.rows.push(Row {
            forward: 1,
            conv: 0,
            kind: RowKind::Mtp,
            experts: vec![vec![0, 15]],
            lookahead: None,
            accepted: None,
        });
        t
    }

    #[test]
    fn round_trips_through_json_lines() {
        let t = sample();
        t.validate().expect("valid");
        let mut buf = Vec::new();
        t.write(&mut buf).expect("write");
        let text = String::from_utf8(buf.clone()).expect("utf8");
        assert!(text.starts_with("{\"format\":\"colibri-routing-trace\",\"version\":1,"));
        assert!(text.contains("\"kind\":\"draft\""));
        let back = Trace::read(&mut buf.as_slice(), "mem").expect("read");
        assert_eq!(back, t);
        assert_eq!(
            t.forwards(),
            vec![Forward { start: 0, end: 2 }, Forward { start: 2, end: 5 }]
        );
        assert_eq!(t.generated_tokens(), 2);
    }

    #[test]
    fn bad_traces_get_errors_naming_the_row() {
        let mut t = sample();
        t.rows[1].experts[1][0] = 16;
        let e = t.validate().expect_err("out of range").to_string();
        assert!(e.contains("row 3") && e.contains("expert 16"), "{e}");
        let mut t = sample();
        t.rows[2].experts.pop();
        assert!(t
            .validate()
            .expect_err("shape")
            .to_string()
            .contains("1 expert lists"));
        let mut t = sample();
        t.rows[4].forward = 0;
        assert!(t
            .validate()
            .expect_err("order")
            .to_string()
            .contains("not consecutive"));
        let e = Trace::read(&mut "{\"format\":\"x\"}\n".as_bytes(), "f.jsonl").expect_err("hdr");
        assert!(e.to_string().contains("f.jsonl, line 1"), "{e}");
        assert!(Trace::read(&mut "".as_bytes(), "f").is_err());
    }
}
