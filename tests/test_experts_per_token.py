"""``experts_per_token``: routing each token to fewer experts than the model's own k, on the
embedded trained model (k = 2 of 16, group-limited, ``norm_topk_prob``). The model's own k
is the model unchanged; fewer change the logits but decoding stays deterministic and
speculation stays lossless against the model with the same value; bad values are refused
with :class:`InvalidArgumentError`, from the API and the command line; a saved context is
only loaded by a model with the value that computed it."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import colibri
import numpy as np
import pytest
from colibri.cli import main
from colibri.errors import InvalidArgumentError, SavedContextError
from conftest import EMBEDDED_TINY
from helpers.tools import load_tool

CODE_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


@pytest.fixture(scope="module")
def full() -> colibri.Model:
    return colibri.Model(draft="off")


@pytest.fixture(scope="module")
def one() -> colibri.Model:
    return colibri.Model(experts_per_token=1, draft="off")


def test_info_reports_the_value_in_effect_and_the_models_own(
    full: colibri.Model, one: colibri.Model
) -> None:
    assert full.info()["routing"] == {"experts_per_token": 2, "num_experts_per_tok": 2}
    assert one.info()["routing"] == {"experts_per_token": 1, "num_experts_per_tok": 2}


def test_the_models_own_k_is_bit_identical(full: colibri.Model) -> None:
    ids = full.encode("def fibonacci(n):\n    if n < 2:\n        return n\n")
    with colibri.Model(experts_per_token=2, draft="off") as same:
        assert same.logits(ids).tobytes() == full.logits(ids).tobytes()
        want = full.generate(CODE_PROMPTS[0], max_new_tokens=32, temperature=0)
        assert same.generate(CODE_PROMPTS[0], max_new_tokens=32, temperature=0).token_ids == (
            want.token_ids
        )


def test_fewer_experts_change_the_logits_and_greedy_stays_deterministic(
    full: colibri.Model, one: colibri.Model
) -> None:
    ids = full.encode("import os\nimport sys\n\ndef main():\n")
    a, b = full.logits(ids), one.logits(ids)
    assert np.isfinite(b).all()
    assert float(np.abs(a - b).max()) > 1e-3
    first = one.generate(CODE_PROMPTS[1], max_new_tokens=40, temperature=0)
    again = one.generate(CODE_PROMPTS[1], max_new_tokens=40, temperature=0)
    assert first.token_ids == again.token_ids
    assert first.stats.expert_hits + first.stats.expert_misses > 0


@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_speculation_stays_lossless_with_fewer_experts(one: colibri.Model, draft: str) -> None:
    """Greedy drafting equals greedy plain decoding of the same (k' = 1) model: the MTP
    layer drafts with k' = 1 too, and the verify is the k' = 1 model."""
    for prompt in CODE_PROMPTS:
        plain = one.generate(prompt, max_new_tokens=40, temperature=0, draft="off")
        for depth in (1, 3):
            out = one.generate(
                prompt, max_new_tokens=40, temperature=0, draft=draft, draft_depth=depth
            )
            assert out.token_ids == plain.token_ids, (prompt, draft, depth)
            assert out.stats.decode_forwards <= plain.stats.decode_forwards


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (3, "1..=2"),
        (100, "1..=2"),
        (0, "1..=2"),
        (-1, "1..=2"),
        (True, "expected an integer"),
        (1.0, "expected an integer"),
        ("2", "expected an integer"),
    ],
)
def test_bad_values_are_refused_with_the_allowed_range(value: Any, says: str) -> None:
    with pytest.raises(InvalidArgumentError, match="experts_per_token") as e:
        colibri.Model(experts_per_token=value)
    assert says in str(e.value)


def test_the_command_line_flag(capsys: pytest.CaptureFixture[str], one: colibri.Model) -> None:
    argv = ["generate", "class Stack:", "-n", "24", "-t", "0", "--draft", "off", "--json"]
    capsys.readouterr()
    assert main([*argv, "--experts-per-token", "1"]) == 0
    got = json.loads(capsys.readouterr().out)
    want = one.generate("class Stack:", max_new_tokens=24, temperature=0)
    assert got["token_ids"] == want.token_ids
    assert main([*argv, "--experts-per-token", "3"]) == 1
    err = capsys.readouterr().err
    assert "experts_per_token" in err and "1..=2" in err


def test_a_saved_context_needs_the_experts_per_token_that_computed_it(
    tmp_path: Path, full: colibri.Model, one: colibri.Model
) -> None:
    """Caches computed with k' = 1 are another model's: a model of its own k refuses them,
    and the other way round; a model with the same k' continues them exactly."""
    for saver, other in ((one, full), (full, one)):
        s = saver.session()
        s.generate(CODE_PROMPTS[2], max_new_tokens=8, temperature=0)
        path = tmp_path / f"ctx-{saver.info()['routing']['experts_per_token']}.bin"
        s.save(path)
        with pytest.raises(SavedContextError, match="experts_per_token"):
            other.load_session(path)
        again = saver.load_session(path)
        kw: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0}
        assert again.generate("\n", **kw).token_ids == s.generate("\n", **kw).token_ids


def test_the_dial_bench_measures_the_cost_against_full_top_k(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """tools/bench_dial.py quality on the embedded model, small: the full row is the
    reference (no KL, full agreement), k' = 1 costs a positive KL and half the bytes."""
    tool = load_tool("bench_dial")
    assert tool.dial_values(2) == [1]
    assert tool.dial_values(6) == [5, 4, 3]
    assert tool.dial_values(8) == [7, 6, 4]
    assert tool.dial_values(1) == []
    capsys.readouterr()
    args = ["quality", str(EMBEDDED_TINY), "--windows", "2", "--seq", "48", "--prompts", "2"]
    assert tool.main([*args, "--gen", "8"]) == 0
    rows = [r.split("|") for r in capsys.readouterr().out.splitlines() if r.startswith("| tiny")]
    assert [r[2].strip() for r in rows] == ["2 of 2", "1 of 2"]
    full, one = rows
    assert float(full[3]) == 0.0 and float(one[3]) > 0.0
    assert float(full[5]) == 1.0 and float(one[5]) < 1.0
    assert float(one[7]) == pytest.approx(float(full[7]) / 2)
