"""Threads, signals and processes: the GIL is released during a forward, Ctrl-C stops a
generation (plain or streamed) within a forward, properties do not wait for a running
generation, concurrent calls are serialised, and a forked child gets a clear error."""

from __future__ import annotations

import signal
import threading
from pathlib import Path
from typing import Any

import colibri
import numpy as np
import pytest

# Python's own Ctrl-C handler around every test, as in a terminal (see conftest.py).
pytestmark = pytest.mark.usefixtures("_python_sigint_handler")


# ----------------------------------------------------------------------------- the GIL


def test_gil_is_released_during_a_forward(model: colibri.Model) -> None:
    """A counting thread advances during long ``logits`` calls (one native call each, no
    callbacks): if the GIL were held it would not move at all."""
    ids = list(range(1, 250))
    count = 0
    stop = threading.Event()

    def counter() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=counter)
    t.start()
    try:
        during = []
        for _ in range(3):
            before = count
            model.logits(ids)
            during.append(count - before)
        before = count
        model.generate("abc", max_new_tokens=200, temperature=0, stop_token_ids=[])
        gen_count = count - before
    finally:
        stop.set()
        t.join()
    assert min(during) > 1000, during
    assert gen_count > 10_000, gen_count


# ----------------------------------------------------------------------------- Ctrl-C


def ctrl_c() -> None:
    """What Ctrl-C does: SIGINT to the main thread (interrupting a blocking wait there)."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


class _EngineSpy:
    """Wraps ``_core.Engine`` to watch the per-forward callbacks of ``generate``."""

    def __init__(self, engine: Any, after: int, started: threading.Event) -> None:
        self._engine = engine
        self._after = after
        self._started = started
        self.fired = threading.Event()
        self.calls_after_fire = 0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, ids: list[int], request: Any, *, on_tokens: Any, **kw: Any) -> Any:
        def wrapped(toks: list[int], scored: Any) -> bool:
            self.calls += 1
            if self.fired.is_set():
                self.calls_after_fire += 1
            if self.calls == self._after:
                self._started.set()
            return bool(on_tokens(toks, scored))

        return self._engine.generate(ids, request, on_tokens=wrapped, **kw)


def test_keyboard_interrupt_stops_generation_and_model_stays_usable(
    model: colibri.Model, golden_a: dict[str, np.ndarray]
) -> None:
    """Ctrl-C (SIGINT) arrives once generation is 5 forwards in; the engine
    must stop within one more forward, raise KeyboardInterrupt, and stay usable."""
    started = threading.Event()
    spy = _EngineSpy(model._engine, 5, started)

    def interrupt() -> None:
        if started.wait(10):
            spy.fired.set()
            ctrl_c()

    real_engine = model._engine
    model._engine = spy
    timer = threading.Thread(target=interrupt)
    timer.start()
    raised = False
    try:
        model.generate("a", max_new_tokens=250, temperature=0, stop_token_ids=[], draft="off")
    except KeyboardInterrupt:
        raised = True
    finally:
        model._engine = real_engine
        timer.join()
    assert spy.fired.is_set()
    assert raised, "KeyboardInterrupt was not raised"
    assert spy.calls < 200, "generation ran to the end"
    assert spy.calls_after_fire <= 1, spy.calls_after_fire
    ids = [int(t) for t in golden_a["prompt_ids"]]
    out = model.generate(ids, max_new_tokens=32, temperature=0, stop_token_ids=[])
    assert out.token_ids == [int(t) for t in golden_a["greedy_ids"]]


def test_keyboard_interrupt_while_streaming(model: colibri.Model) -> None:
    """Ctrl-C reaches the consumer (main thread) while the engine runs on the worker; the
    stream stops the engine within one forward and keeps the partial result."""
    started = threading.Event()
    spy = _EngineSpy(model._engine, 5, started)

    def interrupt() -> None:
        if started.wait(10):
            spy.fired.set()
            ctrl_c()

    real_engine = model._engine
    model._engine = spy
    timer = threading.Thread(target=interrupt)
    timer.start()
    stream = model.generate("a", max_new_tokens=250, stream=True, stop_token_ids=[], draft="off")
    raised = False
    try:
        with stream:
            for _ in stream:
                pass
    except KeyboardInterrupt:
        raised = True
    finally:
        model._engine = real_engine
        timer.join()
    assert raised
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert spy.calls_after_fire <= 2, spy.calls_after_fire
    assert len(stream.result.token_ids) < 200
    assert model.generate("a", max_new_tokens=4, temperature=0).token_ids


# ----------------------------------------------------------------------------- threads


def test_properties_do_not_wait_for_a_running_generation(model: colibri.Model) -> None:
    """The engine holds its lock for a whole generation; Model's properties and info() must
    not need it (they would block holding the GIL that the generation's callbacks need)."""
    with model.generate("busy", stream=True, max_new_tokens=200, stop_token_ids=[]) as s:
        next(s)
        assert model.max_context == 256
        assert model.has_mtp
        assert model.eos_token_ids == [1]
        assert model.info()["config"]["vocab_size"] == 256


def test_concurrent_calls_are_serialised(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": []}
    prompts = ["alpha", "beta", "gamma", "delta"]
    want = {p: model.generate(p, **kw).token_ids for p in prompts}
    want_logits = model.logits([5, 6, 7])
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def work(p: str) -> None:
        try:
            for _ in range(2):
                results[p] = model.generate(p, **kw).token_ids
                np.testing.assert_array_equal(model.logits([5, 6, 7]), want_logits)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == want


# ----------------------------------------------------------------------------- fork


_FORK_SCRIPT = """
import os, sys
import colibri

model = colibri.Model(sys.argv[1])
want = model.generate("def", max_new_tokens=4, temperature=0).text
pid = os.fork()
if pid == 0:
    try:
        model.generate("def", max_new_tokens=4, temperature=0)
        code = 2
    except colibri.ForkedProcessError as e:
        code = 0 if "fork" in str(e) and "spawn" in str(e) else 3
    if sys.argv[2] == "os._exit" or code:
        os._exit(code)
    sys.exit(0)  # interpreter teardown drops the model in the child
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert model.generate("def", max_new_tokens=4, temperature=0).text == want
print("parent ok")
"""


@pytest.mark.parametrize("exit_how", ["os._exit", "normal"])
def test_a_forked_child_gets_a_clear_error(test_model_dir: Path, exit_how: str) -> None:
    """A model loaded before fork() refuses to run in the child (its threads stayed in the
    parent) with ForkedProcessError instead of hanging; the child exits cleanly either way
    (a normal exit drops the model during interpreter teardown), and the parent's model keeps
    working."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(test_model_dir), exit_how],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "parent ok" in done.stdout
