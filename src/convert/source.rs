//! The source checkpoint: its shard headers, read without mapping, and positioned reads of
//! its tensors.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use super::record::{Digests, Stamp};
use crate::container::safetensors::{self, Dtype, MAX_HEADER_BYTES};
use crate::container::{regular_file, shard_paths};
use crate::error::{Error, Result};

/// One tensor of a source shard.
#[derive(Debug, Clone)]
pub(super) struct SrcTensor {
    pub(super) name: String,
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    pub(super) shard: usize,
    pub(super) start: u64,
    pub(super) end: u64,
}

/// A source checkpoint opened for positioned reads.
pub(super) struct Source {
    pub(super) dir: PathBuf,
    files: Vec<(PathBuf, Arc<File>)>,
    /// Each file's stamp when it was opened: the plan and every read are of that version.
    stamps: Vec<Stamp>,
    pub(super) tensors: HashMap<String, SrcTensor>,
    /// Names in shard, offset order.
    pub(super) order: Vec<String>,
    /// The FP8 block size (rows, columns) of the weights' `weight_scale_inv` scales.
    pub(super) block: (usize, usize),
}

pub(super) fn read_exact_at(file: &File, path: &Path, buf: &mut [u8], offset: u64) -> Result<()> {
    #[cfg(unix)]
    {
        use std::os::unix::fs::FileExt;
        file.read_exact_at(buf, offset)
            .map_err(|e| Error::io(path, e))
    }
    #[cfg(not(unix))]
    {
        use std::io::{Read, Seek, SeekFrom};
        let mut f = file.try_clone().map_err(|e| Error::io(path, e))?;
        f.seek(SeekFrom::Start(offset))
            .and_then(|_| f.read_exact(buf))
            .map_err(|e| Error::io(path, e))
    }
}

/// Read and validate the header of one safetensors file without mapping it.
fn read_header(path: &Path, file: &File) -> Result<safetensors::Header> {
    let len = file.metadata().map_err(|e| Error::io(path, e))?.len();
    let mut len8 = [0u8; 8];
    if len < 8 {
        return safetensors::parse_header(path, &[], len);
    }
    read_exact_at(file, path, &mut len8, 0)?;
    let n = u64::from_le_bytes(len8);
    if n > MAX_HEADER_BYTES || n.saturating_add(8) > len {
        return safetensors::parse_header(path, &len8, len);
    }
    let mut prefix = vec![0u8; 8 + n as usize];
    read_exact_at(file, path, &mut prefix, 0)?;
    safetensors::parse_header(path, &prefix, len)
}

impl Source {
    pub(super) fn open(dir: &Path, config: &Value) -> Result<Source> {
        let paths = shard_paths(dir)?;
        if paths.is_empty() {
            return Err(Error::container(
                dir,
                None,
                "no *.safetensors shards to convert",
            ));
        }
        let block = match config
            .get("quantization_config")
            .and_then(|q| q.get("weight_block_size"))
            .and_then(Value::as_array)
        {
            Some(b) if b.len() == 2 => {
                let v: Vec<usize> = b
                    .iter()
                    .filter_map(|x| x.as_u64().and_then(|x| usize::try_from(x).ok()))
                    .filter(|&x| x > 0)
                    .collect();
                if v.len() != 2 {
                    return Err(Error::Config {
                        path: dir.join("config.json"),
                        msg: "quantization_config.weight_block_size must be two positive integers"
                            .into(),
                    });
                }
                (v[0], v[1])
            }
            _ => (128, 128),
        };
        let mut src = Source {
            dir: dir.to_path_buf(),
            files: Vec::new(),
            stamps: Vec::new(),
            tensors: HashMap::new(),
            order: Vec::new(),
            block,
        };
        for path in paths {
            let file = regular_file::open_read(&path).map_err(|e| Error::io(&path, e))?;
            let stamp = Stamp::of(&file.metadata().map_err(|e| Error::io(&path, e))?);
            let header = read_header(&path, &file)?;
            let shard = src.files.len();
            for t in header.tensors {
                if src.tensors.contains_key(&t.name) {
                    return Err(Error::container(
                        &path,
                        Some(&t.name),
                        "tensor appears in more than one shard",
                    ));
                }
                src.order.push(t.name.clone());
                src.tensors.insert(
                    t.name.clone(),
                    SrcTensor {
                        name: t.name.clone(),
                        dtype: t.dtype,
                        shape: t.shape,
                        shard,
                        start: t.start as u64,
                        end: t.end as u64,
                    },
                );
            }
            src.files.push((path, Arc::new(file)));
            src.stamps.push(stamp);
        }
        Ok(src)
    }

    /// Read `buf.len()` bytes of `t` from `offset` (within the tensor), adding them to the
    /// digest of `t`'s file. A file that has become shorter than the read is a
    /// `ContainerError` naming the file, the tensor, the offset and the sizes.
    pub(super) fn read(
        &self,
        t: &SrcTensor,
        offset: u64,
        buf: &mut [u8],
        digests: &mut Digests,
    ) -> Result<()> {
        let (path, file) = &self.files[t.shard];
        let at = t.start + offset;
        match read_exact_at(file, path, buf, at) {
            Err(Error::Io { source, .. }) if source.kind() == std::io::ErrorKind::UnexpectedEof => {
                let now = file.metadata().map_or_else(
                    |e| format!("cannot be read ({e})"),
                    |m| format!("has {}", m.len()),
                );
                Err(Error::container(
                    path,
                    Some(&t.name),
                    format!(
                        "the file was truncated while it was being converted: reading {} bytes \
                         at offset {at} (the tensor is bytes {}..{}) needs at least {} bytes, \
                         the file now {now} (it had {} when the conversion opened it)",
                        buf.len(),
                        t.start,
                        t.end,
                        at + buf.len() as u64,
                        self.stamps[t.shard].size
                    ),
                ))
            }
            Err(e) => Err(e),
            Ok(()) => {
                digests.entry(t.shard).or_default().update(buf);
                Ok(())
            }
        }
    }

    pub(super) fn path(&self, t: &SrcTensor) -> &Path {
        &self.files[t.shard].0
    }

    /// File `i`'s name (its key in the progress record) and its stamp at open.
    pub(super) fn file(&self, i: usize) -> (String, Stamp) {
        let name = self.files[i]
            .0
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        (name, self.stamps[i])
    }

    /// Whether file `i` is still what was opened: its path stat against the stamp at open
    /// (a copy renamed over it, an in-place write, a truncation all change it). The error
    /// names the file, what changed, and `what_then` (what the change stopped).
    pub(super) fn check_unchanged(&self, i: usize, what_then: &str) -> Result<()> {
        let path = &self.files[i].0;
        let then = self.stamps[i];
        let now = match std::fs::metadata(path) {
            Ok(m) => Stamp::of(&m),
            Err(e) => {
                return Err(Error::container(
                    path,
                    None,
                    format!(
                        "the source file went away while it was being converted ({e}); \
                         {what_then}"
                    ),
                ))
            }
        };
        if now == then {
            return Ok(());
        }
        Err(Error::container(
            path,
            None,
            format!(
                "the source file changed while it was being converted ({}); {what_then}. \
                 Run the conversion again once the source is complete: it converts the file \
                 as it is then, redoing every shard made from its old contents",
                now.describe_change(&then)
            ),
        ))
    }
}

pub(super) fn is_fp8(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F8E4M3 | Dtype::F8E5M2)
}

pub(super) fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::Bf16 | Dtype::F16)
}
