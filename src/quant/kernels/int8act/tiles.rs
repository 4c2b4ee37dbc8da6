//! The pass loop the SIMD int8 kernels share: weight rows decoded a few at a time, activation
//! rows in tiles against them.

use super::{block_scales, Line, OutColumns, QuantizedActs, LANES};
use crate::quant::format::QMatrix;
/// One SIMD int8 kernel's pieces, as the pass loop both share ([`tile_rows`]) drives them:
/// weight rows decoded `WR` at a time into the lane layout, activation rows in tiles of up
/// to `AR`.
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
/// it); `x.cols == w.cols()`, `w`'s format is one [`supports`](super::supports) accepts,
/// `o0 + n <= w.rows()`, `out` is [x.rows, w.rows()], and no other task writes its columns
/// `o0..o0 + n`.
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
pub(super) struct TileRows<const NW: usize, const NA: usize> {
    pub w_lines: [*const Line; NW],
    pub w_scales: [*const f32; NW],
    pub x_lines: [*const Line; NA],
    pub x_sums: [*const i32; NA],
    pub x_scales: [*const f32; NA],
}

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
