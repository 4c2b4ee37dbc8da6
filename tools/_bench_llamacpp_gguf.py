"""The checkpoint for llama.cpp (run in the llama.cpp venv): a BF16 GGUF written with gguf-py,
quantised by llama.cpp, and the bytes a token reads from it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from _bench_llamacpp_model import vocab


def read_safetensors(src: Path) -> dict[str, tuple[Path, int, str, list[int]]]:
    """name -> (file, data offset, dtype, shape) over every shard."""
    out = {}
    for f in sorted(src.glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
        for name, t in header.items():
            if name != "__metadata__":
                out[name] = (f, 8 + n + t["data_offsets"][0], t["dtype"], t["shape"])
    return out


def write_gguf(src: Path, dst: Path) -> None:
    """The checkpoint as a BF16 GGUF for llama.cpp's ``deepseek2`` architecture, laid out as
    llama.cpp's convert_hf_to_gguf.py lays out DeepSeek-V3 (experts stacked per layer,
    kv_b split into k_b (transposed) and v_b for MLA; vectors and routers F32), written
    tensor by tensor so memory stays at one stacked expert tensor."""
    import gguf
    import numpy as np

    cfg = json.loads((src / "config.json").read_text())
    index = read_safetensors(src)
    layers, experts = cfg["num_hidden_layers"], cfg["n_routed_experts"]
    heads, nope, v = cfg["num_attention_heads"], cfg["qk_nope_head_dim"], cfg["v_head_dim"]
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.DEEPSEEK2, layers)

    def load(name: str) -> Any:
        f, off, dtype, shape = index[name]
        assert dtype == "BF16", (name, dtype)
        return np.memmap(f, dtype="<u2", mode="r", offset=off, shape=tuple(shape))

    def f32(a: Any) -> Any:
        return (np.asarray(a, dtype=np.uint32) << 16).view(np.float32)

    # (gguf name, shape, producer, as F32)
    plan: list[tuple[str, tuple[int, ...], Any, bool]] = []

    def add(hf: str, shape: tuple[int, ...], make: Any, as_f32: bool) -> None:
        key = hf.replace("e_score_correction_bias", "e_score_correction.bias")
        name = names.get_name(key, try_suffixes=(".weight", ".bias"))
        assert name is not None, hf
        plan.append((name, shape, make, as_f32))

    for hf, (_, _, _, shape) in index.items():
        if ".mlp.experts." in hf:
            continue
        if hf.endswith("kv_b_proj.weight"):
            kl = shape[1]

            def kb(hf: str = hf, kl: int = kl) -> Any:
                return np.ascontiguousarray(
                    load(hf).reshape(heads, nope + v, kl)[:, :nope, :].transpose(0, 2, 1)
                )

            def vb(hf: str = hf, kl: int = kl) -> Any:
                return np.ascontiguousarray(load(hf).reshape(heads, nope + v, kl)[:, nope:, :])

            add(hf.replace("kv_b_proj", "k_b_proj"), (heads, kl, nope), kb, False)
            add(hf.replace("kv_b_proj", "v_b_proj"), (heads, v, kl), vb, False)
            continue
        vec = len(shape) == 1 or hf.endswith("mlp.gate.weight")
        add(hf, tuple(shape), lambda hf=hf: load(hf), vec)
    for layer in range(cfg["first_k_dense_replace"], layers):
        for part in ("down_proj", "gate_proj", "up_proj"):
            first = f"model.layers.{layer}.mlp.experts.0.{part}.weight"
            shape = (experts, *index[first][3])

            def stack(layer: int = layer, part: str = part) -> Any:
                return np.stack(
                    [
                        load(f"model.layers.{layer}.mlp.experts.{e}.{part}.weight")
                        for e in range(experts)
                    ]
                )

            add(f"model.layers.{layer}.mlp.experts.{part}.weight", shape, stack, False)

    w = gguf.GGUFWriter(str(dst), gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.DEEPSEEK2])
    add_metadata(w, cfg)
    for name, shape, _, as_f32 in plan:
        n = int(np.prod(shape))
        if as_f32:
            w.add_tensor_info(name, shape, np.dtype(np.float32), n * 4)
        else:
            w.add_tensor_info(
                name, shape, np.dtype(np.uint16), n * 2, raw_dtype=gguf.GGMLQuantizationType.BF16
            )
    w.write_header_to_file(dst)
    w.write_kv_data_to_file()
    w.write_ti_data_to_file()
    for name, shape, make, as_f32 in plan:
        a = make()
        assert a.shape == shape, (name, a.shape, shape)
        w.write_tensor_data(f32(a) if as_f32 else np.ascontiguousarray(a))
    w.close()


def add_metadata(w: Any, cfg: dict[str, Any]) -> None:
    """The GGUF's key-value header: llama.cpp's ``deepseek2`` hyperparameters of ``cfg`` and
    the tokenizer (``vocab``)."""
    import gguf

    w.add_name("colibri-bench-dsv3")
    w.add_block_count(cfg["num_hidden_layers"])
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(cfg["num_attention_heads"])
    w.add_head_count_kv(1)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(cfg["n_routed_experts"])
    w.add_expert_used_count(cfg["num_experts_per_tok"])
    w.add_expert_group_count(cfg["n_group"])
    w.add_expert_group_used_count(cfg["topk_group"])
    w.add_expert_gating_func(gguf.ExpertGatingFuncType.SIGMOID)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_BF16)
    w.add_leading_dense_block_count(cfg["first_k_dense_replace"])
    w.add_vocab_size(cfg["vocab_size"])
    w.add_q_lora_rank(cfg["q_lora_rank"])
    w.add_kv_lora_rank(cfg["kv_lora_rank"])
    w.add_key_length(cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    w.add_value_length(cfg["kv_lora_rank"])
    w.add_key_length_mla(cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(cfg["v_head_dim"])
    w.add_expert_feed_forward_length(cfg["moe_intermediate_size"])
    w.add_expert_shared_count(cfg["n_shared_experts"])
    w.add_expert_weights_scale(cfg["routed_scaling_factor"])
    w.add_expert_weights_norm(cfg["norm_topk_prob"])
    w.add_rope_dimension_count(cfg["qk_rope_head_dim"])
    tokens, merges = vocab(cfg["vocab_size"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_types([gguf.TokenType.CONTROL] * 2 + [gguf.TokenType.NORMAL] * (len(tokens) - 2))
    w.add_token_merges(merges)
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_add_bos_token(False)
    w.add_quantization_version(gguf.GGML_QUANT_VERSION)


def quantize(src: Path, dst: Path, ftype: str, threads: int) -> None:
    import llama_cpp

    p = llama_cpp.llama_model_quantize_default_params()
    p.ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{ftype}")
    p.nthread = threads
    tmp = dst.with_name(dst.name + ".partial")
    rc = llama_cpp.llama_model_quantize(str(src).encode(), str(tmp).encode(), p)
    if rc != 0:
        raise SystemExit(f"llama_model_quantize({ftype}) failed: {rc}")
    tmp.rename(dst)


def gguf_bytes(path: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """Bytes of the file, and of the weights one token reads (embedding excluded; stacked
    experts scaled by experts-per-token / experts), plus the tensor types used."""
    import gguf

    r = gguf.GGUFReader(str(path))
    frac = cfg["num_experts_per_tok"] / cfg["n_routed_experts"]
    per_token, total, types = 0.0, 0, {}
    for t in r.tensors:
        n = int(t.n_bytes)
        total += n
        tname = t.tensor_type.name
        types[tname] = types.get(tname, 0) + n
        if t.name.startswith("token_embd"):
            continue
        per_token += n * frac if "_exps" in t.name else n
    return {
        "file_bytes": path.stat().st_size,
        "weight_bytes": total,
        "bytes_per_token": int(per_token),
        "types": types,
    }
