//! The activation rows of a decode-sized call ([`DecodeActs`]): quantised per row and block by
//! the parent module's arithmetic and laid out for the decode kernel that will read them, the
//! AVX-512 VNNI one (`decode.rs`, whose module docs give the layout) or the AVX2 one
//! (`decode_avx2.rs`, with its own quantiser).

use std::arch::x86_64::*;

use super::vnni::quantize_block_vec;
use super::{Int8Kernel, Line, BLOCK, LANES};
use crate::error::{Error, Result};
use crate::quant::format::QuantFormat;

/// The activation rows of a decode-sized call, quantised by the parent module's arithmetic and
/// laid out for the weights' format (see the module docs).
pub struct DecodeActs {
    pub(super) rows: usize,
    pub(super) cols: usize,
    /// Chunks of 16 blocks per row (the prefill layout's count, at least 1).
    pub(super) chunks: usize,
    /// The decode kernel these rows are for (AVX-512 VNNI or AVX2, `decode_avx2.rs`), which
    /// was available when they were quantised. The lines are in that kernel's layout (the
    /// AVX2 kernel's is its own, written by its quantiser; scales and sums are the same);
    /// only the VNNI kernel has a packed form.
    pub(super) kernel: Int8Kernel,
    /// Laid out for int8 weights (blocks in element order) rather than int4 (for the VNNI
    /// kernel, qwords of 8 blocks' even and odd elements, see the module docs).
    pub(super) int8: bool,
    /// [rows][chunks · 16] lines.
    pub(super) lines: Vec<Line>,
    /// [rows][chunks · 16]: `sx_b` (0 past the last block).
    pub(super) scales: Vec<f32>,
    /// [rows][chunks · 16]: `Σ xq` of each block (0 past the last block).
    pub(super) sums: Vec<i32>,
    /// For rows of nb = 1, 2, 4 or 8 whole blocks: each row repeated 16 / nb times, so that one
    /// 16-block chunk of weights holds 16 / nb weight rows (`decode.rs`'s `rows_packed`). Kept when a
    /// refill has no packed form (`has_packed` false), so that its buffers serve the next one.
    packed: Option<Box<DecodeActs>>,
    has_packed: bool,
}

impl DecodeActs {
    /// Quantise `x` ([rows, cols] row-major) for weights of `format` (one that has an int8
    /// form), for the active int8 kernel's decode kernel. An error where that kernel has no
    /// decode kernel (the scalar reference), or if `x` is not [rows, cols].
    pub fn new(x: &[f32], rows: usize, cols: usize, format: QuantFormat) -> Result<Self> {
        let mut acts = DecodeActs::empty();
        acts.fill(x, rows, cols, format)?;
        Ok(acts)
    }

    /// No rows (buffers for [`DecodeActs::fill`]).
    pub fn empty() -> Self {
        DecodeActs {
            rows: 0,
            cols: 0,
            chunks: 1,
            kernel: Int8Kernel::Vnni,
            int8: false,
            lines: Vec::new(),
            scales: Vec::new(),
            sums: Vec::new(),
            packed: None,
            has_packed: false,
        }
    }

    /// [`DecodeActs::new`] into these buffers: a decode step quantises a few rows per expert
    /// and layer, and allocating them each time cost more than quantising.
    pub fn fill(&mut self, x: &[f32], rows: usize, cols: usize, format: QuantFormat) -> Result<()> {
        self.fill_on(crate::quant::kernels::int8_kernel()?, x, rows, cols, format)
    }

    /// [`DecodeActs::fill`] for `kernel`'s decode kernel (AVX-512 VNNI or AVX2): an error if
    /// it has none or this CPU cannot run it.
    pub fn fill_on(
        &mut self,
        kernel: Int8Kernel,
        x: &[f32],
        rows: usize,
        cols: usize,
        format: QuantFormat,
    ) -> Result<()> {
        if !matches!(kernel, Int8Kernel::Vnni | Int8Kernel::Avx2) || !kernel.available() {
            return Err(Error::invalid(
                "int8 decode activations",
                format!("this CPU runs no int8 decode kernel for {}", kernel.name()),
            ));
        }
        self.kernel = kernel;
        if rows.checked_mul(cols) != Some(x.len()) {
            return Err(Error::invalid(
                "int8 decode activations",
                format!("{} values are not {rows} rows of {cols}", x.len()),
            ));
        }
        let chunks = super::chunks_for(cols);
        let blocks = chunks * LANES;
        (self.rows, self.cols, self.chunks) = (rows, cols, chunks);
        self.int8 = format == QuantFormat::Int8PerRow;
        // Every line, scale and sum is written below (zero past the last block).
        self.lines.resize(rows * blocks, Line([0; 64]));
        self.scales.resize(rows * blocks, 0.0);
        self.sums.resize(rows * blocks, 0);
        for r in 0..rows {
            let src = &x[r * cols..(r + 1) * cols];
            let (lines, scales, sums) = (
                &mut self.lines[r * blocks..(r + 1) * blocks],
                &mut self.scales[r * blocks..(r + 1) * blocks],
                &mut self.sums[r * blocks..(r + 1) * blocks],
            );
            // SAFETY: the CPU runs the kernel (checked above); each row's slices hold `blocks`
            // elements.
            unsafe { quantize_row_on(kernel, src, self.int8, lines, scales, sums) };
        }
        let nb = cols / BLOCK;
        // (The AVX2 kernel packs narrow rows without a tiled copy.)
        self.has_packed =
            kernel == Int8Kernel::Vnni && cols.is_multiple_of(BLOCK) && matches!(nb, 1 | 2 | 4 | 8);
        if self.has_packed {
            let mut packed = self
                .packed
                .take()
                .unwrap_or_else(|| Box::new(DecodeActs::empty()));
            self.tile_into(x, nb, &mut packed);
            self.packed = Some(packed);
        }
        Ok(())
    }

    /// The packed form of these rows, when they have one.
    pub(super) fn packed(&self) -> Option<&DecodeActs> {
        self.packed.as_deref().filter(|_| self.has_packed)
    }

    /// (VNNI rows only.) These rows (of `nb` whole blocks, `x` their values) repeated 16 / nb
    /// times into `tiled`,
    /// as [`DecodeActs::new`] of the repeated values would quantise and lay them out:
    /// quantisation is per block, so the scales and sums are copies of the row's own, and so
    /// are an int8 row's lines (one per block). An int4 line holds parts of 8 blocks, so int4
    /// rows are quantised again, repeated.
    fn tile_into(&self, x: &[f32], nb: usize, tiled: &mut DecodeActs) {
        let blocks = self.chunks * LANES;
        (tiled.rows, tiled.cols, tiled.chunks) = (self.rows, LANES * BLOCK, 1);
        tiled.int8 = self.int8;
        tiled.kernel = self.kernel;
        tiled.has_packed = false;
        tiled.lines.clear();
        tiled.scales.clear();
        tiled.sums.clear();
        for r in 0..self.rows {
            if self.int8 {
                let at = r * blocks..r * blocks + nb;
                for _ in 0..LANES / nb {
                    tiled.lines.extend_from_slice(&self.lines[at.clone()]);
                    tiled.scales.extend_from_slice(&self.scales[at.clone()]);
                    tiled.sums.extend_from_slice(&self.sums[at.clone()]);
                }
            } else {
                let row = &x[r * self.cols..(r + 1) * self.cols];
                let mut repeated = [0.0f32; LANES * BLOCK];
                for part in repeated.chunks_exact_mut(self.cols) {
                    part.copy_from_slice(row);
                }
                let (mut lines, mut scales, mut sums) =
                    ([Line([0; 64]); LANES], [0.0; LANES], [0; LANES]);
                // SAFETY: `fill` checked the CPU runs the VNNI kernel; 16 elements each.
                unsafe { quantize_row(&repeated, false, &mut lines, &mut scales, &mut sums) };
                tiled.lines.extend_from_slice(&lines);
                tiled.scales.extend_from_slice(&scales);
                tiled.sums.extend_from_slice(&sums);
            }
        }
    }

    /// Whether these activations are laid out for weights of `format`.
    pub(super) fn fits(&self, format: QuantFormat) -> bool {
        self.int8 == (format == QuantFormat::Int8PerRow)
    }
}

/// [`quantize_row`] by `kernel`'s quantiser (each kernel's own line layout; the same scales and
/// sums).
///
/// # Safety
/// The CPU runs `kernel` (VNNI or AVX2); the slices as [`quantize_row`]'s.
unsafe fn quantize_row_on(
    kernel: Int8Kernel,
    src: &[f32],
    int8: bool,
    lines: &mut [Line],
    scales: &mut [f32],
    sums: &mut [i32],
) {
    // SAFETY: the caller's contract.
    unsafe {
        match kernel {
            Int8Kernel::Vnni => quantize_row(src, int8, lines, scales, sums),
            _ => super::decode_avx2::quantize_row(src, int8, lines, scales, sums),
        }
    }
}

/// One activation row into its lines, scales and sums (`blocks` = chunks · 16 each).
///
/// # Safety
/// The CPU has AVX-512 F, BW, VL and VNNI; the slices hold `16 · chunks_for(src.len())`
/// elements.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
unsafe fn quantize_row(
    src: &[f32],
    int8: bool,
    lines: &mut [Line],
    scales: &mut [f32],
    sums: &mut [i32],
) {
    let zero = _mm512_setzero_si512();
    if int8 {
        for (b, line) in lines.iter_mut().enumerate() {
            // SAFETY: the features are enabled here.
            let v;
            (v, scales[b], sums[b]) = match unsafe { quantize_block_vec(src, b * BLOCK) } {
                Some(block) => block,
                None => (zero, 0.0, 0),
            };
            // SAFETY: lines are 64-byte aligned.
            unsafe { _mm512_store_si512(line.0.as_mut_ptr().cast(), v) };
        }
        return;
    }
    for (c, chunk) in lines.chunks_exact_mut(LANES).enumerate() {
        for bi in 0..LANES {
            let b = c * LANES + bi;
            // SAFETY: the features are enabled here.
            let v;
            (v, scales[b], sums[b]) = match unsafe { quantize_block_vec(src, b * BLOCK) } {
                Some(block) => block,
                None => (zero, 0.0, 0),
            };
            // The low byte of each 16-bit lane is an even element, the high byte an odd one.
            let (mut even, mut odd) = ([0u64; 4], [0u64; 4]);
            // SAFETY: the features are enabled here; 32 bytes each.
            unsafe {
                _mm256_storeu_si256(even.as_mut_ptr().cast(), _mm512_cvtepi16_epi8(v));
                _mm256_storeu_si256(
                    odd.as_mut_ptr().cast(),
                    _mm512_cvtepi16_epi8(_mm512_srli_epi16::<8>(v)),
                );
            }
            // Line 8g + 2j + e, qword i: block 8g + i's elements 16j + 2k + e (k = 0..8),
            // matching the weights' qword transpose in `row_tile_int4`.
            let (g, i) = (bi / 8, bi % 8);
            for j in 0..4 {
                for (e, half) in [even[j], odd[j]].into_iter().enumerate() {
                    chunk[8 * g + 2 * j + e].0[8 * i..8 * i + 8]
                        .copy_from_slice(&half.to_le_bytes());
                }
            }
        }
    }
}
