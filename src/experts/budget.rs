//! The RAM budget and how it is shared: the pinned hot set first (from the routing history or
//! given), then an equal LRU share per layer; resident layers are loaded whole *beyond* the
//! budget and take no share of it (docs/expert-store.md).

use super::options::{PinPolicy, StoreOptions};
use super::usage::{self, UsageCounts};
use crate::error::{Error, Result};

/// `MemAvailable` from /proc/meminfo in bytes, where it can be read.
pub fn mem_available() -> Option<u64> {
    std::fs::read_to_string("/proc/meminfo").ok().and_then(|s| {
        s.lines()
            .find_map(|l| l.strip_prefix("MemAvailable:"))
            .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
            .map(|kb| kb * 1024)
    })
}

/// Half of `MemAvailable` from /proc/meminfo (4 GiB where it cannot be read).
pub fn auto_budget() -> u64 {
    mem_available().map_or(4 << 30, |b| b / 2)
}

/// How the budget is spent, decided once at open.
pub(super) struct BudgetPlan {
    /// The budget from the options (or [`auto_budget`]), without the resident layers.
    pub budget: u64,
    /// Every pinned (layer, expert), sorted: the pin set plus all experts of resident layers.
    pub pins: Vec<(usize, usize)>,
    /// Bytes of the pin set (within the budget).
    pub pin_set_bytes: u64,
    /// Bytes of the resident layers (beyond the budget).
    pub resident_bytes: u64,
    /// LRU capacity of each non-resident layer.
    pub lru_per_layer: u64,
    /// The resident layers, sorted and distinct.
    resident_layers: Vec<usize>,
}

impl BudgetPlan {
    /// Plan the budget for a store of `shape` (MoE layer, expert count) whose experts are
    /// charged `charged(layer, expert)` bytes (`None`: no such expert), with routing history
    /// `history` for [`PinPolicy::History`].
    pub fn new(
        opts: &StoreOptions,
        shape: &[(usize, usize)],
        charged: impl Fn(usize, usize) -> Option<u64>,
        history: &UsageCounts,
    ) -> Result<Self> {
        let budget = opts.ram_budget_bytes.unwrap_or_else(auto_budget);
        let mut resident_layers = opts.resident_layers.clone();
        resident_layers.sort_unstable();
        resident_layers.dedup();
        if let Some(&bad) = resident_layers
            .iter()
            .find(|&&l| !shape.iter().any(|&(sl, _)| sl == l))
        {
            return Err(Error::invalid(
                "resident_layers",
                format!(
                    "layer {bad} has no routed experts (MoE layers: {:?})",
                    shape.iter().map(|&(l, _)| l).collect::<Vec<_>>()
                ),
            ));
        }
        let is_resident = |l: usize| resident_layers.binary_search(&l).is_ok();
        let mut pins: Vec<(usize, usize)> = match &opts.pin {
            PinPolicy::Off => Vec::new(),
            PinPolicy::History { fraction } => {
                let share = (budget as f64 * fraction.clamp(0.0, 1.0)) as u64;
                // Experts of resident layers are pinned anyway; never spend budget on them.
                let bytes = |l: usize, e: usize| match is_resident(l) {
                    true => u64::MAX,
                    false => charged(l, e).unwrap_or(u64::MAX),
                };
                usage::select_pins(history, bytes, share)
            }
            PinPolicy::Explicit(v) => {
                let mut v = v.clone();
                v.retain(|&(l, _)| !is_resident(l));
                v
            }
        };
        let mut pin_set_bytes = 0u64;
        for &(l, e) in &pins {
            pin_set_bytes += charged(l, e).ok_or_else(|| {
                Error::invalid("pin", format!("layer {l} has no routed expert {e}"))
            })?;
        }
        if pin_set_bytes > budget {
            return Err(Error::invalid(
                "pin",
                format!(
                    "the pinned experts take {pin_set_bytes} bytes, over the {budget}-byte budget"
                ),
            ));
        }
        let lru_layers = shape.iter().filter(|&&(l, _)| !is_resident(l)).count();
        let lru_per_layer = (budget - pin_set_bytes) / lru_layers.max(1) as u64;
        let mut resident_bytes = 0u64;
        for &(l, n) in shape.iter().filter(|&&(l, _)| is_resident(l)) {
            for e in 0..n {
                resident_bytes += charged(l, e).unwrap_or(0);
                pins.push((l, e));
            }
        }
        pins.sort_unstable();
        pins.dedup();
        Ok(BudgetPlan {
            budget,
            pins,
            pin_set_bytes,
            resident_bytes,
            lru_per_layer,
            resident_layers,
        })
    }

    /// Whether every expert of `layer` is loaded at open and never evicted.
    pub fn is_resident(&self, layer: usize) -> bool {
        self.resident_layers.binary_search(&layer).is_ok()
    }

    /// The LRU capacity of `layer` (none for a resident layer: its experts are all pinned).
    pub fn lru_capacity(&self, layer: usize) -> u64 {
        if self.is_resident(layer) {
            0
        } else {
            self.lru_per_layer
        }
    }

    /// Which experts of `layer` (of `n`) are pinned.
    pub fn pinned_of(&self, layer: usize, n: usize) -> Vec<bool> {
        let mut pinned = vec![false; n];
        for &(pl, e) in &self.pins {
            if pl == layer {
                pinned[e] = true;
            }
        }
        pinned
    }
}
