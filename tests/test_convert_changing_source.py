"""A source checkpoint that changes during a conversion or between its runs: never a silent
mix of old and new contents. A change while a shard is written is a ``ContainerError``
naming the file; a resume redoes (with a warning) every shard whose source bytes changed,
and ends equal to a fresh conversion of the source as it is then."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from colibri import _core
from colibri.convert import convert
from colibri.errors import ContainerError
from helpers.community import random_weights, tiny_config, write_hf_checkpoint

SHARD = 60_000  # max_shard_size: several output shards from each of the two source files
RECORD = ".colibri-convert.json"


def _source(tmp_path: Path) -> Path:
    cfg = tiny_config()
    src = tmp_path / "src"
    write_hf_checkpoint(src, cfg, random_weights(cfg, seed=21))
    hour_ago = time.time_ns() - 3600 * 10**9
    # Last changed an hour ago, so that a rewrite within one tick of the file clock after
    # the test wrote the file still changes its modification time.
    for p in src.glob("*.safetensors"):
        os.utime(p, ns=(hour_ago, hour_ago))
    return src


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name != RECORD}


def _fresh(src: Path, tmp_path: Path) -> dict[str, bytes]:
    """A conversion from scratch of ``src`` as it is now."""
    d = tmp_path / f"fresh{time.monotonic_ns()}"
    convert(src, d, progress=False, max_shard_size=SHARD)
    return _files(d)


def _data_start(path: Path) -> int:
    return 8 + int.from_bytes(path.read_bytes()[:8], "little")


def _first_source(src: Path) -> Path:
    return sorted(src.glob("*.safetensors"))[0]


def test_a_source_rewritten_between_an_interrupt_and_a_resume_is_converted_again(
    tmp_path: Path,
) -> None:
    src, dst = _source(tmp_path), tmp_path / "dst"
    job = _core.ConvertJob(str(src), str(dst), max_shard_bytes=SHARD)
    job.write_shard(0)
    job.write_shard(1)

    def interrupt(n: int) -> None:
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        job.write_shard(2, interrupt)
    del job
    # New values in place (same size, same inode), the modification time put back.
    path = _first_source(src)
    before = path.stat()
    data = bytearray(path.read_bytes())
    for k in range(_data_start(path), len(data), 2):
        data[k] ^= 0x5A  # the low byte of each BF16 value: still finite
    with path.open("r+b") as f:
        f.write(data)
    os.utime(path, ns=(before.st_atime_ns, before.st_mtime_ns))
    assert path.stat().st_mtime_ns == before.st_mtime_ns
    with pytest.warns(UserWarning, match=f"{path}.*changed since") as warned:
        report = convert(src, dst, progress=False, max_shard_size=SHARD)
    assert len(warned) == 2  # shards 0 and 1 came from the old contents
    assert report.shards_skipped == 0
    assert _files(dst) == _fresh(src, tmp_path)


def test_a_touched_source_keeps_its_shards(tmp_path: Path) -> None:
    src, dst = _source(tmp_path), tmp_path / "dst"
    job = _core.ConvertJob(str(src), str(dst), max_shard_bytes=SHARD)
    job.write_shard(0)
    for p in src.glob("*.safetensors"):
        p.touch()  # a new stamp, the same bytes: shard 0's source bytes are read and match
    assert job.status(0) == (True, None)
    report = convert(src, dst, progress=False, max_shard_size=SHARD)
    assert report.shards_skipped == 1
    assert _files(dst) == _fresh(src, tmp_path)


def test_a_zero_filled_copy_renamed_over_a_source_mid_run_is_an_error_naming_it(
    tmp_path: Path,
) -> None:
    src, dst = _source(tmp_path), tmp_path / "dst"
    path = _first_source(src)
    job = _core.ConvertJob(str(src), str(dst), max_shard_bytes=SHARD)
    name = job.shards()[0][0]
    calls = []

    def replace_source(n: int) -> None:
        calls.append(n)
        if len(calls) == 2:  # after the first tensor
            data = bytearray(path.read_bytes())
            start = _data_start(path)
            data[start:] = bytes(len(data) - start)
            (src / "new.tmp").write_bytes(data)
            os.replace(src / "new.tmp", path)

    with pytest.raises(ContainerError, match="changed while it was being converted") as e:
        job.write_shard(0, replace_source)
    assert e.value.filename == str(path)
    assert "inode" in str(e.value) and name in str(e.value)
    assert not job.is_done(0)
    assert not (dst / name).exists() and not (dst / f".{name}.partial").exists()
    # Run again: the new contents are converted.
    report = convert(src, dst, progress=False, max_shard_size=SHARD)
    assert report.shards_skipped == 0
    assert _files(dst) == _fresh(src, tmp_path)


def test_a_source_truncated_mid_run_names_the_file_and_the_offset(tmp_path: Path) -> None:
    src, dst = _source(tmp_path), tmp_path / "dst"
    path = _first_source(src)
    start, size = _data_start(path), path.stat().st_size
    job = _core.ConvertJob(str(src), str(dst), max_shard_bytes=SHARD)

    def truncate(n: int) -> None:
        os.truncate(path, start + 10)

    with pytest.raises(ContainerError, match="truncated while it was being converted") as e:
        job.write_shard(0, truncate)
    text = str(e.value)
    assert e.value.filename == str(path)
    assert e.value.tensor is not None
    assert f"at offset {start} " in text, text
    assert f"now has {start + 10}" in text and f"it had {size} when" in text, text
    assert "failed to fill whole buffer" not in text
