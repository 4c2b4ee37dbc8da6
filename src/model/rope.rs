//! Rotary position embedding, plain or YaRN, laid out as the config says (`rope_interleave`).
//!
//! Follows transformers: the inverse frequencies and YaRN ramp are computed in f32; cos/sin are
//! multiplied by YaRN's `attention_factor`. With interleave the pairs are (2i, 2i+1) and the
//! result is written de-interleaved ([rotated evens; rotated odds]) exactly like transformers'
//! `apply_rotary_pos_emb_interleave`; queries and keys get the same permutation, so dot
//! products are those of the interleaved rotation.

use crate::config::{ModelConfig, RopeScaling};

/// YaRN's `get_mscale`: 1 for scale ≤ 1, else 0.1·mscale·ln(scale) + 1.
pub fn yarn_get_mscale(scale: f64, mscale: f64) -> f64 {
    if scale <= 1.0 {
        1.0
    } else {
        0.1 * mscale * scale.ln() + 1.0
    }
}

impl RopeScaling {
    /// The factor transformers multiplies cos/sin by (`attention_factor` in
    /// `_compute_yarn_parameters`): explicit if given, else
    /// get_mscale(factor, mscale)/get_mscale(factor, mscale_all_dim) when both are non-zero,
    /// else get_mscale(factor, 1).
    pub fn attention_factor(&self) -> f64 {
        if let Some(a) = self.attention_factor {
            return a;
        }
        if self.mscale != 0.0 && self.mscale_all_dim != 0.0 {
            yarn_get_mscale(self.factor, self.mscale)
                / yarn_get_mscale(self.factor, self.mscale_all_dim)
        } else {
            yarn_get_mscale(self.factor, 1.0)
        }
    }
}

/// Attention softmax scale: q_head_dim^-1/2, times mscale² with
/// mscale = get_mscale(factor, mscale_all_dim) when YaRN has a non-zero `mscale_all_dim`
/// (transformers' `yarn_apply_mscale`).
pub fn softmax_scale(cfg: &ModelConfig) -> f32 {
    let mut scale = (cfg.q_head_dim() as f64).powf(-0.5);
    if let Some(r) = &cfg.rope_scaling {
        if r.mscale_all_dim != 0.0 {
            let m = yarn_get_mscale(r.factor, r.mscale_all_dim);
            scale *= m * m;
        }
    }
    scale as f32
}

#[derive(Debug, Clone)]
pub struct Rope {
    /// (dim/2): inverse frequency per rotated pair.
    inv_freq: Vec<f32>,
    /// Multiplier on cos and sin (1 without YaRN).
    attention_factor: f32,
    interleave: bool,
}

impl Rope {
    pub fn new(cfg: &ModelConfig) -> Self {
        let dim = cfg.qk_rope_head_dim;
        let half = dim / 2;
        let base = cfg.rope_theta as f32;
        let pos_freqs: Vec<f32> = (0..half)
            .map(|i| base.powf((2 * i) as f32 / dim as f32))
            .collect();
        let (inv_freq, attention_factor) = match &cfg.rope_scaling {
            None => (pos_freqs.iter().map(|p| 1.0 / p).collect(), 1.0),
            Some(y) => {
                let factor = y.factor as f32;
                let correction_dim = |rot: f64| {
                    (dim as f64
                        * (y.original_max_position_embeddings as f64
                            / (rot * 2.0 * std::f64::consts::PI))
                            .ln())
                        / (2.0 * (cfg.rope_theta).ln())
                };
                let (mut low, mut high) =
                    (correction_dim(y.beta_fast), correction_dim(y.beta_slow));
                if y.truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let low = low.max(0.0) as f32;
                let mut high = high.min(dim as f64 - 1.0) as f32;
                if low == high {
                    high += 0.001;
                }
                let inv: Vec<f32> = (0..half)
                    .map(|i| {
                        let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
                        let extrapolation_factor = 1.0 - ramp;
                        let extra = 1.0 / pos_freqs[i];
                        let inter = 1.0 / (factor * pos_freqs[i]);
                        inter * (1.0 - extrapolation_factor) + extra * extrapolation_factor
                    })
                    .collect();
                (inv, y.attention_factor() as f32)
            }
        };
        Rope {
            inv_freq,
            attention_factor,
            interleave: cfg.rope_interleave,
        }
    }

    /// Rotate each `dim`-wide chunk of `x` (heads of one position) for position `pos`.
    pub fn apply(&self, x: &mut [f32], pos: usize) {
        let half = self.inv_freq.len();
        let dim = 2 * half;
        let mut tmp = [0.0f32; 512];
        for v in x.chunks_exact_mut(dim) {
            tmp[..dim].copy_from_slice(v);
            for i in 0..half {
                let angle = pos as f32 * self.inv_freq[i];
                let (sin, cos) = angle.sin_cos();
                let (cos, sin) = (cos * self.attention_factor, sin * self.attention_factor);
                let (a, b) = if self.interleave {
                    (tmp[2 * i], tmp[2 * i + 1])
                } else {
                    (tmp[i], tmp[i + half])
                };
                v[i] = a * cos - b * sin;
                v[i + half] = b * cos + a * sin;
            }
        }
    }
}
