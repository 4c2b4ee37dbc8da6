//! The streaming expert store as the MoE's source of routed experts.

use crate::error::Result;
use crate::experts::ExpertStore;
use crate::model::moe::{ExpertProvider, ExpertWeights};

impl ExpertProvider for ExpertStore {
    fn with_experts(
        &self,
        layer: usize,
        ids: &[usize],
        f: &mut dyn FnMut(usize, &ExpertWeights<'_>) -> Result<()>,
    ) -> Result<()> {
        ExpertStore::with_experts(self, layer, ids, &mut |id, v| {
            f(
                id,
                &ExpertWeights {
                    gate: v.gate,
                    up: v.up,
                    down: v.down,
                },
            )
        })
    }

    fn prefetch(&self, layer: usize, ids: &[usize]) {
        ExpertStore::prefetch(self, layer, ids)
    }

    fn begin_layer(&self, layer: usize) {
        ExpertStore::hint_previous(self, layer)
    }
}
