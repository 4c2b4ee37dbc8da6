//! Fault injection: make reads of chosen files fail the way real disks and filesystems fail
//! (EIO, a vanished file, a short read, a filesystem that refuses O_DIRECT), so the store's
//! error and fallback paths can be exercised
//! deterministically. Test-only: compiled with the Cargo feature `testing` (or `cfg(test)`);
//! the shipped build has neither this module nor the hooks in `file_io.rs`. Disarmed it
//! costs one relaxed atomic load per read.

use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Mutex;

use super::lock;

/// How an injected read fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FaultKind {
    /// The read fails with `EIO`.
    Eio,
    /// The file is reported missing (`ENOENT`).
    Missing,
    /// The read delivers only this many bytes, then end-of-file (a truncated shard).
    ShortRead(usize),
    /// An O_DIRECT read fails with `EINVAL`, as on a filesystem without direct I/O: the store
    /// must fall back to buffered reads (with one warning) and deliver the same bytes. No
    /// effect on buffered reads.
    DirectRefused,
}

#[derive(Debug, Clone)]
struct Rule {
    file_contains: String,
    kind: FaultKind,
    remaining: Option<usize>,
}

/// Rules that turn reads of matching files into failures. Owned by the store; reach it with
/// [`super::ExpertStore::faults`].
#[derive(Debug, Default)]
pub struct FaultInjector {
    armed: AtomicBool,
    rules: Mutex<Vec<Rule>>,
}

impl FaultInjector {
    /// Fail the next `times` reads (every read when `None`) of files whose path contains
    /// `file_contains`, in the way `kind` says.
    pub fn inject(&self, file_contains: &str, kind: FaultKind, times: Option<usize>) {
        lock(&self.rules).push(Rule {
            file_contains: file_contains.to_owned(),
            kind,
            remaining: times,
        });
        self.armed.store(true, Ordering::Release);
    }

    /// Remove every rule.
    pub fn clear(&self) {
        lock(&self.rules).clear();
        self.armed.store(false, Ordering::Release);
    }

    /// The fault to apply to one read of `file`, consuming one use of the matching rule.
    pub(crate) fn check(&self, file: &Path) -> Option<FaultKind> {
        if !self.armed.load(Ordering::Acquire) {
            return None;
        }
        let name = file.to_string_lossy();
        let mut rules = lock(&self.rules);
        let i = rules
            .iter()
            .position(|r| name.contains(&r.file_contains) && r.remaining != Some(0))?;
        let rule = &mut rules[i];
        if let Some(n) = rule.remaining.as_mut() {
            *n -= 1;
        }
        let kind = rule.kind;
        rules.retain(|r| r.remaining != Some(0));
        if rules.is_empty() {
            self.armed.store(false, Ordering::Release);
        }
        Some(kind)
    }
}

impl FaultKind {
    /// The OS error this fault stands for (`None` for a short read, which is not an error, and
    /// for a refused O_DIRECT read, which the store handles itself).
    pub(crate) fn io_error(self) -> Option<std::io::Error> {
        match self {
            FaultKind::Eio => Some(std::io::Error::from_raw_os_error(libc::EIO)),
            FaultKind::Missing => Some(std::io::Error::from_raw_os_error(libc::ENOENT)),
            FaultKind::ShortRead(_) | FaultKind::DirectRefused => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rules_match_by_substring_and_run_out() {
        let f = FaultInjector::default();
        assert_eq!(f.check(Path::new("/m/a.safetensors")), None);
        f.inject("a.safe", FaultKind::Eio, Some(2));
        assert_eq!(f.check(Path::new("/m/b.safetensors")), None);
        assert_eq!(f.check(Path::new("/m/a.safetensors")), Some(FaultKind::Eio));
        assert_eq!(f.check(Path::new("/m/a.safetensors")), Some(FaultKind::Eio));
        assert_eq!(f.check(Path::new("/m/a.safetensors")), None);
        f.inject("b", FaultKind::ShortRead(7), None);
        for _ in 0..3 {
            assert_eq!(
                f.check(Path::new("/m/b.safetensors")),
                Some(FaultKind::ShortRead(7))
            );
        }
        f.clear();
        assert_eq!(f.check(Path::new("/m/b.safetensors")), None);
        assert_eq!(
            FaultKind::Missing.io_error().map(|e| e.kind()),
            Some(std::io::ErrorKind::NotFound)
        );
    }
}
