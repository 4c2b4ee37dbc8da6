"""``colibri.Model.generate`` on the tiny DeepSeek-V3 fixture with a byte tokenizer
(see conftest.py): the transformers goldens, results and stats, sampling and its warnings,
stop strings, logprobs, and several completions at once (a list of prompts, ``n``)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path
from typing import Any

import colibri
import numpy as np
import pytest
from colibri import _core
from colibri._text import StopMatcher
from conftest import make_test_model

# Python's own Ctrl-C handler around every test, as in a terminal (see conftest.py).
pytestmark = pytest.mark.usefixtures("_python_sigint_handler")


# ----------------------------------------------------------------------------- goldens


def test_logits_match_transformers(model: colibri.Model, golden_a: dict[str, np.ndarray]) -> None:
    ids = [int(t) for t in golden_a["prompt_ids"]]
    got = model.logits(ids)
    want = golden_a["logits"]
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    assert got.shape == want.shape == (len(ids), 256)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


@pytest.mark.parametrize(
    ("draft", "depth"), [("off", 1), ("mtp", 2), ("ngram", 3), ("auto", "auto")]
)
def test_greedy_matches_transformers(
    model: colibri.Model, golden_a: dict[str, np.ndarray], draft: str, depth: Any
) -> None:
    ids = [int(t) for t in golden_a["prompt_ids"]]
    out = model.generate(
        ids,
        max_new_tokens=32,
        temperature=0,
        stop=None,
        stop_token_ids=[],
        draft=draft,
        draft_depth=depth,
    )
    assert out.token_ids == [int(t) for t in golden_a["greedy_ids"]]
    assert out.finish_reason == "length"
    assert out.text == model.decode(out.token_ids)


# ----------------------------------------------------------------------------- results, stats


def test_result_and_stats(model: colibri.Model) -> None:
    out = model.generate(
        "The quick brown fox",
        max_new_tokens=40,
        temperature=0,
        stop_token_ids=[],
        draft="mtp",
        draft_depth=2,
    )
    assert isinstance(out, colibri.GenerationResult)
    assert str(out) == out.text
    s = out.stats
    assert s.prompt_tokens == len(model.encode("The quick brown fox"))
    assert s.generated_tokens == len(out.token_ids) == 40
    # Prefill is one forward; every decode forward emits at least one token.
    assert 1 <= s.forwards <= s.generated_tokens
    assert s.tokens_per_second > 0
    assert s.prefill_seconds > 0 and s.decode_seconds > 0
    assert len(s.drafts_proposed) == len(s.drafts_accepted) >= 2
    assert sum(s.drafts_proposed) > 0
    assert all(0 <= a <= p for a, p in zip(s.drafts_accepted, s.drafts_proposed, strict=True))
    # Depth 2 drafting: nothing is ever proposed deeper than 2.
    assert sum(s.drafts_proposed[2:]) == 0
    assert 0.0 <= s.acceptance_rate <= 1.0
    # Routed experts go through the expert store: 2 MoE layers x top-4 per token at least.
    assert s.expert_hits + s.expert_misses >= 2 * 4 * s.generated_tokens
    assert (s.expert_bytes_read > 0) == (s.expert_misses > 0)
    # The fixture's budget holds every expert, so "auto" runs no lookahead and has no recall.
    assert model.info()["lookahead"] is False
    assert s.prefetch_recall is None


@pytest.mark.parametrize(
    ("kwargs", "lookahead"),
    [
        ({}, False),
        ({"prefetch": "off"}, False),
        ({"prefetch": "real"}, True),
        ({"prefetch": "hint"}, True),
        # Too small for every expert (each layer's share holds 12 of 16): "auto" keeps the
        # lookahead.
        ({"ram_budget": "300KB"}, True),
        # A share of 4 experts, fewer than 2·k = 8: no room to prefetch, no lookahead.
        ({"ram_budget": "100KB"}, False),
    ],
)
def test_lookahead_runs_unless_off_or_every_expert_fits(
    test_model_dir: Path,
    model: colibri.Model,
    kwargs: dict[str, Any],
    lookahead: bool,
    tmp_path: Path,
) -> None:
    # A fresh cache directory: no routing history, so no pins take a share of the budget.
    m = colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path, **kwargs)
    assert m.info()["lookahead"] is lookahead
    kw: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": []}
    out = m.generate("The quick brown fox", **kw)
    # The lookahead's predictions are what recall counts; its absence changes no token.
    r = out.stats.prefetch_recall
    assert (r is not None and 0.0 <= r <= 1.0) if lookahead else r is None
    assert out.token_ids == model.generate("The quick brown fox", **kw).token_ids


# ----------------------------------------------------------------------------- sampling


def test_sampling_is_seeded(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "top_k": 50}
    a = model.generate("abc", seed=7, stop_token_ids=[], **kw)
    b = model.generate("abc", seed=7, stop_token_ids=[], **kw)
    c = model.generate("abc", seed=8, stop_token_ids=[], **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"top_p": 0.9}, ["top_p"]),
        ({"top_k": 5, "seed": 3}, ["top_k", "seed"]),
        ({"temperature": 0, "top_p": 0.5, "top_k": 2, "seed": 1}, ["top_k", "top_p", "seed"]),
    ],
)
def test_sampling_parameters_on_a_greedy_generation_warn(
    model: colibri.Model, kwargs: dict[str, Any], named: list[str]
) -> None:
    """The test model's generation_config.json does not sample, so without a temperature the
    generation is greedy and top_p/top_k/seed change nothing: say so, as transformers does."""
    greedy = model.generate("abc", max_new_tokens=6, temperature=0, stop_token_ids=[])
    with pytest.warns(UserWarning, match="greedy") as record:
        out = model.generate("abc", max_new_tokens=6, stop_token_ids=[], **kwargs)
    assert out.token_ids == greedy.token_ids
    msg = str(record[0].message)
    assert all(f"'{n}'" in msg for n in named), msg
    assert "temperature" in msg
    assert record[0].filename == __file__, "the warning points at the caller"


def test_sampling_parameters_that_apply_do_not_warn(model: colibri.Model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate("abc", max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, seed=1)
        model.generate("abc", max_new_tokens=4)
        model.chat([{"role": "user", "content": "hi"}], max_new_tokens=2, temperature=0)


def test_generation_config_max_new_tokens_is_the_default(tmp_path: Path) -> None:
    d = make_test_model(tmp_path / "m")
    gc = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gc, "max_new_tokens": 7}))
    m = colibri.Model(d, threads=1)
    kw: dict[str, Any] = {"temperature": 0, "stop_token_ids": []}
    out = m.generate("abc", **kw)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert len(m.generate("abc", max_new_tokens=3, **kw).token_ids) == 3
    assert len("".join(m.generate("abc", stream=True, **kw))) > 0
    # Without it, the default is 128.
    (d / "generation_config.json").write_text(json.dumps(gc))
    assert len(colibri.Model(d, threads=1).generate("abc", **kw).token_ids) == 128
    (d / "generation_config.json").write_text(json.dumps({**gc, "max_new_tokens": "many"}))
    with pytest.raises(colibri.ConfigError, match=r"generation_config\.json.*max_new_tokens"):
        colibri.Model(d, threads=1)


def test_draft_mtp_without_the_head_is_refused_at_construction(
    test_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=r"'draft'.*mtp=False"):
        colibri.Model(test_model_dir, mtp=False, draft="mtp")
    # The other drafters are fine without the head.
    assert colibri.Model(test_model_dir, mtp=False, draft="ngram").default_draft == "ngram"
    # A checkpoint without an MTP layer.
    d = make_test_model(tmp_path / "no-mtp")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    assert not colibri.Model(d, threads=1).has_mtp
    with pytest.raises(colibri.InvalidArgumentError, match=r"'draft'.*has none"):
        colibri.Model(d, threads=1, draft="mtp")


def test_eos_stops_and_is_not_in_the_text(model: colibri.Model) -> None:
    # Make the first greedy token the stop token: generation ends after one token.
    first = model.generate("xyz", max_new_tokens=1, temperature=0, stop_token_ids=[]).token_ids
    out = model.generate("xyz", max_new_tokens=20, temperature=0, stop_token_ids=first)
    assert out.token_ids == first
    assert out.finish_reason == "stop"
    assert out.text == ""


def test_penalties_bias_and_min_tokens_keep_speculation_lossless_on_the_trained_model() -> None:
    m = colibri.Model(threads=1)
    prompt = "def fibonacci(n):\n    "
    kw: dict[str, Any] = {
        "max_tokens": 40,
        "temperature": 0,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.3,
        "logit_bias": {m.encode("\n", add_special_tokens=False)[0]: -2.0},
    }
    plain = m.generate(prompt, draft="off", **kw)
    raw = m.generate(prompt, draft="off", max_tokens=40, temperature=0)
    assert plain.token_ids != raw.token_ids, "the processing changed nothing"
    for depth in (1, 3, "auto"):
        spec = m.generate(prompt, draft="mtp", draft_depth=depth, **kw)
        assert spec.token_ids == plain.token_ids, depth
    assert any(spec.stats.drafts_accepted), "no draft was accepted: the test shows nothing"
    sampled = {**kw, "temperature": 0.8, "top_p": 0.95, "min_p": 0.05, "seed": 9}
    assert (
        m.generate(prompt, draft="mtp", draft_depth=2, **sampled).token_ids
        == m.generate(prompt, draft="off", **sampled).token_ids
    )
    # min_tokens: the stop token greedy picks first cannot end the generation early.
    first = raw.token_ids[0]
    held = m.generate(prompt, max_tokens=6, temperature=0, stop_token_ids=[first], min_tokens=3)
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    # ignore_eos removes only the EOS ids from the stop set.
    out = m.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 4


def test_prefill_arithmetic_option_is_chosen_reported_and_keeps_drafting_lossless() -> None:
    """``prefill="int8"`` changes the prompt's forward only: the first token's logprob moves a
    little against the exact prefill, drafting after it still equals plain decoding after
    the same prefill, and ``info()`` reports what "auto" chose."""
    prompt = (
        "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n"
        "    while i < len(a) and j < len(b):\n"
    )
    exact = colibri.Model(threads=1, prefill="exact")
    int8 = colibri.Model(threads=1, prefill="int8")
    auto = colibri.Model(threads=1)
    assert exact.info()["prefill"] == "exact"
    assert int8.info()["prefill"] == "int8"
    # "auto" is int8 wherever a SIMD int8 kernel runs: AVX-512 VNNI or AVX2 (+ FMA).
    features = set(_core.cpu_features())
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= features
    avx2 = {"avx2", "fma"} <= features
    assert auto.info()["prefill"] == ("int8" if vnni or avx2 else "exact")
    assert len(exact.encode(prompt)) >= 16
    kw: dict[str, Any] = {"max_new_tokens": 24, "temperature": 0, "logprobs": 0}
    a = exact.generate(prompt, draft="off", **kw)
    b = int8.generate(prompt, draft="off", **kw)
    assert a.logprobs is not None and b.logprobs is not None
    # The first token comes from the prefill's last row: int8 moves its logprob a little.
    assert a.logprobs[0] != b.logprobs[0]
    assert abs(a.logprobs[0] - b.logprobs[0]) < 0.1
    for draft, depth in [("mtp", 2), ("mtp", "auto"), ("ngram", 3)]:
        out = int8.generate(prompt, draft=draft, draft_depth=depth, **kw)
        assert out.token_ids == b.token_ids, (draft, depth)
    with pytest.raises(colibri.InvalidArgumentError, match="prefill"):
        colibri.Model(prefill="fast")  # type: ignore[arg-type]


# ----------------------------------------------------------------------------- stop strings


def test_stop_matcher_holds_back_only_real_prefixes() -> None:
    m = StopMatcher(["END", "\n\n"])
    assert m.safe_len("abc") == 3
    assert m.safe_len("abcE") == 3
    assert m.safe_len("abcEN") == 3
    assert m.safe_len("abc\n") == 3
    assert m.safe_len("abcEX") == 5
    assert m.check("xxENDyy\n\n") == 2
    assert m.check("no stop here") is None


def _stop_candidate(text: str) -> str:
    """A two-character stop string from the middle of ``text`` (no U+FFFD)."""
    for i in range(len(text) // 3, len(text) - 2):
        s = text[i : i + 2]
        if "\ufffd" not in s and text.find(s) == i:
            return s
    raise AssertionError(f"no stop candidate in {text!r}")


def test_stop_strings(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 80, "temperature": 0, "stop_token_ids": []}
    full = model.generate("Hello", **kw).text
    stop = _stop_candidate(full)
    want = full[: full.index(stop)]
    out = model.generate("Hello", stop=stop, **kw)
    assert out.text == want
    assert out.finish_reason == "stop"
    # Also as one of several; and in streaming, where the stop string arrives one byte per
    # token: its first character must never be shown.
    out2 = model.generate("Hello", stop=["\x00never\x00", stop], **kw)
    assert out2.text == want
    chunks = list(model.generate("Hello", stop=[stop], stream=True, **kw))
    # Joined chunks equal the truncated text: the stop string's first char never leaked.
    assert "".join(chunks) == want


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_match_the_logits_of_an_independent_forward() -> None:
    m = colibri.Model(threads=1)
    prompt = m.encode("import os\nimport ")
    out = m.generate(prompt, max_tokens=6, temperature=0, logprobs=4, stop_token_ids=[])
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    ctx = list(prompt)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        row = m.logits(ctx)[-1].astype(np.float64)
        log_softmax = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert abs(lp - log_softmax[tok]) < 1e-4
        assert len(top) == 4 and top[0][0] == tok
        assert [t for t, _ in top] == list(np.argsort(-row, kind="stable")[:4])
        ctx.append(tok)
    # Sampling reports the law it drew from: a top-k cut token has -inf.
    s = m.generate(prompt, max_tokens=3, temperature=1.0, top_k=2, seed=1, logprobs=3)
    assert s.top_logprobs is not None
    assert all(top[2][1] == float("-inf") for top in s.top_logprobs)
    assert all(lp > float("-inf") for lp in s.logprobs or [])
    assert m.generate(prompt, max_tokens=2).logprobs is None


def test_prompt_logprobs_match_log_softmax_of_an_independent_forward() -> None:
    m = colibri.Model(threads=1)
    prompt = m.encode("def add(a, b):\n    return a")
    m.generate(prompt, max_tokens=2)  # the prompt is now cached: scoring must not reuse it
    out = m.generate(prompt, max_tokens=2, temperature=0, prompt_logprobs=3)
    assert out.stats.prompt_cached_tokens == 0
    assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] == []
    rows = m.logits(prompt).astype(np.float64)
    log_softmax = rows - rows.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    for i in range(1, len(prompt)):
        got = out.prompt_logprobs[i]
        assert got is not None and abs(got - log_softmax[i - 1, prompt[i]]) < 1e-4
        top = out.prompt_top_logprobs[i]
        assert [t for t, _ in top] == list(np.argsort(-rows[i - 1], kind="stable")[:3])
    # Scoring the prompt changes nothing generated, with drafting too.
    plain = m.generate(prompt, max_tokens=12, temperature=0, draft="off")
    scored = m.generate(prompt, max_tokens=12, temperature=0, draft="mtp", prompt_logprobs=0)
    assert scored.token_ids == plain.token_ids
    assert m.generate(prompt, max_tokens=2).prompt_logprobs is None
    # A list of prompts scores each one.
    batch = m.generate([prompt, prompt[:5]], max_tokens=2, prompt_logprobs=1)
    for result, n in zip(batch, (len(prompt), 5), strict=True):
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == n
        assert result.prompt_logprobs[0] is None
        assert np.allclose(result.prompt_logprobs[1:], out.prompt_logprobs[1:n], atol=1e-5)
    with pytest.raises(colibri.InvalidArgumentError, match="prompt_logprobs"):
        m.generate(prompt, max_tokens=2, prompt_logprobs=21)


# ----------------------------------------------------------------------------- n and lists


def test_a_list_of_prompts_is_decoded_together_with_each_result_as_alone() -> None:
    m = colibri.Model(threads=1)
    prompts = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, x):"]
    kw: dict[str, Any] = {"max_tokens": 10, "stop_token_ids": [], "logprobs": 2}
    for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 4, "presence_penalty": 0.5}):
        batch = m.generate(prompts, **kw, **extra)
        assert isinstance(batch, list) and len(batch) == 3
        for p, r in zip(prompts, batch, strict=True):
            alone = m.session().generate(p, draft="off", **kw, **extra)
            assert r.token_ids == alone.token_ids and r.text == alone.text
            assert r.logprobs == alone.logprobs
    # Token-id prompts, stop strings per prompt, and the errors.
    ids = [m.encode("x = 1\n"), m.encode("y = ")]
    out = m.generate(ids, max_tokens=6, temperature=0, stop=["\n"])
    assert all("\n" not in r.text for r in out)
    with pytest.raises(colibri.InvalidArgumentError, match="stream"):
        m.generate(prompts, max_tokens=2, stream=True)  # type: ignore[call-overload]
    with pytest.raises(colibri.InvalidArgumentError):
        m.generate(["ok", [10**9]], max_tokens=2)


def test_n_completions_are_the_seeds_alone_and_decode_together() -> None:
    """``n`` returns n results: completion i is the prompt with seed + i alone (so n=1 is
    completion 0); through ``SamplingParams`` too; bad values are typed errors."""
    m = colibri.Model(threads=2)
    outs = m.generate("def add(a, b):", n=3, max_tokens=8, temperature=0.8, seed=7)
    assert isinstance(outs, list) and len(outs) == 3
    for i, out in enumerate(outs):
        alone = m.generate("def add(a, b):", max_tokens=8, temperature=0.8, seed=7 + i)
        assert out.token_ids == alone.token_ids
    sp = colibri.SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=7)
    assert [o.token_ids for o in m.generate("def add(a, b):", sp)] == [
        o.token_ids for o in outs[:2]
    ]
    for bad in (0, -1, "2", 65):
        with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
            m.generate("x", n=bad)
    with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
        m.generate("x", n=2, stream=True)
    with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
        m.generate(["x", "y"], n=2)
    with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
        m.generate("x", colibri.SamplingParams(n=2), n=2)
