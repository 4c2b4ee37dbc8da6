"""The dequant-matmul kernels, every available path, against an independent numpy float64
reference built from docs/container.md (formats, nibble order, scales)."""

from __future__ import annotations

import colibri
import numpy as np
import numpy.typing as npt
import pytest
from colibri import _core

FORMATS = ["f32", "bf16", "f16", "int8", "int4"] + [
    f"int4_g{gs}" for gs in (16, 32, 48, 64, 96, 128, 192, 256)
]


def pack(
    fmt: str, rows: int, cols: int, rng: np.random.Generator
) -> tuple[npt.NDArray[np.uint8], npt.NDArray[np.float32], npt.NDArray[np.float32]]:
    """Random packed weight bytes and scales in ``fmt``, plus their exact f32 values."""
    w32 = rng.uniform(-1, 1, size=(rows, cols)).astype(np.float32)
    if fmt == "f32":
        return w32.view(np.uint8).ravel(), np.zeros(0, np.float32), w32
    if fmt == "bf16":
        hi = (w32.view(np.uint32) >> 16).astype(np.uint16)
        exact = (hi.astype(np.uint32) << 16).view(np.float32)
        return hi.view(np.uint8).ravel(), np.zeros(0, np.float32), exact
    if fmt == "f16":
        h = w32.astype(np.float16)
        return h.view(np.uint8).ravel(), np.zeros(0, np.float32), h.astype(np.float32)
    if fmt == "int8":
        q = rng.integers(-128, 128, size=(rows, cols)).astype(np.int8)
        s = rng.uniform(0.001, 0.02, size=rows).astype(np.float32)
        return q.view(np.uint8).ravel(), s, q.astype(np.float32) * s[:, None]
    # int4: element 2j is the low nibble of byte j, 2j+1 the high one; w = (nibble - 8) * s.
    gs = cols if fmt == "int4" else int(fmt.removeprefix("int4_g"))
    nb = (cols + 1) // 2
    raw = rng.integers(0, 256, size=(rows, nb)).astype(np.uint8)
    nib = np.empty((rows, 2 * nb), np.int32)
    nib[:, 0::2] = raw & 0x0F
    nib[:, 1::2] = raw >> 4
    q = nib[:, :cols] - 8
    ngroups = -(-cols // gs)
    s = rng.uniform(0.001, 0.02, size=(rows, ngroups)).astype(np.float32)
    exact = q.astype(np.float32) * s[:, np.arange(cols) // gs]
    return raw.ravel(), s.ravel(), exact


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize(("rows", "cols"), [(1, 1), (3, 17), (5, 100), (4, 255), (2, 1030)])
def test_every_path_matches_numpy_f64(fmt: str, rows: int, cols: int) -> None:
    rng = np.random.default_rng(rows * 1000 + cols)
    data, scales, w = pack(fmt, rows, cols, rng)
    s = 9
    x = rng.uniform(-2, 2, size=(s, cols)).astype(np.float32)
    want = x.astype(np.float64) @ w.astype(np.float64).T
    mag = np.abs(x.astype(np.float64)) @ np.abs(w.astype(np.float64)).T
    for path in _core.kernel_paths():
        y = _core._matmul(fmt, rows, cols, data, scales, x, path=path)
        assert y.shape == (s, rows) and y.dtype == np.float32
        err = np.abs(y.astype(np.float64) - want)
        assert np.all(err <= 1e-5 * mag + 1e-30), (path, float(err.max()))
        # Row t of the 9-row call equals the 1-row call bit for bit; threads change nothing.
        for t in range(s):
            one = _core._matmul(fmt, rows, cols, data, scales, x[t : t + 1], path=path)
            assert one.tobytes() == y[t : t + 1].tobytes(), (path, t)
        y2 = _core._matmul(fmt, rows, cols, data, scales, x, path=path, threads=2)
        assert y2.tobytes() == y.tobytes(), path


def test_paths_and_forcing() -> None:
    paths = _core.kernel_paths()
    assert "scalar" in paths
    assert _core.kernel_path() in paths
    with pytest.raises(colibri.InvalidArgumentError):
        _core.set_kernel_path("sse9")
    missing = [p for p in ("avx2", "avx512", "neon") if p not in paths]
    assert missing, "no CPU has both the x86 paths and NEON"
    before = _core.kernel_path()
    with pytest.raises(colibri.InvalidArgumentError, match=missing[0]):
        _core.set_kernel_path(missing[0])
    assert _core.kernel_path() == before
    _core.set_kernel_path(before)
    assert _core.kernel_path() == before
    _core.set_kernel_path(None)
    assert _core.kernel_path() == before


def test_bad_shapes_raise() -> None:
    data = np.zeros(6, np.uint8)
    scales = np.ones(3, np.float32)
    x = np.zeros((2, 4), np.float32)
    with pytest.raises(colibri.InvalidArgumentError):
        _core._matmul("int8", 3, 2, data, scales, x)
    with pytest.raises(colibri.InvalidArgumentError):
        _core._matmul("int8", 3, 3, data, scales, np.zeros((2, 2), np.float32))
    with pytest.raises(colibri.InvalidArgumentError):
        _core._matmul("q4_0", 3, 2, data, scales, np.zeros((2, 2), np.float32))
