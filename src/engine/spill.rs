//! Where idle sessions are spilled: a directory of this user's that no one else can write.
//!
//! A spill file is a conversation's KV cache, read back as the session's state, so the
//! directory must be private. [`SpillDir::resolve`] takes `spill_dir`, else `sessions/` in
//! the cache directory, else (no `COLIBRI_CACHE_DIR`, `XDG_CACHE_HOME` or `HOME`) a private
//! directory made for this engine in the system temporary directory
//! (`colibri-sessions-<pid>-<random>`, 0700, created exclusively, removed when the engine
//! drops), never a shared fixed name such as `/tmp/sessions`. A directory that exists must be
//! a real directory (not a symbolic link), owned by this user and writable by no one else,
//! else the engine does not open ([`Error::InvalidArgument`] naming `spill_dir`). One that
//! does not exist yet is created 0700 when the first session is spilled, and checked again.
//!
//! Files of processes that are gone are swept when a directory is opened. A process's pid
//! alone does not say that: containers sharing a cache volume each have their own pid
//! namespace, where another one's live process looks gone. So each process that spills into
//! a directory holds an advisory lock (`flock`) on `<pid>-<nonce>.lock` there for as long as
//! it lives, and a file is swept only when its pid is gone here **and** that lock is free
//! (or, for files of before the lock, absent).

use std::collections::HashMap;
use std::fs::File;
use std::os::unix::fs::{DirBuilderExt, MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::Mutex;

use crate::container::regular_file::random_name_part as random_u64;
use crate::{Error, Result};

/// The prefix of the private directories made when there is no cache directory.
const PRIVATE_PREFIX: &str = "colibri-sessions-";

/// The uid that owns what this process creates (`/proc/self`'s owner); `None` where
/// `/proc` is absent.
fn own_uid() -> Option<u32> {
    std::fs::metadata("/proc/self").ok().map(|m| m.uid())
}

/// The engine's spill directory.
#[derive(Debug)]
pub(super) struct SpillDir {
    pub(super) path: PathBuf,
    /// Made for this engine (no cache directory): removed with it.
    private: bool,
}

impl SpillDir {
    /// `explicit` (`spill_dir`), else `sessions/` in `cache` (the cache directory), else a
    /// new private directory in the system temporary directory; an existing one is checked
    /// ([`check_private`]) and swept of dead processes' files.
    pub(super) fn resolve(explicit: Option<&Path>, cache: Option<PathBuf>) -> Result<Self> {
        let dir = match (explicit, cache) {
            (Some(dir), _) => dir.to_path_buf(),
            (None, Some(cache)) => cache.join("sessions"),
            (None, None) => return Self::private_in(&std::env::temp_dir()),
        };
        check_private(&dir)?;
        sweep_spill_dir(&dir);
        Ok(SpillDir {
            path: dir,
            private: false,
        })
    }

    /// A new directory `<PRIVATE_PREFIX><pid>-<random>` in `parent`, 0700, made by a
    /// `mkdir` that fails if the name exists (so never a directory or link planted there);
    /// the ones of processes that are gone are removed first.
    pub(super) fn private_in(parent: &Path) -> Result<Self> {
        sweep_private_dirs(parent);
        let mut last = None;
        for _ in 0..16 {
            let name = format!(
                "{PRIVATE_PREFIX}{}-{:016x}",
                std::process::id(),
                random_u64()
            );
            let path = parent.join(name);
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => {
                    hold_owner_lock(&path)?;
                    return Ok(SpillDir {
                        path,
                        private: true,
                    });
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(e) => return Err(Error::io(&path, e)),
            }
        }
        Err(Error::io(
            parent,
            last.unwrap_or_else(|| std::io::Error::other("no free name")),
        ))
    }

    /// Make the directory (0700, with any missing parents) if it is not there yet, and check
    /// it: called before each spill, so a directory replaced since the open is refused too.
    pub(super) fn ensure(&self) -> Result<()> {
        if std::fs::symlink_metadata(&self.path).is_err() {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(&self.path)
                .map_err(|e| Error::io(&self.path, e))?;
        }
        check_private(&self.path)?;
        hold_owner_lock(&self.path)
    }
}

impl Drop for SpillDir {
    fn drop(&mut self) {
        if self.private {
            let _ = std::fs::remove_dir_all(&self.path);
            if let Ok(mut held) = HELD_LOCKS.lock() {
                held.remove(&self.path);
            }
        }
    }
}

/// The owner locks this process holds, by directory: taken once per directory and kept for
/// the life of the process (several engines may spill into one directory), except a private
/// directory's, released when it is removed.
static HELD_LOCKS: std::sync::LazyLock<Mutex<HashMap<PathBuf, File>>> =
    std::sync::LazyLock::new(|| Mutex::new(HashMap::new()));

/// This process's random nonce: in its spill names and its owner lock's name.
fn nonce() -> u64 {
    static NONCE: std::sync::OnceLock<u64> = std::sync::OnceLock::new();
    *NONCE.get_or_init(random_u64)
}

fn owner_lock_name(pid: u32, nonce: u64) -> String {
    format!("{pid}-{nonce:016x}.lock")
}

/// Take (once per directory) this process's owner lock in `dir`: made under a name the
/// sweep ignores, locked, then renamed into place, so no other process ever sees the name
/// unlocked while this one lives.
fn hold_owner_lock(dir: &Path) -> Result<()> {
    let mut held = HELD_LOCKS
        .lock()
        .map_err(|_| Error::Internal("the spill lock registry is poisoned".into()))?;
    if held.contains_key(dir) {
        return Ok(());
    }
    let name = owner_lock_name(std::process::id(), nonce());
    let fresh = dir.join(format!(".{name}.new.{:016x}", random_u64()));
    let file = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .custom_flags(libc::O_NOFOLLOW)
        .open(&fresh)
        .map_err(|e| Error::io(&fresh, e))?;
    let locked = file
        .try_lock()
        .map_err(|e| Error::io(&fresh, std::io::Error::other(e.to_string())))
        .and_then(|()| std::fs::rename(&fresh, dir.join(&name)).map_err(|e| Error::io(dir, e)));
    if let Err(e) = locked {
        let _ = std::fs::remove_file(&fresh);
        return Err(e);
    }
    held.insert(dir.to_path_buf(), file);
    Ok(())
}

/// Whether the owner lock `path` is free: absent (a process of before the lock, or one
/// whose lock was already swept), or a regular file nobody holds. Anything else (held, not
/// a regular file, unreadable) counts as a live owner: its files are kept.
fn owner_lock_is_free(path: &Path) -> bool {
    let file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_NONBLOCK)
        .open(path);
    match file {
        Err(e) => e.kind() == std::io::ErrorKind::NotFound,
        Ok(f) => f.metadata().is_ok_and(|m| m.is_file()) && f.try_lock().is_ok(),
    }
}

/// `Ok` when `dir` does not exist, or is a directory (not a symbolic link) owned by this
/// user that neither its group nor others can write; else the [`Error::InvalidArgument`]
/// for `spill_dir` that says which and what to do.
pub(super) fn check_private(dir: &Path) -> Result<()> {
    check_private_as(dir, own_uid())
}

/// [`check_private`] for the user `uid` (`None`: the owner is not checked).
pub(super) fn check_private_as(dir: &Path, uid: Option<u32>) -> Result<()> {
    let meta = match std::fs::symlink_metadata(dir) {
        Ok(m) => m,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(()),
        Err(e) => return Err(Error::io(dir, e)),
    };
    let why = if meta.file_type().is_symlink() {
        "is a symbolic link".to_owned()
    } else if !meta.is_dir() {
        "is not a directory".to_owned()
    } else if uid.is_some_and(|u| u != meta.uid()) {
        format!("belongs to another user (uid {})", meta.uid())
    } else if meta.mode() & 0o022 != 0 {
        format!(
            "can be written by other users (mode {:04o}); `chmod go-w` it",
            meta.mode() & 0o7777
        )
    } else {
        return Ok(());
    };
    Err(Error::invalid(
        "spill_dir",
        format!(
            "the directory for idle sessions {} {why}: their KV caches (the conversations) \
             are written there and read back, so it must be a directory of this user's that \
             no one else can write; give spill_dir (or COLIBRI_CACHE_DIR) another",
            dir.display()
        ),
    ))
}

/// `<pid>-<nonce>-<engine>-<session>.ctx`: the process (for the sweep of dead ones' files)
/// and a random per-process nonce, so processes sharing a cache volume with the same pid
/// (PID 1 in two containers) never restore each other's files.
pub(super) fn spill_file(dir: &Path, engine: u64, session: u64) -> PathBuf {
    dir.join(format!(
        "{}-{:016x}-{engine}-{session}.ctx",
        std::process::id(),
        nonce()
    ))
}

fn process_is_gone(pid: u32) -> bool {
    !Path::new("/proc").join(pid.to_string()).exists()
}

/// The owner (pid, nonce) of a spill directory entry of ours by name: a spill file
/// `<pid>-<nonce>-<engine>-<session>.ctx`, its temporary `.<spill file>.tmp.<...>`, an owner
/// lock `<pid>-<nonce>.lock` or one being made, `.<pid>-<nonce>.lock.new.<random>`.
fn entry_owner(name: &str) -> Option<(u32, u64)> {
    let base = match name.strip_prefix('.') {
        Some(hidden) => hidden
            .split_once(".ctx.tmp.")
            .map(|(spill, _)| spill)
            .or_else(|| hidden.split_once(".lock.new.").map(|(lock, _)| lock))?,
        None => name
            .strip_suffix(".ctx")
            .or_else(|| name.strip_suffix(".lock"))?,
    };
    let mut parts = base.split('-');
    let pid = parts.next()?.parse::<u32>().ok()?;
    // A nonce of 16 hex digits; older spill names had none (`<pid>-<engine>-<session>`).
    let nonce = parts
        .next()
        .filter(|n| n.len() == 16)
        .and_then(|n| u64::from_str_radix(n, 16).ok())
        .unwrap_or(0);
    Some((pid, nonce))
}

/// Remove the spill files, temporaries and owner locks of processes that are gone: ours by
/// name and owner, regular files only, and only when the process's pid is gone here and its
/// owner lock is free (a live process in another pid namespace holds its lock). Where
/// `/proc` does not tell which processes live, nothing is removed.
fn sweep_spill_dir(dir: &Path) {
    let Some(me) = own_uid() else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let mut gone: HashMap<(u32, u64), bool> = HashMap::new();
    let mut locks = Vec::new();
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some((pid, nonce)) = entry_owner(&name) else {
            continue;
        };
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        if !(meta.is_file() && meta.uid() == me) {
            continue;
        }
        let owner_gone = *gone.entry((pid, nonce)).or_insert_with(|| {
            process_is_gone(pid) && owner_lock_is_free(&dir.join(owner_lock_name(pid, nonce)))
        });
        if !owner_gone {
            continue;
        }
        if name.ends_with(".lock") {
            locks.push(entry.path()); // last: it tells others the files are not yet swept
        } else {
            let _ = std::fs::remove_file(entry.path());
        }
    }
    for lock in locks {
        let _ = std::fs::remove_file(lock);
    }
}

/// Remove the private spill directories in `parent` of processes that are gone (a crash
/// leaves them): real directories of ours, by name, whose owner locks are all free.
fn sweep_private_dirs(parent: &Path) {
    let Some(me) = own_uid() else {
        return;
    };
    let Ok(entries) = std::fs::read_dir(parent) else {
        return;
    };
    for entry in entries.flatten() {
        let name = entry.file_name().to_string_lossy().into_owned();
        let Some(pid) = name
            .strip_prefix(PRIVATE_PREFIX)
            .and_then(|rest| rest.split('-').next())
            .and_then(|p| p.parse::<u32>().ok())
        else {
            continue;
        };
        let Ok(meta) = entry.path().symlink_metadata() else {
            continue;
        };
        if process_is_gone(pid) && meta.is_dir() && meta.uid() == me && no_lock_held(&entry.path())
        {
            let _ = std::fs::remove_dir_all(entry.path());
        }
    }
}

/// Whether no owner lock in `dir` is held (an unreadable directory: one may be).
fn no_lock_held(dir: &Path) -> bool {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return false;
    };
    entries.flatten().all(|e| {
        let name = e.file_name();
        !name.to_string_lossy().ends_with(".lock") || owner_lock_is_free(&e.path())
    })
}
