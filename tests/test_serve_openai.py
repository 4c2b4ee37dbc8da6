"""``colibri serve`` answers what the library answers: completions, chats, streaming, stop
strings, seeds, colibri's extension fields, structured output, lists of prompts and ``n``,
logprobs, penalties and bias, llama-server's /tokenize and /detokenize, the request
defaults, and the fields it refuses (tests/helpers/serve.py starts the server)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import colibri
import httpx
import openai
import pytest
from colibri import _openai as protocol
from colibri.serve.app import default_served_name
from helpers.serve import (
    MODEL,
    PROMPT,
    Live,
)

# ----------------------------------------------------------------------------- answers


def test_completion_equals_the_library(client: openai.OpenAI, local: colibri.Model) -> None:
    want = local.generate(PROMPT, max_new_tokens=24, temperature=0)
    got = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0)
    assert got.object == "text_completion"
    assert got.choices[0].text == want.text
    assert got.choices[0].finish_reason == "length"
    assert got.usage is not None
    assert got.usage.prompt_tokens == len(local.encode(PROMPT))
    assert got.usage.completion_tokens == 24
    assert got.usage.total_tokens == got.usage.prompt_tokens + 24
    ext = got.model_extra["colibri"]  # the extension object
    assert ext["tokens_per_second"] > 0 and ext["forwards"] >= 1
    # Token-id prompts, echo, and OpenAI's default of 16 tokens.
    ids = local.encode(PROMPT)
    got = client.completions.create(model=MODEL, prompt=ids, echo=True, temperature=0)
    assert got.usage is not None and got.usage.completion_tokens == 16
    assert (
        got.choices[0].text
        == local.decode(ids) + local.generate(ids, max_new_tokens=16, temperature=0).text
    )


def test_chat_equals_the_library(client: openai.OpenAI, local: colibri.Model) -> None:
    messages = [
        {"role": "system", "content": "You write Python."},
        {"role": "user", "content": "A function that adds two numbers."},
    ]
    want = local.chat(messages, max_new_tokens=20, temperature=0)
    got = client.chat.completions.create(
        model=MODEL, messages=messages, max_completion_tokens=20, temperature=0
    )
    assert got.object == "chat.completion"
    msg = got.choices[0].message
    assert msg.role == "assistant" and msg.content == want.text
    assert got.choices[0].finish_reason == "length"
    # Text parts are joined; "developer" is the system role.
    parts = [
        {"role": "developer", "content": "You write Python."},
        {"role": "user", "content": [{"type": "text", "text": "A function that adds "},
                                     {"type": "text", "text": "two numbers."}]},
    ]  # fmt: skip
    again = client.chat.completions.create(
        model=MODEL, messages=parts, max_tokens=20, temperature=0
    )
    assert again.choices[0].message.content == want.text


def test_streaming(client: openai.OpenAI, local: colibri.Model) -> None:
    messages = [{"role": "user", "content": "import os"}]
    want = local.chat(messages, max_new_tokens=40, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=messages,
            max_tokens=40,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == want.text
    finals = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finals[-1] == "length" and all(f is None for f in finals[:-1])
    assert len([c for c in chunks if c.choices and c.choices[0].delta.content]) > 3
    assert chunks[-1].choices == [] and chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 40
    assert all(c.usage is None for c in chunks[:-1])
    # Completions stream too; without include_usage there is no usage chunk.
    parts = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stream=True
        )
    )
    assert (
        "".join(p.choices[0].text for p in parts)
        == local.generate(PROMPT, max_new_tokens=30, temperature=0).text
    )
    assert parts[-1].choices[0].finish_reason == "length"
    assert all(p.usage is None for p in parts)
    echoed = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=30, temperature=0, stream=True, echo=True
    )
    assert "".join(p.choices[0].text for p in echoed) == PROMPT + "".join(
        p.choices[0].text for p in parts
    )


def test_stop_strings_are_removed(client: openai.OpenAI, local: colibri.Model) -> None:
    full = local.generate(PROMPT, max_new_tokens=40, temperature=0).text
    stop = full[12:16]
    assert stop.strip() and stop in full
    want = full[: full.index(stop)]
    got = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop, "never-seen"]
    )
    assert got.choices[0].text == want
    assert got.choices[0].finish_reason == "stop"
    streamed = list(
        client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop, stream=True
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == want
    assert streamed[-1].choices[0].finish_reason == "stop"


def test_include_stop_str_in_output_keeps_the_stop(
    client: openai.OpenAI, local: colibri.Model
) -> None:
    """vLLM's ``include_stop_str_in_output``: the stop string that ended the text stays at
    its end, streamed or not, from the server and the library; so does a stop token's text."""
    full = local.generate(PROMPT, max_new_tokens=40, temperature=0)
    stop = full.text[12:16]
    want = full.text[: full.text.index(stop) + len(stop)]
    kw: dict[str, Any] = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0}
    keep = {"include_stop_str_in_output": True}
    got = client.completions.create(**kw, stop=stop, extra_body=keep)
    assert got.choices[0].text == want and got.choices[0].finish_reason == "stop"
    parts = list(client.completions.create(**kw, stop=stop, extra_body=keep, stream=True))
    assert "".join(p.choices[0].text for p in parts) == want
    assert local.generate(PROMPT, max_new_tokens=40, temperature=0, stop=stop, **keep).text == want
    streamed = local.generate(PROMPT, max_new_tokens=40, temperature=0, stop=stop, stream=True,
                              **keep)  # fmt: skip
    assert "".join(streamed) == want
    # A stop token (one that first appears after a few tokens): its text is kept too.
    i, tok = next((i, t) for i, t in enumerate(full.token_ids) if i > 3 and t not in
                  full.token_ids[:i])  # fmt: skip
    ended = local.generate(PROMPT, max_new_tokens=40, temperature=0, stop_token_ids=[tok])
    assert ended.text == local.decode(full.token_ids[:i])
    kept = local.generate(PROMPT, max_new_tokens=40, temperature=0, stop_token_ids=[tok], **keep)
    assert kept.text == local.decode(full.token_ids[: i + 1]) != ended.text
    with pytest.raises(colibri.InvalidArgumentError, match="include_stop_str_in_output"):
        local.generate(PROMPT, include_stop_str_in_output=1)  # type: ignore[arg-type]


def test_seed_really_seeds(client: openai.OpenAI, local: colibri.Model) -> None:
    def ask(seed: int) -> str:
        r = client.completions.create(
            model=MODEL, prompt=PROMPT, max_tokens=32, temperature=1.0, top_p=0.95, seed=seed
        )
        return r.choices[0].text

    a, b = ask(7), ask(7)
    assert a == b
    want = local.generate(PROMPT, max_new_tokens=32, temperature=1.0, top_p=0.95, seed=7)
    assert a == want.text
    assert len({ask(s) for s in (1, 2, 3)} | {a}) > 1


def test_extensions_top_k_ignore_eos_draft(client: openai.OpenAI, local: colibri.Model) -> None:
    r = client.completions.create(
        model=MODEL,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0.8,
        seed=3,
        extra_body={"top_k": 5, "ignore_eos": True, "draft": "off"},
    )
    want = local.generate(
        PROMPT, max_new_tokens=24, temperature=0.8, seed=3, top_k=5, stop_token_ids=[], draft="off"
    )
    assert r.choices[0].text == want.text
    assert r.model_extra["colibri"]["drafts_proposed"] == [0] * len(want.stats.drafts_proposed)


def test_request_defaults(local: colibri.Model) -> None:
    """Absent fields take OpenAI's defaults: chat runs to the end of the context, completions
    stop at 16 tokens; temperature falls back to the model's generation config (greedy
    here), so sampling-only fields are not passed to a greedy generation."""
    chat = protocol.parse(
        {"messages": [{"role": "user", "content": "hi", "name": "bob"}], "top_p": 0.5, "seed": 1},
        "chat",
        local,
        MODEL,
    )
    assert chat.generate == {
        "max_new_tokens": local.max_context - len(chat.prompt_ids),
        "temperature": None,
        "stop": None,
    }
    comp = protocol.parse({"prompt": "x", "temperature": 0.5, "seed": -1}, "completion", local, "m")
    assert comp.generate["max_new_tokens"] == 16
    assert comp.generate["seed"] == 2**64 - 1 and comp.generate["temperature"] == 0.5
    assert comp.id.startswith("cmpl-") and chat.id.startswith("chatcmpl-")

    class Hub:
        path = Path("/cache/hub/models--someone--glm-5-int4/snapshots/0123abcd")

    class Local:
        path = Path("/models/my-model")

    assert default_served_name(Hub()) == "someone/glm-5-int4"  # type: ignore[arg-type]
    assert default_served_name(Local()) == "my-model"  # type: ignore[arg-type]


def test_response_format_json_schema_through_the_openai_client(client: openai.OpenAI) -> None:
    schema = {
        "type": "object",
        "properties": {"pick": {"enum": ["red", "green", "blue"]}, "n": {"type": "boolean"}},
        "required": ["pick", "n"],
        "additionalProperties": False,
    }
    out = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "a colour"}],
        max_tokens=40,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    )
    value = json.loads(out.choices[0].message.content or "")
    assert value["pick"] in ("red", "green", "blue") and isinstance(value["n"], bool)
    assert out.choices[0].finish_reason == "stop"


def test_a_list_of_prompts_is_a_batch_each_as_alone(
    client: openai.OpenAI, local: colibri.Model
) -> None:
    """``prompt`` as a list: every prompt's choices, in order, each what it gets alone
    (greedy and seeded), streamed or not; ``usage`` counts each prompt once."""
    prompts = [PROMPT, "class Stack:", [5, 6, 7]]
    body: dict[str, Any] = {"model": MODEL, "max_tokens": 6, "temperature": 0.8, "seed": 4}
    got = client.completions.create(prompt=prompts, n=2, **body)  # type: ignore[arg-type]
    alone = [
        local.generate(p, max_tokens=6, temperature=0.8, seed=4 + j)
        for p in prompts
        for j in (0, 1)
    ]
    assert [c.index for c in got.choices] == list(range(6))
    assert [c.text for c in got.choices] == [a.text for a in alone]
    assert got.usage is not None
    assert got.usage.prompt_tokens == sum(a.stats.prompt_tokens for a in alone[::2])
    assert got.usage.completion_tokens == sum(len(a.token_ids) for a in alone)
    texts = [""] * 3
    for part in client.completions.create(prompt=prompts, stream=True, echo=True, **body):  # type: ignore[arg-type]
        for c in part.choices:
            texts[c.index] += c.text
    want = [local.decode(local.encode(p) if isinstance(p, str) else p) for p in prompts]
    assert texts == [w + a.text for w, a in zip(want, alone[::2], strict=True)]
    py = local.create_completion(prompts, echo=True, **body)
    assert isinstance(py, dict) and [c["text"] for c in py["choices"]] == texts


def test_n_choices_decode_together_each_as_alone(
    client: openai.OpenAI, local: colibri.Model
) -> None:
    """``n`` choices: choice i is the request with seed + i run alone; usage counts the
    prompt once; streamed, every choice's chunks carry its index."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 10, "temperature": 0.9, "seed": 21}
    got = client.completions.create(n=3, **body)
    assert [c.index for c in got.choices] == [0, 1, 2]
    alone = [local.generate(PROMPT, max_tokens=10, temperature=0.9, seed=21 + i) for i in range(3)]
    assert [c.text for c in got.choices] == [a.text for a in alone]
    assert len({c.text for c in got.choices}) > 1  # different seeds, different samples
    assert got.usage is not None
    assert got.usage.completion_tokens == sum(len(a.token_ids) for a in alone)
    assert got.usage.prompt_tokens == alone[0].stats.prompt_tokens
    texts = {0: "", 1: ""}
    finishes = {}
    for part in client.completions.create(n=2, stream=True, **body):
        for c in part.choices:
            texts[c.index] += c.text
            if c.finish_reason:
                finishes[c.index] = c.finish_reason
    assert texts == {0: alone[0].text, 1: alone[1].text}
    assert set(finishes) == {0, 1}
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], n=2, max_tokens=4, seed=3
    )
    assert [c.index for c in chat.choices] == [0, 1]


# ----------------------------------------------------------------------------- logprobs


def test_logprobs_penalties_and_bias_through_the_openai_client(
    client: openai.OpenAI, local: colibri.Model
) -> None:
    model = local
    r = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=4, logprobs=2, temperature=0
    )
    lp = r.choices[0].logprobs
    assert lp is not None and len(lp.token_logprobs or []) == 4
    lib = model.generate(PROMPT, max_tokens=4, temperature=0, logprobs=2)
    assert lib.logprobs is not None
    assert [round(x, 5) for x in lp.token_logprobs or []] == [round(x, 5) for x in lib.logprobs]
    assert all(len(t) <= 2 for t in lp.top_logprobs or [])
    msgs = [{"role": "user", "content": "hi"}]
    c = client.chat.completions.create(
        model=MODEL, messages=msgs, max_tokens=3, logprobs=True, top_logprobs=2, temperature=0
    )
    content = c.choices[0].logprobs.content if c.choices[0].logprobs else None
    assert content is not None and len(content) >= 1 and len(content[0].top_logprobs) == 2
    # logprobs=false is honoured (nothing asked, nothing refused).
    r2 = client.chat.completions.create(model=MODEL, messages=msgs, max_tokens=2, logprobs=False)
    assert r2.choices[0].logprobs is None
    # Penalties and a bias reach the sampler: the same as the library's with them.
    kw: dict[str, Any] = {"presence_penalty": 1.5, "frequency_penalty": 0.5}
    banned = lib.token_ids[0]
    served = client.completions.create(
        model=MODEL, prompt=PROMPT, max_tokens=6, temperature=0, logit_bias={str(banned): -100},
        extra_body={"repetition_penalty": 1.3, "min_p": 0.0}, **kw,
    )  # fmt: skip
    ref = model.generate(
        PROMPT, max_tokens=6, temperature=0, logit_bias={banned: -100.0},
        repetition_penalty=1.3, **kw,
    )  # fmt: skip
    assert served.choices[0].text == ref.text
    _bad(
        lambda: client.completions.create(model=MODEL, prompt="a", presence_penalty=3),
        "presence_penalty",
    )
    _bad(
        lambda: client.completions.create(model=MODEL, prompt="a", logit_bias={"x": 1}),
        "logit_bias",
    )


def _joined_completion_logprobs(chunks: list[Any]) -> dict[str, list[Any]]:
    """The ``logprobs`` of a streamed completion's chunks, put end to end."""
    out: dict[str, list[Any]] = {k: [] for k in ("tokens", "token_logprobs", "top_logprobs")}
    out["text_offset"] = []
    for c in chunks:
        lp = c["choices"][0]["logprobs"] if c["choices"] else None
        if lp is not None:
            for k in out:
                out[k].extend(lp[k])
    return out


def _stream_json(server: Live, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with httpx.stream("POST", server.url + path, json={**body, "stream": True}, timeout=60) as r:
        assert r.status_code == 200, r.read()
        lines = [ln[6:] for ln in r.iter_lines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


def test_streamed_chunks_carry_their_tokens_logprobs(server: Live, local: colibri.Model) -> None:
    """Each streamed chunk carries the log-probabilities of the tokens whose text it
    carries (not all of them in the last chunk): the tokens of a completion chunk spell
    its text, and the chunks' logprobs put end to end are the non-streamed answer's."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 40, "temperature": 0, "logprobs": 2}
    whole = httpx.post(server.url + "/v1/completions", json=body, timeout=60).json()
    want = whole["choices"][0]["logprobs"]
    chunks = _stream_json(server, "/v1/completions", body)
    texts = [c for c in chunks if c["choices"] and c["choices"][0]["text"]]
    assert len(texts) > 5
    for c in texts:  # the tiny model's code is ASCII: each token's piece is its text
        lp = c["choices"][0]["logprobs"]
        assert lp is not None and "".join(lp["tokens"]) == c["choices"][0]["text"]
    assert _joined_completion_logprobs(chunks) == want
    assert len(want["tokens"]) == 40
    # A stop string's tokens are not in the text: their logprobs come in the last chunk.
    # (Without drafting, so that both end at the same token: the burst that completes a
    # stop string may hold more tokens, and bursts depend on the drafter's timing.)
    stopped = {**body, "stop": whole["choices"][0]["text"][20:24], "draft": "off"}
    cut = _stream_json(server, "/v1/completions", stopped)
    whole_cut = httpx.post(server.url + "/v1/completions", json=stopped, timeout=60).json()
    assert cut[-1]["choices"][0]["finish_reason"] == "stop"
    assert cut[-1]["choices"][0]["logprobs"] is not None
    assert _joined_completion_logprobs(cut) == whole_cut["choices"][0]["logprobs"]
    # Chat: each content chunk's entries, end to end, are the answer's; the library's
    # create_chat_completion streams them the same way.
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "import os"}],
            "max_tokens": 30, "temperature": 0, "logprobs": True, "top_logprobs": 3}  # fmt: skip
    answer = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).json()
    want_content = answer["choices"][0]["logprobs"]["content"]
    for stream in (
        _stream_json(server, "/v1/chat/completions", chat),
        list(local.create_chat_completion(**{**chat, "stream": True})),
    ):
        carrying = [c for c in stream if c["choices"] and c["choices"][0]["logprobs"]]
        assert len(carrying) > 5
        got = [e for c in carrying for e in c["choices"][0]["logprobs"]["content"]]
        assert got == want_content
        for c in carrying:
            entries = c["choices"][0]["logprobs"]["content"]
            assert "".join(e["token"] for e in entries) == c["choices"][0]["delta"]["content"]
    # Without logprobs, no chunk has any.
    plain = _stream_json(server, "/v1/completions", {**body, "logprobs": None})
    assert all(c["choices"][0]["logprobs"] is None for c in plain if c["choices"])


def test_logprobs_mapping() -> None:
    """The one function that turns the engine's per-token logprobs into OpenAI's shapes
    (what the server will answer once ``generate(..., logprobs=k)`` exists)."""

    class FakeModel:
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(ord("a") + t) for t in ids)

    class FakeResult:
        def __init__(self) -> None:
            self.token_ids = [0, 1]
            self.logprobs = [-0.5, -1.25]
            self.top_logprobs = [[(0, -0.5), (2, -1.0)], [(1, -1.25), (3, -2.0)]]

    m, r = FakeModel(), FakeResult()
    chat = protocol.logprobs_body(m, r, "chat", 1)  # type: ignore[arg-type]
    assert chat == {
        "content": [
            {
                "token": "a",
                "logprob": -0.5,
                "bytes": [97],
                "top_logprobs": [{"token": "a", "logprob": -0.5, "bytes": [97]}],
            },
            {
                "token": "b",
                "logprob": -1.25,
                "bytes": [98],
                "top_logprobs": [{"token": "b", "logprob": -1.25, "bytes": [98]}],
            },
        ],
        "refusal": None,
    }
    comp = protocol.logprobs_body(m, r, "completion", 2)  # type: ignore[arg-type]
    assert comp == {
        "tokens": ["a", "b"],
        "token_logprobs": [-0.5, -1.25],
        "top_logprobs": [{"a": -0.5, "c": -1.0}, {"b": -1.25, "d": -2.0}],
        "text_offset": [0, 1],
    }


# ----------------------------------------------------------------------------- llama-server


def test_tokenize_and_detokenize_as_llama_server(server: Live, local: colibri.Model) -> None:
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=30)  # noqa: E731
    r = post("/tokenize", {"content": PROMPT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == local.encode(PROMPT, add_special_tokens=False)
    assert r.json()["count"] == len(ids) and r.json()["max_model_len"] == local.max_context
    special = post("/tokenize", {"prompt": PROMPT, "add_special_tokens": True}).json()["tokens"]
    nulls = {"content": None, "prompt": PROMPT, "add_special": None, "add_special_tokens": True}
    assert post("/tokenize", nulls).json()["tokens"] == special  # null is absent
    assert special == local.encode(PROMPT)
    pieces = post("/tokenize", {"content": PROMPT, "with_pieces": True}).json()["tokens"]
    assert [p["id"] for p in pieces] == ids
    assert "".join(p["piece"] for p in pieces if isinstance(p["piece"], str)) == PROMPT
    back = post("/detokenize", {"tokens": ids})
    assert back.status_code == 200 and back.json() == {"content": PROMPT}
    for path, body, param in [
        ("/tokenize", {"content": 5}, "content"),
        ("/tokenize", {}, "content"),
        ("/tokenize", {"content": "x", "prompt": "x"}, "content"),
        ("/tokenize", {"content": "x", "frobnicate": 1}, "frobnicate"),
        ("/tokenize", {"content": None}, "content"),
        (
            "/tokenize",
            {"content": "x", "add_special": False, "add_special_tokens": "y"},
            "add_special_tokens",
        ),  # each alias is checked
        (
            "/tokenize",
            {"content": "x", "add_special": False, "add_special_tokens": True},
            "add_special",
        ),
        ("/tokenize", {"content": "x" * (local._max_prompt_chars + 1)}, "content"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        r = post(path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, r.text


# ----------------------------------------------------------------------------- errors


def _bad(call: Any, param: str | None, status: int = 400) -> openai.APIStatusError:
    with pytest.raises(openai.APIStatusError) as info:
        call()
    e = info.value
    assert e.status_code == status, e
    body = e.body
    assert isinstance(body, dict) and set(body) >= {"message", "type", "param", "code"}, body
    assert body["param"] == param, body
    if param is not None:
        assert param.split(".")[0].split("[")[0] in body["message"], body
    return e


def test_unsupported_fields_are_400s_naming_them(client: openai.OpenAI) -> None:
    chat = client.chat.completions.create
    msgs = [{"role": "user", "content": "hi"}]
    _bad(lambda: chat(model=MODEL, messages=msgs, n=0), "n")
    _bad(lambda: chat(model=MODEL, messages=msgs, n=17), "n")
    tool = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
    _bad(lambda: chat(model=MODEL, messages=msgs, tools=[tool]), "tools")
    _bad(lambda: chat(model=MODEL, messages=msgs, tool_choice="required"), "tool_choice")
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    _bad(
        lambda: chat(model=MODEL, messages=[{"role": "user", "content": image}]),
        "messages[0].content[0].type",
    )
    _bad(lambda: chat(model=MODEL, messages=msgs, response_format={"type": "xml"}),  # type: ignore[arg-type]
         "response_format")  # fmt: skip
    _bad(lambda: chat(model=MODEL, messages=msgs, audio={"voice": "x", "format": "mp3"}), "audio")
    _bad(
        lambda: chat(model=MODEL, messages=[{"role": "function", "content": "x"}]),
        "messages[0].role",
    )
    _bad(lambda: chat(model=MODEL, messages=msgs, extra_body={"min_q": 0.1}), "min_q")
    _bad(lambda: chat(model=MODEL, messages=msgs, temperature=2.5), "temperature")
    _bad(lambda: chat(model=MODEL, messages=msgs, stream_options={"include_usage": True}),
         "stream_options")  # fmt: skip
    _bad(lambda: chat(model=MODEL, messages=[]), "messages")
    comp = client.completions.create
    _bad(lambda: comp(model=MODEL, prompt=["a", ""]), "prompt[1]")
    _bad(lambda: comp(model=MODEL, prompt=["a"] * 33, n=2), "prompt")
    _bad(lambda: comp(model=MODEL, prompt="a", suffix="b"), "suffix")
    _bad(lambda: comp(model=MODEL, prompt="a", best_of=2), "best_of")
    _bad(lambda: comp(model=MODEL, prompt="", max_tokens=4), "prompt")
    _bad(lambda: comp(model=MODEL, prompt="a", max_tokens=0), "max_tokens")
    e = _bad(lambda: comp(model=MODEL, prompt="x " * 3000), "prompt")
    assert e.body["code"] == "context_length_exceeded"  # type: ignore[index]
    e = _bad(lambda: comp(model="gpt-4o", prompt="a"), "model", status=404)
    assert isinstance(e, openai.NotFoundError)
