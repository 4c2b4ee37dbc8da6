"""The ASGI application: OpenAI's ``/v1`` endpoints, ``/health``, ``/metrics``, ``/stats``
and the dashboard at ``/``, on Starlette, with SSE streaming through sse-starlette."""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from importlib import resources
from typing import Any

from sse_starlette.sse import EventSourceResponse
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import ClientDisconnect, Request
from starlette.responses import HTMLResponse, JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive

from colibri import _openai as protocol
from colibri._openai import ApiError
from colibri.errors import ColibriError
from colibri.model import Model
from colibri.serve import tokens
from colibri.serve.guard import Guard, error_response
from colibri.serve.metrics import ServerStats
from colibri.serve.openapi import openapi_schema
from colibri.serve.scheduler import Delta, Job, QueueFull, Scheduler, ShuttingDown

#: The largest request body accepted (a long prompt is a few MB at most).
MAX_BODY_BYTES = 32 * 2**20
#: The most JSON values (numbers, strings, lists, objects) a request body may hold. Parsing
#: makes a Python object of ~60-90 bytes for each, so 32 MiB of ``[],[],...`` took 923 MB
#: above idle RSS (and 6M short prompt strings 1.15 GB) before any field was checked; the
#: largest field a request needs (a token-id prompt, a vocabulary-sized ``logit_bias``) is
#: far smaller.
MAX_JSON_VALUES = 2**21
_JSON_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*"')


def _json_values_over_limit(body: bytes) -> int | None:
    """An upper bound on the JSON values in ``body`` (object keys included) when it is over
    :data:`MAX_JSON_VALUES`, else None. Every value but the first follows a ``,``, a ``[``
    or a ``:``, so their count bounds it; counted in the raw bytes first (fast, but those
    inside strings count too), and only if that is over, less the ones inside strings.
    Bounded in time and memory: the strings are visited one at a time, and a body of more
    strings than the limit is over it whatever they hold."""

    def count(b: bytes) -> int:
        return b.count(b",") + b.count(b"[") + b.count(b":")

    rough = count(body) + 1
    if rough <= MAX_JSON_VALUES:
        return None
    strings = (body.count(b'"') - body.count(b'\\"')) // 2
    if strings > MAX_JSON_VALUES:
        return strings
    inside = sum(count(m.group()) for m in _JSON_STRING.finditer(body))
    return rough - inside if rough - inside > MAX_JSON_VALUES else None


async def _read_json(request: Request) -> Any:
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
        raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes", code="too_large")
    parts: list[bytes] = []
    size = 0
    try:
        async for part in request.stream():
            parts.append(part)
            size += len(part)
            if size > MAX_BODY_BYTES:
                raise ApiError(413, f"the request body is over {MAX_BODY_BYTES} bytes")
    except ClientDisconnect:  # gone, or closed by the body's deadline: nobody reads this
        raise ApiError(
            400,
            "the connection closed before the request body was complete",
            code="incomplete_body",
        ) from None
    body = b"".join(parts)
    del parts
    values = _json_values_over_limit(body)
    if values is not None:
        raise ApiError(
            413,
            f"the request body holds about {values} JSON values, more than the "
            f"{MAX_JSON_VALUES} a request may (each one is a Python object once parsed)",
            code="too_large",
        )
    try:
        return json.loads(body)
    except (ValueError, UnicodeDecodeError) as e:
        raise ApiError(400, f"the request body is not valid JSON: {e}", code="invalid_json") from e
    except RecursionError:  # nested deeper than the parser goes
        raise ApiError(
            400, "the request body is nested too deeply to parse", code="invalid_json"
        ) from None


async def _disconnected(receive: Receive) -> None:
    """Return when the client has gone (after the body, the next message says so)."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


def _json_line(obj: object) -> str:
    return json.dumps(obj, ensure_ascii=False, separators=(",", ":"))


class Server:
    """The state behind the routes: the model, its scheduler, the stats."""

    def __init__(
        self,
        model: Model,
        *,
        served_name: str,
        sessions: int,
        max_queue: int,
        max_batch: int | None = None,
    ) -> None:
        self.model = model
        self.name = served_name
        self.stats = ServerStats(model)
        self.scheduler = Scheduler(
            model,
            sessions=sessions,
            max_queue=max_queue,
            max_batch=max_batch,
            on_finish=self._finished,
        )
        self.stats.scheduler = self.scheduler
        self.created = int(time.time())
        self.loop: asyncio.AbstractEventLoop | None = None
        self._openapi: dict[str, Any] | None = None

    def stop_soon(self) -> None:
        """From any thread or a signal handler: stop taking requests and cancel the running
        generations (each within one forward), so a shutdown does not wait for them."""
        if self.loop is not None:
            with contextlib.suppress(RuntimeError):  # the loop has already closed
                self.loop.call_soon_threadsafe(self.scheduler.stop)

    def _finished(self, job: Job) -> None:
        if job.outcome is not None:
            o = job.outcome
            self.stats.generation(job.tag, o.result, o.expert_stats, o.seconds, o.queued_seconds)

    # ----------------------------------------------------------------------------- routes
    async def dashboard(self, request: Request) -> Response:
        page = resources.files("colibri.serve").joinpath("static/dashboard.html").read_text("utf-8")
        return HTMLResponse(page, headers={"Cache-Control": "no-store"})

    async def health(self, request: Request) -> Response:
        return JSONResponse(
            {
                "status": "ok",
                "model": self.name,
                "queue_depth": self.scheduler.waiting,
                "running": self.scheduler.running,
            }
        )

    async def metrics(self, request: Request) -> Response:
        body = await asyncio.to_thread(self.stats.prometheus)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    async def stats_json(self, request: Request) -> Response:
        snap = await asyncio.to_thread(self.stats.snapshot)
        snap["served_model"] = self.name
        return JSONResponse(snap, headers={"Cache-Control": "no-store"})

    def _model_card(self) -> dict[str, Any]:
        return {
            "id": self.name,
            "object": "model",
            "created": self.created,
            "owned_by": "colibri",
            "max_context": self.model.max_context,
            "has_mtp": self.model.has_mtp,
        }

    async def openapi(self, request: Request) -> Response:
        if self._openapi is None:
            self._openapi = openapi_schema(self.model, self.name)
        return JSONResponse(self._openapi)

    async def models(self, request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [self._model_card()]})

    async def model_card(self, request: Request) -> Response:
        if request.path_params["name"] != self.name:
            raise ApiError(
                404,
                f"the model '{request.path_params['name']}' does not exist; this server "
                f"serves '{self.name}'",
                param="model",
                code="model_not_found",
            )
        return JSONResponse(self._model_card())

    async def tokenize(self, request: Request) -> Response:
        body = await _read_json(request)
        return JSONResponse(await asyncio.to_thread(tokens.tokenize, body, self.model))

    async def detokenize(self, request: Request) -> Response:
        body = await _read_json(request)
        return JSONResponse(await asyncio.to_thread(tokens.detokenize, body, self.model))

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, "chat")

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, "completion")

    async def _complete(self, request: Request, kind: protocol.Kind) -> Response:
        body = await _read_json(request)
        req = await asyncio.to_thread(self._prepare, body, kind)
        jobs: list[Job] = []
        try:  # the choices decode together in the batch
            jobs = self.scheduler.submit_all(
                [(req.choice_prompt(i), req.choice_generate(i)) for i in range(req.choices)],
                request.url.path,
            )
        except QueueFull as e:
            raise ApiError(
                429,
                f"the server is busy: {e.waiting} requests are queued (--max-queue "
                f"{self.scheduler.max_queue}); retry after {e.retry_after} s",
                code="queue_full",
                headers={"Retry-After": str(e.retry_after)},
            ) from e
        except ShuttingDown as e:
            raise ApiError(503, str(e), code="shutting_down", headers={"Retry-After": "5"}) from e
        warning = protocol.ignored_warning(req)
        extra_headers = {"Warning": warning} if warning else {}
        if req.stream:
            return EventSourceResponse(
                self._events(req, jobs),
                ping=15,
                headers={"Cache-Control": "no-store", **extra_headers},
            )
        outcomes = await self._wait(request, jobs)
        if outcomes is None and self.scheduler.closing:  # cancelled by the shutdown
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        if outcomes is None:  # the client went away: nobody reads an answer
            return Response(status_code=499)
        if any(o.result.finish_reason == "cancelled" for o in outcomes):  # the shutdown
            raise ApiError(503, "the server is shutting down", code="shutting_down")
        return JSONResponse(
            protocol.response(req, [o.result for o in outcomes], self.model),
            headers=extra_headers,
        )

    def _prepare(self, body: object, kind: protocol.Kind) -> protocol.Request:
        """Check the request and tokenise its prompt (on a worker thread: a long prompt
        takes a while), with the checks ``Session.generate`` makes (ranges, the context
        limit) done now, so that a bad request is a 400 before anything is queued."""
        req = protocol.parse(body, kind, self.model, self.name)
        try:
            for prompt in req.prompts:
                self.model.generate(prompt, stream=True, **req.generate).close()
        except ColibriError as e:
            raise protocol.from_colibri_error(e, req.kind, body) from e
        return req

    async def _wait(self, request: Request, jobs: list[Job]) -> list[Any] | None:
        """The outcomes of ``jobs``, or None if the client disconnected first (the jobs are
        then cancelled: within one forward, or before they leave the queue)."""
        work = asyncio.ensure_future(asyncio.gather(*(job.wait() for job in jobs)))
        gone = asyncio.ensure_future(_disconnected(request.receive))
        try:
            await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                for job in jobs:
                    job.cancel()
        if not work.done() or work.cancelled():
            with contextlib.suppress(Exception):
                await work
            return None
        try:
            outcomes = work.result()
        except ColibriError as e:
            raise ApiError(500, f"{type(e).__name__}: {e}", code="engine_error") from e
        return None if any(o is None for o in outcomes) else outcomes

    async def _events(self, req: protocol.Request, jobs: list[Job]) -> AsyncIterator[str]:
        """The SSE ``data:`` lines of a streamed answer, every choice's chunks as they come;
        the jobs are cancelled if the client disconnects (sse-starlette cancels this
        generator)."""
        lines: asyncio.Queue[tuple[int, Delta | BaseException | None]] = asyncio.Queue()

        async def pump(i: int, job: Job) -> None:
            try:
                async for delta in job.chunks():
                    await lines.put((i, delta))
            except BaseException as e:  # reported in the stream
                await lines.put((i, e))
                return
            await lines.put((i, None))

        pumps = [asyncio.ensure_future(pump(i, job)) for i, job in enumerate(jobs)]
        splitters = [req.choice_stream() for _ in jobs]
        model = self.model
        try:
            for i in range(len(jobs)):
                for opening in protocol.opening_chunks(req, i):
                    yield _json_line(opening)
            running = len(jobs)
            while running:
                i, item = await lines.get()
                if item is None:
                    running -= 1
                    for part in protocol.text_chunks(req, splitters[i], None, i, (), model):
                        yield _json_line(part)
                elif isinstance(item, ColibriError):
                    err = ApiError(500, f"{type(item).__name__}: {item}", code="engine_error")
                    yield _json_line(err.body())
                    return
                elif isinstance(item, BaseException):
                    raise item
                else:
                    text, rows = item
                    for part in protocol.text_chunks(req, splitters[i], text, i, rows, model):
                        yield _json_line(part)
            outcomes = [job.outcome for job in jobs]
            if any(o is None or o.result.finish_reason == "cancelled" for o in outcomes):
                # Cancelled by the server's shutdown (a client that left reads nothing).
                yield _json_line(
                    ApiError(503, "the server is shutting down", code="shutting_down").body()
                )
                return
            results = [o.result for o in outcomes if o is not None]
            for closing in protocol.closing_chunks(req, results, model, splitters):
                yield _json_line(closing)
            yield "[DONE]"
        finally:
            for p in pumps:
                p.cancel()
            for job in jobs:
                if job.outcome is None:
                    job.cancel()


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return error_response(exc)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    message = {404: "no such endpoint", 405: "method not allowed"}.get(
        exc.status_code, str(exc.detail)
    )
    err = ApiError(exc.status_code, f"{message}: {request.method} {request.url.path}")
    return error_response(err)


async def _internal_error(request: Request, exc: Exception) -> Response:
    return error_response(ApiError(500, f"internal error: {type(exc).__name__}: {exc}"))


def default_served_name(model: Model) -> str:
    """The model id the API uses unless told otherwise: ``owner/name`` for a model from
    the Hugging Face cache, else the model directory's name (``tiny`` for the embedded
    one)."""
    path = model.path
    repo = path.parents[1].name if len(path.parents) > 1 else ""
    if path.parent.name == "snapshots" and repo.startswith("models--"):
        return repo.removeprefix("models--").replace("--", "/")
    return path.name


def create_app(
    model: Model,
    *,
    api_key: str | None = None,
    served_name: str | None = None,
    sessions: int = 4,
    max_queue: int = 32,
    max_batch: int | None = None,
    allow_origins: Sequence[str] = (),
    allowed_hosts: Sequence[str] = (),
) -> Starlette:
    """The server's ASGI application for ``model``.

    Args:
        model: the loaded model; concurrent requests decode on it together (a continuous
            batch whose forwards they share).
        api_key: when set, every endpoint but ``/health`` needs ``Authorization: Bearer
            <api_key>`` (or HTTP Basic with it as the password, for the dashboard).
        served_name: the model id clients send and ``/v1/models`` lists (default:
            :func:`default_served_name`).
        sessions: conversations whose KV cache is kept between requests.
        max_queue: requests that may wait beyond the running batch; more get a 429.
        max_batch: requests decoded together, their forwards shared (each on its own
            session, so at most ``sessions``); default ``sessions``.
        allow_origins: origins allowed to call the API from a browser (CORS); none by
            default. A request from any other web page (an ``Origin`` header that is
            neither one of these nor the server's own) is a 403 ``origin_not_allowed``.
        allowed_hosts: the ``Host`` names answered beyond loopback ones (``localhost``,
            ``*.localhost``, 127.0.0.0/8, ::1): names, ``*.domain`` suffixes, addresses, or
            ``"*"`` for any. Another ``Host`` is a 403 ``host_not_allowed`` (a guard
            against DNS rebinding). :func:`colibri.serve.serve` passes ``["*"]`` when it
            listens on a non-loopback address and is given none.
    """
    name = served_name or default_served_name(model)
    server = Server(
        model, served_name=name, sessions=sessions, max_queue=max_queue, max_batch=max_batch
    )

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        server.loop = asyncio.get_running_loop()
        yield
        await server.scheduler.close()

    routes = [
        Route("/", server.dashboard, methods=["GET"]),
        Route("/health", server.health, methods=["GET"]),
        Route("/metrics", server.metrics, methods=["GET"]),
        Route("/stats", server.stats_json, methods=["GET"]),
        Route("/openapi.json", server.openapi, methods=["GET"]),
        Route("/v1/models", server.models, methods=["GET"]),
        Route("/v1/models/{name:path}", server.model_card, methods=["GET"]),
        Route("/v1/completions", server.completions, methods=["POST"]),
        Route("/v1/chat/completions", server.chat, methods=["POST"]),
        Route("/tokenize", server.tokenize, methods=["POST"]),
        Route("/detokenize", server.detokenize, methods=["POST"]),
    ]
    middleware = [
        Middleware(
            Guard,
            api_key=api_key,
            stats=server.stats,
            allowed_hosts=allowed_hosts,
            allow_origins=allow_origins,
        )
    ]
    if allow_origins:
        middleware.insert(
            0,
            Middleware(
                CORSMiddleware,
                allow_origins=list(allow_origins),
                allow_methods=["GET", "POST"],
                allow_headers=["Authorization", "Content-Type"],
            ),
        )
    handlers: dict[Any, Callable[[Request, Exception], Awaitable[Response]]] = {
        ApiError: _api_error,
        HTTPException: _http_error,
        Exception: _internal_error,
    }
    app = Starlette(
        routes=routes,
        middleware=middleware,
        exception_handlers=handlers,
        lifespan=lifespan,
    )
    app.state.server = server
    return app
