//! Every available path against the scalar reference and a float64 reference; S-invariance and
//! thread-count invariance bit for bit; the fused expert against its composition; shape errors.

use super::*;
use crate::quant::format::{QuantFormat, GROUP_SIZES};
use crate::quant::pack::{dequantize, quantize, Packed};

/// Deterministic pseudo-random values in [-scale, scale).
fn lcg(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15).wrapping_add(1);
    (0..n)
        .map(|_| {
            x = x
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((x >> 40) as f32 / (1u64 << 24) as f32 - 0.5) * 2.0 * scale
        })
        .collect()
}

/// Every format the kernels take, every group size included.
fn formats() -> Vec<QuantFormat> {
    let mut f = vec![
        QuantFormat::F32,
        QuantFormat::Bf16,
        QuantFormat::F16,
        QuantFormat::Int8PerRow,
        QuantFormat::Int4PerRow,
    ];
    f.extend(
        GROUP_SIZES
            .iter()
            .map(|&group_size| QuantFormat::Int4Grouped { group_size }),
    );
    f
}

fn weights(format: QuantFormat, rows: usize, cols: usize, seed: u64) -> Packed {
    // Rows of different magnitudes so per-row and per-group scales differ.
    let mut w = lcg(seed, rows * cols, 1.0);
    for (o, row) in w.chunks_mut(cols.max(1)).enumerate() {
        let m = 0.25 + (o % 5) as f32;
        row.iter_mut().for_each(|v| *v *= m);
    }
    quantize(format, "w", &w, rows, cols).unwrap()
}

/// `y64[s, o] = Σ x·w` in f64 over the exactly dequantised weights, and `Σ |x·w|`.
fn reference_f64(w: &QMatrix<'_>, x: &[f32], s: usize) -> (Vec<f64>, Vec<f64>) {
    let (rows, cols) = (w.rows(), w.cols());
    let deq = dequantize(w);
    let mut y = vec![0.0f64; s * rows];
    let mut mag = vec![0.0f64; s * rows];
    for t in 0..s {
        for o in 0..rows {
            for i in 0..cols {
                let p = x[t * cols + i] as f64 * deq[o * cols + i] as f64;
                y[t * rows + o] += p;
                mag[t * rows + o] += p.abs();
            }
        }
    }
    (y, mag)
}

fn assert_close(got: &[f32], want: &[f64], mag: &[f64], tol: f64, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, ((g, w), m)) in got.iter().zip(want).zip(mag).enumerate() {
        let err = (*g as f64 - w).abs();
        assert!(
            err <= tol * m + 1e-30,
            "{what}: element {i}: got {g}, want {w} (error {err:e}, Σ|x·w| {m:e})"
        );
    }
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|v| v.to_bits()).collect()
}

fn run(path: KernelPath, w: &QMatrix<'_>, x: &[f32], s: usize) -> Vec<f32> {
    let mut y = vec![f32::NAN; s * w.rows()];
    matmul_with(path, w, x, s, &mut y, None).unwrap();
    y
}

const SHAPES: [(usize, usize); 14] = [
    (1, 1),
    (1, 100),
    (3, 7),
    (2, 15),
    (4, 16),
    (3, 17),
    (5, 63),
    (2, 64),
    (3, 65),
    (6, 100),
    (2, 255),
    (3, 300),
    (1, 513),
    (4, 1030),
];

#[test]
fn every_path_matches_scalar_and_f64_reference() {
    let paths = isa_check::paths();
    assert!(paths.contains(&KernelPath::Scalar));
    for (si, &(rows, cols)) in SHAPES.iter().enumerate() {
        for (fi, &format) in formats().iter().enumerate() {
            let p = weights(format, rows, cols, (si * 100 + fi) as u64);
            let w = p.view();
            for s in [1, 2, 5] {
                let x = lcg(si as u64 * 7 + s as u64, s * cols, 2.0);
                let (y64, mag) = reference_f64(&w, &x, s);
                let mut yref = vec![0.0f32; s * rows];
                scalar::matmul(&w, &x, s, &mut yref);
                assert_close(&yref, &y64, &mag, 1e-5, &format!("scalar::matmul {format}"));
                for &path in &paths {
                    let y = run(path, &w, &x, s);
                    let what = format!("{path} {format} [{rows}, {cols}] S={s}");
                    assert_close(&y, &y64, &mag, 1e-5, &what);
                    if path == KernelPath::Scalar {
                        assert_eq!(bits(&y), bits(&yref), "{what}: scalar path != reference");
                    }
                }
            }
        }
    }
}

#[test]
fn random_shapes_match_f64_reference() {
    let dims = lcg(99, 200, 1.0);
    let fmts = formats();
    for case in 0..40 {
        let r = |k: usize| ((dims[case * 5 + k] + 1.0) * 0.5 * 0.9999) as f64;
        let rows = 1 + (r(0) * 24.0) as usize;
        let cols = 1 + (r(1) * 700.0) as usize;
        let s = 1 + (r(2) * 64.0) as usize;
        let format = fmts[(r(3) * fmts.len() as f64) as usize];
        let p = weights(format, rows, cols, 1000 + case as u64);
        let w = p.view();
        let x = lcg(2000 + case as u64, s * cols, 1.5);
        let (y64, mag) = reference_f64(&w, &x, s);
        for path in isa_check::paths() {
            let y = run(path, &w, &x, s);
            let what = format!("{path} {format} [{rows}, {cols}] S={s}");
            assert_close(&y, &y64, &mag, 1e-5, &what);
        }
    }
}

#[test]
fn row_s_of_an_s_row_call_equals_the_one_row_call_bit_for_bit() {
    for path in isa_check::paths() {
        for (fi, &format) in formats().iter().enumerate() {
            for &(rows, cols) in &[(3, 100), (2, 17), (1, 129), (5, 300), (2, 64), (19, 2100)] {
                let p = weights(format, rows, cols, fi as u64 + cols as u64);
                let w = p.view();
                let x = lcg(fi as u64 * 3 + 1, 64 * cols, 1.0);
                let singles: Vec<Vec<u32>> = (0..64)
                    .map(|t| bits(&run(path, &w, &x[t * cols..(t + 1) * cols], 1)))
                    .collect();
                for s in [1, 2, 3, 4, 5, 8, 9, 17, 64] {
                    // Take rows starting at an offset so tile positions differ from S=1 calls.
                    let off = (64 - s) / 2;
                    let y = run(path, &w, &x[off * cols..(off + s) * cols], s);
                    for t in 0..s {
                        assert_eq!(
                            bits(&y[t * rows..(t + 1) * rows]),
                            singles[off + t],
                            "{path} {format} [{rows}, {cols}]: row {t} of S={s} differs from S=1"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn results_do_not_depend_on_the_thread_count() {
    let pools: Vec<rayon::ThreadPool> = [1, 2, 3]
        .iter()
        .map(|&n| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .build()
                .unwrap()
        })
        .collect();
    for path in isa_check::paths() {
        for format in [
            QuantFormat::Int4Grouped { group_size: 64 },
            QuantFormat::Int8PerRow,
            QuantFormat::Bf16,
        ] {
            // Enough rows for many chunks.
            let (rows, cols) = (301, 200);
            let p = weights(format, rows, cols, 5);
            let w = p.view();
            for s in [1, 3, 8] {
                let x = lcg(s as u64, s * cols, 1.0);
                let base = run(path, &w, &x, s);
                for pool in &pools {
                    let mut y = vec![0.0f32; s * rows];
                    matmul_with(path, &w, &x, s, &mut y, Some(pool)).unwrap();
                    assert_eq!(
                        bits(&y),
                        bits(&base),
                        "{path} {format} S={s} with {} threads",
                        pool.current_num_threads()
                    );
                }
            }
        }
    }
}

/// The fused expert equals its composition bit for bit, on every path, at every S.
#[test]
fn expert_ffn_equals_its_composition() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for path in isa_check::paths() {
        for (fi, &format) in [
            QuantFormat::Int4Grouped { group_size: 64 },
            QuantFormat::Int4Grouped { group_size: 48 },
            QuantFormat::Int8PerRow,
            QuantFormat::Bf16,
            QuantFormat::F32,
        ]
        .iter()
        .enumerate()
        {
            for &(f, h) in &[(40, 70), (33, 128), (1, 5)] {
                let seed = fi as u64 * 10;
                let (gp, up, dp) = (
                    weights(format, f, h, seed),
                    weights(format, f, h, seed + 1),
                    weights(format, h, f, seed + 2),
                );
                let (g, u, d) = (gp.view(), up.view(), dp.view());
                let x = lcg(seed + 3, 17 * h, 1.0);
                let mut single = Vec::new();
                for t in 0..17 {
                    let mut o = vec![0.0f32; h];
                    expert_ffn_with(path, &g, &u, &d, &x[t * h..(t + 1) * h], 1, &mut o, None)
                        .unwrap();
                    single.extend(o);
                }
                for s in [1, 2, 3, 5, 8, 17] {
                    let xs = &x[..s * h];
                    let mut out = vec![0.0f32; s * h];
                    expert_ffn_with(path, &g, &u, &d, xs, s, &mut out, Some(&pool)).unwrap();
                    // Composition on the same path.
                    let gy = run(path, &g, xs, s);
                    let uy = run(path, &u, xs, s);
                    let hid: Vec<f32> = gy.iter().zip(&uy).map(|(a, b)| silu(*a) * b).collect();
                    let want = run(path, &d, &hid, s);
                    let what = format!("{path} {format} F={f} H={h} S={s}");
                    assert_eq!(bits(&out), bits(&want), "{what}: fused != composition");
                    assert_eq!(bits(&out), bits(&single[..s * h]), "{what}: != S=1 calls");
                    // And against float64 end to end (loose: silu and two roundings of h).
                    let (g64, _) = reference_f64(&g, xs, s);
                    let (u64_, _) = reference_f64(&u, xs, s);
                    let h64: Vec<f32> = g64
                        .iter()
                        .zip(&u64_)
                        .map(|(a, b)| (a / (1.0 + (-a).exp()) * b) as f32)
                        .collect();
                    let (o64, mag) = reference_f64(&d, &h64, s);
                    assert_close(&out, &o64, &mag, 1e-4, &what);
                }
            }
        }
    }
}

/// A batch of experts (different shapes, formats and S, one of them past `S_BLOCK`, one
/// with mixed gate/up formats, one with no rows) equals each expert run alone bit for bit, on
/// every path, with or without a pool; so does the int8 arithmetic's batch.
#[test]
fn experts_batch_equals_each_expert_alone() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let g64 = QuantFormat::Int4Grouped { group_size: 64 };
    // (gate/up format, down format, F, H, S); every expert of a MoE layer shares H.
    let h = 128;
    let specs = [
        (g64, g64, 40, 1),
        (g64, g64, 300, 3),
        (QuantFormat::Int8PerRow, QuantFormat::Bf16, 33, 11),
        (QuantFormat::Bf16, g64, 1, 1),
        (g64, g64, 64, 0),
        (g64, g64, 7, 8),
    ];
    let mats: Vec<[Packed; 3]> = specs
        .iter()
        .enumerate()
        .map(|(i, &(fmt, down_fmt, f, _))| {
            let seed = 100 * i as u64;
            [
                weights(fmt, f, h, seed),
                // The third expert's up is int4 while its gate is int8: layouts differ.
                weights(if i == 2 { g64 } else { fmt }, f, h, seed + 1),
                weights(down_fmt, h, f, seed + 2),
            ]
        })
        .collect();
    let xs: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(i, &(.., s))| lcg(7 + i as u64, s * h, 1.0))
        .collect();
    let calls: Vec<ExpertCall<'_>> = mats
        .iter()
        .zip(&xs)
        .zip(&specs)
        .map(|(([g, u, d], x), &(.., s))| ExpertCall {
            gate: g.view(),
            up: u.view(),
            down: d.view(),
            x,
            s,
        })
        .collect();
    let alone = |c: &ExpertCall<'_>, one: &dyn Fn(&ExpertCall<'_>, &mut [f32])| {
        let mut out = vec![0.0f32; c.s * h];
        one(c, &mut out);
        out
    };
    for path in isa_check::paths() {
        let want: Vec<Vec<f32>> = calls
            .iter()
            .map(|c| {
                alone(c, &|c, out| {
                    expert_ffn_with(path, &c.gate, &c.up, &c.down, c.x, c.s, out, None).unwrap()
                })
            })
            .collect();
        for p in [None, Some(&pool)] {
            let mut got: Vec<Vec<f32>> = calls.iter().map(|c| vec![f32::NAN; c.s * h]).collect();
            let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|v| &mut v[..]).collect();
            experts_ffn_with(path, &calls, &mut outs, p).unwrap();
            for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                assert_eq!(bits(g), bits(w), "{path}, expert {i}, pool {}", p.is_some());
            }
        }
    }
    // Int8 activations: the batch is each expert's own int8 call (they quantise their rows).
    let int8 = |c: &ExpertCall<'_>, out: &mut [f32]| {
        expert_ffn_in(
            Arithmetic::Int8,
            &c.gate,
            &c.up,
            &c.down,
            c.x,
            c.s,
            out,
            Some(&pool),
        )
        .unwrap()
    };
    let want: Vec<Vec<f32>> = calls.iter().map(|c| alone(c, &int8)).collect();
    let mut got: Vec<Vec<f32>> = calls.iter().map(|c| vec![f32::NAN; c.s * h]).collect();
    let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|v| &mut v[..]).collect();
    experts_ffn_in(Arithmetic::Int8, &calls, &mut outs, Some(&pool)).unwrap();
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(bits(g), bits(w), "int8, expert {i}");
    }
}

/// A batch with a bad call, or with as many outputs as calls missing, is an error naming the
/// problem, and nothing panics.
#[test]
fn experts_batch_errors_are_errors() {
    let g = weights(QuantFormat::Int8PerRow, 6, 100, 2);
    let d = weights(QuantFormat::Int8PerRow, 100, 6, 3);
    let d_bad = weights(QuantFormat::Int8PerRow, 100, 5, 3);
    let x = vec![0.5f32; 2 * 100];
    fn call<'a>(g: &'a Packed, down: &'a Packed, x: &'a [f32]) -> ExpertCall<'a> {
        ExpertCall {
            gate: g.view(),
            up: g.view(),
            down: down.view(),
            x,
            s: 2,
        }
    }
    for path in isa_check::paths() {
        let (mut a, mut b) = (vec![0.0f32; 200], vec![0.0f32; 200]);
        let calls = [call(&g, &d, &x), call(&g, &d_bad, &x)];
        let err = experts_ffn_with(path, &calls, &mut [&mut a, &mut b], None).unwrap_err();
        assert!(err.to_string().contains("do not form an expert"), "{err}");
        let calls = [call(&g, &d, &x), call(&g, &d, &x)];
        let err = experts_ffn_with(path, &calls, &mut [&mut a], None).unwrap_err();
        assert!(
            err.to_string().contains("2 expert calls but 1 output"),
            "{err}"
        );
        let err = experts_ffn_with(path, &calls, &mut [&mut a, &mut b[1..]], None).unwrap_err();
        assert!(err.to_string().contains("must hold"), "{err}");
        assert!(experts_ffn_with(path, &calls, &mut [&mut a, &mut b], None).is_ok());
        assert!(experts_ffn_with(path, &[], &mut [], None).is_ok());
    }
}

#[test]
fn silu_is_the_textbook_function() {
    for v in [-20.0f32, -1.5, -0.0, 0.0, 0.25, 3.0, 40.0] {
        let want = v as f64 / (1.0 + (-(v as f64)).exp());
        assert!((silu(v) as f64 - want).abs() <= 1e-6 * want.abs().max(1e-30));
    }
    assert_eq!(silu(0.0), 0.0);
}

#[test]
fn shape_errors_are_errors_not_panics() {
    let p = weights(QuantFormat::Int4Grouped { group_size: 64 }, 4, 100, 1);
    let w = p.view();
    for path in isa_check::paths() {
        let x = vec![0.0f32; 2 * 100];
        let mut y = vec![0.0f32; 2 * 4];
        assert!(matmul_with(path, &w, &x[1..], 2, &mut y, None).is_err());
        assert!(matmul_with(path, &w, &x, 2, &mut y[1..], None).is_err());
        assert!(matmul_with(path, &w, &x, 3, &mut y, None).is_err());
        assert!(matmul_with(path, &w, &x, usize::MAX, &mut y, None).is_err());
        assert!(matmul_with(path, &w, &x, 2, &mut y, None).is_ok());
        // Zero rows is a valid, empty call.
        assert!(matmul_with(path, &w, &[], 0, &mut [], None).is_ok());

        let g = weights(QuantFormat::Int8PerRow, 6, 100, 2);
        let d = weights(QuantFormat::Int8PerRow, 100, 6, 3);
        let d_bad = weights(QuantFormat::Int8PerRow, 100, 5, 3);
        let mut out = vec![0.0f32; 2 * 100];
        let (gv, dv) = (g.view(), d.view());
        assert!(expert_ffn_with(path, &gv, &gv, &dv, &x, 2, &mut out, None).is_ok());
        let bad = d_bad.view();
        assert!(expert_ffn_with(path, &gv, &gv, &bad, &x, 2, &mut out, None).is_err());
        assert!(expert_ffn_with(path, &gv, &w, &dv, &x, 2, &mut out, None).is_err());
        assert!(expert_ffn_with(path, &gv, &gv, &dv, &x, 2, &mut out[1..], None).is_err());
        assert!(expert_ffn_with(path, &gv, &gv, &dv, &x[1..], 2, &mut out, None).is_err());
    }
}

#[test]
fn zero_columns_give_zeros() {
    for path in isa_check::paths() {
        for format in formats() {
            let scales = vec![1.0f32; format.scale_count(3, 0).unwrap()];
            let w = QMatrix::new(format, 3, 0, &[], &scales).unwrap();
            let mut y = vec![f32::NAN; 2 * 3];
            matmul_with(path, &w, &[], 2, &mut y, None).unwrap();
            assert!(y.iter().all(|v| *v == 0.0), "{path} {format}: {y:?}");
        }
    }
}

#[test]
fn mixed_gate_and_up_formats_still_compose() {
    for path in isa_check::paths() {
        let g = weights(QuantFormat::Int4Grouped { group_size: 32 }, 9, 96, 1);
        let u = weights(QuantFormat::Int8PerRow, 9, 96, 2);
        let d = weights(QuantFormat::Bf16, 96, 9, 3);
        let x = lcg(4, 3 * 96, 1.0);
        let mut out = vec![0.0f32; 3 * 96];
        expert_ffn_with(path, &g.view(), &u.view(), &d.view(), &x, 3, &mut out, None).unwrap();
        let gy = run(path, &g.view(), &x, 3);
        let uy = run(path, &u.view(), &x, 3);
        let hid: Vec<f32> = gy.iter().zip(&uy).map(|(a, b)| silu(*a) * b).collect();
        assert_eq!(bits(&out), bits(&run(path, &d.view(), &hid, 3)), "{path}");
    }
}

#[test]
fn paths_parse_and_unavailable_ones_are_refused() {
    for p in KernelPath::ALL {
        assert_eq!(KernelPath::parse(p.name()).unwrap(), p);
    }
    assert_eq!(KernelPath::parse(" AVX2 ").unwrap(), KernelPath::Avx2);
    assert!(KernelPath::parse("sse").is_err());
    assert_eq!(parse_override(None), Ok(None));
    assert_eq!(parse_override(Some("")), Ok(None));
    assert_eq!(parse_override(Some("scalar")), Ok(Some(KernelPath::Scalar)));
    assert!(parse_override(Some("fast")).is_err());
    let unavailable: Vec<KernelPath> = KernelPath::ALL
        .into_iter()
        .filter(|p| !p.is_available())
        .collect();
    // Neon on x86, the x86 paths on aarch64: there is always one.
    assert!(!unavailable.is_empty());
    let before = selected_path();
    for p in unavailable {
        assert!(parse_override(Some(p.name())).is_err());
        let err = set_forced_path(Some(p)).unwrap_err().to_string();
        assert!(err.contains(p.name()), "{err}");
        assert_eq!(
            selected_path(),
            before,
            "a refused force must change nothing"
        );
        let w = weights(QuantFormat::Int8PerRow, 2, 3, 1);
        let mut y = [0.0f32; 2];
        assert!(matmul_with(p, &w.view(), &[0.0; 3], 1, &mut y, None).is_err());
    }
    // Forcing the path already in use (so concurrent tests see no change) and un-forcing.
    set_forced_path(Some(before)).unwrap();
    assert_eq!(selected_path(), before);
    assert_eq!(active_path().unwrap(), before);
    set_forced_path(None).unwrap();
    assert_eq!(selected_path(), before);
}

#[test]
fn best_path_uses_the_widest_vectors_available() {
    let best = KernelPath::best();
    assert!(best.is_available());
    // By std's detection, not the crate's: a wrong detection must not pass for a narrower CPU.
    let has = |p| {
        isa_check::path_features(p)
            .iter()
            .all(|f| isa_check::std_detects(f))
    };
    if has(KernelPath::Avx512) {
        assert_eq!(best, KernelPath::Avx512);
    } else if has(KernelPath::Avx2) {
        assert_eq!(best, KernelPath::Avx2);
    } else if has(KernelPath::Neon) {
        assert_eq!(best, KernelPath::Neon);
    }
}

#[test]
fn dequantized_rows_equal_the_reference_bit_for_bit() {
    for path in isa_check::paths() {
        for (fi, &format) in formats().iter().enumerate() {
            for &cols in &[1, 7, 16, 17, 31, 64, 100, 129, 300, 512] {
                let rows = 3;
                let p = weights(format, rows, cols, 7 * fi as u64 + cols as u64);
                let w = p.view();
                for o in 0..rows {
                    let mut reference = vec![f32::NAN; cols];
                    crate::quant::pack::reference_dequantize_row(&w, o, &mut reference);
                    let mut got = vec![f32::NAN; cols];
                    dequantize_row_with(path, &w, o, &mut got).unwrap();
                    assert_eq!(
                        bits(&got),
                        bits(&reference),
                        "{path} {format} [{rows}, {cols}] row {o}"
                    );
                }
            }
        }
    }
}

#[test]
fn dequantize_row_refuses_a_bad_row_or_length() {
    let p = weights(QuantFormat::Int4Grouped { group_size: 64 }, 2, 100, 3);
    let w = p.view();
    for path in isa_check::paths() {
        let mut out = vec![0.0f32; 100];
        let e = dequantize_row_with(path, &w, 2, &mut out).unwrap_err();
        assert!(e.to_string().contains("row 2 of a [2, 100] matrix"), "{e}");
        let mut short = vec![0.0f32; 99];
        let e = dequantize_row_with(path, &w, 0, &mut short).unwrap_err();
        assert!(e.to_string().contains("into 99 floats"), "{e}");
    }
}

/// A batch of decode-sized experts in int8 (the one-pass decode batch where a decode kernel,
/// VNNI or AVX2, runs) equals the int8 arithmetic's scalar reference per expert, bit for bit: S = 1…9, int4
/// and int8 weights, an expert with no rows, with and without a pool.
#[test]
fn int8_decode_batch_equals_the_reference_per_expert() {
    use int8act::{reference_matmul, QuantizedActs};
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let g64 = QuantFormat::Int4Grouped { group_size: 64 };
    let h = 192;
    let specs = [
        (g64, 40, 1),
        (g64, 70, 4),
        (QuantFormat::Int8PerRow, 33, 9),
        (g64, 64, 0),
    ];
    let mats: Vec<[Packed; 3]> = specs
        .iter()
        .enumerate()
        .map(|(i, &(fmt, f, _))| {
            let seed = 300 + 10 * i as u64;
            [
                weights(fmt, f, h, seed),
                weights(fmt, f, h, seed + 1),
                weights(fmt, h, f, seed + 2),
            ]
        })
        .collect();
    let xs: Vec<Vec<f32>> = specs
        .iter()
        .enumerate()
        .map(|(i, &(.., s))| lcg(70 + i as u64, s * h, 2.0))
        .collect();
    let calls: Vec<ExpertCall<'_>> = mats
        .iter()
        .zip(&xs)
        .zip(&specs)
        .map(|(([g, u, d], x), &(.., s))| ExpertCall {
            gate: g.view(),
            up: u.view(),
            down: d.view(),
            x,
            s,
        })
        .collect();
    let reference = |c: &ExpertCall<'_>| -> Vec<f32> {
        let (f, s) = (c.gate.rows(), c.s);
        let q = QuantizedActs::new(c.x, s, h, None);
        let (mut g, mut u) = (vec![0.0f32; s * f], vec![0.0f32; s * f]);
        reference_matmul(&c.gate, &q, &mut g).unwrap();
        reference_matmul(&c.up, &q, &mut u).unwrap();
        for (g, u) in g.iter_mut().zip(&u) {
            *g = silu(*g) * u;
        }
        let mut out = vec![0.0f32; s * h];
        reference_matmul(&c.down, &QuantizedActs::new(&g, s, f, None), &mut out).unwrap();
        out
    };
    let want: Vec<Vec<f32>> = calls.iter().map(reference).collect();
    for p in [None, Some(&pool)] {
        let mut got: Vec<Vec<f32>> = calls.iter().map(|c| vec![f32::NAN; c.s * h]).collect();
        let mut outs: Vec<&mut [f32]> = got.iter_mut().map(|v| &mut v[..]).collect();
        experts_ffn_in(Arithmetic::Int8, &calls, &mut outs, p).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_eq!(
                bits(g),
                bits(w),
                "int8 decode batch, expert {i}, pool {}",
                p.is_some()
            );
        }
    }
}
