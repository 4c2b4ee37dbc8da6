//! How a path wants a call's activations laid out, and the aligned copies that layout takes.

use super::KernelPath;
#[cfg(target_arch = "x86_64")]
use super::{avx2_int4, avx512};
/// How a path wants the activations of a call laid out (chosen by path and weight format,
/// never by S, so every S computes the same function).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))] // the aligned layouts are AVX-512's
pub(super) enum XLayout {
    /// Row-major [S, I], as given.
    Rows,
    /// Row-major, each row padded with zeros to a multiple of 16 elements, in 64-byte-aligned
    /// memory: [S, 16·ceil(I/16)]. AVX-512 formats without a table decode.
    Rows16,
    /// Each row in blocks of 32 elements, each block its 16 even elements then its 16 odd
    /// ones, the last block zero-padded, in 64-byte-aligned memory: [S, 32·ceil(I/32)]. Int4
    /// decoded by table on AVX-512 (a block's low nibbles, then its high ones).
    Pairs32,
    /// As `Pairs32`, each row followed by one 8-lane vector per group of the format
    /// (−8 · the group's activations): AVX2's int4 by group (`avx2_int4`).
    Int4Groups(crate::quant::QuantFormat),
}

/// 16 f32 in one 64-byte cache line. The AVX-512 layouts are built of these so that no
/// 64-byte activation load splits a line: split loads halve the L1 load rate, which bound
/// the kernels at S ≥ 4 (measured: 12 loads per 12 FMAs took 1.9× as long unaligned).
#[derive(Clone, Copy)]
#[repr(C, align(64))]
pub(super) struct Line([f32; 16]);

// SAFETY: `Line` is 16 f32s (64 bytes, alignment 64): no padding, every bit pattern valid.
unsafe impl bytemuck::Zeroable for Line {}
// SAFETY: as above; it is `Copy` and `repr(C)`.
unsafe impl bytemuck::Pod for Line {}

/// Activations as a path reads them: the caller's slice, or a rearranged aligned copy.
pub(super) enum XBuf<'a> {
    Borrowed(&'a [f32]),
    Lines(Vec<Line>),
}

impl std::ops::Deref for XBuf<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        match self {
            XBuf::Borrowed(x) => x,
            XBuf::Lines(l) => bytemuck::cast_slice(l),
        }
    }
}

impl XLayout {
    pub(super) fn of(path: KernelPath, format: crate::quant::QuantFormat) -> XLayout {
        match path {
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx512 => avx512::x_layout(format),
            #[cfg(target_arch = "x86_64")]
            KernelPath::Avx2 if avx2_int4::takes(format) => XLayout::Int4Groups(format),
            _ => {
                let _ = format;
                XLayout::Rows
            }
        }
    }

    /// `x` ([s, n] row-major) in this layout: borrowed as is, or rearranged (O(S·I), small
    /// next to the O·I weights of the call).
    pub(super) fn arrange(self, x: &[f32], s: usize, n: usize) -> XBuf<'_> {
        let width = match self {
            XLayout::Rows => return XBuf::Borrowed(x),
            XLayout::Rows16 => n.div_ceil(16) * 16,
            XLayout::Pairs32 => n.div_ceil(32) * 32,
            #[cfg(target_arch = "x86_64")]
            XLayout::Int4Groups(format) => {
                let shape = avx2_int4::Shape::of(format, n);
                let mut lines = vec![Line([0.0; 16]); s * shape.row_floats() / 16];
                avx2_int4::arrange(x, s, shape, bytemuck::cast_slice_mut(&mut lines));
                return XBuf::Lines(lines);
            }
            #[cfg(not(target_arch = "x86_64"))]
            XLayout::Int4Groups(_) => unreachable!("an AVX2 layout off x86-64"),
        };
        let mut lines = vec![Line([0.0; 16]); s * width / 16];
        let out: &mut [f32] = bytemuck::cast_slice_mut(&mut lines);
        for (src, dst) in x
            .chunks_exact(n.max(1))
            .zip(out.chunks_exact_mut(width.max(1)))
        {
            if self == XLayout::Rows16 {
                dst[..n].copy_from_slice(src);
                continue;
            }
            for (b, blk) in dst.chunks_exact_mut(32).enumerate() {
                let base = 32 * b;
                for i in 0..16 {
                    blk[i] = src.get(base + 2 * i).copied().unwrap_or(0.0);
                    blk[16 + i] = src.get(base + 2 * i + 1).copied().unwrap_or(0.0);
                }
            }
        }
        XBuf::Lines(lines)
    }
}
