//! Weight formats, the quantiser, and the dequant-matmul kernels.

pub mod format;
pub mod kernels;
pub mod pack;

pub use format::{QMatrix, QuantFormat, GROUP_SIZES};
