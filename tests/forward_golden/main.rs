//! The forward pass against transformers' goldens (tests/fixtures/*, made by
//! tools/make_fixtures.py): prefill and token-by-token logits, greedy continuation, chunked
//! prefill, the MTP head (depth 1 and chained), KV accounting, and the default int4/int8
//! container against transformers running the same dequantised weights.
//!
//! One test binary (`cargo test --test forward_golden`), its tests by topic: `exact` (the
//! float32 forward), `dsa` (GLM DSA's key selection) and `quantized` (the default container
//! and the int8 prefill); `common` holds the fixtures' reader and the error measures.

mod common;
mod dsa;
mod exact;
mod quantized;
