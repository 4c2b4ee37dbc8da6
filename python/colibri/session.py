"""``Session``: one conversation on a :class:`colibri.Model`, with its own KV cache."""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from colibri import _core
from colibri.errors import InvalidArgumentError
from colibri.results import GenerationResult
from colibri.sampling import GenerateOptions, SamplingParams, Unpack
from colibri.stream import GenerationStream

if TYPE_CHECKING:
    from colibri.model import Model

__all__ = ["Session"]


def _context_path(path: object) -> str:
    """A saved context's path as text: a ``str``, ``bytes`` or ``os.PathLike``; anything
    else is an :class:`InvalidArgumentError`."""
    if isinstance(path, (str, bytes, os.PathLike)):
        text = os.fsdecode(path)
        if text:
            return text
    raise InvalidArgumentError(
        f"invalid value for 'path': {path!r}; expected a file path (str or os.PathLike)"
    )


class Session:
    """One conversation on a :class:`Model` (from :meth:`Model.session` or
    :meth:`Model.load_session`) with its own KV cache, so several conversations each reuse
    their own earlier turns.

    :meth:`generate` and :meth:`chat` take the keywords of :meth:`Model.generate`. Calls are
    serialised with the model's other calls. While other sessions generate, this one's cache
    counts against the model's ``idle_session_budget``; beyond it the least recently used
    sessions are written to disk (:attr:`evicted`) and read back on their next call.
    :meth:`save` writes the context to a file that :meth:`Model.load_session` reads back,
    here or in another process, so a long system prompt or document is prefilled once.

    Example:
        >>> import colibri, os, tempfile
        >>> m = colibri.Model()
        >>> s = m.session()
        >>> s.prefill("import os, sys")
        >>> path = os.path.join(tempfile.mkdtemp(), "prompt.ctx")
        >>> _ = s.save(path)
        >>> m.load_session(path).kv_tokens == s.kv_tokens
        True
    """

    def __init__(self, model: Model, core: _core.Session | None = None) -> None:
        self._model = model
        self._core = model._engine.new_session() if core is None else core

    def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        stream: bool = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult | GenerationStream:
        """:meth:`Model.generate` on this session's cache (one prompt, no ``n``)."""
        return self._model._start(prompt, sampling_params, stream, options, self._core)

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        stream: bool = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult | GenerationStream:
        """:meth:`Model.chat` on this session's cache (no ``n`` or tools)."""
        ids = self._model._chat_ids(messages)
        return self._model._start(ids, sampling_params, stream, options, self._core)

    def prefill(self, prompt: str | Sequence[int]) -> None:
        """Compute ``prompt``'s KV into the session without generating, so a later
        :meth:`generate` whose prompt starts with it (or a :meth:`save`) reuses it."""
        once: GenerateOptions = {"max_new_tokens": 1, "temperature": 0.0, "stop_token_ids": []}
        self._model._start(prompt, None, False, once, self._core)

    def save(self, path: str | os.PathLike[str]) -> int:
        """Write the session's context (KV caches and tokens) to ``path`` atomically; returns
        the bytes written. The file is only valid for this model (its fingerprint is checked
        on load)."""
        file = _context_path(path)
        with self._model._lock:
            return int(self._model._engine.save_session(file, self._core))

    @property
    def token_ids(self) -> list[int]:
        """The tokens of context the session holds (its prompts and outputs so far)."""
        return [int(t) for t in self._core.tokens()]

    @property
    def kv_tokens(self) -> int:
        """Tokens of context the session's KV cache holds."""
        return int(self._core.kv_tokens)

    @property
    def kv_bytes(self) -> int:
        """Bytes the session's KV cache holds in RAM (0 while evicted to disk)."""
        return int(self._core.kv_bytes)

    @property
    def evicted(self) -> bool:
        """Whether the cache was written to disk under the idle-session budget (it comes back
        on the next call)."""
        return bool(self._core.evicted)

    def reset(self) -> None:
        """Forget the conversation: the next call prefills from scratch."""
        self._core.reset()
