#!/usr/bin/env python3
"""Build tiny random DeepSeek-V3 / GLM-MoE-DSA checkpoints and their golden outputs.

Developer tool only: it needs torch and transformers (run it with /opt/devvenv/bin/python).
Tests and CI never import it; they read the committed files under ``tests/fixtures/``.

For every fixture it writes ``<out>/<name>/config.json``, ``model.safetensors`` (F32, the
official per-expert tensor names, MTP layer at index ``num_hidden_layers``) and
``golden.safetensors`` (prompt, prefill logits, greedy continuation, MTP drafts; for the
sparse DSA fixture the indexer's selections), and ``golden_int4.safetensors``
(transformers' logits on the dequantised weights of the default ``colibri convert``
container). Every number is computed by transformers' own modules; docs/fixtures.md
documents each tensor. A full run also writes ``dsa_indexer_types.json`` (what
``GlmMoeDsaConfig`` derives as ``indexer_types`` from a few configs).

Usage::

    /opt/devvenv/bin/python tools/make_fixtures.py --out tests/fixtures
    /opt/devvenv/bin/python tools/make_fixtures.py --out /tmp/fx --only glm_dsa
    /opt/devvenv/bin/python tools/make_fixtures.py --out tests/fixtures --quantized-goldens
    /opt/devvenv/bin/python tools/make_fixtures.py --indexer-types-json PATH
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.numpy import load_file as np_load_file
from safetensors.torch import load_file, save_file
from torch import nn
from torch.nn import functional as F
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.masking_utils import create_causal_mask
from transformers.modeling_layers import MtpLayer, MtpModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RMSNorm
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import (
    GlmMoeDsaDecoderLayer,
    GlmMoeDsaIndexer,
    GlmMoeDsaRMSNorm,
    apply_rotary_pos_emb_interleave,
)
from transformers.utils import logging as transformers_logging

PROMPT_LEN = 12  # default prompt length T (FixtureSpec.prompt_len)
NEW_TOKENS = 32
CHAIN_DEPTH = 3
SEED = 20260529
# Tolerances of the self-consistency checks (float32 throughout); TOL_DECODE is relative
# to the largest |logit|.
TOL_DECODE = 1e-5
TOL_RELOAD = 1e-6
# The float64 numpy reference against the float32 goldens (absolute, logits up to ~15).
TOL_NUMPY = 1e-4
# Quality bar for a random model (a seed that misses it is skipped, deterministically).
MIN_DISTINCT_GREEDY = 12
MIN_EXPERT_SHARE = 0.75
MAX_ATTEMPTS = 20
# DSA fixtures (index_topk below the contexts): the index_topk-th and (index_topk+1)-th
# largest visible index scores of every sparse row must differ by more than TIE_MARGIN,
# relative to the row's max|score| (torch's CPU topk breaks exact ties in an
# implementation-defined order; the engine breaks them toward the lower index; f32
# deviates from a float64 forward by up to 5e-6 of max|score|). 1e-3 is out of reach: the
# gap is an order-statistic spacing of 9-71 scores, below 1e-3 in 3.3 % of rows, and ~290
# rows are checked (docs/fixtures.md). Attending densely instead must move the logits by at
# least MIN_DENSE_DIFF.
TIE_MARGIN = 2e-4
MIN_DENSE_DIFF = 0.1


@dataclass(frozen=True)
class FixtureSpec:
    """One tiny checkpoint: its family, config overrides and the branches it exercises."""

    name: str
    family: str  # "deepseek_v3" | "glm_moe_dsa"
    config: dict[str, Any]
    covers: list[str] = field(default_factory=list)
    prompt_len: int = PROMPT_LEN
    # Negate the second half of every indexer's query heads (``mirror_indexer_heads_``).
    mirror_indexer_heads: bool = False

    @property
    def sparse_dsa(self) -> bool:
        """True when DSA keeps fewer keys than some context of the goldens (GLM only)."""
        topk = self.config.get("index_topk")
        return self.family == "glm_moe_dsa" and topk is not None and topk < self.max_context

    @property
    def max_context(self) -> int:
        """Longest main-model context in the goldens: prompt + continuation - 1."""
        return self.prompt_len + NEW_TOKENS - 1


COMMON: dict[str, Any] = {
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "max_position_embeddings": 256,
    "hidden_act": "silu",
    "attention_bias": False,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "num_nextn_predict_layers": 1,
}

SPECS: list[FixtureSpec] = [
    FixtureSpec(
        name="dsv3_a",
        family="deepseek_v3",
        config={
            **COMMON,
            "vocab_size": 256,
            "moe_intermediate_size": 16,
            "q_lora_rank": 48,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 4,
            "topk_group": 2,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "rms_norm_eps": 1e-6,
            "tie_word_embeddings": False,
            "rope_interleave": True,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            },
        },
        covers=[
            "q_lora_rank set (q_a_proj/q_a_layernorm/q_b_proj)",
            "first_k_dense_replace=1 (layer 0 dense, layers 1-2 MoE)",
            "noaux_tc with non-zero e_score_correction_bias",
            "group-limited routing: 16 experts, n_group=4, topk_group=2, top-4",
            "norm_topk_prob=true, routed_scaling_factor=2.5, 1 shared expert",
            "YaRN rope (factor 4, mscale=mscale_all_dim=1.0, as DeepSeek-V3 ships)",
            "rope_interleave=true, untied lm_head, rms_norm_eps=1e-6",
            "MTP layer (oracle: transformers' MtpModel)",
        ],
    ),
    FixtureSpec(
        name="dsv3_b",
        family="deepseek_v3",
        config={
            **COMMON,
            "vocab_size": 320,
            "moe_intermediate_size": 24,
            "q_lora_rank": None,
            "n_routed_experts": 8,
            "num_experts_per_tok": 2,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 2,
            "norm_topk_prob": False,
            "routed_scaling_factor": 1.5,
            "first_k_dense_replace": 2,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_interleave": False,
            "rope_theta": 5000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 8.0,
                "mscale": 0.8,
                "mscale_all_dim": 0.6,
                "original_max_position_embeddings": 32,
                "beta_fast": 16,
                "beta_slow": 2,
            },
        },
        covers=[
            "q_lora_rank=null (plain q_proj)",
            "first_k_dense_replace=2 of 4 layers",
            "n_group=1 (no group limit), 8 experts top-2",
            "norm_topk_prob=false, routed_scaling_factor=1.5, n_shared_experts=2",
            "YaRN with mscale != mscale_all_dim (cos/sin attention_factor != 1,"
            " softmax scale x mscale(mscale_all_dim)^2)",
            "rope_interleave=false (half-split rope), tied embeddings (no lm_head tensor)",
            "rms_norm_eps=1e-5 while q_a/kv_a layernorms keep eps 1e-6",
            "MTP layer (oracle: transformers' MtpModel)",
        ],
    ),
    FixtureSpec(
        name="glm_a",
        family="glm_moe_dsa",
        config={
            **COMMON,
            "vocab_size": 256,
            "moe_intermediate_size": 16,
            "q_lora_rank": 48,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 2,
        },
        covers=[
            "glm_moe_dsa: q_lora_rank set (mandatory), interleaved rope (always)",
            "plain rope (no rope_scaling)",
            "first_k_dense_replace=1, 16 experts top-4, n_group=1",
            "norm_topk_prob=true, routed_scaling_factor=2.5, 1 shared expert",
            "DSA indexer tensors present; index_topk=64 > every context used (exact dense)",
            "rms_norm_eps=1e-5 while q_a/kv_a layernorms keep eps 1e-6",
            "MTP layer (oracle: transformers' MtpLayer + GLM decoder layer, see docs)",
        ],
    ),
    FixtureSpec(
        name="glm_b",
        family="glm_moe_dsa",
        config={
            **COMMON,
            "vocab_size": 256,
            "moe_intermediate_size": 16,
            "q_lora_rank": 32,
            "n_routed_experts": 8,
            "num_experts_per_tok": 3,
            "n_group": 2,
            "topk_group": 1,
            "n_shared_experts": 1,
            "norm_topk_prob": False,
            "routed_scaling_factor": 2.0,
            "first_k_dense_replace": 1,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": True,
            "rope_theta": 10000.0,
            "rope_scaling": {
                "type": "yarn",
                "factor": 4.0,
                "mscale": 1.0,
                "mscale_all_dim": 0.8,
                "original_max_position_embeddings": 64,
                "beta_fast": 32,
                "beta_slow": 1,
            },
            "index_topk": 64,
            "index_head_dim": 16,
            "index_n_heads": 2,
        },
        covers=[
            "glm_moe_dsa with group-limited routing (n_group=2, topk_group=1), top-3 of 8",
            "norm_topk_prob=false, routed_scaling_factor=2.0, tied embeddings",
            "YaRN rope on the interleaved GLM layout (mscale != mscale_all_dim)",
            "MTP layer (oracle: transformers' MtpLayer + GLM decoder layer, see docs)",
        ],
    ),
    FixtureSpec(
        name="glm_dsa",
        family="glm_moe_dsa",
        config={
            **COMMON,
            "vocab_size": 256,
            "moe_intermediate_size": 16,
            "q_lora_rank": 48,
            "n_routed_experts": 16,
            "num_experts_per_tok": 4,
            "n_group": 1,
            "topk_group": 1,
            "n_shared_experts": 1,
            "norm_topk_prob": True,
            "routed_scaling_factor": 2.5,
            "first_k_dense_replace": 1,
            "num_hidden_layers": 4,
            "rms_norm_eps": 1e-5,
            "tie_word_embeddings": False,
            "rope_theta": 10000.0,
            "index_topk": 8,
            "index_head_dim": 16,
            "index_n_heads": 4,
            "indexer_types": ["full", "shared", "full", "shared"],
        },
        covers=[
            "DSA sparse: index_topk=8 < most contexts (T=40, contexts up to 71 tokens)",
            "indexer_types full/shared/full/shared (layers 1, 3 reuse the previous selection)",
            "indexer: 4 heads x 16 dims, interleaved rope on the first 8 dims; query heads"
            " 2, 3 = -(heads 0, 1), so no key scores exactly 0 (no exact ties)",
            "MTP layer with its own indexer over its own rows (indexer_types ['full'])",
            "goldens: per-layer selections dsa_topk_L, mtp_dsa_topk, int4_dsa_topk_L",
        ],
        prompt_len=40,
        mirror_indexer_heads=True,
    ),
]


# --------------------------------------------------------------------------------------
# model construction


def build_config(spec: FixtureSpec) -> PreTrainedConfig:
    """Instantiate the transformers config of a fixture."""
    kwargs = copy.deepcopy(spec.config)
    if spec.family == "deepseek_v3":
        cfg: PreTrainedConfig = DeepseekV3Config(**kwargs)
        cfg.architectures = ["DeepseekV3ForCausalLM"]
    else:
        cfg = GlmMoeDsaConfig(**kwargs)
        cfg.architectures = ["GlmMoeDsaForCausalLM"]
    cfg._attn_implementation = "eager"
    return cfg


def model_class(spec: FixtureSpec) -> type[PreTrainedModel]:
    """The transformers causal-LM class of a fixture's family."""
    return DeepseekV3ForCausalLM if spec.family == "deepseek_v3" else GlmMoeDsaForCausalLM


def randomize_(module: nn.Module, gen: torch.Generator, tied: bool, kv_lora: int) -> None:
    """Overwrite every weight with seeded values that give non-degenerate activations.

    Matrices get N(0, 1/fan_in) (unit gain), router weights N(0, 4/fan_in) (spread sigmoid
    scores), norms 1 + 0.1 N(0, 1), LayerNorm biases 0.1 N(0, 1), the router correction bias
    0.05 N(0, 1), the embedding N(0, 0.4^2) and an untied lm_head N(0, 9/H), so logits
    spread over a few units. ``q_a_proj`` and the latent rows of ``kv_a_proj_with_mqa`` are
    10x smaller: their outputs feed RMSNorms with eps 1e-6, and small inputs make an engine
    that uses ``rms_norm_eps`` there visibly wrong.
    """

    def normal(shape: torch.Size, std: float) -> torch.Tensor:
        return torch.randn(shape, generator=gen, dtype=torch.float32) * std

    with torch.no_grad():
        for name, tensor in sorted(module.state_dict(keep_vars=True).items()):
            shape = tensor.shape
            if name.endswith("embed_tokens.weight"):
                value = normal(shape, 0.4)
            elif name == "lm_head.weight":
                if tied:
                    continue
                value = normal(shape, 3.0 / math.sqrt(shape[1]))
            elif name.endswith("e_score_correction_bias"):
                value = normal(shape, 0.05)
            elif name.endswith("mlp.gate.weight"):  # router: spread sigmoid scores
                value = normal(shape, 2.0 / math.sqrt(shape[1]))
            elif "norm" in name and name.endswith(".bias"):
                value = normal(shape, 0.1)
            elif "norm" in name and tensor.dim() == 1:
                value = 1.0 + normal(shape, 0.1)
            elif name.endswith("q_a_proj.weight"):
                value = normal(shape, 0.1 / math.sqrt(shape[1]))
            elif name.endswith("kv_a_proj_with_mqa.weight"):
                value = normal(shape, 1.0 / math.sqrt(shape[1]))
                value[:kv_lora] *= 0.1
            elif tensor.dim() == 3:  # fused experts [E, out, in]
                value = normal(shape, 1.0 / math.sqrt(shape[2]))
            elif tensor.dim() == 2:
                value = normal(shape, 1.0 / math.sqrt(shape[1]))
            else:
                raise ValueError(f"unexpected tensor {name} {tuple(shape)}")
            tensor.copy_(value)


@torch.no_grad()
def mirror_indexer_heads_(module: nn.Module) -> None:
    """Make indexer query head h + n/2 the negative of head h (wq_b rows), in every indexer.

    Then relu(q_h . k) and relu(-q_h . k) cannot both be 0, so no key gets an index score of
    exactly 0 from all heads. With independent random heads about 1 key in 16 does, and
    rows with fewer than ``index_topk`` positive scores then tie at 0 on the selection
    boundary (every seed tried had such rows); this removes those exact ties by
    construction. Each head keeps its own ``weights_proj`` weight, so the per-head relu and
    weighting are still exercised.
    """
    for mod in module.modules():
        if isinstance(mod, GlmMoeDsaIndexer):
            assert mod.n_heads % 2 == 0
            w = mod.wq_b.weight.view(mod.n_heads, mod.head_dim, -1)
            w[mod.n_heads // 2 :] = -w[: mod.n_heads // 2]


def build_model(spec: FixtureSpec, gen: torch.Generator) -> PreTrainedModel:
    """Create the random float32 model of a fixture in eval mode."""
    cfg = build_config(spec)
    model = model_class(spec)(cfg)
    model.to(torch.float32)  # type: ignore[arg-type]
    randomize_(model, gen, bool(cfg.tie_word_embeddings), int(cfg.kv_lora_rank))
    if spec.mirror_indexer_heads:
        mirror_indexer_heads_(model)
    if cfg.tie_word_embeddings:
        model.tie_weights()
        assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    model.eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    return model


# --------------------------------------------------------------------------------------
# MTP layer


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


# --------------------------------------------------------------------------------------
# checkpoint I/O


def split_experts(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Replace transformers' fused expert tensors by the official per-expert names.

    ``experts.gate_up_proj`` [E, 2I, H] holds gate rows then up rows per expert (the
    forward does ``chunk(2)``); ``experts.down_proj`` is [E, H, I].
    """
    out: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        if name.endswith("mlp.experts.gate_up_proj"):
            base = name[: -len("gate_up_proj")]
            inter = tensor.shape[1] // 2
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.gate_proj.weight"] = tensor[e, :inter]
                out[f"{base}{e}.up_proj.weight"] = tensor[e, inter:]
        elif name.endswith("mlp.experts.down_proj"):
            base = name[: -len("down_proj")]
            for e in range(tensor.shape[0]):
                out[f"{base}{e}.down_proj.weight"] = tensor[e]
        else:
            out[name] = tensor
    return out


def official_state_dict(model: PreTrainedModel, tied: bool) -> dict[str, torch.Tensor]:
    """Main-model tensors under official names (per-expert; no lm_head when tied)."""
    state = dict(model.state_dict())
    if tied:
        state.pop("lm_head.weight", None)
    return split_experts(state)


def write_config(cfg: PreTrainedConfig, spec: FixtureSpec, path: Path) -> None:
    """Write config.json: transformers' own dict plus the legacy keys released configs use."""
    data = cfg.to_dict()
    for noisy in (
        "id2label",
        "label2id",
        "_name_or_path",
        "output_hidden_states",
        "output_attentions",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "problem_type",
        "dtype",
        "_attn_implementation",
    ):
        data.pop(noisy, None)
    # Derived by transformers' __post_init__ (qk_head_dim = nope + rope; head_dim is set to
    # qk_rope_head_dim). Released DeepSeek-V3 configs have neither; GLM-5's has head_dim.
    data.pop("qk_head_dim", None)
    if spec.family == "deepseek_v3":
        data.pop("head_dim", None)
    data["architectures"] = list(cfg.architectures or [])
    data["model_type"] = spec.family
    data["num_nextn_predict_layers"] = 1
    data["torch_dtype"] = "float32"
    # Released DeepSeek-V3 / GLM-5 configs carry rope_theta (+ rope_scaling) at top level.
    data["rope_theta"] = spec.config["rope_theta"]
    if "rope_scaling" in spec.config:
        data["rope_scaling"] = dict(spec.config["rope_scaling"])
    path.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")


def save_tensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """Save contiguous CPU copies of ``tensors`` as safetensors, byte-for-byte reproducibly.

    Only one metadata key is written: safetensors serialises the metadata map in hash
    order, so several keys would make the header bytes differ between runs.
    """
    ordered = {k: tensors[k].detach().to("cpu").contiguous().clone() for k in sorted(tensors)}
    save_file(ordered, str(path), metadata={"format": "pt"})


# --------------------------------------------------------------------------------------
# goldens


@torch.no_grad()
def prefill(model: PreTrainedModel, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [S, V] and final pre-norm hidden states [S, H] of one full forward."""
    captured: list[torch.Tensor] = []

    def hook(_m: nn.Module, args: tuple[torch.Tensor, ...]) -> None:
        captured.append(args[0].detach().clone())

    handle = model.model.norm.register_forward_pre_hook(hook)
    try:
        out = model(input_ids=ids[None], use_cache=False)
    finally:
        handle.remove()
    return out.logits[0].float(), captured[0][0]


@torch.no_grad()
def greedy(model: PreTrainedModel, prompt: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' greedy continuation (use_cache=True) and its per-step decode logits."""
    out = model.generate(  # type: ignore[operator]
        prompt[None],
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        do_sample=False,
        use_cache=True,
        output_logits=True,
        return_dict_in_generate=True,
        eos_token_id=None,
        pad_token_id=0,
    )
    new_ids = out.sequences[0, prompt.shape[0] :]
    step_logits = torch.stack([lg[0] for lg in out.logits]).float()
    return new_ids, step_logits


# --------------------------------------------------------------------------------------
# DSA selections (GLM's lightning indexer)


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


# --------------------------------------------------------------------------------------
# independent numpy reference (the spec in docs/fixtures.md, written without transformers)


class NumpyReference:
    """Float64 numpy forward of a fixture directory, following docs/fixtures.md literally.

    It reads only ``config.json`` and ``model.safetensors`` and shares no code with
    transformers, so agreement with the goldens shows the written spec is complete.
    ``weights`` replaces the tensors of ``model.safetensors`` (the dequantised container).
    """

    def __init__(self, fixture_dir: Path, weights: dict[str, np.ndarray] | None = None) -> None:
        """Load the config and all tensors (as float64)."""
        self.cfg: dict[str, Any] = json.loads((fixture_dir / "config.json").read_text())
        if weights is None:
            weights = np_load_file(str(fixture_dir / "model.safetensors"))
        raw = weights
        self.w: dict[str, np.ndarray] = {k: v.astype(np.float64) for k, v in raw.items()}
        c = self.cfg
        self.n_layers = int(c["num_hidden_layers"])
        self.glm = c["model_type"] == "glm_moe_dsa"
        # DSA (GLM): "full" layers run their own indexer, "shared" ones reuse the previous
        # full layer's selection; the MTP layer always has its own indexer.
        self.index_topk = int(c.get("index_topk") or 0)
        self.idx_heads = int(c.get("index_n_heads") or 0)
        self.idx_dim = int(c.get("index_head_dim") or 0)
        self.indexer_types: list[str] = list(c.get("indexer_types") or ["full"] * self.n_layers)
        self.index_scores: dict[str, np.ndarray] = {}  # per layer prefix, from the last call
        self.shared_dense = False  # a deliberately wrong variant: "shared" layers attend densely
        self.interleave = True if self.glm else bool(c.get("rope_interleave", True))
        self.eps = float(c["rms_norm_eps"])
        self.heads = int(c["num_attention_heads"])
        self.nope = int(c["qk_nope_head_dim"])
        self.rope = int(c["qk_rope_head_dim"])
        self.v_dim = int(c["v_head_dim"])
        self.kv_lora = int(c["kv_lora_rank"])
        rp = dict(c.get("rope_parameters") or c.get("rope_scaling") or {})
        theta = float(rp.get("rope_theta", c.get("rope_theta", 10000.0)))
        kind = rp.get("rope_type", rp.get("type", "default"))
        d = self.rope
        base = theta ** (-np.arange(0, d, 2, dtype=np.float64) / d)
        self.attn_factor = 1.0
        self.scaling = (self.nope + self.rope) ** -0.5
        if kind == "yarn":
            f = float(rp["factor"])
            l0 = float(rp["original_max_position_embeddings"])

            def m(scale: float, ms: float) -> float:
                return 1.0 if scale <= 1 else 0.1 * ms * math.log(scale) + 1.0

            def corr(rot: float) -> float:
                return d * math.log(l0 / (rot * 2 * math.pi)) / (2 * math.log(theta))

            low: float = max(math.floor(corr(float(rp.get("beta_fast") or 32))), 0)
            high: float = min(math.ceil(corr(float(rp.get("beta_slow") or 1))), d - 1)
            if low == high:
                high = high + 0.001
            ramp = np.clip((np.arange(d // 2, dtype=np.float64) - low) / (high - low), 0, 1)
            base = base / f * ramp + base * (1 - ramp)
            ms, ms_all = rp.get("mscale"), rp.get("mscale_all_dim")
            self.attn_factor = m(f, ms) / m(f, ms_all) if ms and ms_all else m(f, 1.0)
            if ms_all:
                self.scaling *= m(f, float(ms_all)) ** 2
        self.inv_freq = base
        self.embed = self.w["model.embed_tokens.weight"]
        self.head = self.w.get("lm_head.weight", self.embed)

    @staticmethod
    def rmsnorm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
        """w * x / sqrt(mean(x^2) + eps) over the last axis."""
        return w * x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)

    def rotate(self, x: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """RoPE on [S, heads, d] at positions [S] (output in the de-interleaved layout)."""
        ang = pos[:, None].astype(np.float64) * self.inv_freq[None, :]
        cos = (np.cos(ang) * self.attn_factor)[:, None, :]
        sin = (np.sin(ang) * self.attn_factor)[:, None, :]
        if self.interleave:
            a, b = x[..., 0::2], x[..., 1::2]
        else:
            a, b = x[..., : self.rope // 2], x[..., self.rope // 2 :]
        return np.concatenate([a * cos - b * sin, b * cos + a * sin], axis=-1)

    def indexer(self, p: str, x: np.ndarray, qa: np.ndarray, pos: np.ndarray) -> np.ndarray:
        """DSA lightning indexer: the keys each row keeps, as a bool mask [S, S].

        q = wq_b(qa) per head, k = LayerNorm(wk x) (eps 1e-6, weight + bias), both with
        interleaved rope on their first ``qk_rope_head_dim`` dims; score[s, t] =
        sum_h weights_proj(x)[h] * heads^-0.5 * relu(q_h . k_t * dim^-0.5); row s keeps the
        ``index_topk`` best of keys 0..s (ties toward the lower index).
        """
        w, s, r = self.w, x.shape[0], self.rope
        pre = p + "self_attn.indexer."
        q = (qa @ w[pre + "wq_b.weight"].T).reshape(s, self.idx_heads, self.idx_dim)
        q = np.concatenate([self.rotate(q[..., :r], pos), q[..., r:]], axis=-1)
        k = x @ w[pre + "wk.weight"].T
        k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
        k = k * w[pre + "k_norm.weight"] + w[pre + "k_norm.bias"]
        k = np.concatenate([self.rotate(k[:, None, :r], pos)[:, 0], k[:, r:]], axis=-1)
        head_scores = np.maximum(np.einsum("shd,td->sht", q, k) * self.idx_dim**-0.5, 0.0)
        weights = (x @ w[pre + "weights_proj.weight"].T) * self.idx_heads**-0.5
        scores = np.einsum("sh,sht->st", weights, head_scores)
        self.index_scores[p] = scores
        keep = np.zeros((s, s), dtype=bool)
        for row in range(s):
            keep[row, np.argsort(-scores[row, : row + 1], kind="stable")[: self.index_topk]] = True
        return keep

    def attention(
        self, p: str, x: np.ndarray, pos: np.ndarray, keep: np.ndarray | None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """Causal MLA over all S rows (keys expanded through kv_b), DSA-masked for GLM.

        ``keep`` is the previous full layer's selection (used by "shared" layers); returns
        the output and the selection this layer used.
        """
        w, s = self.w, x.shape[0]
        if p + "self_attn.q_a_proj.weight" in w:
            qa = x @ w[p + "self_attn.q_a_proj.weight"].T
            qa = self.rmsnorm(qa, w[p + "self_attn.q_a_layernorm.weight"], 1e-6)
            q = qa @ w[p + "self_attn.q_b_proj.weight"].T
        else:
            qa = None
            q = x @ w[p + "self_attn.q_proj.weight"].T
        mask = keep
        if p + "self_attn.indexer.wq_b.weight" in w:
            assert qa is not None, "GLM always has q_a_proj"
            keep = mask = self.indexer(p, x, qa, pos)
        elif self.glm:
            assert keep is not None, f"{p}: a shared DSA layer needs a previous full layer"
            if self.shared_dense:
                mask = None
        q = q.reshape(s, self.heads, self.nope + self.rope)
        q_nope, q_rot = q[..., : self.nope], self.rotate(q[..., self.nope :], pos)
        c = x @ w[p + "self_attn.kv_a_proj_with_mqa.weight"].T
        latent = self.rmsnorm(c[:, : self.kv_lora], w[p + "self_attn.kv_a_layernorm.weight"], 1e-6)
        k_rot = self.rotate(c[:, None, self.kv_lora :], pos)  # [S, 1, rope]
        kv = (latent @ w[p + "self_attn.kv_b_proj.weight"].T).reshape(
            s, self.heads, self.nope + self.v_dim
        )
        k_nope, v = kv[..., : self.nope], kv[..., self.nope :]
        scores = np.einsum("shd,thd->hst", q_nope, k_nope)
        scores += np.einsum("shd,td->hst", q_rot, k_rot[:, 0])
        scores *= self.scaling
        allowed = np.tril(np.ones((s, s), dtype=bool))
        if mask is not None:
            allowed &= mask
        scores = np.where(allowed[None], scores, -np.inf)
        scores = np.exp(scores - scores.max(-1, keepdims=True))
        probs = scores / scores.sum(-1, keepdims=True)
        out = np.einsum("hst,thd->shd", probs, v).reshape(s, self.heads * self.v_dim)
        return out @ w[p + "self_attn.o_proj.weight"].T, keep

    def mlp(self, p: str, x: np.ndarray) -> np.ndarray:
        """down(silu(gate x) * up x)."""
        g = x @ self.w[p + "gate_proj.weight"].T
        u = x @ self.w[p + "up_proj.weight"].T
        return (g / (1 + np.exp(-g)) * u) @ self.w[p + "down_proj.weight"].T

    def moe(self, p: str, h: np.ndarray) -> np.ndarray:
        """noaux_tc routing, routed experts and shared experts."""
        c = self.cfg
        n_exp, k = int(c["n_routed_experts"]), int(c["num_experts_per_tok"])
        ng, tg = int(c.get("n_group") or 1), int(c.get("topk_group") or 1)
        scores = 1 / (1 + np.exp(-(h @ self.w[p + "mlp.gate.weight"].T)))
        choice = scores + self.w[p + "mlp.gate.e_score_correction_bias"]
        out = self.mlp(p + "mlp.shared_experts.", h)
        for row in range(h.shape[0]):
            cr = choice[row].copy()
            groups = cr.reshape(ng, n_exp // ng)
            gscore = np.sort(groups, axis=-1)[:, -2:].sum(-1)
            keep = np.argsort(-gscore, kind="stable")[:tg]
            mask = np.zeros(ng, dtype=bool)
            mask[keep] = True
            cr[~np.repeat(mask, n_exp // ng)] = -np.inf
            ids = np.argsort(-cr, kind="stable")[:k]
            wts = scores[row, ids]
            if c.get("norm_topk_prob"):
                wts = wts / (wts.sum() + 1e-20)
            wts = wts * float(c["routed_scaling_factor"])
            for e, wt in zip(ids, wts, strict=True):
                out[row] += wt * self.mlp(f"{p}mlp.experts.{e}.", h[row : row + 1])[0]
        return out

    def layer(
        self, p: str, x: np.ndarray, pos: np.ndarray, keep: np.ndarray | None = None
    ) -> tuple[np.ndarray, np.ndarray | None]:
        """One decoder layer (dense or MoE, decided by the tensors present).

        Returns the new residual stream and the DSA selection the layer used (GLM).
        """
        normed = self.rmsnorm(x, self.w[p + "input_layernorm.weight"], self.eps)
        attn, keep = self.attention(p, normed, pos, keep)
        x = x + attn
        h = self.rmsnorm(x, self.w[p + "post_attention_layernorm.weight"], self.eps)
        mlp = self.moe(p, h) if p + "mlp.gate.weight" in self.w else self.mlp(p + "mlp.", h)
        return x + mlp, keep

    def topk_rows(self, keep: np.ndarray) -> np.ndarray:
        """A selection mask [S, S] in the golden form: I32 [S, index_topk], -1 padded."""
        out = np.full((keep.shape[0], self.index_topk), -1, dtype=np.int32)
        for row in range(keep.shape[0]):
            ids = np.nonzero(keep[row])[0]
            out[row, : len(ids)] = ids
        return out

    def forward(self, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray, dict[int, np.ndarray]]:
        """Main model: (logits [S, V], pre-norm hidden [S, H], {full layer: selection})."""
        pos = np.arange(len(ids))
        x = self.embed[ids]
        keep: np.ndarray | None = None
        selections: dict[int, np.ndarray] = {}
        for layer_idx in range(self.n_layers):
            p = f"model.layers.{layer_idx}."
            if self.glm:
                full = p + "self_attn.indexer.wq_b.weight" in self.w
                assert full == (self.indexer_types[layer_idx] == "full"), f"{p}: indexer_types"
            x, keep = self.layer(p, x, pos, keep)
            if self.glm and self.indexer_types[layer_idx] == "full":
                assert keep is not None
                selections[layer_idx] = self.topk_rows(keep)
        normed = self.rmsnorm(x, self.w["model.norm.weight"], self.eps)
        return normed @ self.head.T, x, selections

    def mtp(
        self, tokens: np.ndarray, carried: np.ndarray, pos: np.ndarray
    ) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
        """MTP layer over rows: (raw block output z, shared_head.norm(z), DSA selection)."""
        p = f"model.layers.{self.n_layers}."
        e = self.rmsnorm(self.embed[tokens], self.w[p + "enorm.weight"], self.eps)
        h = self.rmsnorm(carried, self.w[p + "hnorm.weight"], self.eps)
        x = np.concatenate([e, h], axis=-1) @ self.w[p + "eh_proj.weight"].T
        z, keep = self.layer(p, x, pos)
        return z, self.rmsnorm(z, self.w[p + "shared_head.norm.weight"], self.eps), keep

    def compare(self, golden: dict[str, np.ndarray]) -> dict[str, float]:
        """Max |reference - golden| for every golden float tensor (ids, selections must match).

        Every ``dsa_topk_{L}`` / ``mtp_dsa_topk`` golden present must be selected exactly.
        """
        prompt, greedy_ids = golden["prompt_ids"], golden["greedy_ids"]
        t = len(prompt)
        logits, hidden, _ = self.forward(prompt)
        full_logits, _, selections = self.forward(np.concatenate([prompt, greedy_ids[:-1]]))
        for layer, sel in selections.items():
            if f"dsa_topk_{layer}" in golden:
                assert np.array_equal(sel, golden[f"dsa_topk_{layer}"]), f"numpy dsa_topk_{layer}"
        gl = full_logits[t - 1 : t - 1 + len(greedy_ids)]
        assert np.array_equal(gl.argmax(-1), greedy_ids), "numpy greedy ids differ"
        hn = self.rmsnorm(hidden, self.w["model.norm.weight"], self.eps)
        diffs = {
            "logits": float(np.abs(logits - golden["logits"]).max()),
            "hidden": float(np.abs(hidden - golden["hidden"]).max()),
            "greedy_logits": float(np.abs(gl - golden["greedy_logits"]).max()),
        }
        tokens = np.concatenate([prompt[1:], greedy_ids[:1]])
        pos = np.arange(1, t + 1)
        z, zn, mtp_keep = self.mtp(tokens, hn, pos)
        if "mtp_dsa_topk" in golden:
            assert mtp_keep is not None
            sel = self.topk_rows(mtp_keep)[: t - 1]
            assert np.array_equal(sel, golden["mtp_dsa_topk"]), "numpy mtp_dsa_topk differs"
        mtp_logits = zn[: t - 1] @ self.head.T
        diffs["mtp_logits"] = float(np.abs(mtp_logits - golden["mtp_logits"]).max())
        for raw, key in ((False, "mtp_chain"), (True, "mtp_chain_raw")):
            toks, carry, ps, zz, zzn = tokens, hn, pos, z, zn
            chain_logits = []
            for depth in range(len(golden[key + "_ids"])):
                if depth > 0:
                    zz, zzn, _ = self.mtp(toks, carry, ps)
                lg = zzn[-1] @ self.head.T
                d = int(lg.argmax())
                assert d == int(golden[key + "_ids"][depth]), f"numpy {key} id differs"
                chain_logits.append(lg)
                toks = np.append(toks, d)
                carry = np.concatenate([carry, (zz if raw else zzn)[-1:]])
                ps = np.append(ps, ps[-1] + 1)
            diffs[key + "_logits"] = float(
                np.abs(np.stack(chain_logits) - golden[key + "_logits"]).max()
            )
        return diffs


# --------------------------------------------------------------------------------------
# driver


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


# --------------------------------------------------------------------------------------
# quantised goldens: transformers on the dequantised default container


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


def make_fixture(spec: FixtureSpec, out_root: Path, index: int) -> None:
    """Build, write and verify one fixture directory.

    Seeds ``SEED + 1000 * index + attempt`` are tried in order; the first model whose
    greedy text and routing are non-degenerate is kept, so the result is deterministic.
    """
    cand: Candidate | None = None
    for attempt in range(MAX_ATTEMPTS):
        cand = build_candidate(spec, SEED + 1000 * index + attempt)
        if not cand.problems:
            break
        print(f"{spec.name}: seed {cand.seed} rejected: {'; '.join(cand.problems)}")
    assert cand is not None
    if cand.problems:
        raise RuntimeError(f"{spec.name}: no acceptable seed in {MAX_ATTEMPTS} attempts")
    model, cfg = cand.model, cand.model.config
    tied = bool(cfg.tie_word_embeddings)

    fixture_dir = out_root / spec.name
    fixture_dir.mkdir(parents=True, exist_ok=True)
    write_config(cfg, spec, fixture_dir / "config.json")
    tensors = official_state_dict(model, tied)
    tensors.update(mtp_official_tensors(cand.mtp_layer, model, cfg.num_hidden_layers))
    save_tensors(tensors, fixture_dir / "model.safetensors")
    save_tensors(cand.golden, fixture_dir / "golden.safetensors")

    # Reload the written checkpoint with transformers: proves the names are what it expects.
    reloaded = model_class(spec).from_pretrained(
        fixture_dir, dtype=torch.float32, attn_implementation="eager"
    )
    reloaded.eval()
    written = load_file(str(fixture_dir / "model.safetensors"))
    main_keys = {k for k in written if not k.startswith(f"model.layers.{cfg.num_hidden_layers}.")}
    assert main_keys == set(official_state_dict(reloaded, tied)), "main tensor names differ"
    re_logits, re_hidden = prefill(reloaded, cand.prompt)
    d_reload = max(
        (re_logits - cand.golden["logits"]).abs().max().item(),
        (re_hidden - cand.golden["hidden"]).abs().max().item(),
    )
    assert d_reload < TOL_RELOAD, f"reloaded checkpoint differs by {d_reload}"
    t = spec.prompt_len
    full = torch.cat([cand.prompt, cand.golden["greedy_ids"]])
    long_ids = full[:-1] if spec.sparse_dsa else full
    with record_indexers(reloaded) as calls:
        re_full, _ = prefill(reloaded, long_ids)
    greedy_rows = re_full[t - 1 : t - 1 + NEW_TOKENS]
    assert torch.equal(greedy_rows.argmax(-1), cand.golden["greedy_ids"])
    if spec.sparse_dsa:
        for layer in full_layers(cfg):
            (call,) = calls[f"model.layers.{layer}.self_attn.indexer"]
            got = canonical_topk(call.indices, int(cfg.index_topk))
            assert torch.equal(got, cand.golden[f"dsa_topk_{layer}"]), f"reloaded L{layer} DSA"
    if spec.family == "deepseek_v3":
        mtp_note = check_with_transformers_mtp(
            fixture_dir, cand.prompt, cand.mtp, cand.hidden_normed
        )
    else:
        mtp_note = reload_glm_mtp(spec, fixture_dir, cfg, reloaded, cand)
        mtp_note += "; " + check_glm_with_transformers_mtp(fixture_dir, cand)

    numpy_ref = NumpyReference(fixture_dir)
    ref = numpy_ref.compare(np_load_file(str(fixture_dir / "golden.safetensors")))
    worst = max(ref.values())
    assert worst < TOL_NUMPY, f"numpy reference (docs/fixtures.md) differs: {ref}"
    dsa_notes: list[str] = []
    if cand.dsa_scores:
        ref_logits, _, _ = numpy_ref.forward(long_ids.numpy())
        noise = 0.0
        for layer, tf_scores in cand.dsa_scores.items():
            ref_scores = numpy_ref.index_scores[f"model.layers.{layer}."]
            for r in range(ref_scores.shape[0]):
                row = ref_scores[r, : r + 1]
                diff = np.abs(row - tf_scores[r, : r + 1].double().numpy()).max()
                noise = max(noise, float(diff / np.abs(row).max()))
        dsa_notes.append(
            f"DSA index scores, transformers f32 vs numpy float64: max deviation {noise:.1e}"
            f" of the row's max|score| (TIE_MARGIN is {TIE_MARGIN / noise:.0f}x that)"
        )
        # An engine that attends densely in "shared" layers (ignoring indexer_types).
        numpy_ref.shared_dense = True
        wrong, _, _ = numpy_ref.forward(long_ids.numpy())
        numpy_ref.shared_dense = False
        d_shared = float(np.abs(wrong - ref_logits).max())
        assert d_shared > MIN_DENSE_DIFF, f"shared layers barely matter ({d_shared})"
        dsa_notes.append(
            f"numpy reference with the shared layers attending densely: logits move by up to"
            f" {d_shared:.2f}"
        )

    sizes = {p.name: p.stat().st_size for p in sorted(fixture_dir.iterdir())}
    total = sum(sizes.values())
    print(f"wrote {fixture_dir} (seed {cand.seed}): {total / 1e6:.2f} MB {sizes}")
    print(f"  reload max|d|={d_reload:.2e}; {mtp_note}")
    print(f"  numpy float64 reference (docs/fixtures.md) max|d| over all goldens: {worst:.2e}")
    for note in cand.notes + dsa_notes:
        print(f"  {note}")
    write_quantized_golden(spec, fixture_dir)


# --------------------------------------------------------------------------------------
# indexer_types derivation oracle

INDEXER_TYPES_CASES: list[dict[str, Any]] = [
    {"num_hidden_layers": 78, "index_topk_freq": 4},  # GLM-5.2
    {"num_hidden_layers": 78},  # GLM-5 (no schedule: every layer full)
    {"num_hidden_layers": 10},
    {"num_hidden_layers": 10, "index_topk_freq": 3, "index_skip_topk_offset": 4},
    {"num_hidden_layers": 10, "index_topk_freq": 4, "index_skip_topk_offset": 1},
    {"num_hidden_layers": 6, "index_topk_pattern": "FSSFSF"},
    {"num_hidden_layers": 4, "index_topk_pattern": ["full", "full", "shared", "full"]},
    {"num_hidden_layers": 6, "index_topk_pattern": "FSFSFS", "index_topk_freq": 3},
    {"num_hidden_layers": 5, "index_topk_freq": 2, "index_skip_topk_offset": 0},
    {"num_hidden_layers": 4, "indexer_types": ["full", "shared", "full", "shared"]},
    {
        "num_hidden_layers": 4,
        "indexer_types": ["full", "full", "shared", "shared"],
        "index_topk_freq": 3,
        "index_topk_pattern": "FSFS",
    },
]


def write_indexer_types_json(path: Path) -> None:
    """Write what ``GlmMoeDsaConfig(**kwargs).indexer_types`` derives for each test case.

    A list of ``{"config": kwargs, "indexer_types": [...]}``: the oracle for an engine's
    own derivation (explicit list > ``index_topk_pattern`` > ``index_topk_freq`` /
    ``index_skip_topk_offset``, defaults 1 / 2).
    """
    cases = []
    for kwargs in INDEXER_TYPES_CASES:
        kinds = list(GlmMoeDsaConfig(**copy.deepcopy(kwargs)).indexer_types)
        assert len(kinds) == kwargs["num_hidden_layers"] and set(kinds) <= {"full", "shared"}
        cases.append({"config": kwargs, "indexer_types": kinds})
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("[\n" + ",\n".join(json.dumps(c) for c in cases) + "\n]\n")
    counts = ", ".join(
        f"{c['indexer_types'].count('full')}/{len(c['indexer_types'])}" for c in cases
    )
    print(f"wrote {path}: {len(cases)} cases, full layers {counts}")


def main(argv: list[str] | None = None) -> int:
    """Regenerate every fixture under ``--out``."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("tests/fixtures"))
    parser.add_argument("--only", nargs="*", default=None, help="fixture names to build")
    parser.add_argument(
        "--quantized-goldens",
        action="store_true",
        help="only (re)write golden_int4.safetensors from the fixtures already under --out",
    )
    parser.add_argument(
        "--indexer-types-json",
        type=Path,
        default=None,
        metavar="PATH",
        help="only write the indexer_types derivation oracle to PATH (a full run writes"
        " <out>/dsa_indexer_types.json)",
    )
    args = parser.parse_args(argv)
    if args.indexer_types_json is not None:
        write_indexer_types_json(args.indexer_types_json)
        return 0
    transformers_logging.set_verbosity_error()
    transformers_logging.disable_progress_bar()
    torch.use_deterministic_algorithms(True)
    torch.set_num_threads(1)
    for index, spec in enumerate(SPECS):
        if args.only and spec.name not in args.only:
            continue
        if args.quantized_goldens:
            write_quantized_golden(spec, args.out / spec.name)
        else:
            make_fixture(spec, args.out, index)
    if not args.only and not args.quantized_goldens:
        write_indexer_types_json(args.out / "dsa_indexer_types.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
