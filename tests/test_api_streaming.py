"""``generate(stream=True)`` and the text it streams: chunks equal the result, multi-token
bursts, abandoning and cancelling a stream, errors reaching the consumer, the UTF-8-safe
incremental decoder on random bytes, and the prefill progress callback."""

from __future__ import annotations

import gc
import time
from pathlib import Path
from typing import Any

import colibri
import numpy as np
import pytest
from colibri._text import IncrementalDecoder
from tokenizers import Tokenizer

# Python's own Ctrl-C handler around every test, as in a terminal (see conftest.py).
pytestmark = pytest.mark.usefixtures("_python_sigint_handler")


# ----------------------------------------------------------------------------- streaming


def test_stream_concatenation_equals_the_result(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 120, "temperature": 0, "stop_token_ids": []}
    full = model.generate("Once upon a time", **kw)
    chunks = list(model.generate("Once upon a time", stream=True, **kw))
    assert chunks and all(isinstance(c, str) and c for c in chunks)
    assert "".join(chunks) == full.text
    # Random bytes: the held-back incomplete sequences are real in this output.
    assert len(chunks) < len(full.token_ids)


def test_stream_yields_multi_token_bursts(model: colibri.Model) -> None:
    """With drafts accepted, one verify forward hands several tokens to the callback and
    the stream yields them as one chunk."""
    bursts: list[int] = []
    original = model._run

    def spy(p: Any, on_text: Any, cancel: Any = None) -> Any:
        def counting(delta: str, rows: Any) -> bool:
            bursts.append(len(delta))
            return bool(on_text(delta, rows))

        return original(p, counting, cancel)

    ids = list(range(65, 75)) * 6  # a repetitive prompt the n-gram drafter can exploit
    model._run = spy  # type: ignore[method-assign]
    try:
        chunks = list(
            model.generate(
                ids,
                stream=True,
                max_new_tokens=150,
                temperature=0,
                stop_token_ids=[],
                draft="ngram",
                draft_depth=4,
            )
        )
    finally:
        del model._run
    full = model.generate(
        ids, max_new_tokens=150, temperature=0, stop_token_ids=[], draft="ngram", draft_depth=4
    )
    assert "".join(chunks) == full.text
    assert sum(full.stats.drafts_accepted) > 0
    # Fewer forwards than tokens, so some callbacks carried several tokens.
    assert full.stats.forwards < full.stats.generated_tokens
    assert len(chunks) <= full.stats.forwards


def test_stream_result_after_exhaustion(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 50, "temperature": 0, "draft": "mtp"}
    full = model.generate("stream result", **kw)
    stream = model.generate("stream result", stream=True, **kw)
    assert isinstance(stream, colibri.model.GenerationStream)
    assert stream.result is None
    text = "".join(stream)
    assert stream.result is not None
    assert stream.result.text == text == full.text
    assert stream.result.token_ids == full.token_ids
    assert stream.result.finish_reason == full.finish_reason
    assert stream.result.stats.generated_tokens == full.stats.generated_tokens
    assert list(stream) == []  # exhausted stays exhausted


def test_stream_can_be_abandoned(model: colibri.Model) -> None:
    with model.generate("abc", stream=True, max_new_tokens=200, stop_token_ids=[]) as it:
        first = next(it)
        assert first
    # Closing stopped the engine early and left the partial result.
    assert it.result is not None
    assert it.result.finish_reason == "cancelled"
    assert len(it.result.token_ids) < 200
    assert it.result.text.startswith(first)
    # The model is free again.
    assert model.generate("abc", max_new_tokens=3, temperature=0).token_ids


class _SlowEngine:
    """Wraps ``_core.Engine`` so each forward's callback takes ``delay`` seconds (a long
    generation on a tiny model) and records every generation's finish reason and length."""

    def __init__(self, engine: Any, delay: float) -> None:
        self._engine = engine
        self._delay = delay
        self.finished: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, ids: list[int], request: Any, *, on_tokens: Any, **kw: Any) -> Any:
        def slow(toks: list[int], scored: Any) -> bool:
            time.sleep(self._delay)
            return bool(on_tokens(toks, scored))

        raw = self._engine.generate(ids, request, on_tokens=slow, **kw)
        self.finished.append((str(raw["finish_reason"]), len(raw["tokens"])))
        return raw


@pytest.mark.parametrize("how", ["break", "break-held", "raise-held", "del", "gc"])
def test_abandoned_stream_cancels_its_generation(model: colibri.Model, how: str) -> None:
    """Breaking out of ``for chunk in generate(stream=True)`` (or an exception in the loop's
    body, or dropping the stream) stops the engine within a forward, even while a variable
    still holds the stream: the abandoned generation does not run to ``max_new_tokens`` and
    the next call does not wait for it."""
    slow = _SlowEngine(model._engine, 0.01)  # 250 forwards: 2.5 s if it ran to the end
    real_engine = model._engine
    model._engine = slow
    try:
        kw: dict[str, Any] = {"max_new_tokens": 250, "stop_token_ids": [], "draft": "off"}
        held = None
        if how == "break":
            for chunk in model.generate("abc", stream=True, **kw):
                assert chunk
                break
        elif how == "break-held":
            held = model.generate("abc", stream=True, **kw)
            for chunk in held:
                assert chunk
                break
        elif how == "raise-held":
            held = model.generate("abc", stream=True, **kw)
            with pytest.raises(KeyError):
                for _chunk in held:
                    raise KeyError("the consumer failed")
        else:
            stream = model.generate("abc", stream=True, **kw)
            assert next(stream)
            if how == "gc":  # only the cycle collector can reclaim it
                stream.cycle = stream  # type: ignore[attr-defined]
            del stream
            gc.collect()
        t0 = time.perf_counter()
        out = model.generate("abc", max_new_tokens=2, temperature=0)
        waited = time.perf_counter() - t0
    finally:
        model._engine = real_engine
    assert len(out.token_ids) == 2
    assert waited < 1.0, f"the second call waited {waited:.2f}s for the abandoned one"
    reason, n = slow.finished[0]
    assert reason == "cancelled" and n < 50, slow.finished
    if held is not None:  # still referenced: its result is the partial generation
        assert held.result is not None and held.result.finish_reason == "cancelled"
        assert next(held, None) is None


def test_stream_read_with_next_goes_on_after_a_pause(model: colibri.Model) -> None:
    """Only a ``for`` loop's own iterator closes the stream: ``next()`` calls, and a second
    loop over what is left, read the whole generation."""
    kw: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0, "draft": "off"}
    whole = model.generate("abc", **kw).text
    stream = model.generate("abc", stream=True, **kw)
    head = next(stream)
    rest = "".join(stream)
    assert head + rest == whole
    assert stream.result is not None and stream.result.finish_reason != "cancelled"


def test_stream_errors_reach_the_consumer(model: colibri.Model) -> None:
    def boom(p: Any, on_text: Any, cancel: Any = None) -> Any:
        raise colibri.InternalError("boom")

    model._run = boom  # type: ignore[method-assign]
    try:
        with pytest.raises(colibri.InternalError, match="boom"):
            list(model.generate("abc", stream=True, max_new_tokens=4))
    finally:
        del model._run


# ----------------------------------------------------------------------------- incremental decoding


def byte_tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_incremental_decoder_splits_multibyte_chars(test_model_dir: Path) -> None:
    tok = byte_tokenizer(test_model_dir)
    text = "é€😀 ok ñ"
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    dec = IncrementalDecoder(tok)
    deltas = [dec.push([i]) for i in ids]
    deltas.append(dec.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == dec.text
    # The 4-byte emoji appears exactly once, whole, on its last byte.
    assert deltas[len("é€".encode()) + 3] == "😀"


def test_incremental_decoder_on_random_bytes(test_model_dir: Path) -> None:
    tok = byte_tokenizer(test_model_dir)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = [int(i) for i in rng.integers(0, 256, size=40)]
        dec = IncrementalDecoder(tok)
        pieces, k = [], 0
        while k < len(ids):
            n = int(rng.integers(1, 4))
            pieces.append(dec.push(ids[k : k + n]))
            k += n
        pieces.append(dec.flush())
        assert "".join(pieces) == tok.decode(ids)


# ----------------------------------------------------------------------------- prefill progress


def test_prefill_progress_reports_each_chunk_and_changes_nothing() -> None:
    m = colibri.Model(threads=1)  # the embedded model: a context of 1,100 tokens fits
    prompt = [(7 * i) % 4000 + 3 for i in range(1100)]
    seen: list[tuple[int, int]] = []
    kw: dict[str, Any] = {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": []}
    with_bar = m.session().generate(prompt, prefill_progress=lambda d, t: seen.append((d, t)), **kw)
    assert seen == [(512, 1100), (1024, 1100), (1100, 1100)]
    alone = colibri.Model(threads=1).session().generate(prompt, **kw)
    assert with_bar.token_ids == alone.token_ids

    # A callback that raises stops the prefill with its exception, the model still usable.
    def boom(done: int, total: int) -> None:
        raise RuntimeError("stop here")

    s = m.session()
    with pytest.raises(RuntimeError, match="stop here"):
        s.generate(prompt, prefill_progress=boom, **kw)
    assert s.kv_tokens == 0
    assert m.generate([5, 6], **kw).token_ids
    with pytest.raises(colibri.InvalidArgumentError, match="prefill_progress"):
        m.generate([5, 6], prefill_progress=3, **kw)  # type: ignore[call-overload]
