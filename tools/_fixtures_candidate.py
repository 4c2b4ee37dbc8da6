"""One candidate model per seed: built, its goldens computed (DSA selections included), and
judged against the quality bar."""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from _fixtures_indexer import (
    IndexerCall,
    boundary_margin,
    canonical_topk,
    dense_indexers,
    full_layers,
    record_indexers,
)
from _fixtures_model import build_model, greedy, official_state_dict, prefill, write_config
from _fixtures_mtp import MtpGolden, build_mtp_layer, mtp_goldens
from _fixtures_quantized import quantized_run
from _fixtures_specs import (
    MIN_DENSE_DIFF,
    MIN_DISTINCT_GREEDY,
    MIN_EXPERT_SHARE,
    NEW_TOKENS,
    TIE_MARGIN,
    TOL_DECODE,
    FixtureSpec,
)
from transformers import PreTrainedModel
from transformers.modeling_layers import MtpLayer


def routing_summary(model: PreTrainedModel, ids: torch.Tensor) -> tuple[dict[int, int], int, int]:
    """How the routers behave over ``ids``: distinct experts per layer, branch sensitivity.

    Returns the distinct experts chosen per layer index and the number of (token, layer)
    rows whose chosen set changes when the correction bias is dropped, and when the group
    limit is dropped. Non-zero counts mean the goldens catch an engine that ignores the
    bias or the group limit.
    """
    chosen: dict[str, set[int]] = {}
    bias_rows = 0
    group_rows = 0
    handles = []

    def topk_set(scores: torch.Tensor, k: int) -> list[set[int]]:
        return [set(r) for r in torch.topk(scores, k, dim=-1)[1].tolist()]

    def hook(mod: Any, args: tuple[torch.Tensor, ...], out: Any, key: str) -> None:
        nonlocal bias_rows, group_rows
        chosen.setdefault(key, set()).update(out[2].flatten().tolist())
        got = [set(r) for r in out[2].tolist()]
        h = args[0].reshape(-1, args[0].shape[-1]).float()
        scores = torch.sigmoid(h @ mod.weight.float().T)
        k = int(mod.top_k)
        # Without the group limit: plain top-k of (scores + bias).
        free = topk_set(scores + mod.e_score_correction_bias, k)
        group_rows += sum(a != b for a, b in zip(got, free, strict=True))
        # Without the bias: same group-limited procedure on the raw scores.
        ng, tg = int(mod.num_group), int(mod.topk_group)
        g = scores.view(-1, ng, scores.shape[-1] // ng).topk(2, dim=-1)[0].sum(-1)
        keep = torch.zeros_like(g).scatter_(1, torch.topk(g, tg, dim=-1)[1], 1.0)
        mask = keep.repeat_interleave(scores.shape[-1] // ng, dim=1).bool()
        nob = topk_set(scores.masked_fill(~mask, float("-inf")), k)
        bias_rows += sum(a != b for a, b in zip(got, nob, strict=True))

    for name, mod in model.named_modules():
        if name.endswith("mlp.gate"):
            handles.append(
                mod.register_forward_hook(
                    lambda m, a, o, key=name: hook(m, a, o, key)  # type: ignore[misc]
                )
            )
    with torch.no_grad():
        model(input_ids=ids[None], use_cache=False)
    for handle in handles:
        handle.remove()
    used = {int(k.split(".")[2]): len(v) for k, v in chosen.items()}
    return used, bias_rows, group_rows


@dataclass
class DsaInputs:
    """What ``build_candidate`` computed that the DSA goldens and checks need."""

    prompt: torch.Tensor  # [T]
    long_ids: torch.Tensor  # [T+31]: prompt + greedy_ids[:-1]
    long_logits: torch.Tensor  # [T+31, V] the teacher-forced logits (greedy_logits inside)
    hidden_normed: torch.Tensor  # [T, H] model.norm(hidden) of the prompt prefill
    first_token: int  # greedy_ids[0]
    mtp_logits: torch.Tensor  # [T-1, V]
    long_calls: dict[str, list[IndexerCall]]  # main indexers in the long forward
    decode_calls: dict[str, list[IndexerCall]]  # main indexers during generate()
    mtp_calls: dict[str, list[IndexerCall]]  # the MTP indexer during mtp_goldens()


@dataclass
class DsaResult:
    """DSA golden tensors, notes and seed problems of one candidate."""

    tensors: dict[str, torch.Tensor]
    notes: list[str]
    problems: list[str]
    near_tie: bool  # a selection margin is at or below TIE_MARGIN
    inconsistent: list[str]  # transformers' decode selected other keys than its prefill
    scores: dict[int, torch.Tensor]  # full layer -> index scores [T+31, T+31] (long forward)


@torch.no_grad()
def dsa_goldens(
    spec: FixtureSpec, model: PreTrainedModel, mtp_layer: MtpLayer, inp: DsaInputs
) -> DsaResult:
    """Selections of every full DSA layer, and the checks that make them a sound oracle.

    ``dsa_topk_{L}`` [T+31, topk] comes from the long teacher-forced forward,
    ``mtp_dsa_topk`` [T-1, topk] from the MTP pass of ``mtp_logits`` (its first indexer
    call). Checks: transformers' KV-cached decode selects the same sets; no near-tie at the
    selection boundary in any full layer (main, MTP passes and the quantised container),
    and attending densely visibly changes the logits.
    """
    cfg = model.config
    topk = int(cfg.index_topk)
    t, n = inp.prompt.shape[0], inp.long_ids.shape[0]
    layers = full_layers(cfg)
    keys = {f"model.layers.{i}.self_attn.indexer": i for i in layers}
    assert set(inp.long_calls) == set(keys), f"indexers ran in {sorted(inp.long_calls)}"
    tensors: dict[str, torch.Tensor] = {}
    scores: dict[int, torch.Tensor] = {}
    margins: dict[str, float] = {}
    decode_mismatch = 0
    for key, layer in keys.items():
        (call,) = inp.long_calls[key]
        assert call.scores is not None
        sel = canonical_topk(call.indices, topk)
        tensors[f"dsa_topk_{layer}"] = sel
        scores[layer] = call.scores
        margins[f"L{layer}"] = boundary_margin(call.scores, topk)
        steps = inp.decode_calls[key]
        assert len(steps) == NEW_TOKENS, f"{key}: {len(steps)} indexer calls in generate"
        decode_mismatch += int((canonical_topk(steps[0].indices, topk) != sel[:t]).any(-1).sum())
        for i, step in enumerate(steps[1:], start=1):
            got = canonical_topk(step.indices, topk, first_pos=t - 1 + i)
            decode_mismatch += int(not torch.equal(got[0], sel[t - 1 + i]))

    mtp_key = "mtp_block.self_attn.indexer"
    assert set(inp.mtp_calls) == {mtp_key}, f"MTP indexers: {sorted(inp.mtp_calls)}"
    mtp_pass = inp.mtp_calls[mtp_key]
    tensors["mtp_dsa_topk"] = canonical_topk(mtp_pass[0].indices, topk)[: t - 1]
    margins["MTP"] = min(boundary_margin(c.scores, topk) for c in mtp_pass if c.scores is not None)

    with tempfile.TemporaryDirectory() as tmp:
        write_config(cfg, spec, Path(tmp) / "config.json")
        cfg_json = json.loads((Path(tmp) / "config.json").read_text())
    weights = {
        k: v.detach().numpy()
        for k, v in official_state_dict(model, bool(cfg.tie_word_embeddings)).items()
    }
    margins["int4"] = quantized_run(spec, cfg_json, weights, inp.long_ids).margin

    with dense_indexers(model, mtp_layer):
        dense_logits, _ = prefill(model, inp.long_ids)
        dense_mtp = mtp_goldens(mtp_layer, model, inp.prompt, inp.hidden_normed, inp.first_token)
    d_dense = (dense_logits - inp.long_logits).abs().max().item()
    d_dense_mtp = (dense_mtp.logits - inp.mtp_logits).abs().max().item()
    flips = int((dense_logits.argmax(-1) != inp.long_logits.argmax(-1)).sum())

    problems: list[str] = []
    worst = min(margins.values())
    near_tie = worst <= TIE_MARGIN
    if near_tie:
        problems.append(
            "near-tie at the DSA selection boundary (margins "
            + ", ".join(f"{k} {v:.1e}" for k, v in margins.items())
            + ")"
        )
    inconsistent = []
    if decode_mismatch:
        inconsistent.append(f"KV-cached decode selects other keys in {decode_mismatch} rows")
    if min(d_dense, d_dense_mtp) < MIN_DENSE_DIFF:
        problems.append(f"dense attention barely changes the logits ({d_dense}, {d_dense_mtp})")
    notes = [
        f"DSA: index_topk {topk}, full layers {layers} (+ MTP); sparse rows {n - topk}/{n}"
        f" main, {max(t - 1 - topk, 0)}/{t - 1} MTP; generate()'s KV-cached steps select the"
        f" same keys as the long forward in all {len(keys)} x {n} rows",
        "DSA boundary margin (relative, min over sparse rows): "
        + ", ".join(f"{k} {v:.2e}" for k, v in margins.items())
        + f"; min {worst:.2e} (threshold {TIE_MARGIN:g})",
        f"dense attention (index_topk 1e6) moves the logits by up to {d_dense:.2f} (main,"
        f" {flips}/{n} argmax flips) and {d_dense_mtp:.2f} (MTP)",
    ]
    return DsaResult(tensors, notes, problems, near_tie, inconsistent, scores)


@dataclass
class Candidate:
    """A random model with its goldens, before it is accepted and written."""

    seed: int
    model: PreTrainedModel
    mtp_layer: MtpLayer
    prompt: torch.Tensor
    golden: dict[str, torch.Tensor]
    mtp: MtpGolden
    hidden_normed: torch.Tensor
    notes: list[str]
    problems: list[str]
    dsa_scores: dict[int, torch.Tensor] = field(default_factory=dict)  # sparse DSA only


def build_candidate(spec: FixtureSpec, seed: int) -> Candidate:
    """Build one random model from ``seed``, compute its goldens and judge its quality."""
    gen = torch.Generator().manual_seed(seed)
    torch.manual_seed(seed)
    model = build_model(spec, gen)
    cfg = model.config
    mtp_layer = build_mtp_layer(spec, cfg, gen)
    t = spec.prompt_len
    prompt = torch.randint(2, cfg.vocab_size, (t,), generator=gen, dtype=torch.int64)

    logits, hidden = prefill(model, prompt)
    with record_indexers(model) as decode_calls:
        greedy_ids, step_logits = greedy(model, prompt)
    full = torch.cat([prompt, greedy_ids])
    # The teacher-forced forward of greedy_logits (and of the DSA selections). The sparse
    # DSA fixture runs it over prompt + greedy_ids[:-1], the tokens the engine is given; the
    # older fixtures keep the prompt + greedy_ids forward they were generated with.
    long_ids = full[:-1] if spec.sparse_dsa else full
    with record_indexers(model) as long_calls:
        full_logits, _ = prefill(model, long_ids)
    greedy_logits = full_logits[t - 1 : t - 1 + NEW_TOKENS]
    # Self-consistency of transformers' own paths. A failure is an error, except in a seed
    # rejected for a DSA near-tie (there the paths may legitimately select other keys).
    inconsistent: list[str] = []
    if not torch.equal(greedy_logits.argmax(-1), greedy_ids):
        inconsistent.append("greedy_logits argmax != greedy_ids")
    scale = greedy_logits.abs().max().item()
    d_decode = (greedy_logits - step_logits).abs().max().item()
    if d_decode / scale >= TOL_DECODE:
        inconsistent.append(f"prefill vs incremental decode differ by {d_decode}")
    d_prefix = (full_logits[:t] - logits).abs().max().item()
    if d_prefix / scale >= TOL_DECODE:
        inconsistent.append(f"prompt logits depend on later tokens ({d_prefix})")
    hidden_normed = model.model.norm(hidden)
    with record_indexers(mtp_layer) as mtp_calls:
        mtp = mtp_goldens(mtp_layer, model, prompt, hidden_normed, int(greedy_ids[0]))

    used, bias_rows, group_rows = routing_summary(model, full)
    problems: list[str] = []
    distinct = len(set(greedy_ids.tolist()))
    if distinct < MIN_DISTINCT_GREEDY:
        problems.append(f"greedy continuation has only {distinct} distinct tokens")
    n_exp = int(cfg.n_routed_experts)
    for layer, count in used.items():
        if count < MIN_EXPERT_SHARE * n_exp:
            problems.append(f"layer {layer} routes to only {count}/{n_exp} experts")
    if bias_rows == 0:
        problems.append("the correction bias never changes the routing")
    if int(cfg.n_group) > 1 and group_rows == 0:
        problems.append("the group limit never changes the routing")
    notes = [
        f"decode-vs-prefill max|d|={d_decode:.2e} (rel {d_decode / scale:.1e},"
        f" max|logit| {scale:.1f}); prompt rows of the long forward vs prefill"
        f" max|d|={d_prefix:.2e}",
        "experts used over prompt+continuation: "
        + ", ".join(f"L{k}:{v}/{n_exp}" for k, v in sorted(used.items()))
        + f"; rows changed by bias: {bias_rows}, by group limit: {group_rows}",
        f"greedy_ids={greedy_ids.tolist()}",
        f"mtp chain={mtp.chain_ids.tolist()} raw chain={mtp.raw_chain_ids.tolist()}",
    ]
    golden = {
        "prompt_ids": prompt,
        "logits": logits,
        "hidden": hidden,
        "greedy_ids": greedy_ids,
        "greedy_logits": greedy_logits,
        "mtp_logits": mtp.logits,
        "mtp_chain_ids": mtp.chain_ids,
        "mtp_chain_logits": mtp.chain_logits,
        "mtp_chain_raw_ids": mtp.raw_chain_ids,
        "mtp_chain_raw_logits": mtp.raw_chain_logits,
    }
    if spec.sparse_dsa:
        dsa = dsa_goldens(
            spec,
            model,
            mtp_layer,
            DsaInputs(
                prompt=prompt,
                long_ids=long_ids,
                long_logits=full_logits,
                hidden_normed=hidden_normed,
                first_token=int(greedy_ids[0]),
                mtp_logits=mtp.logits,
                long_calls=long_calls,
                decode_calls=decode_calls,
                mtp_calls=mtp_calls,
            ),
        )
        golden.update(dsa.tensors)
        notes.extend(dsa.notes)
        problems.extend(dsa.problems)
        inconsistent.extend(dsa.inconsistent)
        if inconsistent and dsa.near_tie:
            problems.extend(inconsistent)
            inconsistent = []
    assert not inconsistent, "; ".join(inconsistent)
    return Candidate(
        seed,
        model,
        mtp_layer,
        prompt,
        golden,
        mtp,
        hidden_normed,
        notes,
        problems,
        dsa.scores if spec.sparse_dsa else {},
    )
