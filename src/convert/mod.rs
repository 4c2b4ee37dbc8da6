//! Hugging Face checkpoint (BF16/F16/F32, or FP8 e4m3 with 128×128 `weight_scale_inv`
//! block scales) → colibri container (docs/container.md).
//!
//! The conversion is planned up front from the source headers alone: every output tensor's
//! format and size follow from its role and shape, so each output shard's header is known
//! before any data is read. A shard is then written by streaming: read a block of rows of
//! one source tensor with positioned reads (no mmap, so the source never inflates RSS),
//! dequantise to f32, quantise the rows in parallel (rayon), append. Memory stays bounded by
//! one row block (`chunk_bytes`) whatever the shard or tensor size.
//!
//! Each shard is written to `.NAME.partial` and renamed when complete, then entered in the
//! progress record (`record`: the stat stamp and a CRC-32 of the bytes read of each source
//! file it was made from). A shard whose final file exists with exactly the planned header
//! and length, and whose sources still match its record, is skipped, so an interrupted
//! conversion resumes where it stopped; a source that changed makes its shards be redone,
//! and one that changes while it is read is an error naming it. Nothing is ever written
//! into SRC.

pub mod fp8;

mod options;
mod plan;
mod record;
mod resume;
mod source;
mod tensor_plan;
mod write;

use std::collections::BTreeMap;
use std::path::Path;

use crate::error::Result;

pub use options::ConvertOptions;
pub use plan::{plan, Plan, PlannedShard, PlannedTensor};
pub use resume::ShardStatus;

/// Suffix DeepSeek-V3 / GLM-5 FP8 checkpoints give the block scales of `NAME.weight`:
/// `NAME.weight_scale_inv`.
pub const SCALE_INV_SUFFIX: &str = "_scale_inv";

/// What a conversion did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConvertReport {
    pub shards_written: usize,
    pub shards_skipped: usize,
    /// Of `shards_written`, those that existed finished but were made from source contents
    /// that have changed since: why, per shard ([`ShardStatus::Stale`]).
    pub redone: Vec<String>,
    pub bytes_written: u64,
    /// Output tensors per format name ("int4_g64", "int8", "f32", "copy", ...).
    pub formats: BTreeMap<String, usize>,
}

/// Convert `src` into `dst` in one call (skipping shards already complete).
pub fn convert(src: &Path, dst: &Path, options: &ConvertOptions) -> Result<ConvertReport> {
    let plan = plan(src, dst, options)?;
    let mut report = ConvertReport {
        formats: plan.format_counts(),
        ..ConvertReport::default()
    };
    for i in 0..plan.shards.len() {
        match plan.status(i)? {
            ShardStatus::Done => {
                report.shards_skipped += 1;
                continue;
            }
            ShardStatus::Stale(why) => report.redone.push(why),
            ShardStatus::Missing => {}
        }
        let mut n = 0;
        plan.write_shard(i, &mut |b| {
            n += b;
            Ok(())
        })?;
        report.bytes_written += n;
        report.shards_written += 1;
    }
    plan.finish()?;
    Ok(report)
}

/// Whether a file of a source checkpoint belongs in the container: what loading and
/// prompting the model reads (the tokenizer in any of its Hugging Face forms, the generation
/// config, the chat template) and its license. Everything else stays behind: the weights
/// are rewritten, `config.json` is written separately, and other files (a README describing
/// the source's format, a routing history of another container, notes, numpy dumps) are
/// not the container's.
pub fn is_container_sidecar(name: &str) -> bool {
    const EXACT: [&str; 8] = [
        "generation_config.json",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.json",
        "preprocessor_config.json",
    ];
    !name.starts_with('.')
        && (EXACT.contains(&name)
            || name.starts_with("tokenizer")
            || name.ends_with(".jinja")
            || name.starts_with("LICENSE")
            || name.starts_with("LICENCE"))
}

#[cfg(test)]
mod resume_tests;
#[cfg(test)]
mod tests;
