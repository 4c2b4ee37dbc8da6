"""train_tiny.py's export: the trained model and MTP layer as a Hugging Face checkpoint with
the official DeepSeek-V3 tensor names and config spelling."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from _train_tiny_data import save_tokenizer_files
from safetensors.torch import save_file
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel


def export_state_dict(model: DeepseekV3ForCausalLM, mtp: MtpModel) -> dict[str, torch.Tensor]:
    """Official DeepSeek-V3 tensor names: per-expert weights, MTP layer at index N."""
    cfg = model.config
    inter = cfg.moe_intermediate_size
    out: dict[str, torch.Tensor] = {}

    def put(name: str, t: torch.Tensor) -> None:
        out[name] = t.detach().to(torch.float32).contiguous().clone()

    def put_layer(prefix: str, sd: dict[str, torch.Tensor]) -> None:
        for k, t in sd.items():
            if k.endswith("mlp.experts.gate_up_proj"):
                base = prefix + k[: -len("gate_up_proj")]
                for e in range(t.shape[0]):
                    put(f"{base}{e}.gate_proj.weight", t[e, :inter])
                    put(f"{base}{e}.up_proj.weight", t[e, inter:])
            elif k.endswith("mlp.experts.down_proj"):
                base = prefix + k[: -len("down_proj")]
                for e in range(t.shape[0]):
                    put(f"{base}{e}.down_proj.weight", t[e])
            else:
                put(prefix + k, t)

    sd = model.state_dict()
    main = {k: v for k, v in sd.items() if not k.startswith("model.layers.")}
    for k, v in main.items():
        put(k, v)
    for i, layer in enumerate(model.model.layers):
        put_layer(f"model.layers.{i}.", layer.state_dict())
    n = cfg.num_hidden_layers
    mtp_layer = mtp.layers[0]
    p = f"model.layers.{n}."
    put(p + "embed_tokens.weight", model.model.embed_tokens.weight)
    put(p + "enorm.weight", mtp_layer.enorm.weight)
    put(p + "hnorm.weight", mtp_layer.hnorm.weight)
    put(p + "eh_proj.weight", mtp_layer.eh_proj.weight)
    put_layer(p, mtp_layer.mtp_block.state_dict())
    put(p + "shared_head.norm.weight", mtp_layer.post_norm.weight)
    put(p + "shared_head.head.weight", model.lm_head.weight)
    return out


def export_hf(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, tok: Tokenizer, out: Path, seq: int
) -> None:
    """Write the Hugging Face checkpoint directory."""
    out.mkdir(parents=True, exist_ok=True)
    tensors = export_state_dict(model, mtp)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    cfg = model.config.to_dict()
    cfg["architectures"] = ["DeepseekV3ForCausalLM"]
    cfg["model_type"] = "deepseek_v3"
    cfg["torch_dtype"] = "float32"
    cfg["dtype"] = "float32"
    cfg["num_nextn_predict_layers"] = 1
    cfg.pop("num_mtp_layers", None)
    cfg.pop("_attn_implementation", None)
    cfg.pop("_experts_implementation", None)
    cfg["use_cache"] = True
    # Official DeepSeek-V3 config.json spelling of the RoPE settings, next to transformers'
    # ``rope_parameters`` (transformers accepts both; readers of the official layout need these).
    cfg["rope_theta"] = cfg["rope_parameters"]["rope_theta"]
    cfg["rope_scaling"] = None
    cfg["scoring_func"] = "sigmoid"
    cfg["topk_method"] = "noaux_tc"
    for key in (
        "_name_or_path",
        "id2label",
        "label2id",
        "chunk_size_feed_forward",
        "problem_type",
        "return_dict",
        "output_attentions",
        "output_hidden_states",
        "is_encoder_decoder",
    ):
        cfg.pop(key, None)
    (out / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    gen = {
        "bos_token_id": model.config.bos_token_id,
        "eos_token_id": model.config.eos_token_id,
        "pad_token_id": model.config.pad_token_id,
        "do_sample": False,
        "max_new_tokens": 128,
    }
    (out / "generation_config.json").write_text(json.dumps(gen, indent=2) + "\n")
    save_tokenizer_files(tok, out, seq)
