//! Weight formats as data: how many bytes and scales a logical [O, I] matrix takes in each,
//! and how to tell them apart from byte counts alone (docs/container.md). Everything that needs a
//! size asks here; nothing else computes one.

use crate::error::{Error, Result};

/// Group sizes the int4-grouped format may use, smallest first (inference picks the first fit).
pub const GROUP_SIZES: [usize; 8] = [16, 32, 48, 64, 96, 128, 192, 256];

/// How one weight matrix is stored.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum QuantFormat {
    /// Little-endian f32, O·I·4 bytes, no scales.
    F32,
    /// Little-endian bfloat16, O·I·2 bytes, no scales.
    Bf16,
    /// Little-endian IEEE half, O·I·2 bytes, no scales.
    F16,
    /// O·I signed bytes, one f32 scale per row: `w = q·s[o]`.
    Int8PerRow,
    /// O·ceil(I/2) bytes of nibbles, one scale per row.
    Int4PerRow,
    /// O·ceil(I/2) bytes of nibbles, O·ceil(I/gs) scales: w = (nibble − 8)·s[o, i/gs].
    Int4Grouped { group_size: usize },
}

impl QuantFormat {
    /// Bytes of packed data for a logical [rows, cols] matrix.
    pub fn data_bytes(self, rows: usize, cols: usize) -> Option<usize> {
        match self {
            QuantFormat::F32 => rows.checked_mul(cols)?.checked_mul(4),
            QuantFormat::Bf16 | QuantFormat::F16 => rows.checked_mul(cols)?.checked_mul(2),
            QuantFormat::Int8PerRow => rows.checked_mul(cols),
            QuantFormat::Int4PerRow | QuantFormat::Int4Grouped { .. } => {
                rows.checked_mul(cols.div_ceil(2))
            }
        }
    }

    /// Bytes of one packed row.
    pub fn row_bytes(self, cols: usize) -> usize {
        match self {
            QuantFormat::F32 => cols * 4,
            QuantFormat::Bf16 | QuantFormat::F16 => cols * 2,
            QuantFormat::Int8PerRow => cols,
            QuantFormat::Int4PerRow | QuantFormat::Int4Grouped { .. } => cols.div_ceil(2),
        }
    }

    /// Number of f32 scales per row (0 for float formats).
    pub fn scales_per_row(self, cols: usize) -> usize {
        match self {
            QuantFormat::F32 | QuantFormat::Bf16 | QuantFormat::F16 => 0,
            QuantFormat::Int8PerRow | QuantFormat::Int4PerRow => 1,
            QuantFormat::Int4Grouped { group_size } => cols.div_ceil(group_size),
        }
    }

    /// Number of f32 scales for a logical [rows, cols] matrix.
    pub fn scale_count(self, rows: usize, cols: usize) -> Option<usize> {
        rows.checked_mul(self.scales_per_row(cols))
    }

    /// The group size along a row: `cols` for per-row formats, 0 for float formats.
    pub fn group_size(self, cols: usize) -> usize {
        match self {
            QuantFormat::F32 | QuantFormat::Bf16 | QuantFormat::F16 => 0,
            QuantFormat::Int8PerRow | QuantFormat::Int4PerRow => cols.max(1),
            QuantFormat::Int4Grouped { group_size } => group_size,
        }
    }

    pub fn is_quantized(self) -> bool {
        !matches!(
            self,
            QuantFormat::F32 | QuantFormat::Bf16 | QuantFormat::F16
        )
    }

    /// Largest magnitude of a quantised integer (7 for int4, 127 for int8).
    pub fn qmax(self) -> Option<f32> {
        match self {
            QuantFormat::Int8PerRow => Some(127.0),
            QuantFormat::Int4PerRow | QuantFormat::Int4Grouped { .. } => Some(7.0),
            _ => None,
        }
    }

    /// Tell a quantised format from the byte and scale counts of a `U8` tensor and its `.qs`
    /// scales, against the logical [rows, cols] from the config. Per-row wins over a group
    /// size that covers the whole row; among group sizes the smallest that fits wins.
    pub fn infer(rows: usize, cols: usize, data_bytes: usize, scale_count: usize) -> Option<Self> {
        let int8 = QuantFormat::Int8PerRow;
        let int4 = QuantFormat::Int4PerRow;
        // int8 first: for cols == 1 both byte counts agree and int8 is what a writer would pick.
        if int8.data_bytes(rows, cols) == Some(data_bytes) && scale_count == rows {
            return Some(int8);
        }
        if int4.data_bytes(rows, cols) != Some(data_bytes) {
            return None;
        }
        if scale_count == rows {
            return Some(int4);
        }
        GROUP_SIZES
            .iter()
            .map(|&group_size| QuantFormat::Int4Grouped { group_size })
            .find(|f| f.scale_count(rows, cols) == Some(scale_count))
    }

    /// The name written to (and read from) a container's `__metadata__`.
    pub fn name(self) -> String {
        match self {
            QuantFormat::F32 => "f32".into(),
            QuantFormat::Bf16 => "bf16".into(),
            QuantFormat::F16 => "f16".into(),
            QuantFormat::Int8PerRow => "int8".into(),
            QuantFormat::Int4PerRow => "int4".into(),
            QuantFormat::Int4Grouped { group_size } => format!("int4_g{group_size}"),
        }
    }

    /// Parse a name produced by [`QuantFormat::name`].
    pub fn parse(name: &str) -> Result<Self> {
        let bad = || {
            Error::invalid(
                "format",
                format!(
                    "unknown weight format '{name}'; expected one of f32, bf16, f16, int8, int4, \
                     int4_g{{16,32,48,64,96,128,192,256}}"
                ),
            )
        };
        Ok(match name {
            "f32" => QuantFormat::F32,
            "bf16" => QuantFormat::Bf16,
            "f16" => QuantFormat::F16,
            "int8" => QuantFormat::Int8PerRow,
            "int4" => QuantFormat::Int4PerRow,
            _ => {
                let gs: usize = name
                    .strip_prefix("int4_g")
                    .and_then(|g| g.parse().ok())
                    .ok_or_else(bad)?;
                if !GROUP_SIZES.contains(&gs) {
                    return Err(bad());
                }
                QuantFormat::Int4Grouped { group_size: gs }
            }
        })
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.name())
    }
}

/// A borrowed weight matrix: logical [rows, cols] = [O, I], row-major packed `data` and its
/// `scales` (row-major [O, scales_per_row]). Constructed only through [`QMatrix::new`], so
/// every kernel may rely on the lengths being right.
#[derive(Debug, Clone, Copy)]
pub struct QMatrix<'a> {
    format: QuantFormat,
    rows: usize,
    cols: usize,
    data: &'a [u8],
    scales: &'a [f32],
}

impl<'a> QMatrix<'a> {
    pub fn new(
        format: QuantFormat,
        rows: usize,
        cols: usize,
        data: &'a [u8],
        scales: &'a [f32],
    ) -> Result<Self> {
        let want_data = format.data_bytes(rows, cols);
        let want_scales = format.scale_count(rows, cols);
        if want_data != Some(data.len()) || want_scales != Some(scales.len()) {
            return Err(Error::invalid(
                "weight",
                format!(
                    "{format} matrix [{rows}, {cols}] needs {want_data:?} data bytes and \
                     {want_scales:?} scales, got {} and {}",
                    data.len(),
                    scales.len()
                ),
            ));
        }
        Ok(QMatrix {
            format,
            rows,
            cols,
            data,
            scales,
        })
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
    pub fn data(&self) -> &'a [u8] {
        self.data
    }
    pub fn scales(&self) -> &'a [f32] {
        self.scales
    }
    /// Packed bytes of row `o`.
    pub fn row_data(&self, o: usize) -> &'a [u8] {
        let rb = self.format.row_bytes(self.cols);
        &self.data[o * rb..(o + 1) * rb]
    }
    /// Scales of row `o`.
    pub fn row_scales(&self, o: usize) -> &'a [f32] {
        let n = self.format.scales_per_row(self.cols);
        &self.scales[o * n..(o + 1) * n]
    }
    /// The sub-matrix of rows `start..start + n` (rows are contiguous in data and scales).
    pub fn row_range(&self, start: usize, n: usize) -> Result<QMatrix<'a>> {
        if start.checked_add(n).is_none_or(|end| end > self.rows) {
            return Err(Error::invalid(
                "row_range",
                format!("rows {start}..{} of a {}-row matrix", start + n, self.rows),
            ));
        }
        let rb = self.format.row_bytes(self.cols);
        let sp = self.format.scales_per_row(self.cols);
        Ok(QMatrix {
            format: self.format,
            rows: n,
            cols: self.cols,
            data: &self.data[start * rb..(start + n) * rb],
            scales: &self.scales[start * sp..(start + n) * sp],
        })
    }

    /// Bytes a kernel streams for one pass over this matrix (data + scales).
    pub fn stream_bytes(&self) -> usize {
        self.data.len() + self.scales.len() * 4
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_of_glm_expert_at_gs64() {
        // docs/container.md: a GLM-5.2 expert (gate, up: 2048×6144; down: 6144×2048) at gs64.
        let f = QuantFormat::Int4Grouped { group_size: 64 };
        let gate = f.data_bytes(2048, 6144).unwrap() + 4 * f.scale_count(2048, 6144).unwrap();
        let down = f.data_bytes(6144, 2048).unwrap() + 4 * f.scale_count(6144, 2048).unwrap();
        assert_eq!(2 * gate + down, 21_233_664);
    }

    #[test]
    fn infer_tells_formats_apart() {
        let (o, i) = (10, 300);
        for f in [
            QuantFormat::Int8PerRow,
            QuantFormat::Int4PerRow,
            QuantFormat::Int4Grouped { group_size: 16 },
            QuantFormat::Int4Grouped { group_size: 64 },
            QuantFormat::Int4Grouped { group_size: 128 },
        ] {
            let got = QuantFormat::infer(
                o,
                i,
                f.data_bytes(o, i).unwrap(),
                f.scale_count(o, i).unwrap(),
            );
            assert_eq!(got, Some(f));
        }
        // ceil(300/192) == ceil(300/256) == 2 == ceil(300/150): smallest listed gs that fits.
        assert_eq!(
            QuantFormat::infer(o, i, 1500, 20),
            Some(QuantFormat::Int4Grouped { group_size: 192 })
        );
        assert_eq!(QuantFormat::infer(o, i, 1499, 10), None);
        assert_eq!(QuantFormat::infer(o, i, 1500, 7), None);
    }

    #[test]
    fn names_round_trip() {
        for f in [
            QuantFormat::F32,
            QuantFormat::Bf16,
            QuantFormat::F16,
            QuantFormat::Int8PerRow,
            QuantFormat::Int4PerRow,
            QuantFormat::Int4Grouped { group_size: 48 },
        ] {
            assert_eq!(QuantFormat::parse(&f.name()).unwrap(), f);
        }
        assert!(QuantFormat::parse("int4_g65").is_err());
        assert!(QuantFormat::parse("q4_0").is_err());
    }

    #[test]
    fn qmatrix_checks_lengths() {
        let f = QuantFormat::Int4Grouped { group_size: 64 };
        let data = vec![0u8; 3 * 50];
        let scales = vec![1.0f32; 3 * 2];
        assert!(QMatrix::new(f, 3, 100, &data, &scales).is_ok());
        assert!(QMatrix::new(f, 3, 100, &data[1..], &scales).is_err());
        assert!(QMatrix::new(f, 3, 100, &data, &scales[1..]).is_err());
    }
}
