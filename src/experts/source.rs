//! Where an expert's bytes are: the [`ExpertLocator`] trait (file, byte ranges, formats and
//! shapes of gate/up/down and their scales), so the store does not depend on how a container
//! indexes its shards. The container implements it; tests and benches use [`StaticSource`].

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use crate::error::{Error, Result};
use crate::quant::QuantFormat;

/// `len` bytes at `offset` of file number `file` (an index into [`ExpertLocator::files`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ByteRange {
    pub file: usize,
    pub offset: u64,
    pub len: u64,
}

impl ByteRange {
    pub fn end(&self) -> u64 {
        self.offset + self.len
    }
}

/// One weight matrix of an expert.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MatrixLoc {
    /// The tensor name (for error messages).
    pub name: String,
    pub format: QuantFormat,
    /// Logical [rows, cols] = [O, I].
    pub rows: usize,
    pub cols: usize,
    pub data: ByteRange,
    /// Little-endian f32 scales; `None` for float formats.
    pub scales: Option<ByteRange>,
}

/// gate and up: [moe_intermediate, hidden]; down: [hidden, moe_intermediate].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExpertLoc {
    pub gate: MatrixLoc,
    pub up: MatrixLoc,
    pub down: MatrixLoc,
}

impl ExpertLoc {
    pub fn mats(&self) -> [&MatrixLoc; 3] {
        [&self.gate, &self.up, &self.down]
    }
    /// Every byte range, data and scales.
    pub fn ranges(&self) -> impl Iterator<Item = (&MatrixLoc, ByteRange)> + '_ {
        self.mats()
            .into_iter()
            .flat_map(|m| std::iter::once(m.data).chain(m.scales).map(move |r| (m, r)))
    }
    /// Bytes of the expert on disk (data + scales).
    pub fn bytes(&self) -> u64 {
        self.ranges().map(|(_, r)| r.len).sum()
    }

    /// Check sizes against formats and shapes, and ranges against file sizes.
    pub(crate) fn validate(&self, files: &[PathBuf], file_len: &[u64]) -> Result<()> {
        for m in self.mats() {
            let path = files.get(m.data.file).cloned().unwrap_or_default();
            let bad = |msg: String| Error::container(&path, Some(&m.name), msg);
            let want_data = m.format.data_bytes(m.rows, m.cols);
            if want_data != Some(m.data.len as usize) {
                return Err(bad(format!(
                    "{} bytes of data, but a {} [{}, {}] matrix needs {want_data:?}",
                    m.data.len, m.format, m.rows, m.cols
                )));
            }
            let want_scales = m.format.scale_count(m.rows, m.cols).map(|n| n as u64 * 4);
            let have_scales = m.scales.map_or(0, |s| s.len);
            if want_scales != Some(have_scales) {
                return Err(bad(format!(
                    "{have_scales} bytes of scales, but a {} [{}, {}] matrix needs {want_scales:?}",
                    m.format, m.rows, m.cols
                )));
            }
            for r in std::iter::once(m.data).chain(m.scales) {
                let Some(&len) = file_len.get(r.file) else {
                    return Err(bad(format!("file index {} out of range", r.file)));
                };
                if r.end() > len {
                    let p = files[r.file].clone();
                    return Err(Error::container(
                        p,
                        Some(&m.name),
                        format!(
                            "bytes {}..{} lie past the end of the file ({len} bytes); the shard \
                             is truncated",
                            r.offset,
                            r.end()
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// Where the routed experts of a model are.
pub trait ExpertLocator: Send + Sync {
    /// The model directory (read-only to colibri: a legacy routing history there is read).
    fn model_dir(&self) -> &Path;
    /// The shard files that [`ByteRange::file`] indexes.
    fn files(&self) -> &[PathBuf];
    /// Identifies the model (config and shard layout), so a history file from another model
    /// is recognised.
    fn fingerprint(&self) -> String;
    /// Layer slots, including the MTP layer(s) after the main ones.
    fn num_layers(&self) -> usize;
    /// Routed experts in `layer` (0 for a dense layer).
    fn num_experts(&self, layer: usize) -> usize;
    /// Where expert `expert` of `layer` is.
    fn locate(&self, layer: usize, expert: usize) -> Result<ExpertLoc>;
}

/// An [`ExpertLocator`] given as a table (tests, benches, synthetic containers).
#[derive(Debug, Clone)]
pub struct StaticSource {
    pub dir: PathBuf,
    pub files: Vec<PathBuf>,
    pub fingerprint: String,
    pub num_layers: usize,
    /// Layer index → location of each expert.
    pub layers: BTreeMap<usize, Vec<ExpertLoc>>,
}

impl ExpertLocator for StaticSource {
    fn model_dir(&self) -> &Path {
        &self.dir
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }
    fn num_layers(&self) -> usize {
        self.num_layers
    }
    fn num_experts(&self, layer: usize) -> usize {
        self.layers.get(&layer).map_or(0, Vec::len)
    }
    fn locate(&self, layer: usize, expert: usize) -> Result<ExpertLoc> {
        self.layers
            .get(&layer)
            .and_then(|l| l.get(expert))
            .cloned()
            .ok_or_else(|| {
                Error::invalid(
                    "expert",
                    format!("layer {layer} has no routed expert {expert}"),
                )
            })
    }
}

/// FNV-1a, for fingerprints (stable across runs and platforms, no dependency).
pub(crate) fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h ^= b as u64;
        h = h.wrapping_mul(0x100_0000_01b3);
    }
    h
}

pub(crate) const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;

/// The routed experts of an opened [`Container`](crate::container::Container): tensor names
/// `model.layers.{L}.mlp.experts.{E}.{gate,up,down}_proj.weight` (+ `.qs`) for every MoE layer
/// and the MTP layer(s) when the checkpoint has their experts.
pub struct ContainerSource {
    container: std::sync::Arc<crate::container::Container>,
    files: Vec<PathBuf>,
    experts: Vec<usize>,
    fingerprint: String,
}

impl ContainerSource {
    pub fn new(container: std::sync::Arc<crate::container::Container>) -> Result<Self> {
        use crate::container::{names::expert_tensor_name, Proj};
        let cfg = container.config();
        let files: Vec<PathBuf> = container
            .shards()
            .iter()
            .map(|s| s.path().to_path_buf())
            .collect();
        // Only as many layers as the tensors name: a config may claim any number (e.g.
        // num_nextn_predict_layers = 2^24), and per-layer state must not be sized by that.
        let named = container
            .names()
            .filter_map(|n| crate::container::names::classify(cfg, n).layer)
            .max()
            .map_or(0, |l| l + 1);
        let experts = (0..cfg.total_layers().min(named))
            .map(|l| {
                let moe = cfg.is_moe_layer(l) && cfg.n_routed_experts > 0;
                // An MTP layer may have been stripped from the checkpoint: no experts then.
                let present = !cfg.is_mtp_layer(l)
                    || container.contains(&expert_tensor_name(l, 0, Proj::Gate));
                if moe && present {
                    cfg.n_routed_experts
                } else {
                    0
                }
            })
            .collect();
        let config_json = std::fs::read(container.dir().join("config.json")).unwrap_or_default();
        let mut h = fnv1a(&config_json, FNV_OFFSET);
        for (p, s) in files.iter().zip(container.shards()) {
            let name = p.file_name().map(|n| n.to_string_lossy().into_owned());
            h = fnv1a(name.unwrap_or_default().as_bytes(), h);
            h = fnv1a(&s.len().to_le_bytes(), h);
        }
        Ok(ContainerSource {
            container,
            files,
            experts,
            fingerprint: format!("{h:016x}"),
        })
    }

    fn matrix(&self, name: String) -> Result<MatrixLoc> {
        let c = &self.container;
        let t = c.info(&name)?;
        let (format, (rows, cols)) = match (t.format, t.logical) {
            (Some(f), Some(s)) => (f, s),
            _ => {
                return Err(Error::container(
                    &t.file,
                    Some(&name),
                    "not a weight matrix (no format or logical shape resolved)",
                ))
            }
        };
        let range = |t: &crate::container::TensorInfo| ByteRange {
            file: t.shard,
            offset: t.range.start as u64,
            len: t.range.len() as u64,
        };
        let scales = if format.is_quantized() {
            let qs = c.info(&format!("{name}{}", crate::container::SCALES_SUFFIX))?;
            Some(range(qs))
        } else {
            None
        };
        Ok(MatrixLoc {
            format,
            rows,
            cols,
            data: range(t),
            scales,
            name,
        })
    }
}

impl ExpertLocator for ContainerSource {
    fn model_dir(&self) -> &Path {
        self.container.dir()
    }
    fn files(&self) -> &[PathBuf] {
        &self.files
    }
    fn fingerprint(&self) -> String {
        self.fingerprint.clone()
    }
    fn num_layers(&self) -> usize {
        self.experts.len()
    }
    fn num_experts(&self, layer: usize) -> usize {
        self.experts.get(layer).copied().unwrap_or(0)
    }
    fn locate(&self, layer: usize, expert: usize) -> Result<ExpertLoc> {
        use crate::container::{names::expert_tensor_name, Proj};
        if expert >= self.num_experts(layer) {
            return Err(Error::invalid(
                "expert",
                format!("layer {layer} has no routed expert {expert}"),
            ));
        }
        Ok(ExpertLoc {
            gate: self.matrix(expert_tensor_name(layer, expert, Proj::Gate))?,
            up: self.matrix(expert_tensor_name(layer, expert, Proj::Up))?,
            down: self.matrix(expert_tensor_name(layer, expert, Proj::Down))?,
        })
    }
}
