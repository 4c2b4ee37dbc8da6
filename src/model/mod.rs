//! The forward pass of DeepSeek-V3-family models: MLA attention, dense and MoE feed-forward,
//! GLM-5's DSA lightning indexer, the MTP head, and the KV caches.

pub mod attention;
mod carried;
pub mod context;
pub mod forward;
pub mod indexer;
mod latent_attention;
pub mod linear;
mod mla_decompressed;
pub mod moe;
pub mod norm;
pub mod rope;
pub mod store_source;

pub use carried::Carried;
pub use forward::{Forward, KvCaches, Model, ModelOptions, MtpForward};
