"""A live ``colibri serve`` for the tests: started in a subprocess on a free 127.0.0.1 port
(``start_server``), stopped with Ctrl-C (``stop_server``), and what the tests of it share.
The module-scoped ``server``, ``client`` and ``local`` fixtures (conftest.py) are built on it;
test_tools.py and test_reasoning.py start servers of their own."""

from __future__ import annotations

import queue
import resource
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

ROOT = Path(__file__).resolve().parents[2]
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


def start_server(*args: str, fd_limit: int | None = None) -> Live:
    """``colibri serve`` on a free port (with RLIMIT_NOFILE ``fd_limit`` if given); returns
    once it listens."""
    cmd = [sys.executable, "-m", "colibri.cli", "serve", "--port", "0", "--threads", "2", *args]

    def limit() -> None:
        if fd_limit is not None:
            resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=ROOT,
        preexec_fn=limit if fd_limit is not None else None,
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


def wait_for(cond: Any, timeout: float = 20.0, what: str = "condition") -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.05)
    raise AssertionError(f"timed out waiting for {what}")


def long_stream(server: Live, seen: list[int], stop: threading.Event) -> None:
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
