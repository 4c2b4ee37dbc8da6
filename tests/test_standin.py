"""The disk-scale stand-in (tools/make_standin.py) computes exactly the original model.

The stand-in zero-pads every expert's intermediate dimension; the padded weights are stored
zeros, so logits must be bit-identical and greedy tokens (plain and speculative) identical.
The test builds a small stand-in (intermediate 1024 instead of the default GLM-5.2 size,
which would write 1.8 GB) of the shipped trained tiny model.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from colibri import _core
from helpers.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
TOOL = ROOT / "tools" / "make_standin.py"
TINY = ROOT / "python" / "colibri" / "models" / "tiny"


def build(dst: Path, *extra: str) -> dict:
    out = subprocess.run(
        [sys.executable, str(TOOL), str(TINY), str(dst), "--intermediate", "1024", "-q", *extra],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(out.stdout)


@pytest.fixture(scope="module")
def standin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The proportional stand-in: main experts padded, the MTP layer's kept."""
    dst = tmp_path_factory.mktemp("standin") / "tiny"
    assert build(dst)["moe_intermediate_size"] == 1024
    return dst


@pytest.fixture(scope="module")
def standin_padded_mtp(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The naive stand-in: the MTP layer's experts padded like the others."""
    dst = tmp_path_factory.mktemp("standin") / "tiny-pad"
    build(dst, "--mtp", "pad")
    return dst


@pytest.fixture(scope="module")
def standin_wide_shared(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The shared experts padded to 3 routed experts' width (n_shared_experts 3)."""
    dst = tmp_path_factory.mktemp("standin") / "tiny-shared"
    build(dst, "--shared-experts", "3")
    return dst


def test_expert_size_formula_matches_glm52() -> None:
    tool = load_tool("make_standin")
    # GLM-5.2: hidden 6144, moe_intermediate 2048, int4 groups of 64 with f32 scales.
    assert tool.expert_bytes("int4_g64", 6144, 2048) == tool.GLM52_EXPERT_BYTES == 21_233_664
    # The tiny model (hidden 256) reaches that size at intermediate 49152.
    assert tool.expert_bytes("int4_g64", 256, 49152) == 21_233_664
    assert tool.expert_bytes("int4_g64", 256, 49152 - 64) < 21_233_664


def test_standin_is_bigger_and_readonly_source(standin: Path, standin_padded_mtp: Path) -> None:
    cfg = json.loads((standin / "config.json").read_text())
    assert cfg["moe_intermediate_size"] == 1024
    assert cfg["colibri_mtp_moe_intermediate_size"] == 128
    assert "colibri_mtp_moe_intermediate_size" not in json.loads(
        (standin_padded_mtp / "config.json").read_text()
    )
    sizes = [
        _core.Engine(str(d), usage_file=False, io="pread", prefetch="off").expert_stats()["layers"]
        for d in (standin, standin_padded_mtp)
    ]
    assert sizes[0].keys() == sizes[1].keys()
    src_cfg = json.loads((TINY / "config.json").read_text())
    assert src_cfg["moe_intermediate_size"] == 128  # the source is untouched
    eng = _core.Engine(str(standin), usage_file=False, io="pread", prefetch="off")
    st = eng.expert_stats()
    assert st["layers"]  # opened as a streaming container
    assert not (standin / "colibri-usage.json").exists()


def test_wide_shared_experts_are_that_many_routed_ones(standin_wide_shared: Path) -> None:
    cfg = json.loads((standin_wide_shared / "config.json").read_text())
    assert cfg["n_shared_experts"] == 3
    assert json.loads((TINY / "config.json").read_text())["n_shared_experts"] == 1
    # Every shared projection (main layers and the MTP layer's) is 3 widths of its layer's.
    tool = load_tool("make_standin")
    names = {t.name: t for t in tool.list_tensors(standin_wide_shared)}
    src = {t.name: t for t in tool.list_tensors(TINY)}
    gates = [n for n in names if n.endswith("mlp.shared_experts.gate_proj.weight")]
    assert len(gates) == cfg["num_hidden_layers"] - cfg["first_k_dense_replace"] + 1
    for n in gates:
        mtp = int(n.split(".")[2]) >= cfg["num_hidden_layers"]
        width = 128 if mtp else 1024
        grown = names[n].end - names[n].start
        assert grown == (src[n].end - src[n].start) * 3 * width // 128, n


@pytest.mark.parametrize("variant", ["standin", "standin_padded_mtp", "standin_wide_shared"])
def test_standin_logits_and_tokens_equal_original(
    variant: str, request: pytest.FixtureRequest
) -> None:
    standin: Path = request.getfixturevalue(variant)
    ids = [0, *range(100, 160)]
    orig = _core.Engine(str(TINY), usage_file=False)
    big = _core.Engine(str(standin), usage_file=False, io="pread", ram_budget=0)
    a, b = orig.logits(ids), big.logits(ids)
    assert a.shape == b.shape
    assert np.array_equal(a, b), f"max |diff| {np.abs(a - b).max()}"
    for draft, depth in (("off", 0), ("mtp", 2), ("ngram", 3)):
        g1 = orig.generate(ids, max_new_tokens=40, draft=draft, draft_depth=depth, stop_ids=[])
        g2 = big.generate(ids, max_new_tokens=40, draft=draft, draft_depth=depth, stop_ids=[])
        assert g1["tokens"] == g2["tokens"], draft


def test_nonzero_padding_would_be_caught(tmp_path: Path) -> None:
    """Negative control: the same tool padding with non-zero weights changes the logits, so
    the equality above checks the padding and is not a no-op."""
    tool = load_tool("make_standin")
    tool.ZERO_INT4, tool.ZERO_INT8, tool.FLOOR_SCALE = 0x99, 1, np.float32(0.01)
    bad = tmp_path / "bad"
    assert tool.main([str(TINY), str(bad), "--intermediate", "1024", "-q"]) == 0
    ids = [0, *range(100, 160)]
    a = _core.Engine(str(TINY), usage_file=False).logits(ids)
    b = _core.Engine(str(bad), usage_file=False).logits(ids)
    assert a.shape == b.shape
    assert not np.array_equal(a, b)


def test_disk_bench_runs_and_checks_tokens(standin: Path, tmp_path: Path) -> None:
    """tools/bench_disk.py end to end on the small stand-in: every cell prints a row, the
    learned pins come from the other workload, and the stand-in keeps no history file."""
    jsonl = tmp_path / "runs.jsonl"
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_disk.py"),
            str(standin),
            "--budgets",
            "0",
            "0.5",
            "--drafts",
            "off",
            "mtp1",
            "--prefetch",
            "off",
            "real",
            "--pins",
            "off",
            "learned",
            "--runs",
            "1",
            "--tokens",
            "6",
            "--learn-tokens",
            "6",
            "--pin-mtp",
            "--io",
            "pread",
            "--jsonl",
            str(jsonl),
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [line for line in out.stdout.splitlines() if line.startswith("| ")]
    # header + 0% (2 drafts x 2 prefetch, no pins at 0%) + 50% (2 x 2 x 2)
    assert len(rows) == 1 + 4 + 8, out.stdout
    runs = [json.loads(line) for line in jsonl.read_text().splitlines()]
    assert len({tuple(r["tokens"]) for r in runs}) == 1
    learned = [r for r in runs if r["pins"] == "learned"]
    assert learned and all(r["pinned_bytes"] > 0 for r in learned)
    assert "MTP layer: resident" in out.stdout
    assert not (standin / "colibri-usage.json").exists()


def test_pin_mtp_keeps_the_mtp_layer_resident(standin: Path) -> None:
    import colibri

    m = colibri.Model(standin, io="pread", ram_budget=0, prefetch="off", pin_mtp=True)
    plain = colibri.Model(standin, io="pread", ram_budget=0, prefetch="off", pin_mtp=False)
    st = m._engine.expert_stats()
    assert st["pinned_bytes"] > 0 and st["budget_bytes"] == st["pinned_bytes"]
    mtp_layer = json.loads((standin / "config.json").read_text())["num_hidden_layers"]
    a = m.generate("def f(x):", max_new_tokens=12, draft="mtp", draft_depth=2)
    b = plain.generate("def f(x):", max_new_tokens=12, draft="mtp", draft_depth=2)
    assert a.token_ids == b.token_ids
    layer = m._engine.expert_stats()["layers"][mtp_layer]
    assert layer["misses"] == 0 and layer["hits_pinned"] > 0
    assert plain._engine.expert_stats()["layers"][mtp_layer]["misses"] > 0


def test_pin_mtp_without_an_mtp_layer_is_a_typed_error(
    tmp_path: Path, test_model_dir: Path
) -> None:
    """``pin_mtp``'s layer list comes from the engine's reading of config.json: its alias
    ``num_mtp_layers`` counts, and a bad config is the engine's ``ConfigError``."""
    import colibri
    from colibri.model import _mtp_layers

    cfg = json.loads((test_model_dir / "config.json").read_text())
    first = cfg["num_hidden_layers"]
    cfg.pop("num_nextn_predict_layers", None)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    with pytest.raises(colibri.InvalidArgumentError, match="no MTP layer"):
        _mtp_layers(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_mtp_layers": 2}))
    assert _mtp_layers(tmp_path) == [first, first + 1]
    del cfg["num_hidden_layers"]
    (tmp_path / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    with pytest.raises(colibri.ConfigError, match="num_hidden_layers"):
        _mtp_layers(tmp_path)


def test_dial_bench_runs_every_cell_and_reads_fewer_bytes_with_fewer_experts(
    standin: Path,
) -> None:
    """tools/bench_dial.py speed end to end on the small stand-in: a row per budget x k', and
    k' = 1 reads fewer expert bytes per token than the model's k = 2."""
    out = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench_dial.py"),
            "speed",
            str(standin),
            "--budgets",
            "0.25",
            "--rounds",
            "2",
            "--tokens",
            "8",
            "--io",
            "pread",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=300,
    )
    rows = [line.split("|") for line in out.stdout.splitlines() if line.startswith("| 25%")]
    assert [r[2].strip() for r in rows] == ["2 of 2", "1 of 2"], out.stdout
    mb = [float(r[6]) for r in rows]
    assert 0 < mb[1] < mb[0], out.stdout
