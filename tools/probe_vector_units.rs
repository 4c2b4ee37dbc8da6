//! Stand-alone probe of how many 512-bit operations of each kind a core issues per cycle, alone
//! and mixed (developer tool, not part of the crate): the arithmetic behind the exact int4
//! decode's ceiling in cache (docs/benchmarks.md, "What bounds exact decode in cache on Zen 4").
//! Every measurement is a loop of independent register-to-register operations (inline
//! assembly: nothing is folded away), timed against a chain of dependent scalar `add`s, which
//! retire one per cycle: the figures are cycles, whatever the clock. Loads read one 4 KiB
//! buffer (L1). The last rows are the inner loops of the int4-g64 decode at S = 1 per 128
//! weights of one row: the kept table decode (`Int4Lut` in src/quant/kernels/avx512.rs) and
//! the alternatives measured against it.
//!
//! ```text
//! rustc -O -C target-cpu=native tools/probe_vector_units.rs -o /tmp/probe_vector_units
//! /tmp/probe_vector_units
//! ```

#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
mod probe {
    use std::arch::asm;
    use std::time::Instant;

    /// Loop iterations per measurement.
    const N: u64 = 20_000_000;

    /// Seconds per iteration of a loop running `body` (every zmm register is clobbered; `{p}`
    /// names a readable 4 KiB buffer).
    macro_rules! timed {
        ($body:literal) => {{
            let buf = [1u8; 4096];
            let t = Instant::now();
            // SAFETY: the body reads only the 4 KiB at {p} and writes only zmm registers,
            // all declared clobbered; the loop counter is its own register.
            unsafe {
                asm!(
                    // Zeros everywhere: no denormal or NaN operand slows a loop down.
                    "vpxord zmm0, zmm0, zmm0",
                    "vpxord zmm1, zmm1, zmm1",
                    "vpxord zmm2, zmm2, zmm2",
                    "vpxord zmm3, zmm3, zmm3",
                    "vpxord zmm4, zmm4, zmm4",
                    "vpxord zmm5, zmm5, zmm5",
                    "vpxord zmm6, zmm6, zmm6",
                    "vpxord zmm7, zmm7, zmm7",
                    "vpxord zmm8, zmm8, zmm8",
                    "vpxord zmm9, zmm9, zmm9",
                    "vpxord zmm10, zmm10, zmm10",
                    "vpxord zmm11, zmm11, zmm11",
                    "vpxord zmm12, zmm12, zmm12",
                    "vpxord zmm13, zmm13, zmm13",
                    "vpxord zmm14, zmm14, zmm14",
                    "vpxord zmm15, zmm15, zmm15",
                    "vpxord zmm16, zmm16, zmm16",
                    "vpxord zmm17, zmm17, zmm17",
                    "vpxord zmm18, zmm18, zmm18",
                    "vpxord zmm19, zmm19, zmm19",
                    "vpxord zmm20, zmm20, zmm20",
                    "vpxord zmm21, zmm21, zmm21",
                    "vpxord zmm22, zmm22, zmm22",
                    "vpxord zmm23, zmm23, zmm23",
                    "vpxord zmm24, zmm24, zmm24",
                    "vpxord zmm25, zmm25, zmm25",
                    "vpxord zmm26, zmm26, zmm26",
                    "vpxord zmm27, zmm27, zmm27",
                    "vpxord zmm28, zmm28, zmm28",
                    "vpxord zmm29, zmm29, zmm29",
                    "vpxord zmm30, zmm30, zmm30",
                    "vpxord zmm31, zmm31, zmm31",
                    "2:",
                    $body,
                    "dec {n}",
                    "/* the buffer: {p} */",
                    "jnz 2b",
                    n = inout(reg) N => _,
                    p = in(reg) buf.as_ptr(),
                    out("zmm0") _, out("zmm1") _, out("zmm2") _, out("zmm3") _,
                    out("zmm4") _, out("zmm5") _, out("zmm6") _, out("zmm7") _,
                    out("zmm8") _, out("zmm9") _, out("zmm10") _, out("zmm11") _,
                    out("zmm12") _, out("zmm13") _, out("zmm14") _, out("zmm15") _,
                    out("zmm16") _, out("zmm17") _, out("zmm18") _, out("zmm19") _,
                    out("zmm20") _, out("zmm21") _, out("zmm22") _, out("zmm23") _,
                    out("zmm24") _, out("zmm25") _, out("zmm26") _, out("zmm27") _,
                    out("zmm28") _, out("zmm29") _, out("zmm30") _, out("zmm31") _,
                    options(nostack),
                );
            }
            t.elapsed().as_secs_f64() / N as f64
        }};
    }

    /// Seconds per cycle: 8 dependent scalar adds per iteration retire in 8 cycles.
    fn cycle() -> f64 {
        let mut best = f64::MAX;
        for _ in 0..3 {
            let t = Instant::now();
            let mut x = 0u64;
            // SAFETY: register arithmetic only.
            unsafe {
                asm!(
                    "2:",
                    "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                    "add {x}, 1", "add {x}, 1", "add {x}, 1", "add {x}, 1",
                    "dec {n}",
                    "jnz 2b",
                    n = inout(reg) N => _,
                    x = inout(reg) x,
                    options(nostack, nomem),
                );
            }
            std::hint::black_box(x);
            best = best.min(t.elapsed().as_secs_f64() / (8 * N) as f64);
        }
        best
    }

    /// One measured loop: its name, the operations an iteration issues, and its time.
    struct Row {
        name: &'static str,
        ops: u32,
        seconds: f64,
    }

    fn rows() -> Vec<Row> {
        let r = |name, ops, seconds| Row { name, ops, seconds };
        vec![
            // One kind at a time: 8 independent operations (sources never written).
            r("vpermps", 8, timed!("vpermps zmm0, zmm30, zmm31\nvpermps zmm1, zmm30, zmm31\nvpermps zmm2, zmm30, zmm31\nvpermps zmm3, zmm30, zmm31\nvpermps zmm4, zmm30, zmm31\nvpermps zmm5, zmm30, zmm31\nvpermps zmm6, zmm30, zmm31\nvpermps zmm7, zmm30, zmm31")),
            r("vpermi2ps (two tables)", 8, timed!("vmovaps zmm0, zmm29\nvpermi2ps zmm0, zmm30, zmm31\nvmovaps zmm1, zmm29\nvpermi2ps zmm1, zmm30, zmm31\nvmovaps zmm2, zmm29\nvpermi2ps zmm2, zmm30, zmm31\nvmovaps zmm3, zmm29\nvpermi2ps zmm3, zmm30, zmm31\nvmovaps zmm4, zmm29\nvpermi2ps zmm4, zmm30, zmm31\nvmovaps zmm5, zmm29\nvpermi2ps zmm5, zmm30, zmm31\nvmovaps zmm6, zmm29\nvpermi2ps zmm6, zmm30, zmm31\nvmovaps zmm7, zmm29\nvpermi2ps zmm7, zmm30, zmm31")),
            r("vpmovzxbd zmm, m128", 8, timed!("vpmovzxbd zmm0, [{p}]\nvpmovzxbd zmm1, [{p}+16]\nvpmovzxbd zmm2, [{p}+32]\nvpmovzxbd zmm3, [{p}+48]\nvpmovzxbd zmm4, [{p}+64]\nvpmovzxbd zmm5, [{p}+80]\nvpmovzxbd zmm6, [{p}+96]\nvpmovzxbd zmm7, [{p}+112]")),
            r("vbroadcasti64x4 zmm, m256", 8, timed!("vbroadcasti64x4 zmm0, [{p}]\nvbroadcasti64x4 zmm1, [{p}+32]\nvbroadcasti64x4 zmm2, [{p}+64]\nvbroadcasti64x4 zmm3, [{p}+96]\nvbroadcasti64x4 zmm4, [{p}+128]\nvbroadcasti64x4 zmm5, [{p}+160]\nvbroadcasti64x4 zmm6, [{p}+192]\nvbroadcasti64x4 zmm7, [{p}+224]")),
            r("vpsrld imm", 8, timed!("vpsrld zmm0, zmm30, 4\nvpsrld zmm1, zmm30, 4\nvpsrld zmm2, zmm30, 4\nvpsrld zmm3, zmm30, 4\nvpsrld zmm4, zmm30, 4\nvpsrld zmm5, zmm30, 4\nvpsrld zmm6, zmm30, 4\nvpsrld zmm7, zmm30, 4")),
            r("vpsrlvd", 8, timed!("vpsrlvd zmm0, zmm30, zmm31\nvpsrlvd zmm1, zmm30, zmm31\nvpsrlvd zmm2, zmm30, zmm31\nvpsrlvd zmm3, zmm30, zmm31\nvpsrlvd zmm4, zmm30, zmm31\nvpsrlvd zmm5, zmm30, zmm31\nvpsrlvd zmm6, zmm30, zmm31\nvpsrlvd zmm7, zmm30, zmm31")),
            r("vpandd", 8, timed!("vpandd zmm0, zmm30, zmm31\nvpandd zmm1, zmm30, zmm31\nvpandd zmm2, zmm30, zmm31\nvpandd zmm3, zmm30, zmm31\nvpandd zmm4, zmm30, zmm31\nvpandd zmm5, zmm30, zmm31\nvpandd zmm6, zmm30, zmm31\nvpandd zmm7, zmm30, zmm31")),
            r("vfmadd231ps (8 chains)", 8, timed!("vfmadd231ps zmm0, zmm30, zmm31\nvfmadd231ps zmm1, zmm30, zmm31\nvfmadd231ps zmm2, zmm30, zmm31\nvfmadd231ps zmm3, zmm30, zmm31\nvfmadd231ps zmm4, zmm30, zmm31\nvfmadd231ps zmm5, zmm30, zmm31\nvfmadd231ps zmm6, zmm30, zmm31\nvfmadd231ps zmm7, zmm30, zmm31")),
            r("vcvtdq2ps", 8, timed!("vcvtdq2ps zmm0, zmm30\nvcvtdq2ps zmm1, zmm30\nvcvtdq2ps zmm2, zmm30\nvcvtdq2ps zmm3, zmm30\nvcvtdq2ps zmm4, zmm30\nvcvtdq2ps zmm5, zmm30\nvcvtdq2ps zmm6, zmm30\nvcvtdq2ps zmm7, zmm30")),
            // Pairs: 4 + 4, interleaved. A pair that takes as long as 8 of one kind shares
            // that kind's unit.
            r("vpermps + vpmovzxbd", 8, timed!("vpermps zmm0, zmm30, zmm31\nvpmovzxbd zmm8, [{p}]\nvpermps zmm1, zmm30, zmm31\nvpmovzxbd zmm9, [{p}+16]\nvpermps zmm2, zmm30, zmm31\nvpmovzxbd zmm10, [{p}+32]\nvpermps zmm3, zmm30, zmm31\nvpmovzxbd zmm11, [{p}+48]")),
            r("vpermps + vbroadcasti64x4", 8, timed!("vpermps zmm0, zmm30, zmm31\nvbroadcasti64x4 zmm8, [{p}]\nvpermps zmm1, zmm30, zmm31\nvbroadcasti64x4 zmm9, [{p}+32]\nvpermps zmm2, zmm30, zmm31\nvbroadcasti64x4 zmm10, [{p}+64]\nvpermps zmm3, zmm30, zmm31\nvbroadcasti64x4 zmm11, [{p}+96]")),
            r("vpermps + vpsrld", 8, timed!("vpermps zmm0, zmm30, zmm31\nvpsrld zmm8, zmm30, 4\nvpermps zmm1, zmm30, zmm31\nvpsrld zmm9, zmm30, 4\nvpermps zmm2, zmm30, zmm31\nvpsrld zmm10, zmm30, 4\nvpermps zmm3, zmm30, zmm31\nvpsrld zmm11, zmm30, 4")),
            r("vpermps + vpsrlvd", 8, timed!("vpermps zmm0, zmm30, zmm31\nvpsrlvd zmm8, zmm30, zmm31\nvpermps zmm1, zmm30, zmm31\nvpsrlvd zmm9, zmm30, zmm31\nvpermps zmm2, zmm30, zmm31\nvpsrlvd zmm10, zmm30, zmm31\nvpermps zmm3, zmm30, zmm31\nvpsrlvd zmm11, zmm30, zmm31")),
            r("vpermps + vfmadd231ps", 8, timed!("vpermps zmm0, zmm30, zmm31\nvfmadd231ps zmm8, zmm30, zmm31\nvpermps zmm1, zmm30, zmm31\nvfmadd231ps zmm9, zmm30, zmm31\nvpermps zmm2, zmm30, zmm31\nvfmadd231ps zmm10, zmm30, zmm31\nvpermps zmm3, zmm30, zmm31\nvfmadd231ps zmm11, zmm30, zmm31")),
            r("vpsrld + vfmadd231ps", 8, timed!("vpsrld zmm0, zmm30, 4\nvfmadd231ps zmm8, zmm30, zmm31\nvpsrld zmm1, zmm30, 4\nvfmadd231ps zmm9, zmm30, zmm31\nvpsrld zmm2, zmm30, 4\nvfmadd231ps zmm10, zmm30, zmm31\nvpsrld zmm3, zmm30, 4\nvfmadd231ps zmm11, zmm30, zmm31")),
            r("vpermps + vpsrld + vfmadd231ps", 12, timed!("vpermps zmm0, zmm30, zmm31\nvpsrld zmm8, zmm30, 4\nvfmadd231ps zmm16, zmm30, zmm31\nvpermps zmm1, zmm30, zmm31\nvpsrld zmm9, zmm30, 4\nvfmadd231ps zmm17, zmm30, zmm31\nvpermps zmm2, zmm30, zmm31\nvpsrld zmm10, zmm30, 4\nvfmadd231ps zmm18, zmm30, zmm31\nvpermps zmm3, zmm30, zmm31\nvpsrld zmm11, zmm30, 4\nvfmadd231ps zmm19, zmm30, zmm31")),
            // int4-g64 at S = 1, 128 weights of one row (zmm31: a table, zmm29/30: activations).
            // Kept: per 32 weights, widen 16 bytes to 16 lanes, shift, two table lookups, two
            // FMAs (12 of 24 operations on the permute unit).
            r("kept: vpmovzxbd, vpsrld, 2 vpermps, 2 FMA per 32", 24, timed!("vpmovzxbd zmm8, [{p}]\nvpsrld zmm9, zmm8, 4\nvpermps zmm10, zmm8, zmm31\nvpermps zmm11, zmm9, zmm31\nvfmadd231ps zmm0, zmm10, zmm30\nvfmadd231ps zmm1, zmm11, zmm29\nvpmovzxbd zmm12, [{p}+16]\nvpsrld zmm13, zmm12, 4\nvpermps zmm14, zmm12, zmm31\nvpermps zmm15, zmm13, zmm31\nvfmadd231ps zmm2, zmm14, zmm30\nvfmadd231ps zmm3, zmm15, zmm29\nvpmovzxbd zmm16, [{p}+32]\nvpsrld zmm17, zmm16, 4\nvpermps zmm18, zmm16, zmm31\nvpermps zmm19, zmm17, zmm31\nvfmadd231ps zmm4, zmm18, zmm30\nvfmadd231ps zmm5, zmm19, zmm29\nvpmovzxbd zmm20, [{p}+48]\nvpsrld zmm21, zmm20, 4\nvpermps zmm22, zmm20, zmm31\nvpermps zmm23, zmm21, zmm31\nvfmadd231ps zmm6, zmm22, zmm30\nvfmadd231ps zmm7, zmm23, zmm29")),
            // Per 64 weights, widen 32 bytes to 16 lanes of 4 nibbles (one group, one table).
            r("widen words: vpmovzxwd, 3 vpsrld, 4 vpermps, 4 FMA per 64", 24, timed!("vpmovzxwd zmm8, [{p}]\nvpsrld zmm9, zmm8, 4\nvpsrld zmm10, zmm8, 16\nvpsrld zmm11, zmm8, 20\nvpermps zmm12, zmm8, zmm31\nvpermps zmm13, zmm9, zmm31\nvpermps zmm14, zmm10, zmm31\nvpermps zmm15, zmm11, zmm31\nvfmadd231ps zmm0, zmm12, zmm30\nvfmadd231ps zmm1, zmm13, zmm29\nvfmadd231ps zmm2, zmm14, zmm30\nvfmadd231ps zmm3, zmm15, zmm29\nvpmovzxwd zmm16, [{p}+32]\nvpsrld zmm17, zmm16, 4\nvpsrld zmm18, zmm16, 16\nvpsrld zmm19, zmm16, 20\nvpermps zmm20, zmm16, zmm31\nvpermps zmm21, zmm17, zmm31\nvpermps zmm22, zmm18, zmm31\nvpermps zmm23, zmm19, zmm31\nvfmadd231ps zmm4, zmm20, zmm30\nvfmadd231ps zmm5, zmm21, zmm29\nvfmadd231ps zmm6, zmm22, zmm30\nvfmadd231ps zmm7, zmm23, zmm29")),
            // Plain 64-byte load, seven shifts, eight lookups: one table per 128 weights (a
            // repacked layout, or groups of ≥ 128); 8 of 24 operations on the permute unit.
            r("plain load: 7 vpsrld, 8 vpermps, 8 FMA per 128", 24, timed!("vmovdqu32 zmm8, [{p}]\nvpermps zmm16, zmm8, zmm31\nvfmadd231ps zmm0, zmm16, zmm30\nvpsrld zmm9, zmm8, 4\nvpermps zmm17, zmm9, zmm31\nvfmadd231ps zmm1, zmm17, zmm30\nvpsrld zmm10, zmm8, 8\nvpermps zmm18, zmm10, zmm31\nvfmadd231ps zmm2, zmm18, zmm30\nvpsrld zmm11, zmm8, 12\nvpermps zmm19, zmm11, zmm31\nvfmadd231ps zmm3, zmm19, zmm30\nvpsrld zmm12, zmm8, 16\nvpermps zmm20, zmm12, zmm31\nvfmadd231ps zmm4, zmm20, zmm30\nvpsrld zmm13, zmm8, 20\nvpermps zmm21, zmm13, zmm31\nvfmadd231ps zmm5, zmm21, zmm30\nvpsrld zmm14, zmm8, 24\nvpermps zmm22, zmm14, zmm31\nvfmadd231ps zmm6, zmm22, zmm30\nvpsrld zmm15, zmm8, 28\nvpermps zmm23, zmm15, zmm31\nvfmadd231ps zmm7, zmm23, zmm30")),
            // The same on today's layout: lanes 0-7 and 8-15 of a 64-byte load are two g64
            // groups, so each lookup needs both tables (`vpermi2ps`, the group in index bit 4,
            // set by one `vpternlogd` per even/odd nibble set).
            r("plain load, two tables: vpermi2ps per 16", 27, timed!("vmovdqu32 zmm8, [{p}]\nvmovdqa64 zmm9, zmm8\nvpternlogd zmm9, zmm25, zmm24, 0xEA\nvpsrld zmm10, zmm8, 4\nvpternlogd zmm10, zmm25, zmm24, 0xEA\nvpsrld zmm11, zmm9, 8\nvpsrld zmm12, zmm9, 16\nvpsrld zmm13, zmm9, 24\nvpsrld zmm14, zmm10, 8\nvpsrld zmm15, zmm10, 16\nvpsrld zmm16, zmm10, 24\nvpermi2ps zmm9, zmm26, zmm27\nvpermi2ps zmm10, zmm26, zmm27\nvpermi2ps zmm11, zmm26, zmm27\nvpermi2ps zmm12, zmm26, zmm27\nvpermi2ps zmm13, zmm26, zmm27\nvpermi2ps zmm14, zmm26, zmm27\nvpermi2ps zmm15, zmm26, zmm27\nvpermi2ps zmm16, zmm26, zmm27\nvfmadd231ps zmm0, zmm9, zmm30\nvfmadd231ps zmm1, zmm10, zmm30\nvfmadd231ps zmm2, zmm11, zmm30\nvfmadd231ps zmm3, zmm12, zmm30\nvfmadd231ps zmm4, zmm13, zmm30\nvfmadd231ps zmm5, zmm14, zmm30\nvfmadd231ps zmm6, zmm15, zmm30\nvfmadd231ps zmm7, zmm16, zmm30")),
        ]
    }

    pub fn main() {
        let c = cycle();
        println!("clock ~{:.2} GHz (dependent scalar adds)", 1e-9 / c);
        println!("| loop | operations | cycles per iteration | operations per cycle |");
        println!("|---|---|---|---|");
        let mut all: Vec<Vec<Row>> = (0..3).map(|_| rows()).collect();
        // Best of three passes for each row: interference only ever slows a loop down.
        for i in 0..all[0].len() {
            let best = all.iter().map(|r| r[i].seconds).fold(f64::MAX, f64::min);
            let row = &mut all[0][i];
            row.seconds = best;
            println!(
                "| {} | {} | {:.1} | {:.2} |",
                row.name,
                row.ops,
                row.seconds / c,
                row.ops as f64 * c / row.seconds
            );
        }
    }
}

#[cfg(all(target_arch = "x86_64", target_feature = "avx512f"))]
fn main() {
    probe::main();
}

#[cfg(not(all(target_arch = "x86_64", target_feature = "avx512f")))]
fn main() {
    eprintln!("an AVX-512 probe: build with -C target-cpu=native on an AVX-512 CPU");
}
