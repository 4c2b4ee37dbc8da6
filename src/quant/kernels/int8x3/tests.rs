use super::*;
use crate::quant::pack::quantize;

/// Deterministic pseudo-random values in [-1, 1) with a few outliers (LLM activations have
/// channels far larger than the rest).
fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut state = seed
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    (0..n)
        .map(|i| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            let v = ((state >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0;
            if i % 97 == 13 {
                v * 20.0
            } else {
                v
            }
        })
        .collect()
}

fn formats() -> Vec<QuantFormat> {
    vec![
        QuantFormat::Int4Grouped { group_size: 64 },
        QuantFormat::Int4Grouped { group_size: 128 },
        QuantFormat::Int4Grouped { group_size: 192 },
        QuantFormat::Int4PerRow,
    ]
}

/// Column counts: whole chunks, a half chunk (an odd number of blocks), a partial block, a
/// decode-sized row.
const COLS: [usize; 6] = [64, 128, 192, 257, 448, 2112];

#[test]
fn only_int4_with_block_constant_scales_has_a_split_form() {
    assert!(supports(QuantFormat::Int4Grouped { group_size: 64 }));
    assert!(supports(QuantFormat::Int4Grouped { group_size: 256 }));
    assert!(supports(QuantFormat::Int4PerRow));
    assert!(!supports(QuantFormat::Int8PerRow));
    assert!(!supports(QuantFormat::Int4Grouped { group_size: 32 }));
    assert!(!supports(QuantFormat::Int4Grouped { group_size: 96 }));
    assert!(!supports(QuantFormat::F32));
    let p = quantize(QuantFormat::Int8PerRow, "w", &values(64, 1), 1, 64).unwrap();
    let x = SplitActs::new(&values(64, 2), 1, 64);
    let err = reference_matmul(&p.view(), &x, &mut [0.0]).unwrap_err();
    assert!(err.to_string().contains("no split-int8 form"), "{err}");
}

#[test]
fn digits_are_balanced_bytes_that_rebuild_q() {
    let mut q = -QMAX;
    while q <= QMAX {
        let d = digits(q);
        let back = (i32::from(d[0]) << 16) + (i32::from(d[1]) << 8) + i32::from(d[2]);
        assert_eq!(back, q);
        assert!(d[0].unsigned_abs() <= 127, "{q}: {d:?}");
        q += 997;
    }
    for q in [-QMAX, -1, 0, 1, 127, 128, -128, -129, 255, 256, QMAX - 1, QMAX] {
        let d = digits(q);
        assert_eq!(
            (i32::from(d[0]) << 16) + (i32::from(d[1]) << 8) + i32::from(d[2]),
            q
        );
    }
}

#[test]
fn activations_are_within_half_a_step_of_their_block_maximum() {
    let mut x = values(300, 3);
    x[64..128].fill(0.0); // an all-zero block
    x[200] = f32::NAN; // a block with a NaN: zeros, not garbage
    let a = SplitActs::new(&x, 1, 300);
    assert_eq!(a.chunks, 3);
    for b in 0..5 {
        let src = &x[b * 64..((b + 1) * 64).min(300)];
        let sx = a.scales[(b / 2) * LANES + (b % 2) * 8];
        for (e, v) in src.iter().enumerate() {
            let q = a.q(0, b * 64 + e);
            if b == 1 || b == 3 {
                assert_eq!((q, sx), (0, 0.0), "block {b}");
                continue;
            }
            let m = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            assert_eq!(sx, (f64::from(m) / f64::from(QMAX)) as f32);
            let back = f64::from(sx) * f64::from(q);
            // Half a step, plus sx's own f32 rounding over |Q| ≤ QMAX.
            let bound = f64::from(m) * (0.5 / f64::from(QMAX) + 2f64.powi(-24));
            assert!((back - f64::from(*v)).abs() <= bound, "{b} {e}: {back} {v}");
        }
    }
    // The offsets are 8·ΣQ of each lane's 8 elements.
    for l in 0..LANES {
        let want: i32 = (0..8).map(|i| 8 * a.q(0, 128 + 8 * l + i)).sum();
        assert_eq!(a.offsets[LANES + l], want);
    }
}

/// `Σ w·(sx·Q)` in f64 from the dequantised weights: the reference's integer sums are exact,
/// so it agrees with this to f32 rounding of the lanes.
#[test]
fn reference_is_the_exact_dot_product_of_the_split_activations() {
    for format in formats() {
        for cols in COLS {
            let (o, s) = (5, 3);
            let p = quantize(format, "w", &values(o * cols, 7), o, cols).unwrap();
            let w = p.view();
            let x = values(s * cols, 8);
            let a = SplitActs::new(&x, s, cols);
            let mut y = vec![0.0f32; s * o];
            reference_matmul(&w, &a, &mut y).unwrap();
            let mut wrow = vec![0.0f32; cols];
            for r in 0..o {
                reference_dequantize_row(&w, r, &mut wrow);
                for t in 0..s {
                    let (mut want, mut mag) = (0.0f64, 0.0f64);
                    for (e, wv) in wrow.iter().enumerate() {
                        let (c, j) = (e / CHUNK, e % CHUNK);
                        let sx = a.scales[(t * a.chunks + c) * LANES + j / 8];
                        let term = f64::from(*wv) * f64::from(sx) * f64::from(a.q(t, e));
                        want += term;
                        mag += term.abs();
                    }
                    let got = f64::from(y[t * o + r]);
                    assert!(
                        (got - want).abs() <= 1e-6 * mag,
                        "{format:?} cols {cols} r {r} t {t}: {got} vs {want}"
                    );
                }
            }
        }
    }
}

/// The tolerance the exact kernels are tested to against an f64 reference (1e-5 of Σ|x·w|,
/// src/quant/kernels/tests.rs) holds for the split arithmetic too, outliers included.
#[test]
fn split_activations_are_as_close_as_the_exact_kernels_tolerance() {
    for format in formats() {
        for cols in COLS {
            let (o, s) = (7, 2);
            let p = quantize(format, "w", &values(o * cols, 11), o, cols).unwrap();
            let w = p.view();
            let x = values(s * cols, 12);
            let a = SplitActs::new(&x, s, cols);
            let mut y = vec![0.0f32; s * o];
            reference_matmul(&w, &a, &mut y).unwrap();
            let mut wrow = vec![0.0f32; cols];
            for r in 0..o {
                reference_dequantize_row(&w, r, &mut wrow);
                for t in 0..s {
                    let xs = &x[t * cols..(t + 1) * cols];
                    let want: f64 = wrow.iter().zip(xs).map(|(w, x)| f64::from(w * x)).sum();
                    let mag: f64 = wrow.iter().zip(xs).map(|(w, x)| f64::from((w * x).abs())).sum();
                    let got = f64::from(y[t * o + r]);
                    assert!(
                        (got - want).abs() <= 1e-5 * mag,
                        "{format:?} cols {cols} r {r} t {t}: {got} vs {want} (Σ|xw| {mag})"
                    );
                }
            }
        }
    }
}

#[test]
fn the_vnni_kernel_equals_the_reference_bit_for_bit_and_never_depends_on_s() {
    if !available() {
        eprintln!("no AVX-512 VNNI on this CPU: the kernel is not exercised here");
        return;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for format in formats() {
        for cols in COLS {
            for (o, s) in [(1, 1), (2, 1), (5, 3), (9, 9), (67, 5)] {
                let p = quantize(format, "w", &values(o * cols, 21), o, cols).unwrap();
                let w = p.view();
                let x = values(s * cols, 22 + s as u64);
                let a = SplitActs::new(&x, s, cols);
                let mut want = vec![0.0f32; s * o];
                reference_matmul(&w, &a, &mut want).unwrap();
                for pool in [None, Some(&pool)] {
                    let mut got = vec![f32::NAN; s * o];
                    matmul(&w, &a, &mut got, pool).unwrap();
                    for (i, (g, r)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(
                            g.to_bits(),
                            r.to_bits(),
                            "{format:?} cols {cols} o {o} s {s} at {i}: {g} vs {r}"
                        );
                    }
                }
                // Row t of the S-row call is the 1-row call on row t.
                for t in 0..s {
                    let one = SplitActs::new(&x[t * cols..(t + 1) * cols], 1, cols);
                    let mut y1 = vec![0.0f32; o];
                    matmul(&w, &one, &mut y1, Some(&pool)).unwrap();
                    let row: Vec<u32> = want[t * o..(t + 1) * o].iter().map(|v| v.to_bits()).collect();
                    assert_eq!(row, y1.iter().map(|v| v.to_bits()).collect::<Vec<_>>());
                }
            }
        }
    }
}

#[test]
fn shape_mismatches_are_errors() {
    let p = quantize(QuantFormat::Int4Grouped { group_size: 64 }, "w", &values(256, 1), 2, 128)
        .unwrap();
    let x = SplitActs::new(&values(64, 2), 1, 64);
    let err = matmul(&p.view(), &x, &mut [0.0; 2], None).unwrap_err();
    assert!(err.to_string().contains("must have 128 columns"), "{err}");
    let x = SplitActs::new(&values(128, 2), 1, 128);
    let err = matmul(&p.view(), &x, &mut [0.0; 3], None).unwrap_err();
    assert!(err.to_string().contains("1×2 values"), "{err}");
}
