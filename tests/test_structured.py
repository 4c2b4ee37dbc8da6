"""Structured output (``guided_json`` / ``guided_regex`` / ``guided_grammar``, OpenAI's
``response_format``) on the embedded tiny model: the text parses and matches, drafting under
a constraint gives the plain-decoding tokens, bad constraints are typed errors naming their
keyword. The negative control (verify rows left unmasked) is the Rust test
``unmasked_verify_rows_break_the_lossless_test`` in src/decode/tests_constraint.rs."""

from __future__ import annotations

import json
import re
from typing import Any

import colibri
import pytest
from colibri.errors import InvalidArgumentError

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
        "ok": {"type": "boolean"},
    },
    "required": ["name", "age", "tags", "ok"],
    "additionalProperties": False,
}

#: A date then a word: the same pattern in Python's and Rust's regex syntax.
DATE = r"[0-9]{4}-[01][0-9]-[0-3][0-9] [a-z]{1,8}"

PROMPTS = ["def fibonacci(n):", "The answer is", "import os\n"]


@pytest.fixture(scope="module")
def tiny() -> colibri.Model:
    return colibri.Model()


def check_schema(value: Any) -> None:
    """An independent check of SCHEMA (not the grammar engine's)."""
    assert isinstance(value, dict) and set(value) == {"name", "age", "tags", "ok"}, value
    assert isinstance(value["name"], str) and len(value["name"]) <= 12
    assert type(value["age"]) is int and 0 <= value["age"] <= 120
    assert isinstance(value["tags"], list) and len(value["tags"]) <= 3
    assert all(t in ("a", "b", "c") for t in value["tags"])
    assert isinstance(value["ok"], bool)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 1.0, "seed": 5}])
@pytest.mark.parametrize("prompt", PROMPTS)
def test_json_schema_output_parses_and_matches(
    tiny: colibri.Model, prompt: str, sampling: dict[str, Any]
) -> None:
    out = tiny.generate(prompt, guided_json=SCHEMA, max_new_tokens=80, **sampling)
    assert out.finish_reason == "stop", out.text
    check_schema(json.loads(out.text))
    assert out.token_ids[-1] in tiny.eos_token_ids
    # The model's own continuation is no such JSON: the mask did it.
    free = tiny.generate(prompt, max_new_tokens=30, **sampling)
    with pytest.raises((ValueError, AssertionError)):
        check_schema(json.loads(free.text))


def test_regex_and_grammar_outputs_match(tiny: colibri.Model) -> None:
    for sampling in ({}, {"temperature": 1.0, "seed": 11}):
        out = tiny.generate("Today:", guided_regex=DATE, max_new_tokens=40, **sampling)
        assert re.fullmatch(DATE, out.text), out.text
        out = tiny.generate(
            "x =",
            guided_grammar='start: num (" + " num){0,3}\nnum: /[1-9][0-9]?/',
            max_new_tokens=40,
            **sampling,
        )
        assert out.finish_reason == "stop"
        assert re.fullmatch(r"[1-9][0-9]?( \+ [1-9][0-9]?){0,3}", out.text), out.text


@pytest.mark.parametrize(
    "constraint",
    [{"guided_json": SCHEMA}, {"guided_regex": DATE}],
    ids=["json", "regex"],
)
def test_drafting_under_a_constraint_is_lossless(
    tiny: colibri.Model, constraint: dict[str, Any]
) -> None:
    accepted = 0
    for prompt in PROMPTS:
        for sampling in ({}, {"temperature": 0.9, "seed": 3}):
            plain = tiny.generate(prompt, max_new_tokens=60, draft="off", **constraint, **sampling)
            for draft, depth in [("mtp", 1), ("mtp", 4), ("mtp", "auto"), ("ngram", 3)]:
                out = tiny.generate(
                    prompt,
                    max_new_tokens=60,
                    draft=draft,
                    draft_depth=depth,
                    **constraint,
                    **sampling,
                )
                assert out.token_ids == plain.token_ids, (prompt, draft, depth, sampling)
                accepted += sum(out.stats.drafts_accepted)
    assert accepted > 0, "no draft accepted: the comparison shows nothing"


def test_batch_and_sampling_params_carry_the_constraint(tiny: colibri.Model) -> None:
    sp = colibri.SamplingParams(max_tokens=60, guided_regex=DATE)
    alone = [tiny.generate(p, sp, draft="off") for p in PROMPTS]
    batch = tiny.generate(PROMPTS, sp)
    assert [b.token_ids for b in batch] == [a.token_ids for a in alone]
    assert all(re.fullmatch(DATE, b.text) for b in batch)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_json": {"type": "frobnicate"}}, "guided_json"),
        ({"guided_json": 5}, "guided_json"),
        ({"guided_regex": "[0-"}, "guided_regex"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_grammar": "start: missing_rule"}, "guided_grammar"),
    ],
)
def test_bad_constraints_are_typed_errors(
    tiny: colibri.Model, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(InvalidArgumentError, match=f"'{param}'"):
        tiny.generate("x", max_new_tokens=4, **kwargs)
    # A stream checks its constraint when it is made, not at its first chunk (the server
    # answers 400 before it starts a response on this).
    with pytest.raises(InvalidArgumentError, match=f"'{param}'"):
        tiny.generate("x", max_new_tokens=4, stream=True, **kwargs)


def test_conflicting_constraint_arguments(tiny: colibri.Model) -> None:
    with pytest.raises(InvalidArgumentError, match="one of 'guided_json', 'guided_regex'"):
        tiny.generate("x", guided_json=SCHEMA, guided_regex="a")
    with pytest.raises(InvalidArgumentError, match="stop token"):
        tiny.generate("x", guided_regex="a+", ignore_eos=True)


def test_chat_completion_response_format(tiny: colibri.Model) -> None:
    messages = [{"role": "user", "content": "Describe a person."}]
    body = tiny.create_chat_completion(
        messages,
        max_tokens=80,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "person", "schema": SCHEMA, "strict": True},
        },
    )
    assert isinstance(body, dict)
    check_schema(json.loads(body["choices"][0]["message"]["content"]))
    body = tiny.create_chat_completion(
        messages, max_tokens=60, response_format={"type": "json_object"}
    )
    assert isinstance(body, dict)
    content = body["choices"][0]["message"]["content"]
    if body["choices"][0]["finish_reason"] == "stop":
        assert isinstance(json.loads(content), dict)
    else:
        assert content.startswith("{")
    for bad in ({"type": "xml"}, {"type": "json_schema"}, "json"):
        with pytest.raises(InvalidArgumentError, match="'response_format'"):
            tiny.create_chat_completion(messages, max_tokens=4, response_format=bad)
