//! The planner and the host probes.

use super::host::{probe_compute, probe_disk};
use super::plan::{ModelShape, PlanInput};

fn input(ram_gb: u64, disk: f64) -> PlanInput {
    PlanInput {
        shape: ModelShape::known("glm-5.2").expect("known"),
        ram_bytes: ram_gb << 30,
        reserve_bytes: 4 << 30,
        disk_bytes_per_second: disk,
        compute_bytes_per_second: 20e9,
        history: None,
        seed: 3,
        sample_layers: 4,
    }
}

#[test]
fn the_built_in_shapes_have_glm52_and_deepseek_expert_sizes() {
    let g = ModelShape::known("GLM-5.2").expect("glm");
    // 3 × 6144 × 2048 int4 weights with an f32 scale per 64.
    assert_eq!(g.expert_bytes, 21_233_664);
    assert_eq!((g.moe_layers, g.experts, g.top_k), (75, 256, 8));
    let d = ModelShape::known("deepseek-v3").expect("dsv3");
    assert_eq!(
        d.expert_bytes,
        3 * 7168 * 2048 / 2 + 3 * 7168 * 2048 / 64 * 4
    );
    let err = ModelShape::known("llama-3")
        .expect_err("unknown")
        .to_string();
    assert!(
        err.contains("glm-5.2") && err.contains("deepseek-v3"),
        "{err}"
    );
}

#[test]
fn more_ram_hits_more_and_the_time_model_adds_up() {
    let small = input(64, 3e9).plan().expect("plan");
    let large = input(192, 3e9).plan().expect("plan");
    assert!(large.budget_share > 2.0 * small.budget_share);
    assert!(
        large.best.hit_rate > small.best.hit_rate + 0.1,
        "{} vs {}",
        large.best.hit_rate,
        small.best.hit_rate
    );
    assert!(large.best.tokens_per_second > small.best.tokens_per_second);
    // Without prefetch or drafts, a token costs at most one row of compute plus its reads
    // (nothing overlapped) and at least the larger of the two (everything overlapped).
    let s = input(64, 3e9);
    let row = (s.shape.dense_bytes as f64 + (8 * 75) as f64 * s.shape.expert_bytes as f64) / 20e9;
    for x in small
        .scenarios
        .iter()
        .filter(|x| !x.prefetch && x.draft_depth == 0)
    {
        let reads = x.bytes_per_token / 3e9;
        let (slowest, fastest) = (1.0 / (row + reads), 1.0 / row.max(reads));
        assert!(
            x.tokens_per_second >= slowest * (1.0 - 1e-9)
                && x.tokens_per_second <= fastest * (1.0 + 1e-9),
            "{x:?} outside [{slowest}, {fastest}]"
        );
        // The overlap is a call's resident experts computing while its misses load: at most
        // the routed experts' compute.
        let experts_s = (8 * 75) as f64 * s.shape.expert_bytes as f64 / 20e9;
        assert!(
            1.0 / x.tokens_per_second >= row + reads - experts_s - 1e-9,
            "{x:?}"
        );
        // A miss reads a whole expert.
        let experts = x.bytes_per_token / s.shape.expert_bytes as f64;
        assert!((experts - experts.round()).abs() < 1e-6 || experts > 100.0);
    }
}

#[test]
fn a_faster_disk_reads_the_same_bytes_sooner() {
    let slow = input(96, 1e9).plan().expect("plan");
    let fast = input(96, 8e9).plan().expect("plan");
    for (a, b) in slow.scenarios.iter().zip(&fast.scenarios) {
        assert_eq!(a.bytes_per_token, b.bytes_per_token);
        assert!(b.tokens_per_second > a.tokens_per_second);
    }
    assert!(slow.best.io_share > fast.best.io_share);
}

#[test]
fn too_little_ram_says_how_much_is_needed() {
    let err = input(8, 3e9)
        .plan()
        .expect_err("8 GB cannot hold GLM-5.2's dense weights")
        .to_string();
    assert!(err.contains("give more than"), "{err}");
    let mut bad = input(128, 3e9);
    bad.disk_bytes_per_second = 0.0;
    assert!(bad.plan().is_err());
}

#[test]
fn the_disk_probe_reads_and_refuses_small_files() {
    let dir = std::env::temp_dir().join(format!("colibri-probe-test-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let big = dir.join("big");
    std::fs::write(&big, vec![7u8; 8 << 20]).expect("write");
    let p = probe_disk(std::slice::from_ref(&big), 1 << 20, 0.05).expect("probe");
    assert!(p.reads >= 4 && p.bytes_per_second > 0.0, "{p:?}");
    assert_eq!(p.read_bytes, p.reads << 20);
    let small = dir.join("small");
    std::fs::write(&small, [1u8; 100]).expect("write");
    let err = probe_disk(&[small], 1 << 20, 0.05)
        .expect_err("too small")
        .to_string();
    assert!(err.contains("--disk-bw"), "{err}");
    assert!(probe_disk(&[dir.join("missing")], 1 << 20, 0.05).is_err());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_compute_probe_times_int4_experts() {
    let c = probe_compute(256, 128, 0.05).expect("probe");
    assert!(c.weight_bytes_per_second > 0.0 && c.threads >= 1, "{c:?}");
}
