//! FP8 e4m3fn decoding and DeepSeek-style block dequantisation: a weight [O, I] stored as
//! `F8_E4M3` with `weight_scale_inv` [ceil(O/bo), ceil(I/bi)] (bo = bi = 128 in DeepSeek-V3
//! and GLM-5) decodes as w[o, i] = fp8(o, i) · scale_inv[o / bo, i / bi].

/// Value of one e4m3fn byte: 1 sign bit, 4 exponent bits (bias 7), 3 mantissa bits; no
/// infinities; 0x7f/0xff are NaN; exponent 0 is subnormal (m/8 · 2^-6).
pub fn e4m3_to_f32(b: u8) -> f32 {
    let sign = if b & 0x80 != 0 { -1.0f32 } else { 1.0 };
    let exp = ((b >> 3) & 0x0f) as i32;
    let man = (b & 0x07) as f32;
    if exp == 0x0f && b & 0x07 == 0x07 {
        return f32::NAN;
    }
    if exp == 0 {
        sign * man / 8.0 * 2f32.powi(-6)
    } else {
        sign * (1.0 + man / 8.0) * 2f32.powi(exp - 7)
    }
}

/// All 256 e4m3fn values, indexed by byte.
pub fn e4m3_table() -> [f32; 256] {
    let mut t = [0.0f32; 256];
    for (i, v) in t.iter_mut().enumerate() {
        *v = e4m3_to_f32(i as u8);
    }
    t
}

/// Decode rows `row0..row0 + raw.len()/cols` of an FP8 block-scaled [rows, cols] weight
/// into `out` (same length as `raw`). `scale_inv` is row-major [ceil(rows/bo), ceil(cols/bi)].
/// The caller checks the lengths (see [`crate::convert`]).
pub fn dequant_block_rows(
    table: &[f32; 256],
    raw: &[u8],
    row0: usize,
    cols: usize,
    scale_inv: &[f32],
    block: (usize, usize),
    out: &mut [f32],
) {
    let (bo, bi) = block;
    let scale_cols = cols.div_ceil(bi);
    for (r, (src, dst)) in raw
        .chunks_exact(cols)
        .zip(out.chunks_exact_mut(cols))
        .enumerate()
    {
        let srow = &scale_inv[((row0 + r) / bo) * scale_cols..][..scale_cols];
        for (i, (d, b)) in dst.iter_mut().zip(src).enumerate() {
            *d = table[*b as usize] * srow[i / bi];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_values() {
        assert_eq!(e4m3_to_f32(0x00), 0.0);
        assert_eq!(e4m3_to_f32(0x38), 1.0); // exp 7, man 0
        assert_eq!(e4m3_to_f32(0xb8), -1.0);
        assert_eq!(e4m3_to_f32(0x7e), 448.0); // the largest finite value
        assert_eq!(e4m3_to_f32(0x01), 2f32.powi(-9)); // smallest subnormal
        assert_eq!(e4m3_to_f32(0x08), 2f32.powi(-6)); // smallest normal
        assert!(e4m3_to_f32(0x7f).is_nan() && e4m3_to_f32(0xff).is_nan());
        // Round trip through half's own implementation-independent ordering: monotone.
        let t = e4m3_table();
        for b in 0..0x7eu8 {
            assert!(t[b as usize] < t[b as usize + 1]);
        }
    }

    #[test]
    fn block_scales_apply_per_block() {
        let t = e4m3_table();
        // [3, 5] weight of ones (0x38), blocks 2×2 → scale_inv [2, 3].
        let raw = vec![0x38u8; 15];
        let s = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
        let mut out = vec![0.0; 15];
        dequant_block_rows(&t, &raw, 0, 5, &s, (2, 2), &mut out);
        assert_eq!(
            out,
            vec![1., 1., 2., 2., 3., 1., 1., 2., 2., 3., 4., 4., 5., 5., 6.]
        );
        let mut tail = vec![0.0; 5];
        dequant_block_rows(&t, &raw[10..], 2, 5, &s, (2, 2), &mut tail);
        assert_eq!(tail, vec![4., 4., 5., 5., 6.]);
    }
}
