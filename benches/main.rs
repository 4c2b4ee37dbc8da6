//! One criterion binary; one module per area. Results are meant to be read as ratios against
//! the `bandwidth` group measured in the same run.

use criterion::criterion_main;

mod bandwidth;
mod context;
mod experts;
mod kernels;
mod prefill;
mod probes;
mod random_matrix;

criterion_main!(
    bandwidth::benches,
    context::benches,
    experts::benches,
    kernels::benches,
    prefill::benches
);
