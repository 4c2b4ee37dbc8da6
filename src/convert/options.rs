//! What the conversion produces for each tensor role, checked.

use crate::error::{Error, Result};
use crate::quant::format::{QuantFormat, GROUP_SIZES};

/// What to produce for each tensor role. Bits: 4 → int4 (grouped by `group_size`, or
/// per-row when `group_size` is 0), 8 → int8 per-row, 16 → BF16, 32 → F32.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConvertOptions {
    /// Routed experts of the main layers.
    pub expert_bits: u32,
    /// Attention projections, shared experts and dense MLPs of the main layers.
    pub dense_bits: u32,
    /// Every 2-D weight of the MTP layer(s) except the router.
    pub mtp_bits: u32,
    /// `model.embed_tokens`.
    pub embed_bits: u32,
    /// `lm_head`.
    pub lm_head_bits: u32,
    /// GLM DSA indexer projections (wq_b, wk, weights_proj) of the main layers.
    pub indexer_bits: u32,
    /// int4 group size (one of 16, 32, 48, 64, 96, 128, 192, 256), or 0 for per-row.
    pub group_size: usize,
    /// Largest output shard, in bytes (a shard holds at least one tensor or expert).
    pub max_shard_bytes: u64,
    /// Working-set bound: f32 bytes of source rows processed at once.
    pub chunk_bytes: usize,
}

impl Default for ConvertOptions {
    fn default() -> Self {
        ConvertOptions {
            expert_bits: 4,
            dense_bits: 4,
            mtp_bits: 8,
            embed_bits: 8,
            lm_head_bits: 8,
            indexer_bits: 8,
            group_size: 64,
            max_shard_bytes: 4 << 30,
            chunk_bytes: 64 << 20,
        }
    }
}

impl ConvertOptions {
    /// Check every option; errors name the option.
    pub fn validate(&self) -> Result<()> {
        for (p, b) in self.bits() {
            self.format(p, b)?;
        }
        if self.group_size != 0 && !GROUP_SIZES.contains(&self.group_size) {
            return Err(Error::invalid(
                "group_size",
                format!(
                    "{} is not one of 0 (per-row), {}",
                    self.group_size,
                    GROUP_SIZES.map(|g| g.to_string()).join(", ")
                ),
            ));
        }
        if self.max_shard_bytes == 0 {
            return Err(Error::invalid("max_shard_bytes", "must be > 0"));
        }
        if self.chunk_bytes == 0 {
            return Err(Error::invalid("chunk_bytes", "must be > 0"));
        }
        Ok(())
    }

    fn bits(&self) -> [(&'static str, u32); 6] {
        [
            ("expert_bits", self.expert_bits),
            ("dense_bits", self.dense_bits),
            ("mtp_bits", self.mtp_bits),
            ("embed_bits", self.embed_bits),
            ("lm_head_bits", self.lm_head_bits),
            ("indexer_bits", self.indexer_bits),
        ]
    }

    /// The output format for a bit width.
    pub fn format(&self, param: &str, bits: u32) -> Result<QuantFormat> {
        Ok(match bits {
            4 if self.group_size == 0 => QuantFormat::Int4PerRow,
            4 => QuantFormat::Int4Grouped {
                group_size: self.group_size,
            },
            8 => QuantFormat::Int8PerRow,
            16 => QuantFormat::Bf16,
            32 => QuantFormat::F32,
            other => {
                return Err(Error::invalid(
                    param,
                    format!("{other} bits is not supported; use 4, 8, 16 (bf16) or 32 (f32)"),
                ))
            }
        })
    }
}
