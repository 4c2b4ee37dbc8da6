"""Does ``/health`` stay up while thousands of sockets connect to ``colibri serve`` and never
finish a request? docs/reliability.md ("The server under idle and slow sockets") has the
figures.

Starts ``colibri serve`` (the embedded tiny model) with its fd limit set to ``--fd-limit``,
then keeps ``--sockets`` connections open against it for ``--seconds``: each connects and
sends nothing (``--mode idle``), or sends a request head one byte at a time (``slow``), or
half of each (``mixed``); whenever the server closes one, another takes its place. Meanwhile
a fresh connection asks ``GET /health`` every ``--interval`` seconds, with a 5 s timeout.
Prints one JSON object: the health checks (ok, failed, latency percentiles), the sockets
opened and closed by the server, and the most descriptors the server held.

    python tools/probe_idle_sockets.py --sockets 10000 --fd-limit 1024 --seconds 60

It needs a descriptor limit above ``--sockets`` for itself (raised here when the hard limit
allows, as root it always does).
"""

from __future__ import annotations

import argparse
import errno
import http.client
import json
import os
import resource
import selectors
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SLOW_HEAD = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 4000 + b"\r\n\r\n"


def start_server(fd_limit: int, extra: list[str]) -> tuple[subprocess.Popen[str], str]:
    """``colibri serve`` on a free port with RLIMIT_NOFILE = ``fd_limit``; its base URL."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (fd_limit, fd_limit))

    cmd = [sys.executable, "-m", "colibri.cli", "serve", "--port", "0", "--threads", "1", *extra]
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python")}
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=limit,
        cwd=ROOT,
        env=env,
    )
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("colibri serve: model"):
            return proc, line.split(" at ")[1].split("/v1")[0]
    raise SystemExit(f"the server did not start (exit {proc.wait()})")


class Crowd:
    """``n`` sockets held open against ``addr``; a closed one is replaced."""

    def __init__(self, addr: tuple[str, int], n: int, mode: str) -> None:
        self.addr, self.n, self.mode = addr, n, mode
        self.sel = selectors.DefaultSelector()
        self.opened = self.closed_by_server = self.connect_errors = 0
        self.sent: dict[socket.socket, int] = {}

    def _open(self, slow: bool) -> None:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.setblocking(False)
        rc = s.connect_ex(self.addr)
        if rc not in (0, errno.EINPROGRESS):
            self.connect_errors += 1
            s.close()
            return
        self.opened += 1
        self.sel.register(s, selectors.EVENT_READ, slow)
        if slow:
            self.sent[s] = 0

    def fill(self) -> None:
        while len(self.sel.get_map()) < self.n:
            slow = self.mode == "slow" or (self.mode == "mixed" and self.opened % 2 == 1)
            self._open(slow)

    def step(self, timeout: float) -> None:
        """Notice closed sockets (replacing them), and trickle a byte on each slow one."""
        for key, _ in self.sel.select(timeout):
            s: socket.socket = key.fileobj  # type: ignore[assignment]
            try:
                data = s.recv(65536)
            except BlockingIOError:
                continue
            except OSError:
                data = b""
            if not data:  # the server closed it
                self.closed_by_server += 1
                self.sel.unregister(s)
                self.sent.pop(s, None)
                s.close()
        for s, n in list(self.sent.items()):
            if n < len(SLOW_HEAD):
                try:
                    s.send(SLOW_HEAD[n : n + 1])
                    self.sent[s] = n + 1
                except (BlockingIOError, OSError):
                    pass

    def close(self) -> None:
        for key in list(self.sel.get_map().values()):
            key.fileobj.close()  # type: ignore[union-attr]
        self.sel.close()


def health_loop(url: str, stop: threading.Event, interval: float, out: list[Any]) -> None:
    host, port = url.removeprefix("http://").split(":")
    while not stop.is_set():
        t0 = time.monotonic()
        try:
            conn = http.client.HTTPConnection(host, int(port), timeout=5)
            conn.request("GET", "/health")
            ok = conn.getresponse().status == 200
            conn.close()
        except OSError:
            ok = False
        out.append((ok, time.monotonic() - t0))
        stop.wait(max(0.0, interval - (time.monotonic() - t0)))


def fd_count(pid: int) -> int:
    try:
        return len(os.listdir(f"/proc/{pid}/fd"))
    except OSError:
        return -1


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sockets", type=int, default=10_000)
    ap.add_argument("--fd-limit", type=int, default=1024)
    ap.add_argument("--seconds", type=float, default=30.0)
    ap.add_argument("--interval", type=float, default=0.25)
    ap.add_argument("--mode", choices=["idle", "slow", "mixed"], default="idle")
    ap.add_argument("server_args", nargs="*", help="more `colibri serve` flags (after --)")
    args = ap.parse_args()
    need = args.sockets + 256
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < need:
        resource.setrlimit(resource.RLIMIT_NOFILE, (need, max(hard, need)))
    proc, url = start_server(args.fd_limit, args.server_args)
    log: list[str] = []
    threading.Thread(target=lambda: log.extend(proc.stdout or []), daemon=True).start()
    host, port = url.removeprefix("http://").split(":")
    crowd = Crowd((host, int(port)), args.sockets, args.mode)
    checks: list[Any] = []
    stop = threading.Event()
    checker = threading.Thread(target=health_loop, args=(url, stop, args.interval, checks))
    checker.start()
    max_fds, t_end = 0, time.monotonic() + args.seconds
    try:
        while time.monotonic() < t_end:
            crowd.fill()
            crowd.step(0.05)
            max_fds = max(max_fds, fd_count(proc.pid))
    finally:
        stop.set()
        checker.join()
        held = len(crowd.sel.get_map())
        crowd.close()
        alive = proc.poll() is None
        proc.terminate()
        proc.wait(timeout=30)
    lat = sorted(t for _, t in checks)
    ok = sum(1 for good, _ in checks if good)

    def pct(q: float) -> float:
        return round(lat[min(len(lat) - 1, int(q * len(lat)))] * 1000, 1) if lat else -1.0

    print(
        json.dumps(
            {
                "sockets": args.sockets,
                "mode": args.mode,
                "fd_limit": args.fd_limit,
                "seconds": args.seconds,
                "health_checks": len(checks),
                "health_ok": ok,
                "health_failed": len(checks) - ok,
                "health_ms_p50": pct(0.5),
                "health_ms_p99": pct(0.99),
                "health_ms_max": pct(1.0),
                "sockets_opened": crowd.opened,
                "connect_errors": crowd.connect_errors,
                "closed_by_server": crowd.closed_by_server,
                "held_at_end": held,
                "server_max_fds": max_fds,
                "server_alive": alive,
                "server_log_errors": sum("ERROR" in line for line in log),
                "server_emfile": sum("Errno 24" in line for line in log),
            },
            indent=1,
        )
    )


if __name__ == "__main__":
    main()
