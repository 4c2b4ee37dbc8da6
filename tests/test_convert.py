"""The converter end to end: synthetic BF16 and FP8 checkpoints (written by
``tests/helpers``, independently of colibri) convert into containers whose formats follow
docs/container.md per tensor role and whose bytes match an independent numpy quantiser."""

from __future__ import annotations

import itertools
import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from colibri import _core
from colibri.cli import main as cli_main
from colibri.convert import convert
from colibri.errors import InvalidArgumentError, NonFiniteWeightError, UnsupportedModelError
from helpers.community import (
    bf16_bytes,
    group_scale_bound,
    quantize,
    random_weights,
    tiny_config,
    write_hf_checkpoint,
    write_raw_safetensors,
)

RECORD = ".colibri-convert.json"  # the progress record in DST


def expected_format(name: str, n_layers: int) -> str:
    """defaults of docs/container.md, restated from the tensor name."""
    if name.endswith("mlp.gate.weight"):
        return "f32"
    if f"layers.{n_layers}." in name:  # the MTP layer
        return "int8"
    if "embed_tokens" in name or "lm_head" in name:
        return "int8"
    return "int4_g64"


def check_container(dst: Path, decoded: dict[str, np.ndarray], n_layers: int) -> None:
    c = _core.Container(str(dst))
    for name, w in decoded.items():
        if w.ndim == 1:
            assert c.info(name)["dtype"] == "F32", name
            np.testing.assert_array_equal(c.vector(name), w)
            continue
        fmt = expected_format(name, n_layers)
        assert c.format(name) == fmt, name
        got = c.dequantize(name)
        if fmt == "f32":
            np.testing.assert_array_equal(got, w)
            continue
        # Bit-exact with the independent numpy quantiser of docs/container.md …
        data, scales = quantize(w, fmt)
        assert c.raw(name) == data.tobytes(), name
        assert c.raw(name + ".qs") == scales.astype("<f4").tobytes(), name
        # … and therefore within half a step of the source weights.
        assert np.all(np.abs(got - w) <= group_scale_bound(scales, w.shape, fmt) * 1.0001), name


def test_bf16_checkpoint(tmp_path: Path) -> None:
    cfg = tiny_config()
    decoded = write_hf_checkpoint(tmp_path / "src", cfg, random_weights(cfg, seed=2))
    report = convert(tmp_path / "src", tmp_path / "dst", progress=False, max_shard_size=60_000)
    assert report.shards_written >= 2 and report.shards_skipped == 0
    assert report.formats["int8"] > 0 and report.formats["int4_g64"] > 0
    check_container(tmp_path / "dst", decoded, cfg["num_hidden_layers"])
    for f in ("tokenizer_config.json", "generation_config.json"):
        assert (tmp_path / "dst" / f).read_text() == (tmp_path / "src" / f).read_text()
    # Experts: gate, up, down (each with its scales) back to back in one file.
    c = _core.Container(str(tmp_path / "dst"))
    for e in range(cfg["n_routed_experts"]):
        infos = [
            c.info(f"model.layers.1.mlp.experts.{e}.{p}.weight{s}")
            for p in ("gate_proj", "up_proj", "down_proj")
            for s in ("", ".qs")
        ]
        assert len({i["file"] for i in infos}) == 1
        assert all(a["end"] == b["start"] for a, b in itertools.pairwise(infos))


def test_convert_copies_only_what_a_container_needs(tmp_path: Path) -> None:
    """The tokenizer, generation config and chat template files travel with the weights; a
    source's routing history (state of another model), README, notes, numpy dumps and the
    like do not."""
    cfg = tiny_config()
    src = tmp_path / "src"
    write_hf_checkpoint(src, cfg, random_weights(cfg, seed=3))
    wanted = [
        "tokenizer.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "LICENSE",
    ]
    unwanted = ["colibri-usage.json", "activations.npz", "README.md", "notes.txt", "run.log"]
    for name in wanted + unwanted:
        if not (src / name).exists():
            (src / name).write_text(f"{name}\n")
    (src / "subdir").mkdir()
    convert(src, tmp_path / "dst", progress=False)
    dst = tmp_path / "dst"
    for name in [*wanted, "tokenizer_config.json", "generation_config.json"]:
        assert (dst / name).read_bytes() == (src / name).read_bytes(), name
    got = {p.name for p in dst.iterdir() if not p.name.endswith(".safetensors")}
    sidecars = {*wanted, "tokenizer_config.json", "generation_config.json", "config.json"}
    assert got == {*sidecars, RECORD}


def test_fp8_checkpoint_matches_numpy_decode(tmp_path: Path) -> None:
    # Odd widths (kv_lora_rank 33 → kv_b_proj has I = 33) and I = 100 (not a multiple of 64).
    cfg = tiny_config(kv_lora_rank=33, moe_intermediate_size=100)
    # 32x32 blocks so that most weights hold several blocks; decoded = numpy's own FP8 decode.
    decoded = write_hf_checkpoint(tmp_path / "src", cfg, random_weights(cfg, seed=3), fp8_block=32)
    convert(tmp_path / "src", tmp_path / "dst", progress=False)
    check_container(tmp_path / "dst", decoded, cfg["num_hidden_layers"])
    out_cfg = json.loads((tmp_path / "dst" / "config.json").read_text())
    assert "quantization_config" not in out_cfg


def test_resume_skips_finished_shards(tmp_path: Path) -> None:
    cfg = tiny_config()
    write_hf_checkpoint(tmp_path / "src", cfg, random_weights(cfg, seed=4))
    first = convert(tmp_path / "src", tmp_path / "dst", progress=False, max_shard_size=60_000)
    shards = sorted((tmp_path / "dst").glob("*.safetensors"))
    before = {p.name: p.read_bytes() for p in shards}
    shards[0].write_bytes(before[shards[0].name][:100])  # a torn shard
    (tmp_path / "dst" / f".{shards[1].name}.partial").write_bytes(b"junk")  # a stale temp
    again = convert(tmp_path / "src", tmp_path / "dst", progress=False, max_shard_size=60_000)
    assert (again.shards_written, again.shards_skipped) == (1, first.shards_written - 1)
    assert {p.name: p.read_bytes() for p in shards} == before


def test_cli_convert(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cfg = tiny_config()
    write_hf_checkpoint(tmp_path / "src", cfg, random_weights(cfg, seed=5))
    rc = cli_main(
        ["convert", str(tmp_path / "src"), str(tmp_path / "dst"), "-q", "--expert-bits", "8"]
    )
    assert rc == 0
    assert "wrote" in capsys.readouterr().out
    c = _core.Container(str(tmp_path / "dst"))
    assert c.format("model.layers.1.mlp.experts.0.up_proj.weight") == "int8"
    assert c.format("model.layers.1.mlp.shared_experts.up_proj.weight") == "int4_g64"
    rc = cli_main(["convert", str(tmp_path / "src"), str(tmp_path / "src" / "out"), "-q"])
    assert rc == 1
    assert "inside the source" in capsys.readouterr().err


def test_refusals(tmp_path: Path) -> None:
    cfg = tiny_config()
    write_hf_checkpoint(tmp_path / "src", cfg, random_weights(cfg, seed=6))
    for dst in (tmp_path / "src", tmp_path / "src" / "sub", tmp_path / "src" / ".." / "src" / "x"):
        with pytest.raises(InvalidArgumentError, match="inside the source"):
            convert(tmp_path / "src", dst, progress=False)
    assert not (tmp_path / "src" / "sub").exists()
    with pytest.raises(InvalidArgumentError, match="group_size"):
        convert(tmp_path / "src", tmp_path / "d", group_size=100, progress=False)
    with pytest.raises(InvalidArgumentError, match="dense_bits"):
        convert(tmp_path / "src", tmp_path / "d", dense_bits=2, progress=False)


def test_non_finite_source_is_named(tmp_path: Path) -> None:
    cfg = tiny_config()
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    name = "model.layers.0.self_attn.o_proj.weight"
    w = np.ones((160, 32), dtype=np.float32)
    w[7, 9] = np.inf
    write_raw_safetensors(src / "m.safetensors", {name: ("BF16", w.shape, bf16_bytes(w))})
    with pytest.raises(NonFiniteWeightError, match=rf"{name}.*Inf.*{7 * 32 + 9}"):
        convert(src, tmp_path / "dst", progress=False)


def test_fused_experts_are_refused(tmp_path: Path) -> None:
    cfg = tiny_config()
    src = tmp_path / "src"
    src.mkdir()
    (src / "config.json").write_text(json.dumps(cfg))
    w = np.zeros((4, 192, 160), dtype=np.float32)
    write_raw_safetensors(
        src / "m.safetensors",
        {"model.layers.1.mlp.experts.gate_up_proj": ("BF16", w.shape, bf16_bytes(w))},
    )
    with pytest.raises(UnsupportedModelError, match="fused"):
        convert(src, tmp_path / "dst", progress=False)


def test_progress_exception_stops_a_shard_cleanly(tmp_path: Path) -> None:
    cfg = tiny_config()
    write_hf_checkpoint(tmp_path / "src", cfg, random_weights(cfg, seed=7))
    job = _core.ConvertJob(str(tmp_path / "src"), str(tmp_path / "dst"), max_shard_bytes=60_000)
    seen: list[int] = []

    def stop(n: int) -> None:
        seen.append(n)
        if len(seen) == 3:
            raise RuntimeError("stop here")

    with pytest.raises(RuntimeError, match="stop here"):
        job.write_shard(0, stop)
    assert len(seen) == 3
    assert not job.is_done(0)
    assert not list((tmp_path / "dst").glob("*.safetensors"))  # only the .partial file
    job.write_shard(0)
    assert job.is_done(0)
    name, size = job.shards()[0]
    assert (tmp_path / "dst" / name).stat().st_size == size


def _convert_in_subprocess(
    src: Path, dst: Path, capture: bool = True, **limits: Any
) -> subprocess.Popen[bytes]:
    code = (
        "import resource, signal, sys\n"
        "from colibri.convert import convert\n"
        f"fsize = {limits.get('fsize')!r}\n"
        "if fsize is not None:\n"
        "    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        "    resource.setrlimit(resource.RLIMIT_FSIZE, (fsize, fsize))\n"
        "try:\n"
        f"    convert({str(src)!r}, {str(dst)!r}, progress=False, max_shard_size=400_000)\n"
        "except Exception as e:\n"
        "    print(type(e).__name__, e, file=sys.stderr)\n"
        "    sys.exit(3)\n"
    )
    out = subprocess.PIPE if capture else subprocess.DEVNULL
    return subprocess.Popen([sys.executable, "-c", code], stdout=out, stderr=out)


def _bigger_checkpoint(tmp_path: Path) -> Path:
    cfg = tiny_config(
        num_hidden_layers=6, n_routed_experts=8, moe_intermediate_size=256, hidden_size=256
    )
    write_hf_checkpoint(tmp_path / "src", cfg, random_weights(cfg, seed=11))
    return tmp_path / "src"


def _container_files(d: Path) -> dict[str, bytes]:
    """Every file of a converted container but the progress record (whose entries carry the
    time they were written)."""
    return {p.name: p.read_bytes() for p in d.iterdir() if p.is_file() and p.name != RECORD}


def test_a_killed_conversion_resumes_to_byte_identical_shards(tmp_path: Path) -> None:
    src = _bigger_checkpoint(tmp_path)
    convert(src, tmp_path / "clean", progress=False, max_shard_size=400_000)
    clean = _container_files(tmp_path / "clean")
    dst = tmp_path / "dst"
    proc = _convert_in_subprocess(src, dst, capture=False)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and len(list(dst.glob("*.safetensors"))) < 2:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL, "the conversion ended before it was killed"
    written = len(list(dst.glob("*.safetensors")))
    assert 2 <= written < len([n for n in clean if n.endswith(".safetensors")])
    again = convert(src, dst, progress=False, max_shard_size=400_000)
    assert again.shards_skipped >= 1
    assert _container_files(dst) == clean
    record = json.loads((dst / RECORD).read_text())["shards"]
    assert sorted(record) == sorted(n for n in clean if n.endswith(".safetensors"))


def test_a_full_filesystem_is_a_clean_io_error(tmp_path: Path) -> None:
    src = _bigger_checkpoint(tmp_path)
    small = tmp_path / "small"
    small.mkdir()
    mounted = (
        subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "size=600k", "tmpfs", str(small)],
            capture_output=True,
        ).returncode
        == 0
    )
    try:
        # A real full filesystem (ENOSPC) where tmpfs can be mounted, else a file-size limit
        # (EFBIG): either way the converter must report an I/O error, not crash.
        proc = _convert_in_subprocess(src, small / "dst", fsize=None if mounted else 100_000)
        _, err = proc.communicate(timeout=120)
        text = err.decode()
        assert proc.returncode == 3, text
        assert text.startswith("ColibriIOError"), text
        assert ("No space" in text) or ("too large" in text), text
        assert "Traceback" not in text and "panicked" not in text
    finally:
        if mounted:
            subprocess.run(["umount", str(small)], check=False)
