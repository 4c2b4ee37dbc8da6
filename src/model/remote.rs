//! Routed experts computed by other processes (`colibri.distributed`: Ray actors holding
//! experts in their RAM). The MoE hands a [`RemoteExperts`] each layer's rows and routing
//! before it runs its local experts, runs those meanwhile, then collects: every expert the
//! remote answered is summed in with the others in ascending expert order, and every expert
//! it did not answer (a worker died or timed out) is run from the local store. A worker
//! computes an expert with the same kernels, arithmetic and rows as the head would, so the
//! sum, and the tokens, are the same wherever an expert ran.

use crate::error::Result;
use crate::experts::{ExpertBatch, ReadPrice};
use crate::model::moe::ExpertProvider;
use crate::quant::kernels::Arithmetic;

/// One routed expert of a layer and the rows (indices into the layer's `h`) that chose it,
/// in ascending row order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertRows {
    pub expert: usize,
    pub rows: Vec<usize>,
}

/// What a remote answered for one submitted layer.
#[derive(Debug, Default)]
pub struct RemoteOutputs {
    /// `(expert, y)`: the expert's unweighted outputs on its rows, `[rows.len(), hidden]`
    /// in the order of its [`ExpertRows::rows`].
    pub done: Vec<(usize, Vec<f32>)>,
}

/// A submitted layer whose answers are still to come.
pub trait RemotePending: Send {
    /// The experts this request took (the MoE runs the others locally).
    fn taken(&self) -> &[usize];
    /// Wait for the answers. Never fails: an expert taken and not in the answer is run from
    /// the local store.
    fn collect(self: Box<Self>) -> RemoteOutputs;
}

/// Where routed experts may be computed besides the local store.
pub trait RemoteExperts: Send + Sync {
    /// Start computing `want`'s experts of `layer` that a live worker holds, on their rows of
    /// `h` (`[s, hidden]`), in `arith`. `None` when none is taken.
    fn submit(
        &self,
        layer: usize,
        arith: Arithmetic,
        h: &[f32],
        s: usize,
        want: &[ExpertRows],
    ) -> Option<Box<dyn RemotePending>>;

    /// Whether a live worker holds expert `id` of `layer` (the store then need not prefetch
    /// it).
    fn holds(&self, _layer: usize, _id: usize) -> bool {
        false
    }
}

/// The local provider with a remote beside it: everything but [`ExpertProvider::remote`] is
/// the local one's, and prefetches skip what the remote holds.
pub struct WithRemote<'a> {
    pub local: &'a dyn ExpertProvider,
    pub remote: &'a dyn RemoteExperts,
}

impl ExpertProvider for WithRemote<'_> {
    fn with_expert_batches(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(&ExpertBatch<'_>) -> Result<()>,
    ) -> Result<()> {
        self.local.with_expert_batches(layer, ids, f)
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        let ids: Vec<usize> = ids
            .iter()
            .copied()
            .filter(|&id| !self.remote.holds(layer, id))
            .collect();
        if !ids.is_empty() {
            self.local.prefetch(layer, &ids);
        }
    }

    fn begin_layer(&self, layer: usize) {
        self.local.begin_layer(layer)
    }

    fn read_price(&self, k: usize, mtp_layer: Option<usize>) -> Option<ReadPrice> {
        self.local.read_price(k, mtp_layer)
    }

    fn remote(&self) -> Option<&dyn RemoteExperts> {
        Some(self.remote)
    }
}

#[cfg(test)]
#[path = "remote_tests.rs"]
mod tests;
