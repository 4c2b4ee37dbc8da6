"""``colibri plan``: its report, its recommendations as Model keywords, and its errors."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import colibri
import pytest
from colibri.cli import main
from colibri.errors import InvalidArgumentError
from colibri.plan import parse_rate, plan

Capsys = pytest.CaptureFixture[str]

GIVEN = ["--disk-bw", "3.27GB/s", "--compute", "20GB/s"]


def run_json(capsys: Capsys, *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_json_report_has_the_figures_and_model_keywords(capsys: Capsys) -> None:
    r = run_json(capsys, "plan", "glm-5.2", "--ram", "128GB", *GIVEN, "--json")
    assert r["predicted_tokens_per_second"] > 0
    assert 0 < r["hit_rate"] < 1
    assert r["bytes_per_token"] > 0
    assert r["disk"] is None and r["compute"] is None  # both given: no probes
    assert r["disk_bytes_per_second"] == pytest.approx(3.27e9)
    rec = r["recommended"]
    choices = colibri._core.choices()
    assert rec["prefetch"] in choices["prefetch"]
    assert rec["draft"] in choices["draft"]
    # The expert budget is what is left of the RAM after dense weights and the reserve.
    dense = r["plan"]["model"]["dense_bytes"]
    assert rec["ram_budget"] == 128 * 10**9 - dense - 4 * 2**30
    # The best setting is at least as fast as the defaults it was compared with.
    assert r["predicted_tokens_per_second"] >= r["defaults"]["tokens_per_second"]
    assert "scenarios" not in r["plan"]
    assert r["seconds"] < 60


def test_more_ram_predicts_more_hits(capsys: Capsys) -> None:
    small = run_json(capsys, "plan", "glm-5.2", "--ram", "64GB", *GIVEN, "--json")
    large = run_json(capsys, "plan", "glm-5.2", "--ram", "256GB", *GIVEN, "--json")
    assert large["hit_rate"] > small["hit_rate"]
    assert large["bytes_per_token"] < small["bytes_per_token"]


def test_text_report_and_all_settings(capsys: Capsys) -> None:
    capsys.readouterr()
    assert main(["plan", "deepseek-v3", "--ram", "96GB", *GIVEN, "--all"]) == 0
    out = capsys.readouterr().out
    assert "predicted" in out and "recommend" in out and "colibri.Model(" in out
    # Five pin shares x prefetch on/off x depths 0-3.
    assert len([line for line in out.splitlines() if line.startswith(("0.", "1."))]) == 40


def test_a_container_is_planned_from_its_own_shape(test_model_dir: Path) -> None:
    r = plan(test_model_dir, "2GB", disk_bw="1GB/s", compute="5GB/s", reserve="64MB")
    m = r["plan"]["model"]
    cfg = json.loads((test_model_dir / "config.json").read_text())
    assert m["experts"] == cfg["n_routed_experts"]
    assert m["top_k"] == cfg["num_experts_per_tok"]
    # A tiny model fits in 2 GB whole: every expert is held.
    assert r["plan"]["budget_share"] == 1.0


def test_the_disk_is_probed_when_no_rate_is_given(test_model_dir: Path) -> None:
    r = plan(test_model_dir, "2GB", compute="5GB/s", reserve="64MB", probe_seconds=0.2)
    assert r["disk"] is not None and r["disk"]["reads"] >= 4
    assert r["disk_bytes_per_second"] == r["disk"]["bytes_per_second"] > 0


def test_bad_input_gets_clear_errors(capsys: Capsys) -> None:
    with pytest.raises(InvalidArgumentError, match="known config"):
        plan("no-such-model", "64GB", disk_bw=1e9, compute=1e9)
    with pytest.raises(InvalidArgumentError, match="give more than"):
        plan("glm-5.2", "8GB", disk_bw=1e9, compute=1e9)
    with pytest.raises(InvalidArgumentError, match="positive rate"):
        parse_rate("disk_bw", "-3GB/s")
    with pytest.raises(InvalidArgumentError):
        parse_rate("disk_bw", "fast")
    assert parse_rate("disk_bw", "1.5GB/s") == 1.5e9
    capsys.readouterr()
    assert main(["plan", "glm-5.2", "--ram", "8GB", *GIVEN]) == 1
    assert "give more than" in capsys.readouterr().err
