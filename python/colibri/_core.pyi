"""Type stubs for the compiled extension ``colibri._core`` (built from ``src/python.rs``)."""

from collections.abc import Callable
from os import PathLike
from pathlib import Path

import numpy as np
import numpy.typing as npt

__version__: str

def cpu_features() -> list[str]:
    """CPU features the kernels can dispatch on, e.g. ``["avx2", "fma", "avx512f"]``."""

def build_info() -> dict[str, object]:
    """Version, architecture and CPU features of this build."""

def _raise_for_test(kind: str) -> None:
    """Raise the engine error of ``kind`` (testing the error mapping only)."""

# --- container reader and converter (src/python/container.rs) ---------------------------

class Container:
    """An opened model directory: shard headers parsed, shards mapped read-only."""

    def __init__(self, path: str | PathLike[str]) -> None: ...
    @property
    def dir(self) -> Path: ...
    @property
    def family(self) -> str: ...
    def names(self) -> list[str]: ...
    def __len__(self) -> int: ...
    def __contains__(self, name: str) -> bool: ...
    def info(self, name: str) -> dict[str, object]: ...
    def format(self, name: str) -> str | None: ...
    def expected_shape(self, name: str) -> tuple[int, int] | None: ...
    def dequantize(self, name: str) -> npt.NDArray[np.float32]: ...
    def vector(self, name: str) -> npt.NDArray[np.float32]: ...
    def raw(self, name: str) -> bytes: ...

class ConvertJob:
    """A planned conversion; see ``colibri.convert``."""

    def __init__(
        self,
        src: str | PathLike[str],
        dst: str | PathLike[str],
        *,
        expert_bits: int = 4,
        group_size: int = 64,
        dense_bits: int = 4,
        mtp_bits: int = 8,
        embed_bits: int = 8,
        lm_head_bits: int = 8,
        indexer_bits: int = 8,
        max_shard_bytes: int = ...,
        chunk_bytes: int = ...,
    ) -> None: ...
    def shards(self) -> list[tuple[str, int]]: ...
    def is_done(self, i: int) -> bool: ...
    def write_shard(self, i: int, progress: Callable[[int], object] | None = None) -> None: ...
    def finish(self) -> None: ...
    def format_counts(self) -> dict[str, int]: ...

def decode_fp8_e4m3(raw: npt.NDArray[np.uint8]) -> npt.NDArray[np.float32]:
    """FP8 e4m3fn bytes → float32."""

def dequant_fp8_blocks(
    raw: npt.NDArray[np.uint8],
    scale_inv: npt.NDArray[np.float32],
    block: tuple[int, int] = (128, 128),
) -> npt.NDArray[np.float32]:
    """w = fp8 · scale_inv[o/bo, i/bi] for an FP8 [O, I] weight."""
