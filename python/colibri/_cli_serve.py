"""``colibri serve``'s command line: its flags and what runs them (docs/server.md)."""

from __future__ import annotations

import argparse
import os
import sys

from colibri import _core
from colibri._cli_options import _add_model_options, _load


def _cmd_serve(args: argparse.Namespace) -> int:
    from colibri.errors import InvalidArgumentError

    if args.model_arg is not None:
        if args.model is not None and args.model != args.model_arg:
            raise InvalidArgumentError(
                f"two models given: {args.model_arg!r} and -m {args.model!r}; give one"
            )
        args.model = args.model_arg
    if args.max_queue < 0:
        raise InvalidArgumentError(f"invalid value for '--max-queue': {args.max_queue}; >= 0")
    if args.sessions < 1:
        raise InvalidArgumentError(f"invalid value for '--sessions': {args.sessions}; >= 1")
    if args.max_batch is not None and not 1 <= args.max_batch <= args.sessions:
        raise InvalidArgumentError(
            f"invalid value for '--max-batch': {args.max_batch}; each running request needs "
            f"its own session, so 1..{args.sessions} (--sessions)"
        )
    try:
        from colibri.serve import Limits, check_limits, check_port, listen_socket, serve
    except ImportError as e:
        hint = 'pip install "colibri[serve]"'
        print(f"error: {e}" if hint in str(e) else f"error: {e}; {hint}", file=sys.stderr)
        return 1
    check_port(args.port)
    limits = Limits(
        request_header=args.timeout_request_header,
        request_body=args.timeout_request_body,
        keep_alive=args.timeout_keep_alive,
        max_connections=args.max_connections,
    )
    check_limits(limits)
    # Bind before the model loads (minutes for a large one), so a taken port fails at once.
    listen_socket(args.host, args.port).close()
    api_key = args.api_key if args.api_key is not None else os.environ.get("COLIBRI_API_KEY")
    m = _load(args)
    from colibri.serve.app import default_served_name

    name = args.served_model_name or default_served_name(m)
    auth = "API key required" if api_key else "no API key"

    def listening(url: str) -> None:
        print(
            f"colibri serve: model {name!r} at {url}/v1 ({auth}); dashboard at {url}/",
            flush=True,
        )

    serve(
        m,
        host=args.host,
        port=args.port,
        api_key=api_key or None,
        served_name=args.served_model_name,
        sessions=args.sessions,
        max_queue=args.max_queue,
        max_batch=args.max_batch,
        allow_origins=args.allow_origin or (),
        allowed_hosts=args.allow_host,
        limits=limits,
        log_level=args.log_level,
        on_listen=listening,
    )
    return 0


def _add_serve(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "serve",
        help="an OpenAI-compatible HTTP server with a live dashboard",
        description="Serve the model over HTTP with OpenAI's API (/v1/models, "
        "/v1/completions, /v1/chat/completions, JSON and SSE), plus /health, /metrics "
        "(Prometheus) and a dashboard at /. Needs the serve extra: "
        'pip install "colibri[serve]". See docs/server.md.',
    )
    p.add_argument("model_arg", nargs="?", metavar="MODEL", help="the model (as -m)")
    _add_model_options(p)
    g = p.add_argument_group("server")
    g.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    g.add_argument("--port", type=int, default=8000, help="port, 0 for a free one (default 8000)")
    g.add_argument(
        "--api-key",
        default=None,
        help="require 'Authorization: Bearer KEY' on every endpoint but /health "
        "(default: $COLIBRI_API_KEY, else none)",
    )
    g.add_argument(
        "--max-queue",
        type=int,
        default=32,
        help="requests that may wait beyond the running batch; more get 429 (default 32)",
    )
    g.add_argument(
        "--max-batch",
        type=int,
        default=None,
        help="requests decoded together, their forwards shared (each needs its own "
        "session; default: --sessions)",
    )
    g.add_argument(
        "--sessions",
        type=int,
        default=4,
        help="conversations whose KV cache is kept for reuse (default 4)",
    )
    g.add_argument(
        "--served-model-name",
        default=None,
        help="the model id of the API (default: the model directory's name)",
    )
    g.add_argument(
        "--allow-origin",
        action="append",
        default=None,
        metavar="ORIGIN",
        help="let browser pages from ORIGIN call the API (CORS; repeatable; default none)",
    )
    g.add_argument(
        "--allow-host",
        action="append",
        default=None,
        metavar="HOST",
        help="answer requests whose Host header is HOST (a name, *.domain, an address or "
        "*), repeatable; default: loopback names only when --host is loopback, else any",
    )
    g.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="open connections at most; beyond, the longest-idle one is closed (default: "
        "what the fd limit leaves)",
    )
    g.add_argument(
        "--timeout-request-header",
        type=float,
        default=10.0,
        metavar="S",
        help="seconds a client may take to send a request's head (default 10)",
    )
    g.add_argument(
        "--timeout-request-body",
        type=float,
        default=60.0,
        metavar="S",
        help="seconds a client may take to send a request's body, else 408 (default 60)",
    )
    g.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds an idle kept-alive connection stays open (default 5)",
    )
    g.add_argument(
        "--log-level",
        default="warning",
        choices=["critical", "error", "warning", "info", "debug"],
        help="uvicorn's log level; info and debug log each request (default warning)",
    )
    g.add_argument(
        "--draft",
        default="auto",
        choices=_core.choices()["draft"],
        help="the default speculative drafter (default auto: MTP when the model has it)",
    )
    g.add_argument(
        "--draft-depth", default="auto", help="default draft depth, 1-8 or auto (default auto)"
    )
    p.set_defaults(func=_cmd_serve)
