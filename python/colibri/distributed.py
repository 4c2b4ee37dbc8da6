"""Routed experts held in the RAM of Ray worker actors (docs/distributed.md).

A worker (``colibri experts-worker MODEL --address ADDR --shard I/N``, or
:func:`start_worker`) is a Ray actor named ``colibri-experts-I-of-N`` in the namespace
``colibri``. It loads its share of the container's routed experts (:func:`placement`) into
its own process's RAM and runs them on request with the engine's kernels
(``colibri._core.ExpertShard``).

The head (``Model(..., experts="ray://ADDRESS")``) keeps the dense weights and the KV. Per MoE
layer it sends every live worker holding some of the routed experts one request (the layer's
rows and which rows chose which of its experts), runs the shared and local experts meanwhile,
then collects: a worker computes an expert with the same kernels, arithmetic and rows as the
head, so the tokens are the same wherever the experts ran. A worker that raises or does not
answer within the timeout is marked down and its experts come from the local store, with an
:class:`~colibri.errors.ExpertWorkerWarning`, until it answers a health probe again (Ray
restarts an actor started with ``max_restarts``).

Ray is an optional dependency: ``pip install "colibri[distributed]"``.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import threading
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import numpy as np

from colibri import _core
from colibri.errors import ColibriError, ExpertWorkerWarning, InvalidArgumentError

__all__ = [
    "ACTOR_NAME",
    "NAMESPACE",
    "RayExperts",
    "actor_name",
    "model_experts",
    "parse_address",
    "placement",
    "read_usage",
    "start_worker",
]

#: The Ray namespace of every colibri actor.
NAMESPACE = "colibri"
#: Worker actor names: ``colibri-experts-I-of-N`` (I from 1 to N).
ACTOR_NAME = re.compile(r"^colibri-experts-(\d+)-of-(\d+)$")
_EXPERT = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.gate_proj\.weight$")

Expert = tuple[int, int]


def actor_name(shard: int, n_shards: int) -> str:
    """The actor name of worker ``shard`` of ``n_shards`` (1-based)."""
    return f"colibri-experts-{shard}-of-{n_shards}"


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as e:
        raise ColibriError(
            "experts on Ray workers need Ray: pip install 'colibri[distributed]'"
        ) from e
    return ray


def model_experts(path: str | os.PathLike[str]) -> list[Expert]:
    """Every routed expert ``(layer, expert)`` the container at ``path`` holds (the MTP
    layer's included), sorted."""
    found = []
    for name in _core.Container(os.fspath(path)).names():
        m = _EXPERT.match(name)
        if m:
            found.append((int(m.group(1)), int(m.group(2))))
    return sorted(found)


def placement(
    experts: Sequence[Expert],
    n_shards: int,
    usage: Mapping[Expert, float] | None = None,
) -> list[list[Expert]]:
    """Which worker holds which experts: each expert in one place, every layer's experts
    spread evenly in count (so is RAM), and, with ``usage`` (the routing history: how often
    each expert was chosen, or the calibrated workload), the hot ones spread so that every
    layer's expected load is balanced. Per layer the experts go hottest first, each to the
    worker with the least expected load among those under their share of the count; ties go
    to the worker with fewest experts overall, then the lowest. Deterministic: the head and
    every worker compute the same."""
    if n_shards < 1:
        raise InvalidArgumentError(f"invalid value for 'n_shards': {n_shards}; expected >= 1")
    by_layer: dict[int, list[int]] = {}
    for layer, e in sorted(set(experts)):
        by_layer.setdefault(layer, []).append(e)
    shards: list[list[Expert]] = [[] for _ in range(n_shards)]
    totals = [0] * n_shards
    for layer, ids in sorted(by_layer.items()):
        cap = math.ceil(len(ids) / n_shards)
        load = [0.0] * n_shards
        count = [0] * n_shards
        weight = {e: float((usage or {}).get((layer, e), 0.0)) for e in ids}
        for e in sorted(ids, key=lambda e: (-weight[e], e)):
            open_ = [w for w in range(n_shards) if count[w] < cap]
            w = min(open_, key=lambda w: (load[w], count[w], totals[w], w))
            shards[w].append((layer, e))
            load[w] += weight[e]
            count[w] += 1
            totals[w] += 1
    return [sorted(s) for s in shards]


def read_usage(path: str | os.PathLike[str]) -> dict[Expert, float]:
    """The routing history of a ``colibri-usage.json`` (how often each expert of each layer
    was chosen; the expert store writes it, a model directory may ship one) as
    :func:`placement`'s ``usage``."""
    import json

    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        layers = data["layers"]
        return {
            (int(layer), e): float(n)
            for layer, counts in layers.items()
            for e, n in enumerate(counts)
        }
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
        raise InvalidArgumentError(
            f"invalid value for 'usage': {os.fspath(path)} is not a colibri-usage.json ({e})"
        ) from e


def parse_address(experts: str) -> tuple[str, dict[str, float]]:
    """``ray://ADDRESS[?timeout=S&probe=S]`` as (Ray address, options); ``ADDRESS`` is what
    ``ray.init(address=...)`` takes (``auto``, or the head's ``host:port``)."""
    if not isinstance(experts, str) or not experts.startswith("ray://"):
        raise InvalidArgumentError(
            f"invalid value for 'experts': {experts!r}; expected 'ray://ADDRESS' (ADDRESS as "
            "ray.init takes it: 'auto' or the Ray head's host:port)"
        )
    rest = experts[len("ray://") :]
    address, _, query = rest.partition("?")
    if not address:
        raise InvalidArgumentError(
            f"invalid value for 'experts': {experts!r} names no address; use ray://auto "
            "or ray://HOST:PORT"
        )
    options: dict[str, float] = {}
    for key, values in parse_qs(query, strict_parsing=bool(query)).items():
        if key not in ("timeout", "probe"):
            raise InvalidArgumentError(
                f"invalid value for 'experts': {experts!r}; unknown option {key!r} "
                "(known: timeout, probe)"
            )
        try:
            options[key] = float(values[-1])
        except ValueError:
            raise InvalidArgumentError(
                f"invalid value for 'experts': {experts!r}; {key} must be seconds"
            ) from None
        if not options[key] > 0:
            raise InvalidArgumentError(
                f"invalid value for 'experts': {experts!r}; {key} must be > 0 seconds"
            )
    return address, options


def _node_ip() -> str | None:
    try:
        import ray

        return str(ray.util.get_node_ip_address())
    except Exception:
        return None


class _Worker:
    """The actor's body: a shard of experts resident in this process."""

    def __init__(
        self, path: str, shard: int, n_shards: int, experts: list[Expert], threads: int
    ) -> None:
        self._shard = _core.ExpertShard(path, [tuple(x) for x in experts], threads=threads)
        self._facts = {
            "name": actor_name(shard, n_shards),
            "shard": shard,
            "n_shards": n_shards,
            "experts": [list(x) for x in self._shard.experts],
            "nbytes": int(self._shard.nbytes),
            "hidden_size": int(self._shard.hidden_size),
            "pid": os.getpid(),
            "host": os.uname().nodename,
            "node_ip": _node_ip(),
            "model": path,
        }

    def describe(self) -> dict[str, Any]:
        return self._facts

    def ping(self) -> bool:
        return True

    def busy(self, seconds: float) -> None:
        """Hold the actor for ``seconds`` (requests queue behind it): a late worker, for
        tests and drills."""
        time.sleep(seconds)

    def run(
        self, layer: int, arithmetic: str, h: np.ndarray, want: list[tuple[int, list[int]]]
    ) -> list[tuple[int, np.ndarray]]:
        return self._shard.run(layer, arithmetic, h, want)


def start_worker(
    path: str | os.PathLike[str],
    shard: int,
    n_shards: int,
    *,
    experts: Sequence[Expert] | None = None,
    usage: Mapping[Expert, float] | None = None,
    threads: int = 0,
    max_restarts: int = 0,
    here: bool = True,
    timeout_s: float = 600.0,
) -> Any:
    """Start worker ``shard`` of ``n_shards`` (1-based) on the connected Ray cluster and wait
    until it holds its experts; returns its actor handle. It holds ``experts``, or its share
    of :func:`placement` over the container's routed experts (with ``usage``). ``here`` pins
    it to this node (``colibri experts-worker`` runs on the machine whose RAM it uses).
    ``max_restarts``: how often Ray restarts it after it dies (-1: always)."""
    ray = _import_ray()
    if not 1 <= shard <= n_shards:
        raise InvalidArgumentError(
            f"invalid value for 'shard': {shard}/{n_shards}; expected 1 <= I <= N"
        )
    path = os.fspath(Path(path).resolve())
    held = (
        list(experts)
        if experts is not None
        else placement(model_experts(path), n_shards, usage)[shard - 1]
    )
    options: dict[str, Any] = {
        "name": actor_name(shard, n_shards),
        "namespace": NAMESPACE,
        "max_restarts": max_restarts,
        "num_cpus": 0,
    }
    if here:
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(
            ray.get_runtime_context().get_node_id(), soft=False
        )
    actor = ray.remote(_Worker).options(**options).remote(path, shard, n_shards, held, threads)
    ray.get(actor.describe.remote(), timeout=timeout_s)
    return actor


@dataclass
class _Remote:
    """One worker as the head sees it."""

    name: str
    handle: Any
    experts: set[Expert]
    facts: dict[str, Any]
    up: bool = True
    calls: int = 0
    failures: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    seconds: float = 0.0
    last_ms: float = 0.0
    max_ms: float = 0.0
    last_error: str | None = None

    def info(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "host": self.facts.get("host"),
            "pid": self.facts.get("pid"),
            "up": self.up,
            "experts": len(self.experts),
            "bytes": int(self.facts.get("nbytes", 0)),
            "calls": self.calls,
            "failures": self.failures,
            "mean_ms": 1000.0 * self.seconds / self.calls if self.calls else 0.0,
            "last_ms": self.last_ms,
            "max_ms": self.max_ms,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "last_error": self.last_error,
        }


def _warn(message: str) -> None:
    """Warn without ever raising into the forward (a filter may turn warnings into errors:
    the forward must finish all the same)."""
    with contextlib.suppress(Exception):  # a warning filter set to "error"
        warnings.warn(message, ExpertWorkerWarning, stacklevel=2)


class RayExperts:
    """The head's side: the engine's remote experts (``Engine.set_remote_experts``). Finds
    the ``colibri-experts-*`` actors of the cluster at ``address`` (connecting to it unless
    Ray is already initialised in this process) and learns what each holds.

    ``timeout_s``: how long a layer waits for a worker before its experts run locally;
    ``probe_s``: how often a down worker is probed."""

    def __init__(
        self,
        address: str,
        *,
        hidden_size: int | None = None,
        timeout_s: float = 10.0,
        probe_s: float = 1.0,
    ) -> None:
        ray = _import_ray()
        self._ray = ray
        if not ray.is_initialized():
            try:
                ray.init(
                    address=address,
                    namespace=NAMESPACE,
                    log_to_driver=False,
                    configure_logging=False,
                )
            except Exception as e:
                raise ColibriError(f"cannot join the Ray cluster at {address!r}: {e}") from e
        self.timeout_s = float(timeout_s)
        self.probe_s = float(probe_s)
        self.workers: list[_Remote] = []
        names = sorted(
            a["name"]
            for a in ray.util.list_named_actors(all_namespaces=True)
            if a.get("namespace") == NAMESPACE and ACTOR_NAME.match(a.get("name", ""))
        )
        for name in names:
            try:
                handle = ray.get_actor(name, namespace=NAMESPACE)
                facts = ray.get(handle.describe.remote(), timeout=self.timeout_s)
            except Exception as e:
                _warn(f"expert worker {name} does not answer ({e}); skipped")
                continue
            if hidden_size is not None and facts.get("hidden_size") != hidden_size:
                raise ColibriError(
                    f"expert worker {name} holds a model of hidden size "
                    f"{facts.get('hidden_size')}, this one's is {hidden_size}: it serves "
                    "another model"
                )
            experts = {(int(a), int(b)) for a, b in facts["experts"]}
            self.workers.append(_Remote(name, handle, experts, facts))
        if not self.workers:
            raise ColibriError(
                f"no colibri expert worker found on the Ray cluster at {address!r} "
                f"(actors named colibri-experts-I-of-N in namespace {NAMESPACE!r}: start "
                "them with `colibri experts-worker MODEL --address ADDR --shard I/N`)"
            )
        self._closed = threading.Event()
        self._probe_lock = threading.Lock()
        self._probing: threading.Thread | None = None
        self._owners: dict[Expert, list[_Remote]] = {}
        for w in self.workers:
            for x in w.experts:
                self._owners.setdefault(x, []).append(w)

    @property
    def held(self) -> list[Expert]:
        """Every ``(layer, expert)`` some worker holds."""
        return sorted(self._owners)

    # The engine's side: called from the forward's thread with the GIL held.
    def submit(
        self, layer: int, arithmetic: str, h: np.ndarray, want: list[tuple[int, list[int]]]
    ) -> tuple[list[tuple[_Remote, Any, float]], list[int]] | None:
        """Send every live worker its share of ``want``; (ticket, the experts taken)."""
        try:
            groups: dict[str, tuple[_Remote, list[tuple[int, list[int]]]]] = {}
            for e, rows in want:
                for w in self._owners.get((layer, e), ()):
                    if w.up:
                        groups.setdefault(w.name, (w, []))[1].append((e, rows))
                        break
            if not groups:
                return None
            ticket = []
            taken: list[int] = []
            t0 = time.perf_counter()
            for w, share in groups.values():
                ref = w.handle.run.remote(layer, arithmetic, h, share)
                w.bytes_sent += h.nbytes
                ticket.append((w, ref, t0))
                taken.extend(e for e, _ in share)
            return ticket, taken
        except Exception as e:
            _warn(f"remote experts: cannot submit layer {layer} ({e}); it runs locally")
            return None

    def collect(self, ticket: list[tuple[_Remote, Any, float]]) -> list[tuple[int, np.ndarray]]:
        """Every answered expert's output; a worker that fails or is late is marked down."""
        out: list[tuple[int, np.ndarray]] = []
        answers: list[Any] | None = None
        if ticket:
            # One wait for all (the usual case); one by one only when some failed.
            left = max(0.0, self.timeout_s - (time.perf_counter() - ticket[0][2]))
            try:
                answers = self._ray.get([ref for _, ref, _ in ticket], timeout=left)
            except Exception:  # a worker failed or is late: sorted out below
                answers = None
        for k, (w, ref, t0) in enumerate(ticket):
            try:
                if answers is not None:
                    got = answers[k]
                else:
                    left = max(0.0, self.timeout_s - (time.perf_counter() - t0))
                    got = self._ray.get(ref, timeout=left)
            except Exception as e:
                self._mark_down(w, e)
                continue
            dt = time.perf_counter() - t0
            w.calls += 1
            w.seconds += dt
            w.last_ms = 1000.0 * dt
            w.max_ms = max(w.max_ms, w.last_ms)
            for e, y in got:
                w.bytes_received += y.nbytes
                out.append((int(e), y))
        return out

    def _mark_down(self, w: _Remote, e: BaseException) -> None:
        w.up = False
        w.failures += 1
        w.last_error = f"{type(e).__name__}: {e}"
        self._watch()
        _warn(
            f"expert worker {w.name} failed ({type(e).__name__}); its {len(w.experts)} "
            "experts come from the local store until it answers again"
        )

    def _prober(self) -> None:
        """The health thread: while a worker is down, every ``probe_s`` look it up again by
        name (Ray may have restarted it, or it was started again) and ping it; one that
        answers is up again. Off the forward's thread, so a probe never delays a token."""
        while not self._closed.wait(self.probe_s):
            down = [w for w in self.workers if not w.up]
            if not down:
                with self._probe_lock:
                    if all(w.up for w in self.workers):
                        self._probing = None
                        return
                continue
            for w in down:
                try:
                    handle = self._ray.get_actor(w.name, namespace=NAMESPACE)
                    self._ray.get(handle.ping.remote(), timeout=self.timeout_s)
                except Exception as e:
                    w.last_error = f"probe: {type(e).__name__}: {e}"
                    continue
                w.handle = handle
                w.up = True
                _warn(f"expert worker {w.name} answers again; its experts run there")

    def _watch(self) -> None:
        """Start the health thread unless it runs."""
        with self._probe_lock:
            if self._probing is None and not self._closed.is_set():
                self._probing = threading.Thread(
                    target=self._prober, name="colibri-experts-probe", daemon=True
                )
                self._probing.start()

    def close(self) -> None:
        """Stop the health thread (the workers keep running)."""
        self._closed.set()

    def info(self) -> list[dict[str, Any]]:
        """Per worker: name, host, pid, up, experts and bytes held, calls, failures,
        latency (mean, last, max ms per layer round trip), bytes sent and received."""
        return [w.info() for w in self.workers]


def connect(experts: str, hidden_size: int | None = None) -> RayExperts:
    """The :class:`RayExperts` of ``experts`` (``ray://ADDRESS[?timeout=S&probe=S]``)."""
    address, options = parse_address(experts)
    return RayExperts(
        address,
        hidden_size=hidden_size,
        timeout_s=options.get("timeout", 10.0),
        probe_s=options.get("probe", 1.0),
    )
