//! Read-only memory maps of shard files: the one place in the container that uses `unsafe`.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{Error, Result};

/// A shard file mapped read-only, shared by every weight that views it.
#[derive(Debug)]
pub struct MappedFile {
    path: PathBuf,
    map: Option<Mmap>,
}

impl MappedFile {
    /// Map `path` read-only. An empty file gets no mapping (mapping 0 bytes fails on Linux).
    pub fn open(path: &Path) -> Result<Arc<Self>> {
        let file = File::open(path).map_err(|e| Error::io(path, e))?;
        let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
        let map = if len == 0 {
            None
        } else {
            // SAFETY: the file is opened read-only and we never write through the map. The
            // remaining hazard of a file mapping — another process truncating or rewriting
            // the shard while it is mapped — is outside what Rust can guard against; a model
            // directory must not be modified while colibri has it open (documented in
            // docs/container.md). All offsets into the map are validated against its length
            // before use.
            Some(unsafe { Mmap::map(&file) }.map_err(|e| Error::io(path, e))?)
        };
        Ok(Arc::new(MappedFile {
            path: path.to_path_buf(),
            map,
        }))
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.map.as_deref().unwrap_or(&[])
    }

    /// Bytes `start..end`, or an error naming the file and tensor when out of range.
    pub fn slice(&self, start: usize, end: usize, tensor: &str) -> Result<&[u8]> {
        self.bytes().get(start..end).ok_or_else(|| {
            Error::container(
                &self.path,
                Some(tensor),
                format!(
                    "bytes {start}..{end} lie outside the {}-byte file",
                    self.bytes().len()
                ),
            )
        })
    }

    /// Hint the kernel about the access pattern of a byte range (best effort).
    #[cfg(unix)]
    pub fn advise(&self, start: usize, end: usize, advice: memmap2::Advice) {
        if let Some(m) = &self.map {
            if start < end && end <= m.len() {
                let _ = m.advise_range(advice, start, end - start);
            }
        }
    }
}
