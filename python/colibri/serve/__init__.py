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

from collections.abc import Callable, Sequence  # noqa: E402
from typing import Any  # noqa: E402

from colibri.model import Model  # noqa: E402
from colibri.serve.app import create_app  # noqa: E402

__all__ = ["INSTALL_HINT", "create_app", "serve"]


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
    log_level: str = "warning",
    on_listen: Callable[[str], None] | None = None,
) -> None:
    """Serve ``model`` with uvicorn until SIGINT/SIGTERM (see :func:`create_app` for the
    options). ``port=0`` takes a free port; ``on_listen(url)`` is called with the base URL
    once the server accepts connections (the CLI prints it)."""
    app = create_app(
        model,
        api_key=api_key,
        served_name=served_name,
        sessions=sessions,
        max_queue=max_queue,
        max_batch=max_batch,
        allow_origins=allow_origins,
    )
    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        access_log=log_level in ("debug", "info"),
        timeout_graceful_shutdown=5,
    )
    state = app.state.server
    sock = config.bind_socket()
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if ":" in bound_host else bound_host

    class _Server(uvicorn.Server):
        async def startup(self, sockets: list[Any] | None = None) -> None:
            await super().startup(sockets)
            if self.started and on_listen is not None:  # accepting connections now
                on_listen(f"http://{shown}:{bound_port}")

        def handle_exit(self, sig: int, frame: Any) -> None:
            super().handle_exit(sig, frame)
            state.stop_soon()  # running generations end now, not at the graceful timeout

    _Server(config).run(sockets=[sock])
