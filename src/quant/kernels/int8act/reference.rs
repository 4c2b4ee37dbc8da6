//! The scalar reference of the int8 arithmetic, from the reference dequantiser's integers.

use super::matmul::check;
use super::{block_scales, offset_shift, sum_lanes, QuantizedActs, BLOCK, LANES};
use crate::error::Result;
use crate::quant::format::QMatrix;
use crate::quant::pack::reference_dequantize_row;
/// The reference: `y[t, o]` for the activations `x` by the arithmetic in the module docs,
/// computed from the reference dequantiser's integers (not from the lane layouts).
pub fn reference_matmul(w: &QMatrix<'_>, x: &QuantizedActs, y: &mut [f32]) -> Result<()> {
    check(w, x, y.len())?;
    let s = x.rows;
    if s == 0 {
        return Ok(());
    }
    let mut out_t = vec![0.0f32; w.rows() * s];
    reference_rows(w, 0, x, &mut out_t);
    transpose(&out_t, w.rows(), s, y);
    Ok(())
}

/// [`reference_matmul`] for the rows `o0..o0 + out.len() / S`, written transposed.
pub(super) fn reference_rows(w: &QMatrix<'_>, o0: usize, x: &QuantizedActs, out: &mut [f32]) {
    let (cols, s) = (w.cols(), x.rows);
    let blocks = x.chunks * LANES;
    let shift = offset_shift(w.format());
    let mut deq = vec![0.0f32; cols];
    let mut q = vec![0i32; blocks * BLOCK];
    let mut sw = vec![0.0f32; blocks];
    for (i, out) in out.chunks_exact_mut(s).enumerate() {
        let o = o0 + i;
        // The stored integers: the reference weights divided by their scale (exact: each is
        // an integer times a scale, and the division by that scale undoes it).
        reference_dequantize_row(w, o, &mut deq);
        block_scales(w, o, &mut sw);
        q.fill(0);
        for (e, v) in deq.iter().enumerate() {
            let s = sw[e / BLOCK];
            q[e] = if s == 0.0 { 0 } else { (v / s).round() as i32 };
        }
        for (t, y) in out.iter_mut().enumerate() {
            let mut lanes = [0.0f32; LANES];
            for b in 0..blocks {
                let xq = x.block(t, b);
                // d = Σ u·xq − o·Σ xq with u = q + o: the same integer as Σ q·xq.
                let d: i32 = q[b * BLOCK..(b + 1) * BLOCK]
                    .iter()
                    .zip(&xq)
                    .map(|(q, x)| (q + (1 << shift)) * *x as i32)
                    .sum::<i32>()
                    - (x.sums[t * blocks + b] << shift);
                let scale = sw[b] * x.scales[t * blocks + b];
                lanes[b % LANES] = (d as f32).mul_add(scale, lanes[b % LANES]);
            }
            *y = sum_lanes(&lanes);
        }
    }
}

/// `dst[t·rows + o] = src[o·s + t]`: [rows, s] → [s, rows].
fn transpose(src: &[f32], rows: usize, s: usize, dst: &mut [f32]) {
    for (o, row) in src.chunks_exact(s).enumerate().take(rows) {
        for (t, v) in row.iter().enumerate() {
            dst[t * rows + o] = *v;
        }
    }
}
