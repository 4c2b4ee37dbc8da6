//! Getting an expert's bytes into memory, three ways ([`IoMode`]):
//! - `Mmap`: zero-copy views of the mapped shards. A load is `madvise(WILLNEED)` plus
//!   `MADV_POPULATE_READ` (touching each page where the kernel lacks it) on the I/O thread,
//!   so the kernels never page-fault on disk. Eviction drops the page-table entries
//!   (`MADV_DONTNEED`); the page cache itself belongs to the kernel.
//! - `Pread`: one `pread` per group of adjacent ranges (gate/up/down and their scales are
//!   adjacent in our containers, so one read per expert) into an owned page-aligned slab.
//! - `Direct`: like `Pread` through an `O_DIRECT` descriptor with 4 KiB-aligned ranges,
//!   bypassing the page cache; where the filesystem refuses O_DIRECT it falls back to
//!   buffered reads with one warning.
//!
//! Scales are used in place when 4-byte aligned, otherwise copied into a small `Vec<f32>`.
//! A file that is shorter than an expert's range (truncated after open) gives
//! `Error::Container` naming the file and tensor; an OS error gives `Error::Io` naming the
//! file. Nothing here panics or raises SIGBUS on a bad file: the mapped mode checks the
//! file size (`fstat`) before touching pages, and populating reports errors as values.

mod mapped;
mod owned;
mod resident;
mod slab;

use std::fs::File;
use std::os::fd::AsRawFd;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

use memmap2::{Advice, Mmap};

#[cfg(any(test, feature = "testing"))]
use super::fault::{FaultInjector, FaultKind};
use super::source::{ByteRange, ExpertLoc, MatrixLoc};
use super::warn_once;
use crate::container::regular_file;
use crate::error::{Error, Result};

use owned::plan;
pub(crate) use resident::Resident;
use slab::{slab_len, SlabPool};

/// How expert bytes get from disk to memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum IoMode {
    /// Zero-copy views of the mapped shards.
    Mmap,
    /// `pread` into owned page-aligned slabs.
    #[default]
    Pread,
    /// `O_DIRECT` reads into owned slabs, bypassing the page cache.
    Direct,
}

impl IoMode {
    pub fn parse(s: &str) -> Result<Self> {
        match s {
            "mmap" => Ok(IoMode::Mmap),
            "pread" => Ok(IoMode::Pread),
            "direct" => Ok(IoMode::Direct),
            _ => Err(Error::invalid(
                "io",
                format!("unknown I/O mode '{s}'; expected one of mmap, pread, direct"),
            )),
        }
    }
    pub fn name(self) -> &'static str {
        match self {
            IoMode::Mmap => "mmap",
            IoMode::Pread => "pread",
            IoMode::Direct => "direct",
        }
    }
}

/// O_DIRECT alignment (offsets, lengths and buffers); 4 KiB covers every common device.
const DIRECT_ALIGN: u64 = 4096;
/// Ranges of one file closer than this are read with one call (the gap is read and ignored).
const MERGE_GAP: u64 = 1 << 20;
const PAGE: usize = 4096;

struct Shard {
    path: PathBuf,
    file: File,
    direct: Option<File>,
    map: Option<Arc<Mmap>>,
}

/// The open shard files of a store, in one I/O mode.
pub(crate) struct Files {
    shards: Vec<Shard>,
    mode: IoMode,
    direct_ok: AtomicBool,
    populate_ok: AtomicBool,
    pub pool: Arc<SlabPool>,
    /// Test fault injection (feature `testing`).
    #[cfg(any(test, feature = "testing"))]
    pub faults: FaultInjector,
}

fn truncated(path: &Path, m: &MatrixLoc, r: ByteRange, have: u64) -> Error {
    Error::container(
        path,
        Some(&m.name),
        format!(
            "needs bytes {}..{} but the file now ends at byte {have}; the shard was truncated \
             or replaced while colibri was running",
            r.offset,
            r.end()
        ),
    )
}

impl Files {
    pub fn open(paths: &[PathBuf], mode: IoMode, pool_slabs: usize) -> Result<(Self, Vec<u64>)> {
        let mut shards = Vec::with_capacity(paths.len());
        let mut lens = Vec::with_capacity(paths.len());
        let mut direct_ok = mode == IoMode::Direct;
        for p in paths {
            let file = regular_file::open_read(p).map_err(|e| Error::io(p, e))?;
            let len = file.metadata().map_err(|e| Error::io(p, e))?.len();
            let map = if mode == IoMode::Mmap {
                // SAFETY: a read-only shared mapping of a file we opened. Another process could
                // truncate or rewrite it; before touching pages a load checks the file size
                // (fstat) and populates with MADV_POPULATE_READ, which reports errors as values.
                let m = unsafe { Mmap::map(&file) }.map_err(|e| Error::io(p, e))?;
                Some(Arc::new(m))
            } else {
                None
            };
            let direct = if direct_ok {
                match std::fs::OpenOptions::new()
                    .read(true)
                    .custom_flags(libc::O_DIRECT)
                    .open(p)
                {
                    Ok(f) => Some(f),
                    Err(e) => {
                        direct_ok = false;
                        warn_once(
                            "direct-open",
                            &format!(
                                "{}: O_DIRECT refused ({e}); using buffered reads instead",
                                p.display()
                            ),
                        );
                        None
                    }
                }
            } else {
                None
            };
            lens.push(len);
            shards.push(Shard {
                path: p.clone(),
                file,
                direct,
                map,
            });
        }
        Ok((
            Files {
                shards,
                mode,
                direct_ok: AtomicBool::new(direct_ok),
                populate_ok: AtomicBool::new(true),
                pool: Arc::new(SlabPool::new(pool_slabs)),
                #[cfg(any(test, feature = "testing"))]
                faults: FaultInjector::default(),
            },
            lens,
        ))
    }

    /// The mode in effect (`Direct` reads as `Pread` after a fallback).
    pub fn mode(&self) -> IoMode {
        if self.mode == IoMode::Direct && !self.direct_ok.load(Ordering::Relaxed) {
            IoMode::Pread
        } else {
            self.mode
        }
    }

    /// Load one expert. Returns it and the bytes read from the files.
    pub fn load(&self, loc: &ExpertLoc) -> Result<(Resident, u64)> {
        match self.mode {
            IoMode::Mmap => self.load_mapped(loc),
            IoMode::Pread | IoMode::Direct => self.load_owned(loc),
        }
    }

    fn align(&self) -> u64 {
        if self.mode == IoMode::Direct && self.direct_ok.load(Ordering::Relaxed) {
            DIRECT_ALIGN
        } else {
            1
        }
    }

    /// The bytes a load of `loc` will hold (what the budget is charged): the mapped ranges or
    /// the slabs (alignment slack included), plus scales that must be copied to be aligned.
    pub fn expected_bytes(&self, loc: &ExpertLoc) -> u64 {
        let misaligned = |r: ByteRange, base: u64| {
            if !(r.offset - base).is_multiple_of(4) || cfg!(target_endian = "big") {
                r.len
            } else {
                0
            }
        };
        if self.mode == IoMode::Mmap {
            return loc
                .ranges()
                .map(|(m, r)| {
                    r.len
                        + if Some(r) == m.scales {
                            misaligned(r, 0)
                        } else {
                            0
                        }
                })
                .sum();
        }
        let p = plan(loc, self.align());
        let slabs: u64 = p
            .groups
            .iter()
            .map(|g| slab_len((g.2 - g.1) as usize) as u64)
            .sum();
        let copies: u64 = loc
            .ranges()
            .enumerate()
            .filter(|(_, (m, r))| Some(*r) == m.scales)
            .map(|(i, (_, r))| misaligned(r, p.groups[p.group_of[i]].1))
            .sum();
        slabs + copies
    }

    /// Page-cache hint for an expert (WILLNEED on the mapping or the file).
    pub fn hint(&self, loc: &ExpertLoc) {
        for (_, r) in loc.ranges() {
            let sh = &self.shards[r.file];
            if let Some(map) = &sh.map {
                if r.end() <= map.len() as u64 {
                    let _ = map.advise_range(Advice::WillNeed, r.offset as usize, r.len as usize);
                }
            } else {
                fadvise(&sh.file, r.offset, r.len, libc::POSIX_FADV_WILLNEED);
            }
        }
    }

    /// Drop the shards' pages from the page cache (cold-cache benches and tests).
    pub fn drop_page_cache(&self) {
        for sh in &self.shards {
            fadvise(&sh.file, 0, 0, libc::POSIX_FADV_DONTNEED);
        }
    }
}

/// Test fault injection (feature `testing`; [`FaultInjector`]): what one read of a shard is
/// made to do. Without the feature these are no-ops and the shipped build has no hooks.
#[cfg(any(test, feature = "testing"))]
impl Files {
    /// A mapped read of `m`'s range `r` in `sh`: the injected failure, if any.
    fn mapped_fault(&self, sh: &Shard, m: &MatrixLoc, r: ByteRange) -> Result<()> {
        let Some(k) = self.faults.check(&sh.path) else {
            return Ok(());
        };
        Err(match (k.io_error(), k) {
            (Some(e), _) => Error::io(&sh.path, e),
            (None, FaultKind::ShortRead(n)) => truncated(&sh.path, m, r, r.offset + n as u64),
            (None, _) => Error::Internal("fault without error".into()),
        })
    }

    /// A read of `sh` into `len` bytes: the injected OS error, or how many bytes the read may
    /// deliver and whether an O_DIRECT read is refused (when `direct`).
    fn read_fault(&self, sh: &Shard, len: usize, direct: bool) -> Result<(usize, bool)> {
        match self.faults.check(&sh.path).map(|k| (k.io_error(), k)) {
            Some((Some(e), _)) => Err(Error::io(&sh.path, e)),
            Some((None, FaultKind::ShortRead(n))) => Ok((n.min(len), false)),
            Some((None, FaultKind::DirectRefused)) => Ok((len, direct)),
            _ => Ok((len, false)),
        }
    }
}

#[cfg(not(any(test, feature = "testing")))]
impl Files {
    #[inline(always)]
    fn mapped_fault(&self, _: &Shard, _: &MatrixLoc, _: ByteRange) -> Result<()> {
        Ok(())
    }

    #[inline(always)]
    fn read_fault(&self, _: &Shard, len: usize, _: bool) -> Result<(usize, bool)> {
        Ok((len, false))
    }
}

/// `posix_fadvise` on a whole file or range; advisory, so failures are ignored.
pub(crate) fn fadvise(f: &File, offset: u64, len: u64, advice: libc::c_int) {
    // SAFETY: plain syscall on a descriptor we own; no memory is passed.
    let _ = unsafe {
        libc::posix_fadvise(
            f.as_raw_fd(),
            offset as libc::off_t,
            len as libc::off_t,
            advice,
        )
    };
}
