"""``colibri serve`` end to end: a live server started by ``colibri serve`` in a subprocess on
a free 127.0.0.1 port (tests/helpers/serve.py), driven with the official ``openai`` client, raw
HTTP (httpx) and a headless Chromium (selenium) for the dashboard. The model is the embedded
tiny one, whose greedy output the tests compare with the library's own.

This module: the server process itself (health, the ``serve`` extra, ports, the API key,
shutdown). The others: test_serve_openai.py (answers equal the library's),
test_serve_errors.py (errors are OpenAI-shaped 400s), test_serve_scheduling.py (KV reuse,
cancellation, the queue, batching, load), test_serve_dashboard.py (metrics, /stats, the
dashboard in a browser). test_tools.py and test_reasoning.py import ``MODEL``,
``start_server`` and ``stop_server`` from here."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import colibri
import httpx
import openai
import pytest
from conftest import ROOT
from helpers.serve import (
    MODEL,
    PROMPT,
    Live,
    long_stream,
    start_server,
    stop_server,
    wait_for,
)

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


# ----------------------------------------------------------------------------- shutdown


def test_a_queued_request_cancelled_by_the_shutdown_gets_503() -> None:
    live = start_server("--max-batch", "1", "--sessions", "1")
    seen, stop = [0], threading.Event()
    runner = threading.Thread(target=long_stream, args=(live, seen, stop), daemon=True)
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
