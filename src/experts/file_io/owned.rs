//! Loads into owned slabs (`pread`, or O_DIRECT with aligned ranges): adjacent ranges read
//! with one call.

use std::ops::Range;
use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use super::resident::{Buf, Resident};
use super::{truncated, Files, Shard, MERGE_GAP};
use crate::error::{Error, Result};
use crate::experts::source::{ByteRange, ExpertLoc, MatrixLoc};
use crate::experts::warn_once;

impl Files {
    pub(super) fn load_owned(&self, loc: &ExpertLoc) -> Result<(Resident, u64)> {
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
}

/// Read groups of an owned load: ranges of one file that lie close together are read with one
/// call. `groups[g]` = (file, aligned start, aligned end, unaligned end); `group_of[i]` for
/// each range of `ExpertLoc::ranges`.
pub(super) struct Plan {
    pub(super) groups: Vec<(usize, u64, u64, u64)>,
    pub(super) group_of: Vec<usize>,
}

pub(super) fn plan(loc: &ExpertLoc, align: u64) -> Plan {
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
