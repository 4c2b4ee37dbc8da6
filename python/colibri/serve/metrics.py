"""What the server has done: Prometheus metrics (``/metrics``) and the live figures the
dashboard draws (``/stats``), both fed from each finished generation's stats and the expert
store's per-layer counters."""

from __future__ import annotations

import os
import time
from collections import deque
from collections.abc import Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

from colibri.model import Model
from colibri.results import GenerationResult

#: Generations kept for the dashboard's charts and heat map.
HISTORY = 120

_HIT_KINDS = ("hits_pinned", "hits_lru", "hits_prefetched", "hits_inflight")


def layer_hits(layer: Mapping[str, Any]) -> tuple[int, int]:
    """(hits, misses) of one layer's expert-store counters."""
    return sum(int(layer.get(k, 0)) for k in _HIT_KINDS), int(layer.get("misses", 0))


def _rss_bytes() -> int | None:
    """This process's resident memory (Linux), or None where it cannot be read."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return None


class _Live(Collector):
    """Gauges read when scraped: queue depth, running requests, memory."""

    def __init__(self, stats: ServerStats) -> None:
        self.stats = stats

    def collect(self) -> Any:
        s = self.stats
        sched = s.scheduler
        yield GaugeMetricFamily(
            "colibri_queue_depth",
            "Requests waiting for the engine",
            value=0 if sched is None else sched.waiting,
        )
        yield GaugeMetricFamily(
            "colibri_requests_running",
            "Requests generating now (decoded together, their forwards shared)",
            value=0 if sched is None else sched.running,
        )
        yield GaugeMetricFamily(
            "colibri_requests_running_peak",
            "The most requests that generated together since the server started",
            value=0 if sched is None else sched.peak_running,
        )
        mem = s.memory()
        g = GaugeMetricFamily(
            "colibri_memory_bytes", "Memory in use and its budgets", labels=["kind"]
        )
        for k, v in mem.items():
            if isinstance(v, int):
                g.add_metric([k], float(v))
        yield g
        workers = s.model.experts_workers()
        if workers is not None:
            yield from _worker_metrics(workers)


def _worker_metrics(workers: list[dict[str, Any]]) -> Any:
    """The expert workers' gauges (``experts="ray://..."``, docs/distributed.md), one
    series per worker."""
    fields = [
        ("up", "colibri_expert_worker_up", "1 while the worker answers, 0 while it is down"),
        ("experts", "colibri_expert_worker_experts", "Routed experts the worker holds"),
        ("bytes", "colibri_expert_worker_bytes", "Bytes of expert weights the worker holds"),
        ("calls", "colibri_expert_worker_calls", "Layer requests the worker answered"),
        ("failures", "colibri_expert_worker_failures", "Times the worker failed or was late"),
        ("mean_ms", "colibri_expert_worker_latency_ms", "Mean round trip of a layer request"),
        ("bytes_sent", "colibri_expert_worker_bytes_sent", "Activation bytes sent to it"),
        ("bytes_received", "colibri_expert_worker_bytes_received", "Output bytes it returned"),
    ]
    for key, name, doc in fields:
        g = GaugeMetricFamily(name, doc, labels=["worker"])
        for w in workers:
            g.add_metric([str(w["name"])], float(w[key]))
        yield g


class ServerStats:
    """Counters over the server's life and a window of recent generations."""

    def __init__(self, model: Model) -> None:
        self.model = model
        self.scheduler: Any = None  # set by the app once the scheduler exists
        self.started = time.time()
        self._idle_budget = int(model._engine.info()["idle_session_bytes"])
        self.registry = CollectorRegistry(auto_describe=True)
        r = self.registry
        self.requests = Counter(
            "colibri_requests",
            "HTTP requests answered, by endpoint and status code",
            ["endpoint", "status"],
            registry=r,
        )
        self.latency = Histogram(
            "colibri_request_seconds",
            "Time from admission to the last byte of a generation, by endpoint",
            ["endpoint"],
            buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300),
            registry=r,
        )
        self.prompt_tokens = Counter("colibri_prompt_tokens", "Prompt tokens", registry=r)
        self.cached_tokens = Counter(
            "colibri_prompt_cached_tokens",
            "Prompt tokens whose KV a session already held (not prefilled)",
            registry=r,
        )
        self.generated_tokens = Counter("colibri_generated_tokens", "Tokens generated", registry=r)
        self.generations = Counter(
            "colibri_generations", "Generations, by finish reason", ["finish_reason"], registry=r
        )
        self.tps = Gauge(
            "colibri_tokens_per_second", "Decode speed of the last generation", registry=r
        )
        self.tpf = Gauge(
            "colibri_tokens_per_forward",
            "Tokens per decode forward of the last generation",
            registry=r,
        )
        self.proposed = Counter(
            "colibri_drafts_proposed", "Draft tokens proposed, by depth", ["depth"], registry=r
        )
        self.accepted = Counter(
            "colibri_drafts_accepted", "Draft tokens accepted, by depth", ["depth"], registry=r
        )
        self.acceptance = Gauge(
            "colibri_draft_acceptance",
            "Accepted / proposed draft tokens since start, by depth",
            ["depth"],
            registry=r,
        )
        self.hits = Counter(
            "colibri_expert_hits", "Routed-expert uses served from memory", registry=r
        )
        self.misses = Counter(
            "colibri_expert_misses", "Routed-expert uses read from disk", registry=r
        )
        self.bytes_read = Counter("colibri_expert_bytes_read", "Expert bytes read", registry=r)
        self.wait = Counter(
            "colibri_expert_wait_seconds", "Seconds forwards waited for expert reads", registry=r
        )
        self.layer_hits = Counter(
            "colibri_expert_layer_hits", "Expert hits, by layer", ["layer"], registry=r
        )
        self.layer_misses = Counter(
            "colibri_expert_layer_misses", "Expert misses, by layer", ["layer"], registry=r
        )
        self.recall = Gauge(
            "colibri_prefetch_recall",
            "Share of routed experts the router lookahead predicted, since start",
            registry=r,
        )
        r.register(_Live(self))
        self._proposed: list[int] = []
        self._accepted: list[int] = []
        self._layers: dict[str, list[int]] = {}
        self._recalled = 0
        self._routed = 0
        self.totals = {
            "requests": 0,
            "generations": 0,
            "cancelled": 0,
            "refused": 0,
            "prompt_tokens": 0,
            "cached_tokens": 0,
            "generated_tokens": 0,
            "expert_hits": 0,
            "expert_misses": 0,
            "expert_bytes_read": 0,
            "expert_wait_seconds": 0.0,
            "decode_seconds": 0.0,
        }
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)

    # ----------------------------------------------------------------------------- feeding
    def request(self, endpoint: str, status: int, api: bool = True) -> None:
        """Count an answered HTTP request (the Prometheus counter counts every one; the
        dashboard's total only ``api`` requests, not its own polling)."""
        self.requests.labels(endpoint, str(status)).inc()
        if api:
            self.totals["requests"] += 1
        if status in (429, 503):
            self.totals["refused"] += 1

    def generation(
        self,
        endpoint: str,
        result: GenerationResult,
        store: Mapping[str, Any],
        seconds: float,
        queued: float,
    ) -> None:
        """Record one finished generation: its stats and the store's counters for it."""
        s = result.stats
        t = self.totals
        t["generations"] += 1
        t["cancelled"] += result.finish_reason == "cancelled"
        t["prompt_tokens"] += s.prompt_tokens
        t["cached_tokens"] += s.prompt_cached_tokens
        t["generated_tokens"] += s.generated_tokens
        t["expert_hits"] += s.expert_hits
        t["expert_misses"] += s.expert_misses
        t["expert_bytes_read"] += s.expert_bytes_read
        t["expert_wait_seconds"] += s.expert_wait_seconds
        t["decode_seconds"] += s.decode_seconds
        self.latency.labels(endpoint).observe(seconds)
        self.prompt_tokens.inc(s.prompt_tokens)
        self.cached_tokens.inc(s.prompt_cached_tokens)
        self.generated_tokens.inc(s.generated_tokens)
        self.generations.labels(result.finish_reason).inc()
        self.tps.set(s.tokens_per_second)
        self.tpf.set(s.tokens_per_forward)
        self.hits.inc(s.expert_hits)
        self.misses.inc(s.expert_misses)
        self.bytes_read.inc(s.expert_bytes_read)
        self.wait.inc(s.expert_wait_seconds)
        pairs = zip(s.drafts_proposed, s.drafts_accepted, strict=False)
        for d, (p, a) in enumerate(pairs, start=1):
            while len(self._proposed) < d:
                self._proposed.append(0)
                self._accepted.append(0)
            self._proposed[d - 1] += p
            self._accepted[d - 1] += a
            self.proposed.labels(str(d)).inc(p)
            self.accepted.labels(str(d)).inc(a)
            if self._proposed[d - 1]:
                self.acceptance.labels(str(d)).set(self._accepted[d - 1] / self._proposed[d - 1])
        rates: dict[str, float | None] = {}
        for layer, c in (store.get("layers") or {}).items():
            h, m = layer_hits(c)
            key = str(layer)
            acc = self._layers.setdefault(key, [0, 0])
            acc[0] += h
            acc[1] += m
            self.layer_hits.labels(key).inc(h)
            self.layer_misses.labels(key).inc(m)
            rates[key] = h / (h + m) if h + m else None
        total = store.get("total") or {}
        self._recalled += int(total.get("recalled_router", 0))
        self._routed += int(total.get("routed_router", 0))
        if self._routed:
            self.recall.set(self._recalled / self._routed)
        self.history.append(
            {
                "t": time.time(),
                "endpoint": endpoint,
                "finish_reason": result.finish_reason,
                "prompt_tokens": s.prompt_tokens,
                "cached_tokens": s.prompt_cached_tokens,
                "generated_tokens": s.generated_tokens,
                "tokens_per_second": s.tokens_per_second,
                "prompt_tokens_per_second": s.prompt_tokens_per_second,
                "tokens_per_forward": s.tokens_per_forward,
                "drafts_proposed": list(s.drafts_proposed),
                "drafts_accepted": list(s.drafts_accepted),
                "expert_hits": s.expert_hits,
                "expert_misses": s.expert_misses,
                "expert_wait_seconds": s.expert_wait_seconds,
                "decode_seconds": s.decode_seconds,
                "prefetch_recall": s.prefetch_recall,
                "seconds": seconds,
                "queued_seconds": queued,
                "layer_hit_rate": rates,
            }
        )

    # ----------------------------------------------------------------------------- reading
    def memory(self) -> dict[str, Any]:
        """Bytes in use and their budgets: the expert cache (LRU and pinned) against its
        budget, the sessions' KV caches against the idle-session budget, the process RSS."""
        st = self.model._engine.expert_stats()
        sched = self.scheduler
        return {
            "expert_cache": int(st["lru_bytes"]),
            "expert_pinned": int(st["pinned_bytes"]),
            "expert_budget": int(st["budget_bytes"]),
            "kv_sessions": None if sched is None else sched.pool.kv_bytes,
            "kv_idle_budget": self._idle_budget,
            "rss": _rss_bytes(),
            "io_mode": str(st["io_mode"]),
        }

    def routing(self) -> dict[str, int]:
        """Routed experts per token in effect (``experts_per_token``, fewer than the model's
        own only when the server was started with ``--experts-per-token``) and the model's
        own ``num_experts_per_tok``."""
        facts = self.model._engine.info()
        return {
            "experts_per_token": int(facts["experts_per_token"]),
            "num_experts_per_tok": int(facts["model_experts_per_token"]),
        }

    def snapshot(self) -> dict[str, Any]:
        """Everything the dashboard shows, as JSON-ready data."""
        sched = self.scheduler
        t = dict(self.totals)
        uses = t["expert_hits"] + t["expert_misses"]
        layers = {
            k: {"hits": h, "misses": m, "hit_rate": h / (h + m) if h + m else None}
            for k, (h, m) in sorted(self._layers.items(), key=lambda kv: int(kv[0]))
        }
        return {
            "model": str(self.model.path),
            #: Layers from this index on are the MTP head's.
            "num_hidden_layers": int(self.model.config.get("num_hidden_layers", 0)),
            "uptime_seconds": time.time() - self.started,
            "queue_depth": 0 if sched is None else sched.waiting,
            "running": 0 if sched is None else sched.running,
            "max_queue": None if sched is None else sched.max_queue,
            "max_batch": None if sched is None else sched.max_batch,
            "peak_running": 0 if sched is None else sched.peak_running,
            "sessions": 0 if sched is None else len(sched.pool.slots),
            "max_sessions": None if sched is None else sched.pool.size,
            "totals": t,
            "expert_hit_rate": t["expert_hits"] / uses if uses else None,
            "prefetch_recall": self._recalled / self._routed if self._routed else None,
            "drafts_proposed": list(self._proposed),
            "drafts_accepted": list(self._accepted),
            "acceptance": [
                a / p if p else None for p, a in zip(self._proposed, self._accepted, strict=True)
            ],
            "layers": layers,
            #: The requests running now, updated as their tokens come (not only at the end).
            "active": [] if sched is None else sched.progress(),
            "memory": self.memory(),
            "routing": self.routing(),
            "history": list(self.history),
        }

    def prometheus(self) -> bytes:
        """The Prometheus text exposition of every metric."""
        return generate_latest(self.registry)
