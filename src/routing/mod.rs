//! Routing workloads and what the expert levers do on them (docs/expert-store.md, "The
//! routing workload", and `colibri plan`).
//!
//! - [`histogram`]: per-layer expert popularity (the shipped GLM-5.2 decode histogram, or a
//!   user's routing history);
//! - [`workload`]: the seeded generator calibrated to GLM-5.2's published routing figures;
//! - [`trace`]: the JSON-lines trace format (generated, exported by the engine, or anyone's);
//! - [`stats`]: a trace's routing statistics against those figures.

pub mod calibrate;
pub mod histogram;
pub mod host;
pub mod plan;
pub mod replay;
pub mod request;
pub mod rng;
pub mod sim;
pub mod stats;
pub mod trace;
pub mod workload;

#[cfg(test)]
mod plan_tests;
#[cfg(test)]
mod replay_tests;
#[cfg(test)]
mod tests;

pub use histogram::{Histogram, Skew};
pub use stats::TraceStats;
pub use trace::{Row, RowKind, Trace, TraceHeader};
pub use workload::{Knobs, Workload, WorkloadSpec, GLM52_ACCEPTANCE};
