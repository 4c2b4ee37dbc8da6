"""The synthetic DeepSeek-V3-shaped model bench_llamacpp.py measures: its config, the matrices a
token goes through (flops, parameters), the byte-level BPE tokenizer both engines read, and
the BF16 checkpoint."""

from __future__ import annotations

import hashlib
import importlib.util
import json
from pathlib import Path
from typing import Any

from _bench_llamacpp_env import log

ROOT = Path(__file__).resolve().parents[1]
CTX = 4096


# ------------------------------------------------------------------------------ the model
def _big_checkpoint() -> Any:
    """tools/make_big_checkpoint.py as a module (tensor list and shard writer)."""
    path = ROOT / "tools" / "make_big_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_big_checkpoint", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_config(quick: bool = False) -> dict[str, Any]:
    """The synthetic model: make_big_checkpoint's DeepSeek-V3 shape with 14 layers (1 dense,
    13 MoE) and 8 of 64 experts per token, ~3.2 GB as colibri's int4-g64 (~4.5 bits), about
    0.55 GB of weights read per token. ``quick``: a small model of the same structure."""
    cfg = _big_checkpoint().config(3 if quick else 14)
    cfg.update(
        architectures=["DeepseekV3ForCausalLM"],
        num_experts_per_tok=8,
        max_position_embeddings=CTX,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    if quick:
        cfg.update(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_attention_heads=8,
            q_lora_rank=256,
            kv_lora_rank=128,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
        )
    return cfg


def matmuls(cfg: dict[str, Any]) -> list[tuple[str, int, int, float]]:
    """(role, rows, cols, matrices applied per token) of every weight matrix a token uses."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    m, layers = cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    dense, moe = cfg["first_k_dense_replace"], layers - cfg["first_k_dense_replace"]
    k, shared = cfg["num_experts_per_tok"], cfg["n_shared_experts"]
    out = [
        ("attention q_a", ql, h, layers),
        ("attention q_b", heads * (nope + rope), ql, layers),
        ("attention kv_a", kl + rope, h, layers),
        ("attention kv_b", heads * (nope + v), kl, layers),
        ("attention o", h, heads * v, layers),
        ("dense mlp", cfg["intermediate_size"], h, 3 * dense),
        ("router", cfg["n_routed_experts"], h, moe),
        ("shared experts", m, h, 3 * shared * moe),
        ("routed experts", m, h, 3 * k * moe),
        ("lm_head", cfg["vocab_size"], h, 1),
    ]
    return out


def flops_per_token(cfg: dict[str, Any]) -> int:
    """2 x the multiply-adds of the weight matrices one token goes through (attention scores
    against the context, norms, rope and activations not counted)."""
    return int(sum(2 * r * c * n for _, r, c, n in matmuls(cfg)))


def params(cfg: dict[str, Any]) -> tuple[int, int]:
    """(total parameters of the 2-D weights, those a token uses, embedding excluded)."""
    total = sum(r * c for _, r, c in _shapes2d(cfg))
    active = sum(r * c * n for _, r, c, n in matmuls(cfg))
    return int(total), int(active)


def _shapes2d(cfg: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [(n, s[0], s[1]) for n, s in _big_checkpoint().shapes(cfg) if len(s) == 2]


def config_hash(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]


# -------------------------------------------------------------------------- the tokenizer
def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character each byte maps to."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocab(size: int) -> tuple[list[str], list[str]]:
    """(tokens by id, merges by rank) of a byte-level BPE of ``size`` tokens: 0 ``<|bos|>``,
    1 ``<|endoftext|>``, then the 256 bytes, then two-byte tokens (each one merge)."""
    if not 258 <= size <= 258 + 256 * 256:
        raise ValueError(f"vocab size {size} outside 258..{258 + 256 * 256}")
    b = byte_chars()
    tokens = ["<|bos|>", "<|endoftext|>", *b]
    merges = []
    for i in range(size - len(tokens)):
        left, right = b[i // 256], b[i % 256]
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    return tokens, merges


def write_tokenizer(dst: Path, size: int) -> None:
    """tokenizer.json / tokenizer_config.json / generation_config.json for colibri."""
    tokens, merges = vocab(size)
    special = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in (0, 1)
    ]
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {**level, "use_regex": True},
        "post_processor": None,
        "decoder": {**level, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": tokens[0],
                "eos_token": tokens[1],
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": CTX,
            },
            indent=1,
        )
    )
    (dst / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=1)
    )


def make_checkpoint(dst: Path, cfg: dict[str, Any], shard_gib: float = 1.0) -> None:
    """The BF16 safetensors checkpoint (make_big_checkpoint's writer, seed 0)."""
    import numpy as np

    big = _big_checkpoint()
    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    limit = int(shard_gib * 2**30)
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dtype, shape in big.entries(big.shapes(cfg), False):
        n = int(np.prod(shape)) * 2
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, dtype, shape))
        size += n
    for k, g in enumerate(groups):
        path = dst / f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        big.write_shard(path, g, rng)
        log(f"  {path.name}: {path.stat().st_size / 2**30:.2f} GiB")
    write_tokenizer(dst, cfg["vocab_size"])
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))
