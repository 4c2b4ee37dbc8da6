"""``colibri serve``'s scheduler: conversations reuse their KV, a stream is cancelled from
another thread and by a client that hangs up, the queue bound answers 429, concurrent
requests decode together and answer as alone, and a load of 32 requests from 8 clients
(tests/helpers/serve.py starts the server)."""

from __future__ import annotations

import json
import queue
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import colibri
import httpx
import openai
import pytest
from colibri.serve.scheduler import SessionPool, common_prefix
from helpers.serve import (
    MODEL,
    PROMPT,
    Live,
    wait_for,
)

# ----------------------------------------------------------------------------- KV reuse


def test_conversation_turns_prefill_only_their_new_tokens(server: Live) -> None:
    """Four turns of one chat, with another conversation interleaved: from turn 2 on, the
    prefill is only the new tokens (the reply's re-rendered boundary and the new user
    message); the earlier turns come from the conversation's session."""
    client = server.client()
    chat: list[dict[str, str]] = [{"role": "system", "content": "You write Python."}]
    other: list[dict[str, str]] = []
    rows = []
    for q in ("def add(a, b):", "import os", "class Stack:", "def main():"):
        chat.append({"role": "user", "content": q})
        r = client.chat.completions.create(model=MODEL, messages=chat, max_tokens=24, temperature=0)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        cached = r.usage.prompt_tokens_details.cached_tokens or 0
        rows.append((r.usage.prompt_tokens, cached, r.usage.completion_tokens))
        assert r.model_extra["colibri"]["prefilled_tokens"] == r.usage.prompt_tokens - cached
        chat.append({"role": "assistant", "content": r.choices[0].message.content or ""})
        # Another conversation in between: it gets a session of its own.
        other.append({"role": "user", "content": f"print({len(rows)})"})
        o = client.chat.completions.create(model=MODEL, messages=other, max_tokens=8, temperature=0)
        other.append({"role": "assistant", "content": o.choices[0].message.content or ""})
    print("\nturn  prompt  cached  prefilled  completion")
    for k, (p, c, g) in enumerate(rows, start=1):
        print(f"{k:4}  {p:6}  {c:6}  {p - c:9}  {g:10}")
    for k in range(1, 4):
        prompt, cached, _ = rows[k]
        prev_prompt, _, prev_completion = rows[k - 1]
        # Everything of the previous turn is reused but for the reply's last token or two
        # (a stop at max_tokens, then the template's own end of turn re-tokenised).
        assert cached >= prev_prompt + prev_completion - 2, rows
        new_tokens = prompt - prev_prompt - prev_completion
        assert prompt - cached <= new_tokens + 2, rows
        assert prompt - cached < prompt / 4, rows


def test_stream_cancel_from_another_thread(local: colibri.Model) -> None:
    """``GenerationStream.cancel()``: what the server calls when a client leaves while the
    worker thread iterates the stream; the iteration ends within a forward."""
    stream = local.generate(PROMPT, max_new_tokens=1500, stream=True, stop_token_ids=[])
    got: list[str] = []
    first = threading.Event()

    def consume() -> None:
        for chunk in stream:
            got.append(chunk)
            first.set()

    t = threading.Thread(target=consume)
    t.start()
    assert first.wait(30)
    stream.cancel()
    t.join(30)
    assert not t.is_alive()
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert stream.result.stats.generated_tokens < 1500
    assert "".join(got) == stream.result.text


def test_session_pool_choice() -> None:
    class Stub:
        def session(self) -> object:
            return object()

    pool = SessionPool(Stub(), 2)  # type: ignore[arg-type]
    a, n = pool.choose([1, 2, 3])
    assert n == 0
    a.tokens, a.prompt_len = [1, 2, 3, 9, 9], 3
    b, _ = pool.choose([5, 6])  # no continuation: a new session while there is room
    assert b is not a
    b.tokens, b.prompt_len = [5, 6, 7], 2
    again, n = pool.choose([1, 2, 3, 9, 9, 4])  # extends a's conversation
    assert again is a and n == 5
    third, n = pool.choose([5, 8])  # full: the slot sharing the longest prefix
    assert third is b and n == 1
    # A slot generating now (in the batch) is not a candidate; none free: wait (None).
    other = pool.choose([5, 8], busy=frozenset({id(b)}))
    assert other is not None and other[0] is a
    assert pool.choose([5, 8], busy=frozenset({id(a), id(b)})) is None
    assert common_prefix([1, 2], [1, 2, 3]) == 2 and common_prefix([], [1]) == 0


# ----------------------------------------------------------------------------- concurrency


def _stream(
    url: str, body: dict[str, Any], out: queue.Queue[Any], hang_up: threading.Event | None
) -> None:
    """POST a streaming completion; report its status and its first data line, then hang
    up once ``hang_up`` is set (at once when it is None)."""
    try:
        with (
            httpx.Client(timeout=60) as h,
            h.stream("POST", url + "/v1/completions", json=body) as r,
        ):
            out.put(("status", r.status_code))
            for line in r.iter_lines():
                if line.startswith("data: "):
                    out.put(("data", line))
                    if hang_up is not None:
                        hang_up.wait(60)
                    return
    except Exception as e:  # reported to the test
        out.put(("error", repr(e)))


LONG = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1900, "stream": True, "ignore_eos": True}


def test_disconnect_cancels_the_generation(server: Live) -> None:
    before = server.stats()["totals"]
    out: queue.Queue[Any] = queue.Queue()
    t0 = time.monotonic()
    _stream(server.url, LONG, out, None)
    assert out.get() == ("status", 200)
    assert out.get()[0] == "data"
    # The client has hung up: the engine stops within a forward, long before 1900 tokens.
    after = wait_for(
        lambda: (s := server.stats())["totals"]["cancelled"] > before["cancelled"] and s,
        what="the cancelled generation",
    )
    last = after["history"][-1]
    assert last["finish_reason"] == "cancelled"
    assert last["generated_tokens"] < 1900
    # A non-streamed request whose client gives up is cancelled too.
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.url + "/v1/completions", json={**LONG, "stream": False}, timeout=0.5)
    wait_for(
        lambda: server.stats()["totals"]["cancelled"] >= before["cancelled"] + 2,
        what="the second cancellation",
    )
    assert server.stats()["history"][-1]["generated_tokens"] < 1900
    assert time.monotonic() - t0 < 20
    # And the engine is free for the next one at once.
    r = server.client().completions.create(model=MODEL, prompt="x", max_tokens=2)
    assert r.usage is not None and r.usage.completion_tokens == 2


def test_queue_bound_refuses_with_retry_after(server: Live) -> None:
    """--max-batch 2 generate together and --max-queue 3 wait; the next request is a 429
    with Retry-After, and once the queue drains requests are served again."""
    outs: list[queue.Queue[Any]] = [queue.Queue() for _ in range(5)]
    release = threading.Event()
    threads = []
    try:
        for i, out in enumerate(outs):
            t = threading.Thread(target=_stream, args=(server.url, LONG, out, release), daemon=True)
            t.start()
            threads.append(t)
            if i < 2:  # the batch's two are generating before the others queue behind them
                assert out.get(timeout=30) == ("status", 200)
                assert out.get(timeout=30)[0] == "data"
        wait_for(lambda: server.stats()["queue_depth"] == 3, what="three queued requests")
        r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
        assert r.status_code == 429
        assert int(r.headers["retry-after"]) >= 1
        assert r.json()["error"]["code"] == "queue_full"
        with pytest.raises(openai.RateLimitError):
            server.client().completions.create(model=MODEL, prompt="a", max_tokens=2)
        stats = server.stats()
        # Both generate at once: one batch, its forwards shared.
        assert stats["running"] == 2 and stats["max_batch"] == 2
        assert stats["peak_running"] == 2
    finally:
        release.set()  # each hangs up after its first chunk: the queue drains
        for t in threads:
            t.join(timeout=60)
    wait_for(lambda: (s := server.stats())["queue_depth"] == 0 and s["running"] == 0)
    r = httpx.post(server.url + "/v1/completions", json={"prompt": "a", "max_tokens": 2})
    assert r.status_code == 200


def test_concurrent_requests_share_forwards_and_answer_as_alone(
    server: Live, local: colibri.Model
) -> None:
    """Two streamed requests sent together decode in one batch — their streams interleave,
    where requests taking turns would stream one after the other — and each answers what
    the library gives it alone (greedy with MTP drafting; sampled with n-gram drafting)."""
    bodies = [
        {
            "model": MODEL,
            "prompt": PROMPT,
            "max_tokens": 300,
            "temperature": 0,
            "stream": True,
            "ignore_eos": True,
        },
        {
            "model": MODEL,
            "prompt": "import numpy as np\n",
            "max_tokens": 300,
            "temperature": 0.8,
            "seed": 11,
            "stream": True,
            "ignore_eos": True,
            "draft": "ngram",
        },
    ]
    arrivals: dict[int, list[float]] = {0: [], 1: []}
    texts: dict[int, str] = {}

    def run(i: int) -> None:
        parts = []
        with (
            httpx.Client(timeout=60) as h,
            h.stream("POST", server.url + "/v1/completions", json=bodies[i]) as r,
        ):
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    chunk = json.loads(line[6:])
                    if chunk["choices"] and chunk["choices"][0]["text"]:
                        parts.append(chunk["choices"][0]["text"])
                        arrivals[i].append(time.monotonic())
        texts[i] = "".join(parts)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    a, b = arrivals[0], arrivals[1]
    assert len(a) > 10 and len(b) > 10
    # Each stream's first chunk came before the other's last: they ran together.
    assert a[0] < b[-1] and b[0] < a[-1], (a[0], a[-1], b[0], b[-1])
    for i, body in enumerate(bodies):
        alone = local.generate(
            body["prompt"],
            max_tokens=body["max_tokens"],
            temperature=body["temperature"],
            seed=body.get("seed"),
            draft=body.get("draft", "auto"),
            ignore_eos=True,
        )
        assert texts[i] == alone.text, i


def test_load_32_requests_from_8_clients(server: Live) -> None:
    """32 greedy requests (completions and chats, streamed and not) from 8 concurrent
    clients: each is answered or refused with a 429, none is lost, and every answer is the
    text the same request gets alone."""
    reqs: list[tuple[str, dict[str, Any]]] = []
    for i in range(32):
        kind = "chat" if i % 2 else "completion"
        body: dict[str, Any] = {"model": MODEL, "max_tokens": 12 + i % 5, "temperature": 0}
        if kind == "chat":
            body["messages"] = [{"role": "user", "content": f"def f{i}(x):"}]
        else:
            body["prompt"] = f"# step {i}\ndef g{i}("
        reqs.append((kind, body))

    def ask(c: openai.OpenAI, kind: str, body: dict[str, Any], stream: bool) -> str:
        if kind == "chat":
            if stream:
                parts = c.chat.completions.create(**body, stream=True)
                return "".join(p.choices[0].delta.content or "" for p in parts if p.choices)
            return c.chat.completions.create(**body).choices[0].message.content or ""
        if stream:
            return "".join(p.choices[0].text for p in c.completions.create(**body, stream=True))
        return c.completions.create(**body).choices[0].text

    results: dict[int, str] = {}
    refusals: list[str | None] = []

    def worker(w: int) -> None:
        c = server.client(timeout=120)
        for i in range(w, 32, 8):
            kind, body = reqs[i]
            for _attempt in range(20):  # a refused client retries after Retry-After
                try:
                    results[i] = ask(c, kind, body, stream=i % 3 == 0)
                    break
                except openai.RateLimitError as e:
                    after = e.response.headers.get("retry-after")
                    refusals.append(after)
                    time.sleep(min(float(after or 1), 1.0) * 0.25)

    t0 = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(worker, range(8)))
    elapsed = time.monotonic() - t0
    assert sorted(results) == list(range(32))  # none lost: every one answered in the end
    assert all(r is not None and int(r) >= 1 for r in refusals)
    alone = server.client()
    for i, text in results.items():
        kind, body = reqs[i]
        assert text == ask(alone, kind, body, stream=False), i
    print(f"\n32 requests, 8 clients: {len(refusals)} refusals (429, retried) "
          f"in {elapsed:.1f} s")  # fmt: skip
