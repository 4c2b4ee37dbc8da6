"""The fixtures' MTP layer: built beside the main model, run on its hidden states for the MTP
goldens, and checked against transformers' own MTP modules after a reload."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from _fixtures_indexer import canonical_topk, record_indexers
from _fixtures_model import mirror_indexer_heads_, prefill, randomize_, split_experts
from _fixtures_specs import CHAIN_DEPTH, NEW_TOKENS, TOL_DECODE, FixtureSpec
from safetensors.torch import load_file
from torch import nn
from transformers import (
    DeepseekV3ForCausalLM,
    GlmMoeDsaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import MtpLayer, MtpModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaDecoderLayer,
    GlmMoeDsaRMSNorm,
)

if TYPE_CHECKING:  # only annotations: _fixtures_candidate imports this module
    from _fixtures_candidate import Candidate


def mtp_config(cfg: PreTrainedConfig) -> PreTrainedConfig:
    """Config for the one MTP decoder layer (layer index 0 of a 1-layer MoE stack)."""
    mcfg = copy.deepcopy(cfg)
    mcfg.num_hidden_layers = 1
    mcfg.first_k_dense_replace = 0
    if hasattr(mcfg, "mlp_layer_types"):
        mcfg.mlp_layer_types = ["sparse"]
        mcfg.layer_types = ["indexed_attention"]
        mcfg.indexer_types = ["full"]
    return mcfg


class GlmMtpBlock(GlmMoeDsaDecoderLayer):
    """GLM decoder layer returning only the hidden states, as ``MtpLayer`` expects.

    transformers' ``MtpLayer`` calls ``mtp_block(...)`` and uses the result as a tensor;
    ``GlmMoeDsaDecoderLayer`` returns ``(hidden, topk_indices)``. Nothing else differs.
    """

    def forward(self, *args: Any, **kwargs: Any) -> torch.Tensor:  # type: ignore[override]
        """Run the GLM layer and drop the DSA top-k indices."""
        return super().forward(*args, **kwargs)[0]


def build_mtp_layer(spec: FixtureSpec, cfg: PreTrainedConfig, gen: torch.Generator) -> MtpLayer:
    """A random MTP layer built from transformers' ``MtpLayer`` and the family's block."""
    mcfg = mtp_config(cfg)
    mcfg._attn_implementation = "eager"
    if spec.family == "deepseek_v3":
        from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer

        layer = MtpLayer(mcfg, DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0)
    else:
        layer = MtpLayer(mcfg, GlmMtpBlock, GlmMoeDsaRMSNorm, 0)
    layer.to(torch.float32)
    randomize_(layer, gen, tied=False, kv_lora=int(cfg.kv_lora_rank))
    if spec.mirror_indexer_heads:
        mirror_indexer_heads_(layer)
    layer.eval()
    return layer


def mtp_official_tensors(
    layer: MtpLayer, main: PreTrainedModel, index: int
) -> dict[str, torch.Tensor]:
    """MTP tensors under the official checkpoint names ``model.layers.{index}.*``.

    ``post_norm`` is shipped as ``shared_head.norm``; ``embed_tokens`` and
    ``shared_head.head`` are copies of the main model's embedding and lm_head (as in the
    released DeepSeek-V3 / GLM-5 checkpoints; transformers uses the main model's anyway).
    """
    prefix = f"model.layers.{index}."
    out: dict[str, torch.Tensor] = {}
    for name, tensor in split_experts(dict(layer.state_dict())).items():
        if name.startswith("mtp_block."):
            key = name[len("mtp_block.") :]
        elif name.startswith("post_norm."):
            key = "shared_head.norm." + name[len("post_norm.") :]
        else:
            key = name  # enorm / hnorm / eh_proj
        out[prefix + key] = tensor
    out[prefix + "embed_tokens.weight"] = main.model.embed_tokens.weight
    out[prefix + "shared_head.head.weight"] = main.lm_head.weight
    return out


def mtp_forward(
    layer: MtpLayer,
    embeds: torch.Tensor,
    prev_hidden: torch.Tensor,
    positions: torch.Tensor,
    rotary: nn.Module,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Run the MTP layer causally over all rows at once (no cache).

    ``embeds`` [1, S, H] are embed(token) rows, ``prev_hidden`` [1, S, H] the carried hidden
    (already final-normed, as transformers passes it), ``positions`` [1, S] the rope
    positions. Returns ``(z_raw, z_normed)``: the MTP block output before and after
    ``shared_head.norm`` (``MtpLayer.post_norm``). The steps mirror ``MtpLayer.forward``;
    ``check_mtp_forward`` asserts equality with it.
    """
    mcfg = layer.config
    mask = create_causal_mask(
        config=mcfg,
        inputs_embeds=embeds,
        attention_mask=None,
        cache=None,
        position_ids=positions,
        allow_is_causal_skip=False,
    )
    pos_emb = rotary(embeds, position_ids=positions)
    x = layer.eh_proj(torch.cat([layer.enorm(embeds), layer.hnorm(prev_hidden)], dim=-1))
    z_raw = layer.mtp_block(
        x, attention_mask=mask, position_embeddings=pos_emb, position_ids=positions, cache=None
    )
    assert layer.post_norm is not None
    return z_raw, layer.post_norm(z_raw)


def check_mtp_forward(
    layer: MtpLayer,
    embeds: torch.Tensor,
    prev_hidden: torch.Tensor,
    positions: torch.Tensor,
    rotary: nn.Module,
    z_normed: torch.Tensor,
) -> None:
    """Assert that ``mtp_forward`` equals transformers' own ``MtpLayer.forward``."""
    mask = create_causal_mask(
        config=layer.config,
        inputs_embeds=embeds,
        attention_mask=None,
        cache=None,
        position_ids=positions,
        allow_is_causal_skip=False,
    )
    pos_emb = rotary(embeds, position_ids=positions)
    ref = layer(embeds, prev_hidden, pos_emb, mask, positions, None)
    diff = (ref - z_normed).abs().max().item()
    assert diff == 0.0, f"mtp_forward differs from MtpLayer.forward by {diff}"


@dataclass
class MtpGolden:
    """MTP oracle outputs of one fixture."""

    logits: torch.Tensor  # [T-1, V]
    chain_ids: torch.Tensor  # [D]
    chain_logits: torch.Tensor  # [D, V]
    raw_chain_ids: torch.Tensor  # [D]
    raw_chain_logits: torch.Tensor  # [D, V]


@torch.no_grad()
def mtp_goldens(
    layer: MtpLayer,
    main: PreTrainedModel,
    ids: torch.Tensor,
    hidden_normed: torch.Tensor,
    first_token: int,
) -> MtpGolden:
    """Per-position depth-1 MTP logits over the prompt and depth-1..D chains after it.

    Slot p combines embed(ids[p+1]) with the main model's final-normed hidden at p and
    uses rope position p+1 (transformers' convention). The chain starts at the last prompt
    position with the main model's greedy token and feeds back each draft: ``chain``
    carries ``shared_head.norm(z)`` (transformers' multi-layer convention), ``raw_chain``
    carries the un-normed ``z`` (vLLM's convention). Both re-run the MTP layer over all
    rows, which equals a KV-cached run since attention is causal.
    """
    rotary = main.model.rotary_emb
    embed = main.model.embed_tokens
    head = main.lm_head
    t = ids.shape[0]
    tokens = torch.cat([ids, torch.tensor([first_token])])
    embeds = embed(tokens[1 : t + 1])[None]  # slots 0..T-1
    prev = hidden_normed[:t][None]
    positions = torch.arange(1, t + 1)[None]

    z_raw, z_norm = mtp_forward(layer, embeds, prev, positions, rotary)
    check_mtp_forward(layer, embeds, prev, positions, rotary, z_norm)
    per_pos = head(z_norm[0, : t - 1])

    def chain(carry_raw: bool) -> tuple[torch.Tensor, torch.Tensor]:
        e, h, pos = embeds, prev, positions
        zr, zn = z_raw, z_norm
        out_ids: list[int] = []
        out_logits: list[torch.Tensor] = []
        for depth in range(CHAIN_DEPTH):
            if depth > 0:
                zr, zn = mtp_forward(layer, e, h, pos, rotary)
            lg = head(zn[0, -1])
            d = int(torch.argmax(lg).item())
            out_ids.append(d)
            out_logits.append(lg)
            carry = zr[:, -1:] if carry_raw else zn[:, -1:]
            e = torch.cat([e, embed(torch.tensor([[d]]))], dim=1)
            h = torch.cat([h, carry], dim=1)
            pos = torch.cat([pos, pos[:, -1:] + 1], dim=1)
        return torch.tensor(out_ids, dtype=torch.int64), torch.stack(out_logits)

    c_ids, c_logits = chain(carry_raw=False)
    r_ids, r_logits = chain(carry_raw=True)
    return MtpGolden(per_pos, c_ids, c_logits, r_ids, r_logits)


@torch.no_grad()
def check_with_transformers_mtp(
    fixture_dir: Path, ids: torch.Tensor, gold: MtpGolden, hidden_normed: torch.Tensor
) -> str:
    """Load the written checkpoint's MTP layer with transformers' ``MtpModel`` and compare.

    Also runs ``generate(use_mtp=True)``, captures the first draft's logits and checks
    them against ``mtp_chain_logits[0]``, and checks that MTP greedy decoding emits the
    same tokens as plain greedy decoding. Only DeepSeek-V3 is supported by transformers.
    """
    main = DeepseekV3ForCausalLM.from_pretrained(
        fixture_dir, dtype=torch.float32, attn_implementation="eager"
    )
    main.eval()
    n = main.config.num_hidden_layers
    # The class pattern names layer 61 (the real model); point it at this checkpoint's MTP layer.
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\."]
    mtp = MtpModel.from_pretrained(main, device_map={"": "cpu"})
    mtp.eval()
    t = ids.shape[0]
    z = mtp.forward_layer(
        0,
        hidden_normed[None, : t - 1],
        torch.arange(1, t)[None],
        None,
        input_ids=ids[None, 1:t],
    )
    per_pos = mtp._project_to_logits(z)[0]
    d1 = (per_pos - gold.logits).abs().max().item()
    assert d1 < 1e-5, f"MtpModel per-position logits differ by {d1}"

    captured: list[torch.Tensor] = []
    real_forward = MtpModel.forward

    def spy(self: MtpModel, *args: Any, **kwargs: Any) -> Any:
        res = real_forward(self, *args, **kwargs)
        captured.append(res[1].detach().clone())
        return res

    MtpModel.forward = spy  # type: ignore[method-assign]
    try:
        out = main.generate(
            ids[None],
            max_new_tokens=NEW_TOKENS,
            do_sample=False,
            use_mtp=True,
            eos_token_id=None,
            pad_token_id=0,
        )
    finally:
        MtpModel.forward = real_forward  # type: ignore[method-assign]
    plain = main.generate(
        ids[None], max_new_tokens=NEW_TOKENS, do_sample=False, eos_token_id=None, pad_token_id=0
    )
    assert torch.equal(out, plain), "generate(use_mtp=True) differs from plain greedy"
    first = captured[0][0, 0]
    d2 = (first - gold.chain_logits[0]).abs().max().item()
    assert d2 < 1e-5, f"generate(use_mtp=True) first draft logits differ by {d2}"
    return f"MtpModel per-pos max|d|={d1:.2e}, generate(use_mtp) first draft max|d|={d2:.2e}"


@torch.no_grad()
def reload_glm_mtp(
    spec: FixtureSpec,
    fixture_dir: Path,
    cfg: PreTrainedConfig,
    reloaded: PreTrainedModel,
    cand: Candidate,
) -> str:
    """Rebuild the GLM MTP layer from the written official names and recompute its goldens.

    transformers has no GLM MTP loader, so this inverts ``mtp_official_tensors`` with the
    same renaming transformers' ``MtpModel`` applies to DeepSeek-V3 checkpoints
    (``layers.N.X`` -> ``mtp_block.X``; ``shared_head.norm`` -> ``post_norm``; ``enorm``,
    ``hnorm``, ``eh_proj`` unchanged) and loads it strictly.
    """
    n = int(cfg.num_hidden_layers)
    prefix = f"model.layers.{n}."
    written = load_file(str(fixture_dir / "model.safetensors"))
    state: dict[str, torch.Tensor] = {}
    for key, tensor in written.items():
        if not key.startswith(prefix):
            continue
        rest = key[len(prefix) :]
        if rest in ("embed_tokens.weight", "shared_head.head.weight"):
            shared = (
                reloaded.get_input_embeddings() if rest.startswith("embed") else reloaded.lm_head
            )
            assert isinstance(shared.weight, torch.Tensor)
            assert torch.equal(tensor, shared.weight), f"{key} is not a copy of the main tensor"
            continue
        if rest.startswith(("enorm.", "hnorm.", "eh_proj.")):
            state[rest] = tensor
        elif rest.startswith("shared_head.norm."):
            state["post_norm." + rest[len("shared_head.norm.") :]] = tensor
        else:
            state["mtp_block." + rest] = tensor
    layer = build_mtp_layer(spec, cfg, torch.Generator().manual_seed(0))
    fused = {}
    for key in list(state):
        if ".mlp.experts." in key:
            continue
        fused[key] = state[key]
    experts = int(cfg.n_routed_experts)
    base = "mtp_block.mlp.experts."
    fused[base + "gate_up_proj"] = torch.stack(
        [
            torch.cat([state[f"{base}{e}.gate_proj.weight"], state[f"{base}{e}.up_proj.weight"]])
            for e in range(experts)
        ]
    )
    fused[base + "down_proj"] = torch.stack(
        [state[f"{base}{e}.down_proj.weight"] for e in range(experts)]
    )
    layer.load_state_dict(fused, strict=True)
    _, hidden = prefill(reloaded, cand.prompt)
    with record_indexers(layer) as calls:
        gold = mtp_goldens(
            layer,
            reloaded,
            cand.prompt,
            reloaded.model.norm(hidden),
            int(cand.golden["greedy_ids"][0]),
        )
    if "mtp_dsa_topk" in cand.golden:
        first = calls["mtp_block.self_attn.indexer"][0]
        got = canonical_topk(first.indices, int(cfg.index_topk))[: cand.prompt.shape[0] - 1]
        assert torch.equal(got, cand.golden["mtp_dsa_topk"]), "rebuilt MTP selects other keys"
    diff = max(
        (gold.logits - cand.mtp.logits).abs().max().item(),
        (gold.chain_logits - cand.mtp.chain_logits).abs().max().item(),
        (gold.raw_chain_logits - cand.mtp.raw_chain_logits).abs().max().item(),
    )
    scale = cand.mtp.logits.abs().max().item()
    assert diff / scale < TOL_DECODE, f"GLM MTP from the written checkpoint differs by {diff}"
    return f"GLM MTP (MtpLayer + GLM block) rebuilt from the checkpoint: max|d|={diff:.2e}"


@torch.no_grad()
def check_glm_with_transformers_mtp(fixture_dir: Path, cand: Candidate) -> str:
    """Load a GLM fixture's MTP layer with transformers' ``MtpModel`` and compare.

    ``GlmMoeDsaConfig`` lacks what ``get_mtp_config`` needs; with ``num_mtp_layers`` 1,
    ``mtp_layer_types`` ["full_attention"] (``"indexed_attention"`` makes
    ``create_masks_for_mtp_layer`` raise KeyError) and ``mtp_mlp_layer_types`` ["sparse"]
    set by hand, and the block's ``(hidden, topk_indices)`` output reduced to the hidden
    (``GlmMtpBlock``), ``MtpModel.from_pretrained`` loads the written MTP tensors and its
    ``forward_layer`` must reproduce ``mtp_logits`` (and ``mtp_dsa_topk``). Its config keeps
    the main ``indexer_types``; the MTP layer is built with layer_idx 0 and so runs its own
    indexer when element 0 is "full" (asserted).
    """
    main = GlmMoeDsaForCausalLM.from_pretrained(
        fixture_dir, dtype=torch.float32, attn_implementation="eager"
    )
    main.eval()
    n = main.config.num_hidden_layers
    main.config.num_mtp_layers = 1
    main.config.mtp_layer_types = ["full_attention"]
    main.config.mtp_mlp_layer_types = ["sparse"]
    main._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\."]
    mtp = MtpModel.from_pretrained(main, device_map={"": "cpu"})
    mtp.eval()
    assert mtp.config.indexer_types == main.config.indexer_types
    block = mtp.layers[0].mtp_block
    assert isinstance(block, GlmMoeDsaDecoderLayer)
    assert main.config.indexer_types[0] == "full" and block.self_attn.indexer is not None
    block.__class__ = GlmMtpBlock
    ids, t = cand.prompt, cand.prompt.shape[0]
    _, hidden = prefill(main, ids)
    with record_indexers(mtp) as calls:
        z = mtp.forward_layer(
            0,
            main.model.norm(hidden)[None, : t - 1],
            torch.arange(1, t)[None],
            None,
            input_ids=ids[None, 1:t],
        )
    per_pos = mtp._project_to_logits(z)[0]
    diff = (per_pos - cand.mtp.logits).abs().max().item()
    assert diff < 1e-5, f"MtpModel per-position logits differ by {diff}"
    if "mtp_dsa_topk" in cand.golden:
        (call,) = calls["layers.0.mtp_block.self_attn.indexer"]
        got = canonical_topk(call.indices, int(main.config.index_topk))
        assert torch.equal(got, cand.golden["mtp_dsa_topk"]), "MtpModel selects other keys"
    return f"transformers' MtpModel (GLM, patched config) per-pos max|d|={diff:.2e}"
