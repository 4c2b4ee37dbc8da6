"""A fixture's main model with transformers: its config, random weights, the official tensor
names it is written under, and the prefill / greedy forwards its goldens come from."""

from __future__ import annotations

import copy
import json
import math
from pathlib import Path

import torch
from _fixtures_specs import NEW_TOKENS, FixtureSpec
from safetensors.torch import save_file
from torch import nn
from transformers import (
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    PreTrainedConfig,
    PreTrainedModel,
)
from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer

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
