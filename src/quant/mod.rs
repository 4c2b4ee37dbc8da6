//! Weight formats, the quantiser, and the dequant-matmul kernels.
//!
//! Where each format's pieces are (its byte layout is specified in docs/container.md):
//!
//! | format | sizes | quantiser | scalar reference | SIMD decoders |
//! |---|---|---|---|---|
//! | f32, bf16, f16 | [`format::QuantFormat`] (`data_bytes`, `row_bytes`) | [`pack::quantize`] (re-encodes) | [`pack::reference_dequantize_row`] | x86: `kernels::sources::{F32, Bf16, F16}` over `Isa::{load, bf16, f16}` (`kernels/avx2.rs`, `kernels/avx512.rs`); NEON: the reference |
//! | int8 (per row) | the same, `scales_per_row` | [`pack::quantize`] (absmax / 127, round half even) | the same | x86: `sources::Int8` over `Isa::int8`; AVX-512 prefetches it (`avx512::Int8Ahead`); NEON: the reference |
//! | int4, int4_g{gs} | the same, `group_size` | [`pack::quantize`] (absmax / 7, q + 8 in nibbles) | the same | x86: `sources::Int4` over `Isa::{int4, int4_x4}`; AVX-512 by table for gs a multiple of 32 and per row (`avx512::Int4Lut`); NEON: `neon::fill` |
//!
//! Every decoder is tested against the reference bit for bit (`kernels::dequantize_row_with`
//! on every path, `kernels/tests.rs`), and every kernel path against `kernels::scalar`.

pub mod format;
pub mod kernels;
pub mod pack;

pub use format::{QMatrix, QuantFormat, GROUP_SIZES};
