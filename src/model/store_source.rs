//! The streaming expert store as the MoE's source of routed experts.

use crate::error::Result;
use crate::experts::{ExpertStore, ExpertView};
use crate::model::moe::ExpertProvider;

impl ExpertProvider for ExpertStore {
    fn with_experts(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(usize, &ExpertView<'_>) -> Result<()>,
    ) -> Result<()> {
        ExpertStore::with_experts(self, layer, ids, f)
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        ExpertStore::prefetch(self, layer, ids)
    }

    fn begin_layer(&self, layer: usize) {
        ExpertStore::hint_previous(self, layer)
    }
}
