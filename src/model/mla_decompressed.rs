//! MLA attention for long prefills, computed "decompressed", as transformers writes it: each
//! head's keys `[k_nope | k_rope]` and values are expanded from the cached latents by kv_b,
//! scores are `q · k` over `qk_nope + qk_rope` dimensions and the output is the weighted sum
//! of the value rows. Per (row, key, head) that is `qk_nope + qk_rope + v` multiply-adds
//! (160 for DeepSeek-V3's 64/32/64 test shape, 320 for the real 128/64/128) against the
//! absorbed form's `2·kv_lora + qk_rope` (544, 1,088), and both products run on the matmul
//! kernels in blocks of rows. The price is expanding every key once per forward (`T · heads ·
//! (qk_nope + v) · kv_lora` multiply-adds), which pays only when the forward has many rows
//! ([`pays`]). Every product here is f32 (the expansion on the exact kernels too), but the
//! sums run in another order than the absorbed form's, so the values differ from it in the
//! last bits and depend on how the prompt is chunked: the engine uses this form only in the
//! fast prefill arithmetic, which promises a tolerance, not identity (docs/architecture.md,
//! "Prefill arithmetic").

use rayon::prelude::*;

use crate::error::Result;
use crate::quant::format::{QMatrix, QuantFormat};
use crate::quant::kernels;

/// Query rows per block of the causal product: a block computes its scores against the keys
/// its last row sees, so at most this many rows' worth of masked scores are wasted per block.
const ROW_BLOCK: usize = 64;

/// Floats of expanded keys and values held at once; heads are expanded in groups below it
/// (but never fewer heads than the pool has threads).
const EXPANDED_FLOATS: usize = 16 << 20;

/// The head dimensions of one layer.
#[derive(Clone, Copy, Debug)]
pub(super) struct Dims {
    pub heads: usize,
    pub nope: usize,
    pub rope: usize,
    pub v: usize,
    pub kv_lora: usize,
}

impl Dims {
    fn qd(&self) -> usize {
        self.nope + self.rope
    }
}

/// Whether the decompressed form costs fewer multiply-adds than the absorbed one for `s` rows
/// at cache rows `start..start + s` (dense causal attention): it pays for expanding all
/// `start + s` keys and saves, per (row, key, head), `2·kv_lora + rope − (nope + rope + v)`,
/// plus the absorbed form's per-row folds of kv_b into the query and out of the output.
pub(super) fn pays(d: Dims, s: usize, start: usize) -> bool {
    let t = (start + s) as u128;
    let s = s as u128;
    let pairs = s * start as u128 + s * (s + 1) / 2;
    let (h, kl) = (d.heads as u128, d.kv_lora as u128);
    let fold = (d.nope + d.v) as u128 * kl;
    let absorbed = h * (s * fold + pairs * (2 * kl + d.rope as u128));
    let decompressed = h * (t * fold + pairs * (d.qd() + d.v) as u128);
    decompressed < absorbed
}

/// The borrowed inputs of [`attend`].
pub(super) struct Inputs<'a> {
    pub dims: Dims,
    /// [s, heads, nope + rope], the rope part already rotated.
    pub q: &'a [f32],
    pub s: usize,
    /// Cache rows before these: row r attends to keys `0..=start + r`.
    pub start: usize,
    /// [start + s, kv_lora] normed latents (these rows' included).
    pub latent: &'a [f32],
    /// [start + s, rope] rotated shared keys.
    pub rope_key: &'a [f32],
    /// kv_b: per head `nope` key rows then `v` value rows, each `kv_lora` wide.
    pub kv_b: &'a QMatrix<'a>,
    pub scale: f32,
}

/// Causal attention of the `s` rows, decompressed: [s, heads, v].
pub(super) fn attend(x: &Inputs<'_>, pool: Option<&rayon::ThreadPool>) -> Result<Vec<f32>> {
    attend_within(x, pool, EXPANDED_FLOATS)
}

/// [`attend`] expanding at most `max_floats` of keys and values at once (beyond one head per
/// thread): the values do not depend on it.
fn attend_within(
    x: &Inputs<'_>,
    pool: Option<&rayon::ThreadPool>,
    max_floats: usize,
) -> Result<Vec<f32>> {
    let d = x.dims;
    let t = x.start + x.s;
    let per_head = d.nope + d.v;
    // At least one head per thread, or a long context would leave the other threads idle.
    let threads = pool.map_or(1, |p| p.current_num_threads());
    let group = (max_floats / (t * per_head).max(1))
        .max(threads)
        .clamp(1, d.heads);
    let mut out = vec![0.0f32; x.s * d.heads * d.v];
    for h0 in (0..d.heads).step_by(group) {
        let n = group.min(d.heads - h0);
        // kv[t, n · (nope + v)]: the group's keys and values of every cached row.
        let w = x.kv_b.row_range(h0 * per_head, n * per_head)?;
        // Exact: the int8 arithmetic here saved nothing measurable and cost accuracy (the
        // latents are the keys and values themselves).
        let mut kv = vec![0.0f32; t * n * per_head];
        kernels::matmul(&w, x.latent, t, &mut kv, pool)?;
        let one = |hl: usize| head(x, &kv, n, hl, h0 + hl);
        let heads: Vec<Vec<f32>> = match pool {
            Some(p) => p.install(|| (0..n).into_par_iter().map(one).collect::<Result<_>>())?,
            None => (0..n).map(one).collect::<Result<_>>()?,
        };
        for (hl, o) in heads.iter().enumerate() {
            for r in 0..x.s {
                let at = (r * d.heads + h0 + hl) * d.v;
                out[at..at + d.v].copy_from_slice(&o[r * d.v..(r + 1) * d.v]);
            }
        }
    }
    Ok(out)
}

/// Head `hh` (local index `hl` in the expanded group `kv` of `n` heads): [s, v].
fn head(x: &Inputs<'_>, kv: &[f32], n: usize, hl: usize, hh: usize) -> Result<Vec<f32>> {
    let d = x.dims;
    let (qd, t, per_head) = (d.qd(), x.start + x.s, d.nope + d.v);
    let stride = n * per_head;
    // keys[t, qd] = [k_nope | k_rope]; values transposed, vt[v, t].
    let mut keys = vec![0.0f32; t * qd];
    let mut vt = vec![0.0f32; d.v * t];
    for j in 0..t {
        let row = &kv[j * stride + hl * per_head..j * stride + (hl + 1) * per_head];
        keys[j * qd..j * qd + d.nope].copy_from_slice(&row[..d.nope]);
        keys[j * qd + d.nope..(j + 1) * qd]
            .copy_from_slice(&x.rope_key[j * d.rope..(j + 1) * d.rope]);
        for (c, v) in row[d.nope..].iter().enumerate() {
            vt[c * t + j] = *v;
        }
    }
    let mut q = vec![0.0f32; x.s * qd];
    for r in 0..x.s {
        let at = (r * d.heads + hh) * qd;
        q[r * qd..(r + 1) * qd].copy_from_slice(&x.q[at..at + qd]);
    }
    let mut out = vec![0.0f32; x.s * d.v];
    let mut vt_block = Vec::new();
    for r0 in (0..x.s).step_by(ROW_BLOCK) {
        let r1 = (r0 + ROW_BLOCK).min(x.s);
        let rows = r1 - r0;
        // Keys the block's last row sees; earlier rows mask the rest.
        let seen = x.start + r1;
        let k = f32_matrix(&keys[..seen * qd], seen, qd)?;
        let mut p = vec![0.0f32; rows * seen];
        kernels::matmul(&k, &q[r0 * qd..r1 * qd], rows, &mut p, None)?;
        for (i, row) in p.chunks_exact_mut(seen).enumerate() {
            softmax_causal(row, x.start + r0 + i + 1, x.scale);
        }
        let values = if seen == t {
            &vt[..]
        } else {
            vt_block.clear();
            for c in 0..d.v {
                vt_block.extend_from_slice(&vt[c * t..c * t + seen]);
            }
            &vt_block[..]
        };
        let v = f32_matrix(values, d.v, seen)?;
        kernels::matmul(&v, &p, rows, &mut out[r0 * d.v..r1 * d.v], None)?;
    }
    Ok(out)
}

/// `row[..visible]` ← softmax(row · scale); the masked rest ← 0.
fn softmax_causal(row: &mut [f32], visible: usize, scale: f32) {
    let (seen, masked) = row.split_at_mut(visible);
    masked.fill(0.0);
    let max = seen
        .iter()
        .fold(f32::NEG_INFINITY, |m, &v| m.max(v * scale));
    let mut sum = 0.0f32;
    for v in seen.iter_mut() {
        *v = (*v * scale - max).exp();
        sum += *v;
    }
    let inv = 1.0 / sum;
    for v in seen.iter_mut() {
        *v *= inv;
    }
}

/// A row-major f32 matrix as a kernel operand.
fn f32_matrix(data: &[f32], rows: usize, cols: usize) -> Result<QMatrix<'_>> {
    QMatrix::new(
        QuantFormat::F32,
        rows,
        cols,
        bytemuck::cast_slice(data),
        &[],
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dims() -> Dims {
        Dims {
            heads: 16,
            nope: 64,
            rope: 32,
            v: 64,
            kv_lora: 256,
        }
    }

    #[test]
    fn the_decompressed_form_pays_for_long_prefills_only() {
        // A whole 2,048-token prompt, and 512 rows after 1,536 cached.
        assert!(pays(dims(), 2048, 0));
        assert!(pays(dims(), 512, 1536));
        // A chunk of 16 rows after a long prefix: expanding 4,000 keys costs more than the
        // absorbed form spends on 16 rows.
        assert!(!pays(dims(), 16, 4000));
        // A forward from an empty cache expands exactly the keys the absorbed form folds
        // (one per row), so it always pays there.
        assert!(pays(dims(), 16, 0));
        // Break-even after a prefix: 16 × 384 MACs saved per key and head against 32,768
        // spent expanding it, so about 85 rows.
        assert!(!pays(dims(), 80, 100_000));
        assert!(pays(dims(), 90, 100_000));
    }

    /// Layer 0's attention of a real checkpoint over a 37-row prefix and then 70 rows (two
    /// row blocks, the second one partial), both forms from the same cache.
    #[test]
    fn the_decompressed_form_computes_the_absorbed_forms_attention() {
        use crate::container::Container;
        use crate::model::attention::{Attention, Form, LayerKv};
        use crate::model::rope::Rope;
        use std::path::Path;

        for dir in ["tests/fixtures/dsv3_a", "python/colibri/models/tiny"] {
            let c = Container::open(&Path::new(env!("CARGO_MANIFEST_DIR")).join(dir)).unwrap();
            let cfg = c.config().clone();
            let attn = Attention::load(&c, &cfg, "model.layers.0", 0, false).unwrap();
            let rope = Rope::new(&cfg);
            let h = cfg.hidden_size;
            let mut state = 0x9e37_79b9u32;
            let mut next = || {
                state ^= state << 13;
                state ^= state >> 17;
                state ^= state << 5;
                (state as f32 / u32::MAX as f32) * 2.0 - 1.0
            };
            let (start, s) = (37, 70);
            let prefix: Vec<f32> = (0..start * h).map(|_| next()).collect();
            let xn: Vec<f32> = (0..(s + 1) * h).map(|_| next()).collect();
            let mut kv = LayerKv::new(cfg.kv_lora_rank, cfg.qk_rope_head_dim, 0);
            let run = |kv: &LayerKv, x: &[f32], form: Form| {
                let mut kv = kv.clone();
                let (y, _) = attn
                    .forward(x, s, start, start, &mut kv, &rope, None, None, form)
                    .unwrap();
                (y, kv)
            };
            attn.forward(
                &prefix,
                start,
                0,
                0,
                &mut kv,
                &rope,
                None,
                None,
                Form::Absorbed,
            )
            .unwrap();
            let (absorbed, kv_a) = run(&kv, &xn[..s * h], Form::Absorbed);
            let (decompressed, kv_d) = run(&kv, &xn[..s * h], Form::Decompressed);
            assert_eq!(kv_a.parts(), kv_d.parts(), "{dir}: the same cache rows");
            let scale = absorbed.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert!(scale > 1e-3, "{dir}: a non-trivial output");
            let err = |y: &[f32]| {
                y.iter()
                    .zip(&absorbed)
                    .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()))
                    / scale
            };
            assert!(err(&decompressed) < 1e-5, "{dir}: {}", err(&decompressed));
            // The tolerance tells attention apart: the next rows' input, one row later.
            let (shifted, _) = run(&kv, &xn[h..], Form::Decompressed);
            assert!(err(&shifted) > 1e-2, "{dir}: control {}", err(&shifted));
        }
    }

    /// Heads expanded one per group, or all at once, on one thread or a pool of two: the same
    /// bits (each head's values never depend on its group or thread).
    #[test]
    fn grouping_and_threads_do_not_change_a_value() {
        let d = Dims {
            heads: 5,
            nope: 8,
            rope: 4,
            v: 6,
            kv_lora: 16,
        };
        let (s, start) = (70, 9);
        let t = start + s;
        let mut state = 0x1234_5678u32;
        let mut next = |n: usize| -> Vec<f32> {
            (0..n)
                .map(|_| {
                    state ^= state << 13;
                    state ^= state >> 17;
                    state ^= state << 5;
                    (state as f32 / u32::MAX as f32) * 2.0 - 1.0
                })
                .collect()
        };
        let q = next(s * d.heads * d.qd());
        let latent = next(t * d.kv_lora);
        let rope_key = next(t * d.rope);
        let w = next(d.heads * (d.nope + d.v) * d.kv_lora);
        let kv_b = f32_matrix(&w, d.heads * (d.nope + d.v), d.kv_lora).unwrap();
        let x = Inputs {
            dims: d,
            q: &q,
            s,
            start,
            latent: &latent,
            rope_key: &rope_key,
            kv_b: &kv_b,
            scale: 0.3,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let reference = attend_within(&x, None, usize::MAX).unwrap();
        assert!(reference.iter().any(|v| *v != 0.0));
        for (p, max) in [(None, 1), (Some(&pool), 1), (Some(&pool), usize::MAX)] {
            let got = attend_within(&x, p, max).unwrap();
            assert!(
                got.iter()
                    .zip(&reference)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "max {max}, pool {}",
                p.is_some()
            );
        }
    }

    #[test]
    fn softmax_masks_and_normalises() {
        let mut row = vec![1.0, 2.0, 3.0, 9.0];
        softmax_causal(&mut row, 3, 0.5);
        assert_eq!(row[3], 0.0);
        let sum: f32 = row.iter().sum();
        assert!((sum - 1.0).abs() < 1e-6);
        let e = |v: f32| (0.5 * v - 1.5).exp();
        let z = e(1.0) + e(2.0) + e(3.0);
        assert!((row[0] - e(1.0) / z).abs() < 1e-6);
        assert!((row[2] - e(3.0) / z).abs() < 1e-6);
    }
}
