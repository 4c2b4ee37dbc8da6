"""``colibri serve``: an OpenAI-compatible HTTP server with a live dashboard (docs/server.md).

It needs the ``serve`` extra (``pip install "colibri[serve]"``): Starlette, uvicorn,
sse-starlette and prometheus-client. ``import colibri`` never imports this package.

Example (what ``colibri serve`` runs)::

    from colibri import Model
    from colibri.serve import serve

    serve(Model(), host="127.0.0.1", port=8000)

or, to mount it in an ASGI server of your own, ``create_app(Model())``.
"""

from __future__ import annotations

#: What to run when the extra is missing.
INSTALL_HINT = 'pip install "colibri[serve]"'

try:
    import prometheus_client  # noqa: F401
    import sse_starlette  # noqa: F401
    import starlette  # noqa: F401
    import uvicorn
except ImportError as e:  # pragma: no cover - exercised by the CLI test in a bare venv
    raise ImportError(
        f"colibri serve needs the 'serve' extra ({e.name} is not installed): {INSTALL_HINT}",
        name=e.name,
    ) from e

import contextlib  # noqa: E402
import errno  # noqa: E402
import socket  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from colibri.errors import InvalidArgumentError, ServerAddressError  # noqa: E402
from colibri.model import Model  # noqa: E402
from colibri.serve.app import create_app  # noqa: E402
from colibri.serve.connections import (  # noqa: E402
    BACKLOG,
    LISTEN_QUEUE,
    MAX_HEADER_BYTES,
    Limits,
    protocol_for,
)
from colibri.serve.guard import default_allowed_hosts  # noqa: E402

__all__ = [
    "INSTALL_HINT",
    "Limits",
    "check_limits",
    "check_port",
    "create_app",
    "listen_socket",
    "serve",
]

#: What to do about the usual reasons a socket cannot be bound.
_BIND_HINTS = {
    errno.EADDRINUSE: "another process listens there: stop it, or pick another --port "
    "(0 takes a free one)",
    errno.EACCES: "ports below 1024 need privileges: pick one above 1023",
    errno.EADDRNOTAVAIL: "that address is not one of this machine's: use 127.0.0.1 (this "
    "machine only) or 0.0.0.0 (every interface)",
}


def check_port(port: object) -> int:
    """``port`` as a TCP port number (0 = any free port), else an
    :class:`~colibri.InvalidArgumentError`."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise InvalidArgumentError(
            f"invalid value for 'port': {port!r}; a TCP port is 0..65535 (0 takes a free one)"
        )
    return port


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``(host, port)``, ready for uvicorn; what stops it is a
    :class:`~colibri.ServerAddressError` saying what to do (uvicorn's own binding would
    exit the process instead)."""
    check_port(port)
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:
        infos = socket.getaddrinfo(host, port, family, socket.SOCK_STREAM)
    except OSError as e:  # an unknown host name
        raise ServerAddressError(
            f"cannot listen on {host!r}: {e.strerror or e}; give an address such as 127.0.0.1"
        ) from None
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(infos[0][4])
    except OSError as e:
        sock.close()
        shown = f"[{host}]" if ":" in host else host
        hint = _BIND_HINTS.get(e.errno or 0, "pick another --host or --port")
        raise ServerAddressError(
            f"cannot listen on {shown}:{port}: {e.strerror or e}; {hint}"
        ) from None
    sock.set_inheritable(True)
    return sock


#: The fields of :class:`Limits` and the ``colibri serve`` flags that set them.
_LIMIT_FLAGS = {
    "request_header": "--timeout-request-header",
    "request_body": "--timeout-request-body",
    "keep_alive": "--timeout-keep-alive",
    "max_connections": "--max-connections",
}


def check_limits(limits: Limits) -> None:
    """An :class:`~colibri.InvalidArgumentError` naming the first field of ``limits`` out
    of range (timeouts > 0 and finite, ``max_connections`` ≥ 1)."""
    for name, flag in _LIMIT_FLAGS.items():
        value = getattr(limits, name)
        if name == "max_connections":
            bad = value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value < 1
            )
            want = "at least 1 (None: what the fd limit leaves)"
        else:
            bad = isinstance(value, bool) or not isinstance(value, (int, float))
            bad = bad or not 0 < value < 1e9
            want = "seconds, more than 0"
        if bad:
            raise InvalidArgumentError(f"invalid value for '{name}' ({flag}): {value!r}; {want}")


def serve(
    model: Model,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_name: str | None = None,
    sessions: int = 4,
    max_queue: int = 32,
    max_batch: int | None = None,
    allow_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] | None = None,
    limits: Limits | None = None,
    log_level: str = "warning",
    on_listen: Callable[[str], None] | None = None,
) -> None:
    """Serve ``model`` with uvicorn until SIGINT/SIGTERM (see :func:`create_app` for the
    options). ``port=0`` takes a free port; ``on_listen(url)`` is called with the base URL
    once the server accepts connections (the CLI prints it).

    ``allowed_hosts`` None answers loopback ``Host`` names only when ``host`` is a loopback
    address, and any ``Host`` otherwise. ``limits`` (:class:`Limits`) bounds how long a
    client may take to send a request and how many connections stay open (default:
    ``Limits()``, the cap from the fd limit)."""
    check_limits(limits := limits or Limits())
    if allowed_hosts is None:
        allowed_hosts = default_allowed_hosts(host)
    app = create_app(
        model,
        api_key=api_key,
        served_name=served_name,
        sessions=sessions,
        max_queue=max_queue,
        max_batch=max_batch,
        allow_origins=allow_origins,
        allowed_hosts=allowed_hosts,
    )
    protocol, max_connections = protocol_for(limits)
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        timeout_graceful_shutdown=5,
        http=protocol,
        timeout_keep_alive=limits.keep_alive,
        # Beyond the cap, requests on connections that cannot be closed get a 503; the
        # protocol keeps the rest at the cap by closing idle ones.
        limit_concurrency=max_connections + 1,
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
        backlog=BACKLOG,
    )
    state = app.state.server
    sock = listen_socket(host, port)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[Any] | None = None) -> None:
            await super().startup(sockets)
            # The kernel's queue of connections not yet accepted, longer than the burst the
            # event loop accepts at a time (BACKLOG, which asyncio passed to listen() too):
            # in a flood of connects, a client's SYN waits there instead of being dropped.
            with contextlib.suppress(OSError):
                sock.listen(LISTEN_QUEUE)
            if self.started and on_listen is not None:  # accepting connections now
                on_listen(f"http://{shown}:{bound_port}")

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            state.stop_soon()  # running generations end now, not at the graceful timeout

    _Server(config).run(sockets=[sock])
