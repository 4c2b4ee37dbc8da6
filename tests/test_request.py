"""The keywords of a generation are declared once (``colibri.sampling``): ``generate``,
``SamplingParams``, the server's parser and the CLI's flags follow that declaration, and the
engine's ``GenerateRequest`` checks every value."""

from __future__ import annotations

import argparse
import typing
from typing import Any, TypedDict

import colibri
import pytest
from colibri import _cli_options as cli
from colibri import _core, _openai, sampling
from colibri._openai_errors import ApiError
from colibri.sampling import GENERATE_KEYWORDS, SAMPLING_FIELDS


@pytest.fixture(scope="module")
def tiny() -> colibri.Model:
    return colibri.Model(threads=1)


def test_generate_takes_exactly_the_declared_keywords(tiny: colibri.Model) -> None:
    for name in GENERATE_KEYWORDS:  # each one, given as None (= not given), is taken
        tiny.generate("x", max_new_tokens=1, **{name: None} if name != "max_new_tokens" else {})
    with pytest.raises(colibri.InvalidArgumentError, match="invalid keyword 'temprature'"):
        tiny.generate("x", temprature=0.5)  # type: ignore[call-overload]
    with pytest.raises(colibri.InvalidArgumentError, match="invalid keyword 'n'"):
        tiny.session().generate("x", n=2)  # type: ignore[call-arg]
    # The typed signature is the declaration's.
    hints = typing.get_type_hints(colibri.Model.generate)
    assert typing.get_origin(hints["options"]) is sampling.Unpack
    assert typing.get_args(hints["options"]) == (sampling.GenerateOptions,)


def test_sampling_params_takes_the_sampling_fields_and_n() -> None:
    every = {name: None for name in SAMPLING_FIELDS}
    assert colibri.SamplingParams(**every).fields() == {}
    sp = colibri.SamplingParams(temperature=0.5, top_k=4, n=2)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.n) == (0.5, 4, None, 2)
    assert sp == colibri.SamplingParams(n=2, top_k=4, temperature=0.5)
    assert sp != colibri.SamplingParams(temperature=0.5)
    assert repr(sp) == "SamplingParams(temperature=0.5, top_k=4, n=2)"
    with pytest.raises(AttributeError, match="immutable"):
        sp.temperature = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError, match="max_new_tokens"):
        colibri.SamplingParams(max_new_tokens=3)  # type: ignore[call-arg]
    with pytest.raises(AttributeError):
        _ = sp.draft


def test_values_are_checked_by_the_engine_once() -> None:
    """A value out of range is the engine's error (the same text from SamplingParams,
    generate and the engine itself); Python checks only what it must convert."""
    with pytest.raises(colibri.InvalidArgumentError) as from_params:
        colibri.SamplingParams(top_p=1.5)
    with pytest.raises(colibri.InvalidArgumentError) as from_engine:
        _core.check_request({"top_p": 1.5})
    assert str(from_params.value) == str(from_engine.value)
    assert "'top_p'" in str(from_engine.value)
    with pytest.raises(colibri.InvalidArgumentError, match="expected a number"):
        colibri.SamplingParams(top_p="high")  # type: ignore[arg-type]


def test_every_sampling_field_is_parsed_passed_through_or_refused_by_the_server() -> None:
    parsed, through, refused = _openai._PARSED, set(_openai._PASSED_THROUGH), _openai._NOT_SERVED
    assert parsed | through | refused == set(SAMPLING_FIELDS)
    assert not (parsed & through or parsed & refused or through & refused)
    assert through <= _openai._COMMON and not refused & _openai._COMMON


def test_a_passed_through_field_reaches_the_generation(
    tiny: colibri.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = {"prompt": "x", "max_tokens": 2, "prompt_logprobs": 1}
    with pytest.raises(ApiError, match="prompt_logprobs"):  # not served: refused by name
        _openai.parse(dict(body), "completion", tiny, "m")
    monkeypatch.setattr(_openai, "_PASSED_THROUGH", ("prompt_logprobs",))
    monkeypatch.setattr(_openai, "_COMMON", _openai._COMMON | {"prompt_logprobs"})
    request = _openai.parse(dict(body), "completion", tiny, "m")
    assert request.generate["prompt_logprobs"] == 1


def test_the_cli_has_a_flag_for_every_generation_keyword(monkeypatch: pytest.MonkeyPatch) -> None:
    flags = cli._generation_flags()
    assert set(flags) == set(GENERATE_KEYWORDS) - cli._NO_FLAG - {"max_new_tokens"}

    class WithAnother(sampling.GenerateOptions, total=False):
        typical_p: float | None

    monkeypatch.setattr(sampling, "GenerateOptions", WithAnother)
    p = argparse.ArgumentParser()
    cli._add_sampling_options(p)
    args = p.parse_args(["--typical-p", "0.9", "--logit-bias", "5=-inf", "--stop", "a"])
    kwargs: dict[str, Any] = cli._gen_kwargs(args)
    assert kwargs["typical_p"] == 0.9
    assert kwargs["logit_bias"] == {5: float("-inf")}
    assert kwargs["stop"] == ["a"]

    class Unrepresentable(TypedDict, total=False):
        hook: typing.Callable[[], None] | None

    monkeypatch.setattr(sampling, "GenerateOptions", Unrepresentable)
    with pytest.raises(TypeError, match="hook"):
        cli._generation_flags()


def test_a_new_sampling_field_reaches_the_engine(
    tiny: colibri.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A field declared in ``colibri.sampling`` that the Python side does not shape goes to
    the engine's ``GenerateRequest`` as given: here the engine does not know it, and says so
    by name (the Python side refused nothing)."""
    from colibri import _generation as model_module

    assert set(model_module._SHAPED_HERE) == set(SAMPLING_FIELDS)  # today every one is shaped
    monkeypatch.setattr(model_module, "SAMPLING_FIELDS", (*SAMPLING_FIELDS, "typical_p"))
    monkeypatch.setattr(model_module, "GENERATE_KEYWORDS", (*GENERATE_KEYWORDS, "typical_p"))
    with pytest.raises(colibri.InvalidArgumentError, match="unknown field 'typical_p'"):
        tiny.generate("x", max_new_tokens=1, typical_p=0.9)  # type: ignore[call-overload]
