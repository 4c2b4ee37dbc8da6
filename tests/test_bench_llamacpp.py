"""tools/bench_llamacpp.py's arithmetic and the model it builds, without llama.cpp.

The side-by-side benchmark itself needs a llama-cpp-python build (minutes) and is not run
here; these check what its ratios rest on: the flops per token, the bytes per token colibri
reports for the synthetic model, and the shared tokenizer.
"""

from __future__ import annotations

import json
import sys

import pytest
from helpers.tools import load_tool


@pytest.fixture(scope="module")
def tool():
    return load_tool("bench_llamacpp")


@pytest.mark.parametrize("quick", [False, True])
def test_matmuls_cover_every_weight(tool, quick):
    """With every expert active, the per-token matrices are exactly the checkpoint's 2-D
    weights less the embedding: the flops formula misses and double-counts nothing."""
    cfg = tool.bench_config(quick)
    every = dict(cfg, num_experts_per_tok=cfg["n_routed_experts"])
    embed = cfg["vocab_size"] * cfg["hidden_size"]
    total, active = tool.params(every)
    assert active == total - embed
    assert tool.flops_per_token(every) == 2 * active


def test_full_size_model(tool):
    """The documented model: 14 layers, 8 of 64 experts, ~5.56 G parameters, 1.824 GFLOP
    per token."""
    cfg = tool.bench_config(False)
    assert (cfg["num_hidden_layers"], cfg["n_routed_experts"], cfg["num_experts_per_tok"]) == (
        14,
        64,
        8,
    )
    total, active = tool.params(cfg)
    assert total == 5_557_714_944
    assert tool.flops_per_token(cfg) == 2 * active == 1_823_997_952


def test_vocab_is_a_valid_bpe(tool, tmp_path):
    from tokenizers import Tokenizer

    tokens, merges = tool.vocab(4096)
    assert len(tokens) == 4096 and len(set(tokens)) == 4096
    assert len(merges) == 4096 - 258
    tool.write_tokenizer(tmp_path, 4096)
    tok = Tokenizer.from_file(str(tmp_path / "tokenizer.json"))
    assert tok.get_vocab_size() == 4096
    text = "def f(x):\n    return 'héllo' * 2"
    assert tok.decode(tok.encode(text).ids) == text


def test_colibri_bytes_per_token(tool, tmp_path):
    """The quick model converts with colibri's defaults, loads with the generated tokenizer,
    and the bytes per token read from Model.info() match int4-g64 matrices, an int8 LM head
    and f32 routers."""
    from colibri.convert import convert

    cfg = tool.bench_config(True)
    tool.make_checkpoint(tmp_path / "hf", cfg)
    convert(str(tmp_path / "hf"), str(tmp_path / "col"))
    got = tool.colibri_info(sys.executable, tmp_path, tmp_path / "col", cfg)
    want = 0
    for role, rows, cols, n in tool.matmuls(cfg):
        if role == "lm_head":
            per = rows * (cols + 4)
        elif role == "router":
            per = rows * cols * 4
        else:
            per = rows * (cols // 2 + cols // 64 * 4)
        want += per * n
    assert abs(got["bytes_per_token"] - want) / want < 0.01
    assert json.loads((tmp_path / "col" / "config.json").read_text())["num_experts_per_tok"] == 4


def test_llama_cpp_builds_natively_except_where_amx_would_abort_it(tool) -> None:
    """Native flags by default; on an AMX CPU the native features are named one by one,
    AMX left out (its buffer type aborts MUL_MAT_ID on the MoE model)."""
    assert tool.default_cmake_args({"avx2", "fma", "avx512f"}) == tool.CMAKE_ARGS
    amx = {"avx", "avx2", "fma", "f16c", "avx512f", "avx512_vnni", "amx_int8", "amx_tile"}
    args = tool.default_cmake_args(amx).split()
    assert "-DGGML_NATIVE=OFF" in args
    assert {"-DGGML_AVX512=ON", "-DGGML_AVX512_VNNI=ON", "-DGGML_AVX2=ON"} <= set(args)
    # Only what the CPU has, and nothing of AMX.
    assert "-DGGML_AVX512_BF16=ON" not in args
    assert not [a for a in args if "AMX" in a]


def _result(tool, probes):
    """A results document for one colibri and one llama.cpp variant, as `results` builds it."""
    variants = [
        {"name": "colibri", "engine": "colibri", "draft": "off", "bytes_per_token": 5e8},
        {"name": "llama.cpp Q4_0", "engine": "llama.cpp", "bytes_per_token": 5e8},
    ]
    rows = [
        {
            "variant": v["name"],
            "kind": k,
            "decode_tok_s": d,
            "prefill_tok_s": p,
            "VmHWM": 2**30,
            "others_cores": 0.0,
        }
        for v, d, p in ((variants[0], 40.0, 100.0), (variants[1], 50.0, 80.0))
        for k in ("d8", "p512", "p2048")
    ]
    model = {"flops_per_token": 2e9}
    return tool.results({}, model, {}, probes, variants, rows)


def test_exact_floor_is_reported_against_the_bandwidth(tool):
    """The probe's exact-arithmetic stream floor becomes a ratio to the bandwidth (the best of
    the probes, like the bandwidth itself) and a line of the report; results from a probe
    without it (older caches) report neither."""
    probe = {"read_GBps": 30.0, "fma_f32_GFLOPs": 200.0, "vnni_int8_GOPs": None}
    res = _result(tool, [dict(probe, exact_floor_GBps=24.0), dict(probe, exact_floor_GBps=27.0)])
    floor = [r for r in res["ratios"] if r[0].startswith("exact-arithmetic stream floor")]
    assert len(floor) == 1 and floor[0][1] == pytest.approx(0.9)
    # colibri decodes 40 tok/s x 500 MB = 20 GB/s of the 30: the decode ratio beside it.
    decode = [r for r in res["ratios"] if "decode_8: tok/s x bytes/token" in r[0]]
    assert decode[0][1] == pytest.approx(20 / 30)
    assert "Exact-arithmetic stream floor 27.0 GB/s (90% of the bandwidth)" in tool.report(res)

    old = _result(tool, [probe])
    assert not [r for r in old["ratios"] if r[0].startswith("exact-arithmetic")]
    assert "Exact-arithmetic" not in tool.report(old)
