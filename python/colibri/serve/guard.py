"""The server's request guard (ASGI middleware, docs/server.md "Security"): which ``Host`` it
answers to, which web pages may call it, the API key, and the request counter.

A server on ``127.0.0.1`` is reachable from the web pages its user opens: a page can send
it "simple" requests (a form, or ``fetch`` with a ``text/plain`` body, no preflight), and a
page on a domain that an attacker re-points at 127.0.0.1 (DNS rebinding) can even read the
answers. So, as llama-server's and the MCP SDK's guards do, by default

- the ``Host`` header must name a loopback host (``localhost``, ``*.localhost``,
  ``127.0.0.0/8``, ``::1``, any port) or one the server was told (``allowed_hosts``); a
  server listening on another address answers any ``Host`` unless told a list;
- a request from a web page (one with an ``Origin`` header) must come from the server's own
  origin (its dashboard) or one of ``allow_origins``;
- without an API key, a POST whose body a page could send without a preflight
  (``text/plain``, a form) is refused: the API takes JSON.
"""

from __future__ import annotations

import base64
import binascii
import hmac
import ipaddress
from collections.abc import Sequence
from urllib.parse import urlsplit

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from colibri._openai import ApiError
from colibri.serve.metrics import ServerStats

#: Paths answered without the API key.
PUBLIC_PATHS = frozenset({"/health"})

#: Paths a browser opens (the dashboard and its data): a missing key asks for HTTP Basic
#: credentials (any user name, the key as password), so a person can log in.
BROWSER_PATHS = frozenset({"/", "/stats"})

#: Endpoint labels of the request counter (anything else is "other").
ENDPOINTS = frozenset(
    {
        "/",
        "/health",
        "/metrics",
        "/stats",
        "/openapi.json",
        "/v1/models",
        "/v1/completions",
        "/v1/chat/completions",
        "/tokenize",
        "/detokenize",
    }
)

#: The API's own paths: what the dashboard's request count counts (not its own polling of
#: ``/stats``, nor ``/health`` or ``/metrics`` scrapes).
API_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"})

#: Body types a web page can POST to another origin without a CORS preflight.
SIMPLE_BODY_TYPES = frozenset(
    {"text/plain", "application/x-www-form-urlencoded", "multipart/form-data"}
)


def is_api(path: str) -> bool:
    """Whether ``path`` is one of the API's (what the dashboard's request count counts)."""
    return path in API_PATHS or path.startswith("/v1/models")


def error_response(e: ApiError) -> JSONResponse:
    """The JSON response of ``e``."""
    return JSONResponse(e.body(), status_code=e.status, headers=e.headers)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (a name or an address, IPv6 with or without brackets) is this
    machine's loopback: ``localhost``, a name under ``.localhost`` (RFC 6761), 127.0.0.0/8
    or ::1."""
    name = host.strip("[]").rstrip(".").lower()
    if name == "localhost" or name.endswith(".localhost"):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def default_allowed_hosts(bind_host: str) -> tuple[str, ...]:
    """The ``Host`` names a server listening on ``bind_host`` answers beyond loopback ones
    when it is told none: none on a loopback address, any (``"*"``) on another (its clients'
    names for it are not known)."""
    return () if is_loopback(bind_host) else ("*",)


def _host_name(value: str) -> str:
    """The host of a ``Host`` header (``name``, ``name:port``, ``[v6]:port``), lowercased."""
    value = value.strip().lower()
    if value.startswith("["):
        return value[1 : value.find("]")] if "]" in value else value
    if value.count(":") == 1:
        value = value.partition(":")[0]
    return value.rstrip(".")


def _matches(name: str, pattern: str) -> bool:
    pattern = pattern.strip().strip("[]").rstrip(".").lower()
    if pattern == "*":
        return True
    if pattern.startswith("*."):
        return name.endswith(pattern[1:])
    return name == pattern


def _same_origin(origin: str, host: str) -> bool:
    """Whether the page origin ``origin`` is this server as ``host`` (a Host header) names it."""
    parts = urlsplit(origin)
    if parts.scheme not in ("http", "https"):
        return False
    default = 443 if parts.scheme == "https" else 80
    here = urlsplit(f"//{host.strip().lower()}")
    try:
        return (parts.hostname, parts.port or default) == (here.hostname, here.port or default)
    except ValueError:  # a port that is not a number
        return False


class Guard:
    """ASGI middleware: the ``Host`` allow-list, the ``Origin`` check and the refusal of
    simple cross-site bodies (the module's docstring), then the API key check
    (``Authorization: Bearer KEY``, or HTTP Basic with the key as password) on every path
    but :data:`PUBLIC_PATHS`; and the request counter of the metrics."""

    def __init__(
        self,
        app: ASGIApp,
        *,
        api_key: str | None,
        stats: ServerStats,
        allowed_hosts: Sequence[str] = (),
        allow_origins: Sequence[str] = (),
    ) -> None:
        self.app = app
        self.key = None if api_key is None else api_key.encode()
        self.stats = stats
        self.allowed_hosts = tuple(allowed_hosts)
        self.allow_origins = frozenset(o.rstrip("/").lower() for o in allow_origins)

    # ----------------------------------------------------------------------- checks
    def _host_error(self, host: str | None) -> ApiError | None:
        if host is None:  # HTTP/1.0 without one: not a browser
            return None
        name = _host_name(host)
        if is_loopback(name) or any(_matches(name, p) for p in self.allowed_hosts):
            return None
        return ApiError(
            403,
            f"this server does not answer to the host {name!r} (the Host header): it "
            "answers to localhost names and loopback addresses, which guards it against "
            "DNS rebinding; start it with --allow-host "
            f"{name} (or '*') if that name is meant to reach it",
            code="host_not_allowed",
        )

    def _origin_error(self, origin: str, host: str | None) -> ApiError | None:
        origin = origin.strip().rstrip("/").lower()
        if "*" in self.allow_origins or origin in self.allow_origins:
            return None
        if host is not None and _same_origin(origin, host):  # the dashboard, from here
            return None
        return ApiError(
            403,
            f"requests from the web page origin {origin!r} are refused (a page in a browser "
            "could otherwise use this server); start it with --allow-origin "
            f"{origin} to let that page call the API",
            code="origin_not_allowed",
        )

    def _refusal(self, scope: Scope) -> ApiError | None:
        headers = {k: v for k, v in scope.get("headers", [])}
        host = headers.get(b"host")
        host_text = None if host is None else host.decode("latin-1")
        err = self._host_error(host_text)
        if err is None and b"origin" in headers:
            err = self._origin_error(headers[b"origin"].decode("latin-1"), host_text)
        if err is None and self.key is None and scope.get("method") == "POST":
            media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
            if media.decode("latin-1") in SIMPLE_BODY_TYPES:
                err = ApiError(
                    415,
                    f"a request body of type {media.decode('latin-1')!r} is refused: the API "
                    "takes JSON, send 'Content-Type: application/json' (without an API key, "
                    "text/plain and form bodies are refused, as a web page in a browser can "
                    "send them to this server)",
                    code="unsupported_media_type",
                )
        return err

    def _authorized(self, scope: Scope) -> bool:
        if self.key is None:
            return True
        header = b""
        for k, v in scope.get("headers", []):
            if k == b"authorization":
                header = v
        scheme, _, value = header.partition(b" ")
        value = value.strip()
        if scheme.lower() == b"bearer":
            return hmac.compare_digest(value, self.key)
        if scheme.lower() == b"basic":
            try:
                _, _, password = base64.b64decode(value, validate=True).partition(b":")
            except (binascii.Error, ValueError):
                return False
            return hmac.compare_digest(password, self.key)
        return False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope.get("path", "")
        endpoint = path if path in ENDPOINTS else "other"
        status = 500

        async def counting_send(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            refused = self._refusal(scope)
            if refused is not None:
                await error_response(refused)(scope, receive, counting_send)
                return
            guarded = path not in PUBLIC_PATHS and scope.get("method") != "OPTIONS"
            if guarded and not self._authorized(scope):
                challenge = (
                    'Basic realm="colibri", charset="UTF-8"'
                    if path in BROWSER_PATHS
                    else 'Bearer realm="colibri"'
                )
                err = ApiError(
                    401,
                    "a valid API key is required: send 'Authorization: Bearer <key>'",
                    code="invalid_api_key",
                    headers={"WWW-Authenticate": challenge},
                )
                await error_response(err)(scope, receive, counting_send)
                return
            await self.app(scope, receive, counting_send)
        finally:
            self.stats.request(endpoint, status, api=is_api(path))
