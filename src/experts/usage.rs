//! Routing history: how often each (layer, expert) was routed to, kept across runs and used
//! to choose the pinned hot set. It is per-model state, so it lives in the user's cache
//! directory ([`default_cache_dir`]: `$COLIBRI_CACHE_DIR`, else `$XDG_CACHE_HOME/colibri`,
//! else `~/.cache/colibri`), at `models/<fingerprint>/colibri-usage.json` ([`history_path`]),
//! never in the model directory (an installed package, the Hugging Face cache). A legacy
//! `colibri-usage.json` next to the weights is still read when the cache has none yet
//! (migration); the first save then writes its counts, merged, to the cache. The file carries
//! the model's fingerprint; a file from another model, or one that cannot be parsed, is
//! ignored with a warning. Saving is atomic (temporary file + rename in the same directory)
//! and, under an advisory lock on a `.colibri-usage.json.lock` next to it, merges with
//! whatever another run saved meanwhile, so concurrent processes lose no counts. Failing to
//! save (read-only cache, full disk, a lock held past 10 s) never fails generation: it warns
//! and reports [`SaveOutcome::Skipped`].

use std::collections::BTreeMap;
use std::io::Write;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// The history's file name (in the cache, and the legacy sidecar in a model directory).
pub const USAGE_FILE: &str = "colibri-usage.json";
/// The environment variable that overrides the cache directory.
pub const CACHE_DIR_ENV: &str = "COLIBRI_CACHE_DIR";

/// The user cache directory for colibri's per-model state, platformdirs-style:
/// `$COLIBRI_CACHE_DIR` if set, else `$XDG_CACHE_HOME/colibri` (an absolute path), else
/// `~/Library/Caches/colibri` on macOS, `%LOCALAPPDATA%\colibri\cache` on Windows and
/// `~/.cache/colibri` elsewhere. `None` when none of these can be determined.
pub fn default_cache_dir() -> Option<PathBuf> {
    let var = |name: &str| {
        std::env::var_os(name)
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    };
    if let Some(dir) = var(CACHE_DIR_ENV) {
        return Some(dir);
    }
    if cfg!(windows) {
        return var("LOCALAPPDATA").map(|d| d.join("colibri").join("cache"));
    }
    if let Some(xdg) = var("XDG_CACHE_HOME").filter(|d| d.is_absolute()) {
        return Some(xdg.join("colibri"));
    }
    let home = var("HOME")?;
    Some(if cfg!(target_os = "macos") {
        home.join("Library").join("Caches").join("colibri")
    } else {
        home.join(".cache").join("colibri")
    })
}

/// Where the history of the model with `fingerprint` lives under `cache_dir`.
pub fn history_path(cache_dir: &Path, fingerprint: &str) -> PathBuf {
    cache_dir.join("models").join(fingerprint).join(USAGE_FILE)
}
const FORMAT: &str = "colibri-usage";
const VERSION: u32 = 1;

/// Routing counts per layer (layer index → count per expert).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct UsageCounts {
    pub layers: BTreeMap<usize, Vec<u64>>,
}

#[derive(Serialize, Deserialize)]
struct UsageJson {
    format: String,
    version: u32,
    fingerprint: String,
    /// Layer index (as a string, JSON keys) → counts per expert.
    layers: BTreeMap<String, Vec<u64>>,
}

/// What happened to a save request.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SaveOutcome {
    /// Written (merged) to this path.
    Written(PathBuf),
    /// Not written; the reason (also printed once as a warning).
    Skipped(String),
}

impl UsageCounts {
    /// Zero counts shaped like `shape` ((layer, experts) pairs).
    pub fn zeros(shape: &[(usize, usize)]) -> Self {
        UsageCounts {
            layers: shape.iter().map(|&(l, n)| (l, vec![0; n])).collect(),
        }
    }

    /// True when `self` has exactly the layers and expert counts of `shape`.
    fn has_shape(&self, shape: &[(usize, usize)]) -> bool {
        self.layers.len() == shape.len()
            && shape
                .iter()
                .all(|&(l, n)| self.layers.get(&l).is_some_and(|c| c.len() == n))
    }

    /// Add `other` (same shape) into `self`.
    pub fn merge(&mut self, other: &UsageCounts) {
        for (l, c) in &other.layers {
            if let Some(mine) = self.layers.get_mut(l) {
                for (a, b) in mine.iter_mut().zip(c) {
                    *a = a.saturating_add(*b);
                }
            }
        }
    }

    pub fn total(&self) -> u64 {
        self.layers.values().flatten().sum()
    }
}

/// Read the history at `path`. Returns the counts (zeros when absent or unusable) and a
/// warning when the file exists but was ignored.
pub fn load(
    path: &Path,
    fingerprint: &str,
    shape: &[(usize, usize)],
) -> (UsageCounts, Option<String>) {
    match read(path, fingerprint, shape) {
        Ok(Some(c)) => (c, None),
        Ok(None) => (UsageCounts::zeros(shape), None),
        Err(why) => (
            UsageCounts::zeros(shape),
            Some(format!(
                "{}: ignoring the routing history ({why}); it will be rewritten for this model",
                path.display()
            )),
        ),
    }
}

/// Read the history at `path`, or, when there is no file there yet, the legacy sidecar at
/// `legacy` (a model directory's `colibri-usage.json`, from before the history moved to the
/// cache). Returns the counts and a warning as [`load`] does.
pub fn load_or_migrate(
    path: &Path,
    legacy: Option<&Path>,
    fingerprint: &str,
    shape: &[(usize, usize)],
) -> (UsageCounts, Option<String>) {
    match legacy {
        Some(old) if !path.exists() && old.exists() => load(old, fingerprint, shape),
        _ => load(path, fingerprint, shape),
    }
}

/// A routing history is a few hundred KB even for GLM-5.2; anything far larger is not one.
const MAX_HISTORY_BYTES: u64 = 64 << 20;

/// The text of `path` if it is a regular file of sane size. Opened non-blocking and checked
/// on the open descriptor, so a FIFO or device named like the history cannot block the
/// model's open, and a swap between a check and the open cannot either.
fn read_regular_file(path: &Path) -> std::io::Result<String> {
    use std::io::Read;
    let mut options = std::fs::OpenOptions::new();
    options.read(true);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(path)?;
    let meta = file.metadata()?;
    if !meta.is_file() {
        return Err(std::io::Error::other("it is not a regular file"));
    }
    if meta.len() > MAX_HISTORY_BYTES {
        return Err(std::io::Error::other(format!(
            "{} bytes is far larger than a routing history",
            meta.len()
        )));
    }
    let mut text = String::new();
    file.take(MAX_HISTORY_BYTES).read_to_string(&mut text)?;
    Ok(text)
}

/// `Ok(None)`: no file. `Err(reason)`: a file that is not usable for this model.
fn read(
    path: &Path,
    fingerprint: &str,
    shape: &[(usize, usize)],
) -> Result<Option<UsageCounts>, String> {
    let text = match read_regular_file(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(format!("cannot read it: {e}")),
    };
    let j: UsageJson = serde_json::from_str(&text).map_err(|e| format!("not valid: {e}"))?;
    if j.format != FORMAT || j.version != VERSION {
        return Err(format!(
            "format '{}' version {} is not {FORMAT} version {VERSION}",
            j.format, j.version
        ));
    }
    if j.fingerprint != fingerprint {
        return Err(format!(
            "it belongs to another model (fingerprint {} != {fingerprint})",
            j.fingerprint
        ));
    }
    let mut layers = BTreeMap::new();
    for (k, v) in j.layers {
        let l: usize = k.parse().map_err(|_| format!("bad layer key '{k}'"))?;
        layers.insert(l, v);
    }
    let c = UsageCounts { layers };
    if !c.has_shape(shape) {
        return Err("its layers or expert counts do not match this model".into());
    }
    Ok(Some(c))
}

/// How long a save waits for another process's save of the same history.
const LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// An exclusive advisory lock (`flock`) on `<dir>/.colibri-usage.json.lock`, held while a
/// save reads, merges and replaces the history, so concurrent saves (other processes, other
/// models of this one) serialise and none overwrites another's counts. Waits at most
/// [`LOCK_WAIT`]; the lock file is opened non-blocking and must be a regular file.
fn lock_history(path: &Path) -> Result<std::fs::File, String> {
    let dir = path.parent().unwrap_or(Path::new("."));
    let lock_path = dir.join(format!(".{USAGE_FILE}.lock"));
    let fail = |e: &dyn std::fmt::Display| {
        format!(
            "cannot write the routing history {}: cannot lock {}: {e}",
            path.display(),
            lock_path.display()
        )
    };
    std::fs::create_dir_all(dir).map_err(|e| fail(&e))?;
    let mut options = std::fs::OpenOptions::new();
    options.read(true).write(true).create(true).truncate(false);
    #[cfg(unix)]
    {
        use std::os::unix::fs::OpenOptionsExt;
        options.custom_flags(libc::O_NONBLOCK);
    }
    let file = options.open(&lock_path).map_err(|e| fail(&e))?;
    if !file.metadata().map_err(|e| fail(&e))?.is_file() {
        return Err(fail(&"it is not a regular file"));
    }
    let start = std::time::Instant::now();
    loop {
        match file.try_lock() {
            Ok(()) => return Ok(file),
            Err(std::fs::TryLockError::WouldBlock) if start.elapsed() < LOCK_WAIT => {
                std::thread::sleep(std::time::Duration::from_millis(5));
            }
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(fail(&format!(
                    "another process held it for {} s",
                    LOCK_WAIT.as_secs()
                )))
            }
            Err(std::fs::TryLockError::Error(e)) => return Err(fail(&e)),
        }
    }
}

/// Merge `delta` into the history on disk and write it atomically, under the history's
/// lock: the file is re-read under the lock, so concurrent runs (threads or processes) add
/// up and lose nothing. Returns the merged counts on success.
pub fn save(
    path: &Path,
    fingerprint: &str,
    shape: &[(usize, usize)],
    fallback_base: &UsageCounts,
    delta: &UsageCounts,
) -> Result<UsageCounts, String> {
    // Released when it drops, after the rename.
    let _lock = lock_history(path)?;
    let mut merged = match read(path, fingerprint, shape) {
        Ok(Some(c)) => c,
        // Absent or foreign: start from what we loaded (zeros for a foreign file).
        Ok(None) | Err(_) => fallback_base.clone(),
    };
    merged.merge(delta);
    let j = UsageJson {
        format: FORMAT.into(),
        version: VERSION,
        fingerprint: fingerprint.into(),
        layers: merged
            .layers
            .iter()
            .map(|(l, c)| (l.to_string(), c.clone()))
            .collect(),
    };
    let text = serde_json::to_string(&j).map_err(|e| e.to_string())?;
    let dir = path.parent().unwrap_or(Path::new("."));
    // A name no other user can plant a link at beforehand, created new.
    let tmp = dir.join(format!(
        ".{USAGE_FILE}.tmp-{}-{:016x}",
        std::process::id(),
        crate::container::regular_file::random_name_part()
    ));
    let write = || -> std::io::Result<()> {
        std::fs::create_dir_all(dir)?;
        let mut f = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&tmp)?;
        f.write_all(text.as_bytes())?;
        f.sync_all()?;
        std::fs::rename(&tmp, path)
    };
    if let Err(e) = write() {
        let _ = std::fs::remove_file(&tmp);
        return Err(format!(
            "cannot write the routing history {}: {e}",
            path.display()
        ));
    }
    Ok(merged)
}

/// Choose the pinned hot set: the most-routed (layer, expert) pairs, most counted first
/// (ties: lower layer, then lower id), while their bytes fit `budget`. Never-routed experts
/// are not pinned.
pub fn select_pins(
    counts: &UsageCounts,
    bytes_of: impl Fn(usize, usize) -> u64,
    budget: u64,
) -> Vec<(usize, usize)> {
    let mut cand: Vec<(u64, usize, usize)> = counts
        .layers
        .iter()
        .flat_map(|(&l, c)| {
            c.iter()
                .enumerate()
                .filter(|(_, &n)| n > 0)
                .map(move |(e, &n)| (n, l, e))
        })
        .collect();
    cand.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)).then(a.2.cmp(&b.2)));
    let mut used = 0u64;
    let mut pins = Vec::new();
    for (_, l, e) in cand {
        // `bytes_of` may say u64::MAX for "never pin this one": the sum must not wrap.
        match used.checked_add(bytes_of(l, e)) {
            Some(total) if total <= budget => {
                used = total;
                pins.push((l, e));
            }
            _ => {}
        }
    }
    pins.sort_unstable();
    pins
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHAPE: [(usize, usize); 2] = [(3, 4), (5, 4)];

    fn counts(a: [u64; 4], b: [u64; 4]) -> UsageCounts {
        UsageCounts {
            layers: [(3, a.to_vec()), (5, b.to_vec())].into_iter().collect(),
        }
    }

    /// A FIFO named like the history must not block (open() on a FIFO waits for a writer).
    #[cfg(unix)]
    #[test]
    fn a_fifo_named_like_the_history_is_ignored_without_blocking() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join(USAGE_FILE);
        let c_path = std::ffi::CString::new(p.to_str().unwrap()).unwrap();
        // SAFETY: a valid NUL-terminated path; mkfifo only creates a file system node.
        assert_eq!(unsafe { libc::mkfifo(c_path.as_ptr(), 0o600) }, 0);
        let (tx, rx) = std::sync::mpsc::channel();
        let q = p.clone();
        std::thread::spawn(move || {
            let _ = tx.send(load(&q, "fp", &SHAPE));
        });
        let (c, warning) = rx
            .recv_timeout(std::time::Duration::from_secs(10))
            .expect("loading the history blocked on a FIFO");
        assert_eq!(c.total(), 0);
        let w = warning.expect("a warning");
        assert!(w.contains("not a regular file"), "{w}");
    }

    #[test]
    fn save_merges_with_what_is_on_disk_and_round_trips() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join(USAGE_FILE);
        let (c0, w) = load(&p, "fp", &SHAPE);
        assert_eq!((c0.total(), w), (0, None));
        let d1 = counts([1, 0, 0, 2], [0, 0, 5, 0]);
        save(&p, "fp", &SHAPE, &c0, &d1).expect("save 1");
        // A second run (loaded zeros before the first saved) adds its own counts.
        let d2 = counts([1, 1, 0, 0], [0, 0, 0, 3]);
        let merged = save(&p, "fp", &SHAPE, &c0, &d2).expect("save 2");
        assert_eq!(merged, counts([2, 1, 0, 2], [0, 0, 5, 3]));
        let (back, w) = load(&p, "fp", &SHAPE);
        assert_eq!((back, w), (merged, None));
        // No temporary files are left behind; the lock file stays (deleting it would race
        // with a process about to lock it).
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .expect("ls")
            .map(|e| e.expect("entry").file_name())
            .collect();
        names.sort();
        let lock = format!(".{USAGE_FILE}.lock");
        assert_eq!(names, vec![lock.as_str(), USAGE_FILE]);
    }

    #[test]
    fn foreign_or_corrupt_history_is_ignored_with_a_warning() {
        let dir = tempfile::tempdir().expect("tempdir");
        let p = dir.path().join(USAGE_FILE);
        save(
            &p,
            "other",
            &SHAPE,
            &UsageCounts::zeros(&SHAPE),
            &counts([9; 4], [9; 4]),
        )
        .expect("save");
        let (c, w) = load(&p, "fp", &SHAPE);
        assert_eq!(c.total(), 0);
        assert!(w.expect("warning").contains("another model"));
        let (c, w) = load(&p, "other", &[(3, 4)]);
        assert_eq!(c.total(), 0);
        assert!(w.expect("warning").contains("do not match"));
        std::fs::write(&p, "{not json").expect("write");
        let (_, w) = load(&p, "fp", &SHAPE);
        assert!(w.expect("warning").contains("not valid"));
        // Saving over a foreign file replaces it with this model's counts.
        let m = save(
            &p,
            "fp",
            &SHAPE,
            &UsageCounts::zeros(&SHAPE),
            &counts([1; 4], [0; 4]),
        )
        .expect("save");
        assert_eq!(m, counts([1; 4], [0; 4]));
    }

    #[test]
    fn history_lives_under_the_fingerprint_and_save_creates_its_directory() {
        let cache = tempfile::tempdir().expect("tempdir");
        let p = history_path(cache.path(), "0123abcd");
        assert_eq!(
            p,
            cache
                .path()
                .join("models")
                .join("0123abcd")
                .join(USAGE_FILE)
        );
        let d = counts([1, 0, 0, 0], [0; 4]);
        save(&p, "fp", &SHAPE, &UsageCounts::zeros(&SHAPE), &d).expect("save");
        assert_eq!(load(&p, "fp", &SHAPE), (d.clone(), None));
        // A legacy file is read only while the cache has none.
        let legacy = cache.path().join("legacy.json");
        let old = counts([0; 4], [3, 0, 0, 0]);
        save(&legacy, "fp", &SHAPE, &old, &UsageCounts::zeros(&SHAPE)).expect("legacy");
        let fresh = cache.path().join("new").join(USAGE_FILE);
        assert_eq!(load_or_migrate(&fresh, Some(&legacy), "fp", &SHAPE).0, old);
        assert_eq!(load_or_migrate(&p, Some(&legacy), "fp", &SHAPE).0, d);
        assert_eq!(load_or_migrate(&fresh, None, "fp", &SHAPE).0.total(), 0);
    }

    #[test]
    fn unwritable_directory_is_an_error_string_not_a_panic() {
        let p = Path::new("/proc/definitely/not/writable").join(USAGE_FILE);
        let r = save(
            &p,
            "fp",
            &SHAPE,
            &UsageCounts::zeros(&SHAPE),
            &counts([1; 4], [1; 4]),
        );
        assert!(r.expect_err("must fail").contains("cannot write"));
    }

    #[test]
    fn pins_take_the_hottest_experts_that_fit() {
        let c = counts([5, 0, 7, 1], [7, 2, 0, 0]);
        let pins = select_pins(&c, |_, _| 10, 30);
        assert_eq!(pins, vec![(3, 0), (3, 2), (5, 0)]);
        assert_eq!(select_pins(&c, |_, _| 10, 9), vec![]);
        assert_eq!(
            select_pins(&c, |_, _| 1, 100).len(),
            5,
            "zero counts never pinned"
        );
    }

    /// An expert priced u64::MAX ("never pin", as resident layers' are) after a chosen one
    /// must not wrap the running sum into a small number and be pinned.
    #[test]
    fn never_pin_prices_do_not_wrap_the_sum() {
        let c = counts([9, 0, 0, 0], [8, 7, 0, 0]);
        let bytes = |l: usize, _: usize| if l == 5 { u64::MAX } else { 10 };
        assert_eq!(select_pins(&c, bytes, 30), vec![(3, 0)]);
    }
}
