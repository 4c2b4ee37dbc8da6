//! The tile driver of the x86 paths, written once over the vector operations of an ISA
//! ([`Isa`]) and the row sources of a weight format ([`Src`], the decoders in `sources.rs`).
//! Each ISA module (`avx2.rs`, `avx512.rs`) implements [`Isa`] with its intrinsics and
//! instantiates this driver in its `#[target_feature]` entry points ([`isa_entry_points!`]),
//! so both paths run the same loops: the rows of a chunk in passes of four, two or one weight
//! rows, the activation rows of a pass in tiles, each dot product's vectors into accumulator
//! v % [`A`], the partial vectors masked, the accumulators reduced by the ISA's fixed tree.
//!
//! Everything here, and every [`Isa`] and [`Src`] method, is `#[inline(always)]`: the whole
//! call tree is inlined into the entry point and compiled with its target features. A
//! function left out of line would be compiled without them and its intrinsics would become
//! calls (docs/benchmarks-history.md, "Kernels: dequant-matmul": a closure inside the kernel
//! compiled without the features, and its intrinsics ran as out-of-line calls).

use crate::quant::format::{QMatrix, QuantFormat};

/// Independent accumulators per dot product (vector v → accumulator v % A).
pub(super) const A: usize = 2;
/// Vectors decoded together ([`Src::quad`]: one load of packed int4 on AVX2, one table for
/// two blocks on AVX-512).
pub(super) const D: usize = 4;
/// The widest vector of any [`Isa`] (AVX-512: 16 f32), for stack buffers of one vector.
pub(super) const MAX_LANES: usize = 16;

/// The vector operations of one instruction set, as the driver and the row sources use them.
///
/// # Safety
/// Every `unsafe fn` here needs the CPU features of the implementing ISA (its entry points
/// enable them) and, where it takes pointers, the elements it names readable (or writable).
pub(super) trait Isa: Copy {
    /// `L` f32 lanes.
    type V: Copy;
    /// A set of lanes.
    type Mask: Copy;
    /// Lanes per vector.
    const L: usize;
    /// Activation rows per tile with one weight row (1..=4 or 8).
    const TILE: usize;
    /// Activation rows per tile with two weight rows.
    const TILE_PAIR: usize;
    /// Activation rows per tile with four weight rows; `None`: no passes of four weight rows
    /// (nor of two rows of one matrix), every row of a matrix by itself.
    const TILE_QUAD: Option<usize>;
    /// How far ahead of the vector being decoded the shift-and-convert int4 source
    /// ([`super::sources::Int4`]) prefetches its row, in bytes; `None`: it does not.
    const INT4_PREFETCH_BYTES: Option<usize>;

    unsafe fn zero() -> Self::V;
    unsafe fn splat(v: f32) -> Self::V;
    /// `L` floats at `p`, any alignment.
    unsafe fn load(p: *const f32) -> Self::V;
    /// The lanes of `m` from `p` (the others +0 and not read: no fault past the end).
    unsafe fn load_masked(m: Self::Mask, p: *const f32) -> Self::V;
    /// `v` into the `L` floats at `p`.
    unsafe fn store(p: *mut f32, v: Self::V);
    /// Lanes `0..r` (r ≤ L).
    unsafe fn first_lanes(r: usize) -> Self::Mask;
    /// `v` with the lanes outside `m` +0.
    unsafe fn zero_outside(m: Self::Mask, v: Self::V) -> Self::V;
    /// `a · b + acc`, one rounding.
    unsafe fn fma(a: Self::V, b: Self::V, acc: Self::V) -> Self::V;
    /// The sum of a dot product's accumulators in this ISA's fixed tree.
    unsafe fn reduce(acc: [Self::V; A]) -> f32;
    /// `L` signed bytes at `p`, times `scale`.
    unsafe fn int8(p: *const u8, scale: Self::V) -> Self::V;
    /// `L` int4 weights from the `L/2` bytes at `p` (element 2j the low nibble of byte j,
    /// 2j+1 the high one): `(nibble − 8) · scale`.
    unsafe fn int4(p: *const u8, scale: Self::V) -> Self::V;
    /// [`Isa::int4`] for the `D` vectors from the `D·L/2` bytes at `p`, vector j times
    /// `scales[j]`; an ISA may decode them from one load.
    #[inline(always)]
    unsafe fn int4_x4(p: *const u8, scales: [Self::V; D]) -> [Self::V; D] {
        // SAFETY: forwarded: the D·L/2 bytes at `p` are readable.
        unsafe {
            let half = Self::L / 2;
            [
                Self::int4(p, scales[0]),
                Self::int4(p.add(half), scales[1]),
                Self::int4(p.add(2 * half), scales[2]),
                Self::int4(p.add(3 * half), scales[3]),
            ]
        }
    }
    /// `L` bf16 (the top halves of f32s) from the `2L` bytes at `p`.
    unsafe fn bf16(p: *const u8) -> Self::V;
    /// `L` IEEE halves from the `2L` bytes at `p`, widened exactly.
    unsafe fn f16(p: *const u8) -> Self::V;
    /// Hint the cache about the line at `p`: never faults, whatever the address; no effect on
    /// any value.
    fn prefetch(p: *const u8);
    /// Run `body` over the row sources this ISA uses for `format`, for rows of `cols` columns
    /// of which `side_by_side` are read at a time (an ISA may set prefetch distances from it).
    /// The plain sources of `sources.rs` unless an ISA has its own (AVX-512's table-decoded
    /// int4).
    #[inline(always)]
    unsafe fn with_sources<B: OverSources<Self>>(
        format: QuantFormat,
        cols: usize,
        side_by_side: usize,
        body: B,
    ) {
        let _ = (cols, side_by_side);
        // SAFETY: forwarded.
        unsafe { super::sources::plain::<Self, B>(format, body) }
    }
}

/// A weight row as a sequence of exactly dequantised vectors of `I::L` lanes. Implementations
/// hold raw pointers into a row whose length matches the `n` the driver iterates over.
pub(super) trait Src<I: Isa>: Copy {
    /// Vector `v` (whole: every lane an element).
    unsafe fn one(self, v: usize) -> I::V;
    /// Vectors `D·q .. D·q + D` (all whole); a source may share work between them.
    #[inline(always)]
    unsafe fn quad(self, q: usize) -> [I::V; D] {
        // SAFETY: forwarded: vectors Dq .. Dq+D are whole.
        unsafe {
            [
                self.one(D * q),
                self.one(D * q + 1),
                self.one(D * q + 2),
                self.one(D * q + 3),
            ]
        }
    }
    /// Vectors `0..whole(n)` of a row of n elements are whole.
    #[inline(always)]
    fn whole(n: usize) -> usize {
        n / I::L
    }
    /// A row of n elements is vectors `0..vectors(n)`; those from `whole(n)` on are partial.
    #[inline(always)]
    fn vectors(n: usize) -> usize {
        n.div_ceil(I::L)
    }
    /// The lanes of partial vector `v` that hold elements, in W and in X alike.
    #[inline(always)]
    unsafe fn tail_mask(n: usize, _v: usize) -> I::Mask {
        // SAFETY: forwarded (the ISA's features).
        unsafe { I::first_lanes(n % I::L) }
    }
    /// Partial vector `v` of a row of `n` elements; lanes outside `tail_mask` are +0.
    unsafe fn tail(self, v: usize, n: usize) -> I::V;
    /// Hint the cache about the bytes some way ahead of vector `v` (no effect on results).
    #[inline(always)]
    fn prefetch(self, _v: usize) {}
}

/// Work run over the row sources of one format: [`Isa::with_sources`] picks the source type
/// and calls [`OverSources::run`] with a constructor of row o of a matrix (one instantiation
/// of the work per source type).
pub(super) trait OverSources<I: Isa> {
    /// # Safety
    /// The contract of the work (the entry point's), and the sources `make` builds span whole
    /// rows of the matrices they are built from.
    unsafe fn run<S: Src<I>>(self, make: impl Fn(&QMatrix<'_>, usize) -> S);
}

/// Accumulate vectors `v0..v1` of `NW` weight rows against `T` activation rows of `n` elements
/// (`x[t]` points at vector `v0` of row t) into `acc`: vector v goes to accumulator v % A of
/// every (weight row, activation row); the partial vectors at the end (from `S::whole(n)`)
/// have the lanes outside `S::tail_mask` zero in W and X. `v0` is a multiple of D, so walking
/// `0..S::vectors(n)` in consecutive ranges performs exactly the same operations on every
/// accumulator as walking it in one go.
#[inline(always)]
unsafe fn accumulate<I: Isa, S: Src<I>, const NW: usize, const T: usize>(
    w: [S; NW],
    x: [*const f32; T],
    n: usize,
    v0: usize,
    v1: usize,
    acc: &mut [[[I::V; A]; T]; NW],
) {
    // SAFETY: the caller guarantees the CPU features, that each `x[t]` points at the
    // elements v0·L .. min(v1·L, n) of a row and each source at a row of n elements.
    unsafe {
        let (whole, total) = (S::whole(n), S::vectors(n));
        let full = v1.min(whole);
        let mut v = v0;
        while v + D <= full {
            for src in &w {
                src.prefetch(v);
            }
            let mut wq = [[I::zero(); D]; NW];
            for k in 0..NW {
                wq[k] = w[k].quad(v / D);
            }
            // Pair h of the quad is vectors v + 2h, v + 2h + 1 (indexing keeps every loop
            // here unrolled over constants).
            #[allow(clippy::needless_range_loop)]
            for h in 0..D / 2 {
                for t in 0..T {
                    for j in 0..2 {
                        let u = 2 * h + j;
                        let xv = I::load(x[t].add((v - v0 + u) * I::L));
                        for k in 0..NW {
                            acc[k][t][u % A] = I::fma(wq[k][u], xv, acc[k][t][u % A]);
                        }
                    }
                }
            }
            v += D;
        }
        while v < full {
            let mut wv = [I::zero(); NW];
            for k in 0..NW {
                wv[k] = w[k].one(v);
            }
            for t in 0..T {
                let xv = I::load(x[t].add((v - v0) * I::L));
                for k in 0..NW {
                    acc[k][t][v % A] = I::fma(wv[k], xv, acc[k][t][v % A]);
                }
            }
            v += 1;
        }
        v = v.max(whole);
        while v < v1.min(total) {
            let mut wv = [I::zero(); NW];
            for k in 0..NW {
                wv[k] = w[k].tail(v, n);
            }
            let m = S::tail_mask(n, v);
            for t in 0..T {
                let xv = I::load_masked(m, x[t].add((v - v0) * I::L));
                for k in 0..NW {
                    acc[k][t][v % A] = I::fma(wv[k], xv, acc[k][t][v % A]);
                }
            }
            v += 1;
        }
    }
}

/// Dot products of `NW` weight rows with `T` activation rows of length `n` in one pass: each
/// decoded weight vector is applied to all `T` rows. The tiles of one call after the first
/// decode the same weight row again, from L1: memory is read once per call whatever S is.
#[inline(always)]
unsafe fn dot_tile<I: Isa, S: Src<I>, const NW: usize, const T: usize>(
    w: [S; NW],
    x: [*const f32; T],
    n: usize,
) -> [[f32; T]; NW] {
    // SAFETY: forwarded contract of `accumulate`.
    unsafe {
        let mut acc = [[[I::zero(); A]; T]; NW];
        accumulate::<I, S, NW, T>(w, x, n, 0, S::vectors(n), &mut acc);
        let mut y = [[0.0f32; T]; NW];
        for k in 0..NW {
            for t in 0..T {
                y[k][t] = I::reduce(acc[k][t]);
            }
        }
        y
    }
}

/// Run `$tile!(T, t0)` over all `s` activation rows: tiles of `tm`, then one smaller tile.
macro_rules! for_tiles {
    ($s:expr, $tm:expr, $tile:ident) => {{
        let (s, tm) = ($s, $tm);
        let mut t0 = 0;
        while s - t0 >= tm {
            match tm {
                8 => $tile!(8, t0),
                4 => $tile!(4, t0),
                3 => $tile!(3, t0),
                2 => $tile!(2, t0),
                _ => $tile!(1, t0),
            }
            t0 += tm;
        }
        match s - t0 {
            0 => {}
            1 => $tile!(1, t0),
            2 => $tile!(2, t0),
            3 => $tile!(3, t0),
            4 => $tile!(4, t0),
            5 => $tile!(5, t0),
            6 => $tile!(6, t0),
            _ => $tile!(7, t0),
        }
    }};
}

/// All `s` activation rows (row t at `x + t · stride`) against `NW` weight rows of `n`
/// elements (as the source walks them), in tiles of `tm` rows (one of the ISA's tile
/// constants: fixed once inlined), then one smaller tile. `out[k]` points at `s` floats for
/// weight row k.
#[inline(always)]
unsafe fn tiles<I: Isa, S: Src<I>, const NW: usize>(
    w: [S; NW],
    x: *const f32,
    stride: usize,
    s: usize,
    n: usize,
    tm: usize,
    out: [*mut f32; NW],
) {
    // SAFETY: `x` holds s rows of at least n at `stride`; each `out[k]` points at s writable
    // floats.
    unsafe {
        macro_rules! tile {
            ($t:literal, $t0:expr) => {{
                let mut xs = [x; $t];
                for (i, p) in xs.iter_mut().enumerate() {
                    *p = x.add(($t0 + i) * stride);
                }
                let y = dot_tile::<I, S, NW, $t>(w, xs, n);
                for k in 0..NW {
                    for i in 0..$t {
                        *out[k].add($t0 + i) = y[k][i];
                    }
                }
            }};
        }
        for_tiles!(s, tm, tile);
    }
}

/// A tile size `tiles` has an arm for.
const fn is_tile_size(t: usize) -> bool {
    matches!(t, 1..=4 | 8)
}

/// The tile constants of `I` are sizes `tiles` has arms for, and its vectors fit one
/// [`MAX_LANES`] buffer (checked at compile time, per ISA).
#[inline(always)]
fn check_tiles<I: Isa>() {
    const {
        assert!(is_tile_size(I::TILE) && is_tile_size(I::TILE_PAIR));
        assert!(match I::TILE_QUAD {
            Some(t) => is_tile_size(t),
            None => true,
        });
        assert!(I::L <= MAX_LANES);
    }
}

/// Rows `o0..o0 + out.len()/s` of one matrix (`make(o)` is row o) against all `s` activation
/// rows, into `out` ([rows, s]). With `I::TILE_QUAD`, four weight rows at a time in tiles of
/// that many activation rows, then a pair in tiles of `I::TILE_PAIR`; every row left by itself
/// in tiles of `I::TILE`. Four rows (AVX-512): at S = 1 their eight accumulator chains cover
/// the FMA latency of both pipes (two rows left four), and at S > 1 each activation vector
/// loaded feeds four FMAs (L1 loads, not FMAs, bound these tiles: 4 × 2 measured 4–14% faster
/// than 2 × 4, and 2 × 4 had been 25–35% faster than 1 × 8). Each dot product is computed
/// exactly as in [`dot_tile`], whatever the tiling.
#[inline(always)]
unsafe fn rows_of_one<I: Isa, S: Src<I>>(
    make: impl Fn(usize) -> S,
    n: usize,
    o0: usize,
    x: &[f32],
    s: usize,
    out: &mut [f32],
) {
    check_tiles::<I>();
    // SAFETY: forwarded from `rows`: `out` holds [rows, s] for rows o0.. that exist, `x` s
    // rows of `x.len() / s ≥ n` floats.
    unsafe {
        let (xp, stride) = (x.as_ptr(), x.len() / s);
        let rows = out.len() / s;
        let y = out.as_mut_ptr();
        let mut i = 0;
        if let Some(tile_quad) = I::TILE_QUAD {
            while i + 4 <= rows {
                let w = [
                    make(o0 + i),
                    make(o0 + i + 1),
                    make(o0 + i + 2),
                    make(o0 + i + 3),
                ];
                let y4 = [
                    y.add(i * s),
                    y.add((i + 1) * s),
                    y.add((i + 2) * s),
                    y.add((i + 3) * s),
                ];
                tiles::<I, S, 4>(w, xp, stride, s, n, tile_quad, y4);
                i += 4;
            }
            while i + 2 <= rows {
                let w = [make(o0 + i), make(o0 + i + 1)];
                let y2 = [y.add(i * s), y.add((i + 1) * s)];
                tiles::<I, S, 2>(w, xp, stride, s, n, I::TILE_PAIR, y2);
                i += 2;
            }
        }
        while i < rows {
            tiles::<I, S, 1>([make(o0 + i)], xp, stride, s, n, I::TILE, [y.add(i * s)]);
            i += 1;
        }
    }
}

/// Rows `o0..` of two matrices of one shape (`make(k, o)`: row o of matrix k) against all `s`
/// activation rows, into `out_a` and `out_b`: with `I::TILE_QUAD`, two rows of each per pass
/// in tiles of that many (as [`rows_of_one`] does with four rows of one matrix); every row
/// left with its partner in the other matrix, in tiles of `I::TILE_PAIR`.
#[inline(always)]
unsafe fn rows_of_two<I: Isa, S: Src<I>>(
    make: impl Fn(usize, usize) -> S,
    n: usize,
    o0: usize,
    x: &[f32],
    s: usize,
    out_a: &mut [f32],
    out_b: &mut [f32],
) {
    check_tiles::<I>();
    // SAFETY: forwarded from `rows_pair`.
    unsafe {
        let (xp, stride) = (x.as_ptr(), x.len() / s);
        let rows = out_a.len() / s;
        let (ya, yb) = (out_a.as_mut_ptr(), out_b.as_mut_ptr());
        let mut i = 0;
        if let Some(tile_quad) = I::TILE_QUAD {
            while i + 2 <= rows {
                let (p, q) = (o0 + i, o0 + i + 1);
                let w = [make(0, p), make(0, q), make(1, p), make(1, q)];
                let y4 = [
                    ya.add(i * s),
                    ya.add((i + 1) * s),
                    yb.add(i * s),
                    yb.add((i + 1) * s),
                ];
                tiles::<I, S, 4>(w, xp, stride, s, n, tile_quad, y4);
                i += 2;
            }
        }
        while i < rows {
            let w = [make(0, o0 + i), make(1, o0 + i)];
            let y2 = [ya.add(i * s), yb.add(i * s)];
            tiles::<I, S, 2>(w, xp, stride, s, n, I::TILE_PAIR, y2);
            i += 1;
        }
    }
}

/// Weight rows read side by side by a pass of [`rows_of_one`].
const fn one_matrix_side_by_side<I: Isa>() -> usize {
    if I::TILE_QUAD.is_some() {
        4
    } else {
        1
    }
}

/// `out[i·s + t] = W[o0 + i] · x_t` for the rows `o0..o0 + out.len()/s`.
///
/// # Safety
/// The CPU has `I`'s features; `s > 0`, `x` holds `s` rows of `x.len()/s ≥ w.cols()` floats
/// in the layout the path gives `w`'s format (`XLayout`), `out.len()` is a multiple of s and
/// `o0 + out.len()/s <= w.rows()`.
#[inline(always)]
pub(super) unsafe fn rows<I: Isa>(
    w: &QMatrix<'_>,
    o0: usize,
    x: &[f32],
    s: usize,
    out: &mut [f32],
) {
    struct Work<'a, 'w> {
        w: &'a QMatrix<'w>,
        o0: usize,
        x: &'a [f32],
        s: usize,
        out: &'a mut [f32],
    }
    impl<I: Isa> OverSources<I> for Work<'_, '_> {
        #[inline(always)]
        unsafe fn run<S: Src<I>>(self, make: impl Fn(&QMatrix<'_>, usize) -> S) {
            let w = self.w;
            // SAFETY: forwarded from `rows`.
            unsafe {
                rows_of_one::<I, S>(|o| make(w, o), w.cols(), self.o0, self.x, self.s, self.out)
            }
        }
    }
    let side_by_side = one_matrix_side_by_side::<I>();
    let work = Work { w, o0, x, s, out };
    // SAFETY: the caller's contract.
    unsafe { I::with_sources(w.format(), w.cols(), side_by_side, work) }
}

/// [`rows`] for two matrices of the same shape and format (gate and up), sharing the
/// activation loads.
///
/// # Safety
/// As [`rows`], for both `a` and `b`, which have the same shape and format; `out_a` and
/// `out_b` have the same length.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
pub(super) unsafe fn rows_pair<I: Isa>(
    a: &QMatrix<'_>,
    b: &QMatrix<'_>,
    o0: usize,
    x: &[f32],
    s: usize,
    out_a: &mut [f32],
    out_b: &mut [f32],
) {
    struct Work<'a, 'w> {
        a: &'a QMatrix<'w>,
        b: &'a QMatrix<'w>,
        o0: usize,
        x: &'a [f32],
        s: usize,
        out: [&'a mut [f32]; 2],
    }
    impl<I: Isa> OverSources<I> for Work<'_, '_> {
        #[inline(always)]
        unsafe fn run<S: Src<I>>(self, make: impl Fn(&QMatrix<'_>, usize) -> S) {
            let (a, b) = (self.a, self.b);
            let [out_a, out_b] = self.out;
            let make = |k: usize, o: usize| if k == 0 { make(a, o) } else { make(b, o) };
            // SAFETY: forwarded from `rows_pair`.
            unsafe { rows_of_two::<I, S>(make, a.cols(), self.o0, self.x, self.s, out_a, out_b) }
        }
    }
    debug_assert_eq!(a.format(), b.format());
    // Two rows of each matrix per pass with four-row passes.
    let side_by_side = one_matrix_side_by_side::<I>().div_ceil(2);
    let work = Work {
        a,
        b,
        o0,
        x,
        s,
        out: [out_a, out_b],
    };
    // SAFETY: the caller's contract.
    unsafe { I::with_sources(a.format(), a.cols(), side_by_side, work) }
}

/// Row `o` of `w` dequantised into `out` (`w.cols()` floats) in natural order, through the
/// plain sources (`sources::plain`; AVX-512's table-decoded int4 produces its vectors in a
/// permuted order): the same exact f32 weights as `pack::reference_dequantize_row`.
///
/// # Safety
/// The CPU has `I`'s features; `o < w.rows()` and `out.len() >= w.cols()`.
#[inline(always)]
pub(super) unsafe fn dequantize_row<I: Isa>(w: &QMatrix<'_>, o: usize, out: &mut [f32]) {
    struct Work<'a, 'w> {
        w: &'a QMatrix<'w>,
        o: usize,
        out: &'a mut [f32],
    }
    impl<I: Isa> OverSources<I> for Work<'_, '_> {
        #[inline(always)]
        unsafe fn run<S: Src<I>>(self, make: impl Fn(&QMatrix<'_>, usize) -> S) {
            check_tiles::<I>();
            let (n, l) = (self.w.cols(), I::L);
            let src = make(self.w, self.o);
            // The plain sources walk the row in natural order: vector v is elements
            // v·L .. v·L + L, the whole ones first.
            let whole = n / l;
            // SAFETY: the caller's contract: `out` holds n floats, the source spans row o.
            unsafe {
                for v in 0..whole {
                    I::store(self.out.as_mut_ptr().add(v * l), src.one(v));
                }
                if !n.is_multiple_of(l) {
                    let mut last = [0.0f32; MAX_LANES];
                    I::store(last.as_mut_ptr(), src.tail(whole, n));
                    self.out[whole * l..n].copy_from_slice(&last[..n - whole * l]);
                }
            }
        }
    }
    // SAFETY: the caller's contract.
    unsafe { super::sources::plain::<I, _>(w.format(), Work { w, o, out }) }
}

/// The `#[target_feature]` entry points of one ISA, each the driver instantiated for it:
/// `rows`, `rows_pair` and `dequantize_row` with the contracts of [`rows`], [`rows_pair`]
/// and [`dequantize_row`] (the CPU has `$features`).
macro_rules! isa_entry_points {
    ($isa:ty, $features:literal) => {
        /// [`super::driver::rows`] on this ISA.
        ///
        /// # Safety
        /// The CPU has the features this function enables, and `driver::rows`'s contract.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn rows(
            w: &QMatrix<'_>,
            o0: usize,
            x: &[f32],
            s: usize,
            out: &mut [f32],
        ) {
            // SAFETY: the caller's contract; the features are enabled here.
            unsafe { super::driver::rows::<$isa>(w, o0, x, s, out) }
        }

        /// [`super::driver::rows_pair`] on this ISA; matrices of different formats one at a
        /// time through [`rows`] (which computes every dot product in the same order).
        ///
        /// # Safety
        /// The CPU has the features this function enables, and `driver::rows_pair`'s contract
        /// but for the formats, which may differ.
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        pub(super) unsafe fn rows_pair(
            a: &QMatrix<'_>,
            b: &QMatrix<'_>,
            o0: usize,
            x: &[f32],
            s: usize,
            out_a: &mut [f32],
            out_b: &mut [f32],
        ) {
            // SAFETY: the caller's contract; the features are enabled here.
            unsafe {
                if a.format() != b.format() {
                    rows(a, o0, x, s, out_a);
                    rows(b, o0, x, s, out_b);
                } else {
                    super::driver::rows_pair::<$isa>(a, b, o0, x, s, out_a, out_b)
                }
            }
        }

        /// [`super::driver::dequantize_row`] on this ISA.
        ///
        /// # Safety
        /// The CPU has the features this function enables, and `driver::dequantize_row`'s
        /// contract.
        #[target_feature(enable = $features)]
        pub(super) unsafe fn dequantize_row(w: &QMatrix<'_>, o: usize, out: &mut [f32]) {
            // SAFETY: the caller's contract; the features are enabled here.
            unsafe { super::driver::dequantize_row::<$isa>(w, o, out) }
        }
    };
}
pub(super) use isa_entry_points;
