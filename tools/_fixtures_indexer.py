"""GLM's lightning indexer in the fixtures: its scores and selections recorded from
transformers' forward, made dense, and put in the canonical order the goldens store."""

from __future__ import annotations

import math
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.nn import functional as F
from transformers import PreTrainedConfig
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaIndexer,
    apply_rotary_pos_emb_interleave,
)


@dataclass
class IndexerCall:
    """One call of a ``GlmMoeDsaIndexer``: its top-k output and, without a cache, its scores."""

    indices: torch.Tensor  # [S, k] int32, exactly as transformers returns them
    scores: torch.Tensor | None  # [S, S] float32 index scores before the top-k (no cache only)


@torch.no_grad()
def indexer_scores(
    mod: GlmMoeDsaIndexer,
    hidden: torch.Tensor,
    q_resid: torch.Tensor,
    position_embeddings: tuple[torch.Tensor, torch.Tensor],
    mask: torch.Tensor,
) -> torch.Tensor:
    """The index scores ``GlmMoeDsaIndexer.forward`` computes without a cache, before top-k.

    A line-by-line copy of transformers' code (which returns only the indices);
    ``record_indexers`` asserts that its top-k equals the module's output bit for bit.
    """
    b, s, _ = hidden.shape
    cos, sin = position_embeddings
    rope = mod.qk_rope_head_dim
    q = mod.wq_b(q_resid).view(b, s, mod.n_heads, mod.head_dim)
    q_rot, q_pass = torch.split(q, [rope, mod.head_dim - rope], dim=-1)
    k = mod.k_norm(mod.wk(hidden)).unsqueeze(2)
    k_rot, k_pass = torch.split(k, [rope, mod.head_dim - rope], dim=-1)
    q_rot, k_rot = apply_rotary_pos_emb_interleave(q_rot, k_rot, cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_rot, q_pass], dim=-1)
    k = torch.cat([k_rot, k_pass], dim=-1).squeeze(2)
    scores = torch.matmul(q.float(), k.transpose(-1, -2).float().unsqueeze(1)) * mod.softmax_scale
    scores = F.relu(scores)
    weights = mod.weights_proj(hidden.to(mod.weights_proj.weight.dtype)).float()
    weights = weights * (mod.n_heads**-0.5)
    index_scores = torch.matmul(weights.unsqueeze(-2), scores).squeeze(-2)
    if mask.dtype == torch.bool:
        return index_scores.masked_fill(~mask, float("-inf"))
    return index_scores + mask


@contextmanager
def record_indexers(root: nn.Module) -> Iterator[dict[str, list[IndexerCall]]]:
    """Record every ``GlmMoeDsaIndexer`` call under ``root``, keyed by module name, in order.

    Batch 1 only. Calls without a cache also get their index scores (``indexer_scores``).
    """
    calls: dict[str, list[IndexerCall]] = {}

    def hook(
        mod: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], out: Any, key: str
    ) -> None:
        assert isinstance(mod, GlmMoeDsaIndexer)
        scores = None
        if kwargs.get("cache") is None:
            full = indexer_scores(mod, *args[:4])
            topk = min(mod.index_topk, full.shape[-1])
            ref = full.topk(topk, dim=-1).indices.to(torch.int32)
            assert torch.equal(ref, out), f"{key}: indexer_scores disagrees with the indexer"
            scores = full[0]
        calls.setdefault(key, []).append(IndexerCall(out[0].detach().clone(), scores))

    handles = [
        mod.register_forward_hook(partial(hook, key=name), with_kwargs=True)
        for name, mod in root.named_modules()
        if isinstance(mod, GlmMoeDsaIndexer)
    ]
    try:
        yield calls
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def dense_indexers(*roots: nn.Module) -> Iterator[None]:
    """Temporarily set ``index_topk`` to 10**6 on every indexer (DSA keeps every key)."""
    mods = [m for r in roots for m in r.modules() if isinstance(m, GlmMoeDsaIndexer)]
    saved = [m.index_topk for m in mods]
    for m in mods:
        m.index_topk = 10**6
    try:
        yield
    finally:
        for m, k in zip(mods, saved, strict=True):
            m.index_topk = k


def canonical_topk(indices: torch.Tensor, topk: int, first_pos: int = 0) -> torch.Tensor:
    """The golden form of a selection: I32 [S, topk], row r = key position ``first_pos + r``.

    Keeps the causally visible indices (j <= first_pos + r; transformers' top-k also
    returns masked future positions when a row sees fewer than ``topk`` keys), sorted
    ascending, padded with -1.
    """
    rows = []
    for r, row in enumerate(indices.tolist()):
        visible = sorted(j for j in row if j <= first_pos + r)
        assert len(set(visible)) == len(visible) == min(topk, first_pos + r + 1), (r, row)
        rows.append(visible + [-1] * (topk - len(visible)))
    return torch.tensor(rows, dtype=torch.int32)


def boundary_margin(scores: torch.Tensor, topk: int) -> float:
    """Smallest selection margin of a causal score matrix [S, S] (row r sees keys 0..r).

    Over rows with more than ``topk`` visible keys: (topk-th largest - (topk+1)-th largest
    visible score) / max|visible score|. ``inf`` when no row is sparse.
    """
    best = math.inf
    for r in range(topk, scores.shape[0]):
        visible = scores[r, : r + 1].double()
        top = torch.sort(visible, descending=True).values
        scale = visible.abs().max().item()
        gap = (top[topk - 1] - top[topk]).item()
        best = min(best, gap / scale if scale > 0 else 0.0)
    return best


def full_layers(cfg: PreTrainedConfig) -> list[int]:
    """Main layers that run their own indexer (``indexer_types`` entry "full")."""
    return [i for i, kind in enumerate(cfg.indexer_types) if kind == "full"]
