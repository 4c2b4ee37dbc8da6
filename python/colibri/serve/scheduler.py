"""Running requests on one :class:`colibri.Model`: a bounded FIFO queue in front of a
continuous batch (up to ``max_batch`` generations decode together, their forwards shared:
an expert any of them routes to is read once for all), a pool of sessions so that
conversations keep their KV prefix across requests, and one worker thread that runs the
batch so the event loop never waits on the engine.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from colibri.model import BatchEntry, Model, Session
from colibri.results import GenerationResult
from colibri.stream import ScoredRow, TextSink


def common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of two token lists."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


@dataclass
class _Slot:
    session: Session
    #: The tokens its KV cache holds (``Session.token_ids`` after its last generation).
    tokens: list[int] = field(default_factory=list)
    #: The length of the last prompt run on it.
    prompt_len: int = 0
    last_used: float = 0.0


class SessionPool:
    """At most ``size`` sessions, each holding one conversation's KV cache.

    :meth:`choose` gives a request the session that continues its conversation: the one
    whose last prompt the new prompt extends (the longest such), so the engine prefills only
    the new tokens. Otherwise a new session while there is room, else the one sharing the
    longest prefix with the prompt (a common system prompt), the least recently used among
    equals. Idle sessions' caches count against the model's ``idle_session_budget`` and are
    written to disk beyond it, so the pool's size bounds reuse, not RAM."""

    def __init__(self, model: Model, size: int) -> None:
        if size < 1:
            raise ValueError("a session pool needs at least one session")
        self.model = model
        self.size = size
        self.slots: list[_Slot] = []
        #: Bytes the pool's KV caches held in RAM after the last generation (evicted: 0).
        self.kv_bytes = 0

    def choose(
        self, ids: list[int], busy: frozenset[int] = frozenset()
    ) -> tuple[_Slot, int] | None:
        """The slot to run prompt ``ids`` on, and how many of its tokens it will reuse;
        slots whose ``id()`` is in ``busy`` (generating now) are not candidates, and
        ``None`` means every slot is busy."""
        free = [s for s in self.slots if id(s) not in busy]
        scored = [(common_prefix(s.tokens, ids), s) for s in free]
        continuing = [(n, s) for n, s in scored if s.prompt_len and n >= s.prompt_len]
        if continuing:
            n, slot = max(continuing, key=lambda x: (x[0], x[1].last_used))
        elif len(self.slots) < self.size:
            slot, n = _Slot(self.model.session()), 0
            self.slots.append(slot)
        elif scored:
            n, slot = max(scored, key=lambda x: (x[0], -x[1].last_used))
        else:
            return None
        slot.last_used = time.monotonic()
        return slot, n

    def measure(self) -> None:
        """Read what the sessions' caches hold into :attr:`kv_bytes` (call it while no
        generation runs: a session's getters wait for one)."""
        self.kv_bytes = sum(s.session.kv_bytes for s in self.slots)


class QueueFull(Exception):
    """The queue is at its bound; retry after :attr:`retry_after` seconds."""

    def __init__(self, waiting: int, retry_after: int) -> None:
        super().__init__(f"{waiting} requests are waiting for the engine")
        self.waiting = waiting
        self.retry_after = retry_after


class ShuttingDown(Exception):
    """The server is stopping and takes no new requests."""


_END = object()

#: A running request's current speed is measured over about this many seconds...
RATE_WINDOW = 3.0
#: ...from marks of its token count taken at most this often.
RATE_STEP = 0.25


@dataclass
class Outcome:
    """What a finished generation left: the result, the expert store's per-layer counters
    (of the batch it ran in: the store's counters are shared by its requests), the wall
    time, and how long it waited in the queue."""

    result: GenerationResult
    expert_stats: dict[str, Any]
    seconds: float
    queued_seconds: float


#: A piece of a job's text and the log-probability rows of the tokens it completes.
Delta = tuple[str, list[ScoredRow]]


class Job:
    """One admitted request. Iterate :meth:`chunks` for its text; :attr:`outcome` is set
    once it has finished. :meth:`cancel` (a client that went away) stops it within one
    forward, or drops it from the queue if it has not started."""

    def __init__(self, ids: list[int], kwargs: dict[str, Any], tag: str = "") -> None:
        self.ids = ids
        self.kwargs = kwargs
        #: What the request was (the endpoint), for the metrics.
        self.tag = tag
        self.outcome: Outcome | None = None
        self.error: BaseException | None = None
        self.cancelled = False
        self.started = False
        self._queue: asyncio.Queue[Any] = asyncio.Queue()
        self._ended = asyncio.Event()
        self._cancel = threading.Event()
        self._scheduler: Scheduler | None = None
        self._submitted = time.monotonic()
        self._began = 0.0
        #: The session slot it runs on, once admitted into the batch.
        self._slot: _Slot | None = None
        #: Live progress (written by the worker thread as tokens come): tokens generated,
        #: the forwards that emitted them, when the first came (its prefill's end), and the
        #: store's expert wait when the job began.
        self.generated = 0
        self.bursts = 0
        self._first_token = 0.0
        self._wait_at_start = 0.0
        #: ``(time, tokens generated)`` at most every :data:`RATE_STEP` seconds, the last
        #: :data:`RATE_WINDOW` seconds' worth: the current speed is measured over them.
        self._marks: deque[tuple[float, int]] = deque()

    def progress(self, now: float, expert_wait: float) -> dict[str, Any]:
        """Where a running job stands, for ``/stats``: its prompt and generated tokens, its
        current speed (over the last :data:`RATE_WINDOW` seconds, or since its first token
        when that is more recent), tokens per forward, the expert wait since it began (the
        batch's: the store's counters are shared by the requests decoding together) and an
        estimate of the seconds left to ``max_tokens`` at the current speed."""
        decoding = self._first_token > 0.0
        elapsed = now - self._began
        rate = None
        marks = list(self._marks)  # one C call: atomic against the worker's appends
        since, base = (self._first_token, 1) if not marks else marks[0]
        if decoding and self.generated > base and now > since:
            rate = (self.generated - base) / (now - since)
        limit = int(self.kwargs.get("max_new_tokens") or 0)
        left = max(0, limit - self.generated)
        return {
            "endpoint": self.tag,
            "phase": "decode" if decoding else "prefill",
            "prompt_tokens": len(self.ids),
            "generated_tokens": self.generated,
            "max_tokens": limit or None,
            "elapsed_seconds": elapsed,
            "tokens_per_second": rate,
            "tokens_per_forward": self.generated / self.bursts if self.bursts else None,
            "expert_wait_seconds": max(0.0, expert_wait - self._wait_at_start),
            "eta_seconds": left / rate if rate else None,
        }

    def _count(self, ids: list[int], now: float | None = None) -> None:
        """The worker's callback: a burst of ``ids`` was generated (at ``now``)."""
        now = time.monotonic() if now is None else now
        if not self._first_token:
            self._first_token = now
        self.generated += len(ids)
        self.bursts += 1
        marks = self._marks
        if not marks or now - marks[-1][0] >= RATE_STEP:
            marks.append((now, self.generated))
            while now - marks[0][0] > RATE_WINDOW:
                marks.popleft()

    def cancel(self) -> None:
        """Stop the generation (within one forward), or drop it from the queue."""
        self.cancelled = True
        self._cancel.set()
        if self._scheduler is not None:
            self._scheduler._drop_queued(self)

    async def chunks(self) -> AsyncIterator[Delta]:
        """The generated text, chunk by chunk, each with the log-probability rows of the
        tokens it completes (none unless asked for); raises what the generation raised."""
        while True:
            item = await self._queue.get()
            if item is _END:
                if self.error is not None:
                    raise self.error
                return
            yield item

    async def wait(self) -> Outcome | None:
        """Wait for the end; the outcome (None when cancelled before it started)."""
        async for _ in self.chunks():
            pass
        return self.outcome


class Scheduler:
    """Admits requests into a bounded FIFO queue and runs them in a continuous batch.

    Up to ``max_batch`` requests decode together (each on its own session of the pool,
    their forwards shared); a request joins the running batch at the next forward, after
    its prefill, and leaves it when it ends. ``max_queue`` requests may wait beyond those;
    one more is refused with :class:`QueueFull`. ``on_finish(job)`` is called (on the event
    loop) after each generation, for the metrics."""

    def __init__(
        self,
        model: Model,
        *,
        sessions: int = 4,
        max_queue: int = 32,
        max_batch: int | None = None,
        on_finish: Callable[[Job], None] | None = None,
    ) -> None:
        self.model = model
        self.pool = SessionPool(model, sessions)
        self.max_queue = max_queue
        #: Generations decoded together (each needs a session of its own).
        self.max_batch = sessions if max_batch is None else max_batch
        if not 1 <= self.max_batch <= sessions:
            raise ValueError(
                f"max_batch {self.max_batch}: each running request needs its own session, "
                f"so it must be in 1..{sessions} (the sessions)"
            )
        self.on_finish = on_finish
        self.waiting = 0
        self.running = 0
        #: The most requests that ran together so far.
        self.peak_running = 0
        self._pending: deque[Job] = deque()
        self._jobs: set[Job] = set()
        self._recent: deque[float] = deque(maxlen=16)
        self._closing = False
        self._wake = threading.Condition()
        self._worker: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._next_id = 0
        self._by_id: dict[int, Job] = {}

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the requests ahead times the recent mean
        request time, divided among the batch's places, at least 1."""
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(mean * (self.waiting + self.running) / self.max_batch))

    def submit(self, ids: list[int], kwargs: dict[str, Any], tag: str = "") -> Job:
        """Queue a generation of prompt ``ids`` with ``Session.generate`` keywords
        ``kwargs`` (already checked); ``tag`` names it in the metrics. Raises
        :class:`QueueFull` or :class:`ShuttingDown`."""
        return self.submit_all([(ids, kwargs)], tag)[0]

    def submit_all(
        self, requests: list[tuple[list[int], dict[str, Any]]], tag: str = ""
    ) -> list[Job]:
        """Queue the generations of one API request (its choices) together: all of them,
        or none with :class:`QueueFull` when they do not fit beside what waits. An idle
        server takes a request of any size (its choices then run ``max_batch`` at a time)."""
        if self._closing:
            raise ShuttingDown("the server is shutting down")
        room = self.max_batch - self.running
        over = self.waiting + len(requests) > self.max_queue + max(0, room)
        if over and (self.running or self.waiting):
            raise QueueFull(self.waiting, self.retry_after())
        self._loop = asyncio.get_running_loop()
        jobs = []
        for ids, kwargs in requests:
            job = Job(ids, kwargs, tag)
            job._scheduler = self
            self._jobs.add(job)
            jobs.append(job)
        with self._wake:
            self._pending.extend(jobs)
            self.waiting += len(jobs)
            self._wake.notify()
        if self._worker is None:
            self._worker = threading.Thread(target=self._work, name="colibri-batch", daemon=True)
            self._worker.start()
        return jobs

    # ------------------------------------------------------------------ the worker thread
    def _work(self) -> None:
        """Run batches while there are requests; sleep while there are none."""
        while True:
            with self._wake:
                while not self._pending and not self._closing:
                    self._wake.wait()
                if self._closing and not self._pending:
                    return
            try:
                self.model._run_continuous(self._admit, self._done)
            except BaseException as e:  # the engine failed as a whole: fail what is left
                for i, job in list(self._by_id.items()):
                    del self._by_id[i]
                    job._slot = None
                    self.running -= 1
                    self._end(job, None, e)

    def _admit(self, live: int) -> list[BatchEntry]:
        """The batch's callback before every forward: the queued requests that fit."""
        entries: list[BatchEntry] = []
        busy = frozenset(id(j._slot) for j in self._by_id.values() if j._slot is not None)
        while True:
            with self._wake:
                if not self._pending or live + len(entries) >= self.max_batch:
                    break
                job = self._pending[0]
                chosen = None if job.cancelled else self.pool.choose(job.ids, busy)
                if chosen is None and not job.cancelled:
                    break  # every session generates: wait for one to end
                self._pending.popleft()
                self.waiting -= 1
            if job.cancelled:
                self._end(job, None, None)
                continue
            assert chosen is not None
            slot, _ = chosen
            busy = busy | {id(slot)}
            try:
                params = self.model._params(job.ids, None, dict(job.kwargs))
            except BaseException as e:  # a bad request fails alone
                self._end(job, None, e)
                continue
            job._slot = slot
            job.started = True
            job._began = time.monotonic()
            job._wait_at_start = self.expert_wait_seconds()
            self.running += 1
            self.peak_running = max(self.peak_running, self.running)
            self._next_id += 1
            self._by_id[self._next_id] = job
            entries.append(
                BatchEntry(
                    id=self._next_id,
                    params=params,
                    session=slot.session,
                    on_text=self._text_sink(job),
                    cancel=job._cancel,
                    on_tokens=job._count,
                )
            )
        return entries

    def expert_wait_seconds(self) -> float:
        """The expert store's total wait for reads so far (all requests)."""
        return float(self.model._engine.expert_stats()["total"]["wait_ns"]) / 1e9

    def progress(self) -> list[dict[str, Any]]:
        """Every running request's :meth:`Job.progress`, oldest first."""
        now = time.monotonic()
        wait = self.expert_wait_seconds()
        jobs = sorted(self._by_id.items())
        return [job.progress(now, wait) for _, job in jobs if job.started]

    def _text_sink(self, job: Job) -> TextSink:
        def on_text(delta: str, rows: list[ScoredRow]) -> bool:
            self._post(job._queue.put_nowait, (delta, rows))
            return not job.cancelled

        return on_text

    def _done(self, i: int, result: GenerationResult | BaseException) -> None:
        """The batch's callback when request ``i`` ends."""
        job = self._by_id.pop(i)
        slot = job._slot
        assert slot is not None
        job._slot = None
        self.running -= 1
        if isinstance(result, BaseException):
            slot.tokens = []
            slot.prompt_len = 0
            self._end(job, None, result)
            return
        slot.tokens = slot.session.token_ids
        slot.prompt_len = len(job.ids)
        self.pool.measure()
        seconds = time.monotonic() - job._began
        self._recent.append(seconds)
        outcome = Outcome(
            result, self.model._engine.expert_stats(), seconds, job._began - job._submitted
        )
        self._end(job, outcome, None)

    def _end(self, job: Job, outcome: Outcome | None, error: BaseException | None) -> None:
        """Hand a job's end to the event loop (from any thread)."""

        def settle() -> None:
            if job._ended.is_set():
                return
            job.outcome = outcome
            job.error = error
            self._jobs.discard(job)
            if outcome is not None and self.on_finish is not None:
                self.on_finish(job)
            job._ended.set()
            job._queue.put_nowait(_END)

        self._post(settle)

    def _post(self, fn: Callable[..., Any], *args: Any) -> None:
        loop = self._loop
        if loop is None:
            return
        with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
            loop.call_soon_threadsafe(fn, *args)

    def _drop_queued(self, job: Job) -> None:
        """A queued job that was cancelled leaves the queue now."""
        with self._wake:
            if job.started or job not in self._pending:
                return
            self._pending.remove(job)
            self.waiting -= 1
        self._end(job, None, None)

    @property
    def closing(self) -> bool:
        """Whether :meth:`stop` or :meth:`close` was called."""
        return self._closing

    def stop(self) -> None:
        """Refuse new requests and cancel the running and queued ones (on the loop)."""
        self._closing = True
        for job in list(self._jobs):
            job.cancel()
        with self._wake:
            self._wake.notify_all()

    async def close(self) -> None:
        """:meth:`stop`, then wait for the generations to end."""
        self.stop()
        for job in list(self._jobs):
            await job._ended.wait()
        worker = self._worker
        if worker is not None:
            await asyncio.get_running_loop().run_in_executor(None, worker.join)
