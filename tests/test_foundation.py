"""The Rust↔Python round trip: version, CPU features, and the error mapping."""

from __future__ import annotations

import errno
import logging
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


@pytest.mark.parametrize(
    ("kind", "attrs"),
    [
        ("io", {"filename": "/nonexistent", "errno": errno.ENOENT, "param": None, "tensor": None}),
        ("config", {"filename": "config.json", "errno": None, "param": None, "tensor": None}),
        ("container", {"filename": "a.safetensors", "errno": None, "param": None, "tensor": "w"}),
        ("invalid", {"filename": None, "errno": None, "param": "temperature", "tensor": None}),
        ("panic", {"filename": None, "errno": None, "param": None, "tensor": None}),
    ],
)
def test_engine_errors_carry_their_fields(kind: str, attrs: dict[str, object]) -> None:
    with pytest.raises(colibri.ColibriError) as info:
        _core._raise_for_test(kind)
    got = {name: getattr(info.value, name) for name in attrs}
    assert got == attrs
    # The engine's message stands as it is (OSError would rewrite it once errno is set).
    assert not str(info.value).startswith("[Errno")


def test_a_real_io_error_names_file_and_errno(tmp_path: Path) -> None:
    missing = tmp_path / "no-model"
    with pytest.raises(colibri.ColibriFileNotFoundError) as info:
        _core.Container(str(missing))
    assert info.value.errno == errno.ENOENT
    assert info.value.filename is not None and str(missing) in info.value.filename
    assert str(missing) in str(info.value)


def test_a_bad_argument_names_its_param(tmp_path: Path) -> None:
    with pytest.raises(colibri.InvalidArgumentError) as info:
        _core.ConvertJob(tmp_path / "src", tmp_path / "dst", group_size=7)
    assert info.value.param == "group_size"
    assert info.value.filename is None and info.value.tensor is None


def test_a_panic_never_crosses_as_panic_exception() -> None:
    with pytest.raises(colibri.InternalError, match="deliberate test panic"):
        _core._raise_for_test("panic")


def test_cancel_maps_to_keyboard_interrupt() -> None:
    with pytest.raises(KeyboardInterrupt):
        _core._raise_for_test("cancelled")


def test_engine_warnings_reach_the_colibri_logger(
    tmp_path: Path, test_model_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A routing history that cannot be read is a warning, logged to ``colibri`` (not
    printed to stderr) by the call that opened the model."""
    cache = tmp_path / "cache"
    first = colibri.Model(test_model_dir, cache_dir=cache)
    history = first.usage_path
    assert history is not None
    first.close()
    history.parent.mkdir(parents=True, exist_ok=True)
    history.write_text("{not json")
    with caplog.at_level(logging.WARNING, logger="colibri"):
        colibri.Model(test_model_dir, cache_dir=cache).close()
    got = [r for r in caplog.records if r.name == "colibri" and str(history) in r.getMessage()]
    assert got, [r.getMessage() for r in caplog.records]
