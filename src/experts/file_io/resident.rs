//! An expert in memory: its buffers (mapped views or owned slabs), where each matrix lies in
//! them, and its release (pages dropped, slabs back to the pool).

use std::ops::Range;
use std::sync::Arc;

use memmap2::{Mmap, MmapMut, UncheckedAdvice};

use super::slab::SlabPool;
use super::{Files, PAGE};
use crate::container::{finite, Dtype, SCALES_SUFFIX};
use crate::error::{Error, Result};
use crate::experts::source::ExpertLoc;
use crate::experts::ExpertView;
use crate::quant::{QMatrix, QuantFormat};

pub(super) enum Buf {
    Mapped(Arc<Mmap>),
    Owned(MmapMut),
}

impl Buf {
    fn bytes(&self) -> &[u8] {
        match self {
            Buf::Mapped(m) => m,
            Buf::Owned(m) => m,
        }
    }
}

enum Scales {
    None,
    InPlace { buf: usize, range: Range<usize> },
    Owned(Vec<f32>),
}

struct MatPlace {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    buf: usize,
    data: Range<usize>,
    scales: Scales,
}

/// An expert in memory: mapped views or owned slabs, and where each matrix lies in them.
pub(crate) struct Resident {
    bufs: Vec<Buf>,
    mats: [MatPlace; 3],
    /// Bytes of scales copied for alignment (reported to the gauge).
    copied: u64,
    /// (buf, range) of mapped ranges, released with MADV_DONTNEED on drop.
    mapped: Vec<(usize, Range<usize>)>,
    pool: Arc<SlabPool>,
}

impl Resident {
    fn mat(&self, i: usize) -> Result<QMatrix<'_>> {
        let p = &self.mats[i];
        let data = &self.bufs[p.buf].bytes()[p.data.clone()];
        let scales: &[f32] = match &p.scales {
            Scales::None => &[],
            Scales::InPlace { buf, range } => {
                bytemuck::try_cast_slice(&self.bufs[*buf].bytes()[range.clone()])
                    .map_err(|e| Error::Internal(format!("in-place scales not castable: {e}")))?
            }
            Scales::Owned(v) => v,
        };
        QMatrix::new(p.format, p.rows, p.cols, data, scales)
    }

    pub fn view(&self) -> Result<ExpertView<'_>> {
        Ok(ExpertView {
            gate: self.mat(0)?,
            up: self.mat(1)?,
            down: self.mat(2)?,
        })
    }
}

impl Drop for Resident {
    fn drop(&mut self) {
        self.pool.gauge.sub(self.copied);
        for (b, r) in &self.mapped {
            if let Buf::Mapped(map) = &self.bufs[*b] {
                // Only whole pages inside the range, so neighbours keep theirs.
                let start = r.start.div_ceil(PAGE) * PAGE;
                let end = r.end / PAGE * PAGE;
                if end > start {
                    // SAFETY: the map is a read-only MAP_SHARED file mapping: MADV_DONTNEED only
                    // drops page-table entries, and the next access re-reads the same file
                    // bytes, so no live reference observes changed contents.
                    let _ = unsafe {
                        map.unchecked_advise_range(UncheckedAdvice::DontNeed, start, end - start)
                    };
                }
            }
        }
        // Owned slabs go back to the pool.
        for b in std::mem::take(&mut self.bufs) {
            if let Buf::Owned(m) = b {
                self.pool.give(m);
            }
        }
    }
}

impl Files {
    /// Build the resident expert from buffers and the (buf, range) of each of its ranges, in
    /// `ExpertLoc::ranges` order.
    pub(super) fn finish(
        &self,
        loc: &ExpertLoc,
        bufs: Vec<Buf>,
        places: &[(usize, Range<usize>)],
        mapped: Vec<(usize, Range<usize>)>,
    ) -> Result<Resident> {
        let mut it = places.iter();
        let mut next = || {
            it.next()
                .cloned()
                .ok_or_else(|| Error::Internal("range count mismatch".into()))
        };
        let mut mats = Vec::with_capacity(3);
        let mut copied = 0u64;
        for m in loc.mats() {
            let (buf, data) = next()?;
            let scales = match m.scales {
                None => Scales::None,
                Some(_) => {
                    let (sb, range) = next()?;
                    let raw = &bufs[sb].bytes()[range.clone()];
                    if cfg!(target_endian = "little")
                        && bytemuck::try_cast_slice::<u8, f32>(raw).is_ok()
                    {
                        Scales::InPlace { buf: sb, range }
                    } else {
                        copied += raw.len() as u64;
                        Scales::Owned(
                            raw.chunks_exact(4)
                                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                                .collect(),
                        )
                    }
                }
            };
            mats.push(MatPlace {
                format: m.format,
                rows: m.rows,
                cols: m.cols,
                buf,
                data,
                scales,
            });
        }
        let mats: [MatPlace; 3] = mats
            .try_into()
            .map_err(|_| Error::Internal("expert without three matrices".into()))?;
        self.pool.gauge.add(copied);
        let res = Resident {
            bufs,
            mats,
            copied,
            mapped,
            pool: self.pool.clone(),
        };
        // Stored floats checked once per load (scales; every value of a float expert), so a
        // damaged expert is an error naming its tensor rather than a NaN logit.
        for (i, m) in loc.mats().into_iter().enumerate() {
            let q = res.mat(i)?;
            let bad = match m.format {
                QuantFormat::F32 => finite::scan_raw(q.data(), Dtype::F32).map(|b| (b, "")),
                QuantFormat::Bf16 => finite::scan_raw(q.data(), Dtype::Bf16).map(|b| (b, "")),
                QuantFormat::F16 => finite::scan_raw(q.data(), Dtype::F16).map(|b| (b, "")),
                _ => finite::scan_f32(q.scales()).map(|b| (b, SCALES_SUFFIX)),
            };
            if let Some((b, suffix)) = bad {
                let file = self.shards.get(m.data.file).map(|s| s.path.clone());
                return Err(Error::NonFiniteWeight {
                    file: file.unwrap_or_default(),
                    tensor: format!("{}{suffix}", m.name),
                    what: b.describe(),
                    index: b.index,
                });
            }
        }
        Ok(res)
    }
}
