"""Bad arguments to ``generate``, ``logits`` and ``SamplingParams`` are typed errors
naming the parameter; prompts and generations stay within the context."""

from __future__ import annotations

from typing import Any

import colibri
import pytest
from colibri import _core

# Python's own Ctrl-C handler around every test, as in a terminal (see conftest.py).
pytestmark = pytest.mark.usefixtures("_python_sigint_handler")


# ----------------------------------------------------------------------------- bad input


BAD_GENERATE: list[tuple[dict[str, Any], str]] = [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"draft": "eagle"}, "draft"),
    ({"draft": None, "draft_depth": 0}, "draft_depth"),
    ({"draft_depth": 9}, "draft_depth"),
    ({"draft_depth": "deep"}, "draft_depth"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"stop_token_ids": "1"}, "stop_token_ids"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_GENERATE)
def test_bad_generate_arguments(model: colibri.Model, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=param):
        model.generate("hello", **kwargs)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, 256], "vocabulary"),
        ([1, -2], "prompt"),
        ([1, 2**40], "vocabulary"),
        ([1, 2.0], "prompt"),
        (None, "prompt"),
        (42, "prompt"),
        ([7] * 256, "context"),
        ("x" * 300, "context"),
    ],
)
def test_bad_prompts(model: colibri.Model, prompt: Any, match: str) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=match):
        model.generate(prompt, max_new_tokens=4)


def test_bad_logits_input(model: colibri.Model) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match="context"):
        model.logits([3] * 257)
    with pytest.raises(colibri.InvalidArgumentError, match="empty"):
        model.logits([])


def test_text_with_a_lone_surrogate_is_a_typed_error(model: colibri.Model) -> None:
    for call in (
        lambda: model.generate("a\udc80b", max_new_tokens=2),
        lambda: model.encode("\ud800"),
    ):
        with pytest.raises(colibri.InvalidArgumentError, match="not valid Unicode"):
            call()
    with pytest.raises(colibri.InvalidArgumentError, match=r"text.*bytes.*string"):
        model.encode(b"abc")  # type: ignore[arg-type]


def test_long_generation_ends_at_the_context(model: colibri.Model) -> None:
    out = model.generate([5] * 250, max_new_tokens=100, temperature=0, stop_token_ids=[])
    assert out.finish_reason == "length"
    assert len(out.token_ids) == model.max_context - 250


# ----------------------------------------------------------------------------- SamplingParams


def test_sampling_params_object_equals_keywords_and_conflicts_are_errors() -> None:
    m = colibri.Model(threads=1)
    sp = colibri.SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=5, min_p=0.02)
    by_object = m.generate("x = ", sp)
    by_keywords = m.generate(
        "x = ", max_new_tokens=8, temperature=0.7, top_k=20, seed=5, min_p=0.02
    )
    assert by_object.token_ids == by_keywords.token_ids
    assert len(m.chat([{"role": "user", "content": "hi"}], sp).token_ids) <= 8
    with pytest.raises(colibri.InvalidArgumentError, match="both"):
        m.generate("x", sp, temperature=0.1)
    with pytest.raises(colibri.InvalidArgumentError, match="not both"):
        m.generate("x", max_tokens=2, max_new_tokens=2)
    with pytest.raises(colibri.InvalidArgumentError, match="sampling_params"):
        m.generate("x", {"temperature": 0})  # type: ignore[call-overload]
    s = m.session()
    assert len(s.generate("x = ", sampling_params=sp).token_ids) <= 8
    for bad, needle in [
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logprobs": _core.limits()["max_top_logprobs"] + 1}, "logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ]:
        with pytest.raises(colibri.InvalidArgumentError, match=needle):
            m.generate("x", max_tokens=2, **bad)
    # Banning a token with -inf bias keeps it out of a greedy generation.
    greedy = m.generate("x = ", max_tokens=5, temperature=0)
    banned = greedy.token_ids[0]
    out = m.generate("x = ", max_tokens=5, temperature=0, logit_bias={banned: float("-inf")})
    assert banned not in out.token_ids


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logprobs": -1}, "logprobs"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": "a", "guided_json": {"type": "object"}}, "one of"),
    ],
)
def test_sampling_params_are_checked_when_made(fields: dict[str, Any], needle: str) -> None:
    """A bad field is an error where the object is made, not at the first generate."""
    with pytest.raises(colibri.InvalidArgumentError, match=needle):
        colibri.SamplingParams(**fields)


def test_sampling_params_checks_what_needs_the_model_at_generate(model: colibri.Model) -> None:
    sp = colibri.SamplingParams(stop_token_ids=[10**9], max_tokens=2)  # no vocabulary yet
    with pytest.raises(colibri.InvalidArgumentError, match="outside the vocabulary"):
        model.generate("x", sp)
