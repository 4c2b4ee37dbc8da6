//! RMSNorm as transformers computes it: x · rsqrt(mean(x²) + eps) · w, in f32.

/// Normalise each `dim`-wide row of `x` in place with weight `w`.
pub fn rmsnorm_inplace(x: &mut [f32], w: &[f32], eps: f32) {
    let dim = w.len();
    for row in x.chunks_exact_mut(dim) {
        let ss: f32 = row.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let inv = 1.0 / (ss + eps).sqrt();
        for (v, g) in row.iter_mut().zip(w) {
            *v = g * (*v * inv);
        }
    }
}

/// `rmsnorm_inplace` into a new buffer.
pub fn rmsnorm(x: &[f32], w: &[f32], eps: f32) -> Vec<f32> {
    let mut out = x.to_vec();
    rmsnorm_inplace(&mut out, w, eps);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unit_rms_after_norm() {
        let x = [3.0f32, -4.0, 0.0, 5.0, 1.0, 1.0, 1.0, 1.0];
        let y = rmsnorm(&x, &[1.0; 4], 0.0);
        for row in y.chunks(4) {
            let ms: f32 = row.iter().map(|v| v * v).sum::<f32>() / 4.0;
            assert!((ms - 1.0).abs() < 1e-6);
        }
        assert!((y[0] / y[1] + 0.75).abs() < 1e-6);
    }
}
