//! Deterministic random quantised matrices for the kernel benches and the probes in tools/
//! (which include this file by path, so both time the same data).

use colibri::quant::{QMatrix, QuantFormat};

/// Deterministic pseudo-random bytes.
pub fn bytes(seed: u64, n: usize) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (x >> 56) as u8
        })
        .collect()
}

/// A random matrix in `format`: random nibbles/bytes with scales in [0.005, 0.01), or random
/// bf16 values in (-1, 1).
pub struct Owned {
    pub format: QuantFormat,
    pub rows: usize,
    pub cols: usize,
    pub data: Vec<u8>,
    pub scales: Vec<f32>,
}

impl Owned {
    pub fn new(format: QuantFormat, rows: usize, cols: usize, seed: u64) -> Self {
        let n = format.data_bytes(rows, cols).expect("size");
        let mut data = bytes(seed, n);
        if format == QuantFormat::Bf16 {
            for pair in data.chunks_exact_mut(2) {
                // sign, exponent 119..126 (|v| < 1), random mantissa.
                let e = 119 + (pair[1] & 7) as u16;
                let v = ((pair[1] as u16 & 0x80) << 8) | (e << 7) | (pair[0] as u16 & 0x7F);
                pair.copy_from_slice(&v.to_le_bytes());
            }
        }
        let scales = bytes(seed + 1, format.scale_count(rows, cols).expect("size"))
            .into_iter()
            .map(|b| 0.005 + b as f32 / 51200.0)
            .collect();
        Owned {
            format,
            rows,
            cols,
            data,
            scales,
        }
    }

    pub fn view(&self) -> QMatrix<'_> {
        QMatrix::new(self.format, self.rows, self.cols, &self.data, &self.scales).expect("view")
    }

    /// The first `r` rows as a matrix of their own.
    pub fn head(&self, r: usize) -> QMatrix<'_> {
        let rb = self.format.row_bytes(self.cols);
        let sr = self.format.scales_per_row(self.cols);
        QMatrix::new(
            self.format,
            r,
            self.cols,
            &self.data[..r * rb],
            &self.scales[..r * sr],
        )
        .expect("head")
    }
}
