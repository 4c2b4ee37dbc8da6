"""The container reader through the bindings: community-layout containers written by
``tests/helpers`` read back, and every kind of bad input is a typed exception naming the
file and the tensor (never a crash)."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import numpy as np
import pytest
from colibri import _core
from colibri.errors import (
    ColibriFileNotFoundError,
    ConfigError,
    ContainerError,
    InvalidArgumentError,
    MissingTensorError,
    UnsupportedModelError,
)
from helpers.community import (
    dequantize,
    e4m3_decode,
    group_scale_bound,
    quantize,
    random_weights,
    tiny_config,
    write_community_container,
    write_raw_safetensors,
)
from safetensors.numpy import save_file

EXPERT = "model.layers.1.mlp.experts.2.gate_proj.weight"  # [96, 160]
O_PROJ = "model.layers.0.self_attn.o_proj.weight"  # [160, 32]


GROUP_SIZES = (16, 32, 48, 64, 96, 128, 192, 256)


def inferable_group_size(cols: int, gs: int) -> int:
    """The group size a reader infers from the scale count alone (docs/container.md: the smallest
    listed size giving the same count). Without metadata a container can only carry that
    one; e.g. gs 64 on 80 columns has 2 groups per row, like gs 48, and reads as gs 48."""
    return min(g for g in GROUP_SIZES if -(-cols // g) == -(-cols // gs))


def community_formats(weights: dict[str, np.ndarray]) -> dict[str, str]:
    """A mix of every format the community layout uses, across roles."""
    fmts = {}
    for name, w in weights.items():
        if w.ndim != 2 or name.endswith("mlp.gate.weight"):
            continue
        cols = w.shape[1]
        if "embed_tokens" in name or "lm_head" in name or "layers.2." in name:
            fmts[name] = "int8"
        elif "kv_b_proj" in name or cols <= 64:
            fmts[name] = "int4"
        elif "q_a_proj" in name:
            fmts[name] = f"int4_g{inferable_group_size(cols, 32)}"
        else:
            fmts[name] = f"int4_g{inferable_group_size(cols, 64)}"
    return fmts


@pytest.fixture
def community(tmp_path: Path) -> tuple[Path, dict[str, np.ndarray], dict[str, str]]:
    cfg = tiny_config(kv_lora_rank=33)  # kv_b_proj: an odd I (33), stored int4 per row
    weights = random_weights(cfg, seed=1)
    fmts = community_formats(weights)
    write_community_container(tmp_path / "m", cfg, weights, fmts)
    return tmp_path / "m", weights, fmts


def test_community_layout_reads_back(community: tuple[Path, dict, dict]) -> None:
    path, weights, fmts = community
    c = _core.Container(str(path))
    assert c.family == "deepseek_v3"
    for name, w in weights.items():
        if name in fmts:
            fmt = fmts[name]
            assert c.format(name) == fmt, name
            got = c.dequantize(name)
            assert got.shape == w.shape
            data, scales = quantize(w, fmt)
            np.testing.assert_array_equal(got, dequantize(data, scales, w.shape, fmt))
            assert np.all(np.abs(got - w) <= group_scale_bound(scales, w.shape, fmt) * 1.0001)
            info = c.info(name)
            assert info["dtype"] == "U8" and tuple(info["logical_shape"]) == w.shape
        elif w.ndim == 2:
            assert c.format(name) == "f32"
            np.testing.assert_array_equal(c.dequantize(name), w)
        else:
            np.testing.assert_array_equal(c.vector(name), w)
    assert len(c) == len(weights) + len(fmts)
    assert {f for f in fmts.values()} >= {"int8", "int4", "int4_g32", "int4_g48", "int4_g64"}
    assert EXPERT in c and EXPERT + ".qs" in c


def test_missing_tensor_is_typed(community: tuple[Path, dict, dict]) -> None:
    c = _core.Container(str(community[0]))
    with pytest.raises(MissingTensorError, match=r"lm_head\.weightx"):
        c.dequantize("lm_head.weightx")
    with pytest.raises(KeyError):  # MissingTensorError is also a KeyError
        c.info("nope")
    with pytest.raises(ContainerError, match="not a 2-D weight"):
        c.dequantize("model.norm.weight")


# --- bad input ---------------------------------------------------------------------------


def write_model(tmp_path: Path, tensors: dict, cfg: dict | None = None) -> Path:
    d = tmp_path / "bad"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps(cfg or tiny_config()))
    write_raw_safetensors(d / "shard.safetensors", tensors)
    return d


def quantised_entry(name: str, w: np.ndarray, fmt: str) -> dict:
    data, scales = quantize(w, fmt)
    return {
        name: ("U8", (data.size,), data.tobytes()),
        name + ".qs": ("F32", (scales.size,), scales.astype("<f4").tobytes()),
    }


def good_expert() -> dict:
    w = np.random.default_rng(0).standard_normal((96, 160)).astype(np.float32)
    return quantised_entry(EXPERT, w, "int4_g64")


def expect_container_error(path: Path, *needles: str) -> None:
    with pytest.raises(ContainerError) as info:
        _core.Container(str(path))
    msg = str(info.value)
    for n in needles:
        assert n in msg, msg


def test_truncated_shard(tmp_path: Path) -> None:
    d = write_model(tmp_path, good_expert())
    shard = d / "shard.safetensors"
    raw = shard.read_bytes()
    for cut in (4, 30, len(raw) - 1):
        shard.write_bytes(raw[:cut])
        expect_container_error(d, "shard.safetensors")


def test_header_length_past_eof_and_absurd(tmp_path: Path) -> None:
    d = write_model(tmp_path, good_expert())
    shard = d / "shard.safetensors"
    shard.write_bytes(struct.pack("<Q", 10_000) + b"{}")
    expect_container_error(d, "shard.safetensors", "past the end")
    shard.write_bytes(struct.pack("<Q", 2**63) + b"{}" * 8)
    expect_container_error(d, "shard.safetensors", "cap")


def test_non_utf8_and_invalid_json_header(tmp_path: Path) -> None:
    d = write_model(tmp_path, good_expert())
    shard = d / "shard.safetensors"
    shard.write_bytes(struct.pack("<Q", 8) + b"\xff\xfe\xfd{}   ")
    expect_container_error(d, "shard.safetensors", "UTF-8")
    shard.write_bytes(struct.pack("<Q", 8) + b'{"a": [ ')
    expect_container_error(d, "shard.safetensors", "JSON")


def header_file(path: Path, header: dict, data_len: int) -> None:
    text = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + b"\0" * data_len)


@pytest.mark.parametrize(
    ("entries", "data_len", "needle"),
    [
        ({EXPERT: {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]}}, 4, "out of range"),
        ({EXPERT: {"dtype": "U8", "shape": [8], "data_offsets": [8, 0]}}, 16, "out of range"),
        (
            {
                "a": {"dtype": "U8", "shape": [8], "data_offsets": [0, 8]},
                EXPERT: {"dtype": "U8", "shape": [8], "data_offsets": [4, 12]},
            },
            16,
            "overlaps",
        ),
        ({EXPERT: {"dtype": "Q4_K", "shape": [8], "data_offsets": [0, 8]}}, 8, "unknown dtype"),
        ({EXPERT: {"dtype": "F32", "shape": [3], "data_offsets": [0, 8]}}, 8, "needs 12 bytes"),
    ],
)
def test_bad_offsets_and_dtypes(tmp_path: Path, entries: dict, data_len: int, needle: str) -> None:
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config()))
    header_file(d / "s.safetensors", entries, data_len)
    expect_container_error(d, "s.safetensors", EXPERT, needle)


def test_wrong_scale_count(tmp_path: Path) -> None:
    t = good_expert()
    dtype, shape, raw = t[EXPERT + ".qs"]
    t[EXPERT + ".qs"] = (dtype, (shape[0] - 1,), raw[:-4])
    expect_container_error(write_model(tmp_path, t), "shard.safetensors", EXPERT, "scales")


def test_logical_shape_disagreeing_with_config(tmp_path: Path) -> None:
    # The bytes are an int4_g64 [96, 160] expert, but this config says [96, 320].
    d = write_model(tmp_path, good_expert(), tiny_config(hidden_size=320))
    expect_container_error(d, "shard.safetensors", EXPERT, "[96, 320]")
    # A float weight whose stored shape disagrees with the config.
    w = np.zeros((32, 160), dtype=np.float32)
    d = write_model(tmp_path, {O_PROJ: ("F32", w.shape, w.tobytes())})
    expect_container_error(d, "shard.safetensors", O_PROJ, "[160, 32]")


def test_metadata_disagreeing_with_bytes(tmp_path: Path) -> None:
    w = np.random.default_rng(0).standard_normal((96, 160)).astype(np.float32)
    data, scales = quantize(w, "int4_g64")
    d = tmp_path / "m"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(tiny_config()))
    save_file(
        {EXPERT: data, EXPERT + ".qs": scales},
        str(d / "s.safetensors"),
        metadata={EXPERT: "int8"},
    )
    expect_container_error(d, "s.safetensors", EXPERT, "int8")


def test_config_errors_are_typed(tmp_path: Path) -> None:
    d = write_model(tmp_path, good_expert(), tiny_config(model_type="llama"))
    with pytest.raises(UnsupportedModelError, match=r"deepseek_v3.*glm_moe_dsa"):
        _core.Container(str(d))
    (d / "config.json").write_text(json.dumps(tiny_config(topk_group=3)))
    with pytest.raises(ConfigError, match="topk_group"):
        _core.Container(str(d))
    with pytest.raises(ColibriFileNotFoundError):
        _core.Container(str(tmp_path / "absent"))


def test_fp8_decode_matches_numpy() -> None:
    codes = np.arange(256, dtype=np.uint8)
    ours = _core.decode_fp8_e4m3(codes)
    ref = e4m3_decode(codes)
    np.testing.assert_array_equal(np.isnan(ours), np.isnan(ref))
    np.testing.assert_array_equal(ours[~np.isnan(ref)], ref[~np.isnan(ref)])
    assert ours[0x7E] == 448.0
    rng = np.random.default_rng(3)
    raw = rng.integers(0, 0x7E, size=(300, 260), dtype=np.uint8)  # finite codes only
    scale = rng.uniform(0.001, 2.0, size=(3, 3)).astype(np.float32)
    got = _core.dequant_fp8_blocks(raw, scale, (128, 128))
    want = e4m3_decode(raw) * np.repeat(np.repeat(scale, 128, 0), 128, 1)[:300, :260]
    np.testing.assert_array_equal(got, want)
    with pytest.raises(InvalidArgumentError, match="scale_inv"):
        _core.dequant_fp8_blocks(raw, scale[:2], (128, 128))
