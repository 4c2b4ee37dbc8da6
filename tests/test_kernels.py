"""The kernel dispatch as Python sees it: the paths this machine can run, forcing one.

The kernels themselves are tested in Rust, every available path against float64 references:
``src/quant/kernels/tests.rs`` (against the scalar reference, S- and thread-invariance) and
``tests/kernel_layout.rs`` (weights packed by docs/container.md's layout, independently of
the crate's own quantiser)."""

from __future__ import annotations

import colibri
import pytest
from colibri import _core


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
