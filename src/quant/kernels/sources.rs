//! The SIMD decoders of the x86 paths: one row source ([`Src`]) per weight format, written once
//! over the ISA's vector operations ([`Isa`]: `int4`, `int8`, `bf16`, `f16`, `load`), each
//! producing the exact f32 weights of `pack::reference_dequantize_row` (the table in
//! `quant/mod.rs` lists where each format's layout, quantiser, reference and decoders live).
//! AVX-512 adds its own table-decoded int4 and prefetching int8 (`avx512.rs`).
//!
//! A partial last vector is decoded from a copy of the row's last bytes in a stack buffer
//! (never reading past the row), with the lanes past the row's end +0.

use std::marker::PhantomData;
use std::ptr;

use super::driver::{Isa, OverSources, Src, D, MAX_LANES};
use super::group_magic;
use crate::quant::format::{QMatrix, QuantFormat};

/// Run `body` over the plain source of `format`: the one every ISA has.
///
/// # Safety
/// The contract of `body` ([`OverSources::run`]).
#[inline(always)]
pub(super) unsafe fn plain<I: Isa, B: OverSources<I>>(format: QuantFormat, body: B) {
    // SAFETY: forwarded; each constructor spans the whole row o of the matrix it is given.
    unsafe {
        match format {
            QuantFormat::F32 => body.run(F32::<I>::row),
            QuantFormat::Bf16 => body.run(Bf16::<I>::row),
            QuantFormat::F16 => body.run(F16::<I>::row),
            QuantFormat::Int8PerRow => body.run(Int8::<I>::row),
            f @ (QuantFormat::Int4PerRow | QuantFormat::Int4Grouped { .. }) => {
                let magic = group_magic(f, I::L);
                body.run(move |w: &QMatrix<'_>, o: usize| Int4::<I>::row(w, o, magic))
            }
        }
    }
}

/// The last `bytes` bytes of a row from `p`, in a buffer filled with `fill` past them: what a
/// partial vector is decoded from.
#[inline(always)]
unsafe fn tail_bytes(p: *const u8, bytes: usize, fill: u8) -> [u8; 2 * MAX_LANES] {
    let mut buf = [fill; 2 * MAX_LANES];
    // SAFETY: the caller's: `bytes` (≤ 2·MAX_LANES) bytes at `p` are in the row.
    unsafe { ptr::copy_nonoverlapping(p, buf.as_mut_ptr(), bytes) };
    buf
}

/// f32: little-endian bytes, any alignment (or a decoded row buffer).
#[derive(Clone, Copy)]
pub(super) struct F32<I>(*const f32, PhantomData<I>);

/// bf16: the 16 bits are the top half of the f32 (widening is exact).
#[derive(Clone, Copy)]
pub(super) struct Bf16<I>(*const u8, PhantomData<I>);

/// IEEE half (`vcvtph2ps` is exact, subnormals included).
#[derive(Clone, Copy)]
pub(super) struct F16<I>(*const u8, PhantomData<I>);

/// int8 per row: w = q · scale.
#[derive(Clone, Copy)]
pub(super) struct Int8<I> {
    pub(super) data: *const u8,
    pub(super) scale: f32,
    isa: PhantomData<I>,
}

/// int4 (grouped or per-row) by shift and convert: element 2j is the low nibble of byte j,
/// 2j+1 the high one; w = (nibble − 8) · scale[group(v)], the group of vector v found as
/// `(v · magic) >> 32` (`group_magic`).
#[derive(Clone, Copy)]
pub(super) struct Int4<I> {
    data: *const u8,
    scales: *const f32,
    magic: u64,
    isa: PhantomData<I>,
}

impl<I: Isa> F32<I> {
    #[inline(always)]
    fn row(w: &QMatrix<'_>, o: usize) -> Self {
        F32(w.row_data(o).as_ptr() as *const f32, PhantomData)
    }
}

impl<I: Isa> Src<I> for F32<I> {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> I::V {
        // SAFETY: elements Lv .. Lv+L are in the row.
        unsafe { I::load(self.0.add(v * I::L)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> I::V {
        // SAFETY: masked lanes are not read (fault suppression), the rest are in the row.
        unsafe { I::load_masked(I::first_lanes(n % I::L), self.0.add(v * I::L)) }
    }
}

impl<I: Isa> Bf16<I> {
    #[inline(always)]
    fn row(w: &QMatrix<'_>, o: usize) -> Self {
        Bf16(w.row_data(o).as_ptr(), PhantomData)
    }
}

impl<I: Isa> Src<I> for Bf16<I> {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> I::V {
        // SAFETY: bytes 2Lv .. 2Lv+2L are in the row.
        unsafe { I::bf16(self.0.add(v * 2 * I::L)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> I::V {
        // SAFETY: the row ends 2·(n % L) bytes after byte 2Lv; zero bytes widen to +0.
        unsafe { I::bf16(tail_bytes(self.0.add(v * 2 * I::L), 2 * (n % I::L), 0).as_ptr()) }
    }
}

impl<I: Isa> F16<I> {
    #[inline(always)]
    fn row(w: &QMatrix<'_>, o: usize) -> Self {
        F16(w.row_data(o).as_ptr(), PhantomData)
    }
}

impl<I: Isa> Src<I> for F16<I> {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> I::V {
        // SAFETY: bytes 2Lv .. 2Lv+2L are in the row.
        unsafe { I::f16(self.0.add(v * 2 * I::L)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> I::V {
        // SAFETY: the row ends 2·(n % L) bytes after byte 2Lv; zero bytes widen to +0.
        unsafe { I::f16(tail_bytes(self.0.add(v * 2 * I::L), 2 * (n % I::L), 0).as_ptr()) }
    }
}

impl<I: Isa> Int8<I> {
    #[inline(always)]
    pub(super) fn row(w: &QMatrix<'_>, o: usize) -> Self {
        Int8 {
            data: w.row_data(o).as_ptr(),
            scale: w.row_scales(o)[0],
            isa: PhantomData,
        }
    }
}

impl<I: Isa> Src<I> for Int8<I> {
    #[inline(always)]
    unsafe fn one(self, v: usize) -> I::V {
        // SAFETY: bytes Lv .. Lv+L are in the row.
        unsafe { I::int8(self.data.add(v * I::L), I::splat(self.scale)) }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> I::V {
        let r = n % I::L;
        // SAFETY: the row ends r bytes after byte Lv.
        unsafe {
            let buf = tail_bytes(self.data.add(v * I::L), r, 0);
            I::zero_outside(
                I::first_lanes(r),
                I::int8(buf.as_ptr(), I::splat(self.scale)),
            )
        }
    }
}

impl<I: Isa> Int4<I> {
    #[inline(always)]
    fn row(w: &QMatrix<'_>, o: usize, magic: u64) -> Self {
        Int4 {
            data: w.row_data(o).as_ptr(),
            scales: w.row_scales(o).as_ptr(),
            magic,
            isa: PhantomData,
        }
    }

    /// The scale of vector v's group, in every lane.
    #[inline(always)]
    unsafe fn scale(self, v: usize) -> I::V {
        // SAFETY: `group_magic` maps every vector of the row to its group, < scales_per_row.
        unsafe { I::splat(*self.scales.add(((v as u64 * self.magic) >> 32) as usize)) }
    }
}

impl<I: Isa> Src<I> for Int4<I> {
    #[inline(always)]
    fn prefetch(self, v: usize) {
        if let Some(ahead) = I::INT4_PREFETCH_BYTES {
            // `wrapping_add`: the address may lie past the row; a prefetch never faults.
            I::prefetch(self.data.wrapping_add(v * I::L / 2 + ahead));
        }
    }

    #[inline(always)]
    unsafe fn one(self, v: usize) -> I::V {
        // SAFETY: vector v is whole, so bytes Lv/2 .. Lv/2 + L/2 are in the row.
        unsafe { I::int4(self.data.add(v * I::L / 2), self.scale(v)) }
    }

    #[inline(always)]
    unsafe fn quad(self, q: usize) -> [I::V; D] {
        let v = D * q;
        // SAFETY: vectors v .. v+D are whole, so their D·L/2 bytes are in the row.
        unsafe {
            let scales = [
                self.scale(v),
                self.scale(v + 1),
                self.scale(v + 2),
                self.scale(v + 3),
            ];
            I::int4_x4(self.data.add(v * I::L / 2), scales)
        }
    }

    #[inline(always)]
    unsafe fn tail(self, v: usize, n: usize) -> I::V {
        let r = n % I::L;
        // SAFETY: the row ends ceil(r/2) bytes after byte Lv/2; padding nibbles read as 8
        // (weight 0) and the lanes past r are zeroed anyway.
        unsafe {
            let buf = tail_bytes(self.data.add(v * I::L / 2), r.div_ceil(2), 0x88);
            I::zero_outside(I::first_lanes(r), I::int4(buf.as_ptr(), self.scale(v)))
        }
    }
}
