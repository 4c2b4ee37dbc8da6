"""Connection limits for uvicorn: how long a client may take to send a request, and how many
sockets the server keeps open, so that idle or slow sockets cannot use up its file
descriptors (docs/server.md, "Connection limits").

uvicorn closes a kept-alive connection ``timeout_keep_alive`` seconds after its last
response, but nothing closes one that connects and never finishes a request: at an fd limit
of 1,024, about a thousand such sockets stopped the server from accepting ``/health``. The
:class:`Protocol` here (uvicorn's h11 protocol, subclassed) adds

- a deadline for the request head (``request_header`` seconds from the connection, or from
  the previous response), after which the socket is closed;
- a deadline for the request body (``request_body`` seconds from its head), after which the
  client gets a 408 and the socket is closed;
- a cap on open connections (``max_connections``): a connection beyond it closes the one
  that has waited longest without a complete request, so a new client is always served
  while any socket is merely idle. Only connections whose request is being answered are
  never closed this way; beyond the cap those get uvicorn's 503 (``limit_concurrency``).
"""

from __future__ import annotations

import asyncio
import json
import os
import resource
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import h11
from uvicorn.protocols.http.h11_impl import H11Protocol

#: How many sockets one turn of the event loop accepts at most (asyncio's backlog): kept
#: small, so a burst cannot take the descriptors the process needs before the cap closes
#: the surplus.
BACKLOG = 64

#: The kernel's queue of connections not yet accepted (listen()'s backlog), set after the
#: event loop's own: connections wait there, costing the process no descriptor.
LISTEN_QUEUE = 4096

#: Descriptors left to the process beyond the connections and the bursts of accepts that
#: come before the cap closes their surplus (files the model opens, pipes, the log).
FD_RESERVE = 64

#: The largest request head (line and headers) h11 buffers; a longer one is a 400.
MAX_HEADER_BYTES = 16 * 1024


@dataclass(frozen=True)
class Limits:
    """The connection limits of one server (the ``serve()`` keywords of the same names)."""

    #: Seconds a client may take to send a request's head, from connecting or from the
    #: previous response.
    request_header: float = 10.0
    #: Seconds a client may take to send a request's body, from its head.
    request_body: float = 60.0
    #: Seconds an idle kept-alive connection stays open after a response.
    keep_alive: float = 5.0
    #: Open connections at most (None: what the fd limit leaves, :func:`default_max_connections`).
    max_connections: int | None = None


def default_max_connections() -> int:
    """What the soft fd limit leaves for connections: the limit less the descriptors open now,
    four bursts of :data:`BACKLOG` accepts (the event loop accepts a burst each turn, and
    a closed socket's descriptor is released a turn or two later; 3 bursts were measured
    in flight at once) and :data:`FD_RESERVE`;
    at least 8, at most 4,096."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        used = len(os.listdir("/proc/self/fd"))
    except OSError:
        used = 64
    if soft == resource.RLIM_INFINITY:
        soft = 1 << 20
    return max(8, min(4096, soft - used - 4 * BACKLOG - FD_RESERVE))


class _Waiting:
    """The connections that have no complete request in, oldest first (one per server)."""

    def __init__(self, max_connections: int) -> None:
        self.max_connections = max_connections
        self.order: OrderedDict[Protocol, None] = OrderedDict()
        self.closed_for_room = 0
        self.timed_out = 0

    def make_room(self, connections: set[Any], newcomer: Protocol) -> None:
        while len(connections) > self.max_connections and self.order:
            oldest = next(iter(self.order))
            if oldest is newcomer:
                if len(self.order) == 1:
                    return
                self.order.move_to_end(oldest)
                continue
            self.closed_for_room += 1
            oldest.drop()


class Protocol(H11Protocol):
    """uvicorn's h11 protocol with the request deadlines and the connection cap of
    :class:`Limits` (made for a server by :func:`protocol_for`)."""

    limits: Limits = Limits()
    waiting: _Waiting = _Waiting(4096)

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._deadline: asyncio.TimerHandle | None = None
        self._seen: object = None  # the cycle whose start was handled
        self._receiving = False  # a request's head is in, its body not yet

    # ------------------------------------------------------------------------- states
    def _arm(self, seconds: float, then: Any) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
        self._deadline = self.loop.call_later(seconds, then)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _wait_for_head(self) -> None:
        self._receiving = False
        self.waiting.order[self] = None
        self.waiting.order.move_to_end(self)
        self._arm(self.limits.request_header, self._head_late)

    def _follow(self) -> None:
        """After h11 parsed what came in: a new request's head starts the body deadline, a
        complete request ends both (its answer is the application's)."""
        cycle = self.cycle
        if cycle is not None and cycle is not self._seen and not cycle.response_complete:
            self._seen = cycle
            self._receiving = True
            self.waiting.order[self] = None
            self.waiting.order.move_to_end(self)
            self._arm(self.limits.request_body, self._body_late)
        if self._receiving and cycle is not None and not cycle.more_body:
            self._receiving = False
            self.waiting.order.pop(self, None)
            self._disarm()

    def drop(self) -> None:
        """Close the connection now (it has no request being answered). It stops counting
        at once: the transport releases it a turn later, and until then it must not make
        the cap close another, nor uvicorn's concurrency limit refuse a request."""
        self.waiting.order.pop(self, None)
        self.connections.discard(self)
        self._disarm()
        if not self.transport.is_closing():
            if self.cycle is not None and not self.cycle.response_complete:
                self.cycle.disconnected = True
                self.cycle.message_event.set()
            self.transport.close()

    def _head_late(self) -> None:
        self._deadline = None
        self.waiting.timed_out += 1
        self.drop()

    def _body_late(self) -> None:
        """A 408 (as the application would answer it) if nothing was sent yet, then close."""
        self._deadline = None
        self.waiting.timed_out += 1
        cycle = self.cycle
        if cycle is not None and not cycle.response_started and not self.transport.is_closing():
            body = json.dumps(
                {
                    "error": {
                        "message": f"the request body did not arrive within "
                        f"{self.limits.request_body:g} s",
                        "type": "invalid_request_error",
                        "param": None,
                        "code": "request_timeout",
                    }
                }
            ).encode()
            headers = [("content-type", "application/json"), ("connection", "close")]
            try:
                out = self.conn.send(h11.Response(status_code=408, headers=headers))
                out = (out or b"") + (self.conn.send(h11.Data(data=body)) or b"")
                out += self.conn.send(h11.EndOfMessage()) or b""
                self.transport.write(out)
            except h11.LocalProtocolError:  # the state does not allow a response: just close
                pass
        self.drop()  # the application's answer, if it comes, goes nowhere

    # ----------------------------------------------------------- uvicorn's callbacks
    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._wait_for_head()
        self.waiting.make_room(self.connections, self)

    def connection_lost(self, exc: Exception | None) -> None:
        self.waiting.order.pop(self, None)
        self._disarm()
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._follow()

    def on_response_complete(self) -> None:
        if not self.transport.is_closing():
            self._wait_for_head()  # the next request's head (keep-alive closes it sooner)
        super().on_response_complete()
        self._follow()  # a pipelined request may have started


def protocol_for(limits: Limits) -> tuple[type[Protocol], int]:
    """A protocol class with ``limits`` (its own set of waiting connections) and the
    connection cap it enforces."""
    cap = limits.max_connections or default_max_connections()
    return type(
        "Protocol", (Protocol,), {"limits": limits, "waiting": _Waiting(cap), "__doc__": None}
    ), cap
