//! The dequant-matmul kernels, every available path, against a float64 reference built from
//! weights packed here by docs/container.md's description of each format (element order,
//! nibble order, per-row and per-group scales), independently of the crate's own quantiser
//! and dequantiser. Row t of an S-row call equals the one-row call bit for bit, and the
//! thread count changes nothing. (The crate's unit tests compare the paths with the scalar
//! reference; this checks that all of them read the documented layout.)

use colibri::quant::kernels::{isa_check, matmul_with, KernelPath};
use colibri::quant::{QMatrix, QuantFormat};

/// Deterministic values in [lo, hi).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 33
    }
    fn uniform(&mut self, lo: f32, hi: f32) -> f32 {
        lo + (hi - lo) * (self.next() as f32 / (1u64 << 31) as f32)
    }
}

/// A packed weight in `format` (its container name) and the exact f32 values it holds.
struct Packed {
    data: Vec<u8>,
    scales: Vec<f32>,
    exact: Vec<f32>,
}

fn pack(format: &str, rows: usize, cols: usize, rng: &mut Lcg) -> Packed {
    let n = rows * cols;
    let w: Vec<f32> = (0..n).map(|_| rng.uniform(-1.0, 1.0)).collect();
    match format {
        "f32" => Packed {
            data: w.iter().flat_map(|v| v.to_le_bytes()).collect(),
            scales: Vec::new(),
            exact: w,
        },
        // bf16: the high half of the f32 bits.
        "bf16" => {
            let hi: Vec<u16> = w.iter().map(|v| (v.to_bits() >> 16) as u16).collect();
            Packed {
                data: hi.iter().flat_map(|h| h.to_le_bytes()).collect(),
                scales: Vec::new(),
                exact: hi
                    .iter()
                    .map(|&h| f32::from_bits((h as u32) << 16))
                    .collect(),
            }
        }
        "f16" => {
            let h: Vec<half::f16> = w.iter().map(|&v| half::f16::from_f32(v)).collect();
            Packed {
                data: h.iter().flat_map(|v| v.to_le_bytes()).collect(),
                scales: Vec::new(),
                exact: h.iter().map(|v| v.to_f32()).collect(),
            }
        }
        // int8: one i8 per element, one scale per row; w = q · s.
        "int8" => {
            let q: Vec<i8> = (0..n).map(|_| (rng.next() % 256) as u8 as i8).collect();
            let s: Vec<f32> = (0..rows).map(|_| rng.uniform(0.001, 0.02)).collect();
            Packed {
                data: q.iter().map(|&v| v as u8).collect(),
                exact: (0..n).map(|i| q[i] as f32 * s[i / cols]).collect(),
                scales: s,
            }
        }
        // int4: element 2j is the low nibble of byte j of its row, 2j+1 the high one;
        // w = (nibble − 8) · s, one scale per row ("int4") or per group of columns.
        _ => {
            let gs = match format.strip_prefix("int4_g") {
                Some(g) => g.parse().unwrap(),
                None => cols,
            };
            let nb = cols.div_ceil(2);
            let groups = cols.div_ceil(gs);
            let data: Vec<u8> = (0..rows * nb).map(|_| (rng.next() % 256) as u8).collect();
            let s: Vec<f32> = (0..rows * groups)
                .map(|_| rng.uniform(0.001, 0.02))
                .collect();
            let mut exact = vec![0.0f32; n];
            for r in 0..rows {
                for c in 0..cols {
                    let byte = data[r * nb + c / 2];
                    let nibble = if c % 2 == 0 { byte & 0x0f } else { byte >> 4 };
                    exact[r * cols + c] = (nibble as i32 - 8) as f32 * s[r * groups + c / gs];
                }
            }
            Packed {
                data,
                scales: s,
                exact,
            }
        }
    }
}

fn run(path: KernelPath, w: &QMatrix<'_>, x: &[f32], s: usize, threads: usize) -> Vec<f32> {
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .unwrap();
    let mut y = vec![0.0f32; s * w.rows()];
    matmul_with(path, w, x, s, &mut y, Some(&pool)).unwrap();
    y
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|f| f.to_bits()).collect()
}

#[test]
fn every_path_reads_the_documented_layout() {
    let mut formats: Vec<String> = ["f32", "bf16", "f16", "int8", "int4"]
        .map(String::from)
        .to_vec();
    formats.extend([16, 32, 48, 64, 96, 128, 192, 256].map(|g| format!("int4_g{g}")));
    let shapes = [(1, 1), (3, 17), (5, 100), (4, 255), (2, 1030)];
    for format in &formats {
        for &(rows, cols) in &shapes {
            let mut rng = Lcg((rows * 1000 + cols) as u64);
            let p = pack(format, rows, cols, &mut rng);
            let f = QuantFormat::parse(format).unwrap();
            let w = QMatrix::new(f, rows, cols, &p.data, &p.scales).unwrap();
            let s = 9;
            let x: Vec<f32> = (0..s * cols).map(|_| rng.uniform(-2.0, 2.0)).collect();
            for path in isa_check::paths() {
                let y = run(path, &w, &x, s, 1);
                for t in 0..s {
                    for o in 0..rows {
                        let (mut want, mut mag) = (0.0f64, 0.0f64);
                        for i in 0..cols {
                            let p = x[t * cols + i] as f64 * p.exact[o * cols + i] as f64;
                            want += p;
                            mag += p.abs();
                        }
                        let err = (y[t * rows + o] as f64 - want).abs();
                        assert!(
                            err <= 1e-5 * mag + 1e-30,
                            "{format} [{rows}, {cols}] on {}: row {t} out {o}: {} vs {want}",
                            path.name(),
                            y[t * rows + o]
                        );
                    }
                    let one = run(path, &w, &x[t * cols..(t + 1) * cols], 1, 1);
                    assert_eq!(
                        bits(&one),
                        bits(&y[t * rows..(t + 1) * rows]),
                        "{format} [{rows}, {cols}] on {}: row {t} alone",
                        path.name()
                    );
                }
                let y2 = run(path, &w, &x, s, 2);
                assert_eq!(
                    bits(&y2),
                    bits(&y),
                    "{format} on {}: 2 threads",
                    path.name()
                );
            }
        }
    }
}

#[test]
fn bad_shapes_and_formats_are_errors() {
    let data = [0u8; 6];
    let scales = [1.0f32; 3];
    // 3×2 int8 fits the bytes; x's width must be the weight's.
    let w = QMatrix::new(QuantFormat::parse("int8").unwrap(), 3, 2, &data, &scales).unwrap();
    let mut y = vec![0.0f32; 2 * 3];
    let path = KernelPath::available()[0];
    assert!(matmul_with(path, &w, &[0.0; 8], 2, &mut y, None).is_err());
    // 3×3 int8 needs 9 bytes, not 6.
    assert!(QMatrix::new(QuantFormat::parse("int8").unwrap(), 3, 3, &data, &scales).is_err());
    assert!(QuantFormat::parse("q4_0").is_err());
}
