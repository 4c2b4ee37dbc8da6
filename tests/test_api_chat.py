"""``Model.chat`` and ``apply_chat_template``: the template and its sandbox, malformed
conversations as typed errors, OpenAI-style content parts, replacing the template, and the
OpenAI-shaped ``create_completion``/``create_chat_completion``."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import colibri
import pytest
from conftest import make_test_model

# Python's own Ctrl-C handler around every test, as in a terminal (see conftest.py).
pytestmark = pytest.mark.usefixtures("_python_sigint_handler")


# ----------------------------------------------------------------------------- chat


def test_chat_renders_the_template(model: colibri.Model) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    eos = json.loads((model.path / "tokenizer_config.json").read_text())["eos_token"]
    prompt = model.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == f"<|system|>Be brief.{eos}<|user|>Hi!{eos}<|assistant|>"
    out = model.chat(messages, max_new_tokens=12, temperature=0)
    ref = model.generate(
        model.encode(prompt, add_special_tokens=False), max_new_tokens=12, temperature=0
    )
    assert out.token_ids == ref.token_ids
    assert "".join(model.chat(messages, max_new_tokens=12, temperature=0, stream=True)) == out.text


def _model_with_template(tmp_path: Path, template: str) -> colibri.Model:
    d = make_test_model(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return colibri.Model(d, threads=1)


def test_chat_template_is_sandboxed(tmp_path: Path) -> None:
    m = _model_with_template(
        tmp_path, "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ messages }}"
    )
    with pytest.raises(colibri.ColibriError, match="chat template"):
        m.chat([{"role": "user", "content": "hi"}], max_new_tokens=2)


def test_chat_template_raise_exception(tmp_path: Path) -> None:
    m = _model_with_template(tmp_path, "{{ raise_exception('only user turns please') }}")
    with pytest.raises(colibri.InvalidArgumentError, match="only user turns please"):
        m.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", r"messages.*str.*list of \{'role'.*generate\(prompt\)"),
        ({"role": "user", "content": "hi"}, "messages.*wrap a single message in a list"),
        (None, "messages.*NoneType"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\].*int.*string"),
        ([{"role": "user", "content": {"text": "hi"}}], r"messages\[0\]\['content'\]"),
        ([{"role": "user"}], r"messages\[0\].*no 'content'"),
        ([{"content": "hi"}], r"messages\[0\].*no 'role'"),
        ([{"role": "user", "content": "ok"}, "hi"], r"messages\[1\].*str"),
        ([{"role": "user", "content": "a\udc80b"}], r"messages\[0\]\['content'\].*Unicode"),
    ],
)
def test_bad_chat_messages(model: colibri.Model, messages: Any, match: str) -> None:
    """Every malformed conversation is an InvalidArgumentError that says what a conversation
    is (never a jinja TypeError, a string iterated as messages, or a ConfigError)."""
    with pytest.raises(colibri.InvalidArgumentError, match=match):
        model.chat(messages, max_new_tokens=2)
    with pytest.raises(colibri.InvalidArgumentError, match=match):
        model.apply_chat_template(messages)


def test_chat_template_errors_on_messages_are_typed(tmp_path: Path) -> None:
    """A template that fails on the messages it is given (not on itself) blames them."""
    m = _model_with_template(tmp_path, "{{ messages[0]['content'] + 1 }}")
    with pytest.raises(colibri.InvalidArgumentError, match="TypeError"):
        m.apply_chat_template([{"role": "user", "content": "hi"}])


def test_chat_takes_openai_style_content_parts(model: colibri.Model) -> None:
    """A list content of text parts (what OpenAI clients send, and the server accepts) is
    the same conversation as its joined text; other parts are a clear error."""
    kw: dict[str, Any] = {"max_tokens": 6, "temperature": 0}
    plain = model.chat([{"role": "user", "content": "hello there"}], **kw)
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    assert model.chat([{"role": "user", "content": parts}], **kw).token_ids == plain.token_ids
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(colibri.InvalidArgumentError, match="text only"):
        model.chat([{"role": "user", "content": image}], **kw)
    with pytest.raises(colibri.InvalidArgumentError, match="content part"):
        model.chat([{"role": "user", "content": ["hi"]}], **kw)


def test_apply_chat_template_has_transformers_defaults_and_templates_can_be_replaced(
    test_model_dir: Path, tmp_path: Path
) -> None:
    m = colibri.Model(test_model_dir, threads=1)
    msgs = [{"role": "user", "content": "hi"}]
    ids = m.apply_chat_template(msgs)
    text = m.apply_chat_template(msgs, tokenize=False)
    assert isinstance(ids, list) and ids == m.encode(text, add_special_tokens=False)
    assert not text.endswith("<|assistant|>")
    assert m.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith(
        "<|assistant|>"
    )
    plain = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert m.apply_chat_template(msgs, tokenize=False, chat_template=plain) == "[user] hi\n"
    f = tmp_path / "t.jinja"
    f.write_text(plain)
    for given in (plain, str(f), f):
        other = colibri.Model(test_model_dir, threads=1, chat_template=given)
        assert other.apply_chat_template(msgs, tokenize=False) == "[user] hi\n"
        kw: dict[str, Any] = {"max_new_tokens": 4, "temperature": 0}
        assert other.chat(msgs, **kw).token_ids == other.generate("[user] hi\n", **kw).token_ids
    with pytest.raises(colibri.InvalidArgumentError, match="chat_template"):
        colibri.Model(test_model_dir, threads=1, chat_template="")


# ----------------------------------------------------------------------------- OpenAI-shaped bodies


def test_create_completion_bounds_the_prompt_before_tokenising_it() -> None:
    """A string prompt longer than the context can hold is refused from its length, and a
    token list from its count before any id is checked (the last id here is out of the
    vocabulary: the count is what is named)."""
    m = colibri.Model(threads=1)
    t0 = time.monotonic()
    with pytest.raises(colibri.InvalidArgumentError, match="max_context"):
        m.create_completion("x" * (m._max_prompt_chars + 1), max_tokens=1)
    too_many = [1] * (m.max_context * 200) + [10**9]
    with pytest.raises(colibri.InvalidArgumentError, match="tokens, more than this model's"):
        m.create_completion(too_many, max_tokens=1)
    with pytest.raises(colibri.InvalidArgumentError, match="outside the vocabulary"):
        m.create_completion([1, 10**9], max_tokens=1)
    assert time.monotonic() - t0 < 10


def test_a_completions_batch_is_counted_before_any_prompt_is_tokenised() -> None:
    """More prompts than the request's choices allow are refused from their count: 6M short
    prompts were each tokenised first (50 s) before the count was checked."""
    m = colibri.Model(threads=1)
    calls = []
    encode = m.encode

    def counting(text: str, *a: Any, **kw: Any) -> list[int]:
        calls.append(text)
        return encode(text, *a, **kw)

    m.encode = counting  # type: ignore[method-assign]
    for prompt, n in [(["def f("] * 100_000, 1), (["def f("] * 5, 16), ([[1, 2]] * 65, 1)]:
        with pytest.raises(colibri.InvalidArgumentError, match="prompts times n="):
            m.create_completion(prompt, n=n, max_tokens=1)
    assert calls == []
    body = m.create_completion(["def f("] * 4, n=16, max_tokens=1)  # 64 choices: allowed
    assert isinstance(body, dict) and len(body["choices"]) == 64 and len(calls) == 4


def test_create_completion_and_chat_completion_return_openai_bodies() -> None:
    m = colibri.Model(threads=1)
    body = m.create_completion("def add(a, b):", max_tokens=8, temperature=0, logprobs=1)
    assert isinstance(body, dict) and body["object"] == "text_completion"
    ref = m.generate("def add(a, b):", max_tokens=8, temperature=0)
    choice = body["choices"][0]
    assert choice["text"] == ref.text and choice["finish_reason"] in ("length", "stop")
    assert len(choice["logprobs"]["token_logprobs"]) == len(ref.token_ids)
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    chunks = list(m.create_completion("def add(a, b):", max_tokens=8, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    msgs = [{"role": "user", "content": "hi"}]
    chat = m.create_chat_completion(msgs, max_tokens=6, temperature=0)
    assert isinstance(chat, dict) and chat["object"] == "chat.completion"
    said = m.chat(msgs, max_tokens=6, temperature=0).text
    assert chat["choices"][0]["message"]["content"] == said
    parts = list(m.create_chat_completion(msgs, max_tokens=6, temperature=0, stream=True))
    assert parts[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
        m.create_completion("x", n=0)
    two = m.create_completion("x", n=2, max_tokens=4, temperature=0.8, seed=4)
    assert isinstance(two, dict) and [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][1]["text"] == m.generate("x", max_tokens=4, temperature=0.8, seed=5).text
    streamed = list(
        m.create_completion("x", n=2, max_tokens=4, temperature=0.8, seed=4, stream=True)
    )
    by_index = {0: "", 1: ""}
    for c in streamed:
        for ch in c["choices"]:
            by_index[ch["index"]] += ch["text"]
    assert [by_index[0], by_index[1]] == [c["text"] for c in two["choices"]]
    with pytest.raises(colibri.InvalidArgumentError, match="'tools'"):
        m.create_chat_completion(msgs, tools=[{"type": "function", "function": {"name": "f"}}])
