//! Writing a planned shard by streaming (read a block of rows, dequantise, quantise in
//! parallel, append), and finishing the container.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use rayon::prelude::*;

use super::plan::{OutKind, Plan, PlannedTensor};
use super::record::Digests;
use super::source::SrcTensor;
use super::{fp8, is_container_sidecar};
use crate::container::decode_floats;
use crate::error::{Error, Result};
use crate::quant::pack::quantize;

impl Plan {
    pub fn dst(&self) -> &Path {
        &self.dst
    }
    pub fn src(&self) -> &Path {
        &self.src.dir
    }

    /// Write shard `i` (to a temporary name, renamed when complete, then entered in the
    /// progress record). `progress` receives the bytes written after each tensor; an error
    /// from it (e.g. Ctrl-C) stops the write. A source file that changed while the shard
    /// was written (stat differs from when it was opened) is a `ContainerError` naming it,
    /// and the shard is not renamed into place.
    pub fn write_shard(&self, i: usize, progress: &mut dyn FnMut(u64) -> Result<()>) -> Result<()> {
        let s = self
            .shards
            .get(i)
            .ok_or_else(|| Error::invalid("shard", format!("no shard {i}")))?;
        std::fs::create_dir_all(&self.dst).map_err(|e| Error::io(&self.dst, e))?;
        let final_path = self.dst.join(&s.file_name);
        let tmp = self.dst.join(format!(".{}.partial", s.file_name));
        let file = File::create(&tmp).map_err(|e| Error::io(&tmp, e))?;
        let mut out = BufWriter::with_capacity(8 << 20, file);
        let w =
            |out: &mut BufWriter<File>, b: &[u8]| out.write_all(b).map_err(|e| Error::io(&tmp, e));
        w(&mut out, &s.header)?;
        progress(s.header.len() as u64)?;
        let mut digests = Digests::new();
        for t in &s.tensors {
            let n = self.write_tensor(t, &mut digests, &mut |b| w(&mut out, b))?;
            progress(n)?;
        }
        let file = out
            .into_inner()
            .map_err(|e| Error::io(&tmp, e.into_error()))?;
        file.sync_all().map_err(|e| Error::io(&tmp, e))?;
        let len = file.metadata().map_err(|e| Error::io(&tmp, e))?.len();
        if len != s.total_bytes {
            return Err(Error::Internal(format!(
                "{}: wrote {len} bytes, planned {}",
                tmp.display(),
                s.total_bytes
            )));
        }
        drop(file);
        let not_written = format!("{} was not written", final_path.display());
        if let Err(e) = self.check_sources(s, &not_written) {
            let _ = std::fs::remove_file(&tmp);
            return Err(e);
        }
        std::fs::rename(&tmp, &final_path).map_err(|e| Error::io(&final_path, e))?;
        self.record_shard(s, &digests)
    }

    /// Stream one planned tensor through `sink`; returns the bytes written.
    fn write_tensor(
        &self,
        t: &PlannedTensor,
        digests: &mut Digests,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<u64> {
        let st = &self.src.tensors[&t.name];
        let path = self.src.path(st);
        if let OutKind::Copy { .. } = t.kind {
            return self.copy_tensor(st, digests, sink);
        }
        let (format, rows, cols) = match &t.kind {
            OutKind::Quant { format, rows, cols } => (*format, *rows, *cols),
            OutKind::Float { format, shape } => match shape.as_slice() {
                [r, c] => (*format, *r, *c),
                _ => (*format, 1, shape.iter().product()),
            },
            OutKind::Copy { .. } => unreachable!("handled above"),
        };
        let scale_inv = match &t.scale_inv {
            Some(s) => Some(self.block_scales(s, digests)?),
            None => None,
        };
        let table = fp8::e4m3_table();
        let esize = st.dtype.size();
        let row_bytes = cols * esize;
        let chunk_rows = (self.options.chunk_bytes / (cols.max(1) * 4)).clamp(1, rows.max(1));
        let mut raw = vec![0u8; chunk_rows * row_bytes];
        let mut vals = vec![0.0f32; chunk_rows * cols];
        let mut scales: Vec<f32> = Vec::with_capacity(format.scale_count(rows, cols).unwrap_or(0));
        let mut written = 0u64;
        let threads = rayon::current_num_threads().max(1);
        let mut r0 = 0;
        while r0 < rows {
            let nr = chunk_rows.min(rows - r0);
            let raw = &mut raw[..nr * row_bytes];
            self.src.read(st, (r0 * row_bytes) as u64, raw, digests)?;
            let vals = &mut vals[..nr * cols];
            match (&scale_inv, st.dtype) {
                (Some(s), _) => {
                    fp8::dequant_block_rows(&table, raw, r0, cols, s, self.src.block, vals)
                }
                (None, dtype) => {
                    let v = decode_floats(raw, dtype).ok_or_else(|| {
                        Error::container(path, Some(&t.name), format!("cannot convert {dtype}"))
                    })?;
                    vals.copy_from_slice(&v);
                }
            }
            // Quantise row blocks in parallel; rows are independent, so this is bit-exact
            // with quantising the whole tensor at once.
            let per_task = nr.div_ceil(threads * 4).max(1);
            let packed: Vec<Result<_>> = vals
                .par_chunks(per_task * cols.max(1))
                .enumerate()
                .map(|(k, block)| {
                    let br = block.len() / cols.max(1);
                    quantize(format, &t.name, block, br, cols).map_err(|e| match e {
                        Error::NonFinite {
                            tensor,
                            what,
                            index,
                        } => Error::NonFinite {
                            tensor,
                            what,
                            index: index + (r0 + k * per_task) * cols,
                        },
                        other => other,
                    })
                })
                .collect();
            for p in packed {
                let p = p?;
                sink(&p.data)?;
                written += p.data.len() as u64;
                scales.extend_from_slice(&p.scales);
            }
            r0 += nr;
        }
        if format.is_quantized() {
            let bytes: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
            sink(&bytes)?;
            written += bytes.len() as u64;
        }
        Ok(written)
    }

    /// A tensor's bytes, unchanged, through `sink` in chunks of at most `chunk_bytes`.
    fn copy_tensor(
        &self,
        st: &SrcTensor,
        digests: &mut Digests,
        sink: &mut dyn FnMut(&[u8]) -> Result<()>,
    ) -> Result<u64> {
        let total = st.end - st.start;
        let mut buf = vec![0u8; (self.options.chunk_bytes as u64).min(total) as usize];
        let mut off = 0u64;
        while off < total {
            let n = ((total - off) as usize).min(buf.len());
            self.src.read(st, off, &mut buf[..n], digests)?;
            sink(&buf[..n])?;
            off += n as u64;
        }
        Ok(total)
    }

    /// The FP8 block scales `name`, read whole (they are 1/16384 of the weight).
    fn block_scales(&self, name: &str, digests: &mut Digests) -> Result<Vec<f32>> {
        let sst = &self.src.tensors[name];
        let mut raw = vec![0u8; (sst.end - sst.start) as usize];
        self.src.read(sst, 0, &mut raw, digests)?;
        Ok(decode_floats(&raw, sst.dtype).unwrap_or_default())
    }

    /// Copy the files a container needs besides its weights ([`is_container_sidecar`]: the
    /// tokenizer, generation config, chat template, license), write config.json (without
    /// the source's `quantization_config`), and check that the result opens as a container.
    pub fn finish(&self) -> Result<()> {
        std::fs::create_dir_all(&self.dst).map_err(|e| Error::io(&self.dst, e))?;
        let rd = std::fs::read_dir(&self.src.dir).map_err(|e| Error::io(&self.src.dir, e))?;
        for entry in rd {
            let entry = entry.map_err(|e| Error::io(&self.src.dir, e))?;
            let p = entry.path();
            let name = entry.file_name().to_string_lossy().into_owned();
            if !is_container_sidecar(&name) || !p.is_file() {
                continue;
            }
            let to = self.dst.join(&name);
            std::fs::copy(&p, &to).map_err(|e| Error::io(&to, e))?;
        }
        let mut cfg = self.config_json.clone();
        if let Some(o) = cfg.as_object_mut() {
            o.remove("quantization_config");
        }
        let text = serde_json::to_string_pretty(&cfg)
            .map_err(|e| Error::Internal(format!("serialising config.json: {e}")))?;
        let tmp = self.dst.join(".config.json.partial");
        std::fs::write(&tmp, text + "\n").map_err(|e| Error::io(&tmp, e))?;
        let to = self.dst.join("config.json");
        std::fs::rename(&tmp, &to).map_err(|e| Error::io(&to, e))?;
        crate::container::Container::open(&self.dst).map(|_| ())
    }

    /// Output tensors per format name.
    pub fn format_counts(&self) -> BTreeMap<String, usize> {
        let mut m = BTreeMap::new();
        for s in &self.shards {
            for t in &s.tensors {
                let k = t.format().map_or_else(|| "copy".to_string(), |f| f.name());
                *m.entry(k).or_insert(0) += 1;
            }
        }
        m
    }
}
