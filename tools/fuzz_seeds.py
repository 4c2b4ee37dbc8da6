"""Write the fuzz seed corpus (fuzz/corpus/<target>/): small valid inputs for each
cargo-fuzz target, from which libFuzzer mutates. Deterministic; rerun after a format change.

    python tools/fuzz_seeds.py
"""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
CORPUS = ROOT / "fuzz" / "corpus"

#: The fixed config of the container_index target (fuzz_targets/container_index.rs).
CONFIG = {
    "model_type": "deepseek_v3",
    "vocab_size": 64,
    "hidden_size": 128,
    "intermediate_size": 96,
    "moe_intermediate_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "q_lora_rank": 32,
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
}

_DTYPES = {np.uint8: "U8", np.float32: "F32", np.float16: "F16"}


def safetensors(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """A safetensors file (written here so the seeds do not depend on a library)."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = metadata
    data = b""
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": _DTYPES[arr.dtype.type],
            "shape": list(arr.shape),
            "data_offsets": [len(data), len(data) + len(raw)],
        }
        data += raw
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def int4_rows(rows: int, cols: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """Per-row int4 bytes and scales for an [rows, cols] weight."""
    data = rng.integers(0, 256, size=rows * ((cols + 1) // 2), dtype=np.uint8)
    scales = rng.uniform(0.01, 0.1, size=rows).astype(np.float32)
    return data, scales


def shard(rng: np.random.Generator, bad: float | None = None) -> bytes:
    h, m = CONFIG["hidden_size"], CONFIG["moe_intermediate_size"]
    t: dict[str, np.ndarray] = {}
    for proj, (o, i) in {"gate_proj": (m, h), "up_proj": (m, h), "down_proj": (h, m)}.items():
        name = f"model.layers.1.mlp.experts.0.{proj}.weight"
        t[name], t[name + ".qs"] = int4_rows(o, i, rng)
    norm = np.ones(h, dtype=np.float32)
    if bad is not None:
        norm[5] = bad
    t["model.layers.1.input_layernorm.weight"] = norm
    t["model.layers.1.mlp.gate.e_score_correction_bias"] = np.zeros(4, dtype=np.float32)
    t["model.layers.1.mlp.gate.weight"] = rng.standard_normal((4, h)).astype(np.float16)
    return safetensors(t, {"colibri_format_version": "1"})


def write(target: str, blobs: list[bytes]) -> None:
    d = CORPUS / target
    d.mkdir(parents=True, exist_ok=True)
    for old in d.iterdir():
        old.unlink()
    for b in blobs:
        (d / hashlib.sha1(b).hexdigest()).write_bytes(b)


def main() -> None:
    rng = np.random.default_rng(24)
    tiny = {
        "a": np.arange(6, dtype=np.float32).reshape(2, 3),
        "b": np.arange(4, dtype=np.uint8),
    }
    write(
        "safetensors_header",
        [
            safetensors(tiny),
            safetensors(tiny, {"colibri_format_version": "1", "a": "f32"}),
            safetensors({}),
            shard(rng),
        ],
    )
    configs = [json.dumps(CONFIG).encode()]
    for fixture in ("dsv3_a", "glm_a", "glm_dsa"):
        configs.append((ROOT / "tests" / "fixtures" / fixture / "config.json").read_bytes())
    write("config", configs)
    write(
        "container_index",
        [
            shard(rng),
            shard(rng, bad=float("nan")),
            json.dumps({**CONFIG, "n_routed_experts": 2}).encode() + b"\0" + shard(rng),
        ],
    )


if __name__ == "__main__":
    main()
