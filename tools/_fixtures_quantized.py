"""The quantised goldens (golden_int4.safetensors): transformers on the weights of the
default ``colibri convert`` container, dequantised."""

from __future__ import annotations

import json
import math
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from _fixtures_indexer import boundary_margin, canonical_topk, full_layers, record_indexers
from _fixtures_model import model_class, official_state_dict, prefill, save_tensors
from _fixtures_numpy import NumpyReference
from _fixtures_specs import TIE_MARGIN, TOL_NUMPY, FixtureSpec
from safetensors.numpy import load_file as np_load_file
from safetensors.torch import load_file

INT4_GROUP = 64
MIN_SCALE = np.float32(1e-8)


def default_format(name: str, shape: tuple[int, ...], n_layers: int) -> str:
    """The format ``colibri convert`` gives a tensor with its default options.

    docs/container.md's role table: the router gate and every vector stay f32; the whole
    MTP layer (index >= ``num_hidden_layers``), the embedding, the LM head and the GLM
    indexer projections are int8 per row; every other matrix (routed and shared experts,
    attention, dense MLPs) is int4 in groups of 64.
    """
    if len(shape) != 2 or name.endswith("mlp.gate.weight"):
        return "f32"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "int8"
    parts = name.split(".")
    if parts[:2] == ["model", "layers"] and int(parts[2]) >= n_layers:
        return "int8"
    if ".self_attn.indexer." in name:
        return "int8"
    return f"int4_g{INT4_GROUP}"


def fake_quantize(w: np.ndarray, fmt: str) -> np.ndarray:
    """Quantise then dequantise a float32 [O, I] matrix exactly as docs/container.md (float32).

    Per row (int8) or per group of ``INT4_GROUP`` columns (int4; one group when I <= 64,
    which is what the per-row int4 layout computes): s = max(absmax / qmax, 1e-8),
    q = clip(round_half_even(w / s), -qmax - 1, qmax), value q * s.
    """
    if fmt == "f32":
        return w
    w = np.asarray(w, dtype=np.float32)
    qmax, gs = (np.float32(127), w.shape[1]) if fmt == "int8" else (np.float32(7), INT4_GROUP)
    out = np.empty_like(w)
    for start in range(0, w.shape[1], gs):
        block = w[:, start : start + gs]
        s = np.maximum(np.abs(block).max(axis=1) / qmax, MIN_SCALE).astype(np.float32)[:, None]
        q = np.clip(np.rint(block / s), -qmax - 1, qmax)
        out[:, start : start + gs] = q * s
    return out


@dataclass
class QuantizedRun:
    """transformers on the dequantised default container, over one token sequence."""

    logits: torch.Tensor  # [S, V]
    topk: dict[int, torch.Tensor]  # full layer -> canonical selection [S, topk] (sparse DSA)
    margin: float  # smallest DSA boundary margin (inf without sparse DSA)
    counts: dict[str, int]  # tensors per format
    weights: dict[str, np.ndarray]  # the dequantised tensors


@torch.no_grad()
def quantized_run(
    spec: FixtureSpec, cfg: dict[str, Any], weights: dict[str, np.ndarray], ids: torch.Tensor
) -> QuantizedRun:
    """Quantise + dequantise ``weights`` as ``colibri convert`` does, load them, run ``ids``."""
    n_layers = int(cfg["num_hidden_layers"])
    counts: dict[str, int] = {}
    deq_np: dict[str, np.ndarray] = {}
    for name in sorted(weights):
        fmt = default_format(name, weights[name].shape, n_layers)
        counts[fmt] = counts.get(fmt, 0) + 1
        deq_np[name] = np.ascontiguousarray(fake_quantize(weights[name], fmt))
    deq = {k: torch.from_numpy(v) for k, v in deq_np.items()}
    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
        save_tensors(deq, Path(tmp) / "model.safetensors")
        model = model_class(spec).from_pretrained(
            tmp, dtype=torch.float32, attn_implementation="eager"
        )
    model.eval()
    for name, tensor in official_state_dict(model, bool(cfg["tie_word_embeddings"])).items():
        assert torch.equal(tensor, deq[name]), f"{name}: loaded weight is not the dequantised one"
    with record_indexers(model) as calls:
        logits, _ = prefill(model, ids)
    topk: dict[int, torch.Tensor] = {}
    margin = math.inf
    if spec.sparse_dsa:
        k = int(model.config.index_topk)
        for layer in full_layers(model.config):
            (call,) = calls[f"model.layers.{layer}.self_attn.indexer"]
            assert call.scores is not None
            topk[layer] = canonical_topk(call.indices, k)
            margin = min(margin, boundary_margin(call.scores, k))
    return QuantizedRun(logits, topk, margin, counts, deq_np)


@torch.no_grad()
def write_quantized_golden(spec: FixtureSpec, fixture_dir: Path) -> None:
    """Write ``golden_int4.safetensors``: transformers' logits on the default container.

    Reads the fixture's ``config.json``, ``model.safetensors`` and ``golden.safetensors``,
    replaces every weight by its dequantised default-container value, loads that into
    transformers and records float32 logits over ``prompt_ids + greedy_ids[:-1]`` (one
    teacher-forced forward), and for a sparse DSA fixture the selection of every full layer
    (``int4_dsa_topk_{L}``). The numpy reference on the same dequantised weights must agree.
    The other fixture files are left untouched.
    """
    cfg = json.loads((fixture_dir / "config.json").read_text())
    weights = np_load_file(str(fixture_dir / "model.safetensors"))
    golden = load_file(str(fixture_dir / "golden.safetensors"))
    ids = torch.cat([golden["prompt_ids"], golden["greedy_ids"][:-1]])
    run = quantized_run(spec, cfg, weights, ids)
    out = {"int4_ids": ids, "int4_logits": run.logits}
    out.update({f"int4_dsa_topk_{k}": v for k, v in run.topk.items()})
    save_tensors(out, fixture_dir / "golden_int4.safetensors")

    ref = NumpyReference(fixture_dir, weights=run.weights)
    ref_logits, _, ref_topk = ref.forward(ids.numpy())
    d_ref = float(np.abs(ref_logits - run.logits.numpy()).max())
    assert d_ref < TOL_NUMPY, f"numpy reference on the dequantised weights differs by {d_ref}"
    for layer, sel in run.topk.items():
        assert np.array_equal(ref_topk[layer], sel.numpy()), f"numpy int4 selection L{layer}"
    f32 = torch.cat([golden["logits"], golden["greedy_logits"][1:]])
    agree = (run.logits.argmax(-1) == f32.argmax(-1)).float().mean().item()
    size = (fixture_dir / "golden_int4.safetensors").stat().st_size
    dsa = ""
    if run.topk:
        f32_sel = [golden[f"dsa_topk_{k}"] for k in run.topk]
        same = sum(
            int((a == b).all(-1).sum()) for a, b in zip(f32_sel, run.topk.values(), strict=True)
        )
        dsa = (
            f"; DSA selections int4_dsa_topk_{list(run.topk)}: boundary margin"
            f" {run.margin:.2e}, rows equal to the float32 selection {same}/"
            f"{len(run.topk) * ids.shape[0]}, numpy reference selects the same sets"
        )
        assert run.margin > TIE_MARGIN, f"int4 DSA near-tie (margin {run.margin})"
    print(
        f"wrote {fixture_dir / 'golden_int4.safetensors'} ({size} B; formats {run.counts}); "
        f"top-1 agreement with the float32 goldens {agree:.1%}; numpy reference on the"
        f" dequantised weights max|d|={d_ref:.2e}{dsa}"
    )
