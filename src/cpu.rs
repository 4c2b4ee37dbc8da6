//! CPU features the kernels dispatch on, detected once at run time (never at build time:
//! a wheel built with `target-cpu=native` would crash on older machines).

use std::sync::OnceLock;

/// What this CPU can run, as far as colibri's kernels care.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct CpuFeatures {
    pub avx2: bool,
    pub fma: bool,
    pub f16c: bool,
    pub avx512f: bool,
    pub avx512bw: bool,
    pub avx512vl: bool,
    pub avx512vnni: bool,
    pub avx512bf16: bool,
    pub neon: bool,
    /// An AMD CPU (`AuthenticAMD`): not a feature, but where the AVX-512 kernels prefetch
    /// their weights to (L2 on AMD; see `quant::kernels::avx512`).
    pub amd: bool,
}

impl CpuFeatures {
    fn detect() -> Self {
        #[cfg(target_arch = "x86_64")]
        {
            CpuFeatures {
                avx2: std::arch::is_x86_feature_detected!("avx2"),
                fma: std::arch::is_x86_feature_detected!("fma"),
                f16c: std::arch::is_x86_feature_detected!("f16c"),
                avx512f: std::arch::is_x86_feature_detected!("avx512f"),
                avx512bw: std::arch::is_x86_feature_detected!("avx512bw"),
                avx512vl: std::arch::is_x86_feature_detected!("avx512vl"),
                avx512vnni: std::arch::is_x86_feature_detected!("avx512vnni"),
                avx512bf16: std::arch::is_x86_feature_detected!("avx512bf16"),
                neon: false,
                amd: vendor_is_amd(),
            }
        }
        #[cfg(target_arch = "aarch64")]
        {
            CpuFeatures {
                neon: std::arch::is_aarch64_feature_detected!("neon"),
                ..Default::default()
            }
        }
        #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
        {
            CpuFeatures::default()
        }
    }

    /// Named features that are present, in a stable order (for logs and `build_info`).
    pub fn names(&self) -> Vec<&'static str> {
        let all = [
            ("avx2", self.avx2),
            ("fma", self.fma),
            ("f16c", self.f16c),
            ("avx512f", self.avx512f),
            ("avx512bw", self.avx512bw),
            ("avx512vl", self.avx512vl),
            ("avx512vnni", self.avx512vnni),
            ("avx512bf16", self.avx512bf16),
            ("neon", self.neon),
        ];
        all.iter().filter(|(_, on)| *on).map(|(n, _)| *n).collect()
    }
}

/// Whether CPUID's vendor string is `AuthenticAMD`.
#[cfg(target_arch = "x86_64")]
fn vendor_is_amd() -> bool {
    // `__cpuid` is a safe function in recent compilers and an unsafe one in older ones.
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaf 0 exists on every x86-64 CPU and has no side effects.
    let r = unsafe { std::arch::x86_64::__cpuid(0) };
    let mut vendor = [0u8; 12];
    for (dst, reg) in vendor.chunks_exact_mut(4).zip([r.ebx, r.edx, r.ecx]) {
        dst.copy_from_slice(&reg.to_le_bytes());
    }
    &vendor == b"AuthenticAMD"
}

/// The features of the running CPU (detected on first call, then cached).
pub fn features() -> CpuFeatures {
    static FEATURES: OnceLock<CpuFeatures> = OnceLock::new();
    *FEATURES.get_or_init(CpuFeatures::detect)
}

/// The target architecture this library was compiled for.
pub fn arch() -> &'static str {
    std::env::consts::ARCH
}

#[cfg(all(test, target_arch = "x86_64", target_os = "linux"))]
mod tests {
    /// The vendor read through CPUID is the one the kernel reports (`vendor_id` in
    /// /proc/cpuinfo), so the AMD-only prefetch choice follows the real CPU.
    #[test]
    fn amd_follows_the_vendor_the_kernel_reports() {
        let info = std::fs::read_to_string("/proc/cpuinfo").expect("/proc/cpuinfo");
        let vendor = info
            .lines()
            .find(|l| l.starts_with("vendor_id"))
            .expect("a vendor_id line");
        assert_eq!(
            super::features().amd,
            vendor.contains("AuthenticAMD"),
            "{vendor}"
        );
    }
}
