"""The streaming machinery: :class:`GenerationStream` (a generation's text, chunk by chunk,
from a worker thread) and the text side of each generation (incremental decoding, stop
strings, the text callback)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from tokenizers import Tokenizer

from colibri._text import IncrementalDecoder, StopMatcher
from colibri.errors import InternalError
from colibri.results import _ENGINE_FINISH_REASONS, GenerationResult, _stats

#: One generated token's log-probability row, as the engine reports it:
#: ``{"token": id, "logprob": float, "top": [(id, logprob), ...]}``.
ScoredRow = Mapping[str, Any]

#: Where a generation's text goes: ``on_text(delta, rows)`` gets each new piece of text
#: with the log-probability rows of the tokens it completes (empty without ``logprobs``);
#: False stops the generation.
TextSink = Callable[[str, list[ScoredRow]], bool]


class _Finished:
    def __init__(self, result: GenerationResult | None, error: BaseException | None) -> None:
        self.result = result
        self.error = error


class GenerationStream(Iterator[str]):
    """The text of a generation, chunk by chunk, as the engine accepts tokens.

    Iterate it for ``str`` chunks (several tokens' worth when drafts are accepted; never a
    partial UTF-8 character or a possible start of a stop string). Once exhausted,
    :attr:`result` holds the :class:`GenerationResult` (text, token ids, stats). Generation
    starts at the first ``next()`` and runs on a worker thread; :meth:`close` (or leaving a
    ``with`` block, or Ctrl-C while waiting) stops it within one forward, and :attr:`result`
    then describes the partial generation (``finish_reason == "cancelled"``). Abandoning the
    stream (``break`` out of a ``for`` loop over it, or dropping the last reference) stops it
    within one forward too, as a generator is closed when it is dropped.
    """

    def __init__(self, run: Callable[[TextSink, threading.Event], GenerationResult]) -> None:
        self._run = run
        self._queue: queue.Queue[tuple[str, list[ScoredRow]] | _Finished] = queue.Queue()
        self._cancel = threading.Event()
        self._thread: threading.Thread | None = None
        self._finished = False
        #: The complete result, set when the stream is exhausted or closed.
        self.result: GenerationResult | None = None
        #: The log-probability rows of the tokens the last chunk completed (with
        #: ``logprobs``; ``create_completion`` streams them with their text).
        self._rows: list[ScoredRow] = []

    def _start(self) -> None:
        # The worker must not reference the stream: a running thread is a GC root, and a
        # stream it kept alive could never be collected, so abandoning it (``break`` out of
        # the loop, ``del``) would not reach ``__del__`` and the generation would run on.
        self._thread = threading.Thread(
            target=_stream_worker,
            args=(self._run, self._queue, self._cancel),
            name="colibri-generate",
            daemon=True,
        )
        self._thread.start()

    def __iter__(self) -> Iterator[str]:
        # A ``for`` loop holds the only reference to the iterator it gets here, so leaving
        # the loop early drops it at once, and its ``finally`` stops the generation (an
        # iterator returning itself would leave it running while the stream is referenced).
        return self._chunks()

    def _chunks(self) -> Iterator[str]:
        try:
            while True:
                try:
                    chunk = self.__next__()
                except StopIteration:
                    return
                yield chunk
        finally:
            if not self._finished:
                self.close()

    def _scored_chunks(self) -> Iterator[tuple[str, list[ScoredRow]]]:
        """The chunks with the log-probability rows of the tokens each completes."""
        for text in self:
            yield text, self._rows

    def __next__(self) -> str:
        if self._finished:
            raise StopIteration
        if self._thread is None:
            self._start()
        while True:
            try:
                item = self._queue.get()
            except BaseException:  # KeyboardInterrupt while waiting: stop the engine too
                self.close()
                raise
            if isinstance(item, tuple):
                if item[0]:
                    self._rows = item[1]
                    return item[0]
                continue
            self._finish(item)
            raise StopIteration

    def _finish(self, item: _Finished) -> None:
        self._finished = True
        if self._thread is not None:
            self._thread.join()
        if item.error is not None:
            raise item.error
        self.result = item.result

    def cancel(self) -> None:
        """Ask the generation to stop within one forward, from any thread, without waiting.

        The consumer's iteration then ends (after the chunks already produced) and
        :attr:`result` has ``finish_reason == "cancelled"``; a server cancels a request whose
        client went away this way while another thread iterates the stream."""
        self._cancel.set()

    def close(self) -> None:
        """Stop the generation (within one forward) and wait for the engine to be free."""
        if self._finished:
            return
        self._cancel.set()
        if self._thread is None:
            self._finished = True
            return
        while True:
            item = self._queue.get()
            if isinstance(item, _Finished):
                if isinstance(item.error, Exception):
                    item.error = None  # the consumer asked to stop; errors after it are moot
                self._finish(item)
                return

    def __enter__(self) -> GenerationStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        # An abandoned stream (dropped or garbage-collected unfinished) stops its generation
        # within one forward; the next call on the model then waits at most that long.
        cancel = getattr(self, "_cancel", None)
        if cancel is not None:
            cancel.set()


def _stream_worker(
    run: Callable[[TextSink, threading.Event], GenerationResult],
    out: queue.Queue[tuple[str, list[ScoredRow]] | _Finished],
    cancel: threading.Event,
) -> None:
    """The body of a :class:`GenerationStream`'s worker thread (it holds no reference to the
    stream itself, see ``GenerationStream._start``)."""

    def on_text(delta: str, rows: list[ScoredRow]) -> bool:
        out.put((delta, rows))
        return not cancel.is_set()

    try:
        out.put(_Finished(run(on_text, cancel), None))
    except BaseException as e:  # handed to the consumer
        out.put(_Finished(None, e))


class _Lane:
    """One generation's text side: incremental decoding, stop strings, the text callback.

    With log-probabilities asked for and a text callback, each token's row goes out with
    the delta that completes the token's text (tokens are then decoded one at a time to
    know where each one's text ends); rows of tokens whose text never goes out (a stop
    string's, a stop token's) stay in :attr:`unsent` for the caller, who has the result."""

    def __init__(
        self,
        tokenizer: Tokenizer,
        p: Mapping[str, Any],
        on_text: TextSink | None,
        cancel: threading.Event | None,
    ) -> None:
        self.decoder = IncrementalDecoder(tokenizer)
        self.matcher = StopMatcher(p["stops"])
        self.include_stop = bool(p.get("include_stop_str_in_output"))
        # A stop token's text is left out unless stop strings are kept (vLLM's rule; EOS,
        # a special token, has no text either way).
        self.hidden: set[int] = set() if self.include_stop else set(p["stop_ids"])
        self.on_text = on_text
        self.cancel = cancel
        self.shown = 0
        self.stopped_by_string = False
        #: Rows not yet sent with a delta: ``[end, row]``, ``end`` the text length once the
        #: token's text is whole (None while it is not).
        self.unsent: list[list[Any]] = []

    def _push(self, new_ids: list[int], scored: list[ScoredRow] | None) -> None:
        if scored is None or self.on_text is None:
            self.decoder.push([t for t in new_ids if t not in self.hidden])
            return
        for t, row in zip(new_ids, scored, strict=True):
            if t not in self.hidden:
                self.decoder.push([t])
            self.unsent.append([None, row])
            if not self.decoder.pending:
                self._settle_ends()

    def _settle_ends(self) -> None:
        end = len(self.decoder.text)
        for entry in reversed(self.unsent):
            if entry[0] is not None:
                break
            entry[0] = end

    def _send(self, upto: int) -> bool:
        """The text up to ``upto`` out, with the rows of the tokens it completes."""
        rows: list[ScoredRow] = []
        while self.unsent and self.unsent[0][0] is not None and self.unsent[0][0] <= upto:
            rows.append(self.unsent.pop(0)[1])
        assert self.on_text is not None
        keep_going = self.on_text(self.decoder.text[self.shown : upto], rows)
        self.shown = upto
        return keep_going

    def on_tokens(self, new_ids: list[int], scored: list[ScoredRow] | None = None) -> bool:
        """The engine's callback (``scored``: the tokens' log-probability rows, when asked
        for): False stops the generation (a stop string, a cancel)."""
        if self.cancel is not None and self.cancel.is_set():
            return False
        self._push(new_ids, scored)
        text = self.decoder.text
        cut = self.matcher.check(text, self.shown)
        if cut is not None:
            self.stopped_by_string = True
            if self.include_stop:
                cut += self.matcher.length_at(text, cut)
            if self.on_text is not None and cut > self.shown:
                self._send(cut)
            self.shown = cut
            return False
        if self.on_text is not None:
            upto = self.matcher.safe_len(text)
            if upto > self.shown:
                return self._send(upto)
        return True

    def result(self, raw: Mapping[str, Any]) -> GenerationResult:
        """The result of the engine's answer ``raw``."""
        reason = str(raw["finish_reason"])
        if reason not in _ENGINE_FINISH_REASONS:
            raise InternalError(f"the engine returned an unknown finish reason {reason!r}")
        finish = _ENGINE_FINISH_REASONS[reason]
        if self.stopped_by_string:
            text = self.decoder.text[: self.shown]
            finish = "stop"
        else:
            self.decoder.flush()
            self._settle_ends()
            text = self.decoder.text
            if self.on_text is not None and len(text) > self.shown:
                self._send(len(text))
        scored = raw.get("logprobs")
        prompt = raw.get("prompt_logprobs")
        return GenerationResult(
            text=text,
            token_ids=[int(t) for t in raw["tokens"]],
            finish_reason=finish,
            stats=_stats(raw["stats"]),
            logprobs=None if scored is None else [float(r["logprob"]) for r in scored],
            top_logprobs=None
            if scored is None
            else [[(int(t), float(lp)) for t, lp in r["top"]] for r in scored],
            prompt_logprobs=None
            if prompt is None
            else [None, *(float(r["logprob"]) for r in prompt)],
            prompt_top_logprobs=None
            if prompt is None
            else [[], *([(int(t), float(lp)) for t, lp in r["top"]] for r in prompt)],
        )
