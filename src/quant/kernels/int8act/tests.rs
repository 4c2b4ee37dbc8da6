use super::*;
use crate::quant::kernels::{isa_check, scalar};
use crate::quant::pack::{quantize, reference_dequantize_row};

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
        QuantFormat::Int4PerRow,
        QuantFormat::Int8PerRow,
    ]
}

#[test]
fn only_formats_with_block_constant_scales_have_an_int8_form() {
    assert!(supports(QuantFormat::Int4Grouped { group_size: 64 }));
    assert!(supports(QuantFormat::Int4Grouped { group_size: 256 }));
    assert!(supports(QuantFormat::Int8PerRow));
    assert!(!supports(QuantFormat::Int4Grouped { group_size: 32 }));
    assert!(!supports(QuantFormat::Int4Grouped { group_size: 96 }));
    assert!(!supports(QuantFormat::Bf16));
    let p = quantize(QuantFormat::Bf16, "w", &values(64, 1), 1, 64).unwrap();
    let x = QuantizedActs::new(&values(64, 2), 1, 64, None);
    let err = reference_matmul(&p.view(), &x, &mut [0.0]).unwrap_err();
    assert!(err.to_string().contains("no int8-activation form"), "{err}");
}

#[test]
fn activations_round_to_127_steps_of_their_block_maximum() {
    let mut x = values(200, 3);
    x[64..128].fill(0.0); // an all-zero block
    let q = QuantizedActs::new(&x, 1, 200, None);
    assert_eq!(q.chunks, 1);
    for b in 0..4 {
        let src = &x[b * 64..((b + 1) * 64).min(200)];
        let m = src.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        let block = q.block(0, b);
        assert_eq!(q.scales[b], m / 127.0);
        assert_eq!(q.sums[b], block.iter().map(|v| *v as i32).sum::<i32>());
        for (e, v) in src.iter().enumerate() {
            let back = block[e] as f32 * q.scales[b];
            assert!((back - v).abs() <= q.scales[b] * 0.5 + 1e-7, "{b} {e}");
        }
        // Past the row's end: zeros.
        assert!(block[src.len()..].iter().all(|v| *v == 0));
    }
    assert_eq!(q.scales[1], 0.0);
    assert!(q.scales[4..].iter().all(|s| *s == 0.0));
}

/// The reference's integer sums are Σ q·xq: rebuilt here in f64 from the dequantised weights
/// and the activations' own rounding, the result agrees to f32 rounding.
#[test]
fn reference_is_the_blockwise_integer_dot_product() {
    for format in formats() {
        let (o, i, s) = (5, 300, 3);
        let p = quantize(format, "w", &values(o * i, 4), o, i).unwrap();
        let x = values(s * i, 5);
        let q = QuantizedActs::new(&x, s, i, None);
        let mut y = vec![0.0f32; s * o];
        reference_matmul(&p.view(), &q, &mut y).unwrap();
        let mut wrow = vec![0.0f32; i];
        for r in 0..o {
            reference_dequantize_row(&p.view(), r, &mut wrow);
            for t in 0..s {
                let mut want = 0.0f64;
                for b in 0..i.div_ceil(64) {
                    let xq = q.block(t, b);
                    for e in b * 64..((b + 1) * 64).min(i) {
                        want +=
                            wrow[e] as f64 * xq[e - b * 64] as f64 * q.scales[t * 16 + b] as f64;
                    }
                }
                let got = y[t * o + r] as f64;
                assert!(
                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                    "{format} row {r} act {t}: {got} vs {want}"
                );
            }
        }
    }
}

/// Against the exact f32 kernel: the int8 rounding of the activations moves each output by
/// a few percent of the outputs' RMS at worst (3% measured with one ×20 outlier every 97
/// elements, which coarsens the steps of the blocks holding one).
#[test]
fn int8_activations_stay_close_to_the_exact_product() {
    for format in formats() {
        let (o, i, s) = (64, 1024, 8);
        let p = quantize(format, "w", &values(o * i, 6), o, i).unwrap();
        let x = values(s * i, 7);
        let mut exact = vec![0.0f32; s * o];
        scalar::matmul(&p.view(), &x, s, &mut exact);
        let mut approx = vec![0.0f32; s * o];
        let q = QuantizedActs::new(&x, s, i, None);
        reference_matmul(&p.view(), &q, &mut approx).unwrap();
        let rms = (exact.iter().map(|v| v * v).sum::<f32>() / exact.len() as f32).sqrt();
        let worst = exact
            .iter()
            .zip(&approx)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(worst / rms < 0.05, "{format}: worst {worst} at rms {rms}");
        assert!(
            worst > 0.0,
            "{format}: int8 activations cannot be exact here"
        );
    }
}

#[test]
fn shape_mismatches_are_errors() {
    let p = quantize(QuantFormat::Int8PerRow, "w", &values(4 * 64, 8), 4, 64).unwrap();
    let q = QuantizedActs::new(&values(2 * 65, 9), 2, 65, None);
    assert!(reference_matmul(&p.view(), &q, &mut [0.0; 8]).is_err());
    let q = QuantizedActs::new(&values(2 * 64, 9), 2, 64, None);
    assert!(reference_matmul(&p.view(), &q, &mut [0.0; 7]).is_err());
}

#[cfg(target_arch = "x86_64")]
#[test]
fn transpose16_swaps_rows_and_words() {
    if !isa_check::runs_int8(Int8Kernel::Vnni) {
        return;
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn run(m: &[[u32; 16]; 16]) -> [[u32; 16]; 16] {
        use std::arch::x86_64::*;
        // SAFETY: the features were checked by the caller; each row is 16 u32.
        unsafe {
            let mut r = [_mm512_setzero_si512(); 16];
            for (v, row) in r.iter_mut().zip(m) {
                *v = _mm512_loadu_si512(row.as_ptr().cast());
            }
            let t = vnni::transpose16_for_tests(r);
            let mut out = [[0u32; 16]; 16];
            for (row, v) in out.iter_mut().zip(t) {
                _mm512_storeu_si512(row.as_mut_ptr().cast(), v);
            }
            out
        }
    }
    let mut m = [[0u32; 16]; 16];
    for (j, row) in m.iter_mut().enumerate() {
        for (k, v) in row.iter_mut().enumerate() {
            *v = (j * 100 + k) as u32;
        }
    }
    // SAFETY: checked above.
    let t = unsafe { run(&m) };
    for k in 0..16 {
        for j in 0..16 {
            assert_eq!(t[k][j], m[j][k]);
        }
    }
}

#[cfg(target_arch = "x86_64")]
#[test]
fn transpose8_swaps_rows_and_words() {
    if !isa_check::runs_int8(Int8Kernel::Avx2) {
        return;
    }
    #[target_feature(enable = "avx2")]
    unsafe fn run(m: &[[u32; 8]; 8]) -> [[u32; 8]; 8] {
        use std::arch::x86_64::*;
        // SAFETY: the features were checked by the caller; each row is 8 u32.
        unsafe {
            let mut r = [_mm256_setzero_si256(); 8];
            for (v, row) in r.iter_mut().zip(m) {
                *v = _mm256_loadu_si256(row.as_ptr().cast());
            }
            let t = avx2::transpose8_for_tests(r);
            let mut out = [[0u32; 8]; 8];
            for (row, v) in out.iter_mut().zip(t) {
                _mm256_storeu_si256(row.as_mut_ptr().cast(), v);
            }
            out
        }
    }
    let mut m = [[0u32; 8]; 8];
    for (j, row) in m.iter_mut().enumerate() {
        for (k, v) in row.iter_mut().enumerate() {
            *v = (j * 100 + k) as u32;
        }
    }
    // SAFETY: checked above.
    let t = unsafe { run(&m) };
    for k in 0..8 {
        for j in 0..8 {
            assert_eq!(t[k][j], m[j][k]);
        }
    }
}

/// The 16-at-once lane sum adds in `sum_lanes`' order: values whose float sum depends on the
/// order (large and small magnitudes, cancellations) give the same bits, cell by cell.
#[cfg(target_arch = "x86_64")]
#[test]
fn sum_lanes16_adds_in_the_order_of_sum_lanes() {
    if !isa_check::runs_int8(Int8Kernel::Vnni) {
        return;
    }
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni")]
    unsafe fn run(m: &[[f32; 16]; 16]) -> [f32; 16] {
        use std::arch::x86_64::*;
        // SAFETY: the features were checked by the caller; each row is 16 f32.
        unsafe {
            // A loop, not `array::from_fn`: a closure would not inherit the target features.
            let mut v = [_mm512_setzero_ps(); 16];
            for (v, row) in v.iter_mut().zip(m) {
                *v = _mm512_loadu_ps(row.as_ptr());
            }
            vnni::sum_lanes16_for_tests(v)
        }
    }
    let mut m = [[0.0f32; 16]; 16];
    let big = values(256, 3);
    for (c, row) in m.iter_mut().enumerate() {
        for (i, v) in row.iter_mut().enumerate() {
            // Magnitudes from 1e-4 to 1e8: reordering changes the rounding.
            *v = big[c * 16 + i] * 10f32.powi(((c + 3 * i) % 13) as i32 - 4);
        }
    }
    // SAFETY: checked above.
    let got = unsafe { run(&m) };
    let mut reordered_differs = false;
    for c in 0..16 {
        assert_eq!(got[c].to_bits(), sum_lanes(&m[c]).to_bits(), "cell {c}");
        let sequential: f32 = m[c].iter().sum();
        reordered_differs |= sequential.to_bits() != got[c].to_bits();
    }
    // The control: another order gives other bits for some cell, so the test can fail.
    assert!(reordered_differs);
}

/// The SIMD kernels this CPU runs, each checked against std's detection and
/// `COLIBRI_REQUIRE_ISA` ([`isa_check`]), so that none is left out by a wrong detection.
fn simd_kernels() -> Vec<Int8Kernel> {
    isa_check::simd_int8_kernels()
}

/// Every SIMD kernel equals the reference bit for bit: every supported format, column counts
/// around the block and chunk edges, every tile shape, passes of several rows, and a pool.
#[test]
fn simd_kernels_equal_the_reference_bit_for_bit() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for kernel in simd_kernels() {
        for format in formats() {
            for &i in &[1usize, 63, 64, 65, 127, 128, 1000, 1024, 1025, 2048 + 64] {
                for &(o, s) in &[(1usize, 1usize), (3, 5), (4, 4), (9, 7), (17, 11), (6, 40)] {
                    let p = quantize(format, "w", &values(o * i, (o * i) as u64), o, i).unwrap();
                    let x = values(s * i, (s + i) as u64);
                    let q = QuantizedActs::new_on(&x, s, i, None, kernel);
                    let qp = QuantizedActs::new_on(&x, s, i, Some(&pool), kernel);
                    assert!(q.q.iter().zip(&qp.q).all(|(a, b)| a.0 == b.0));
                    assert_eq!((&q.scales, &q.sums), (&qp.scales, &qp.sums));
                    let mut want = vec![0.0f32; s * o];
                    reference_matmul(&p.view(), &q, &mut want).unwrap();
                    let mut got = vec![0.0f32; s * o];
                    matmul_quantized(&p.view(), &q, &mut got, kernel, None).unwrap();
                    let mut pooled = vec![0.0f32; s * o];
                    matmul_quantized(&p.view(), &q, &mut pooled, kernel, Some(&pool)).unwrap();
                    for (k, ((a, b), c)) in want.iter().zip(&got).zip(&pooled).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{kernel:?} {format} I={i} O={o} S={s} at {k}"
                        );
                        assert_eq!(
                            a.to_bits(),
                            c.to_bits(),
                            "{kernel:?} {format} pooled at {k}"
                        );
                    }
                }
            }
        }
        // Passes of fewer rows than S decode each weight row again and give the same values.
        let (o, i, s) = (8, 640, 21);
        let p = quantize(
            QuantFormat::Int4Grouped { group_size: 64 },
            "w",
            &values(o * i, 11),
            o,
            i,
        )
        .unwrap();
        let q = QuantizedActs::new_on(&values(s * i, 12), s, i, None, kernel);
        let mut whole = vec![0.0f32; o * s];
        let mut passes = vec![0.0f32; o * s];
        // SAFETY: the kernel is available (checked by `simd_kernels`); the shapes agree, the
        // outputs are [S, O] and one call writes every column.
        unsafe {
            let into = |y: &mut [f32]| OutColumns {
                ptr: y.as_mut_ptr(),
                s,
                o,
            };
            match kernel {
                Int8Kernel::Vnni => {
                    vnni::rows(&p.view(), 0, o, &q, s, into(&mut whole));
                    vnni::rows(&p.view(), 0, o, &q, 5, into(&mut passes));
                }
                _ => {
                    avx2::rows(&p.view(), 0, o, &q, s, into(&mut whole));
                    avx2::rows(&p.view(), 0, o, &q, 5, into(&mut passes));
                }
            }
        }
        assert_eq!(whole, passes, "{kernel:?}");
    }
}

/// Weights at the int8 extremes (−128 and 127, where AVX2's sign trick and the 16-bit pair
/// sums are closest to overflowing) against activations at ±127 give the reference's bits.
#[test]
fn simd_kernels_are_exact_at_the_extremes() {
    let (o, i, s) = (5, 256, 3);
    for kernel in simd_kernels() {
        for format in formats() {
            let mut w = vec![0.0f32; o * i];
            for (k, v) in w.iter_mut().enumerate() {
                // Each row's largest magnitude on its negative side, so the quantiser uses the
                // format's most negative integer; neighbours of equal sign (the pair sums).
                *v = if (k / 2) % 3 == 0 { -1.0 } else { 0.99 };
            }
            let p = quantize(format, "w", &w, o, i).unwrap();
            let x: Vec<f32> = (0..s * i)
                .map(|k| if (k / 2) % 3 == 0 { -2.0 } else { 2.0 })
                .collect();
            let q = QuantizedActs::new_on(&x, s, i, None, kernel);
            let mut want = vec![0.0f32; s * o];
            reference_matmul(&p.view(), &q, &mut want).unwrap();
            let mut got = vec![0.0f32; s * o];
            matmul_quantized(&p.view(), &q, &mut got, kernel, None).unwrap();
            assert_eq!(want, got, "{kernel:?} {format}");
            // The control: the exact float product, which the int8 result must be near.
            let mut exact = vec![0.0f32; s * o];
            scalar::matmul(&p.view(), &x, s, &mut exact);
            for (a, b) in got.iter().zip(&exact) {
                assert!(
                    (a - b).abs() <= 1e-3 * b.abs().max(1.0),
                    "{kernel:?} {format}: {a} vs {b}"
                );
            }
        }
    }
}

/// The AVX-512 quantiser gives the scalar one's bytes, scales and sums: blocks with
/// outliers, all-zero blocks, partial last blocks and chunks, many rows on a pool.
#[test]
fn vector_quantisers_equal_the_scalar_one() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for &cols in &[1usize, 17, 64, 100, 1024, 1025, 3000] {
        let rows = 5;
        let mut x = values(rows * cols, cols as u64);
        x[..cols.min(64)].fill(0.0);
        let a = QuantizedActs::new_on(&x, rows, cols, None, Int8Kernel::Reference);
        for kernel in simd_kernels() {
            let b = QuantizedActs::new_on(&x, rows, cols, Some(&pool), kernel);
            assert!(
                a.q.iter().zip(&b.q).all(|(p, q)| p.0 == q.0),
                "{kernel:?} cols {cols}"
            );
            assert_eq!(a.scales, b.scales, "{kernel:?} cols {cols}");
            assert_eq!(a.sums, b.sums, "{kernel:?} cols {cols}");
        }
    }
}

/// `matmul_decode`, the entry that quantises and picks the active decode kernel itself,
/// equals the reference bit for bit on one thread and on a pool (each kernel's own layouts,
/// refills and packed rows: `every_decode_kernel_equals_the_reference_bit_for_bit`). Skipped
/// (with a note) on CPUs without a decode kernel.
#[cfg(target_arch = "x86_64")]
#[test]
fn decode_kernel_equals_the_reference_bit_for_bit() {
    if simd_kernels().is_empty() {
        eprintln!("no AVX2 or AVX-512 VNNI here: no decode kernel runs");
        return;
    }
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for format in formats() {
        for &i in &[1usize, 64, 129, 512, 1025, 2048 + 64] {
            for &(o, s) in &[(1usize, 1usize), (5, 3), (17, 8), (6, 9), (40, 3)] {
                let p = quantize(format, "w", &values(o * i, (o * i) as u64), o, i).unwrap();
                let x = values(s * i, (s + 3 * i) as u64);
                let q = QuantizedActs::new_on(&x, s, i, None, Int8Kernel::Reference);
                let mut want = vec![0.0f32; s * o];
                reference_matmul(&p.view(), &q, &mut want).unwrap();
                for pool in [None, Some(&pool)] {
                    let mut got = vec![0.0f32; s * o];
                    matmul_decode(&p.view(), &x, s, &mut got, pool).unwrap();
                    for (k, (a, b)) in want.iter().zip(&got).enumerate() {
                        assert_eq!(
                            a.to_bits(),
                            b.to_bits(),
                            "{format} I={i} O={o} S={s} at {k} (pool {})",
                            pool.is_some()
                        );
                    }
                }
            }
        }
    }
}

/// The decode kernel at the extremes: every weight at the format's largest magnitude (int4
/// nibbles 0 and 15, int8 −128 and 127, where a lane's products sum largest) against
/// activations at ±127, in rows of 1 to 8 chunks and every row count, equals the reference
/// bit for bit: the qword-transposed int4 accumulators (2 lanes per block) hold exact sums.
#[cfg(target_arch = "x86_64")]
#[test]
fn decode_kernel_is_exact_at_the_extremes() {
    if !Int8Kernel::Vnni.available() {
        eprintln!("no AVX-512 VNNI here: the decode kernel does not run");
        return;
    }
    for format in formats() {
        for &i in &[64usize, 1024, 2048, 8192] {
            for &(o, s) in &[(3usize, 1usize), (2, 4), (2, 8), (1, 9)] {
                for sign in [1.0f32, -1.0] {
                    // Row 0 all at the negative extreme, the others alternating in runs.
                    let w: Vec<f32> = (0..o * i)
                        .map(|k| {
                            let (r, c) = (k / i, k % i);
                            if r == 0 || (c / 3) % 2 == 0 {
                                -sign
                            } else {
                                0.99 * sign
                            }
                        })
                        .collect();
                    let p = quantize(format, "w", &w, o, i).unwrap();
                    let x: Vec<f32> = (0..s * i)
                        .map(|k| {
                            if (k / i) % 2 == 0 || (k / 5) % 2 == 0 {
                                2.0
                            } else {
                                -2.0
                            }
                        })
                        .collect();
                    let q = QuantizedActs::new_on(&x, s, i, None, Int8Kernel::Reference);
                    let mut want = vec![0.0f32; s * o];
                    reference_matmul(&p.view(), &q, &mut want).unwrap();
                    let mut got = vec![0.0f32; s * o];
                    matmul_decode(&p.view(), &x, s, &mut got, None).unwrap();
                    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(&want), bits(&got), "{format} I={i} O={o} S={s}");
                }
            }
        }
    }
}

/// Every decode kernel (AVX-512 VNNI and AVX2, each where it runs) equals the reference bit
/// for bit for every row count a decode step, verify or batch makes (S = 1…9 and beyond), every
/// supported format (groups of 64, 128 and 256, per row, int8) and column counts around the
/// block, pair, group-of-8 and chunk edges, packed rows (1, 2, 4 and 8 blocks) among them, on
/// one thread and on a pool, in fresh and in refilled buffers. Each quantises to the
/// reference's scales and sums (the lines are each kernel's own layout).
#[cfg(target_arch = "x86_64")]
#[test]
fn every_decode_kernel_equals_the_reference_bit_for_bit() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    let mut formats = formats();
    formats.push(QuantFormat::Int4Grouped { group_size: 256 });
    let kernels = simd_kernels();
    assert!(
        !kernels.is_empty() || !Int8Kernel::Avx2.available(),
        "AVX2 runs here"
    );
    for format in formats {
        let mut reused: Vec<_> = kernels.iter().map(|_| DecodeActs::empty()).collect();
        for &i in &[
            1usize,
            63,
            64,
            65,
            127,
            128,
            129,
            192,
            256,
            320,
            448,
            512,
            576,
            1000,
            1024,
            1025,
            2048 + 64,
        ] {
            for &(o, s) in &[
                (1usize, 1usize),
                (3, 2),
                (5, 3),
                (4, 4),
                (9, 5),
                (17, 8),
                (6, 9),
                (33, 1),
                (40, 3),
                (7, 7),
                (11, 6),
            ] {
                let p = quantize(format, "w", &values(o * i, (o * i) as u64), o, i).unwrap();
                let x = values(s * i, (s + 3 * i) as u64);
                let q = QuantizedActs::new_on(&x, s, i, None, Int8Kernel::Reference);
                let mut want = vec![0.0f32; s * o];
                reference_matmul(&p.view(), &q, &mut want).unwrap();
                for (kernel, reused) in kernels.iter().zip(reused.iter_mut()) {
                    let mut d = DecodeActs::empty();
                    d.fill_on(*kernel, &x, s, i, format).unwrap();
                    assert_eq!(
                        (&q.scales, &q.sums),
                        (&d.scales, &d.sums),
                        "{kernel:?} {format} I={i}"
                    );
                    reused.fill_on(*kernel, &x, s, i, format).unwrap();
                    for (acts, what, pool) in
                        [(&d, "fresh", None), (&*reused, "refilled", Some(&pool))]
                    {
                        let mut got = vec![0.0f32; s * o];
                        let mut jobs = [DecodeJob {
                            w: p.view(),
                            x: acts,
                            y: &mut got,
                        }];
                        matmuls_decode(&mut jobs, pool).unwrap();
                        assert_eq!(
                            bits(&want),
                            bits(&got),
                            "{kernel:?} {what}: {format} I={i} O={o} S={s}"
                        );
                    }
                }
            }
        }
    }
}

/// The decode kernels at the int8 extremes (weights at −128 and 127, activations at ±127,
/// neighbours of equal sign: where the 16-bit pair sums and AVX2's sign trick come closest to
/// overflowing) give the reference's bits.
#[cfg(target_arch = "x86_64")]
#[test]
fn decode_kernels_are_exact_at_the_extremes() {
    let (o, i, s) = (9, 1024 + 64, 3);
    for kernel in simd_kernels() {
        for format in formats() {
            let mut w = vec![0.0f32; o * i];
            for (k, v) in w.iter_mut().enumerate() {
                *v = if (k / 2) % 3 == 0 { -1.0 } else { 0.99 };
            }
            let p = quantize(format, "w", &w, o, i).unwrap();
            for sign in [1.0f32, -1.0] {
                let x: Vec<f32> = (0..s * i)
                    .map(|k| sign * if (k / 2) % 3 == 0 { -2.0 } else { 2.0 })
                    .collect();
                let q = QuantizedActs::new_on(&x, s, i, None, Int8Kernel::Reference);
                let mut want = vec![0.0f32; s * o];
                reference_matmul(&p.view(), &q, &mut want).unwrap();
                let mut d = DecodeActs::empty();
                d.fill_on(kernel, &x, s, i, format).unwrap();
                let mut got = vec![0.0f32; s * o];
                matmuls_decode(
                    &mut [DecodeJob {
                        w: p.view(),
                        x: &d,
                        y: &mut got,
                    }],
                    None,
                )
                .unwrap();
                assert_eq!(want, got, "{kernel:?} {format}");
            }
        }
    }
}

/// Row invariance on every decode kernel: row t of an S-row call (S = 1…9, rows of different
/// magnitudes) equals the 1-row call on row t alone, bit for bit, with and without a pool.
#[cfg(target_arch = "x86_64")]
#[test]
fn decode_kernels_are_row_invariant() {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    for kernel in simd_kernels() {
        for format in formats() {
            for &i in &[64usize, 256, 700, 2048] {
                let o = 37;
                let p = quantize(format, "w", &values(o * i, i as u64), o, i).unwrap();
                let mut x = values(9 * i, 7 + i as u64);
                for (k, v) in x.iter_mut().enumerate() {
                    *v *= 1.0 + (k / i) as f32;
                }
                let one = |t: usize| {
                    let mut d = DecodeActs::empty();
                    d.fill_on(kernel, &x[t * i..(t + 1) * i], 1, i, format)
                        .unwrap();
                    let mut y = vec![0.0f32; o];
                    matmuls_decode(
                        &mut [DecodeJob {
                            w: p.view(),
                            x: &d,
                            y: &mut y,
                        }],
                        None,
                    )
                    .unwrap();
                    y
                };
                let alone: Vec<Vec<f32>> = (0..9).map(one).collect();
                for s in 1..=9 {
                    let mut d = DecodeActs::empty();
                    d.fill_on(kernel, &x[..s * i], s, i, format).unwrap();
                    let mut y = vec![0.0f32; s * o];
                    matmuls_decode(
                        &mut [DecodeJob {
                            w: p.view(),
                            x: &d,
                            y: &mut y,
                        }],
                        Some(&pool),
                    )
                    .unwrap();
                    for (t, row) in y.chunks_exact(o).enumerate() {
                        let b = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                        assert_eq!(
                            b(row),
                            b(&alone[t]),
                            "{kernel:?} {format} I={i} S={s} t={t}"
                        );
                    }
                }
            }
        }
    }
}
