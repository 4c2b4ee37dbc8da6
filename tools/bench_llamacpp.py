"""colibri and llama.cpp side by side on one synthetic DeepSeek-V3-shaped model (issue 23).

One command builds everything it needs outside the repository, in a cache directory:

1. a venv with llama-cpp-python (pinned, built from the PyPI sdist with native CPU flags and
   OpenMP) and gguf-py — never a dependency of colibri;
2. a random DeepSeek-V3-shaped BF16 checkpoint (tools/make_big_checkpoint.py's tensors, the
   config below), with a byte-level BPE tokenizer both engines read;
3. the same checkpoint converted for both engines: ``colibri convert`` (defaults) and a BF16
   GGUF (written with gguf-py, no torch), quantised by llama.cpp to Q4_0 and Q4_K_M.

It then measures, each measurement in a fresh process, engines alternated within each round,
medians over the rounds: decode tok/s after 8- and 512-token prompts, prefill tok/s of 512
and 2,048 tokens, and each process's peak RSS; plus, in the same run (before and after the
rounds), the 2-thread streaming-read bandwidth, the f32 FMA ceiling and the int8 VNNI ceiling
(a small probe compiled with rustc, the method of benches/probes.rs). It prints a markdown
table with the ratios issue 23 names and writes JSON.

    python tools/bench_llamacpp.py --cache /work/llamabench            # full size, 3 rounds
    python tools/bench_llamacpp.py --cache /tmp/lb --quick             # tiny model, 1 round

Token ids are fed directly (random ids, the same for both engines). colibri runs in the
interpreter that runs this script (or ``--colibri-python``), from a snapshot of its colibri
package copied at the start, so a rebuild during the run cannot change what is measured.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import inspect
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
LLAMA_CPP_PYTHON = "0.3.36"
GGUF = "0.19.0"
CMAKE_ARGS = "-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DCMAKE_BUILD_TYPE=Release"
# CPU flags (lscpu, /proc/cpuinfo's names) -> the ggml option that compiles for them.
GGML_FEATURES = [
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("bmi2", "GGML_BMI2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
]
CTX = 4096
# Long enough that the warm-up routes tokens to every expert (64 experts, top 8: a 128-token
# warm-up left ~170 MB of experts for colibri to read inside the measured 512-token prefill,
# where llama.cpp's mapped file was already warm).
WARMUP_PROMPT = 512
WARMUP_GEN = 8
_KEEP: list[Any] = []


# ------------------------------------------------------------------------------ the model
def _big_checkpoint() -> Any:
    """tools/make_big_checkpoint.py as a module (tensor list and shard writer)."""
    path = ROOT / "tools" / "make_big_checkpoint.py"
    spec = importlib.util.spec_from_file_location("make_big_checkpoint", path)
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def bench_config(quick: bool = False) -> dict[str, Any]:
    """The synthetic model: make_big_checkpoint's DeepSeek-V3 shape with 14 layers (1 dense,
    13 MoE) and 8 of 64 experts per token, ~3.2 GB as colibri's int4-g64 (~4.5 bits), about
    0.55 GB of weights read per token. ``quick``: a small model of the same structure."""
    cfg = _big_checkpoint().config(3 if quick else 14)
    cfg.update(
        architectures=["DeepseekV3ForCausalLM"],
        num_experts_per_tok=8,
        max_position_embeddings=CTX,
        rope_theta=10000.0,
        rms_norm_eps=1e-6,
        scoring_func="sigmoid",
        topk_method="noaux_tc",
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
        tie_word_embeddings=False,
        hidden_act="silu",
    )
    if quick:
        cfg.update(
            vocab_size=4096,
            hidden_size=512,
            intermediate_size=1024,
            moe_intermediate_size=256,
            num_attention_heads=8,
            q_lora_rank=256,
            kv_lora_rank=128,
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
        )
    return cfg


def matmuls(cfg: dict[str, Any]) -> list[tuple[str, int, int, float]]:
    """(role, rows, cols, matrices applied per token) of every weight matrix a token uses."""
    h, heads = cfg["hidden_size"], cfg["num_attention_heads"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    ql, kl = cfg["q_lora_rank"], cfg["kv_lora_rank"]
    m, layers = cfg["moe_intermediate_size"], cfg["num_hidden_layers"]
    dense, moe = cfg["first_k_dense_replace"], layers - cfg["first_k_dense_replace"]
    k, shared = cfg["num_experts_per_tok"], cfg["n_shared_experts"]
    out = [
        ("attention q_a", ql, h, layers),
        ("attention q_b", heads * (nope + rope), ql, layers),
        ("attention kv_a", kl + rope, h, layers),
        ("attention kv_b", heads * (nope + v), kl, layers),
        ("attention o", h, heads * v, layers),
        ("dense mlp", cfg["intermediate_size"], h, 3 * dense),
        ("router", cfg["n_routed_experts"], h, moe),
        ("shared experts", m, h, 3 * shared * moe),
        ("routed experts", m, h, 3 * k * moe),
        ("lm_head", cfg["vocab_size"], h, 1),
    ]
    return out


def flops_per_token(cfg: dict[str, Any]) -> int:
    """2 x the multiply-adds of the weight matrices one token goes through (attention scores
    against the context, norms, rope and activations not counted)."""
    return int(sum(2 * r * c * n for _, r, c, n in matmuls(cfg)))


def params(cfg: dict[str, Any]) -> tuple[int, int]:
    """(total parameters of the 2-D weights, those a token uses, embedding excluded)."""
    total = sum(r * c for _, r, c in _shapes2d(cfg))
    active = sum(r * c * n for _, r, c, n in matmuls(cfg))
    return int(total), int(active)


def _shapes2d(cfg: dict[str, Any]) -> list[tuple[str, int, int]]:
    return [(n, s[0], s[1]) for n, s in _big_checkpoint().shapes(cfg) if len(s) == 2]


def config_hash(cfg: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(cfg, sort_keys=True).encode()).hexdigest()[:10]


# -------------------------------------------------------------------------- the tokenizer
def byte_chars() -> list[str]:
    """GPT-2's byte-level alphabet: the printable character each byte maps to."""
    keep = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = {}, 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + extra)
            extra += 1
    return [chars[b] for b in range(256)]


def vocab(size: int) -> tuple[list[str], list[str]]:
    """(tokens by id, merges by rank) of a byte-level BPE of ``size`` tokens: 0 ``<|bos|>``,
    1 ``<|endoftext|>``, then the 256 bytes, then two-byte tokens (each one merge)."""
    if not 258 <= size <= 258 + 256 * 256:
        raise ValueError(f"vocab size {size} outside 258..{258 + 256 * 256}")
    b = byte_chars()
    tokens = ["<|bos|>", "<|endoftext|>", *b]
    merges = []
    for i in range(size - len(tokens)):
        left, right = b[i // 256], b[i % 256]
        tokens.append(left + right)
        merges.append(f"{left} {right}")
    return tokens, merges


def write_tokenizer(dst: Path, size: int) -> None:
    """tokenizer.json / tokenizer_config.json / generation_config.json for colibri."""
    tokens, merges = vocab(size)
    special = [
        {
            "id": i,
            "content": tokens[i],
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i in (0, 1)
    ]
    level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True}
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": {**level, "use_regex": True},
        "post_processor": None,
        "decoder": {**level, "use_regex": True},
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": {t: i for i, t in enumerate(tokens)},
            "merges": merges,
        },
    }
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False))
    (dst / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": tokens[0],
                "eos_token": tokens[1],
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": CTX,
            },
            indent=1,
        )
    )
    (dst / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 0, "eos_token_id": 1, "do_sample": False}, indent=1)
    )


def make_checkpoint(dst: Path, cfg: dict[str, Any], shard_gib: float = 1.0) -> None:
    """The BF16 safetensors checkpoint (make_big_checkpoint's writer, seed 0)."""
    import numpy as np

    big = _big_checkpoint()
    dst.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    limit = int(shard_gib * 2**30)
    groups: list[list[tuple[str, str, tuple[int, ...]]]] = [[]]
    size = 0
    for name, dtype, shape in big.entries(big.shapes(cfg), False):
        n = int(np.prod(shape)) * 2
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append((name, dtype, shape))
        size += n
    for k, g in enumerate(groups):
        path = dst / f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        big.write_shard(path, g, rng)
        log(f"  {path.name}: {path.stat().st_size / 2**30:.2f} GiB")
    write_tokenizer(dst, cfg["vocab_size"])
    (dst / "config.json").write_text(json.dumps(cfg, indent=1))


# ------------------------------------------------------------------- GGUF (llama.cpp venv)
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
    w.add_name("colibri-bench-dsv3")
    w.add_block_count(layers)
    w.add_context_length(cfg["max_position_embeddings"])
    w.add_embedding_length(cfg["hidden_size"])
    w.add_feed_forward_length(cfg["intermediate_size"])
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_rope_freq_base(cfg["rope_theta"])
    w.add_layer_norm_rms_eps(cfg["rms_norm_eps"])
    w.add_expert_count(experts)
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
    w.add_key_length_mla(nope + cfg["qk_rope_head_dim"])
    w.add_value_length_mla(v)
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


# -------------------------------------------------------------------------------- workers
def prompt_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    import numpy as np

    return [int(x) for x in np.random.default_rng(seed).integers(2, vocab_size, size=n)]


def vm_status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def worker_colibri(a: argparse.Namespace) -> dict[str, Any]:
    import colibri

    kw: dict[str, Any] = {"threads": a.threads, "max_context": CTX, "draft": a.draft}
    gen_kw: dict[str, Any] = {}
    if a.prefill:
        if "prefill" in inspect.signature(colibri.Model.__init__).parameters:
            kw["prefill"] = a.prefill
        else:
            gen_kw["prefill"] = a.prefill
    t0 = time.perf_counter()
    m = colibri.Model(a.model, **kw)
    load_s = time.perf_counter() - t0
    vs = m.config["vocab_size"]
    common = {"temperature": 0, "stop_token_ids": [], **gen_kw}
    warm = m.session()
    warm.generate(prompt_ids(vs, WARMUP_PROMPT, 7), max_new_tokens=WARMUP_GEN, **common)
    s = m.session()
    ids = prompt_ids(vs, a.prompt, 1234)
    t0 = time.perf_counter()
    out = s.generate(ids, max_new_tokens=a.gen, **common)
    wall = time.perf_counter() - t0
    st = out.stats
    return {
        "load_s": load_s,
        "wall_s": wall,
        "prefill_tok_s": st.prompt_tokens_per_second,
        "decode_tok_s": st.tokens_per_second if a.gen > 1 else None,
        "tokens_per_forward": st.tokens_per_forward,
        "generated": st.generated_tokens,
        "expert_misses": st.expert_misses,
        "expert_bytes_read": st.expert_bytes_read,
        "prefill_resolved": m.info().get("prefill"),  # the arithmetic "auto" chose
        "tokens": list(out.token_ids[:16]),
        **vm_status(),
    }


def worker_llama(a: argparse.Namespace) -> dict[str, Any]:
    import ctypes

    import llama_cpp as L
    import numpy as np

    _KEEP.append(L.llama_log_callback(lambda *_: None))  # alive while llama.cpp may call it
    L.llama_log_set(_KEEP[-1], ctypes.c_void_p())
    L.llama_backend_init()
    t0 = time.perf_counter()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {a.model}")
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = CTX, 2048, 512
    cp.n_threads = cp.n_threads_batch = a.threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    load_s = time.perf_counter() - t0
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(2048, 0, 1)
    mem = L.llama_get_memory(ctx)

    def run(tokens: list[int], pos: int) -> None:
        for i0 in range(0, len(tokens), 2048):
            part = tokens[i0 : i0 + 2048]
            batch.n_tokens = len(part)
            for i, t in enumerate(part):
                batch.token[i] = t
                batch.pos[i] = pos + i0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(part) - 1
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise SystemExit(f"llama_decode failed: {rc}")

    def argmax() -> int:
        p = L.llama_get_logits_ith(ctx, -1)
        return int(np.ctypeslib.as_array(p, shape=(n_vocab,)).argmax())

    def generate(ids: list[int], n: int) -> tuple[float, float, list[int]]:
        L.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        run(ids, 0)
        out = [argmax()]
        t1 = time.perf_counter()
        for j in range(n - 1):
            run([out[-1]], len(ids) + j)
            out.append(argmax())
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    generate(prompt_ids(n_vocab, WARMUP_PROMPT, 7), WARMUP_GEN)
    ids = prompt_ids(n_vocab, a.prompt, 1234)
    t0 = time.perf_counter()
    pre, dec, out = generate(ids, a.gen)
    wall = time.perf_counter() - t0
    res = {
        "load_s": load_s,
        "wall_s": wall,
        "prefill_tok_s": len(ids) / pre,
        "decode_tok_s": (a.gen - 1) / dec if a.gen > 1 else None,
        "tokens_per_forward": 1.0,
        "generated": len(out),
        "tokens": out[:16],
        **vm_status(),
    }
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return res


# --------------------------------------------------------------------- machine's ceilings
PROBE_RS = r"""
// Machine ceilings for tools/bench_llamacpp.py: the method of benches/probes.rs (a streaming
// XOR read of a 1 GiB buffer with software prefetch 8 KiB ahead; independent FMA chains),
// plus an int8 VNNI (vpdpbusd) ceiling. Prints one JSON line.
use std::arch::x86_64::*;
use std::time::Instant;

fn xor_prefetching(words: &[u64]) -> u64 {
    const AHEAD: usize = 8192 / 8;
    let mut acc = [0u64; 8];
    let lines = words.chunks_exact(8);
    let rest = lines.remainder().iter().fold(0, |a, &b| a ^ b);
    for (i, line) in lines.enumerate() {
        let ahead = words.as_ptr().wrapping_add(i * 8 + AHEAD) as *const i8;
        unsafe { _mm_prefetch::<_MM_HINT_T0>(ahead) };
        for (a, &v) in acc.iter_mut().zip(line) { *a ^= v; }
    }
    acc.iter().fold(rest, |a, &b| a ^ b)
}

const CHAINS: usize = 12;

// The exact f32 S = 1 int4 loop's floor of work (tools/probe_stream_compute.rs): the same
// prefetching stream, each 64-byte line converted to floats once and multiplied into 128
// lanes of FMAs (one lane per int4 weight) against 8 activation vectors (constant addresses:
// held in registers), and nothing else. No exact decode can stream faster than this on the
// machine; docs/benchmarks.md, "How much compute a stream can carry".
/// Prefetch the line 8 KiB past `q` into L2 (`t1`, as the kernels do on AMD) or L1.
#[inline(always)]
fn prefetch_ahead(q: *const u8, t1: bool) {
    let ahead = q.wrapping_add(8192) as *const i8;
    unsafe {
        if t1 { _mm_prefetch::<_MM_HINT_T1>(ahead) } else { _mm_prefetch::<_MM_HINT_T0>(ahead) }
    }
}

#[target_feature(enable = "avx512f")]
unsafe fn exact_floor512(words: &[u64], x: &[f32], t1: bool) -> f32 {
    let mut acc = [_mm512_setzero_ps(); 8];
    let p = words.as_ptr() as *const u8;
    let lines = words.len() / 8;
    for i in 0..lines {
        let q = p.add(64 * i);
        prefetch_ahead(q, t1);
        let v = _mm512_cvtepi32_ps(_mm512_loadu_si512(q as *const _));
        for k in 0..8 {
            let xv = _mm512_loadu_ps(x.as_ptr().add(16 * k));
            acc[k] = _mm512_fmadd_ps(v, xv, acc[k]);
        }
    }
    let mut s = acc[0];
    for a in &acc[1..] { s = _mm512_add_ps(s, *a); }
    _mm512_reduce_add_ps(s)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn exact_floor256(words: &[u64], x: &[f32], t1: bool) -> f32 {
    let mut acc = [_mm256_setzero_ps(); 8];
    let p = words.as_ptr() as *const u8;
    let lines = words.len() / 8;
    for i in 0..lines {
        let q = p.add(64 * i);
        prefetch_ahead(q, t1);
        for h in 0..2 {
            let v = _mm256_cvtepi32_ps(_mm256_loadu_si256(q.add(32 * h) as *const __m256i));
            for k in 0..8 {
                let xv = _mm256_loadu_ps(x.as_ptr().add(8 * k));
                acc[k] = _mm256_fmadd_ps(v, xv, acc[k]);
            }
        }
    }
    let mut s = acc[0];
    for a in &acc[1..] { s = _mm256_add_ps(s, *a); }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}

#[target_feature(enable = "avx512f")]
unsafe fn fma512(iters: usize, seed: f32) -> f32 {
    let mut acc = [_mm512_set1_ps(seed); CHAINS];
    let (a, b) = (_mm512_set1_ps(0.999_99), _mm512_set1_ps(1e-7));
    for _ in 0..iters { for c in acc.iter_mut() { *c = _mm512_fmadd_ps(*c, a, b); } }
    let mut s = _mm512_setzero_ps();
    for c in acc { s = _mm512_add_ps(s, c); }
    _mm512_reduce_add_ps(s)
}

#[target_feature(enable = "avx2,fma")]
unsafe fn fma256(iters: usize, seed: f32) -> f32 {
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    let (a, b) = (_mm256_set1_ps(0.999_99), _mm256_set1_ps(1e-7));
    for _ in 0..iters { for c in acc.iter_mut() { *c = _mm256_fmadd_ps(*c, a, b); } }
    let mut s = _mm256_setzero_ps();
    for c in acc { s = _mm256_add_ps(s, c); }
    let mut out = [0f32; 8];
    _mm256_storeu_ps(out.as_mut_ptr(), s);
    out.iter().sum()
}

#[target_feature(enable = "avx512f,avx512vnni")]
unsafe fn vnni512(iters: usize, seed: i32) -> i32 {
    let mut acc = [_mm512_set1_epi32(seed); CHAINS];
    let (a, b) = (_mm512_set1_epi8(3), _mm512_set1_epi8(-2));
    for _ in 0..iters { for c in acc.iter_mut() { *c = _mm512_dpbusd_epi32(*c, a, b); } }
    let mut s = _mm512_setzero_si512();
    for c in acc { s = _mm512_add_epi32(s, c); }
    _mm512_reduce_add_epi32(s)
}

fn median(mut v: Vec<f64>) -> f64 { v.sort_by(|a, b| a.partial_cmp(b).unwrap()); v[v.len() / 2] }

fn main() {
    let threads: usize = std::env::args().nth(1).map_or(2, |s| s.parse().unwrap());
    let gib: usize = std::env::args().nth(2).map_or(1, |s| s.parse().unwrap());
    let bytes = gib << 30;
    let buf: Vec<u64> = (0..bytes / 8).map(|i| i as u64).collect();
    let want = buf.iter().fold(0u64, |a, &v| a ^ v);
    let mut read = Vec::new();
    for _ in 0..11 {
        let t = Instant::now();
        let per = buf.len() / threads;
        let x = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads).map(|k| {
                let end = if k + 1 == threads { buf.len() } else { (k + 1) * per };
                let part = &buf[k * per..end];
                s.spawn(move || part.chunks(1 << 13).map(xor_prefetching).fold(0, |a, b| a ^ b))
            }).collect();
            hs.into_iter().map(|h| h.join().unwrap()).fold(0, |a, b| a ^ b)
        });
        let dt = t.elapsed().as_secs_f64();
        assert_eq!(x, want);
        read.push(bytes as f64 / dt / 1e9);
    }
    read.remove(0);
    let avx512 = is_x86_feature_detected!("avx512f");
    // The kernels prefetch into L2 on AMD (src/quant/kernels/avx512.rs).
    let v = __cpuid(0);
    let amd = v.ebx == 0x6874_7541 && v.edx == 0x6974_6e65 && v.ecx == 0x444d_4163;
    let x: Vec<f32> = (0..128).map(|i| (i % 7) as f32 * 0.1).collect();
    let mut floor = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let per = buf.len() / threads;
        std::thread::scope(|s| {
            for k in 0..threads {
                let end = if k + 1 == threads { buf.len() } else { (k + 1) * per };
                let (part, x) = (&buf[k * per..end], &x);
                s.spawn(move || std::hint::black_box(unsafe {
                    if avx512 { exact_floor512(part, x, amd) } else { exact_floor256(part, x, amd) }
                }));
            }
        });
        floor.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let vnni = avx512 && is_x86_feature_detected!("avx512vnni");
    let iters = 1usize << 22;
    let mut fma = Vec::new();
    let mut int8 = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads).map(|k| s.spawn(move || unsafe {
                if avx512 { fma512(iters, k as f32 + 1.0) } else { fma256(iters, k as f32 + 1.0) }
            })).collect();
            for h in hs { std::hint::black_box(h.join().unwrap()); }
        });
        let lanes = if avx512 { 16 } else { 8 };
        fma.push((threads * iters * CHAINS * 2 * lanes) as f64 / t.elapsed().as_secs_f64() / 1e9);
        if vnni {
            let t = Instant::now();
            std::thread::scope(|s| {
                let hs: Vec<_> = (0..threads)
                    .map(|k| s.spawn(move || unsafe { vnni512(iters, k as i32) }))
                    .collect();
                for h in hs { std::hint::black_box(h.join().unwrap()); }
            });
            // 16 lanes x 4 byte products, each a multiply and an add
            int8.push((threads * iters * CHAINS * 2 * 64) as f64 / t.elapsed().as_secs_f64() / 1e9);
        }
    }
    println!(
        concat!(
            "{{\"threads\": {}, \"read_GBps\": {:.3}, \"read_GBps_max\": {:.3}, ",
            "\"fma_f32_GFLOPs\": {:.2}, \"fma_path\": \"{}\", \"vnni_int8_GOPs\": {}, ",
            "\"exact_floor_GBps\": {:.3}}}"
        ),
        threads,
        median(read.clone()),
        read.iter().cloned().fold(0.0, f64::max),
        median(fma),
        if avx512 { "avx512" } else { "avx2" },
        if vnni { format!("{:.2}", median(int8)) } else { "null".to_string() },
        median(floor)
    );
}
"""


def probe(cache: Path, threads: int, gib: int) -> dict[str, Any]:
    exe = cache / "probe"
    src = cache / "probe.rs"
    if not exe.exists() or not src.exists() or src.read_text() != PROBE_RS:
        src.write_text(PROBE_RS)
        rustc = shutil.which("rustc")
        if rustc is None:
            raise SystemExit("the bandwidth/FMA probe needs rustc (rustup.rs)")
        cmd = [
            rustc,
            "--edition",
            "2021",
            "-O",
            "-C",
            "target-cpu=native",
            str(src),
            "-o",
            str(exe),
        ]
        subprocess.run(cmd, check=True)
    out = subprocess.run(
        [str(exe), str(threads), str(gib)], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout)


# ------------------------------------------------------------------------------- set-up
def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as lscpu names them (empty where it cannot tell)."""
    return set((_lscpu("Flags") or "").split())


def default_cmake_args(flags: set[str]) -> str:
    """llama.cpp's build: native (``-march=native``), except on CPUs with AMX.

    There ``GGML_NATIVE`` compiles ggml's AMX extra buffer type, which takes the Q4_0 expert
    tensors of this MoE model, and then no backend can run their ``MUL_MAT_ID``: every
    measurement aborts with ``GGML_ASSERT(*cur_backend_id != -1)`` (ggml-backend.cpp:1294,
    llama-cpp-python 0.3.36, seen 2026-12-03). On such CPUs the build names the CPU's other
    features itself (the same kernels a native build picks on an AVX-512 CPU without AMX).
    """
    if "amx_int8" not in flags:
        return CMAKE_ARGS
    on = " ".join(f"-D{opt}=ON" for flag, opt in GGML_FEATURES if flag in flags)
    return f"-DGGML_NATIVE=OFF {on} -DGGML_OPENMP=ON -DCMAKE_BUILD_TYPE=Release"


def llama_venv(cache: Path, cmake_args: str) -> Path:
    """The venv with llama-cpp-python built from the sdist (made once per build options, then
    reused)."""
    venv = cache / "venv"
    py = venv / "bin" / "python"
    check = f"import llama_cpp, gguf; assert llama_cpp.__version__ == '{LLAMA_CPP_PYTHON}'"
    record = cache / "llama-build.json"
    built_with = json.loads(record.read_text()).get("CMAKE_ARGS") if record.exists() else None
    if (
        built_with == cmake_args
        and py.exists()
        and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0
    ):
        return py
    if venv.exists():
        log(f"{venv} was built with {built_with!r}; rebuilding with {cmake_args!r}")
        shutil.rmtree(venv)
    log(f"building llama-cpp-python {LLAMA_CPP_PYTHON} from the sdist in {venv} (minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-U", "pip"], check=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count()))
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []  # a long build, others first
    with open(cache / "llama-build.log", "w") as logf:
        subprocess.run(
            [
                *nice,
                *pip,
                "-v",
                # Not pip's wheel cache: a wheel built with other CMAKE_ARGS would be reused.
                "--no-cache-dir",
                "--no-binary",
                "llama-cpp-python",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            ],
            check=True,
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    subprocess.run([*pip, f"gguf=={GGUF}", "numpy"], check=True)
    (cache / "llama-build.json").write_text(json.dumps({"CMAKE_ARGS": cmake_args}))
    return py


def llama_facts(py: Path) -> dict[str, Any]:
    code = (
        "import json, llama_cpp as L; L.llama_backend_init(); print(json.dumps({"
        "'llama_cpp_python': L.__version__, "
        "'system_info': L.llama_print_system_info().decode()}))"
    )
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def snapshot_colibri(py: str, cache: Path) -> tuple[Path, dict[str, Any]]:
    """Copy the colibri package ``py`` imports to CACHE/colibri-snapshot; its provenance."""
    code = (
        "import json, inspect, colibri; from colibri import _core; "
        "print(json.dumps({'file': colibri.__file__, "
        "'prefill': 'prefill' in inspect.signature(colibri.Model.__init__).parameters or "
        "'prefill' in inspect.signature(colibri.Model.generate).parameters, "
        "'prefill_modes': list(getattr(getattr(colibri, 'validation', None), "
        "'_PREFILL_MODES', None) or ['fast', 'exact']), "
        "'version': getattr(colibri, '__version__', None)}))"
    )
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True)
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    pkg = Path(facts["file"]).parent
    snap = cache / "colibri-snapshot"
    shutil.rmtree(snap, ignore_errors=True)
    snap.mkdir(parents=True)
    shutil.copytree(pkg, snap / "colibri", ignore=shutil.ignore_patterns("__pycache__"))
    facts["source"] = str(pkg)
    facts.update(provenance(pkg))
    ext = sorted(pkg.glob("_core*.so"))
    if ext:  # when the extension was built: a checkout's HEAD may have moved on since
        facts["extension_built"] = time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(ext[0].stat().st_mtime)
        )
    return snap, facts


def provenance(pkg: Path) -> dict[str, Any]:
    """The git commit the colibri package was built from, where that can be told: an editable
    install lives in a checkout; a plain install records its source in direct_url.json."""
    where: Path | None = pkg
    for d in pkg.parent.glob("colibri-*.dist-info/direct_url.json"):
        url = json.loads(d.read_text()).get("url", "")
        if url.startswith("file://"):
            where = Path(url[7:])
    try:
        root = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--show-toplevel"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        head = subprocess.run(
            ["git", "-C", root, "log", "-1", "--format=%h %cI %s"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return {"checkout": root, "commit": head, "dirty": bool(dirty)}
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": None}


def colibri_info(py: str, snap: Path, model: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """colibri's bytes: file total and the weights one token reads (embedding excluded,
    routed experts scaled by experts-per-token / experts)."""
    code = (
        "import json, sys, colibri; m = colibri.Model(sys.argv[1], threads=1); "
        "print(json.dumps(m.info()))"
    )
    env = dict(os.environ, PYTHONPATH=str(snap))
    out = subprocess.run(
        [py, "-c", code, str(model)], check=True, capture_output=True, text=True, env=env
    )
    info = json.loads(out.stdout.strip().splitlines()[-1])
    roles = {r: sum(f.values()) for r, f in info["tensors"].items()}
    frac = cfg["num_experts_per_tok"] / cfg["n_routed_experts"]
    per_token = sum(b for r, b in roles.items() if r not in ("embed", "routed_experts"))
    per_token += roles.get("routed_experts", 0) * frac
    return {
        "file_bytes": info["total_bytes"],
        "bytes_per_token": int(per_token),
        "roles": roles,
        "kv_bytes_per_token": info["memory"]["kv_bytes_per_token"],
    }


def warm(paths: list[Path]) -> None:
    """Read every file once so the measurement finds it in the page cache."""
    for p in paths:
        for f in sorted(p.glob("*")) if p.is_dir() else [p]:
            if f.is_file():
                with open(f, "rb", buffering=0) as fh:
                    while fh.read(1 << 23):
                        pass


# -------------------------------------------------------------------------------- the run
KINDS = {"d8": 8, "p512": 512, "p2048": 2048}


def run_one(variant: dict[str, Any], kind: str, args: argparse.Namespace) -> dict[str, Any]:
    prompt = KINDS[kind] if not args.quick else {"d8": 8, "p512": 64, "p2048": 128}[kind]
    gen = 1 if kind == "p2048" else args.gen
    cmd = [
        variant["python"],
        str(Path(__file__).resolve()),
        variant["worker"],
        variant["model"],
        "--threads",
        str(args.threads),
        "--prompt",
        str(prompt),
        "--gen",
        str(gen),
    ]
    if variant.get("prefill"):
        cmd += ["--prefill", variant["prefill"]]
    if variant.get("draft"):
        cmd += ["--draft", variant["draft"]]
    env = dict(os.environ, **variant.get("env", {}))
    busy0, mine0 = cpu_busy(), children_cpu()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    # CPU the rest of the machine used meanwhile, in cores (the measurement's own excluded).
    others = (cpu_busy() - busy0 - (children_cpu() - mine0)) / wall
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r.update(kind=kind, prompt=prompt, gen=gen, process_s=wall, others_cores=others)
            r["loadavg"] = os.getloadavg()[0]
            return r
    raise RuntimeError(f"{variant['name']} {kind} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")


def quiet(max_others: float, timeout: float) -> float:
    """Wait (up to ``timeout`` s) until the rest of the machine uses at most ``max_others``
    cores over a 1-s sample; return the last sample."""
    end = time.monotonic() + timeout
    while True:
        b0, t0 = cpu_busy(), time.perf_counter()
        time.sleep(1.0)
        others = (cpu_busy() - b0) / (time.perf_counter() - t0)
        if others <= max_others or time.monotonic() > end:
            return others


def measure(v: dict[str, Any], kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement on a machine others share: wait for a quiet moment, warm the page
    cache, run; when other processes took more than ``--max-others`` cores meanwhile, run it
    again (``--attempts`` in all) and keep the least disturbed attempt."""
    best: dict[str, Any] | None = None
    tried = []
    for _ in range(args.attempts):
        before = quiet(args.max_others, args.quiet_wait)
        warm([Path(v["model"])])
        r = run_one(v, kind, args)
        r["others_before"] = before
        tried.append(r["others_cores"])
        if best is None or r["others_cores"] < best["others_cores"]:
            best = r
        if r["others_cores"] <= args.max_others:
            break
        log(f"  {v['name']} {kind}: others used {r['others_cores']:.2f} cores, again")
    assert best is not None
    best["attempts_others"] = tried
    return best


def cpu_busy() -> float:
    """CPU seconds every process on the machine has used (all cores), from /proc/stat."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    idle = int(f[3]) + int(f[4])
    return (sum(int(x) for x in f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def report(res: dict[str, Any]) -> str:
    """The markdown tables."""
    bw = res["ceilings"]["read_GBps"] * 1e9
    fma = res["ceilings"]["fma_f32_GFLOPs"] * 1e9
    vnni = res["ceilings"].get("vnni_int8_GOPs")
    fpt = res["model"]["flops_per_token"]
    lines = [
        "| engine | bytes/token MB | decode tok/s after 8 | decode tok/s after 512 | "
        "prefill tok/s 512 | prefill tok/s 2048 | decode % of BW | prefill % of FMA | "
        "peak RSS MiB | others' CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in res["variants"]:
        s = v["summary"]
        bpt = v["bytes_per_token"]

        def f(x: float | None, fmt: str = "{:.1f}") -> str:
            return "—" if x is None else fmt.format(x)

        d8, d512, p512, p2048 = (
            s.get(k) for k in ("decode_8", "decode_512", "prefill_512", "prefill_2048")
        )
        pct_bw = None if d8 is None else 100 * d8 * bpt / bw
        best_p = max([x for x in (p512, p2048) if x is not None], default=None)
        pct_fma = None if best_p is None else 100 * best_p * fpt / fma
        lines.append(
            f"| {v['name']} | {bpt / 1e6:.0f} | {f(d8)} | {f(d512)} | {f(p512)} | {f(p2048)} | "
            f"{f(pct_bw, '{:.0f}%')} | {f(pct_fma, '{:.0f}%')} | "
            f"{f(s.get('peak_rss'), '{:.0f}')} | {f(s.get('others_cores'), '{:.2f}')} |"
        )
    lines.append("")
    lines.append(
        f"Bandwidth {res['ceilings']['read_GBps']:.1f} GB/s (2-thread streaming read), "
        f"FMA ceiling {res['ceilings']['fma_f32_GFLOPs']:.0f} GFLOP/s f32"
        + (f", VNNI ceiling {vnni:.0f} GOP/s int8" if vnni else "")
        + f"; {fpt / 1e9:.3f} GFLOP per token."
    )
    floor = res["ceilings"].get("exact_floor_GBps")
    if floor:
        lines.append(
            f"Exact-arithmetic stream floor {floor:.1f} GB/s ({100 * floor * 1e9 / bw:.0f}% of the "
            "bandwidth): the same stream with one f32 FMA lane per int4 weight and no decoding, "
            "the most an exact S = 1 decode can reach on this machine."
        )
    if res.get("ratios"):
        lines.append("")
        lines.append("| ratio (one run) | value | goal |")
        lines.append("|---|---|---|")
        for name, val, goal in res["ratios"]:
            lines.append(f"| {name} | {'—' if val is None else f'{val:.2f}'} | {goal} |")
    return "\n".join(lines)


def ratios(res: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    by = {v["name"]: v for v in res["variants"]}
    llama = [v for v in res["variants"] if v["engine"] == "llama.cpp"]
    col = [v for v in res["variants"] if v["engine"] == "colibri" and v.get("draft") == "off"]
    if not llama or not col:
        return []
    bw = res["ceilings"]["read_GBps"] * 1e9
    fma = res["ceilings"]["fma_f32_GFLOPs"] * 1e9
    vnni = res["ceilings"].get("vnni_int8_GOPs")
    fpt = res["model"]["flops_per_token"]
    out: list[tuple[str, float | None, str]] = []

    def best(vs: list[dict[str, Any]], key: str) -> tuple[str, float] | None:
        got = [(v["name"], v["summary"][key]) for v in vs if v["summary"].get(key)]
        return max(got, key=lambda x: x[1]) if got else None

    for key, goal in (
        ("prefill_512", "≥ 1.5"),
        ("prefill_2048", "≥ 1.5"),
        ("decode_8", "≥ 1.2"),
        ("decode_512", "≥ 1.2"),
    ):
        c, ll = best(col, key), best(llama, key)
        if c and ll:
            out.append((f"colibri / llama.cpp {key} ({c[0]} / {ll[0]})", c[1] / ll[1], goal))
    for key in ("decode_8", "decode_512"):
        c = best(col, key)
        if c:
            bpt = by[c[0]]["bytes_per_token"]
            out.append(
                (f"{c[0]} {key}: tok/s x bytes/token / bandwidth", c[1] * bpt / bw, "≥ 0.85")
            )
    floor = res["ceilings"].get("exact_floor_GBps")
    if floor:
        out.append(
            (
                "exact-arithmetic stream floor / bandwidth (what exact decode could reach here)",
                floor * 1e9 / bw,
                "≥ 0.85 for the 85% goal to be reachable",
            )
        )
    for key in ("prefill_512", "prefill_2048"):
        c = best(col, key)
        if c:
            out.append(
                (f"{c[0]} {key}: tok/s x flops/token / FMA ceiling", c[1] * fpt / fma, "≥ 0.60")
            )
            if vnni:
                out.append(
                    (
                        f"{c[0]} {key}: tok/s x flops/token / VNNI ceiling",
                        c[1] * fpt / (vnni * 1e9),
                        "(≥ 0.60 if VNNI is the path)",
                    )
                )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path("/work/llamabench"),
        help="where the venv, checkpoints and GGUFs live (outside the repository)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round, short prompts")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=None, help="decode tokens (default 64, quick 16)")
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"], help="llama.cpp quant types")
    ap.add_argument(
        "--colibri-python",
        default=sys.executable,
        help="the interpreter that imports colibri (default: this one)",
    )
    ap.add_argument(
        "--no-snapshot",
        action="store_true",
        help="run the installed colibri package instead of a copy of it",
    )
    ap.add_argument(
        "--cmake-args",
        default=default_cmake_args(cpu_flags()),
        help="llama.cpp's build options (default: native; AMX left out where the CPU has it)",
    )
    ap.add_argument("--probe-gib", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per measurement")
    ap.add_argument("--keep-bf16-gguf", action="store_true")
    ap.add_argument(
        "--max-others",
        type=float,
        default=0.3,
        help="cores other processes may use during a measurement before it is repeated",
    )
    ap.add_argument("--attempts", type=int, default=3, help="tries per measurement")
    ap.add_argument("--quiet-wait", type=float, default=120, help="seconds to wait for quiet")
    ap.add_argument("--json", type=Path, default=None, help="default: CACHE/results-<time>.json")
    args = ap.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    args.gen = args.gen or (16 if args.quick else 64)
    cache = args.cache.resolve()
    if cache == ROOT or ROOT in cache.parents:
        raise SystemExit("--cache must be outside the repository")
    cache.mkdir(parents=True, exist_ok=True)

    cfg = bench_config(args.quick)
    tag = ("quick-" if args.quick else "dsv3-") + config_hash(cfg)
    work = cache / tag
    work.mkdir(exist_ok=True)
    llama_py = llama_venv(cache, args.cmake_args)

    hf, col_dir = work / "hf-bf16", work / "colibri"
    if not (hf / "config.json").exists():
        log(f"writing the BF16 checkpoint to {hf}")
        make_checkpoint(hf, cfg)
    snap, col_facts = snapshot_colibri(args.colibri_python, cache)
    col_env = {} if args.no_snapshot else {"PYTHONPATH": str(snap)}
    log(
        f"colibri from {col_facts['source']} (commit {col_facts.get('commit')}, "
        f"dirty {col_facts.get('dirty')}), prefill option: {col_facts['prefill']}"
    )
    if not (col_dir / "config.json").exists():
        log(f"colibri convert -> {col_dir}")
        t0 = time.perf_counter()
        code = "import sys; from colibri.convert import convert; convert(sys.argv[1], sys.argv[2])"
        subprocess.run(
            [args.colibri_python, "-c", code, str(hf), str(col_dir)],
            check=True,
            env=dict(os.environ, **col_env),
        )
        log(f"  {time.perf_counter() - t0:.0f} s")
    ggufs = {t: work / f"model-{t}.gguf" for t in args.types}
    bf16 = work / "model-BF16.gguf"
    me = str(Path(__file__).resolve())
    if not all(p.exists() for p in ggufs.values()):
        if not bf16.exists():
            log(f"writing {bf16}")
            subprocess.run([str(llama_py), me, "_gguf", str(hf), str(bf16)], check=True)
        for t, p in ggufs.items():
            if not p.exists():
                log(f"llama_model_quantize {t} -> {p}")
                t0 = time.perf_counter()
                subprocess.run(
                    [str(llama_py), me, "_quantize", str(bf16), str(p), t, str(args.threads)],
                    check=True,
                )
                log(f"  {time.perf_counter() - t0:.0f} s")
        if not args.keep_bf16_gguf:
            bf16.unlink()

    total, active = params(cfg)
    model = {
        "config": cfg,
        "params_2d": total,
        "params_per_token": active,
        "flops_per_token": flops_per_token(cfg),
        "hf_bf16_bytes": sum(f.stat().st_size for f in hf.glob("*.safetensors")),
    }
    col = colibri_info(args.colibri_python, snap, col_dir, cfg)
    variants: list[dict[str, Any]] = []
    # Every prefill arithmetic colibri offers ("auto" picks one of them), else its only one.
    modes = [m for m in col_facts["prefill_modes"] if m != "auto"] if col_facts["prefill"] else []
    modes = modes or [None]
    for mode in modes:
        variants.append(
            {
                "name": "colibri" + (f" prefill={mode}" if mode else ""),
                "engine": "colibri",
                "python": args.colibri_python,
                "worker": "_colibri",
                "model": str(col_dir),
                "prefill": mode,
                "draft": "off",
                "env": col_env,
                "kinds": list(KINDS),
                "bytes_per_token": col["bytes_per_token"],
                "file_bytes": col["file_bytes"],
            }
        )
    variants.append(
        {
            "name": "colibri draft=auto (ngram)",
            "engine": "colibri",
            "python": args.colibri_python,
            "worker": "_colibri",
            "model": str(col_dir),
            "prefill": None,
            "draft": "auto",
            "env": col_env,
            "kinds": ["d8", "p512"],
            "bytes_per_token": col["bytes_per_token"],
            "file_bytes": col["file_bytes"],
        }
    )
    for t, p in ggufs.items():
        gb = json.loads(
            subprocess.run(
                [str(llama_py), me, "_ggufbytes", str(p), str(hf / "config.json")],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        variants.append(
            {
                "name": f"llama.cpp {t}",
                "engine": "llama.cpp",
                "python": str(llama_py),
                "worker": "_llama",
                "model": str(p),
                "kinds": list(KINDS),
                "bytes_per_token": gb["bytes_per_token"],
                "file_bytes": gb["file_bytes"],
                "gguf_types": gb["types"],
            }
        )

    facts = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu": _lscpu("Model name"),
        "cpu_flags": sorted(
            f
            for f in (_lscpu("Flags") or "").split()
            if f.startswith(("avx512", "avx_vnni", "amx", "fma", "avx2"))
        ),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "loadavg_start": os.getloadavg(),
        "colibri": col_facts,
        "llama": {**llama_facts(llama_py), "cmake_args": args.cmake_args},
        "quick": args.quick,
        "rounds": rounds,
        "gen": args.gen,
        "warmup": f"{WARMUP_PROMPT}-token prompt + {WARMUP_GEN} tokens in the same process",
    }
    log("probe: bandwidth / FMA / VNNI")
    probes = [probe(cache, args.threads, args.probe_gib)]
    log(f"  {probes[0]}")
    rows: list[dict[str, Any]] = []
    out = args.json or cache / f"results-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    for rnd in range(rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for kind in KINDS:
            for v in order:
                if kind not in v["kinds"]:
                    continue
                r = measure(v, kind, args)
                r.update(variant=v["name"], round=rnd)
                rows.append(r)
                log(
                    f"round {rnd} {v['name']:<28} {kind:<6} prefill {r['prefill_tok_s']:7.1f} "
                    f"decode {r['decode_tok_s'] or 0:6.1f} tok/s  RSS {r['VmHWM'] / 2**20:6.0f} MiB"
                    f"  others {r['others_cores']:.2f} cores"
                )
            partial = results(facts, model, col, probes, variants, rows)
            out.write_text(json.dumps(partial, indent=1))
    probes.append(probe(cache, args.threads, args.probe_gib))
    log(f"  {probes[-1]}")
    facts["loadavg_end"] = os.getloadavg()
    res = results(facts, model, col, probes, variants, rows)
    out.write_text(json.dumps(res, indent=1))
    print(report(res))
    print(f"\nJSON: {out}")


def results(
    facts: dict[str, Any],
    model: dict[str, Any],
    col: dict[str, Any],
    probes: list[dict[str, Any]],
    variants: list[dict[str, Any]],
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """Everything measured so far, with each variant's medians and the goals' ratios."""
    ceilings = {
        "read_GBps": max(p["read_GBps"] for p in probes),
        "fma_f32_GFLOPs": max(p["fma_f32_GFLOPs"] for p in probes),
        "vnni_int8_GOPs": max((p["vnni_int8_GOPs"] or 0) for p in probes) or None,
        "exact_floor_GBps": max((p.get("exact_floor_GBps") or 0) for p in probes) or None,
        "probes": probes,
        "method": "rustc-compiled probe (benches/probes.rs method), before and after; max",
    }
    out = []
    for v in variants:
        mine = [r for r in rows if r["variant"] == v["name"]]
        by = {k: [r for r in mine if r["kind"] == k] for k in KINDS}
        v = {k: x for k, x in v.items() if k != "env"}
        v["summary"] = {
            "decode_8": med(by["d8"], "decode_tok_s"),
            "decode_512": med(by["p512"], "decode_tok_s"),
            "prefill_512": med(by["p512"], "prefill_tok_s"),
            "prefill_2048": med(by["p2048"], "prefill_tok_s"),
            "peak_rss": max((r["VmHWM"] for r in mine), default=0) / 2**20,
            "others_cores": med(mine, "others_cores"),
            "n": {k: len(x) for k, x in by.items()},
        }
        out.append(v)
    res = {
        "facts": facts,
        "model": model,
        "colibri_bytes": col,
        "ceilings": ceilings,
        "variants": out,
        "rows": rows,
    }
    res["ratios"] = ratios(res)
    return res


def _lscpu(field: str) -> str | None:
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return None
    m = re.search(rf"^{field}:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else None


def sub() -> None:
    """The internal subcommands this script runs in the child processes."""
    cmd = sys.argv[1]
    if cmd == "_gguf":
        write_gguf(Path(sys.argv[2]), Path(sys.argv[3]))
    elif cmd == "_quantize":
        quantize(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    elif cmd == "_ggufbytes":
        cfg = json.loads(Path(sys.argv[3]).read_text())
        print(json.dumps(gguf_bytes(Path(sys.argv[2]), cfg)))
    else:
        ap = argparse.ArgumentParser()
        ap.add_argument("model")
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--prompt", type=int, required=True)
        ap.add_argument("--gen", type=int, required=True)
        ap.add_argument("--prefill", default=None)
        ap.add_argument("--draft", default="off")
        a = ap.parse_args(sys.argv[2:])
        r = worker_colibri(a) if cmd == "_colibri" else worker_llama(a)
        print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sub()
    else:
        main()
