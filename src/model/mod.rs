//! The forward pass of DeepSeek-V3-family models: MLA attention, dense and MoE feed-forward,
//! GLM-5's DSA lightning indexer and the MTP head. The model holds weights only; each
//! sequence's KV caches ([`KvCaches`]) are its owner's.

pub mod attention;
mod batch;
mod caches;
pub mod context;
pub mod forward;
pub mod indexer;
mod latent_attention;
mod layer;
pub mod linear;
mod mla_decompressed;
pub mod moe;
pub mod norm;
pub mod remote;
pub mod rope;
pub mod routing_sink;
mod sequence;
pub mod store_source;

pub use batch::{Forward, MtpForward, MtpRows, SeqRows};
pub use caches::KvCaches;
pub use forward::{Model, ModelOptions};
pub use routing_sink::{ForwardKind, RoutedRows, RoutingSink};
pub use sequence::Sequence;
