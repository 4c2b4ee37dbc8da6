//! Shard files read with positioned reads (`pread`) into owned memory. Nothing here maps a
//! file: a shard that is truncated or rewritten while the model is open can only make a read
//! fail, which is reported as an error naming the file and tensor — never a SIGBUS.
//! (The expert store's opt-in `io="mmap"` mode maps shards itself; docs/reliability.md.)

use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Error, Result};

use super::regular_file;
use super::safetensors::{self, Header, MAX_HEADER_BYTES};

/// An open shard file, shared by the container's tensors.
#[derive(Debug)]
pub struct ShardFile {
    path: PathBuf,
    file: File,
    /// Size at open; every tensor range was validated against it.
    len: u64,
}

impl ShardFile {
    /// Open `path` read-only; it must be a regular file.
    pub fn open(path: &Path) -> Result<Arc<Self>> {
        let file = regular_file::open_read(path).map_err(|e| {
            if regular_file::is_not_regular(&e) {
                Error::container(
                    path,
                    None,
                    "not a regular file (a FIFO, device or directory named like a shard)",
                )
            } else {
                Error::io(path, e)
            }
        })?;
        let meta = file.metadata().map_err(|e| Error::io(path, e))?;
        Ok(Arc::new(ShardFile {
            path: path.to_path_buf(),
            file,
            len: meta.len(),
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The file's size when it was opened.
    pub fn len(&self) -> u64 {
        self.len
    }

    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Read and validate the safetensors header (the first 8 + N bytes only).
    pub fn header(&self) -> Result<Header> {
        let len = self.len;
        if len < 8 {
            return safetensors::parse_header(&self.path, &[], len);
        }
        let mut len8 = [0u8; 8];
        self.read_into(0, &mut len8, None)?;
        let n = u64::from_le_bytes(len8);
        if n > MAX_HEADER_BYTES || n.saturating_add(8) > len {
            return safetensors::parse_header(&self.path, &len8, len);
        }
        let mut prefix = vec![0u8; 8 + n as usize];
        self.read_into(0, &mut prefix, None)?;
        safetensors::parse_header(&self.path, &prefix, len)
    }

    /// Bytes `range` of the file into a new vector, or an error naming the file and tensor
    /// when the range lies outside the file (as opened, or as it is now).
    pub fn read(&self, range: Range<usize>, tensor: &str) -> Result<Vec<u8>> {
        self.check_range(&range, tensor)?;
        let mut buf = vec![0u8; range.len()];
        self.read_into(range.start as u64, &mut buf, Some(tensor))?;
        Ok(buf)
    }

    /// Check `range` against the size at open.
    pub fn check_range(&self, range: &Range<usize>, tensor: &str) -> Result<()> {
        if range.start > range.end || range.end as u64 > self.len {
            return Err(Error::container(
                &self.path,
                Some(tensor),
                format!(
                    "bytes {}..{} lie outside the {}-byte file",
                    range.start, range.end, self.len
                ),
            ));
        }
        Ok(())
    }

    /// Fill `buf` from `offset`. A file that ends early (it shrank since it was opened) is
    /// `Error::Container`; an OS error is `Error::Io`.
    pub fn read_into(&self, offset: u64, buf: &mut [u8], tensor: Option<&str>) -> Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            match read_at(&self.file, &mut buf[done..], offset + done as u64) {
                Ok(0) => {
                    let now = self.file.metadata().map(|m| m.len()).unwrap_or(0);
                    return Err(Error::container(
                        &self.path,
                        tensor,
                        format!(
                            "needs bytes {}..{} but the file now ends at byte {now} (it had {} \
                             bytes when opened); the shard was truncated or replaced while \
                             colibri was reading it",
                            offset,
                            offset + buf.len() as u64,
                            self.len
                        ),
                    ));
                }
                Ok(n) => done += n,
                Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
                Err(e) => return Err(Error::io(&self.path, e)),
            }
        }
        Ok(())
    }
}

fn read_at(file: &File, buf: &mut [u8], offset: u64) -> std::io::Result<usize> {
    use std::os::unix::fs::FileExt;
    file.read_at(buf, offset)
}
