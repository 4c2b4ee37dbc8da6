//! The fast prefill arithmetic: `Y[S×O] ≈ X[S×I] · Wᵀ` with the activations rounded to int8
//! per block of 64 elements and each block's products summed as integers (AVX-512 VNNI
//! `vpdpbusd`), as llama.cpp's Q8 activations against Q4 weights do. **Not exact**: the
//! activations lose their low bits (≈ 0.4% of a block's largest magnitude). The engine uses it
//! only where exactness is not promised — prefill forwards of at least
//! [`PREFILL_MIN_ROWS`] rows when the `prefill` option allows it (docs/architecture.md,
//! "Prefill arithmetic"); decode and verify rows always run the exact kernels, so speculation
//! stays lossless.
//!
//! The arithmetic, which the scalar reference ([`reference_matmul`]) and the VNNI path
//! (`vnni.rs`) compute bit for bit:
//! - **activations** ([`QuantizedActs::new`]): per row and block b of 64 elements,
//!   `m = max|x|`, `xq = round_half_even(x · (127 / m))` as i8 and `sx_b = m / 127` (a block
//!   of zeros: `xq = 0`, `sx_b = 0`);
//! - **weights** as unsigned bytes `u = q + o` (int4: the stored nibble, o = 8; int8: o = 128),
//!   so that `d_b = Σ u·xq − o·Σ xq = Σ q·xq` is the block's exact integer dot product;
//! - **scales**: `sw_b`, the scale of the weight group holding block b (group sizes that are
//!   multiples of 64) or of the row (per-row int4 and int8);
//! - **sum**: block b goes to lane `b mod 16`:
//!   `lane = fma(d_b as f32, sw_b · sx_b, lane)` over the blocks in order, then the 16 lanes by
//!   [`sum_lanes`]' fixed tree.
//!
//! Formats with other group sizes, and float weights, have no int8 form: [`supports`] says so
//! and the caller runs the exact kernel for them.

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2;
#[cfg(target_arch = "x86_64")]
pub(super) mod vnni;

use rayon::prelude::*;

use crate::error::{Error, Result};
use crate::quant::format::{QMatrix, QuantFormat};
use crate::quant::pack::reference_dequantize_row;

/// Prefill forwards of fewer rows than this run the exact kernels whatever the option says:
/// decode steps and verify forwards (at most 1 + the deepest draft, 9 rows) stay below it.
pub const PREFILL_MIN_ROWS: usize = 16;

/// Elements per activation block (one scale each), and per lane of a `vpdpbusd` chunk.
pub const BLOCK: usize = 64;
/// Blocks per chunk: one per 32-bit lane of a 512-bit vector.
const LANES: usize = 16;

/// 64 bytes in one cache line: the lane layouts are built of these, so no vector load splits
/// a line.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line(pub [u8; 64]);

// SAFETY: 64 bytes, alignment 64: no padding, every bit pattern valid.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; it is `Copy` and `repr(C)`.
unsafe impl bytemuck::Pod for Line {}

/// Whether `format` has an int8-activation form (the weights' scales are constant over each
/// 64-element block).
pub fn supports(format: QuantFormat) -> bool {
    match format {
        QuantFormat::Int8PerRow | QuantFormat::Int4PerRow => true,
        QuantFormat::Int4Grouped { group_size } => group_size % BLOCK == 0,
        QuantFormat::F32 | QuantFormat::Bf16 | QuantFormat::F16 => false,
    }
}

/// The code that computes the int8 arithmetic: every one gives the reference's bits.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Int8Kernel {
    /// [`reference_matmul`]'s scalar loops: correct everywhere, far slower than the exact
    /// kernels.
    Reference,
    /// AVX2 `vpmaddubsw` (`avx2.rs`): x86-64 CPUs without AVX-512 VNNI.
    Avx2,
    /// AVX-512 VNNI `vpdpbusd` (`vnni.rs`).
    Vnni,
}

impl Int8Kernel {
    /// Whether this CPU can run the kernel.
    pub fn available(self) -> bool {
        let f = crate::cpu::features();
        let x86 = cfg!(target_arch = "x86_64");
        match self {
            Int8Kernel::Reference => true,
            Int8Kernel::Avx2 => x86 && f.avx2 && f.fma,
            Int8Kernel::Vnni => x86 && f.avx512f && f.avx512bw && f.avx512vl && f.avx512vnni,
        }
    }

    /// The fastest kernel this CPU runs.
    pub fn best() -> Int8Kernel {
        [Int8Kernel::Vnni, Int8Kernel::Avx2]
            .into_iter()
            .find(|k| k.available())
            .unwrap_or(Int8Kernel::Reference)
    }

    /// The name reports use.
    pub fn name(self) -> &'static str {
        match self {
            Int8Kernel::Reference => "reference",
            Int8Kernel::Avx2 => "avx2",
            Int8Kernel::Vnni => "avx512-vnni",
        }
    }
}

/// Whether this CPU runs a SIMD int8 kernel (AVX-512 VNNI or AVX2); elsewhere the int8
/// arithmetic runs as the scalar reference, correct but slow.
pub fn simd_available() -> bool {
    Int8Kernel::best() != Int8Kernel::Reference
}

/// `u = q + offset` for a format: the shift with `offset = 1 << shift`.
fn offset_shift(format: QuantFormat) -> u32 {
    match format {
        QuantFormat::Int8PerRow => 7,
        _ => 3,
    }
}

/// Chunks of 16 blocks for `cols` columns.
fn chunks_for(cols: usize) -> usize {
    cols.div_ceil(BLOCK).div_ceil(LANES).max(1)
}

/// Activation rows quantised to int8 per 64-element block, laid out for `vpdpbusd`: row r's
/// chunk c is 16 lines; line k holds, in 32-bit lane j, elements `4k..4k+4` of block
/// `16c + j`.
pub struct QuantizedActs {
    rows: usize,
    cols: usize,
    chunks: usize,
    /// [rows][chunks · 16] lines of i8 (as bytes).
    q: Vec<Line>,
    /// [rows][chunks · 16]: `sx_b` (0 past the last block).
    scales: Vec<f32>,
    /// [rows][chunks · 16]: `Σ xq` of each block (0 past the last block).
    sums: Vec<i32>,
}

impl QuantizedActs {
    /// Quantise `x` ([rows, cols] row-major), rows in parallel on `pool` when given (each
    /// row's values do not depend on how rows are split).
    pub fn new(x: &[f32], rows: usize, cols: usize, pool: Option<&rayon::ThreadPool>) -> Self {
        Self::new_on(x, rows, cols, pool, Int8Kernel::best())
    }

    /// [`QuantizedActs::new`] by `kernel`'s quantiser (which must be available): every one
    /// gives the same bytes, scales and sums for finite `x`.
    fn new_on(
        x: &[f32],
        rows: usize,
        cols: usize,
        pool: Option<&rayon::ThreadPool>,
        kernel: Int8Kernel,
    ) -> Self {
        let chunks = chunks_for(cols);
        let blocks = chunks * LANES;
        let mut q = vec![Line([0; 64]); rows * blocks];
        let mut scales = vec![0.0f32; rows * blocks];
        let mut sums = vec![0i32; rows * blocks];
        let one_row =
            |r: usize, (lines, (scales, sums)): (&mut [Line], (&mut [f32], &mut [i32]))| {
                let src = &x[r * cols..(r + 1) * cols];
                #[cfg(target_arch = "x86_64")]
                match kernel {
                    // SAFETY (both): the caller says the CPU runs `kernel`; the row's lines,
                    // scales and sums are `blocks` long.
                    Int8Kernel::Vnni => {
                        return unsafe { vnni::quantize_row(src, lines, scales, sums) };
                    }
                    Int8Kernel::Avx2 => {
                        return unsafe { avx2::quantize_row(src, lines, scales, sums) };
                    }
                    Int8Kernel::Reference => {}
                }
                let _ = kernel;
                let mut xq = [0i8; BLOCK];
                for (b, src) in src.chunks(BLOCK).enumerate() {
                    let (scale, sum) = quantize_block(src, &mut xq);
                    scales[b] = scale;
                    sums[b] = sum;
                    let (c, j) = (b / LANES, b % LANES);
                    for k in 0..BLOCK / 4 {
                        let dst = &mut lines[c * LANES + k].0[4 * j..4 * j + 4];
                        for (d, v) in dst.iter_mut().zip(&xq[4 * k..4 * k + 4]) {
                            *d = *v as u8;
                        }
                    }
                }
            };
        if cols > 0 {
            match pool {
                Some(pool) if rows > 1 => pool.install(|| {
                    q.par_chunks_mut(blocks)
                        .zip(
                            scales
                                .par_chunks_mut(blocks)
                                .zip(sums.par_chunks_mut(blocks)),
                        )
                        .enumerate()
                        .for_each(|(r, row)| one_row(r, row))
                }),
                _ => q
                    .chunks_mut(blocks)
                    .zip(scales.chunks_mut(blocks).zip(sums.chunks_mut(blocks)))
                    .enumerate()
                    .for_each(|(r, row)| one_row(r, row)),
            }
        }
        QuantizedActs {
            rows,
            cols,
            chunks,
            q,
            scales,
            sums,
        }
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Block b of row r as i8, in element order (zeros past the end of the row).
    fn block(&self, r: usize, b: usize) -> [i8; BLOCK] {
        let blocks = self.chunks * LANES;
        let (c, j) = (b / LANES, b % LANES);
        let mut out = [0i8; BLOCK];
        for k in 0..BLOCK / 4 {
            let line = &self.q[r * blocks + c * LANES + k].0;
            for e in 0..4 {
                out[4 * k + e] = line[4 * j + e] as i8;
            }
        }
        out
    }
}

/// 1.5 · 2^23: see `quantize_block`.
const ROUNDER: f32 = 12_582_912.0;

/// One block: `xq` (zero-padded past `src`), and its scale and integer sum.
fn quantize_block(src: &[f32], xq: &mut [i8; BLOCK]) -> (f32, i32) {
    let m = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    xq.fill(0);
    if m == 0.0 || !m.is_finite() {
        // A NaN or Inf activation is the forward's own error to report; quantise it to zeros
        // rather than to garbage.
        return (0.0, 0);
    }
    let inv = 127.0 / m;
    let mut sum = 0i32;
    for (d, v) in xq.iter_mut().zip(src) {
        // Round half to even by the f32 adder: |v · inv| ≤ 127 (plus a rounding), far below
        // 2^22, where adding and removing 1.5 · 2^23 leaves the nearest integer, ties to even
        // (`round_ties_even` is a libm call on baseline x86-64: 10% of an int8 prefill).
        let r = ((v * inv + ROUNDER) - ROUNDER).clamp(-127.0, 127.0);
        *d = r as i8;
        sum += r as i32;
    }
    (m / 127.0, sum)
}

/// The 16 lanes summed by the fixed tree both paths use: halves added lane-wise (8, 4, 2, 1).
#[inline]
pub(super) fn sum_lanes(l: &[f32; LANES]) -> f32 {
    let mut v = *l;
    let mut n = LANES / 2;
    while n > 0 {
        for i in 0..n {
            v[i] += v[i + n];
        }
        n /= 2;
    }
    v[0]
}

/// The weight scale of each block of row `o`, [chunks · 16] (0 past the last block).
pub(super) fn block_scales(w: &QMatrix<'_>, o: usize, out: &mut [f32]) {
    let scales = w.row_scales(o);
    let blocks = w.cols().div_ceil(BLOCK);
    for (b, s) in out.iter_mut().enumerate() {
        *s = if b >= blocks {
            0.0
        } else {
            match w.format() {
                QuantFormat::Int4Grouped { group_size } => scales[b * BLOCK / group_size],
                _ => scales[0],
            }
        };
    }
}

/// The reference: `y[t, o]` for the activations `x` by the arithmetic in the module docs,
/// computed from the reference dequantiser's integers (not from the lane layouts).
pub fn reference_matmul(w: &QMatrix<'_>, x: &QuantizedActs, y: &mut [f32]) -> Result<()> {
    check(w, x, y.len())?;
    let s = x.rows;
    let mut out_t = vec![0.0f32; w.rows() * s];
    reference_rows(w, 0, x, &mut out_t);
    transpose(&out_t, w.rows(), s, y);
    Ok(())
}

/// [`reference_matmul`] for the rows `o0..o0 + out.len() / S`, written transposed.
fn reference_rows(w: &QMatrix<'_>, o0: usize, x: &QuantizedActs, out: &mut [f32]) {
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

fn check(w: &QMatrix<'_>, x: &QuantizedActs, y_len: usize) -> Result<()> {
    if !supports(w.format()) {
        return Err(Error::invalid(
            "int8 matmul",
            format!("{} weights have no int8-activation form", w.format()),
        ));
    }
    if x.cols != w.cols() || x.rows.checked_mul(w.rows()) != Some(y_len) {
        return Err(Error::invalid(
            "int8 matmul",
            format!(
                "W is [{}, {}] so X must have {} columns and Y {}×{} values; got {} columns \
                 and {y_len} values",
                w.rows(),
                w.cols(),
                w.cols(),
                x.rows,
                w.rows(),
                x.cols
            ),
        ));
    }
    Ok(())
}

/// Activation rows per pass over the weights: the quantised rows of a pass stay in L2
/// (1 MiB of them; L2 is 1–2 MiB per core on the VNNI CPUs), and every weight row is decoded
/// once per pass.
fn rows_per_pass(cols: usize) -> usize {
    ((1 << 20) / (chunks_for(cols) * LANES * 64)).max(8)
}

/// `y ≈ x · Wᵀ` by the int8 arithmetic, for activations already quantised, on `kernel` (an
/// error if this CPU cannot run it). `pool` parallelises over weight rows. The result does
/// not depend on the kernel, the pool or its threads.
pub fn matmul_quantized(
    w: &QMatrix<'_>,
    x: &QuantizedActs,
    y: &mut [f32],
    kernel: Int8Kernel,
    pool: Option<&rayon::ThreadPool>,
) -> Result<()> {
    check(w, x, y.len())?;
    if !kernel.available() {
        return Err(Error::invalid(
            "int8 matmul",
            format!("this CPU cannot run the {} int8 kernel", kernel.name()),
        ));
    }
    let (o, s) = (w.rows(), x.rows);
    if o == 0 || s == 0 {
        return Ok(());
    }
    let out = OutColumns {
        ptr: y.as_mut_ptr(),
        s,
        o,
    };
    let row_bytes = w.format().row_bytes(w.cols());
    // Weight rows `o0..o0 + n` into their columns of `y`.
    let work = |o0: usize, n: usize| {
        let pass = rows_per_pass(w.cols());
        // SAFETY (both): the kernel's availability was checked above; `check` made the shapes
        // agree; rows `o0..o0 + n` are in `w`, and no other task writes their columns.
        #[cfg(target_arch = "x86_64")]
        match kernel {
            Int8Kernel::Vnni => return unsafe { vnni::rows(w, o0, n, x, pass, out) },
            Int8Kernel::Avx2 => return unsafe { avx2::rows(w, o0, n, x, pass, out) },
            Int8Kernel::Reference => {}
        }
        let _ = (kernel, pass);
        let mut chunk = vec![0.0f32; n * s];
        reference_rows(w, o0, x, &mut chunk);
        for (i, row) in chunk.chunks_exact(s).enumerate() {
            for (t, v) in row.iter().enumerate() {
                // SAFETY: t < s and o0 + i < o; this task alone writes column o0 + i.
                unsafe { out.set(t, o0 + i, *v) };
            }
        }
    };
    match pool {
        None => work(0, o),
        Some(pool) => {
            let threads = pool.current_num_threads().max(1);
            // ~8 chunks per thread for balance, but at least ~16 KiB of weights per chunk.
            let per = o
                .div_ceil(threads * 8)
                .max((16 << 10) / row_bytes.max(1))
                .clamp(1, o);
            pool.install(|| {
                (0..o.div_ceil(per))
                    .into_par_iter()
                    .for_each(|i| work(i * per, per.min(o - i * per)))
            });
        }
    }
    Ok(())
}

/// One SIMD int8 kernel's pieces, as the pass loop both share ([`tile_rows`]) drives them:
/// weight rows decoded `WR` at a time into the lane layout, activation rows in tiles of up
/// to `AR`.
#[cfg(target_arch = "x86_64")]
pub(super) trait Tiles {
    /// Weight rows decoded per pass (and per tile), 1..=4.
    const WR: usize;
    /// Activation rows per tile, 1..=4.
    const AR: usize;
    /// What a tile needs to know of the weights' format.
    type Format: Copy;
    /// [`Tiles::Format`] of `w`'s format.
    fn format(w: &QMatrix<'_>) -> Self::Format;
    /// Row `o` of `w` in the lane layout (`out.len()` = chunks · 16).
    ///
    /// # Safety
    /// The CPU has the kernel's features; `o < w.rows()`.
    unsafe fn decode_row(w: &QMatrix<'_>, o: usize, out: &mut [Line]);
    /// Rows `0..NW` of the decoded weights (`wl`, `ws`: [NW][blocks]) against activation
    /// rows `t0..t0 + NA`; returns `[w][a]`.
    ///
    /// # Safety
    /// The CPU has the kernel's features; `wl` and `ws` hold `NW · blocks` elements and `x`
    /// has at least `t0 + NA` rows.
    unsafe fn tile<const NW: usize, const NA: usize>(
        wl: &[Line],
        ws: &[f32],
        x: &QuantizedActs,
        t0: usize,
        format: Self::Format,
    ) -> [[f32; NA]; NW];
}

/// [`Tiles::tile`] for run-time sizes (1..=WR weight rows, 1..=AR activation rows), results
/// into `out` at weight row `o` (its column) and activation row `t0`.
///
/// # Safety
/// As [`Tiles::tile`] for `nw` rows and `na` activation rows; columns `o..o + nw` are this
/// task's and `t0 + na <= S`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn tile_into<K: Tiles>(
    nw: usize,
    na: usize,
    wl: &[Line],
    ws: &[f32],
    x: &QuantizedActs,
    t0: usize,
    format: K::Format,
    o: usize,
    out: OutColumns,
) {
    macro_rules! run {
        ($nw:literal, $na:literal) => {{
            // SAFETY: forwarded from the caller.
            let v = unsafe { K::tile::<$nw, $na>(wl, ws, x, t0, format) };
            for (r, row) in v.iter().enumerate() {
                for (a, value) in row.iter().enumerate() {
                    // SAFETY: the caller's contract: columns `o..o + nw` are this task's and
                    // `t0 + na <= S`.
                    unsafe { out.set(t0 + a, o + r, *value) };
                }
            }
        }};
    }
    // The clamps are no-ops for valid sizes; they let the compiler drop the arms past a
    // kernel's tile.
    match (nw.min(K::WR), na.min(K::AR)) {
        (4, 4) => run!(4, 4),
        (4, 3) => run!(4, 3),
        (4, 2) => run!(4, 2),
        (4, 1) => run!(4, 1),
        (3, 4) => run!(3, 4),
        (3, 3) => run!(3, 3),
        (3, 2) => run!(3, 2),
        (3, 1) => run!(3, 1),
        (2, 4) => run!(2, 4),
        (2, 3) => run!(2, 3),
        (2, 2) => run!(2, 2),
        (2, 1) => run!(2, 1),
        (1, 4) => run!(1, 4),
        (1, 3) => run!(1, 3),
        (1, 2) => run!(1, 2),
        _ => run!(1, 1),
    }
}

/// `y[t, o0 + i] ≈ W[o0 + i] · x_t` by the int8 arithmetic for `i < n`, every t, on kernel
/// `K`: the activations in passes of `pass` rows, each weight row decoded once per pass.
///
/// # Safety
/// The CPU has `K`'s features (its entry point enables them; everything here is inlined into
/// it); `x.cols == w.cols()`, `w`'s format is one [`supports`] accepts, `o0 + n <=
/// w.rows()`, `out` is [x.rows, w.rows()], and no other task writes its columns
/// `o0..o0 + n`.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(super) unsafe fn tile_rows<K: Tiles>(
    w: &QMatrix<'_>,
    o0: usize,
    n: usize,
    x: &QuantizedActs,
    pass: usize,
    out: OutColumns,
) {
    let s = x.rows;
    let blocks = x.chunks * LANES;
    let format = K::format(w);
    let mut wl = vec![Line([0; 64]); K::WR * blocks];
    let mut ws = vec![0.0f32; K::WR * blocks];
    for p0 in (0..s).step_by(pass.max(1)) {
        let p1 = (p0 + pass).min(s);
        for i0 in (0..n).step_by(K::WR) {
            let nw = K::WR.min(n - i0);
            for r in 0..nw {
                // SAFETY: the caller's features; `o0 + i0 + r < o0 + n <= w.rows()`.
                unsafe { K::decode_row(w, o0 + i0 + r, &mut wl[r * blocks..(r + 1) * blocks]) };
                block_scales(w, o0 + i0 + r, &mut ws[r * blocks..(r + 1) * blocks]);
            }
            let mut t = p0;
            while t < p1 {
                let na = K::AR.min(p1 - t);
                // SAFETY: the caller's features; rows `0..nw` of `wl`/`ws` were decoded above,
                // `t + na <= s`, and columns `o0 + i0..o0 + i0 + nw` are this call's.
                unsafe { tile_into::<K>(nw, na, &wl, &ws, x, t, format, o0 + i0, out) };
                t += na;
            }
        }
    }
}

/// Where one tile's rows start: weight rows `0..NW` of a pass's decoded weights (lines and
/// per-block scales, `blocks` of each per row) and activation rows `t0..t0 + NA` (lines, `Σ xq`
/// and scales). The kernels' tiles index these by line or block.
#[cfg(target_arch = "x86_64")]
pub(super) struct TileRows<const NW: usize, const NA: usize> {
    pub w_lines: [*const Line; NW],
    pub w_scales: [*const f32; NW],
    pub x_lines: [*const Line; NA],
    pub x_sums: [*const i32; NA],
    pub x_scales: [*const f32; NA],
}

#[cfg(target_arch = "x86_64")]
impl<const NW: usize, const NA: usize> TileRows<NW, NA> {
    /// # Safety
    /// `wl` and `ws` hold at least `NW · blocks` elements and `x` has at least `t0 + NA` rows,
    /// `blocks = x.chunks · LANES` each.
    #[inline(always)]
    pub(super) unsafe fn new(wl: &[Line], ws: &[f32], x: &QuantizedActs, t0: usize) -> Self {
        let blocks = x.chunks * LANES;
        debug_assert!(wl.len() >= NW * blocks && ws.len() >= NW * blocks);
        debug_assert!((t0 + NA) * blocks <= x.q.len());
        let mut rows = TileRows {
            w_lines: [wl.as_ptr(); NW],
            w_scales: [ws.as_ptr(); NW],
            x_lines: [x.q.as_ptr(); NA],
            x_sums: [x.sums.as_ptr(); NA],
            x_scales: [x.scales.as_ptr(); NA],
        };
        // SAFETY: by the contract above every offset is at most the length of its slice.
        // Plain loops, not `array::from_fn`: the tiles inline this into functions with target
        // features, which closures would not inherit.
        unsafe {
            for r in 0..NW {
                rows.w_lines[r] = wl.as_ptr().add(r * blocks);
                rows.w_scales[r] = ws.as_ptr().add(r * blocks);
            }
            for a in 0..NA {
                rows.x_lines[a] = x.q.as_ptr().add((t0 + a) * blocks);
                rows.x_sums[a] = x.sums.as_ptr().add((t0 + a) * blocks);
                rows.x_scales[a] = x.scales.as_ptr().add((t0 + a) * blocks);
            }
        }
        rows
    }
}

/// The output `y` ([S, O] row-major) as the tasks of one call write it: each task its own
/// columns (weight rows), straight into place.
#[derive(Clone, Copy)]
pub(super) struct OutColumns {
    ptr: *mut f32,
    s: usize,
    o: usize,
}

// SAFETY: the pointer is to the caller's `y`, borrowed mutably for the whole call; tasks
// write disjoint columns (`set`'s contract) and nothing reads `y` until they have joined.
unsafe impl Send for OutColumns {}
// SAFETY: as above.
unsafe impl Sync for OutColumns {}

impl OutColumns {
    /// `y[t, col] = v`.
    ///
    /// # Safety
    /// `t < S`, `col < O`, and no other task of the call writes column `col`.
    #[inline(always)]
    pub(super) unsafe fn set(&self, t: usize, col: usize, v: f32) {
        debug_assert!(t < self.s && col < self.o);
        // SAFETY: in bounds by the contract (`y` holds S·O floats).
        unsafe { *self.ptr.add(t * self.o + col) = v };
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

#[cfg(test)]
mod tests;
