//! The streaming expert store as the MoE's source of routed experts.

use crate::error::Result;
use crate::experts::{ExpertBatch, ExpertStore, ReadPrice};
use crate::model::moe::ExpertProvider;

impl ExpertProvider for ExpertStore {
    fn with_expert_batches(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(&ExpertBatch<'_>) -> Result<()>,
    ) -> Result<()> {
        ExpertStore::with_expert_batches(self, layer, ids, f)
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        ExpertStore::prefetch(self, layer, ids)
    }

    fn begin_layer(&self, layer: usize) {
        ExpertStore::hint_previous(self, layer)
    }

    fn read_price(&self, k: usize, mtp_layer: Option<usize>) -> Option<ReadPrice> {
        Some(ExpertStore::read_price(self, k, mtp_layer))
    }
}
