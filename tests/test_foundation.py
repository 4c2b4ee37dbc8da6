"""The Rust↔Python round trip: version, CPU features, and the error mapping."""

from __future__ import annotations

import errno
import json
import logging
import platform
import re
import shutil
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


def test_cargo_bench_needs_no_flag() -> None:
    """``cargo bench`` as users run it, with no ``--features``, runs the benches (kernels,
    expert store, model; one criterion binary): no bench target requires a feature, and
    scripts/test.sh lints them built without one."""
    cargo = tomllib.loads((ROOT / "Cargo.toml").read_text())
    benches = cargo.get("bench", [])
    assert [b["name"] for b in benches] == ["main"]
    assert all("required-features" not in b for b in benches)
    assert (ROOT / "benches" / "main.rs").is_file()
    assert "--benches" in (ROOT / "scripts" / "test.sh").read_text()


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


def _raise(kind: str, tmp: Path, model_dir: Path) -> None:
    """Make the engine raise an error of ``kind`` through a public call, the way a user
    meets it. (Every variant's class and fields, and a caught panic, are tested in Rust:
    src/python/errors.rs, src/python.rs.)"""
    if kind == "io":
        _core.Container(tmp / "no-model")
    elif kind == "config":
        (tmp / "config.json").write_text("{")
        _core.Container(tmp)
    elif kind == "container":
        shutil.copy(model_dir / "config.json", tmp / "config.json")
        header = json.dumps({"w": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}})
        shard = tmp / "model.safetensors"
        shard.write_bytes(len(header).to_bytes(8, "little") + header.encode() + bytes(8))
        _core.Container(tmp)
    else:
        _core.ConvertJob(tmp / "src", tmp / "dst", group_size=7)


def _fields(kind: str, tmp: Path) -> dict[str, object]:
    """The fields the error :func:`_raise` raises carries (the others are ``None``)."""
    return {
        "io": {"filename": str(tmp / "no-model" / "config.json"), "errno": errno.ENOENT},
        "config": {"filename": str(tmp / "config.json")},
        "container": {"filename": str(tmp / "model.safetensors"), "tensor": "w"},
        "invalid": {"param": "group_size"},
    }[kind]


_NONE = {"filename": None, "errno": None, "param": None, "tensor": None}


@pytest.mark.parametrize(
    ("kind", "cls", "builtin"),
    [
        ("io", colibri.ColibriFileNotFoundError, FileNotFoundError),
        ("config", colibri.ConfigError, ValueError),
        ("container", colibri.ContainerError, ValueError),
        ("invalid", colibri.InvalidArgumentError, ValueError),
    ],
)
def test_engine_errors_map_to_the_hierarchy_with_their_fields(
    kind: str, cls: type, builtin: type, tmp_path: Path, test_model_dir: Path
) -> None:
    with pytest.raises(cls) as info:
        _raise(kind, tmp_path, test_model_dir)
    assert isinstance(info.value, colibri.ColibriError)
    assert isinstance(info.value, builtin)
    assert str(info.value)
    want = {**_NONE, **_fields(kind, tmp_path)}
    got = {name: getattr(info.value, name) for name in want}
    assert got == want
    # The engine's message stands as it is (OSError would rewrite it once errno is set).
    assert not str(info.value).startswith("[Errno")


def test_the_shipped_module_has_no_test_hooks() -> None:
    """The tests run against the binary that ships, and it carries no test-only entry points
    (docs/development.md: what the API cannot reach is tested in Rust)."""
    assert [n for n in dir(_core) if n.startswith("_") and not n.startswith("__")] == []


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
