"""Same seed, same text whatever the caches hold: with ``decode="int8"`` (which
``prefill="auto"`` then follows; ``decode="auto"`` is still exact decode with an int8 prefill)
every row is computed from its own tokens alone,
so a prompt prefilled fresh, continued from a cached prefix, restored from a saved context or
run as one lane of a batch samples the same tokens. The negative control (``decode="exact"``
with the chunk-dependent ``prefill="int8"``) must differ for some seed, or the test could not
fail. On the shipped trained tiny model, seeded sampling at temperature 0.9."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import colibri
import pytest

# Code text, as a user would prompt the trained model: a prefix of it (24 or 31 tokens) is
# prefilled first and the rest in a second call, so the chunks differ between runs.
PROMPT = (
    "import numpy as np\n\n\ndef normalize(x):\n    x = np.asarray(x)\n"
    "    return x / np.linalg.norm(x)\n"
)
SEEDS = range(12)


def _sampled(model: colibri.Model, prompt: list[int], seed: int, **kw: Any) -> list[int]:
    return model.generate(prompt, max_new_tokens=16, temperature=0.9, seed=seed, **kw).token_ids


def _runs(model: colibri.Model, tmp_path: Path, prompt: list[int], seed: int) -> dict[str, Any]:
    """The same request four ways; the caches differ each time."""
    out: dict[str, Any] = {}
    model.logits([3])  # the default cache holds something else
    out["fresh"] = _sampled(model, prompt, seed)
    s = model.session()
    s.prefill(prompt[:24])
    out["cached prefix"] = s.generate(
        prompt, max_new_tokens=16, temperature=0.9, seed=seed
    ).token_ids
    path = tmp_path / f"ctx-{seed}.ctx"
    saved = model.session()
    saved.prefill(prompt[:31])
    saved.save(path)
    out["restored"] = (
        model.load_session(path)
        .generate(prompt, max_new_tokens=16, temperature=0.9, seed=seed)
        .token_ids
    )
    lanes = model.generate(
        [prompt[:9], prompt, prompt[:30]], max_new_tokens=16, temperature=0.9, seed=seed
    )
    out["batch lane"] = lanes[1].token_ids
    return out


def test_the_same_seed_gives_the_same_text_whatever_the_cache_holds(tmp_path: Path) -> None:
    arith = "int8" if colibri.Model(threads=1).info()["prefill"] == "int8" else "exact"
    model = colibri.Model(threads=2, draft="off", decode=arith)
    info = model.info()
    assert info["row_invariant"] and info["prefill"] == info["decode"]
    prompt = model.encode(PROMPT)
    assert len(prompt) > 31
    for seed in SEEDS:
        runs = _runs(model, tmp_path, prompt, seed)
        for name, tokens in runs.items():
            assert tokens == runs["fresh"], f"seed {seed}: {name} differs from a fresh prefill"
    # Drafting on (the default draft="auto", depth auto) samples the same text as well.
    drafting = colibri.Model(threads=2, decode=arith)
    for seed in SEEDS:
        assert _sampled(drafting, prompt, seed) == _sampled(model, prompt, seed), seed


def test_the_negative_control_differs_when_rows_depend_on_their_chunk(tmp_path: Path) -> None:
    if colibri.Model(threads=1).info()["prefill"] != "int8":
        pytest.skip("no SIMD int8 kernel on this CPU: every arithmetic here is exact")
    control = colibri.Model(threads=2, draft="off", decode="exact", prefill="int8")
    assert not control.info()["row_invariant"]
    prompt = control.encode(PROMPT)
    differed = 0
    for seed in SEEDS:
        runs = _runs(control, tmp_path, prompt, seed)
        differed += any(tokens != runs["fresh"] for tokens in runs.values())
    assert differed > 0, "the control never differed: the test above could not fail"
