//! How long a context may grow: the model's exact limit, bounded by the RAM its KV cache may
//! take (docs/architecture.md, "Context length").

use crate::error::{Error, Result};

/// KV RAM assumed when the available memory cannot be read.
const FALLBACK_KV_RAM: u64 = 4 << 30;
/// The default never goes below what this much KV RAM holds.
const MIN_KV_RAM: u64 = 1 << 30;

/// The default `max_context`: the model's exact limit, or fewer tokens when their KV would
/// not fit in half of the memory left after the dense weights and the expert budget
/// (`available` = `MemAvailable` at open; at least 1 GiB of KV either way).
pub fn default_max_context(
    exact: usize,
    kv_bytes_per_token: usize,
    available: Option<u64>,
    dense_bytes: u64,
    expert_budget: u64,
) -> usize {
    let kv_ram = available.map_or(FALLBACK_KV_RAM, |a| {
        (a.saturating_sub(dense_bytes).saturating_sub(expert_budget) / 2).max(MIN_KV_RAM)
    });
    let fits = kv_ram / kv_bytes_per_token.max(1) as u64;
    exact
        .min(usize::try_from(fits).unwrap_or(usize::MAX))
        .max(1)
}

/// Check a user's `max_context` against the model's exact limit (`why`: what sets it).
pub fn check_max_context(requested: usize, exact: usize, why: &str) -> Result<usize> {
    if requested == 0 {
        return Err(Error::invalid("max_context", "must be at least 1 token"));
    }
    if requested > exact {
        return Err(Error::invalid(
            "max_context",
            format!(
                "{requested} exceeds the {exact} tokens this model is computed exactly for \
                 ({why})"
            ),
        ));
    }
    Ok(requested)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn default_is_the_exact_limit_when_the_kv_fits() {
        // 64 GiB available, 8 GiB dense, 24 GiB budget: 16 GiB of KV at 192 KiB/token.
        let g = 1u64 << 30;
        let n = default_max_context(202_752, 192 << 10, Some(64 * g), 8 * g, 24 * g);
        assert_eq!(n, (16 * g / (192 << 10)) as usize);
        assert_eq!(default_max_context(4096, 100, Some(64 * g), 0, 0), 4096);
        // Nothing left: 1 GiB of KV still.
        assert_eq!(
            default_max_context(1 << 20, 1 << 20, Some(g), 2 * g, 0),
            1024
        );
        assert_eq!(default_max_context(1 << 20, 1 << 20, None, 0, 0), 4096);
    }

    #[test]
    fn a_requested_context_is_checked() {
        let why = "max_position_embeddings";
        assert_eq!(check_max_context(100, 4096, why).unwrap(), 100);
        assert!(check_max_context(0, 4096, why).is_err());
        let e = check_max_context(5000, 4096, why).unwrap_err().to_string();
        assert!(
            e.contains("max_context") && e.contains("4096") && e.contains(why),
            "{e}"
        );
    }
}
