//! The source checkpoint: its shard headers, read without mapping, and positioned reads of
//! its tensors.

use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;

use crate::container::safetensors::{self, Dtype, MAX_HEADER_BYTES};
use crate::container::{regular_file, shard_paths};
use crate::error::{Error, Result};

/// One tensor of a source shard.
#[derive(Debug, Clone)]
pub(super) struct SrcTensor {
    pub(super) dtype: Dtype,
    pub(super) shape: Vec<usize>,
    shard: usize,
    pub(super) start: u64,
    pub(super) end: u64,
}

/// A source checkpoint opened for positioned reads.
pub(super) struct Source {
    pub(super) dir: PathBuf,
    files: Vec<(PathBuf, Arc<File>)>,
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
            tensors: HashMap::new(),
            order: Vec::new(),
            block,
        };
        for path in paths {
            let file = regular_file::open_read(&path).map_err(|e| Error::io(&path, e))?;
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
                    t.name,
                    SrcTensor {
                        dtype: t.dtype,
                        shape: t.shape,
                        shard,
                        start: t.start as u64,
                        end: t.end as u64,
                    },
                );
            }
            src.files.push((path, Arc::new(file)));
        }
        Ok(src)
    }

    pub(super) fn read(&self, t: &SrcTensor, offset: u64, buf: &mut [u8]) -> Result<()> {
        let (path, file) = &self.files[t.shard];
        read_exact_at(file, path, buf, t.start + offset)
    }

    pub(super) fn path(&self, t: &SrcTensor) -> &Path {
        &self.files[t.shard].0
    }
}

pub(super) fn is_fp8(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F8E4M3 | Dtype::F8E5M2)
}

pub(super) fn is_float(dtype: Dtype) -> bool {
    matches!(dtype, Dtype::F32 | Dtype::Bf16 | Dtype::F16)
}
