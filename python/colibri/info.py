"""``colibri info``: what a model directory holds (config summary, formats and bytes per
tensor role, the memory plan), read without loading the model for compute."""

from __future__ import annotations

import os
from typing import Any

from colibri import _core

#: Roles of the tensors in a container, in the order ``colibri info`` prints them.
ROLES = (
    "embed",
    "lm_head",
    "attention",
    "indexer",
    "norms",
    "dense_mlp",
    "router",
    "shared_experts",
    "routed_experts",
    "mtp",
    "mtp_routed_experts",
)


def tensor_role(name: str, num_hidden_layers: int) -> str:
    """The role of a tensor (a scale ``NAME.qs`` has its weight's role)."""
    name = name.removesuffix(".qs")
    parts = name.split(".")
    layer = int(parts[2]) if name.startswith("model.layers.") and parts[2].isdigit() else None
    if layer is not None and layer >= num_hidden_layers:
        return "mtp_routed_experts" if ".mlp.experts." in name else "mtp"
    if ".mlp.experts." in name:
        return "routed_experts"
    if ".mlp.shared_experts." in name:
        return "shared_experts"
    if ".mlp.gate." in name:
        return "router"
    if ".self_attn.indexer." in name:
        return "indexer"
    if ".self_attn." in name:
        return "attention"
    if ".mlp." in name:
        return "dense_mlp"
    if "embed_tokens" in name:
        return "embed"
    if name.startswith("lm_head"):
        return "lm_head"
    return "norms"


def model_info(path: str | os.PathLike[str], *, mtp_loaded: bool = True) -> dict[str, Any]:
    """Describe the model directory ``path`` without loading it for compute.

    Returns a dict with ``config`` (family, layers, experts, ...: the engine's reading of
    ``config.json``, its aliases and family defaults included), ``tensors`` (for each
    role: ``{format: bytes}``, a weight's scales counted with it), and ``memory``:
    ``dense_bytes`` (resident in RAM: everything but the routed experts, the MTP layer only
    when ``mtp_loaded``), ``expert_bytes`` (routed experts, streamed from disk),
    ``kv_bytes_per_token`` (the KV cache: the normed latent and the roped key per layer,
    float32, the GLM DSA indexer key per full layer, plus the MTP layer's row when loaded).
    """
    c = _core.Container(os.fspath(path))
    cfg = _core.model_config(c.dir)  # the engine's reading of config.json
    n_layers = int(cfg["num_hidden_layers"])
    names = c.names()
    fmt_of: dict[str, str] = {}
    infos: dict[str, dict[str, Any]] = {name: c.info(name) for name in names}
    for name, t in infos.items():
        fmt_of[name] = str(t["format"] or t["dtype"]).lower()
    tensors: dict[str, dict[str, int]] = {}
    for name, t in infos.items():
        size = int(t["end"]) - int(t["start"])
        base = name.removesuffix(".qs")
        fmt = fmt_of.get(base, fmt_of[name])
        role = tensor_role(name, n_layers)
        by_fmt = tensors.setdefault(role, {})
        by_fmt[fmt] = by_fmt.get(fmt, 0) + size
    tensors = {r: tensors[r] for r in ROLES if r in tensors}
    total = {r: sum(v.values()) for r, v in tensors.items()}
    has_mtp = "mtp" in total
    expert_roles = ["routed_experts"] + (["mtp_routed_experts"] if mtp_loaded else [])
    dense_roles = [r for r in total if r not in ("routed_experts", "mtp_routed_experts")]
    if not mtp_loaded:
        dense_roles = [r for r in dense_roles if r != "mtp"]
    summary = {
        key: cfg[key]
        for key in (
            "model_type",
            "hidden_size",
            "num_hidden_layers",
            "first_k_dense_replace",
            "vocab_size",
            "n_routed_experts",
            "num_experts_per_tok",
            "n_shared_experts",
            "moe_intermediate_size",
            "num_attention_heads",
            "kv_lora_rank",
            "q_lora_rank",
            "max_position_embeddings",
        )
    }
    summary["mtp_layers"] = cfg["num_nextn_predict_layers"]
    return {
        "path": str(c.dir),
        "config": summary,
        "tensor_count": len(names),
        "tensors": tensors,
        "total_bytes": sum(total.values()),
        "memory": {
            "dense_bytes": sum(total[r] for r in dense_roles),
            "expert_bytes": sum(total.get(r, 0) for r in expert_roles),
            "kv_bytes_per_token": int(c.kv_bytes_per_token(has_mtp and mtp_loaded)),
        },
    }
