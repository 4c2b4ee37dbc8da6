"""Running requests on one :class:`colibri.Model`: a bounded FIFO queue in front of the
engine (which runs one generation at a time), a pool of sessions so that conversations keep
their KV prefix across requests, and a worker thread per generation so the event loop never
waits on the engine.
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

from colibri.model import GenerationResult, GenerationStream, Model, Session


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

    def choose(self, ids: list[int]) -> tuple[_Slot, int]:
        """The slot to run prompt ``ids`` on, and how many of its tokens it will reuse."""
        scored = [(common_prefix(s.tokens, ids), s) for s in self.slots]
        continuing = [(n, s) for n, s in scored if s.prompt_len and n >= s.prompt_len]
        if continuing:
            n, slot = max(continuing, key=lambda x: (x[0], x[1].last_used))
        elif len(self.slots) < self.size:
            slot, n = _Slot(self.model.session()), 0
            self.slots.append(slot)
        else:
            n, slot = max(scored, key=lambda x: (x[0], -x[1].last_used))
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


@dataclass
class Outcome:
    """What a finished generation left: the result, the expert store's per-layer counters
    for it, the wall time, and how long it waited in the queue."""

    result: GenerationResult
    expert_stats: dict[str, Any]
    seconds: float
    queued_seconds: float


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
        self._stream: GenerationStream | None = None
        self._task: asyncio.Task[None] | None = None
        self._submitted = time.monotonic()

    def cancel(self) -> None:
        """Stop the generation (within one forward), or drop it from the queue."""
        self.cancelled = True
        if self._stream is not None:
            self._stream.cancel()
        elif not self.started and self._task is not None:
            self._task.cancel()  # still queued: leave the queue now

    async def chunks(self) -> AsyncIterator[str]:
        """The generated text, chunk by chunk; raises what the generation raised."""
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
    """Admits requests into a bounded FIFO queue and runs them on the model one at a time.

    ``max_queue`` requests may wait while one runs; one more is refused with
    :class:`QueueFull`. ``on_finish(job)`` is called (on the event loop) after each
    generation, for the metrics."""

    def __init__(
        self,
        model: Model,
        *,
        sessions: int = 4,
        max_queue: int = 32,
        on_finish: Callable[[Job], None] | None = None,
    ) -> None:
        self.model = model
        self.pool = SessionPool(model, sessions)
        self.max_queue = max_queue
        self.on_finish = on_finish
        self.waiting = 0
        self.running = 0
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()
        self._jobs: set[Job] = set()
        self._recent: deque[float] = deque(maxlen=16)
        self._closing = False

    def retry_after(self) -> int:
        """Seconds a refused client should wait: the queue ahead times the recent mean
        request time, at least 1."""
        mean = sum(self._recent) / len(self._recent) if self._recent else 1.0
        return max(1, math.ceil(mean * (self.waiting + self.running)))

    def submit(self, ids: list[int], kwargs: dict[str, Any], tag: str = "") -> Job:
        """Queue a generation of prompt ``ids`` with ``Session.generate`` keywords
        ``kwargs`` (already checked); ``tag`` names it in the metrics. Raises
        :class:`QueueFull` or :class:`ShuttingDown`."""
        if self._closing:
            raise ShuttingDown("the server is shutting down")
        if self.waiting >= self.max_queue and (self.running or self.waiting):
            raise QueueFull(self.waiting, self.retry_after())
        job = Job(ids, kwargs, tag)
        self.waiting += 1
        self._jobs.add(job)
        task = asyncio.get_running_loop().create_task(self._run(job))
        job._task = task
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return job

    async def _run(self, job: Job) -> None:
        try:
            try:
                await self._lock.acquire()
            finally:
                self.waiting -= 1
            try:
                if job.cancelled or self._closing:
                    return
                self.running += 1
                try:
                    await self._generate(job)
                finally:
                    self.running -= 1
            finally:
                self._lock.release()
        except asyncio.CancelledError:
            pass  # dropped from the queue before it started (Job.cancel)
        except BaseException as e:  # handed to the consumer
            job.error = e
        finally:
            self._jobs.discard(job)
            job._queue.put_nowait(_END)

    async def _generate(self, job: Job) -> None:
        loop = asyncio.get_running_loop()
        slot, _ = self.pool.choose(job.ids)
        stream = slot.session.generate(job.ids, stream=True, **job.kwargs)
        assert isinstance(stream, GenerationStream)
        job._stream = stream
        job.started = True
        if job.cancelled:
            stream.cancel()
        done: asyncio.Future[tuple[GenerationResult, dict[str, Any]]] = loop.create_future()
        start = time.monotonic()

        def put(item: object) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
                loop.call_soon_threadsafe(job._queue.put_nowait, item)

        def finish(value: Any, error: BaseException | None) -> None:
            def settle() -> None:
                if done.done():
                    return
                if error is not None:
                    done.set_exception(error)
                else:
                    done.set_result(value)

            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(settle)

        def drive() -> None:
            """The worker thread: iterate the stream (the engine runs on its own thread
            and releases the GIL), then read what the session and the store hold."""
            try:
                for text in stream:
                    put(text)
                result = stream.result
                assert result is not None
                slot.tokens = slot.session.token_ids
                slot.prompt_len = len(job.ids)
                self.pool.measure()
                finish((result, self.model._engine.expert_stats()), None)
            except BaseException as e:
                slot.tokens = []
                slot.prompt_len = 0
                finish(None, e)

        threading.Thread(target=drive, name="colibri-serve", daemon=True).start()
        # Shielded: the engine's turn ends when the worker thread says so, not before.
        result, store = await asyncio.shield(done)
        seconds = time.monotonic() - start
        self._recent.append(seconds)
        job.outcome = Outcome(result, store, seconds, start - job._submitted)
        if self.on_finish is not None:
            self.on_finish(job)

    @property
    def closing(self) -> bool:
        """Whether :meth:`stop` or :meth:`close` was called."""
        return self._closing

    def stop(self) -> None:
        """Refuse new requests and cancel the running and queued ones (on the loop)."""
        self._closing = True
        for job in list(self._jobs):
            job.cancel()

    async def close(self) -> None:
        """:meth:`stop`, then wait for the generations to end."""
        self.stop()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
