"""The Rust↔Python round trip: version, CPU features, and the error mapping."""

from __future__ import annotations

import platform
import re
from pathlib import Path

import colibri
import pytest
import tomllib
from colibri import _core

ROOT = Path(__file__).resolve().parents[1]


def test_version_is_single_sourced_with_cargo() -> None:
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    assert colibri.__version__ == cargo["package"]["version"]
    assert re.fullmatch(r"\d+\.\d+\.\d+.*", colibri.__version__)


def test_cpu_features_match_the_os_view() -> None:
    feats = set(_core.cpu_features())
    machine = platform.machine().lower()
    if machine in ("x86_64", "amd64"):
        flags = set()
        cpuinfo = Path("/proc/cpuinfo")
        if cpuinfo.exists():
            for line in cpuinfo.read_text().splitlines():
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
        if flags:
            assert ("avx2" in feats) == ("avx2" in flags)
            assert ("avx512f" in feats) == ("avx512f" in flags)
            assert ("fma" in feats) == ("fma" in flags)
        assert "neon" not in feats
    info = colibri.build_info()
    assert info["version"] == colibri.__version__
    assert info["cpu_features"] == _core.cpu_features()


@pytest.mark.parametrize(
    ("kind", "cls", "builtin"),
    [
        ("io", colibri.ColibriFileNotFoundError, FileNotFoundError),
        ("config", colibri.ConfigError, ValueError),
        ("container", colibri.ContainerError, ValueError),
        ("invalid", colibri.InvalidArgumentError, ValueError),
        ("panic", colibri.InternalError, RuntimeError),
    ],
)
def test_engine_errors_map_to_the_hierarchy(kind: str, cls: type, builtin: type) -> None:
    with pytest.raises(cls) as info:
        _core._raise_for_test(kind)
    assert isinstance(info.value, colibri.ColibriError)
    assert isinstance(info.value, builtin)
    assert str(info.value)


def test_a_panic_never_crosses_as_panic_exception() -> None:
    with pytest.raises(colibri.InternalError, match="deliberate test panic"):
        _core._raise_for_test("panic")


def test_cancel_maps_to_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt):
        _core._raise_for_test("cancelled")
