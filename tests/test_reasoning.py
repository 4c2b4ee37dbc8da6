"""A thinking model's reasoning split from its answer (``colibri._reasoning``): the splitter
itself, chunked any way, and the chat answers of a model whose template thinks, with the
model's output forced through ``<think>`` by a constraint (the tiny model does not think
on its own), from the library and over HTTP, streamed or not."""

from __future__ import annotations

import random
import re
from pathlib import Path
from typing import Any

import colibri
import pytest
from colibri._reasoning import ReasoningSplitter, split
from test_serve import MODEL, start_server, stop_server

# GLM's shape: the model opens <think> itself. DeepSeek-V3.1's: the prompt opens it.
OPENS_ITSELF = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    "{# the template strips </think> from earlier turns #}"
)
OPENED_BY_PROMPT = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|><think>{% endif %}"
    "{# ... </think> ... #}"
)
MESSAGES = [{"role": "user", "content": "Add two and two."}]
THOUGHT = r"<think>[a-z]{2,8}( [a-z]{2,8}){1,3}</think>\n[a-z]{2,8}( [a-z]{2,8}){1,3}"
OPENED_THOUGHT = r"[a-z]{2,8}( [a-z]{2,8}){1,3}</think>[a-z]{2,8}( [a-z]{2,8}){1,3}"


@pytest.mark.parametrize(
    ("text", "inside", "want"),
    [
        ("<think>a b</think>\n\nc", False, ("a b", "c")),
        ("  <think>a</think>c <think>d</think>", False, ("a", "c <think>d</think>")),
        ("c <think>d</think>", False, (None, "c <think>d</think>")),
        ("<think></think>c", False, ("", "c")),
        ("a</think>c", True, ("a", "c")),
        ("a <thin", True, ("a <thin", "")),
        ("<thi", False, (None, "<thi")),
        ("", False, (None, "")),
    ],
)
def test_split(text: str, inside: bool, want: tuple[str | None, str]) -> None:
    assert split(text, inside) == want


def test_streamed_pieces_equal_the_whole_however_chunked() -> None:
    text = "<think>Two and two: four.</think>\n\nIt is four. <think>not again</think>"
    want = split(text, False)
    for seed in range(300):
        r = random.Random(seed)
        s, pieces, i = ReasoningSplitter(False), [], 0
        while i < len(text):
            j = i + r.randint(1, 6)
            pieces += s.push(text[i:j])
            i = j
        pieces += s.flush()
        got = (
            "".join(t for k, t in pieces if k == "reasoning"),
            "".join(t for k, t in pieces if k == "content"),
        )
        assert got == want, seed
        assert all(t for _, t in pieces)


@pytest.fixture(scope="module")
def thinking() -> colibri.Model:
    return colibri.Model(threads=2, chat_template=OPENS_ITSELF)


def _forced(model: colibri.Model, pattern: str, **kw: Any) -> Any:
    return model.create_chat_completion(
        MESSAGES, guided_regex=pattern, max_tokens=80, temperature=0.8, seed=5, **kw
    )


def test_chat_answer_carries_reasoning_content(thinking: colibri.Model) -> None:
    raw = thinking.generate(
        thinking.apply_chat_template(MESSAGES, add_generation_prompt=True),
        guided_regex=THOUGHT,
        max_tokens=80,
        temperature=0.8,
        seed=5,
    ).text
    assert re.fullmatch(THOUGHT, raw), raw
    reasoning, content = split(raw, False)
    msg = _forced(thinking, THOUGHT)["choices"][0]["message"]
    assert msg["reasoning_content"] == reasoning and msg["content"] == content
    assert "<think>" not in msg["content"] and reasoning
    streamed = list(_forced(thinking, THOUGHT, stream=True))
    deltas = [c["choices"][0]["delta"] for c in streamed if c["choices"]]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == reasoning
    assert "".join(d.get("content") or "" for d in deltas) == content
    quiet = _forced(thinking, THOUGHT, include_reasoning=False)["choices"][0]["message"]
    assert "reasoning_content" not in quiet and quiet["content"] == content


def test_a_prompt_that_opens_the_reasoning(tmp_path: Path) -> None:
    m = colibri.Model(threads=2, chat_template=OPENED_BY_PROMPT)
    msg = _forced(m, OPENED_THOUGHT)["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"]
    assert "</think>" not in msg["content"] + msg["reasoning_content"]


def test_models_without_thinking_templates_answer_as_before() -> None:
    plain = colibri.Model(threads=2)
    msg = _forced(plain, THOUGHT)["choices"][0]["message"]
    assert "reasoning_content" not in msg and msg["content"].startswith("<think>")


def test_earlier_turns_may_carry_their_reasoning(thinking: colibri.Model) -> None:
    turns = [
        *MESSAGES,
        {"role": "assistant", "content": "four", "reasoning_content": "two and two"},
        {"role": "user", "content": "And three and three?"},
    ]
    body = thinking.create_chat_completion(turns, max_tokens=4, temperature=0)
    assert body["choices"][0]["message"]["content"] is not None
    with pytest.raises(colibri.InvalidArgumentError, match="reasoning_content"):
        bad = [{"role": "user", "content": "x", "reasoning_content": "y"}]
        thinking.create_chat_completion(bad, max_tokens=4)


def test_reasoning_over_http_with_the_openai_client(tmp_path: Path) -> None:
    template = tmp_path / "thinking.jinja"
    template.write_text(OPENS_ITSELF, encoding="utf-8")
    live = start_server("--chat-template", str(template))
    try:
        client = live.client()
        extra = {"guided_regex": THOUGHT}
        kw: dict[str, Any] = {"model": MODEL, "messages": MESSAGES, "max_tokens": 80,
                              "temperature": 0.8, "seed": 5, "extra_body": extra}  # fmt: skip
        whole = client.chat.completions.create(**kw).choices[0].message
        reasoning = (whole.model_extra or {}).get("reasoning_content")
        assert reasoning and whole.content and "<think>" not in whole.content
        got_r, got_c = "", ""
        for part in client.chat.completions.create(stream=True, **kw):
            for c in part.choices:
                got_r += (c.delta.model_extra or {}).get("reasoning_content") or ""
                got_c += c.delta.content or ""
        assert (got_r, got_c) == (reasoning, whole.content)
    finally:
        stop_server(live)
