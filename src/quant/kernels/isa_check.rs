//! The kernels' CPU requirements restated for tests and CI, apart from the detection the
//! kernels dispatch on (`crate::cpu`), so that a test of a SIMD kernel cannot pass by skipping
//! it. [`runs_path`] and [`runs_int8`] tell a test whether to exercise a kernel; they panic
//! instead of returning false when
//! - std's own detection (`is_x86_feature_detected!`) and the crate disagree about whether the
//!   kernel can run here (a broken detection would otherwise skip the kernel's tests), or
//! - [`REQUIRE_ENV`] (comma-separated feature or kernel names, e.g. `avx2,avx512vnni`) names a
//!   feature this CPU lacks, a kernel that cannot run, or every feature of a kernel that
//!   cannot run (CI sets it from the host's flags, `scripts/test.sh`).

use super::int8act::Int8Kernel;
use super::KernelPath;

/// Features or kernels that must run on this host; unset or empty requires nothing.
pub const REQUIRE_ENV: &str = "COLIBRI_REQUIRE_ISA";

/// The features some kernel needs, by std's names.
pub const FEATURES: [&str; 8] = [
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512vl",
    "avx512vnni",
    "neon",
];

/// Whether std detects `feature` (one of [`FEATURES`]) on this CPU.
pub fn std_detects(feature: &str) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::is_x86_feature_detected as has;
        match feature {
            "avx2" => has!("avx2"),
            "fma" => has!("fma"),
            "f16c" => has!("f16c"),
            "avx512f" => has!("avx512f"),
            "avx512bw" => has!("avx512bw"),
            "avx512vl" => has!("avx512vl"),
            "avx512vnni" => has!("avx512vnni"),
            _ => false,
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        feature == "neon" && std::arch::is_aarch64_feature_detected!("neon")
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        let _ = feature;
        false
    }
}

/// What an exact kernel path needs of the CPU.
pub fn path_features(path: KernelPath) -> &'static [&'static str] {
    match path {
        KernelPath::Scalar => &[],
        KernelPath::Avx2 => &["avx2", "fma", "f16c"],
        KernelPath::Avx512 => &["avx512f", "avx512bw"],
        KernelPath::Neon => &["neon"],
    }
}

/// What an int8 kernel needs of the CPU.
pub fn int8_features(kernel: Int8Kernel) -> &'static [&'static str] {
    match kernel {
        Int8Kernel::Reference => &[],
        Int8Kernel::Avx2 => &["avx2", "fma"],
        Int8Kernel::Vnni => &["avx512f", "avx512bw", "avx512vl", "avx512vnni"],
    }
}

/// A name as [`REQUIRE_ENV`] compares it: `avx512_vnni`, `AVX512-VNNI` and `avx512vnni` alike.
fn normalize(name: &str) -> String {
    name.trim()
        .to_ascii_lowercase()
        .chars()
        .filter(|c| *c != '_' && *c != '-')
        .collect()
}

/// One kernel as the checks see it.
struct Kernel {
    /// For messages: `path avx2`, `int8 avx512-vnni`.
    label: String,
    name: &'static str,
    needs: &'static [&'static str],
    /// What the crate says.
    available: bool,
}

fn path_entry(path: KernelPath) -> Kernel {
    Kernel {
        label: format!("path {}", path.name()),
        name: path.name(),
        needs: path_features(path),
        available: path.is_available(),
    }
}

fn int8_entry(kernel: Int8Kernel) -> Kernel {
    Kernel {
        label: format!("int8 {}", kernel.name()),
        name: kernel.name(),
        needs: int8_features(kernel),
        available: kernel.available(),
    }
}

fn kernels() -> Vec<Kernel> {
    let int8 = [Int8Kernel::Reference, Int8Kernel::Avx2, Int8Kernel::Vnni];
    KernelPath::ALL
        .into_iter()
        .map(path_entry)
        .chain(int8.into_iter().map(int8_entry))
        .collect()
}

/// [`REQUIRE_ENV`]'s names, normalised; an unknown name panics (a typo would require nothing).
pub fn required() -> Vec<String> {
    let Ok(value) = std::env::var(REQUIRE_ENV) else {
        return Vec::new();
    };
    let known: Vec<String> = FEATURES
        .iter()
        .copied()
        .chain(kernels().iter().map(|k| k.name))
        .map(normalize)
        .collect();
    let names: Vec<String> = value
        .split(',')
        .map(normalize)
        .filter(|n| !n.is_empty())
        .collect();
    for n in &names {
        assert!(
            known.contains(n),
            "{REQUIRE_ENV}={value}: '{n}' is neither a feature the kernels need ({}) nor a \
             kernel name",
            FEATURES.join(", ")
        );
    }
    names
}

/// Run the checks for `k`; returns whether its tests should run (saying so on stderr when
/// not and `announce`).
fn check(k: &Kernel, announce: bool) -> bool {
    let missing: Vec<&str> = k
        .needs
        .iter()
        .copied()
        .filter(|f| !std_detects(f))
        .collect();
    assert_eq!(
        k.available,
        missing.is_empty(),
        "{}: the crate says available = {}, but std detects {:?} as missing {:?}",
        k.label,
        k.available,
        k.needs,
        missing
    );
    let required = required();
    for n in &required {
        if FEATURES.iter().any(|f| normalize(f) == *n) {
            assert!(
                std_detects(n),
                "{REQUIRE_ENV} names {n}, which std does not detect on this CPU"
            );
        }
    }
    let named = required.contains(&normalize(k.name));
    let all_needs_named =
        !k.needs.is_empty() && k.needs.iter().all(|f| required.contains(&normalize(f)));
    assert!(
        k.available || !(named || all_needs_named),
        "{REQUIRE_ENV} requires {}, which cannot run here (missing {missing:?})",
        k.label
    );
    if !k.available && announce {
        eprintln!("skipping {}: this CPU lacks {missing:?}", k.label);
    }
    k.available
}

/// Whether a test should exercise `path` (see the module docs for when this panics).
pub fn runs_path(path: KernelPath) -> bool {
    check(&path_entry(path), true)
}

/// Whether a test should exercise the int8 `kernel` (see the module docs).
pub fn runs_int8(kernel: Int8Kernel) -> bool {
    check(&int8_entry(kernel), true)
}

/// The exact paths a test should run: every one this CPU has, each checked.
pub fn paths() -> Vec<KernelPath> {
    KernelPath::ALL
        .into_iter()
        .filter(|p| runs_path(*p))
        .collect()
}

/// The SIMD int8 kernels a test should run, each checked.
pub fn simd_int8_kernels() -> Vec<Int8Kernel> {
    [Int8Kernel::Avx2, Int8Kernel::Vnni]
        .into_iter()
        .filter(|k| runs_int8(*k))
        .collect()
}

/// What this host runs, for a CI log: std's and the crate's feature detection, every kernel
/// (needs, available, required), and the paths calls select. Runs every check.
pub fn report() -> String {
    let std_has: Vec<&str> = FEATURES
        .iter()
        .copied()
        .filter(|f| std_detects(f))
        .collect();
    let mut out = format!(
        "arch {}; std detects [{}]; the crate detects [{}]\n{REQUIRE_ENV} = [{}]\n",
        crate::cpu::arch(),
        std_has.join(", "),
        crate::cpu::features().names().join(", "),
        required().join(", ")
    );
    for k in kernels() {
        let runs = check(&k, false);
        out += &format!(
            "  {:<18} needs [{}]: {}\n",
            k.label,
            k.needs.join(", "),
            if runs { "runs" } else { "not on this CPU" }
        );
    }
    let int8 = super::int8_kernel().map_or_else(|e| e.to_string(), |k| k.name().to_string());
    out += &format!(
        "selected: exact path {}, int8 kernel {int8}\n",
        super::selected_path()
    );
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Prints what this host runs (`scripts/test.sh` shows it with `--nocapture`) and checks
    /// every kernel against std's detection and the required list.
    #[test]
    fn report_the_isa_paths_this_host_runs() {
        println!("{}", report());
    }

    #[test]
    fn names_compare_without_case_dashes_or_underscores() {
        assert_eq!(normalize(" AVX512_VNNI "), "avx512vnni");
        assert_eq!(normalize("avx512-vnni"), normalize(Int8Kernel::Vnni.name()));
        assert_eq!(normalize("avx512vnni"), normalize("avx512vnni"));
    }

    /// Every feature a kernel needs is one the checks know and std can be asked about.
    #[test]
    fn every_needed_feature_is_known() {
        for k in kernels() {
            for f in k.needs {
                assert!(FEATURES.contains(f), "{}: {f}", k.label);
            }
        }
    }
}
