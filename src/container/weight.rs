//! 2-D weights and 1-D vectors read into owned memory, their floats checked on the way.

use std::path::Path;
use std::sync::Arc;

use super::{decode_floats, finite, Container, SCALES_SUFFIX};
use crate::error::{Error, Result};
use crate::quant::format::{QMatrix, QuantFormat};

/// `Send + Sync`.
#[derive(Clone)]
pub struct Weight {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    data: Arc<Vec<u8>>,
    /// f32 scales (empty for float formats).
    scales: Arc<Vec<f32>>,
}

impl std::fmt::Debug for Weight {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Weight")
            .field("format", &self.format)
            .field("rows", &self.rows)
            .field("cols", &self.cols)
            .finish()
    }
}

impl Weight {
    /// An owned weight (e.g. freshly quantised), validated like a mapped one.
    pub fn from_owned(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        data: Vec<u8>,
        scales: Vec<f32>,
    ) -> Result<Self> {
        QMatrix::new(format, rows, cols, &data, &scales)?;
        Ok(Weight {
            format,
            rows,
            cols,
            data: Arc::new(data),
            scales: Arc::new(scales),
        })
    }

    /// The borrowed matrix the kernels take.
    pub fn view(&self) -> QMatrix<'_> {
        QMatrix::new(self.format, self.rows, self.cols, &self.data, &self.scales)
            .expect("Weight lengths are validated when it is built")
    }

    pub fn format(&self) -> QuantFormat {
        self.format
    }
    /// O: output features.
    pub fn rows(&self) -> usize {
        self.rows
    }
    /// I: input features.
    pub fn cols(&self) -> usize {
        self.cols
    }
    /// Bytes of data plus scales.
    pub fn nbytes(&self) -> usize {
        self.data.len() + 4 * self.scales.len()
    }
    /// Dequantise to row-major f32 [rows, cols] (reference path).
    pub fn to_f32(&self) -> Vec<f32> {
        crate::quant::pack::dequantize(&self.view())
    }
}

impl Container {
    /// A 2-D weight in any format, read into owned memory. Its floats (the scales of a
    /// quantised weight, every value of a float one) are checked: NaN, Inf or a magnitude
    /// beyond [`finite::MAX_MAGNITUDE`] is [`Error::NonFiniteWeight`] naming the tensor.
    pub fn weight(&self, name: &str) -> Result<Weight> {
        let t = self.info(name)?;
        let (Some(format), Some((rows, cols))) = (t.format, t.logical) else {
            return Err(Error::container(
                &t.file,
                Some(name),
                format!(
                    "not a 2-D weight (dtype {}, shape {:?}); use vector() for 1-D tensors",
                    t.dtype, t.shape
                ),
            ));
        };
        // Check the byte ranges before allocating for them.
        let file = &self.shards[t.shard];
        file.check_range(&t.range, name)?;
        let qs = if format.is_quantized() {
            let qs_name = format!("{name}{SCALES_SUFFIX}");
            let qs = self.info(&qs_name)?;
            self.shards[qs.shard].check_range(&qs.range, &qs_name)?;
            Some((qs_name, qs))
        } else {
            None
        };
        let data = file.read(t.range.clone(), name)?;
        self.loaded(data.len())?;
        check_floats(&t.file, name, finite::scan_raw(&data, t.dtype))?;
        let scales: Vec<f32> = match qs {
            Some((qs_name, qs)) => {
                let raw = self.shards[qs.shard].read(qs.range.clone(), &qs_name)?;
                self.loaded(raw.len())?;
                let v: Vec<f32> = raw
                    .chunks_exact(4)
                    .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                    .collect();
                check_floats(&qs.file, &qs_name, finite::scan_f32(&v))?;
                v
            }
            None => Vec::new(),
        };
        QMatrix::new(format, rows, cols, &data, &scales)
            .map_err(|e| Error::container(&t.file, Some(name), e.to_string()))?;
        Ok(Weight {
            format,
            rows,
            cols,
            data: Arc::new(data),
            scales: Arc::new(scales),
        })
    }

    /// A 1-D F32/BF16/F16 tensor as f32 (norm weights, `e_score_correction_bias`), checked
    /// like [`Container::weight`]'s floats.
    pub fn vector(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.info(name)?;
        if t.shape.len() != 1 {
            return Err(Error::container(
                &t.file,
                Some(name),
                format!("expected a 1-D tensor, found shape {:?}", t.shape),
            ));
        }
        let raw = self.bytes(name)?;
        self.loaded(raw.len())?;
        let v = decode_floats(&raw, t.dtype).ok_or_else(|| {
            Error::container(
                &t.file,
                Some(name),
                format!("expected F32/BF16/F16, found {}", t.dtype),
            )
        })?;
        check_floats(&t.file, name, finite::scan_f32(&v))?;
        Ok(v)
    }
}

/// `Error::NonFiniteWeight` for a bad value a scan found.
fn check_floats(file: &Path, tensor: &str, bad: Option<finite::BadValue>) -> Result<()> {
    match bad {
        None => Ok(()),
        Some(b) => Err(Error::NonFiniteWeight {
            file: file.to_path_buf(),
            tensor: tensor.to_owned(),
            what: b.describe(),
            index: b.index,
        }),
    }
}
