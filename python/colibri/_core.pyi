"""Type stubs for the compiled extension ``colibri._core`` (built from ``src/python.rs``)."""

__version__: str

def cpu_features() -> list[str]:
    """CPU features the kernels can dispatch on, e.g. ``["avx2", "fma", "avx512f"]``."""

def build_info() -> dict[str, object]:
    """Version, architecture and CPU features of this build."""

def _raise_for_test(kind: str) -> None:
    """Raise the engine error of ``kind`` (testing the error mapping only)."""
