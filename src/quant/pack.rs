//! The quantiser and the scalar reference dequantiser, bit-exact with docs/container.md:
//! s = max(absmax/qmax, 1e-8); q = clip(round_half_even(w/s)); int4 stores q + 8 with element
//! 2j in the low nibble of byte j and 2j+1 in the high nibble. Every kernel is tested
//! against [`reference_dequantize_row`].

use crate::error::{Error, Result};
use crate::quant::format::{QMatrix, QuantFormat};

/// Smallest scale the quantiser emits (keeps all-zero groups finite).
pub const MIN_SCALE: f32 = 1e-8;

/// A quantised (or re-encoded float) matrix with owned storage.
#[derive(Debug, Clone, PartialEq)]
pub struct Packed {
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Packed {
    pub fn view(&self) -> QMatrix<'_> {
        QMatrix::new(self.format, self.rows, self.cols, &self.data, &self.scales)
            .expect("Packed is constructed with consistent lengths")
    }
}

/// First NaN or Inf in `w`, as an error naming `tensor`.
pub fn check_finite(tensor: &str, w: &[f32]) -> Result<()> {
    match w.iter().position(|v| !v.is_finite()) {
        None => Ok(()),
        Some(index) => Err(Error::NonFinite {
            tensor: tensor.to_owned(),
            what: if w[index].is_nan() { "NaN" } else { "Inf" },
            index,
        }),
    }
}

/// Quantise (or re-encode) a row-major [rows, cols] f32 matrix into `format`.
/// `tensor` names the weight in errors (NaN/Inf in the source are refused).
pub fn quantize(
    format: QuantFormat,
    tensor: &str,
    w: &[f32],
    rows: usize,
    cols: usize,
) -> Result<Packed> {
    if rows.checked_mul(cols) != Some(w.len()) {
        return Err(Error::invalid(
            tensor,
            format!(
                "expected {rows}×{cols} = {} values, got {}",
                rows.saturating_mul(cols),
                w.len()
            ),
        ));
    }
    check_finite(tensor, w)?;
    let nbytes = format
        .data_bytes(rows, cols)
        .ok_or_else(|| Error::invalid(tensor, "matrix too large"))?;
    let mut data = vec![0u8; nbytes];
    let mut scales = Vec::with_capacity(format.scale_count(rows, cols).unwrap_or(0));
    match format {
        QuantFormat::F32 => {
            for (dst, v) in data.chunks_exact_mut(4).zip(w) {
                dst.copy_from_slice(&v.to_le_bytes());
            }
        }
        QuantFormat::Bf16 => {
            for (dst, v) in data.chunks_exact_mut(2).zip(w) {
                dst.copy_from_slice(&half::bf16::from_f32(*v).to_le_bytes());
            }
        }
        QuantFormat::F16 => {
            for (dst, v) in data.chunks_exact_mut(2).zip(w) {
                dst.copy_from_slice(&half::f16::from_f32(*v).to_le_bytes());
            }
        }
        QuantFormat::Int8PerRow | QuantFormat::Int4PerRow | QuantFormat::Int4Grouped { .. } => {
            let qmax = format.qmax().unwrap_or(7.0);
            let gs = format.group_size(cols);
            let row_bytes = format.row_bytes(cols);
            let mut q = vec![0i8; cols];
            for (o, row) in w.chunks_exact(cols.max(1)).enumerate().take(rows) {
                for (g, group) in row.chunks(gs).enumerate() {
                    let absmax = group.iter().fold(0.0f32, |m, v| m.max(v.abs()));
                    let s = (absmax / qmax).max(MIN_SCALE);
                    scales.push(s);
                    for (k, v) in group.iter().enumerate() {
                        q[g * gs + k] = (v / s).round_ties_even().clamp(-qmax - 1.0, qmax) as i8;
                    }
                }
                let dst = &mut data[o * row_bytes..(o + 1) * row_bytes];
                if format == QuantFormat::Int8PerRow {
                    for (d, v) in dst.iter_mut().zip(&q) {
                        *d = *v as u8;
                    }
                } else {
                    for (j, d) in dst.iter_mut().enumerate() {
                        let lo = (q[2 * j] + 8) as u8;
                        let hi = q.get(2 * j + 1).map_or(8, |v| (v + 8) as u8);
                        *d = lo | (hi << 4);
                    }
                }
            }
        }
    }
    Ok(Packed {
        format,
        rows,
        cols,
        data,
        scales,
    })
}

/// Reference dequantisation of row `o` of `m` into `out` (length `m.cols()`).
pub fn reference_dequantize_row(m: &QMatrix<'_>, o: usize, out: &mut [f32]) {
    let cols = m.cols();
    let row = m.row_data(o);
    let scales = m.row_scales(o);
    let out = &mut out[..cols];
    match m.format() {
        QuantFormat::F32 => {
            for (d, b) in out.iter_mut().zip(row.chunks_exact(4)) {
                *d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QuantFormat::Bf16 => {
            for (d, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *d = half::bf16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        QuantFormat::F16 => {
            for (d, b) in out.iter_mut().zip(row.chunks_exact(2)) {
                *d = half::f16::from_le_bytes([b[0], b[1]]).to_f32();
            }
        }
        QuantFormat::Int8PerRow => {
            for (d, b) in out.iter_mut().zip(row) {
                *d = (*b as i8) as f32 * scales[0];
            }
        }
        QuantFormat::Int4PerRow | QuantFormat::Int4Grouped { .. } => {
            let gs = m.format().group_size(cols);
            for (i, d) in out.iter_mut().enumerate() {
                let byte = row[i / 2];
                let nibble = if i % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                *d = (nibble as i32 - 8) as f32 * scales[i / gs];
            }
        }
    }
}

/// Reference dequantisation of the whole matrix, row-major [rows, cols].
pub fn dequantize(m: &QMatrix<'_>) -> Vec<f32> {
    let mut out = vec![0.0f32; m.rows() * m.cols()];
    for o in 0..m.rows() {
        reference_dequantize_row(m, o, &mut out[o * m.cols()..(o + 1) * m.cols()]);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(seed: u64, n: usize, scale: f32) -> Vec<f32> {
        let mut x = seed;
        (0..n)
            .map(|_| {
                x = x
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
            })
            .collect()
    }

    const FORMATS: [QuantFormat; 5] = [
        QuantFormat::Int8PerRow,
        QuantFormat::Int4PerRow,
        QuantFormat::Int4Grouped { group_size: 16 },
        QuantFormat::Int4Grouped { group_size: 64 },
        QuantFormat::Int4Grouped { group_size: 96 },
    ];

    #[test]
    fn error_within_half_a_step() {
        for (rows, cols) in [(1, 1), (3, 7), (5, 64), (4, 130), (2, 257)] {
            let w = lcg(rows as u64 * 31 + cols as u64, rows * cols, 3.0);
            for f in FORMATS {
                let p = quantize(f, "w", &w, rows, cols).unwrap();
                let back = dequantize(&p.view());
                let gs = f.group_size(cols);
                for o in 0..rows {
                    for i in 0..cols {
                        let s = p.scales[o * f.scales_per_row(cols) + i / gs];
                        let err = (back[o * cols + i] - w[o * cols + i]).abs();
                        assert!(
                            err <= 0.5 * s * 1.0001,
                            "{f} [{rows},{cols}] err {err} s {s}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn known_bytes() {
        // One row [-7, 7, 0, 1] at int4 per-row: absmax 7 → s = 1; q + 8 = [1, 15, 8, 9].
        let p = quantize(QuantFormat::Int4PerRow, "w", &[-7.0, 7.0, 0.0, 1.0], 1, 4).unwrap();
        assert_eq!(p.scales, vec![1.0]);
        assert_eq!(p.data, vec![0xf1, 0x98]);
        // Odd length: the missing high nibble is stored as 8 (q = 0).
        let p = quantize(QuantFormat::Int4PerRow, "w", &[7.0, -7.0, 3.5], 1, 3).unwrap();
        assert_eq!(p.data, vec![0x1f, 0x8c]); // 3.5/1 rounds half-even to 4 → 12 = 0xc
                                              // int8: absmax 127 → s = 1, bytes are two's complement.
        let p = quantize(QuantFormat::Int8PerRow, "w", &[-127.0, 2.5, 127.0], 1, 3).unwrap();
        assert_eq!(p.data, vec![0x81, 2, 127]); // 2.5 → 2 (half-even)
    }

    #[test]
    fn all_zeros_use_min_scale() {
        let p = quantize(
            QuantFormat::Int4Grouped { group_size: 64 },
            "w",
            &[0.0; 130],
            1,
            130,
        )
        .unwrap();
        assert!(p.scales.iter().all(|&s| s == MIN_SCALE));
        assert!(dequantize(&p.view()).iter().all(|&v| v == 0.0));
    }

    #[test]
    fn extreme_values_stay_finite() {
        // Near f32::MAX, q·s can round past MAX (e.g. 127·(MAX/127)); 3e38 stays finite.
        let w = [3e38, -3e38, 1e-30, -1e-30, f32::MIN_POSITIVE, 0.0];
        for f in FORMATS {
            let p = quantize(f, "w", &w, 1, 6).unwrap();
            let back = dequantize(&p.view());
            assert!(back.iter().all(|v| v.is_finite()), "{f}: {back:?}");
            assert_eq!(back[0], -back[1]);
        }
    }

    #[test]
    fn non_finite_is_refused_with_the_tensor_name() {
        let err = quantize(
            QuantFormat::Int8PerRow,
            "layers.0.mlp",
            &[1.0, f32::NAN],
            1,
            2,
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("layers.0.mlp") && err.contains("NaN"), "{err}");
        let err = quantize(QuantFormat::F32, "x", &[f32::INFINITY], 1, 1).unwrap_err();
        assert!(err.to_string().contains("Inf"));
    }

    #[test]
    fn float_formats_round_trip() {
        let w = lcg(7, 12, 1.0);
        let p = quantize(QuantFormat::F32, "w", &w, 3, 4).unwrap();
        assert_eq!(dequantize(&p.view()), w);
        let p = quantize(QuantFormat::Bf16, "w", &w, 3, 4).unwrap();
        for (a, b) in dequantize(&p.view()).iter().zip(&w) {
            assert!((a - b).abs() <= b.abs() / 128.0);
        }
    }
}
