"""The extra fields llama.cpp's and vLLM's clients send (``colibri._client_fields``): each row
of the documented table does what it says — mapped fields equal the request written with
colibri's own names, ignored ones warn and change nothing, refused ones are errors naming
them — and the table in docs/server.md is the code's."""

from __future__ import annotations

import re
import warnings
from typing import Any

import colibri
import pytest
from colibri._client_fields import FIELDS
from colibri._gbnf import gbnf_to_lark
from conftest import ROOT

PROMPT = "def fibonacci(n):"
MESSAGES = [{"role": "user", "content": "Write a function."}]
GREEDY: dict[str, Any] = {"max_tokens": 8, "temperature": 0}


@pytest.fixture(scope="module")
def tiny() -> colibri.Model:
    return colibri.Model(threads=2)


def _text(body: dict[str, Any]) -> str:
    choice = body["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def _quiet(call: Any) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a mapped or honoured field must not warn
        return call()


# (field, value, the same request in colibri's names); kind "completion" unless chat.
MAPPED: list[tuple[str, str, Any, dict[str, Any]]] = [
    ("completion", "n_predict", 5, {"max_tokens": 5}),
    ("completion", "n_probs", 2, {"logprobs": 2}),
    ("chat", "n_probs", 2, {"logprobs": True, "top_logprobs": 2}),
    ("completion", "repeat_penalty", 1.3, {"repetition_penalty": 1.3}),
    ("completion", "top_k", -1, {}),
    ("completion", "grammar", 'root ::= [0-9]+ "."', {"guided_grammar": 'start: /[0-9]/+ "."'}),
    ("chat", "guided_choice", ["yes", "no"], {"guided_grammar": 'start: "yes" | "no"'}),
    ("completion", "cache_prompt", False, {}),
    ("completion", "skip_special_tokens", True, {}),
    ("chat", "add_generation_prompt", True, {}),
    ("completion", "truncate_prompt_tokens", 3, {"prompt": "PLACEHOLDER"}),
]


@pytest.mark.parametrize(("kind", "name", "value", "same"), MAPPED)
def test_mapped_and_honoured_fields_equal_colibris_own_request(
    tiny: colibri.Model, kind: str, name: str, value: Any, same: dict[str, Any]
) -> None:
    create = tiny.create_chat_completion if kind == "chat" else tiny.create_completion
    first = MESSAGES if kind == "chat" else PROMPT
    base = dict(GREEDY)
    if name == "n_predict":
        base.pop("max_tokens")
    if name == "top_k":  # only sampling reads it
        base = {"max_tokens": 8, "temperature": 0.9, "seed": 3}
    if name == "truncate_prompt_tokens":
        ids = tiny.encode(PROMPT)
        same = {"prompt": ids[-value:]}
    extra = _quiet(lambda: create(first, **base, **{name: value}))  # type: ignore[arg-type]
    args = {**base, **same}
    own_first = args.pop("prompt", first)
    own = _quiet(lambda: create(own_first, **args))  # type: ignore[arg-type]
    assert _text(extra) == _text(own)
    for count in ("prompt_tokens", "completion_tokens"):  # (cached_tokens: the second reuses)
        assert extra["usage"][count] == own["usage"][count]
    assert extra["choices"][0]["logprobs"] == own["choices"][0]["logprobs"]


IGNORED: list[tuple[str, Any]] = [
    ("typical_p", 0.5),
    ("mirostat", 2),
    ("tfs_z", 0.9),
    ("repeat_last_n", 32),
    ("penalize_nl", True),
    ("n_keep", 4),
    ("id_slot", 1),
    ("min_keep", 1),
    ("skip_special_tokens", False),
    ("length_penalty", 1.2),
    ("priority", 5),
    ("request_id", "abc"),
]


@pytest.mark.parametrize(("name", "value"), IGNORED)
def test_ignored_fields_warn_and_change_nothing(tiny: colibri.Model, name: str, value: Any) -> None:
    plain = tiny.create_completion(PROMPT, **GREEDY)
    with pytest.warns(UserWarning, match=f"ignored fields: {name}"):
        got = tiny.create_completion(PROMPT, **GREEDY, **{name: value})
    assert _text(got) == _text(plain)


@pytest.mark.parametrize(
    ("name", "value"),
    [("typical_p", 1.0), ("mirostat", 0), ("tfs_z", 1.0), ("mirostat_tau", 5.0)],
)
def test_fields_at_their_off_value_are_silent(tiny: colibri.Model, name: str, value: Any) -> None:
    _quiet(lambda: tiny.create_completion(PROMPT, **GREEDY, **{name: value}))


@pytest.mark.parametrize(
    ("kind", "fields", "needle"),
    [
        ("completion", {"include_stop_str_in_output": "yes"}, "include_stop_str_in_output"),
        ("chat", {"best_of": 2}, "best_of"),
        ("chat", {"best_of": True}, "best_of"),  # not 1, though True == 1 in Python
        ("completion", {"best_of": True}, "best_of"),
        ("chat", {"echo": True}, "echo"),
        ("completion", {"use_beam_search": True}, "use_beam_search"),
        ("completion", {"n_predict": 0}, "n_predict"),
        ("completion", {"repeat_penalty": "x"}, "repeat_penalty"),
        ("completion", {"grammar": "root ::= ("}, "grammar"),
        ("completion", {"grammar": "value ::= [a-z]"}, "root"),
        ("completion", {"grammar": "root ::= undefined-rule"}, "undefined-rule"),
        ("chat", {"guided_choice": []}, "guided_choice"),
        ("chat", {"chat_template_kwargs": {"messages": []}}, "chat_template_kwargs"),
        ("chat", {"continue_final_message": True}, "continue_final_message"),
        ("completion", {"repeat_penalty": 1.2, "repetition_penalty": 1.1}, "give one"),
        ("completion", {"add_generation_prompt": True}, "add_generation_prompt"),
    ],
)
def test_refused_and_malformed_fields_name_themselves(
    tiny: colibri.Model, kind: str, fields: dict[str, Any], needle: str
) -> None:
    create = tiny.create_chat_completion if kind == "chat" else tiny.create_completion
    first = MESSAGES if kind == "chat" else PROMPT
    with pytest.raises(colibri.InvalidArgumentError, match=re.escape(needle)):
        create(first, **GREEDY, **fields)  # type: ignore[arg-type]


def test_continue_final_message_continues_the_assistant_turn(tiny: colibri.Model) -> None:
    msgs = [*MESSAGES, {"role": "assistant", "content": "def add(a, b):"}]
    got = tiny.create_chat_completion(
        msgs, continue_final_message=True, add_generation_prompt=False, **GREEDY
    )
    rendered = tiny.apply_chat_template(msgs, tokenize=False)
    cut = rendered[: rendered.rfind("def add(a, b):") + len("def add(a, b):")]
    want = tiny.generate(tiny.encode(cut, add_special_tokens=False), **GREEDY)
    assert _text(got) == want.text


def test_chat_template_kwargs_reach_the_template(tmp_path: Any) -> None:
    template = (
        "{% for m in messages %}{{ m.content }}{% endfor %}"
        "{% if enable_thinking is defined and not enable_thinking %}/nothink{% endif %}"
    )
    m = colibri.Model(threads=1, chat_template=template)
    with_kw = m.apply_chat_template(MESSAGES, tokenize=False, enable_thinking=False)
    assert with_kw.endswith("/nothink")
    assert not m.apply_chat_template(MESSAGES, tokenize=False).endswith("/nothink")
    body = m.create_chat_completion(
        MESSAGES, chat_template_kwargs={"enable_thinking": False}, **GREEDY
    )
    want = m.generate(m.encode(with_kw, add_special_tokens=False), **GREEDY)
    assert _text(body) == want.text


def test_gbnf_translation_keeps_the_language() -> None:
    """The translated grammar accepts what the GBNF does: checked on llama.cpp's own JSON
    grammar's constructs (continuation lines, comments, classes with escapes, repetition
    ranges, an empty alternative, names with dashes)."""
    gbnf = (
        "root ::= item-list  # a list\n"
        'item-list ::= item ("," ws item){0,3}\n'
        'item ::= [a-z\\-]+ | "\\"" [^"\\\\\\x00-\\x1F]* "\\""\n'
        'ws ::= | " "\n'
    )
    lark = gbnf_to_lark(gbnf)
    assert lark.splitlines()[0] == "start: r_item_list"
    assert 'r_item_list: r_item ("," r_ws r_item){0,3}' in lark
    assert 'r_ws: "" | " "' in lark
    m = colibri.Model(threads=1)
    for seed in range(3):
        out = m.generate("items:", guided_grammar=lark, max_tokens=30, temperature=1.0, seed=seed)
        if out.finish_reason == "stop":
            item = r'([a-z\-]+|"[^"\\\x00-\x1f]*")'
            assert re.fullmatch(rf"{item}(, ?{item}){{0,3}}", out.text), out.text


def test_the_documented_table_is_the_codes() -> None:
    doc = (ROOT / "docs" / "server.md").read_text(encoding="utf-8")
    for f in FIELDS:
        row = f"| `{f.name}` | {f.client} | {f.treatment} |"
        assert row in doc, f"docs/server.md lacks the row {row!r}"
