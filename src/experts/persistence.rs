//! The store's side of the routing history (the file format and merge live in
//! [`usage`](super::usage)): which file it is read from at open, and saving this session's
//! counts back into it. Nothing is ever written into the model directory.

use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering::Relaxed;

use super::options::StoreOptions;
use super::source::ExpertLocator;
use super::usage::{self, SaveOutcome, UsageCounts, USAGE_FILE};
use super::{lock, warn_once, ExpertStore};
use crate::error::Result;

/// The routing history a store opens with: where it is saved (`None`: it is not), and the
/// counts read from there (or from a legacy file in the model directory, migrated).
pub(super) fn open_history(
    source: &dyn ExpertLocator,
    opts: &StoreOptions,
    fingerprint: &str,
    shape: &[(usize, usize)],
) -> (Option<PathBuf>, UsageCounts) {
    let legacy = source.model_dir().join(USAGE_FILE);
    let cache_dir = if opts.usage_file {
        let dir = opts.cache_dir.clone().or_else(usage::default_cache_dir);
        if dir.is_none() {
            warn_once(
                "usage-no-cache-dir",
                &format!(
                    "no cache directory for the routing history (set {} or HOME); it \
                         will not be saved",
                    usage::CACHE_DIR_ENV
                ),
            );
        }
        dir
    } else {
        None
    };
    let usage_path = cache_dir.map(|d| usage::history_path(&d, fingerprint));
    let base = if !opts.usage_file {
        UsageCounts::zeros(shape)
    } else {
        let (c, warning) = match &usage_path {
            Some(p) => usage::load_or_migrate(p, Some(&legacy), fingerprint, shape),
            None => usage::load(&legacy, fingerprint, shape),
        };
        if let Some(w) = warning {
            let key = usage_path.as_deref().unwrap_or(&legacy).display();
            warn_once(&format!("usage-load:{key}"), &w);
        }
        c
    };
    (usage_path, base)
}

impl ExpertStore {
    /// Where the routing history is saved (in the cache directory), or `None` when it is
    /// not (`usage_file` off, or no cache directory could be determined).
    pub fn usage_path(&self) -> Option<&Path> {
        self.inner.usage_path.as_deref()
    }

    /// Merge this session's routing counts into the history file (atomic write). A failure to
    /// write (read-only directory...) warns once and returns `Skipped`; it is never an error.
    pub fn save_usage(&self) -> Result<SaveOutcome> {
        let inner = &self.inner;
        let Some(path) = &inner.usage_path else {
            return Ok(SaveOutcome::Skipped(
                "the routing history is not saved (usage_file off, or no cache directory)".into(),
            ));
        };
        let delta = UsageCounts {
            layers: inner
                .layers
                .iter()
                .enumerate()
                .filter_map(|(l, ls)| {
                    ls.as_ref()
                        .map(|ls| (l, ls.usage.iter().map(|a| a.load(Relaxed)).collect()))
                })
                .collect(),
        };
        let mut base = lock(&inner.usage_base);
        match usage::save(path, &inner.fingerprint, &inner.shape, &base, &delta) {
            Ok(merged) => {
                for (l, counts) in &delta.layers {
                    if let Some(Some(ls)) = inner.layers.get(*l) {
                        for (a, &d) in ls.usage.iter().zip(counts) {
                            a.fetch_sub(d, Relaxed);
                        }
                    }
                }
                *base = merged;
                Ok(SaveOutcome::Written(path.clone()))
            }
            Err(msg) => {
                warn_once(&format!("usage-save:{}", path.display()), &msg);
                Ok(SaveOutcome::Skipped(msg))
            }
        }
    }
}
