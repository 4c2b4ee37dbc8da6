"""Write checkpoints and community-layout containers with numpy (and ``safetensors``) only.

Everything here is an independent reimplementation of docs/container.md, so tests can
check colibri's reader and converter against it: the quantiser
(``s = max(absmax/qmax, 1e-8)``, round half to even, clip, int4 nibble ``q + 8`` with
element ``2j`` in the low nibble of byte ``j``),
an FP8 e4m3fn codec from the bit layout, and a raw safetensors writer for the dtypes numpy
lacks (BF16, F8_E4M3).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

MIN_SCALE = np.float32(1e-8)


def tiny_config(**overrides: Any) -> dict[str, Any]:
    """A small DeepSeek-V3 config: 2 main layers (1 dense, 1 MoE) plus one MTP layer.

    hidden_size 160 is not a multiple of 64, so int4-gs64 rows end with a partial group.
    """
    cfg: dict[str, Any] = {
        "model_type": "deepseek_v3",
        "vocab_size": 50,
        "hidden_size": 160,
        "intermediate_size": 80,
        "moe_intermediate_size": 96,
        "num_hidden_layers": 2,
        "num_attention_heads": 2,
        "q_lora_rank": 48,
        "kv_lora_rank": 32,
        "qk_nope_head_dim": 16,
        "qk_rope_head_dim": 8,
        "v_head_dim": 16,
        "n_routed_experts": 4,
        "num_experts_per_tok": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 2,
        "topk_group": 1,
        "num_nextn_predict_layers": 1,
        "eos_token_id": 1,
        "bos_token_id": 0,
    }
    cfg.update(overrides)
    return cfg


def tensor_shapes(cfg: Mapping[str, Any]) -> Iterator[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor of a checkpoint for ``cfg``, written out by hand."""
    h, v = cfg["hidden_size"], cfg["vocab_size"]
    heads = cfg["num_attention_heads"]
    qk = cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    q_lora, kv_lora = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    moe = cfg["moe_intermediate_size"]
    n_layers = cfg["num_hidden_layers"]
    yield "model.embed_tokens.weight", (v, h)
    for layer in range(n_layers + cfg.get("num_nextn_predict_layers", 0)):
        p = f"model.layers.{layer}"
        yield f"{p}.input_layernorm.weight", (h,)
        yield f"{p}.post_attention_layernorm.weight", (h,)
        yield f"{p}.self_attn.q_a_proj.weight", (q_lora, h)
        yield f"{p}.self_attn.q_a_layernorm.weight", (q_lora,)
        yield f"{p}.self_attn.q_b_proj.weight", (heads * qk, q_lora)
        yield f"{p}.self_attn.kv_a_proj_with_mqa.weight", (kv_lora + cfg["qk_rope_head_dim"], h)
        yield f"{p}.self_attn.kv_a_layernorm.weight", (kv_lora,)
        yield (
            f"{p}.self_attn.kv_b_proj.weight",
            (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), kv_lora),
        )
        yield f"{p}.self_attn.o_proj.weight", (h, heads * cfg["v_head_dim"])
        if layer < cfg["first_k_dense_replace"]:
            inter = cfg["intermediate_size"]
            yield f"{p}.mlp.gate_proj.weight", (inter, h)
            yield f"{p}.mlp.up_proj.weight", (inter, h)
            yield f"{p}.mlp.down_proj.weight", (h, inter)
        else:
            yield f"{p}.mlp.gate.weight", (cfg["n_routed_experts"], h)
            yield f"{p}.mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],)
            shared = moe * cfg["n_shared_experts"]
            yield f"{p}.mlp.shared_experts.gate_proj.weight", (shared, h)
            yield f"{p}.mlp.shared_experts.up_proj.weight", (shared, h)
            yield f"{p}.mlp.shared_experts.down_proj.weight", (h, shared)
            for e in range(cfg["n_routed_experts"]):
                yield f"{p}.mlp.experts.{e}.gate_proj.weight", (moe, h)
                yield f"{p}.mlp.experts.{e}.up_proj.weight", (moe, h)
                yield f"{p}.mlp.experts.{e}.down_proj.weight", (h, moe)
        if layer >= n_layers:
            yield f"{p}.enorm.weight", (h,)
            yield f"{p}.hnorm.weight", (h,)
            yield f"{p}.eh_proj.weight", (h, 2 * h)
            yield f"{p}.shared_head.norm.weight", (h,)
            yield f"{p}.shared_head.head.weight", (v, h)
            yield f"{p}.embed_tokens.weight", (v, h)
    yield "model.norm.weight", (h,)
    yield "lm_head.weight", (v, h)


def random_weights(cfg: Mapping[str, Any], seed: int = 0) -> dict[str, np.ndarray]:
    """Float32 weights (values exactly representable in bf16) for every tensor of ``cfg``."""
    rng = np.random.default_rng(seed)
    out = {}
    for name, shape in tensor_shapes(cfg):
        w = rng.standard_normal(shape, dtype=np.float32) * rng.uniform(0.01, 3.0)
        out[name] = bf16_round(w.astype(np.float32))
    return out


# --- quantiser (docs/container.md), numpy --------------------------------------------------------


def quantize(w: np.ndarray, fmt: str) -> tuple[np.ndarray, np.ndarray]:
    """Quantise a float32 [O, I] matrix: ``fmt`` is ``int8``, ``int4`` or ``int4_g<gs>``.

    Returns (packed bytes as a flat uint8 array, scales as a flat float32 array).
    """
    w = np.asarray(w, dtype=np.float32)
    o, i = w.shape
    if fmt == "int8":
        qmax, gs = np.float32(127), i
    elif fmt == "int4":
        qmax, gs = np.float32(7), i
    elif fmt.startswith("int4_g"):
        qmax, gs = np.float32(7), int(fmt.removeprefix("int4_g"))
    else:
        raise ValueError(fmt)
    n_groups = -(-i // gs)
    q = np.zeros((o, i), dtype=np.int8)
    scales = np.zeros((o, n_groups), dtype=np.float32)
    for g in range(n_groups):
        block = w[:, g * gs : (g + 1) * gs]
        s = np.maximum(np.abs(block).max(axis=1) / qmax, MIN_SCALE).astype(np.float32)
        scales[:, g] = s
        q[:, g * gs : (g + 1) * gs] = np.clip(np.rint(block / s[:, None]), -qmax - 1, qmax)
    if fmt == "int8":
        return q.view(np.uint8).reshape(-1), scales.reshape(-1)
    nib = (q.astype(np.int16) + 8).astype(np.uint8)
    if i % 2:
        nib = np.concatenate([nib, np.full((o, 1), 8, dtype=np.uint8)], axis=1)
    packed = nib[:, 0::2] | (nib[:, 1::2] << 4)
    return packed.reshape(-1), scales.reshape(-1)


def dequantize(
    data: np.ndarray, scales: np.ndarray, shape: tuple[int, int], fmt: str
) -> np.ndarray:
    """Inverse of :func:`quantize` (float32 [O, I])."""
    o, i = shape
    if fmt == "int8":
        q = data.view(np.int8).reshape(o, i).astype(np.float32)
        return q * scales.reshape(o, 1)
    gs = i if fmt == "int4" else int(fmt.removeprefix("int4_g"))
    b = data.reshape(o, -1)
    nib = np.stack([b & 0x0F, b >> 4], axis=2).reshape(o, -1)[:, :i]
    q = nib.astype(np.float32) - 8
    s = np.repeat(scales.reshape(o, -1), gs, axis=1)[:, :i]
    return q * s


def group_scale_bound(scales: np.ndarray, shape: tuple[int, int], fmt: str) -> np.ndarray:
    """Half a quantisation step per element: the error bound of round-to-nearest."""
    o, i = shape
    gs = i if fmt in ("int8", "int4") else int(fmt.removeprefix("int4_g"))
    return 0.5 * np.repeat(scales.reshape(o, -1), gs, axis=1)[:, :i]


# --- bf16 and fp8 ------------------------------------------------------------------------


def bf16_round(w: np.ndarray) -> np.ndarray:
    """Round float32 to the nearest bfloat16 (ties to even), returned as float32."""
    u = np.ascontiguousarray(w, dtype=np.float32).view(np.uint32).astype(np.uint64)
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return rounded.astype(np.uint32).view(np.float32).reshape(np.shape(w))


def bf16_bytes(w: np.ndarray) -> bytes:
    """Little-endian bfloat16 bytes of float32 values already rounded to bf16."""
    u = np.ascontiguousarray(bf16_round(w)).view(np.uint32)
    return (u >> 16).astype("<u2").tobytes()


def e4m3_decode(b: np.ndarray) -> np.ndarray:
    """FP8 e4m3fn bytes → float32, from the bit layout (sign, 4-bit exponent bias 7,
    3-bit mantissa; exponent 0 subnormal; 0x7F/0xFF NaN)."""
    b = np.asarray(b, dtype=np.uint8).astype(np.int32)
    sign = np.where(b & 0x80, -1.0, 1.0)
    exp = (b >> 3) & 0xF
    man = (b & 0x7).astype(np.float64)
    normal = (1.0 + man / 8.0) * np.exp2(exp - 7.0)
    sub = man / 8.0 * 2.0**-6
    v = sign * np.where(exp == 0, sub, normal)
    v = np.where((b & 0x7F) == 0x7F, np.nan, v)
    return v.astype(np.float32)


def e4m3_encode(x: np.ndarray) -> np.ndarray:
    """Float32 → nearest finite FP8 e4m3fn byte (by search over the 254 finite codes)."""
    codes = np.array([c for c in range(256) if (c & 0x7F) != 0x7F], dtype=np.uint8)
    values = e4m3_decode(codes)
    idx = np.abs(np.asarray(x, dtype=np.float32)[..., None] - values).argmin(axis=-1)
    return codes[idx]


# --- writers -----------------------------------------------------------------------------


def write_raw_safetensors(
    path: Path,
    tensors: Mapping[str, tuple[str, tuple[int, ...], bytes]],
    metadata: Mapping[str, str] | None = None,
) -> None:
    """Write a safetensors file from (dtype name, shape, raw bytes) per tensor."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    offset = 0
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {
            "dtype": dtype,
            "shape": list(shape),
            "data_offsets": [offset, offset + len(raw)],
        }
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for _, _, raw in tensors.values():
            f.write(raw)


def write_hf_checkpoint(
    directory: Path,
    cfg: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    *,
    fp8_block: int | None = None,
    shards: int = 2,
) -> dict[str, np.ndarray]:
    """Write ``weights`` as a Hugging Face checkpoint in ``shards`` files.

    BF16 by default; with ``fp8_block``, every 2-D weight is stored FP8 e4m3 with
    ``weight_scale_inv`` block scales of that block size (the other tensors stay BF16).
    Returns the values the checkpoint decodes to (what a converter must reproduce).
    """
    directory.mkdir(parents=True, exist_ok=True)
    cfg = dict(cfg)
    if fp8_block:
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [fp8_block] * 2}
    (directory / "config.json").write_text(json.dumps(cfg))
    (directory / "tokenizer_config.json").write_text("{}")
    (directory / "generation_config.json").write_text(json.dumps({"eos_token_id": 1}))
    entries: dict[str, tuple[str, tuple[int, ...], bytes]] = {}
    decoded: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if fp8_block and w.ndim == 2:
            o, i = w.shape
            b = fp8_block
            absmax = float(np.abs(w).max()) or 1.0
            rng = np.random.default_rng(len(name))
            s = rng.uniform(0.5, 2.0, (-(-o // b), -(-i // b))) * absmax / 448.0
            s = s.astype(np.float32)
            s_full = np.repeat(np.repeat(s, b, axis=0), b, axis=1)[:o, :i]
            q = e4m3_encode(w / s_full)
            entries[name] = ("F8_E4M3", w.shape, q.tobytes())
            entries[name + "_scale_inv"] = ("F32", s.shape, s.astype("<f4").tobytes())
            decoded[name] = e4m3_decode(q) * s_full
        else:
            entries[name] = ("BF16", w.shape, bf16_bytes(w))
            decoded[name] = bf16_round(w)
    names = list(entries)
    per = -(-len(names) // shards)
    for k in range(shards):
        part = {n: entries[n] for n in names[k * per : (k + 1) * per]}
        if part:
            write_raw_safetensors(
                directory / f"model-{k + 1:05d}-of-{shards:05d}.safetensors", part
            )
    return decoded


def write_community_container(
    directory: Path,
    cfg: Mapping[str, Any],
    weights: Mapping[str, np.ndarray],
    formats: Mapping[str, str],
) -> None:
    """Write a container the way the community int4 containers are laid out: each weight
    in ``formats`` as ``NAME`` (U8 packed bytes) + ``NAME.qs`` (F32 scales), everything else
    float32, no ``__metadata__``, via ``safetensors.numpy``."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(dict(cfg)))
    tensors: dict[str, np.ndarray] = {}
    for name, w in weights.items():
        if name in formats:
            data, scales = quantize(w, formats[name])
            tensors[name] = data
            tensors[name + ".qs"] = scales
        else:
            tensors[name] = np.ascontiguousarray(w, dtype=np.float32)
    names = list(tensors)
    half = len(names) // 2
    save_file({n: tensors[n] for n in names[:half]}, str(directory / "part-a.safetensors"))
    save_file({n: tensors[n] for n in names[half:]}, str(directory / "part-b.safetensors"))
