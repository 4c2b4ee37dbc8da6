"""``colibri serve``'s errors: the client's mistakes are OpenAI-shaped 400s naming the field
(bad constraints, other clients' extra fields, hostile bodies; the unsupported fields are in
test_serve_openai.py), and HTTP errors have the same shape (tests/helpers/serve.py starts
the server)."""

from __future__ import annotations

import time
from typing import Any

import colibri
import httpx
from helpers.serve import (
    MODEL,
    PROMPT,
    Live,
)

# ----------------------------------------------------------------------------- errors


def test_bad_constraints_are_400s_before_any_answer(server: Live) -> None:
    """An invalid schema, regex or grammar is the client's mistake: a 400 naming the field,
    streamed or not (never a 500, nor a 200 whose stream then fails)."""
    msgs = [{"role": "user", "content": "hi"}]
    bad_schema = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "x"}}}
    cases: list[tuple[str, dict[str, Any], str]] = [
        ("chat/completions", {"messages": msgs, "response_format": bad_schema}, "response_format"),
        ("chat/completions", {"messages": msgs, "guided_regex": "a(("}, "guided_regex"),
        ("completions", {"prompt": "x", "guided_grammar": "start: nope"}, "guided_grammar"),
        ("completions", {"prompt": "x", "guided_json": {"type": "x"}}, "guided_json"),
    ]
    for path, fields, param in cases:
        for stream in (False, True):
            body = {"model": MODEL, "max_tokens": 4, "stream": stream, **fields}
            r = httpx.post(f"{server.url}/v1/{path}", json=body, timeout=30)
            assert r.status_code == 400, (path, fields, stream, r.status_code, r.text)
            err = r.json()["error"]
            assert err["param"] == param and err["type"] == "invalid_request_error", err


def test_clients_extra_fields_over_http(server: Live) -> None:
    """llama.cpp's and vLLM's extra fields (docs/server.md has the table): a mapped one
    answers as colibri's own field does, an ignored one is named in a ``Warning`` header,
    streamed or not, and a refused one is a 400 naming it."""
    url = f"{server.url}/v1/completions"
    base = {"model": MODEL, "prompt": PROMPT, "max_tokens": 6, "temperature": 0}
    own = httpx.post(url, json={**base, "repetition_penalty": 1.2}, timeout=30)
    mapped = httpx.post(url, json={**base, "repeat_penalty": 1.2, "cache_prompt": True}, timeout=30)
    assert mapped.status_code == 200 and "warning" not in mapped.headers
    assert mapped.json()["choices"][0]["text"] == own.json()["choices"][0]["text"]
    for stream in (False, True):
        r = httpx.post(url, json={**base, "mirostat": 2, "stream": stream}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["warning"].startswith('299 colibri "ignored fields: mirostat')
    r = httpx.post(url, json={**base, "use_beam_search": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "use_beam_search"


def test_http_errors_are_openai_shaped(server: Live) -> None:
    def check(r: httpx.Response, status: int) -> dict[str, Any]:
        assert r.status_code == status, r.text
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        return err

    err = check(
        httpx.post(server.url + "/v1/chat/completions", content=b"{not json", timeout=10), 400
    )
    assert err["code"] == "invalid_json"
    check(httpx.post(server.url + "/v1/completions", json=[1, 2], timeout=10), 400)
    check(httpx.get(server.url + "/v1/nothing-here", timeout=10), 404)
    check(httpx.get(server.url + "/v1/chat/completions", timeout=10), 405)
    check(httpx.get(server.url + "/v1/models/other", timeout=10), 404)


def test_hostile_bodies_are_400s_and_bounded(server: Live, local: colibri.Model) -> None:
    """Deeply nested JSON is a 400 ``invalid_json`` (not a 500), and a prompt longer than
    the context can hold is refused before it is tokenised: at once, whatever its size."""
    nested = "[" * 100_000 + "]" * 100_000
    r = httpx.post(
        server.url + "/v1/completions",
        content=nested,
        headers={"Content-Type": "application/json"},
        timeout=30,
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "invalid_json", r.text
    big = "x" * (local._max_prompt_chars + 1)
    t0 = time.monotonic()
    r = httpx.post(
        server.url + "/v1/completions",
        json={"model": MODEL, "prompt": big, "max_tokens": 1},
        timeout=60,
    )
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
    assert time.monotonic() - t0 < 10
    ids = [1] * (local.max_context * 100) + [10**9]  # counted before any id is checked
    for prompt in (ids, [[1], ids]):
        r = httpx.post(
            server.url + "/v1/completions",
            json={"model": MODEL, "prompt": prompt, "max_tokens": 1},
            timeout=60,
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["code"] == "context_length_exceeded", r.text


def test_a_body_of_too_many_json_values_is_refused_before_it_is_parsed(server: Live) -> None:
    """Parsing makes a Python object per JSON value (32 MiB of ``[],`` took 923 MB above idle
    RSS), so a body of more values than ``MAX_JSON_VALUES`` is a 413 before it is parsed,
    while commas and brackets inside a string are not counted as values."""
    from colibri.serve.app import MAX_JSON_VALUES

    wide = (b'{"model":"tiny","prompt":"x","max_tokens":1,"stop":['
            + b"[]," * MAX_JSON_VALUES + b"[]]}")  # fmt: skip
    r = httpx.post(server.url + "/v1/completions", content=wide,
                   headers={"Content-Type": "application/json"}, timeout=60)  # fmt: skip
    assert r.status_code == 413, r.text
    assert r.json()["error"]["code"] == "too_large" and "JSON values" in r.text
    # The same bytes inside one string: one value; refused for its length, not its commas.
    text = "[]," * MAX_JSON_VALUES
    r = httpx.post(server.url + "/v1/completions",
                   json={"model": MODEL, "prompt": text, "max_tokens": 1}, timeout=60)  # fmt: skip
    assert r.status_code == 400, r.text
    assert r.json()["error"]["code"] == "context_length_exceeded"
