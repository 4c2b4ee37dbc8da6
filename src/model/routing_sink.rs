//! What the model tells an observer of its routing: after each forward, every row's routed
//! experts per MoE layer, and when a sequence rolls back rejected rows. The engine's
//! `trace_routing` option writes them as a routing trace (`routing::recorder`); the model
//! itself keeps nothing.

/// Which entry point a forward came through.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ForwardKind {
    /// [`Model::prefill`](super::Model::prefill): a prompt's rows.
    Prompt,
    /// [`Model::forward`](super::Model::forward): a decode step or a verify (row 0 the fed
    /// token, the others drafts).
    Decode,
    /// [`Model::mtp_forward`](super::Model::mtp_forward): the MTP head's rows.
    Mtp,
}

/// One sequence's rows in a forward and their routing.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RoutedRows {
    /// The sequence's caches ([`KvCaches::id`](super::KvCaches::id)).
    pub sequence: u64,
    /// The cache position of the first row.
    pub start: usize,
    /// `[row][layer]` → the routed expert ids, best first: the main model's MoE layers in
    /// order, or the one MTP layer.
    pub experts: Vec<Vec<Vec<u16>>>,
}

/// Told of every forward's routing while installed ([`Model::set_routing_sink`](super::Model::set_routing_sink)).
/// Called on the forward's thread, after the forward succeeded.
pub trait RoutingSink: Send + Sync {
    /// One forward over every sequence of `rows` (one batch: each layer read the union of
    /// their experts once).
    fn forward(&self, kind: ForwardKind, rows: &[RoutedRows]);
    /// `sequence` kept its first `len` cache rows (rows from `len` on were rolled back).
    fn truncated(&self, sequence: u64, len: usize);
}
