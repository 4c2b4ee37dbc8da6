//! Which implementation of the kernels runs: the paths, what each needs of the CPU, and the
//! choice among them (forced by [`set_forced_path`], else `COLIBRI_KERNEL`, else detected).

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::OnceLock;

use crate::error::{Error, Result};
/// One implementation of the kernels.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelPath {
    /// The reference: dequantise a row, then one sequential dot product per activation row.
    Scalar,
    /// x86-64 AVX2 + FMA (+ F16C for f16 weights).
    Avx2,
    /// x86-64 AVX-512 F + BW.
    Avx512,
    /// aarch64 Advanced SIMD.
    Neon,
}

impl KernelPath {
    /// Every path, in order of preference from least to most specialised.
    pub const ALL: [KernelPath; 4] = [
        KernelPath::Scalar,
        KernelPath::Avx2,
        KernelPath::Avx512,
        KernelPath::Neon,
    ];

    /// The name used by `COLIBRI_KERNEL` and the Python binding.
    pub fn name(self) -> &'static str {
        match self {
            KernelPath::Scalar => "scalar",
            KernelPath::Avx2 => "avx2",
            KernelPath::Avx512 => "avx512",
            KernelPath::Neon => "neon",
        }
    }

    /// Parse a name produced by [`KernelPath::name`].
    pub fn parse(name: &str) -> Result<Self> {
        KernelPath::ALL
            .into_iter()
            .find(|p| p.name() == name.trim().to_ascii_lowercase())
            .ok_or_else(|| {
                Error::invalid(
                    "kernel path",
                    format!("unknown kernel path '{name}'; expected scalar, avx2, avx512 or neon"),
                )
            })
    }

    /// Whether this build runs on a CPU that has every feature the path needs.
    pub fn is_available(self) -> bool {
        let f = crate::cpu::features();
        match self {
            KernelPath::Scalar => true,
            KernelPath::Avx2 => cfg!(target_arch = "x86_64") && f.avx2 && f.fma && f.f16c,
            KernelPath::Avx512 => cfg!(target_arch = "x86_64") && f.avx512f && f.avx512bw,
            KernelPath::Neon => cfg!(target_arch = "aarch64") && f.neon,
        }
    }

    /// The paths this machine can run.
    pub fn available() -> Vec<KernelPath> {
        KernelPath::ALL
            .into_iter()
            .filter(|p| p.is_available())
            .collect()
    }

    /// The fastest available path.
    pub fn best() -> KernelPath {
        [KernelPath::Avx512, KernelPath::Avx2, KernelPath::Neon]
            .into_iter()
            .find(|p| p.is_available())
            .unwrap_or(KernelPath::Scalar)
    }

    fn code(self) -> u8 {
        match self {
            KernelPath::Scalar => 1,
            KernelPath::Avx2 => 2,
            KernelPath::Avx512 => 3,
            KernelPath::Neon => 4,
        }
    }

    fn from_code(code: u8) -> Option<Self> {
        KernelPath::ALL.into_iter().find(|p| p.code() == code)
    }

    pub(super) fn require(self) -> Result<Self> {
        if self.is_available() {
            Ok(self)
        } else {
            Err(Error::invalid("kernel path", self.unavailable()))
        }
    }

    /// Why this path cannot run here.
    fn unavailable(self) -> String {
        format!(
            "kernel path '{}' needs CPU features this machine ({}, features [{}]) lacks; \
             available: {}",
            self.name(),
            crate::cpu::arch(),
            crate::cpu::features().names().join(", "),
            KernelPath::available()
                .iter()
                .map(|p| p.name())
                .collect::<Vec<_>>()
                .join(", ")
        )
    }
}

impl std::fmt::Display for KernelPath {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The path forced by [`set_forced_path`] (0 = none).
static FORCED: AtomicU8 = AtomicU8::new(0);

/// Parse an override value of `COLIBRI_KERNEL`: unset or empty means auto-detect.
pub(super) fn parse_override(
    value: Option<&str>,
) -> std::result::Result<Option<KernelPath>, String> {
    match value.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) => {
            let p = KernelPath::ALL
                .into_iter()
                .find(|p| p.name() == v.to_ascii_lowercase())
                .ok_or_else(|| {
                    format!("unknown kernel path '{v}'; expected scalar, avx2, avx512 or neon")
                })?;
            if p.is_available() {
                Ok(Some(p))
            } else {
                Err(p.unavailable())
            }
        }
    }
}

/// `COLIBRI_KERNEL`, read once.
fn env_override() -> &'static std::result::Result<Option<KernelPath>, String> {
    static ENV: OnceLock<std::result::Result<Option<KernelPath>, String>> = OnceLock::new();
    ENV.get_or_init(|| parse_override(std::env::var("COLIBRI_KERNEL").ok().as_deref()))
}

/// The auto-detected path, detected once.
fn detected() -> KernelPath {
    static BEST: OnceLock<KernelPath> = OnceLock::new();
    *BEST.get_or_init(KernelPath::best)
}

/// The path [`matmul`](super::matmul) and [`expert_ffn`](super::expert_ffn) use now: the
/// forced one, else `COLIBRI_KERNEL`, else the detected one. An invalid `COLIBRI_KERNEL` is an
/// error here (and so for every call).
pub fn active_path() -> Result<KernelPath> {
    if let Some(p) = KernelPath::from_code(FORCED.load(Ordering::Relaxed)) {
        return Ok(p);
    }
    match env_override() {
        Ok(Some(p)) => Ok(*p),
        Ok(None) => Ok(detected()),
        Err(msg) => Err(Error::invalid("COLIBRI_KERNEL", msg.clone())),
    }
}

/// The path calls use now (see [`active_path`]); when `COLIBRI_KERNEL` is invalid, calls fail
/// and this reports the auto-detected path.
pub fn selected_path() -> KernelPath {
    active_path().unwrap_or_else(|_| detected())
}

/// Force every later call onto `path` (`None` returns to `COLIBRI_KERNEL` / auto-detection).
/// Forcing a path this CPU cannot run is an error and changes nothing. Process-wide.
pub fn set_forced_path(path: Option<KernelPath>) -> Result<()> {
    let code = match path {
        Some(p) => p.require()?.code(),
        None => 0,
    };
    FORCED.store(code, Ordering::Relaxed);
    Ok(())
}
