"""``colibri serve`` end to end: a live server started by ``colibri serve`` in a subprocess on
a free 127.0.0.1 port, driven with the official ``openai`` client, raw HTTP (httpx) and a
headless Chromium (selenium) for the dashboard. The model is the embedded tiny one, whose
greedy output the tests compare with the library's own.

Set ``COLIBRI_DASHBOARD_SCREENSHOT=docs/dashboard.png`` to write the dashboard screenshot of
the browser test where the docs show it."""

from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import colibri
import httpx
import openai
import pytest
from colibri import _openai as protocol
from colibri.serve.app import default_served_name
from colibri.serve.scheduler import SessionPool, common_prefix
from conftest import ROOT
from prometheus_client.parser import text_string_to_metric_families

MODEL = "tiny"
PROMPT = "def fibonacci(n):"


@dataclass
class Live:
    url: str
    proc: subprocess.Popen[str]
    log: list[str]
    pump: threading.Thread

    def client(self, key: str = "none", **kw: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, **kw)

    def stats(self, **kw: Any) -> dict[str, Any]:
        r = httpx.get(self.url + "/stats", timeout=10, **kw)
        r.raise_for_status()
        return r.json()


def start_server(*args: str) -> Live:
    """``colibri serve`` on a free port; returns once it listens."""
    cmd = [sys.executable, "-m", "colibri.cli", "serve", "--port", "0", "--threads", "2", *args]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT
    )
    lines: queue.Queue[str] = queue.Queue()
    log: list[str] = []

    def pump() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            log.append(line)
            lines.put(line)

    pumping = threading.Thread(target=pump, daemon=True)
    pumping.start()
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            line = lines.get(timeout=1)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if line.startswith("colibri serve: model"):
            url = line.split(" at ")[1].split("/v1")[0]
            return Live(url, proc, log, pumping)
    proc.kill()
    raise AssertionError("the server did not start:\n" + "".join(log))


def stop_server(live: Live) -> None:
    """Ctrl-C: a graceful shutdown, then the CLI's status for an interrupt (130)."""
    live.proc.send_signal(signal.SIGINT)
    try:
        rc = live.proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        live.proc.kill()
        raise AssertionError("the server did not stop on SIGINT:\n" + "".join(live.log)) from None
    finally:
        live.pump.join(timeout=5)
        assert live.proc.stdout is not None
        live.proc.stdout.close()
    log = "".join(live.log)
    assert rc == 130, log
    assert "Traceback" not in log and "ERROR" not in log, log


@pytest.fixture(scope="module")
def server() -> Iterator[Live]:
    # The lookahead on (the tiny model fits any budget, which turns "auto" off): the
    # dashboard and metrics show its recall.
    live = start_server(
        "--max-queue", "3", "--sessions", "4", "--max-batch", "2", "--prefetch", "real"
    )
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(server: Live) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def local() -> colibri.Model:
    """The same model in this process: what the server's answers must equal."""
    return colibri.Model(threads=2)


def wait_for(cond: Any, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


# ----------------------------------------------------------------------------- basics


def test_models_health_and_import(server: Live, client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    h = httpx.get(server.url + "/health").json()
    assert h["status"] == "ok" and h["model"] == MODEL
    # `import colibri` stays free of the web stack.
    code = "import colibri, sys; print(any(m.split('.')[0] in sys.modules for m in "
    code += "('starlette', 'uvicorn', 'sse_starlette', 'prometheus_client')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_serve_without_the_extra_says_how_to_install() -> None:
    code = (
        "import sys; sys.modules['sse_starlette'] = None\n"
        "from colibri.cli import main; sys.exit(main(['serve', '--port', '0']))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert 'pip install "colibri[serve]"' in r.stderr
    assert "Traceback" not in r.stderr


def _serve_cli(*args: str) -> subprocess.CompletedProcess[str]:
    cmd = [sys.executable, "-m", "colibri.cli", "serve", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=60, cwd=ROOT)


@pytest.mark.parametrize("port", ["99999", "-1"])
def test_serve_refuses_a_port_out_of_range(port: str) -> None:
    t0 = time.monotonic()
    r = _serve_cli("--port", port)
    assert r.returncode == 1, r
    assert r.stderr.startswith("error: invalid value for 'port'") and "0..65535" in r.stderr
    assert "Traceback" not in r.stderr
    assert time.monotonic() - t0 < 30  # refused before the model loads


def test_serve_on_a_port_in_use_says_so(server: Live) -> None:
    """A taken port is ``error:`` and exit 1 (uvicorn would exit 3 with its own log line),
    and the running server is unharmed."""
    port = server.url.rsplit(":", 1)[1]
    r = _serve_cli("--port", port)
    assert r.returncode == 1, r
    assert r.stderr.startswith(f"error: cannot listen on 127.0.0.1:{port}"), r.stderr
    assert "another process" in r.stderr and "Traceback" not in r.stderr
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    with pytest.raises(colibri.ServerAddressError, match="in use"):
        from colibri.serve import listen_socket

        listen_socket("127.0.0.1", int(port))


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


def test_tokenize_and_detokenize_as_llama_server(server: Live, local: colibri.Model) -> None:
    post = lambda path, body: httpx.post(server.url + path, json=body, timeout=30)  # noqa: E731
    r = post("/tokenize", {"content": PROMPT})
    assert r.status_code == 200, r.text
    ids = r.json()["tokens"]
    assert ids == local.encode(PROMPT, add_special_tokens=False)
    assert r.json()["count"] == len(ids) and r.json()["max_model_len"] == local.max_context
    special = post("/tokenize", {"prompt": PROMPT, "add_special_tokens": True}).json()["tokens"]
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
        ("/tokenize", {"content": "x" * (local._max_prompt_chars + 1)}, "content"),
        ("/detokenize", {"tokens": [1, -1]}, "tokens[1]"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ]:
        r = post(path, body)
        assert r.status_code == 400, (path, body, r.text)
        assert r.json()["error"]["param"] == param, r.text


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
    r = httpx.post(url, json={**base, "include_stop_str_in_output": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "include_stop_str_in_output"


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


# ----------------------------------------------------------------------------- auth


def test_api_key_guards_every_endpoint_but_health() -> None:
    live = start_server("--api-key", "s3cret")
    try:
        with pytest.raises(openai.AuthenticationError):
            live.client().models.list()
        with pytest.raises(openai.AuthenticationError):
            live.client("wrong").completions.create(model=MODEL, prompt="a", max_tokens=2)
        ok = live.client("s3cret").completions.create(model=MODEL, prompt="a", max_tokens=2)
        assert ok.usage is not None and ok.usage.completion_tokens == 2
        for path in ("/", "/stats", "/metrics", "/v1/models"):
            r = httpx.get(live.url + path, timeout=10)
            assert r.status_code == 401, path
            assert r.json()["error"]["code"] == "invalid_api_key"
            good = httpx.get(live.url + path, headers={"Authorization": "Bearer s3cret"})
            assert good.status_code == 200, path
        # A browser logs into the dashboard with HTTP Basic (any user, the key as password).
        assert httpx.get(live.url + "/").headers["www-authenticate"].startswith("Basic")
        assert httpx.get(live.url + "/", auth=("me", "s3cret")).status_code == 200
        assert httpx.get(live.url + "/stats", auth=("me", "nope")).status_code == 401
        assert httpx.get(live.url + "/health").status_code == 200
    finally:
        stop_server(live)


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


# ----------------------------------------------------------------------------- metrics


def test_metrics_are_prometheus_text(server: Live, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "colibri_requests",
        "colibri_generated_tokens",
        "colibri_prompt_tokens",
        "colibri_prompt_cached_tokens",
        "colibri_tokens_per_second",
        "colibri_tokens_per_forward",
        "colibri_drafts_proposed",
        "colibri_drafts_accepted",
        "colibri_draft_acceptance",
        "colibri_expert_hits",
        "colibri_expert_misses",
        "colibri_expert_bytes_read",
        "colibri_expert_wait_seconds",
        "colibri_expert_layer_hits",
        "colibri_prefetch_recall",
        "colibri_queue_depth",
        "colibri_memory_bytes",
        "colibri_request_seconds",
    ):
        assert name in fams, name

    def value(name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in fams[name].samples
            if s.name.endswith("_total") or s.name == name
            if all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert value("colibri_generated_tokens") >= 8
    assert value("colibri_requests", endpoint="/v1/completions", status="200") >= 1
    assert value("colibri_expert_hits") > 0
    assert value("colibri_tokens_per_second") > 0
    assert value("colibri_memory_bytes", kind="expert_budget") > 0
    assert value("colibri_queue_depth") == 0


# ----------------------------------------------------------------------------- dashboard

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
CHROMEDRIVER = shutil.which("chromedriver")


def test_dashboard_updates_in_a_browser(server: Live, tmp_path: Path) -> None:
    if CHROMIUM is None or CHROMEDRIVER is None:
        why = (
            "needs Debian's chromium and chromium-driver (apt-get install chromium "
            "chromium-driver; .ci/run installs them)"
        )
        if os.environ.get("COLIBRI_REQUIRE_BROWSER"):  # CI: the browser must be there
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,1180", "--hide-scrollbars"):  # fmt: skip
        opts.add_argument(a)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium fetch a driver
    driver = webdriver.Chrome(options=opts, service=Service(str(CHROMEDRIVER)))
    try:
        driver.get(server.url + "/")

        def text(id_: str) -> str:
            return str(driver.find_element("id", id_).text)

        def polls() -> int:
            return int(driver.find_element("tag name", "body").get_attribute("data-polls") or 0)

        wait_for(lambda: polls() >= 1, what="the first poll")
        assert "live" in text("status")
        n0, tokens0 = int(text("generations")), int(text("tokens"))
        c = server.client()
        for q in ("class Node:", "def walk(tree):"):
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": q}],
                max_tokens=20,
                temperature=0,
            )
        wait_for(lambda: int(text("generations")) == n0 + 2, what="the dashboard to update")
        assert int(text("tokens")) == tokens0 + 40
        # While a long generation runs, its row in "Running now" counts up.
        seen, stop = [0], threading.Event()
        runner = threading.Thread(target=_long_stream, args=(server, seen, stop), daemon=True)
        runner.start()
        try:

            def generated() -> int:
                # Poll now rather than wait for the page's 1 s timer: on the tiny model
                # the whole generation takes about two seconds.
                driver.execute_script("return poll();")
                rows = driver.find_elements("css selector", "#active tr")
                if not rows:
                    return 0
                cells = rows[0].find_elements("tag name", "td")
                return int(cells[3].text.split(" / ")[0])

            a = wait_for(lambda: generated() >= 5, what="a running row on the page")
            wait_for(lambda: generated() > a, what="the row to count up")
            assert not driver.find_element("id", "active-empty").is_displayed()
        finally:
            stop.set()
            runner.join(timeout=60)
        wait_for(lambda: driver.find_element("id", "active-empty").is_displayed(),
                 what="the row to go when the generation ends")  # fmt: skip
        assert float(text("tps")) > 0
        assert float(text("tpf")) >= 1.0
        assert text("hitrate").endswith("%")
        assert text("recall").endswith("%")
        # The charts drew: the heat map has coloured cells (not only the background).
        coloured = driver.execute_script(
            """const c = document.getElementById('c-heat');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 1] > 150) n++;
            return n;"""
        )
        assert coloured > 500
        logs = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not logs, logs
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if target := os.environ.get("COLIBRI_DASHBOARD_SCREENSHOT"):
            shutil.copyfile(shot, ROOT / target)
    finally:
        driver.quit()


def _long_stream(server: Live, seen: list[int], stop: threading.Event) -> None:
    """A long streamed generation (the tiny model makes 1,900 tokens in ~2 s); counts its
    chunks into ``seen[0]`` until ``stop``."""
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 1900, "ignore_eos": True,
            "temperature": 0, "stream": True, "draft": "off"}  # fmt: skip
    with httpx.stream("POST", server.url + "/v1/completions", json=body, timeout=60) as r:
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                seen[0] += 1
            if stop.is_set():
                return


def test_stats_show_running_requests_live(server: Live) -> None:
    """``/stats`` describes a generation while it runs, not only when it ends: its tokens
    grow between polls, with its speed and an ETA against ``max_tokens``."""
    seen, stop = [0], threading.Event()
    t = threading.Thread(target=_long_stream, args=(server, seen, stop), daemon=True)
    t.start()
    try:
        first = wait_for(
            lambda: [a for a in server.stats()["active"] if a["generated_tokens"] >= 5],
            what="a running generation in /stats",
        )[0]
        assert first["endpoint"] == "/v1/completions" and first["phase"] == "decode"
        assert first["max_tokens"] == 1900 and first["prompt_tokens"] > 0
        later = wait_for(
            lambda: [
                a
                for a in server.stats()["active"]
                if a["generated_tokens"] >= first["generated_tokens"] + 20
            ],
            what="its token count to grow",
        )[0]
        assert later["tokens_per_second"] > 0 and later["eta_seconds"] is not None
        assert later["tokens_per_forward"] >= 1.0 and later["elapsed_seconds"] > 0
    finally:
        stop.set()
        t.join(timeout=60)
    wait_for(lambda: not server.stats()["active"], what="the generation to end")


def test_stats_json(server: Live) -> None:
    s = server.stats()
    assert s["served_model"] == MODEL
    # The request count is of API requests: the dashboard's polling and scrapes add none.
    for _ in range(3):
        server.stats()
        httpx.get(server.url + "/health", timeout=10)
        httpx.get(server.url + "/metrics", timeout=10)
    assert server.stats()["totals"]["requests"] == s["totals"]["requests"]
    httpx.get(server.url + "/v1/models", timeout=10)
    assert server.stats()["totals"]["requests"] == s["totals"]["requests"] + 1
    assert s["totals"]["generations"] == len(s["history"]) or len(s["history"]) == 120
    assert s["layers"] and all(0.0 <= v["hit_rate"] <= 1.0 for v in s["layers"].values())
    json.dumps(s)


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


def test_a_queued_request_cancelled_by_the_shutdown_gets_503() -> None:
    live = start_server("--max-batch", "1", "--sessions", "1")
    seen, stop = [0], threading.Event()
    runner = threading.Thread(target=_long_stream, args=(live, seen, stop), daemon=True)
    runner.start()
    try:
        wait_for(lambda: seen[0] >= 3, what="the first request to run")
        with ThreadPoolExecutor(1) as pool:
            queued = pool.submit(
                httpx.post,
                live.url + "/v1/completions",
                json={"model": MODEL, "prompt": PROMPT, "max_tokens": 4},
                timeout=60,
            )
            wait_for(lambda: live.stats()["queue_depth"] == 1, what="the second to queue")
            live.proc.send_signal(signal.SIGINT)
            r = queued.result(timeout=60)
        assert r.status_code == 503, (r.status_code, r.text)
        assert r.json()["error"]["code"] == "shutting_down"
    finally:
        stop.set()
        runner.join(timeout=60)
        live.proc.wait(timeout=30)
        live.pump.join(timeout=5)
        assert live.proc.stdout is not None
        live.proc.stdout.close()
