//! Loads in the mapped mode: a checked, populated range of the shard's mapping.

use std::sync::atomic::Ordering;

use memmap2::{Advice, Mmap};

use super::resident::{Buf, Resident};
use super::{truncated, Files, PAGE};
use crate::error::{Error, Result};
use crate::experts::source::ExpertLoc;

impl Files {
    pub(super) fn load_mapped(&self, loc: &ExpertLoc) -> Result<(Resident, u64)> {
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
}
