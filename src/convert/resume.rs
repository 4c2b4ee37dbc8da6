//! Resuming: whether a finished output shard may be kept, checking the sources it was made
//! from against the progress record ([`super::record`]), and entering a shard there once it
//! is written.

use std::fs::File;

use super::plan::{Plan, PlannedShard};
use super::record::{header_crc, now_ns, Digests, Record, ShardEntry, SourceEntry};
use super::source::read_exact_at;
use crate::error::{Error, Result};

/// Where an output shard stands before a run.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ShardStatus {
    /// Its file has the planned header and length, and its sources are what it was made of.
    Done,
    /// No finished file with the planned header and length, or no record of what it was
    /// made from: it is (re)written.
    Missing,
    /// A finished file made from source contents that have changed since: it is rewritten.
    /// The text names the source file and the shard.
    Stale(String),
}

impl Plan {
    /// Whether shard `i` already exists complete in DST and was made from the sources as
    /// they are now (it will be skipped).
    pub fn is_done(&self, i: usize) -> Result<bool> {
        Ok(self.status(i)? == ShardStatus::Done)
    }

    /// Whether shard `i` can be kept. When a source's stat stamp differs from the recorded
    /// one, or changed too close to when it was recorded to prove anything
    /// ([`ShardEntry::is_racy`]), the shard's bytes of its sources are read again and
    /// compared with the recorded CRC-32s: equal, the shard is kept (and the stamps and time
    /// recorded anew); different, it is stale.
    pub fn status(&self, i: usize) -> Result<ShardStatus> {
        let Some(s) = self.shards.get(i) else {
            return Err(Error::invalid("shard", format!("no shard {i}")));
        };
        if !self.file_complete(s) {
            return Ok(ShardStatus::Missing);
        }
        let Some(entry) = self.lock_record()?.shards.get(&s.file_name).cloned() else {
            return Ok(ShardStatus::Missing);
        };
        let files = self.shard_sources(s);
        let names: Vec<String> = files.iter().map(|&f| self.src.file(f).0).collect();
        let recorded: Vec<&str> = entry.sources.iter().map(|e| e.file.as_str()).collect();
        if entry.header_crc32 != header_crc(&s.header) || names != recorded {
            return Ok(ShardStatus::Missing);
        }
        if files.iter().zip(&entry.sources).all(|(&f, e)| {
            let now = self.src.file(f).1;
            now == e.stamp && !entry.is_racy(&now)
        }) {
            return Ok(ShardStatus::Done);
        }
        let digests = self.digest_shard(s)?;
        for (&f, e) in files.iter().zip(&entry.sources) {
            if !e.matches(&digests.get(&f).cloned().unwrap_or_default()) {
                return Ok(ShardStatus::Stale(format!(
                    "{} changed since {} was made from it (its bytes differ from those \
                     recorded); converting that shard again",
                    self.src.dir.join(&e.file).display(),
                    self.dst.join(&s.file_name).display()
                )));
            }
        }
        // Same bytes under a new stamp (touched, copied, restored): keep, and record the
        // stamp so the next run need not read them again.
        self.record_shard(s, &digests)?;
        Ok(ShardStatus::Done)
    }

    /// Whether DST holds shard `s` with exactly the planned header and length.
    fn file_complete(&self, s: &PlannedShard) -> bool {
        let path = self.dst.join(&s.file_name);
        let Ok(file) = File::open(&path) else {
            return false;
        };
        if file.metadata().map(|m| m.len()).ok() != Some(s.total_bytes) {
            return false;
        }
        let mut head = vec![0u8; s.header.len()];
        read_exact_at(&file, &path, &mut head, 0).is_ok() && head == s.header
    }

    /// The source files (indices, ascending) shard `s` reads from.
    fn shard_sources(&self, s: &PlannedShard) -> Vec<usize> {
        let mut files: Vec<usize> = s
            .tensors
            .iter()
            .flat_map(|t| std::iter::once(&t.name).chain(t.scale_inv.as_ref()))
            .map(|n| self.src.tensors[n].shard)
            .collect();
        files.sort_unstable();
        files.dedup();
        files
    }

    /// The digests of the bytes writing `s` reads, read in the same order (each tensor's
    /// FP8 block scales, then the tensor, start to end), without converting anything.
    fn digest_shard(&self, s: &PlannedShard) -> Result<Digests> {
        let mut digests = Digests::new();
        let mut buf = Vec::new();
        for t in &s.tensors {
            for name in t.scale_inv.iter().chain(std::iter::once(&t.name)) {
                let st = &self.src.tensors[name];
                let total = st.end - st.start;
                let step = (self.options.chunk_bytes as u64).min(total).max(1);
                buf.resize(step as usize, 0);
                let mut off = 0;
                while off < total {
                    let n = (total - off).min(step) as usize;
                    self.src.read(st, off, &mut buf[..n], &mut digests)?;
                    off += n as u64;
                }
            }
        }
        Ok(digests)
    }

    /// Every source file `s` read still has the stamp it had when opened, else the error
    /// naming it (`what_then`: what that stops).
    pub(super) fn check_sources(&self, s: &PlannedShard, what_then: &str) -> Result<()> {
        for f in self.shard_sources(s) {
            self.src.check_unchanged(f, what_then)?;
        }
        Ok(())
    }

    /// Enter the finished shard `s`, made from the bytes `digests` summarise, in the record.
    pub(super) fn record_shard(&self, s: &PlannedShard, digests: &Digests) -> Result<()> {
        let sources = self
            .shard_sources(s)
            .into_iter()
            .map(|f| {
                let (file, stamp) = self.src.file(f);
                SourceEntry::new(file, stamp, &digests.get(&f).cloned().unwrap_or_default())
            })
            .collect();
        let entry = ShardEntry {
            header_crc32: header_crc(&s.header),
            sources,
            recorded_ns: now_ns(),
        };
        let mut record = self.lock_record()?;
        record.shards.insert(s.file_name.clone(), entry);
        record.save(&self.dst)
    }

    fn lock_record(&self) -> Result<std::sync::MutexGuard<'_, Record>> {
        self.record
            .lock()
            .map_err(|_| Error::Internal("the conversion record's lock is poisoned".into()))
    }
}
