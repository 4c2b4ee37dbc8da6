"""``colibri serve`` under abuse: deadlines for requests that never finish, the connection
cap that keeps ``/health`` up among idle sockets (tools/probe_idle_sockets.py measures it at
scale), and the guard against DNS rebinding and cross-site requests (``Host`` and
``Origin`` allow-lists, simple bodies refused without a key)."""

from __future__ import annotations

import resource
import socket
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from colibri.serve.guard import default_allowed_hosts, is_loopback
from helpers.serve import MODEL, PROMPT, ROOT, Live, start_server, stop_server

BODY = {"model": MODEL, "prompt": PROMPT, "max_tokens": 2, "temperature": 0}


def _address(live: Live) -> tuple[str, int]:
    host, port = live.url.removeprefix("http://").split(":")
    return host, int(port)


def _closed_within(sock: socket.socket, seconds: float) -> tuple[bool, bytes]:
    """Whether the server closes ``sock`` within ``seconds`` (and what it sent first)."""
    sock.settimeout(0.2)
    got = b""
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            data = sock.recv(65536)
        except TimeoutError:
            continue
        except OSError:
            return True, got
        if not data:
            return True, got
        got += data
    return False, got


@pytest.fixture(scope="module")
def quick() -> Iterator[Live]:
    """A server whose deadlines are 1 s each."""
    live = start_server(
        "--timeout-request-header", "1", "--timeout-request-body", "1",
        "--timeout-keep-alive", "1", "--max-connections", "40",
    )  # fmt: skip
    yield live
    stop_server(live)


def test_a_socket_that_never_sends_is_closed_after_the_header_deadline(quick: Live) -> None:
    with socket.create_connection(_address(quick)) as s:
        closed, _ = _closed_within(s, 6)
    assert closed, "an idle socket stayed open past --timeout-request-header"


def test_a_head_trickled_byte_by_byte_is_closed_at_the_deadline(quick: Live) -> None:
    """Slowloris: each byte resets no timer; the head must be complete in time."""
    head = b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Pad: " + b"a" * 200
    with socket.create_connection(_address(quick)) as s:
        t0 = time.monotonic()
        closed = False
        for i in range(len(head)):
            try:
                s.sendall(head[i : i + 1])
            except OSError:
                closed = True
                break
            done, _ = _closed_within(s, 0.1)
            if done:
                closed = True
                break
        assert closed and time.monotonic() - t0 < 6, "a trickled head kept its socket open"


def test_a_body_that_does_not_arrive_is_a_408(quick: Live) -> None:
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
        b'Content-Type: application/json\r\nContent-Length: 100\r\n\r\n{"prompt"'
    )
    with socket.create_connection(_address(quick)) as s:
        s.sendall(head)
        closed, answer = _closed_within(s, 6)
    assert closed, "a request whose body stopped coming kept its socket"
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b'"code": "request_timeout"' in answer, answer
    assert httpx.get(quick.url + "/health", timeout=10).status_code == 200


def test_a_kept_alive_connection_closes_after_its_idle_time(quick: Live) -> None:
    with socket.create_connection(_address(quick)) as s:
        s.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        closed, answer = _closed_within(s, 6)
    assert answer.startswith(b"HTTP/1.1 200 ") and closed, answer


def test_past_the_cap_the_longest_idle_connection_is_closed(quick: Live) -> None:
    """--max-connections 40: a 41st socket closes the first idle one (only that one), not
    itself, and a request still gets its answer."""
    socks = [socket.create_connection(_address(quick)) for _ in range(40)]
    try:
        time.sleep(0.1)  # all 40 in; the header deadline is 1 s away
        extra = socket.create_connection(_address(quick))
        socks.append(extra)
        closed, _ = _closed_within(socks[0], 0.5)
        assert closed, "the oldest idle socket was not closed for the newcomer"
        kept, _ = _closed_within(socks[1], 0.1)
        assert not kept, "one newcomer closed more than one idle socket"
        extra.sendall(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        _, answer = _closed_within(extra, 3)
        assert answer.startswith(b"HTTP/1.1 200 "), answer
    finally:
        for s in socks:
            s.close()


def test_health_answers_through_a_crowd_of_idle_sockets() -> None:
    """At an fd limit of 512, 2,000 sockets that connect and send nothing (replaced when the
    server closes them): every /health check answers, within 5 s (before the connection
    limits, ~500 such sockets made /health time out)."""
    n = 2000
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < n + 256:
        resource.setrlimit(resource.RLIMIT_NOFILE, (n + 256, max(hard, n + 256)))
    live = start_server(fd_limit=512)
    socks: list[socket.socket] = []
    try:
        addr = _address(live)
        checks = []
        deadline = time.monotonic() + 8
        while time.monotonic() < deadline:
            while len(socks) < n:
                s = socket.socket()
                s.setblocking(False)
                s.connect_ex(addr)
                socks.append(s)
            t0 = time.monotonic()
            try:
                ok = httpx.get(live.url + "/health", timeout=5).status_code == 200
            except httpx.HTTPError:
                ok = False
            checks.append((ok, time.monotonic() - t0))
            alive = []
            for s in socks:  # replace what the server closed
                try:
                    gone = s.recv(1) == b""
                except BlockingIOError:
                    gone = False
                except OSError:
                    gone = True
                if gone:
                    s.close()
                else:
                    alive.append(s)
            socks = alive
        assert len(checks) >= 5 and all(ok for ok, _ in checks), checks
    finally:
        for s in socks:
            s.close()
        stop_server(live)


def test_bad_limits_are_refused_before_the_model_loads() -> None:
    for flag, value in [
        ("--timeout-request-header", "0"),
        ("--timeout-request-body", "nan"),
        ("--timeout-keep-alive", "-1"),
        ("--max-connections", "0"),
    ]:
        r = subprocess.run(
            [sys.executable, "-m", "colibri.cli", "serve", "--port", "0", flag, value],
            capture_output=True,
            text=True,
            cwd=ROOT,
            timeout=60,
        )
        assert r.returncode == 1 and f"({flag})" in r.stderr, (flag, r.stderr)


# ------------------------------------------------------------------------ Host and Origin


def test_loopback_hosts_and_the_default_allow_list() -> None:
    for host in ["localhost", "LOCALHOST.", "app.localhost", "127.0.0.1", "127.3.4.5", "::1",
                 "[::1]"]:  # fmt: skip
        assert is_loopback(host), host
    for host in ["evil.example", "localhost.evil.example", "10.0.0.1", "0.0.0.0", "::", ""]:
        assert not is_loopback(host), host
    assert default_allowed_hosts("127.0.0.1") == () and default_allowed_hosts("::1") == ()
    assert default_allowed_hosts("0.0.0.0") == ("*",)


def test_a_foreign_host_header_is_refused(server: Live) -> None:
    """DNS rebinding: a page on evil.example re-pointed at 127.0.0.1 sends Host:
    evil.example; every path refuses it, /health and /stats included."""
    for path in ["/health", "/stats", "/v1/models", "/"]:
        r = httpx.get(server.url + path, headers={"Host": "evil.example"}, timeout=10)
        assert r.status_code == 403, (path, r.status_code)
        assert r.json()["error"]["code"] == "host_not_allowed"
        assert "--allow-host evil.example" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/completions", json=BODY, headers={"Host": "evil.example:8000"})
    assert r.status_code == 403
    port = _address(server)[1]
    for host in ["localhost", f"localhost:{port}", f"127.0.0.1:{port}", "[::1]:8000",
                 "dash.localhost"]:  # fmt: skip
        r = httpx.get(server.url + "/health", headers={"Host": host}, timeout=10)
        assert r.status_code == 200, (host, r.text)


def test_allow_host_extends_the_list() -> None:
    live = start_server("--allow-host", "colibri.lan", "--allow-host", "*.example.org")
    try:
        ok = ["colibri.lan", "colibri.lan:80", "a.example.org", "localhost"]
        for host in ok:
            r = httpx.get(live.url + "/health", headers={"Host": host}, timeout=10)
            assert r.status_code == 200, host
        for host in ["other.lan", "example.org.evil", "colibri.lan.evil"]:
            r = httpx.get(live.url + "/health", headers={"Host": host}, timeout=10)
            assert r.status_code == 403, host
    finally:
        stop_server(live)


def test_cross_site_requests_are_refused_without_a_key(server: Live) -> None:
    """A web page's simple POST (text/plain or a form: no preflight) and any request from
    another origin are refused; the server's own origin (its dashboard) and clients that
    send no Origin (curl, the openai package) are served."""
    url = server.url + "/v1/completions"
    plain = httpx.post(
        url, content=httpx.Request("POST", url, json=BODY).content,
        headers={"Content-Type": "text/plain;charset=UTF-8"}, timeout=30,
    )  # fmt: skip
    assert plain.status_code == 415 and plain.json()["error"]["code"] == "unsupported_media_type"
    form = httpx.post(url, data={"prompt": "x"}, timeout=30)
    assert form.status_code == 415
    multipart = httpx.post(url, files={"f": b"x"}, timeout=30)
    assert multipart.status_code == 415
    r = httpx.post(url, json=BODY, headers={"Origin": "https://evil.example"}, timeout=30)
    assert r.status_code == 403 and r.json()["error"]["code"] == "origin_not_allowed"
    r = httpx.get(server.url + "/stats", headers={"Origin": "null"}, timeout=30)
    assert r.status_code == 403
    assert httpx.post(url, json=BODY, headers={"Origin": server.url}, timeout=30).status_code == 200
    assert httpx.post(url, json=BODY, timeout=30).status_code == 200
    no_type = httpx.post(url, content=b'{"prompt": "x", "max_tokens": 1}', timeout=30)
    assert no_type.status_code == 200, no_type.text


def test_with_a_key_a_text_plain_body_is_served() -> None:
    live = start_server("--api-key", "k3y")
    try:
        url = live.url + "/v1/completions"
        content = httpx.Request("POST", url, json=BODY).content
        headers = {"Content-Type": "text/plain", "Authorization": "Bearer k3y"}
        assert httpx.post(url, content=content, headers=headers, timeout=30).status_code == 200
        del headers["Authorization"]
        assert httpx.post(url, content=content, headers=headers, timeout=30).status_code == 401
        r = httpx.post(
            url, json=BODY, timeout=30,
            headers={"Authorization": "Bearer k3y", "Origin": "https://evil.example"},
        )  # fmt: skip
        assert r.status_code == 403  # cached Basic credentials must not let a page in
    finally:
        stop_server(live)


def test_allow_origin_is_cors_for_that_origin_only() -> None:
    live = start_server("--allow-origin", "https://app.example")
    try:
        url = live.url + "/v1/chat/completions"
        pre = httpx.options(
            url,
            headers={
                "Origin": "https://app.example",
                "Access-Control-Request-Method": "POST",
                "Access-Control-Request-Headers": "content-type",
            },
            timeout=10,
        )
        assert pre.status_code == 200, pre.text
        assert pre.headers["access-control-allow-origin"] == "https://app.example"
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = httpx.post(url, json=body, headers={"Origin": "https://app.example"}, timeout=30)
        assert r.status_code == 200, r.text
        assert r.headers["access-control-allow-origin"] == "https://app.example"
        r = httpx.post(url, json=body, headers={"Origin": "https://other.example"}, timeout=30)
        assert r.status_code == 403 and "access-control-allow-origin" not in r.headers
    finally:
        stop_server(live)
