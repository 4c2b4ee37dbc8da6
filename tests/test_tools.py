"""Tool calls (``colibri._tools``): the GLM and DeepSeek formats parsed and held back from
streams, and chat requests with ``tools`` against the models' real chat templates
(``tests/fixtures/templates``: GLM-4.6's and DeepSeek-V3.1's, from their tokenizer configs),
the forced calls (``tool_choice`` required or named) checked as JSON against the tool's
schema, from the library and over HTTP with the ``openai`` client's tool helpers."""

# DeepSeek's tool-call tokens are spelled with fullwidth bars and ▁: not typos.
# ruff: noqa: RUF001

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Literal

import colibri
import openai
import pydantic
import pytest
from colibri._tools import CallFilter, Tool, extract
from conftest import FIXTURES
from test_serve import MODEL, start_server, stop_server

TEMPLATES = FIXTURES / "templates"
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                "celsius": {"type": "boolean"},
                "days": {"type": "integer", "minimum": 1, "maximum": 9},
            },
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
NOOP = {
    "type": "function",
    "function": {
        "name": "noop",
        "parameters": {"type": "object", "properties": {}, "additionalProperties": False},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
SPECS = [Tool("get_weather", "", WEATHER["function"]["parameters"])]  # type: ignore[index]


# ----------------------------------------------------------------------------- parsing


def test_glm_calls_parse_with_typed_values() -> None:
    text = (
        "Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Paris"
        "</arg_value>\n<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>"
        "<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Rome</arg_value>\n"
        "</tool_call>"
    )
    content, calls = extract(text, "glm", SPECS)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3}),
        ("get_weather", {"city": "Rome"}),
    ]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)


def test_deepseek_calls_parse_in_both_generations() -> None:
    v31 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>"
        '{"city": "Oslo"}<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    v3 = (
        "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
    )
    for text in (v31, v3):
        content, calls = extract(text, "deepseek", SPECS)
        assert content == "" and [(c.name, json.loads(c.arguments)) for c in calls] == [
            ("get_weather", {"city": "Oslo"})
        ]


def test_a_call_cut_off_stays_text() -> None:
    cut = "Sure <tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Par"
    assert extract(cut, "glm", SPECS) == (cut, [])
    assert extract("no calls here", "deepseek", SPECS) == ("no calls here", [])


@pytest.mark.parametrize("fmt", ["glm", "deepseek"])
def test_streams_hold_calls_back_however_chunked(fmt: Literal["glm", "deepseek"]) -> None:
    call = (
        "<tool_call>noop\n</tool_call>"
        if fmt == "glm"
        else "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>noop<｜tool▁sep｜>{}<｜tool▁call▁end｜>"
    )
    for text, shown in [
        ("I will call it <t" + "x " + call, "I will call it <tx"),
        ("plain <t", "plain <t"),
    ]:
        for seed in range(100):
            r, f, out, i = random.Random(seed), CallFilter(fmt), "", 0
            while i < len(text):
                j = i + r.randint(1, 4)
                out += f.push(text[i:j])
                i = j
            out += f.flush()
            # (a blank before the call may already have gone out: a stream cannot take
            # text back; the whole answer's content is stripped of it)
            assert out.rstrip() == shown, (seed, out)


# ----------------------------------------------------------------------------- requests


@pytest.fixture(scope="module", params=["glm-4.6", "deepseek-v3.1"])
def templated(request: pytest.FixtureRequest) -> colibri.Model:
    text = (TEMPLATES / f"{request.param}.jinja").read_text(encoding="utf-8")
    return colibri.Model(threads=2, chat_template=text)


def _call(model: colibri.Model, **kw: Any) -> dict[str, Any]:
    args: dict[str, Any] = {"max_tokens": 300, "temperature": 0.7, "seed": 3, **kw}
    return model.create_chat_completion(ASK, **args)  # type: ignore[return-value]


def _check_weather(arguments: str) -> dict[str, Any]:
    args = json.loads(arguments)
    assert set(args) <= {"city", "celsius", "days"}
    assert "city" not in args or args["city"] in ("Paris", "Rome", "Oslo")
    assert "celsius" not in args or isinstance(args["celsius"], bool)
    assert "days" not in args or isinstance(args["days"], int)
    return args


def test_a_named_tool_choice_forces_a_valid_call(templated: colibri.Model) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    for seed in range(3):
        body = _call(templated, tools=[WEATHER, NOOP], tool_choice=choice, seed=seed)
        c = body["choices"][0]
        assert c["finish_reason"] == "tool_calls", c
        assert c["message"]["content"] is None
        (call,) = c["message"]["tool_calls"]
        assert call["type"] == "function" and call["id"].startswith("call_")
        assert call["function"]["name"] == "get_weather"
        _check_weather(call["function"]["arguments"])


def test_required_picks_one_of_the_tools_and_streams_it_at_the_end(
    templated: colibri.Model,
) -> None:
    whole = _call(templated, tools=[WEATHER, NOOP], tool_choice="required")
    (call,) = whole["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] in ("get_weather", "noop")
    chunks = list(_call(templated, tools=[WEATHER, NOOP], tool_choice="required", stream=True))
    deltas = [c["choices"][0] for c in chunks if c["choices"]]
    assert not "".join(d["delta"].get("content") or "" for d in deltas)  # no markup as text
    streamed = [tc for d in deltas for tc in d["delta"].get("tool_calls") or []]
    assert [tc["function"] for tc in streamed] == [call["function"]]
    assert streamed[0]["index"] == 0 and deltas[-1]["finish_reason"] == "tool_calls"


def test_tools_reach_the_prompt_unless_the_choice_is_none(templated: colibri.Model) -> None:
    from colibri import _openai

    def prompt(**kw: Any) -> str:
        req = _openai.parse({"messages": ASK, **kw}, "chat", templated, "m")
        return templated.decode(req.prompt_ids, skip_special_tokens=False)

    assert "get_weather" in prompt(tools=[WEATHER])
    assert "get_weather" not in prompt(tools=[WEATHER], tool_choice="none")


def test_a_conversation_with_calls_and_results_renders_and_goes_on(
    templated: colibri.Model,
) -> None:
    args = json.dumps({"city": "Paris"})
    turns = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": args},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    body = templated.create_chat_completion(turns, tools=[WEATHER], max_tokens=8, temperature=0)
    assert body["choices"][0]["finish_reason"] in ("length", "stop", "tool_calls")
    from colibri import _openai

    req = _openai.parse({"messages": turns, "tools": [WEATHER]}, "chat", templated, "m")
    text = templated.decode(req.prompt_ids, skip_special_tokens=False)
    assert "sunny, 21 C" in text and "Paris" in text


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "x"}}},
         "tool_choice"),
        ({"tools": "nope"}, "tools"),
        ({"tools": [{"type": "function", "function": {"name": "a b"}}]}, "tools[0].function.name"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [WEATHER], "tool_choice": "required", "guided_regex": "a"}, "tool_choice"),
        ({"functions": [{"name": "f"}]}, "functions"),
    ],
)  # fmt: skip
def test_bad_tool_requests_name_the_field(
    templated: colibri.Model, fields: dict[str, Any], param: str
) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=param.split(".")[0].split("[")[0]):
        _call(templated, **fields)


def test_a_template_without_a_call_format_refuses_tools() -> None:
    plain = colibri.Model(threads=1)
    with pytest.raises(colibri.InvalidArgumentError, match="tool-call format"):
        _call(plain, tools=[WEATHER])


class Weather(pydantic.BaseModel):
    city: Literal["Paris", "Rome", "Oslo"]
    celsius: bool


@pytest.mark.parametrize("template", ["glm-4.6", "deepseek-v3.1"])
def test_the_openai_clients_tool_helpers_over_http(template: str) -> None:
    live = start_server("--chat-template", str(TEMPLATES / f"{template}.jinja"))
    try:
        client = live.client()
        tool = openai.pydantic_function_tool(Weather, name="get_weather")
        done = client.chat.completions.parse(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=[tool],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            max_tokens=300,
            temperature=0.7,
            seed=1,
        )
        msg = done.choices[0].message
        assert done.choices[0].finish_reason == "tool_calls"
        assert msg.tool_calls and isinstance(msg.tool_calls[0].function.parsed_arguments, Weather)
        with client.chat.completions.stream(
            model=MODEL,
            messages=ASK,  # type: ignore[arg-type]
            tools=[tool],
            tool_choice="required",
            max_tokens=300,
            temperature=0.7,
            seed=1,
        ) as stream:
            for _ in stream:
                pass
            final = stream.get_final_completion()
        streamed = final.choices[0].message.tool_calls
        assert streamed and isinstance(streamed[0].function.parsed_arguments, Weather)
    finally:
        stop_server(live)


def test_fixture_templates_are_the_models(tmp_path: Path) -> None:
    """The fixtures are the models' own templates, unedited (their first bytes as shipped)."""
    glm = (TEMPLATES / "glm-4.6.jinja").read_text(encoding="utf-8")
    ds = (TEMPLATES / "deepseek-v3.1.jinja").read_text(encoding="utf-8")
    assert glm.startswith("[gMASK]<sop>") and "<arg_key>" in glm
    assert "<｜tool▁calls▁begin｜>" in ds and "<｜Assistant｜>" in ds


def test_model_chat_returns_the_parsed_calls(templated: colibri.Model) -> None:
    choice = {"type": "function", "function": {"name": "get_weather"}}
    out = templated.chat(
        ASK, tools=[WEATHER, NOOP], tool_choice=choice, max_tokens=300, temperature=0.7, seed=2
    )
    assert out.tool_calls is not None and len(out.tool_calls) == 1
    assert out.tool_calls[0]["function"]["name"] == "get_weather"
    _check_weather(out.tool_calls[0]["function"]["arguments"])
    assert out.text == ""
    # The same request through the OpenAI-shaped call makes the same call.
    body = _call(templated, tools=[WEATHER, NOOP], tool_choice=choice, seed=2)
    assert (
        body["choices"][0]["message"]["tool_calls"][0]["function"]
        == (out.tool_calls[0]["function"])
    )
    plain = templated.chat(ASK, max_tokens=4, temperature=0)
    assert plain.tool_calls is None
    none = templated.chat(ASK, tools=[WEATHER], tool_choice="none", max_tokens=4, temperature=0)
    assert none.tool_calls == [] and none.text == plain.text
    with pytest.raises(colibri.InvalidArgumentError, match="stream"):
        templated.chat(ASK, tools=[WEATHER], stream=True)
    with pytest.raises(colibri.InvalidArgumentError, match="tool_choice"):
        templated.chat(ASK, tools=[WEATHER], tool_choice={"type": "function", "function": {}})
