"""tools/ab_inprocess.py, the paired in-process A/B of decode options, on the embedded tiny
model: the run it makes, its summary, and its refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
from helpers.tools import load_tool

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "python" / "colibri" / "models" / "tiny"


@pytest.fixture(scope="module")
def tool():
    return load_tool("ab_inprocess")


def test_paired_difference_is_per_round(tool) -> None:
    p = tool.paired([10.0, 20.0], [11.0, 18.0])
    assert math.isclose(p["mean"], (0.1 - 0.1) / 2, abs_tol=1e-12)
    assert p["b_faster"] == 1 and p["rounds"] == 2
    assert math.isclose(p["se"], 0.1, rel_tol=1e-9)  # stdev of (0.1, -0.1) is 0.1414 / sqrt 2
    assert (p["a_median"], p["b_median"]) == (15.0, 14.5)


def test_a_run_on_the_tiny_model_reports_every_slot(tool, capsys) -> None:
    s = tool.main([str(TINY), "{}", '{"prefetch": "off"}', "--gen", "4", "--rounds", "2", "--json"])
    assert set(s["slot_medians"]) == {"A0", "B1", "B2", "A3"}
    assert all(v > 0 for v in s["slot_medians"].values())
    assert s["b_vs_a"]["rounds"] == 2
    # Prefetch never changes what is computed: every slot decoded the same greedy tokens.
    assert s["same_tokens"] is True
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("0 [") and out[1].startswith("1 [")
    assert out[-2].startswith("B vs A: ")


def test_several_processes_are_summarised_across_processes(tool, capsys) -> None:
    args = [str(TINY), "{}", '{"prefetch": "off"}', "--gen", "3", "--rounds", "2"]
    s = tool.main([*args, "--processes", "2", "--json"])
    assert len(s["processes"]) == 2
    means = [r["b_vs_a"]["mean"] for r in s["processes"]]
    assert math.isclose(s["mean"], sum(means) / 2)
    assert math.isclose(s["se"], abs(means[0] - means[1]) / 2, rel_tol=1e-9)
    assert s["same_tokens"] is True
    out = capsys.readouterr().out.splitlines()
    assert out[0].startswith("process 1: B vs A ") and out[1].startswith("process 2: ")


def test_bad_options_are_refused(tool) -> None:
    with pytest.raises(SystemExit, match="JSON object"):
        tool.parse_options("prefetch=off")
    with pytest.raises(SystemExit, match="JSON object, not list"):
        tool.parse_options("[1]")
    with pytest.raises(SystemExit, match="at least 2"):
        tool.main([str(TINY), "{}", "{}", "--rounds", "1"])
    with pytest.raises(SystemExit, match="--processes must be at least 1"):
        tool.main([str(TINY), "{}", "{}", "--processes", "0"])
