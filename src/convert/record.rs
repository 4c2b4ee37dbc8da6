//! The progress record, `DST/.colibri-convert.json`: for every finished output shard, the
//! fingerprint of each source file it was made from (its stat stamp, and a CRC-32 of the
//! bytes the converter read from it for that shard, in reading order).
//!
//! A source that changes while it is converted is an error (the shard being written is not
//! renamed into place); on a re-run, a finished shard is kept only when its sources still
//! carry the recorded stamps, or, where a stamp differs, when re-reading them gives the
//! recorded CRC. Otherwise the shard is converted again. docs/container.md ("Resumable").

use std::collections::BTreeMap;
use std::fs::Metadata;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

use crate::container::regular_file;
use crate::error::{Error, Result};

/// The record's file name in DST.
pub(super) const RECORD_NAME: &str = ".colibri-convert.json";
const RECORD_VERSION: u32 = 1;
/// A record larger than this is not ours (one entry is ~300 bytes).
const MAX_RECORD_BYTES: u64 = 64 << 20;

/// What stat says about a file: any write through the kernel changes `ctime` (which no
/// utility can set back), a file renamed over it changes `ino`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct Stamp {
    pub(super) size: u64,
    pub(super) mtime_ns: i64,
    pub(super) ctime_ns: i64,
    pub(super) dev: u64,
    pub(super) ino: u64,
}

impl Stamp {
    pub(super) fn of(meta: &Metadata) -> Stamp {
        #[cfg(unix)]
        {
            use std::os::unix::fs::MetadataExt;
            let ns = |s: i64, n: i64| s.saturating_mul(1_000_000_000).saturating_add(n);
            Stamp {
                size: meta.len(),
                mtime_ns: ns(meta.mtime(), meta.mtime_nsec()),
                ctime_ns: ns(meta.ctime(), meta.ctime_nsec()),
                dev: meta.dev(),
                ino: meta.ino(),
            }
        }
        #[cfg(not(unix))]
        {
            let mtime_ns = meta
                .modified()
                .ok()
                .and_then(|t| t.duration_since(UNIX_EPOCH).ok())
                .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX));
            Stamp {
                size: meta.len(),
                mtime_ns,
                ctime_ns: 0,
                dev: 0,
                ino: 0,
            }
        }
    }

    /// Which fields differ from `then`, in words.
    pub(super) fn describe_change(&self, then: &Stamp) -> String {
        let mut parts = Vec::new();
        if self.dev != then.dev || self.ino != then.ino {
            parts.push("replaced by another file (inode changed)".to_string());
        }
        if self.size != then.size {
            parts.push(format!("size {} → {} bytes", then.size, self.size));
        }
        if self.mtime_ns != then.mtime_ns {
            parts.push("modification time changed".to_string());
        }
        if self.ctime_ns != then.ctime_ns {
            parts.push("status change time changed (written to)".to_string());
        }
        parts.join(", ")
    }
}

/// CRC-32 and count of the bytes read from one source file.
#[derive(Debug, Clone, Default)]
pub(super) struct Digest {
    hasher: crc32fast::Hasher,
    bytes: u64,
}

impl Digest {
    pub(super) fn update(&mut self, b: &[u8]) {
        self.hasher.update(b);
        self.bytes += b.len() as u64;
    }
    fn value(&self) -> (u32, u64) {
        (self.hasher.clone().finalize(), self.bytes)
    }
}

/// The running digests of one output shard, per source file index.
pub(super) type Digests = BTreeMap<usize, Digest>;

/// One source file of a finished shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct SourceEntry {
    pub(super) file: String,
    pub(super) stamp: Stamp,
    pub(super) crc32: u32,
    pub(super) bytes: u64,
}

impl SourceEntry {
    pub(super) fn new(file: String, stamp: Stamp, digest: &Digest) -> SourceEntry {
        let (crc32, bytes) = digest.value();
        SourceEntry {
            file,
            stamp,
            crc32,
            bytes,
        }
    }
    /// Whether `digest` is of the bytes this entry records.
    pub(super) fn matches(&self, digest: &Digest) -> bool {
        digest.value() == (self.crc32, self.bytes)
    }
}

/// One finished output shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub(super) struct ShardEntry {
    /// CRC-32 of the shard's header (an entry of another plan does not vouch for this one).
    pub(super) header_crc32: u32,
    /// In source file order.
    pub(super) sources: Vec<SourceEntry>,
    /// Wall-clock time the entry was written, ns since the Unix epoch.
    pub(super) recorded_ns: i64,
}

/// How close before the record a source's last change may be for its stamp not to prove
/// that the bytes read are still there: file times tick coarsely (a few ms on Linux, 1–2 s
/// on some file systems), so a write in the same tick as the change before it leaves the
/// stamp as it was. Such "racy" entries are checked by reading (as git does for its index).
const RACY_NS: i64 = 2_000_000_000;

impl ShardEntry {
    /// Whether `stamp`, recorded here, changed too close to when the entry was written to
    /// vouch for the bytes by itself.
    pub(super) fn is_racy(&self, stamp: &Stamp) -> bool {
        stamp.mtime_ns.max(stamp.ctime_ns) > self.recorded_ns.saturating_sub(RACY_NS)
    }
}

/// Now, ns since the Unix epoch.
pub(super) fn now_ns() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| i64::try_from(d.as_nanos()).unwrap_or(i64::MAX))
}

#[derive(Debug, Default, Serialize, Deserialize)]
pub(super) struct Record {
    colibri_convert_record: u32,
    pub(super) shards: BTreeMap<String, ShardEntry>,
}

pub(super) fn header_crc(header: &[u8]) -> u32 {
    crc32fast::hash(header)
}

impl Record {
    /// DST's record; an absent, unreadable or foreign one is an empty record (every shard
    /// without an entry is converted again, never trusted).
    pub(super) fn load(dst: &Path) -> Record {
        let path = dst.join(RECORD_NAME);
        let Ok(file) = regular_file::open_read(&path) else {
            return Record::default();
        };
        let mut text = String::new();
        if file
            .take(MAX_RECORD_BYTES)
            .read_to_string(&mut text)
            .is_err()
        {
            return Record::default();
        }
        match serde_json::from_str::<Record>(&text) {
            Ok(r) if r.colibri_convert_record == RECORD_VERSION => r,
            _ => Record::default(),
        }
    }

    /// Write the record to DST (a synced temporary file renamed over the old one).
    pub(super) fn save(&mut self, dst: &Path) -> Result<()> {
        self.colibri_convert_record = RECORD_VERSION;
        let text = serde_json::to_string_pretty(self)
            .map_err(|e| Error::Internal(format!("serialising the conversion record: {e}")))?;
        let tmp: PathBuf = dst.join(format!("{RECORD_NAME}.partial"));
        let to = dst.join(RECORD_NAME);
        let write = || -> std::io::Result<()> {
            let mut f = std::fs::File::create(&tmp)?;
            std::io::Write::write_all(&mut f, text.as_bytes())?;
            f.sync_all()
        };
        write().map_err(|e| Error::io(&tmp, e))?;
        std::fs::rename(&tmp, &to).map_err(|e| Error::io(&to, e))
    }
}
