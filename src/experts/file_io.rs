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

use std::fs::File;
use std::ops::Range;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;

use memmap2::{Advice, Mmap, MmapMut, MmapOptions, UncheckedAdvice};

#[cfg(any(test, feature = "testing"))]
use super::fault::{FaultInjector, FaultKind};
use super::source::{ByteRange, ExpertLoc, MatrixLoc};
use super::{lock, warn_once, ExpertView};
use crate::container::{finite, Dtype, SCALES_SUFFIX};
use crate::error::{Error, Result};
use crate::quant::{QMatrix, QuantFormat};

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

/// Bytes of owned buffers alive (the real allocation of pread/direct slabs and copied scales).
#[derive(Debug, Default)]
pub(crate) struct Gauge {
    live: AtomicU64,
    peak: AtomicU64,
}

impl Gauge {
    fn add(&self, n: u64) {
        let v = self.live.fetch_add(n, Ordering::Relaxed) + n;
        self.peak.fetch_max(v, Ordering::Relaxed);
    }
    fn sub(&self, n: u64) {
        self.live.fetch_sub(n, Ordering::Relaxed);
    }
    pub fn live(&self) -> u64 {
        self.live.load(Ordering::Relaxed)
    }
    pub fn peak(&self) -> u64 {
        self.peak.load(Ordering::Relaxed)
    }
    pub fn reset_peak(&self) {
        self.peak.store(self.live(), Ordering::Relaxed);
    }
}

enum Buf {
    Mapped(Arc<Mmap>),
    Owned(MmapMut),
}

impl Buf {
    fn bytes(&self) -> &[u8] {
        match self {
            Buf::Mapped(m) => m,
            Buf::Owned(m) => m,
        }
    }
}

enum Scales {
    None,
    InPlace { buf: usize, range: Range<usize> },
    Owned(Vec<f32>),
}

struct MatPlace {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    buf: usize,
    data: Range<usize>,
    scales: Scales,
}

/// Slab sizes are rounded up (to 64 KiB from 1 MiB up, else to pages) so that the experts of
/// one layer share slab sizes whatever their alignment slack.
pub(crate) fn slab_len(len: usize) -> usize {
    let round = if len >= 1 << 20 { 64 << 10 } else { PAGE };
    len.div_ceil(round).max(1) * round
}

/// Owned read buffers, recycled: a fresh anonymous mapping per load costs a page fault and a
/// zeroed page per 4 KiB (measured 3-4× slower loads under CPU load), so freed slabs wait in
/// a small free list (at most `max_free`, a fixed overhead) for the next load of that size.
/// New slabs are pre-faulted (`MAP_POPULATE`).
pub(crate) struct SlabPool {
    free: std::sync::Mutex<Vec<MmapMut>>,
    max_free: usize,
    /// Every owned byte alive: slabs in use or free, and copied scales.
    pub gauge: Gauge,
}

impl SlabPool {
    pub fn new(max_free: usize) -> Self {
        SlabPool {
            free: std::sync::Mutex::new(Vec::new()),
            max_free,
            gauge: Gauge::default(),
        }
    }

    fn take(&self, len: usize) -> std::io::Result<MmapMut> {
        let len = slab_len(len);
        {
            let mut free = lock(&self.free);
            if let Some(i) = free.iter().position(|m| m.len() == len) {
                return Ok(free.swap_remove(i));
            }
        }
        let m = MmapOptions::new().len(len).populate().map_anon()?;
        self.gauge.add(len as u64);
        Ok(m)
    }

    fn give(&self, m: MmapMut) {
        let mut free = lock(&self.free);
        if free.len() < self.max_free {
            free.push(m);
        } else {
            drop(free);
            self.gauge.sub(m.len() as u64);
        }
    }
}

/// An expert in memory: mapped views or owned slabs, and where each matrix lies in them.
pub(crate) struct Resident {
    bufs: Vec<Buf>,
    mats: [MatPlace; 3],
    /// Bytes of scales copied for alignment (reported to the gauge).
    copied: u64,
    /// (buf, range) of mapped ranges, released with MADV_DONTNEED on drop.
    mapped: Vec<(usize, Range<usize>)>,
    pool: Arc<SlabPool>,
}

impl Resident {
    fn mat(&self, i: usize) -> Result<QMatrix<'_>> {
        let p = &self.mats[i];
        let data = &self.bufs[p.buf].bytes()[p.data.clone()];
        let scales: &[f32] = match &p.scales {
            Scales::None => &[],
            Scales::InPlace { buf, range } => {
                bytemuck::try_cast_slice(&self.bufs[*buf].bytes()[range.clone()])
                    .map_err(|e| Error::Internal(format!("in-place scales not castable: {e}")))?
            }
            Scales::Owned(v) => v,
        };
        QMatrix::new(p.format, p.rows, p.cols, data, scales)
    }

    pub fn view(&self) -> Result<ExpertView<'_>> {
        Ok(ExpertView {
            gate: self.mat(0)?,
            up: self.mat(1)?,
            down: self.mat(2)?,
        })
    }
}

impl Drop for Resident {
    fn drop(&mut self) {
        self.pool.gauge.sub(self.copied);
        for (b, r) in &self.mapped {
            if let Buf::Mapped(map) = &self.bufs[*b] {
                // Only whole pages inside the range, so neighbours keep theirs.
                let start = r.start.div_ceil(PAGE) * PAGE;
                let end = r.end / PAGE * PAGE;
                if end > start {
                    // SAFETY: the map is a read-only MAP_SHARED file mapping: MADV_DONTNEED only
                    // drops page-table entries, and the next access re-reads the same file
                    // bytes, so no live reference observes changed contents.
                    let _ = unsafe {
                        map.unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start)
                    };
                }
            }
        }
        // Owned slabs go back to the pool.
        for b in std::mem::take(&mut self.bufs) {
            if let Buf::Owned(m) = b {
                self.pool.give(m);
            }
        }
    }
}

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
            let file = File::open(p).map_err(|e| Error::io(p, e))?;
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

    fn load_mapped(&self, loc: &ExpertLoc) -> Result<(Resident, u64)> {
        let mut bufs: Vec<Buf> = Vec::new();
        let mut buf_of_file: Vec<(usize, usize)> = Vec::new();
        let mut mapped = Vec::new();
        let mut places = Vec::with_capacity(6);
        let mut bytes = 0;
        for (m, r) in loc.ranges() {
            let sh = &self.shards[r.file];
            let Some(map) = &sh.map else {
                return Err(Error::Internal("mapped load without a map".into()));
            };
            self.mapped_fault(sh, m, r)?;
            let now = sh
                .file
                .metadata()
                .map_err(|e| Error::io(&sh.path, e))?
                .len();
            if r.end() > now || r.end() > map.len() as u64 {
                return Err(truncated(&sh.path, m, r, now.min(map.len() as u64)));
            }
            let (off, len) = (r.offset as usize, r.len as usize);
            // A hint only: failure changes nothing but speed.
            let _ = map.advise_range(Advice::WillNeed, off, len);
            self.populate(map, off, len)
                .map_err(|e| Error::io(&sh.path, e))?;
            let b = match buf_of_file.iter().find(|(f, _)| *f == r.file) {
                Some(&(_, b)) => b,
                None => {
                    bufs.push(Buf::Mapped(map.clone()));
                    buf_of_file.push((r.file, bufs.len() - 1));
                    bufs.len() - 1
                }
            };
            mapped.push((b, off..off + len));
            places.push((b, off..off + len));
            bytes += r.len;
        }
        self.finish(loc, bufs, &places, mapped)
            .map(|res| (res, bytes))
    }

    /// Fault the range in from disk on this thread (MADV_POPULATE_READ, else touch each page).
    fn populate(&self, map: &Mmap, off: usize, len: usize) -> std::io::Result<()> {
        if len == 0 {
            return Ok(());
        }
        if self.populate_ok.load(Ordering::Relaxed) {
            match map.advise_range(Advice::PopulateRead, off, len) {
                Ok(()) => return Ok(()),
                Err(e) if e.raw_os_error() == Some(libc::EINVAL) => {
                    // Kernel before 5.14.
                    self.populate_ok.store(false, Ordering::Relaxed);
                }
                Err(e) => return Err(e),
            }
        }
        let bytes = &map[off..off + len];
        let mut acc = 0u8;
        for i in (0..len).step_by(PAGE) {
            acc ^= bytes[i];
        }
        std::hint::black_box(acc ^ bytes[len - 1]);
        Ok(())
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

    fn load_owned(&self, loc: &ExpertLoc) -> Result<(Resident, u64)> {
        let align = self.align();
        let direct = align > 1;
        let ranges: Vec<(&MatrixLoc, ByteRange)> = loc.ranges().collect();
        let p = plan(loc, align);
        let mut bufs = Vec::with_capacity(p.groups.len());
        let mut read = 0u64;
        for (gi, &(file, a_start, a_end, end)) in p.groups.iter().enumerate() {
            let sh = &self.shards[file];
            let len = (a_end - a_start) as usize;
            let mut buf = self.pool.take(len).map_err(|e| Error::io(&sh.path, e))?;
            let Some((m, r0)) = (0..ranges.len())
                .find(|&i| p.group_of[i] == gi)
                .map(|i| ranges[i])
            else {
                return Err(Error::Internal("empty read group".into()));
            };
            let need = (end - a_start) as usize;
            let r = self.read_group(sh, &mut buf[..len], a_start, need, direct, m, r0);
            match r {
                Ok(n) => read += n,
                Err(e) => {
                    self.pool.give(buf);
                    for b in bufs {
                        if let Buf::Owned(m) = b {
                            self.pool.give(m);
                        }
                    }
                    return Err(e);
                }
            }
            bufs.push(Buf::Owned(buf));
        }
        let places: Vec<(usize, Range<usize>)> = ranges
            .iter()
            .enumerate()
            .map(|(i, (_, r))| {
                let g = p.group_of[i];
                let o = (r.offset - p.groups[g].1) as usize;
                (g, o..o + r.len as usize)
            })
            .collect();
        self.finish(loc, bufs, &places, Vec::new())
            .map(|res| (res, read))
    }

    /// Read `need` bytes at `offset` into `buf`, through O_DIRECT when `direct`.
    #[allow(clippy::too_many_arguments)]
    fn read_group(
        &self,
        sh: &Shard,
        buf: &mut [u8],
        offset: u64,
        need: usize,
        direct: bool,
        m: &MatrixLoc,
        r: ByteRange,
    ) -> Result<u64> {
        let (limit, mut refuse_direct) = self.read_fault(sh, buf.len(), direct)?;
        let mut file = match (&sh.direct, direct) {
            (Some(f), true) => f,
            _ => &sh.file,
        };
        let mut done = 0usize;
        while done < need {
            let n = if done >= limit {
                0
            } else {
                let res = if std::mem::take(&mut refuse_direct) {
                    Err(std::io::Error::from_raw_os_error(libc::EINVAL))
                } else {
                    file.read_at(&mut buf[done..limit], offset + done as u64)
                };
                match res {
                    Ok(n) => n,
                    Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
                    Err(e) if e.raw_os_error() == Some(libc::EINVAL) && direct => {
                        if self.direct_ok.swap(false, Ordering::Relaxed) {
                            warn_once(
                                "direct-read",
                                &format!(
                                    "{}: O_DIRECT read refused ({e}); using buffered reads",
                                    sh.path.display()
                                ),
                            );
                        }
                        file = &sh.file;
                        continue;
                    }
                    Err(e) => return Err(Error::io(&sh.path, e)),
                }
            };
            if n == 0 {
                return Err(truncated(&sh.path, m, r, offset + done as u64));
            }
            done += n;
        }
        Ok(done as u64)
    }

    /// Build the resident expert from buffers and the (buf, range) of each of its ranges, in
    /// `ExpertLoc::ranges` order.
    fn finish(
        &self,
        loc: &ExpertLoc,
        bufs: Vec<Buf>,
        places: &[(usize, Range<usize>)],
        mapped: Vec<(usize, Range<usize>)>,
    ) -> Result<Resident> {
        let mut it = places.iter();
        let mut next = || {
            it.next()
                .cloned()
                .ok_or_else(|| Error::Internal("range count mismatch".into()))
        };
        let mut mats = Vec::with_capacity(3);
        let mut copied = 0u64;
        for m in loc.mats() {
            let (buf, data) = next()?;
            let scales = match m.scales {
                None => Scales::None,
                Some(_) => {
                    let (sb, range) = next()?;
                    let raw = &bufs[sb].bytes()[range.clone()];
                    if cfg!(target_endian = "little")
                        && bytemuck::try_cast_slice::<u8, f32>(raw).is_ok()
                    {
                        Scales::InPlace { buf: sb, range }
                    } else {
                        copied += raw.len() as u64;
                        Scales::Owned(
                            raw.chunks_exact(4)
                                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                                .collect(),
                        )
                    }
                }
            };
            mats.push(MatPlace {
                format: m.format,
                rows: m.rows,
                cols: m.cols,
                buf,
                data,
                scales,
            });
        }
        let mats: [MatPlace; 3] = mats
            .try_into()
            .map_err(|_| Error::Internal("expert without three matrices".into()))?;
        self.pool.gauge.add(copied);
        let res = Resident {
            bufs,
            mats,
            copied,
            mapped,
            pool: self.pool.clone(),
        };
        // Stored floats checked once per load (scales; every value of a float expert), so a
        // damaged expert is an error naming its tensor rather than a NaN logit.
        for (i, m) in loc.mats().into_iter().enumerate() {
            let q = res.mat(i)?;
            let bad = match m.format {
                QuantFormat::F32 => finite::scan_raw(q.data(), Dtype::F32).map(|b| (b, "")),
                QuantFormat::Bf16 => finite::scan_raw(q.data(), Dtype::Bf16).map(|b| (b, "")),
                QuantFormat::F16 => finite::scan_raw(q.data(), Dtype::F16).map(|b| (b, "")),
                _ => finite::scan_f32(q.scales()).map(|b| (b, SCALES_SUFFIX)),
            };
            if let Some((b, suffix)) = bad {
                let file = self.shards.get(m.data.file).map(|s| s.path.clone());
                return Err(Error::NonFiniteWeight {
                    file: file.unwrap_or_default(),
                    tensor: format!("{}{suffix}", m.name),
                    what: b.describe(),
                    index: b.index,
                });
            }
        }
        Ok(res)
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

/// Read groups of an owned load: ranges of one file that lie close together are read with one
/// call. `groups[g]` = (file, aligned start, aligned end, unaligned end); `group_of[i]` for
/// each range of `ExpertLoc::ranges`.
struct Plan {
    groups: Vec<(usize, u64, u64, u64)>,
    group_of: Vec<usize>,
}

fn plan(loc: &ExpertLoc, align: u64) -> Plan {
    let ranges: Vec<ByteRange> = loc.ranges().map(|(_, r)| r).collect();
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&i| (ranges[i].file, ranges[i].offset));
    let mut spans: Vec<(usize, u64, u64)> = Vec::new();
    let mut group_of = vec![0usize; ranges.len()];
    for &i in &order {
        let r = ranges[i];
        match spans.last_mut() {
            Some(g) if g.0 == r.file && r.offset <= g.2 + MERGE_GAP => g.2 = g.2.max(r.end()),
            _ => spans.push((r.file, r.offset, r.end())),
        }
        group_of[i] = spans.len() - 1;
    }
    let groups = spans
        .into_iter()
        .map(|(f, s, e)| (f, s / align * align, e.div_ceil(align) * align, e))
        .collect();
    Plan { groups, group_of }
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
