//! Measuring instruments of the benches, not kernels: a prefetching read (the memory limit the
//! kernels are held against) and the f32 FMA ceiling of a kernel path (the compute limit).
//! They live here rather than in the library because nothing but the benches runs them.

use colibri::quant::kernels::int8act::Int8Kernel;
use colibri::quant::kernels::KernelPath;

/// XOR of `words`, read with software prefetch 8 KiB ahead (one per cache line) where the
/// CPU has it: the read the memory-bandwidth benches time, prefetching as the kernels do, so
/// that the machine's limit is not understated by a read that waits on the hardware
/// prefetcher alone.
pub fn xor_prefetching(words: &[u64]) -> u64 {
    const AHEAD: usize = 8192 / 8;
    let mut acc = [0u64; 8];
    let lines = words.chunks_exact(8);
    let rest = lines.remainder().iter().fold(0, |a, &b| a ^ b);
    for (i, line) in lines.enumerate() {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: a prefetch never faults, whatever the address (hence `wrapping_add`); SSE is
        // part of x86-64.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                words.as_ptr().wrapping_add(i * 8 + AHEAD) as *const i8,
            )
        };
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (i, AHEAD);
        for (a, &v) in acc.iter_mut().zip(line) {
            *a ^= v;
        }
    }
    acc.iter().fold(rest, |a, &b| a ^ b)
}

/// Panics unless [`xor_prefetching`] is the XOR of every word at lengths around its 8-word
/// lines: run before anything is timed with it.
pub fn check_xor_prefetching() {
    for n in [0usize, 1, 7, 8, 9, 1000, 5000] {
        let words: Vec<u64> = (0..n as u64)
            .map(|i| i.wrapping_mul(0x9E37_79B9_7F4A_7C15))
            .collect();
        let want = words.iter().fold(0, |a, &b| a ^ b);
        assert_eq!(xor_prefetching(&words), want, "xor_prefetching, n {n}");
    }
}

/// The f32 FMA ceiling of `path` on this thread: runs `iters` rounds of independent vector
/// FMAs and returns (flops done, a value to keep the work alive). Benches divide the flops by
/// the time to put the kernels' S > 1 cost against the machine's compute limit. `None` for
/// paths without a probe (scalar, NEON) or that this CPU cannot run.
pub fn fma_peak(path: KernelPath, iters: usize, seed: f32) -> Option<(usize, f32)> {
    if !path.is_available() {
        return None;
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F is present (checked above).
        KernelPath::Avx512 => Some((iters * x86::FLOPS_PER_ITER_512, unsafe {
            x86::fma_peak_avx512(iters, seed)
        })),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 and FMA are present (checked above).
        KernelPath::Avx2 => Some((iters * x86::FLOPS_PER_ITER_256, unsafe {
            x86::fma_peak_avx2(iters, seed)
        })),
        _ => {
            let _ = (iters, seed);
            None
        }
    }
}

/// The int8 ceiling of `kernel` (`kernels::int8act`) on this thread: `iters` rounds of the
/// kernel's multiply-add instruction in independent chains — 512-bit `vpdpbusd` (64
/// multiply-adds) for VNNI, 256-bit `vpmaddubsw` plus the 16-bit add that accumulates it (32
/// multiply-adds) for AVX2 — and returns (integer ops done, counting a multiply-add as two
/// like the FMA probe, and a value to keep the work alive). `None` for the scalar reference
/// or a kernel this CPU cannot run.
pub fn int8_peak(kernel: Int8Kernel, iters: usize, seed: i32) -> Option<(usize, i32)> {
    if !kernel.available() {
        return None;
    }
    match kernel {
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512 F and VNNI are present (checked above).
        Int8Kernel::Vnni => Some((iters * x86::OPS_PER_ITER_VNNI, unsafe {
            x86::vnni_peak(iters, seed)
        })),
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX2 is present (checked above).
        Int8Kernel::Avx2 => Some((iters * x86::OPS_PER_ITER_MADDUBS, unsafe {
            x86::maddubs_peak(iters, seed)
        })),
        _ => {
            let _ = (iters, seed);
            None
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Independent FMA chains: 12 × 4 cycles of latency covers two FMA pipes.
    const CHAINS: usize = 12;
    /// Flops per iteration of [`fma_peak_avx2`] (8 lanes, multiply and add).
    pub const FLOPS_PER_ITER_256: usize = CHAINS * 2 * 8;
    /// Flops per iteration of [`fma_peak_avx512`] (16 lanes).
    pub const FLOPS_PER_ITER_512: usize = CHAINS * 2 * 16;
    /// Integer ops per iteration of [`vnni_peak`] (64 multiply-adds per instruction).
    pub const OPS_PER_ITER_VNNI: usize = CHAINS * 2 * 64;
    /// Integer ops per iteration of [`maddubs_peak`] (32 multiply-adds per instruction).
    pub const OPS_PER_ITER_MADDUBS: usize = CHAINS * 2 * 32;

    /// `iters` rounds of [`CHAINS`] independent 256-bit `vpmaddubsw` + `vpaddw` (the AVX2
    /// int8 kernel's inner pair; the 16-bit sums wrap, which the ceiling does not care about).
    /// Each chain's accumulator is also the multiply's unsigned operand: with two constant
    /// operands the compiler hoists `vpmaddubsw` out of the loop and only the adds are timed
    /// (the first version of this probe reported 2.4 TOP/s on a 2-core Zen 3 that way).
    ///
    /// # Safety
    /// The CPU supports AVX2.
    #[target_feature(enable = "avx2")]
    pub unsafe fn maddubs_peak(iters: usize, seed: i32) -> i32 {
        let mut acc = [_mm256_set1_epi16(seed as i16); CHAINS];
        let b = _mm256_set1_epi8(-2);
        for _ in 0..iters {
            for c in acc.iter_mut() {
                *c = _mm256_add_epi16(*c, _mm256_maddubs_epi16(*c, b));
            }
        }
        let mut sum = _mm256_setzero_si256();
        for c in acc {
            sum = _mm256_add_epi16(sum, c);
        }
        let mut out = [0i16; 16];
        // SAFETY: `out` holds 16 i16 lanes.
        unsafe { _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, sum) };
        out.iter().map(|&v| v as i32).sum()
    }

    /// `iters` rounds of [`CHAINS`] independent 512-bit `vpdpbusd`.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F and VNNI.
    #[target_feature(enable = "avx512f,avx512vnni")]
    pub unsafe fn vnni_peak(iters: usize, seed: i32) -> i32 {
        let mut acc = [_mm512_set1_epi32(seed); CHAINS];
        let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
        for _ in 0..iters {
            for c in acc.iter_mut() {
                *c = _mm512_dpbusd_epi32(*c, a, b);
            }
        }
        let mut sum = _mm512_setzero_si512();
        for c in acc {
            sum = _mm512_add_epi32(sum, c);
        }
        _mm512_reduce_add_epi32(sum)
    }

    /// `iters` rounds of [`CHAINS`] independent 8-lane FMAs.
    ///
    /// # Safety
    /// The CPU supports AVX2 and FMA.
    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn fma_peak_avx2(iters: usize, seed: f32) -> f32 {
        let mut acc = [_mm256_set1_ps(seed); CHAINS];
        let (a, b) = (_mm256_set1_ps(0.999_99), _mm256_set1_ps(1e-7));
        for _ in 0..iters {
            for c in acc.iter_mut() {
                *c = _mm256_fmadd_ps(*c, a, b);
            }
        }
        let mut out = [0.0f32; 8];
        let mut sum = _mm256_setzero_ps();
        for c in acc {
            sum = _mm256_add_ps(sum, c);
        }
        // SAFETY: `out` holds 8 floats.
        unsafe { _mm256_storeu_ps(out.as_mut_ptr(), sum) };
        out.iter().sum()
    }

    /// `iters` rounds of [`CHAINS`] independent 16-lane FMAs.
    ///
    /// # Safety
    /// The CPU supports AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub unsafe fn fma_peak_avx512(iters: usize, seed: f32) -> f32 {
        let mut acc = [_mm512_set1_ps(seed); CHAINS];
        let (a, b) = (_mm512_set1_ps(0.999_99), _mm512_set1_ps(1e-7));
        for _ in 0..iters {
            for c in acc.iter_mut() {
                *c = _mm512_fmadd_ps(*c, a, b);
            }
        }
        let mut sum = _mm512_setzero_ps();
        for c in acc {
            sum = _mm512_add_ps(sum, c);
        }
        _mm512_reduce_add_ps(sum)
    }
}
