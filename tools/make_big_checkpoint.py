"""Write a large synthetic DeepSeek-V3 checkpoint (BF16 or FP8) to measure converter memory.

Tensors are streamed to disk one at a time (the header is computed first), so this tool
itself needs little memory. Values are random normals rounded to bf16.

Usage:
    python tools/make_big_checkpoint.py /tmp/big --gib 2.2 --shard-gib 0.6
    /usr/bin/time -v colibri convert /tmp/big /tmp/big-out -q
"""

from __future__ import annotations

import argparse
import json
import struct
from pathlib import Path

import numpy as np


def config(layers: int) -> dict:
    """A DeepSeek-V3 config with big experts and ``layers`` layers (first one dense)."""
    return {
        "model_type": "deepseek_v3",
        "vocab_size": 32000,
        "hidden_size": 2048,
        "intermediate_size": 4096,
        "moe_intermediate_size": 1024,
        "num_hidden_layers": layers,
        "num_attention_heads": 16,
        "q_lora_rank": 768,
        "kv_lora_rank": 256,
        "qk_nope_head_dim": 64,
        "qk_rope_head_dim": 32,
        "v_head_dim": 64,
        "n_routed_experts": 64,
        "num_experts_per_tok": 4,
        "n_shared_experts": 1,
        "first_k_dense_replace": 1,
        "n_group": 8,
        "topk_group": 4,
        "num_nextn_predict_layers": 0,
        "eos_token_id": 1,
        "bos_token_id": 0,
    }


def shapes(cfg: dict) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of every tensor."""
    h, v, m = cfg["hidden_size"], cfg["vocab_size"], cfg["moe_intermediate_size"]
    heads, qk = cfg["num_attention_heads"], cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]
    out: list[tuple[str, tuple[int, ...]]] = [("model.embed_tokens.weight", (v, h))]
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        out += [
            (f"{p}.input_layernorm.weight", (h,)),
            (f"{p}.post_attention_layernorm.weight", (h,)),
            (f"{p}.self_attn.q_a_proj.weight", (cfg["q_lora_rank"], h)),
            (f"{p}.self_attn.q_a_layernorm.weight", (cfg["q_lora_rank"],)),
            (f"{p}.self_attn.q_b_proj.weight", (heads * qk, cfg["q_lora_rank"])),
            (
                f"{p}.self_attn.kv_a_proj_with_mqa.weight",
                (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"], h),
            ),
            (f"{p}.self_attn.kv_a_layernorm.weight", (cfg["kv_lora_rank"],)),
            (
                f"{p}.self_attn.kv_b_proj.weight",
                (heads * (cfg["qk_nope_head_dim"] + cfg["v_head_dim"]), cfg["kv_lora_rank"]),
            ),
            (f"{p}.self_attn.o_proj.weight", (h, heads * cfg["v_head_dim"])),
        ]
        if layer < cfg["first_k_dense_replace"]:
            i = cfg["intermediate_size"]
            out += [
                (f"{p}.mlp.gate_proj.weight", (i, h)),
                (f"{p}.mlp.up_proj.weight", (i, h)),
                (f"{p}.mlp.down_proj.weight", (h, i)),
            ]
        else:
            out += [
                (f"{p}.mlp.gate.weight", (cfg["n_routed_experts"], h)),
                (f"{p}.mlp.gate.e_score_correction_bias", (cfg["n_routed_experts"],)),
            ]
            for part in ("gate_proj", "up_proj", "down_proj"):
                out.append(
                    (
                        f"{p}.mlp.shared_experts.{part}.weight",
                        (m, h) if part != "down_proj" else (h, m),
                    )
                )
            for e in range(cfg["n_routed_experts"]):
                out += [
                    (f"{p}.mlp.experts.{e}.gate_proj.weight", (m, h)),
                    (f"{p}.mlp.experts.{e}.up_proj.weight", (m, h)),
                    (f"{p}.mlp.experts.{e}.down_proj.weight", (h, m)),
                ]
    out += [("model.norm.weight", (h,)), ("lm_head.weight", (v, h))]
    return out


def bf16(rng: np.random.Generator, shape: tuple[int, ...]) -> bytes:
    """Random normal values (scaled like weights) as little-endian bf16 bytes."""
    x = (rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02)).view(np.uint32)
    return ((x + 0x7FFF + ((x >> 16) & 1)) >> 16).astype("<u2").tobytes()


def fp8(rng: np.random.Generator, shape: tuple[int, ...]) -> bytes:
    """Random finite FP8 e4m3fn bytes (0x7F and 0xFF, the NaN codes, are avoided)."""
    b = rng.integers(0, 0x7E, size=shape, dtype=np.uint8)
    return (b | (rng.integers(0, 2, size=shape, dtype=np.uint8) << 7)).tobytes()


def entries(
    tensors: list[tuple[str, tuple[int, ...]]], use_fp8: bool
) -> list[tuple[str, str, tuple[int, ...]]]:
    """(name, dtype, shape) to write: with FP8, each 2-D weight plus its block scales."""
    out = []
    for name, shape in tensors:
        if use_fp8 and len(shape) == 2:
            out.append((name, "F8_E4M3", shape))
            out.append((name + "_scale_inv", "F32", (-(-shape[0] // 128), -(-shape[1] // 128))))
        else:
            out.append((name, "BF16", shape))
    return out


def write_shard(
    path: Path, tensors: list[tuple[str, str, tuple[int, ...]]], rng: np.random.Generator
) -> None:
    """Stream one shard: header first, then each tensor."""
    size = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
    header, offset = {}, 0
    for name, dtype, shape in tensors:
        n = int(np.prod(shape)) * size[dtype]
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + n]}
        offset += n
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for _, dtype, shape in tensors:
            if dtype == "BF16":
                f.write(bf16(rng, shape))
            elif dtype == "F8_E4M3":
                f.write(fp8(rng, shape))
            else:
                f.write(rng.uniform(1e-5, 1e-4, size=shape).astype("<f4").tobytes())


def main() -> None:
    """Entry point."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("dst", type=Path)
    ap.add_argument("--gib", type=float, default=2.2, help="approximate total size in GiB")
    ap.add_argument("--shard-gib", type=float, default=0.6, help="approximate shard size in GiB")
    ap.add_argument("--fp8", action="store_true", help="FP8 e4m3 weights with 128x128 block scales")
    args = ap.parse_args()
    # Each MoE layer holds ~0.8 GiB in bf16; choose the layer count for the target size.
    layers = max(2, round(args.gib / (0.4 if args.fp8 else 0.8)) + 1)
    cfg = config(layers)
    if args.fp8:
        cfg["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    args.dst.mkdir(parents=True, exist_ok=True)
    (args.dst / "config.json").write_text(json.dumps(cfg, indent=1))
    rng = np.random.default_rng(0)
    limit = int(args.shard_gib * 2**30)
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    nbytes = {"BF16": 2, "F32": 4, "F8_E4M3": 1}
    for name, dtype, shape in entries(shapes(cfg), args.fp8):
        n = int(np.prod(shape)) * nbytes[dtype]
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, dtype, shape))
        size += n
    for k, g in enumerate(groups):
        path = args.dst / f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        write_shard(path, g, rng)
        print(f"{path.name}: {path.stat().st_size / 2**30:.2f} GiB")


if __name__ == "__main__":
    main()
