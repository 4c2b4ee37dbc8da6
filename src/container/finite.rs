//! Stored float values checked before they are used: NaN, ±Inf and magnitudes no trained
//! weight has (they overflow float32 within a layer) are refused when a tensor is loaded,
//! naming the tensor, instead of surfacing later as a NaN logit.

use super::safetensors::Dtype;

/// Largest magnitude accepted in a stored float (weight, scale, norm, router, bias). Trained
/// DeepSeek-V3 / GLM-5 checkpoints stay below 1e4; a value of 1e20 times an activation of
/// order 1e2, summed over thousands of inputs and squared in an attention score, already
/// overflows float32 (3.4e38).
pub const MAX_MAGNITUDE: f32 = 1e20;

/// The first bad value of a tensor.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BadValue {
    pub index: usize,
    pub value: f32,
}

impl BadValue {
    /// "NaN", "Inf", "-Inf" or "the value 3.0e38 (beyond ±1e20)".
    pub fn describe(&self) -> String {
        let v = self.value;
        if v.is_nan() {
            "NaN".into()
        } else if v.is_infinite() {
            if v > 0.0 { "Inf" } else { "-Inf" }.into()
        } else {
            format!("the value {v:e}, beyond the ±{MAX_MAGNITUDE:e} any trained weight stays within (it overflows float32 in the forward pass)")
        }
    }
    pub fn is_non_finite(&self) -> bool {
        !self.value.is_finite()
    }
}

const CHUNK: usize = 4096;

#[inline]
fn bad(x: f32) -> bool {
    x.is_nan() || x.abs() > MAX_MAGNITUDE
}

/// The first value of `vals` that is NaN, infinite or beyond [`MAX_MAGNITUDE`].
pub fn scan_f32(vals: &[f32]) -> Option<BadValue> {
    for (c, chunk) in vals.chunks(CHUNK).enumerate() {
        // Branch-free over the chunk (vectorises), then locate.
        if chunk.iter().fold(0u32, |a, &x| a | bad(x) as u32) != 0 {
            let i = chunk.iter().position(|&x| bad(x)).unwrap_or(0);
            return Some(BadValue {
                index: c * CHUNK + i,
                value: chunk[i],
            });
        }
    }
    None
}

/// Like [`scan_f32`] over little-endian raw bytes of `dtype` (F32, BF16, F16); other
/// dtypes hold no floats and pass.
pub fn scan_raw(raw: &[u8], dtype: Dtype) -> Option<BadValue> {
    let width = match dtype {
        Dtype::F32 => 4,
        Dtype::Bf16 | Dtype::F16 => 2,
        _ => return None,
    };
    let decode = |b: &[u8]| -> f32 {
        match dtype {
            Dtype::F32 => f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
            Dtype::Bf16 => f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16),
            _ => half::f16::from_le_bytes([b[0], b[1]]).to_f32(),
        }
    };
    for (c, chunk) in raw.chunks(CHUNK * width).enumerate() {
        let any = match dtype {
            // F16 cannot exceed 65504: only NaN/Inf (exponent all ones) are bad.
            Dtype::F16 => chunk
                .chunks_exact(2)
                .fold(0u32, |a, b| a | ((b[1] & 0x7c) == 0x7c) as u32),
            _ => chunk
                .chunks_exact(width)
                .fold(0u32, |a, b| a | bad(decode(b)) as u32),
        };
        if any != 0 {
            let (i, value) = chunk
                .chunks_exact(width)
                .map(decode)
                .enumerate()
                .find(|&(_, v)| bad(v))
                .unwrap_or((0, f32::NAN));
            return Some(BadValue {
                index: c * CHUNK + i,
                value,
            });
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn finds_nan_inf_and_overflow_in_every_dtype() {
        let mut v = vec![0.5f32; 10_000];
        assert_eq!(scan_f32(&v), None);
        v[9_000] = 3e38;
        assert_eq!(scan_f32(&v).map(|b| b.index), Some(9_000));
        v[5_000] = f32::NAN;
        assert_eq!(scan_f32(&v).map(|b| b.index), Some(5_000));
        assert!(scan_f32(&v).is_some_and(|b| b.is_non_finite()));
        let f32_raw: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(scan_raw(&f32_raw, Dtype::F32).map(|b| b.index), Some(5_000));
        let bf: Vec<u8> = v
            .iter()
            .flat_map(|x| half::bf16::from_f32(*x).to_le_bytes())
            .collect();
        assert_eq!(scan_raw(&bf, Dtype::Bf16).map(|b| b.index), Some(5_000));
        let mut h = vec![half::f16::from_f32(1.0); 9_000];
        let hr: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        assert_eq!(scan_raw(&hr, Dtype::F16), None);
        h[8_500] = half::f16::NEG_INFINITY;
        let hr: Vec<u8> = h.iter().flat_map(|x| x.to_le_bytes()).collect();
        let b = scan_raw(&hr, Dtype::F16).expect("found");
        assert_eq!((b.index, b.value), (8_500, f32::NEG_INFINITY));
        assert_eq!(scan_raw(&[0xffu8; 64], Dtype::U8), None);
    }
}
