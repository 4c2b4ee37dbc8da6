"""``Model.generate`` and what runs it: the keywords checked into the engine's request
(:meth:`GenerationMixin._params`), one generation, a batch, the server's continuous batch,
and a session's turn. :class:`colibri.Model` inherits it (through
:class:`colibri._chat_api.ChatMixin`)."""

from __future__ import annotations

import os
import threading
import warnings
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, overload

from colibri.errors import InvalidArgumentError
from colibri.results import GenerationResult
from colibri.sampling import (
    GENERATE_KEYWORDS,
    SAMPLING_FIELDS,
    GenerateOptions,
    SamplingParams,
    Unpack,
)
from colibri.stream import GenerationStream, ScoredRow, TextSink, _Lane
from colibri.validation import (
    _DRAFT_MODES,
    _check_bool,
    _check_choice,
    _check_depth,
    _check_int,
    _check_processing,
    _check_seed,
    _check_stop_ids,
    _check_stops,
    _check_temperature,
    _check_top_p,
    _choices,
    _guided_argument,
    _is_batch,
    check_engine_request,
)

if TYPE_CHECKING:
    from pathlib import Path

    from tokenizers import Tokenizer

    from colibri._pin_mtp import PinMtpChoice
    from colibri.session import Session
    from colibri.validation import DraftMode

__all__ = ["BatchEntry", "GenerationMixin"]


class GenerationMixin:
    """``generate`` and its machinery; the model's state (engine, tokenizer, defaults) is
    :class:`colibri.Model`'s."""

    if TYPE_CHECKING:
        _engine: Any
        _lock: threading.Lock
        _generation_config: dict[str, Any]
        tokenizer: Tokenizer
        path: Path
        default_max_new_tokens: int
        default_draft: DraftMode
        default_draft_depth: int
        _pin_mtp: PinMtpChoice

        @property
        def max_context(self) -> int: ...
        @property
        def eos_token_ids(self) -> list[int]: ...
        def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]: ...
        def _check_token(self, name: str, value: object) -> int: ...

    # ----------------------------------------------------------------------------- generate
    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        n: int,
        stream: Literal[False] = False,
        **options: Unpack[GenerateOptions],
    ) -> list[GenerationResult]: ...

    @overload
    def generate(
        self,
        prompt: list[str] | list[list[int]],
        sampling_params: SamplingParams | None = None,
        *,
        stream: Literal[False] = False,
        **options: Unpack[GenerateOptions],
    ) -> list[GenerationResult]: ...

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        stream: Literal[False] = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult: ...

    @overload
    def generate(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None = None,
        *,
        stream: Literal[True],
        **options: Unpack[GenerateOptions],
    ) -> GenerationStream: ...

    def generate(
        self,
        prompt: str | Sequence[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | None = None,
        *,
        n: int | None = None,
        stream: bool = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult | GenerationStream | list[GenerationResult]:
        """Continue ``prompt`` (text or token ids), or every prompt of a list of them.

        A list of prompts returns a list of results: each prompt gets a fresh session and
        their decode forwards are shared (batched decode: an expert any of them routes to is
        read once for all; each drafts on its own and its drafts are verified in the shared
        forward), each result the one the prompt gets alone.

        Args:
            sampling_params: a :class:`SamplingParams` holding any of the keywords below
                (vLLM style); a keyword given as well must not repeat one of its fields.
            **options: any keyword of :class:`~colibri.GenerateOptions` (the sampling
                fields of :class:`~colibri.SamplingOptions`: ``max_tokens``,
                ``temperature``, ``top_k``, ``top_p``, ``min_p``, ``seed``, ``stop``,
                ``stop_token_ids``, ``ignore_eos``, the penalties, ``logit_bias``,
                ``min_tokens``, ``logprobs``, ``prompt_logprobs``, ``guided_*``; and
                ``max_new_tokens``, ``prefill_progress``, ``draft``, ``draft_depth``), each
                documented there. ``None`` means "not given".
            n: generate this many completions of the prompt (vLLM's and OpenAI's ``n``) and
                return them as a list: they decode together (batched decode), completion i
                sampled with seed ``seed + i`` (so completion 0 is the one ``n=1`` gives).
            stream: if true, return a :class:`GenerationStream`: an iterator of text chunks
                yielded as tokens are accepted, whose ``result`` is set once it is exhausted.

        Every logit processing step (bias, penalties, ``min_tokens``, the ``guided_*`` mask)
        runs in the Rust sampler on every row it picks from, verify rows included:
        speculative decoding stays lossless with them.

        Returns:
            A :class:`GenerationResult`, or with ``stream=True`` a :class:`GenerationStream`.
        """
        kw = _check_keywords(options)
        choices = _choices(n, sampling_params)
        if choices > 1:
            if _is_batch(prompt):
                raise InvalidArgumentError(
                    f"invalid value for 'n': {choices} completions take one prompt"
                )
            return self._n_results(prompt, sampling_params, kw, choices, stream)
        if _is_batch(prompt):
            if stream:
                raise InvalidArgumentError(
                    "stream=True takes one prompt; a list of prompts returns a list of results"
                )
            return self._run_batch([self._params(p, sampling_params, kw) for p in prompt])
        return self._launch(self._params(prompt, sampling_params, kw), stream)

    def _n_results(
        self,
        prompt: str | Sequence[int],
        sampling_params: object,
        kw: Mapping[str, Any],
        choices: int,
        stream: bool,
    ) -> list[GenerationResult]:
        """``choices`` completions of one prompt, decoded together; completion i sampled
        with seed ``seed + i``."""
        if stream:
            raise InvalidArgumentError(
                f"invalid value for 'n': {choices} completions take stream=False"
            )
        base = self._params(prompt, sampling_params, kw)
        return self._run_batch(
            [{**base, "seed": (base["seed"] + i) % 2**64} for i in range(choices)]
        )

    def _params(
        self,
        prompt: str | Sequence[int],
        sampling_params: object,
        keywords: Mapping[str, Any],
    ) -> dict[str, Any]:
        """The engine's arguments for ``prompt``, from ``sampling_params`` and the call's
        keywords (``None`` = not given), validated."""
        given: dict[str, Any] = {}
        if sampling_params is not None:
            if not isinstance(sampling_params, SamplingParams):
                raise InvalidArgumentError(
                    f"invalid value for 'sampling_params': {sampling_params!r}; expected a "
                    "colibri.SamplingParams"
                )
            given.update(sampling_params.fields())
        if keywords.get("max_new_tokens") is not None and keywords.get("max_tokens") is not None:
            raise InvalidArgumentError(
                "give 'max_new_tokens' or 'max_tokens' (the same thing), not both"
            )
        for name, value in keywords.items():
            if value is None:
                continue
            field_name = "max_tokens" if name == "max_new_tokens" else name
            if field_name in given:
                raise InvalidArgumentError(
                    f"'{name}' is given both as a keyword and in sampling_params; give it once"
                )
            given[field_name] = value
        max_new_tokens = given.get("max_tokens")
        temperature = given.get("temperature")
        top_k = given.get("top_k")
        top_p = given.get("top_p")
        seed = given.get("seed")
        stop = given.get("stop")
        stop_token_ids = given.get("stop_token_ids")
        draft = given.get("draft")
        draft_depth = given.get("draft_depth")
        ids = self._prompt_ids(prompt)
        if max_new_tokens is None:
            max_new_tokens = self.default_max_new_tokens
        n = _check_int("max_new_tokens", max_new_tokens, minimum=1)
        gc = self._generation_config
        sampling = bool(gc.get("do_sample", False))
        ignored = [k for k in ("top_k", "top_p", "min_p", "seed") if given.get(k) is not None]
        given_temperature = temperature
        if temperature is None:
            temperature = float(gc.get("temperature", 1.0)) if sampling else 0.0
        if top_k is None:
            top_k = int(gc.get("top_k", 0)) if sampling else 0
        if top_p is None:
            top_p = float(gc.get("top_p", 1.0)) if sampling else 1.0
        temperature = _check_temperature(temperature)
        top_p = _check_top_p(top_p)
        top_k = _check_int("top_k", top_k, minimum=0)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        seed = _check_seed(seed)
        stops = _check_stops(stop)
        if stop_token_ids is None:
            stop_ids = self.eos_token_ids
        else:
            stop_ids = _check_stop_ids(stop_token_ids, self._check_token)
        if given.get("ignore_eos") is not None and _check_bool("ignore_eos", given["ignore_eos"]):
            stop_ids = [t for t in stop_ids if t not in self.eos_token_ids]
        processing = {
            **_check_processing(given, self._check_token),
            "grammar": self._grammar(given),
        }
        if processing["grammar"] is not None and not stop_ids:
            raise InvalidArgumentError(
                "a guided_* constraint ends the generation with a stop token once its text is "
                "complete, and this generation has none (ignore_eos=True or stop_token_ids=[]); "
                "give a stop token id"
            )
        d = self.default_draft if draft is None else _check_choice("draft", draft, _DRAFT_MODES)
        if d == "auto" and not self._pin_mtp.mtp_drafting:
            # pin_mtp="auto" could not keep the MTP layer resident: MTP drafting starts
            # disabled (its every draft and absorbed row would be read from disk).
            d = "ngram"
        depth = self.default_draft_depth if draft_depth is None else _check_depth(draft_depth)
        if len(ids) >= self.max_context:
            raise InvalidArgumentError(
                f"invalid value for 'prompt': {len(ids)} tokens leave no room to generate in "
                f"this model's max_context ({self.max_context} tokens); shorten the prompt or "
                "open the model with a larger max_context"
            )
        # Generation ends at the context limit like at max_new_tokens (finish_reason "length").
        n = min(n, self.max_context - len(ids))
        request = {
            "ids": ids,
            "max_new_tokens": n,
            "temperature": float(temperature),
            "top_k": top_k,
            "top_p": float(top_p),
            "seed": seed,
            "stops": stops,
            "include_stop_str_in_output": given.get("include_stop_str_in_output") is not None
            and _check_bool("include_stop_str_in_output", given["include_stop_str_in_output"]),
            "draft": d,
            "draft_depth": depth,
            "stop_ids": stop_ids,
            **processing,
        }
        # Any other sampling field goes to the engine as it is (the engine checks it): a
        # field declared in colibri.sampling and the engine's GenerateRequest needs nothing here.
        for name in SAMPLING_FIELDS:
            if name not in _SHAPED_HERE and given.get(name) is not None:
                request[name] = given[name]
        check_engine_request(_engine_request(request))
        if temperature == 0 and ignored:  # only once every argument is known to be valid
            names = ", ".join(repr(k) for k in ignored)
            why = (
                "temperature=0"
                if given_temperature is not None
                else "no temperature was given and generation_config.json does not sample"
            )
            warnings.warn(
                f"{names} ignored: this generation is greedy ({why}); pass a temperature > 0 "
                "to sample with them",
                UserWarning,
                stacklevel=_caller_stacklevel(),
            )
        return request

    def _grammar(self, given: Mapping[str, Any]) -> tuple[str, str] | None:
        """The engine's ``grammar`` argument, ``(kind, text)``, of the ``guided_*`` keywords;
        gives the engine the vocabulary on first use."""
        argument = _guided_argument(given)
        if argument is None:
            return None
        if not self._engine.has_vocabulary:
            text = (self.path / "tokenizer.json").read_text(encoding="utf-8")
            self._engine.load_vocabulary(text)
        return argument

    def _run(
        self,
        p: Mapping[str, Any],
        on_text: TextSink | None,
        cancel: threading.Event | None = None,
    ) -> GenerationResult:
        lane = _Lane(self.tokenizer, p, on_text, cancel)
        with self._lock:
            raw: dict[str, Any] = self._engine.generate(
                p["ids"],
                _engine_request(p),
                on_tokens=lane.on_tokens,
                session=p.get("session"),
                prefill_progress=p["prefill_progress"],
            )
        return lane.result(raw)

    def _run_batch(self, params: Sequence[Mapping[str, Any]]) -> list[GenerationResult]:
        """Several generations at once, each on a fresh session, their decode forwards
        shared (batched decode)."""
        lanes = [_Lane(self.tokenizer, p, None, None) for p in params]
        with self._lock:
            sessions = [self._engine.new_session() for _ in params]
            raw = self._engine.generate_batch(
                [{"ids": p["ids"], **_engine_request(p)} for p in params],
                sessions,
                lambda i, ids, scored: lanes[i].on_tokens(ids, scored),
            )
        for r in raw:
            if isinstance(r, BaseException):
                raise r
        return [lane.result(r) for lane, r in zip(lanes, raw, strict=True)]

    def _run_continuous(
        self,
        admit: Callable[[int], Sequence[BatchEntry]],
        on_done: Callable[[int, GenerationResult | BaseException], None],
    ) -> None:
        """A continuous batch (``colibri serve``): before every forward ``admit(running)``
        returns the generations to start (prepared by :meth:`_params`, each on its own
        session); each streams its text through its ``on_text`` and ends through
        ``on_done(id, result or error)``. Returns once nothing runs and nothing is
        admitted."""
        lanes: dict[int, _Lane] = {}
        progress: dict[int, Callable[[list[int]], None]] = {}

        def admit_core(live: int) -> list[tuple[int, dict[str, Any], Any]]:
            out = []
            for entry in admit(live):
                lanes[entry.id] = _Lane(self.tokenizer, entry.params, entry.on_text, entry.cancel)
                if entry.on_tokens is not None:
                    progress[entry.id] = entry.on_tokens
                request = {"ids": entry.params["ids"], **_engine_request(entry.params)}
                out.append((entry.id, request, entry.session._core))
            return out

        def on_tokens(i: int, ids: list[int], scored: list[ScoredRow] | None) -> bool:
            hook = progress.get(i)
            if hook is not None:
                hook(ids)
            return lanes[i].on_tokens(ids, scored)

        def finished(i: int, raw: Any) -> None:
            lane = lanes.pop(i)
            progress.pop(i, None)
            if isinstance(raw, BaseException):
                on_done(i, raw)
                return
            try:
                result = lane.result(raw)
            except BaseException as e:  # handed to the request
                on_done(i, e)
                return
            on_done(i, result)

        with self._lock:
            self._engine.run_batch(admit_core, on_tokens, finished)

    def _launch(self, params: dict[str, Any], stream: bool) -> GenerationResult | GenerationStream:
        """Run prepared ``params``: now, or as a :class:`GenerationStream`."""
        if stream:
            if params["grammar"] is not None:  # a bad constraint is an error of this call
                self._engine.check_grammar(*params["grammar"])
            return GenerationStream(lambda on_text, cancel: self._run(params, on_text, cancel))
        return self._run(params, on_text=None)

    def _start(
        self,
        prompt: str | Sequence[int],
        sampling_params: SamplingParams | None,
        stream: bool,
        options: Mapping[str, Any],
        session: object,
    ) -> GenerationResult | GenerationStream:
        """``generate(prompt, sampling_params, stream=stream, **options)`` on ``session``'s
        caches."""
        params = self._params(
            prompt, sampling_params, _check_keywords(options, "sampling_params, stream")
        )
        params["session"] = session
        return self._launch(params, stream)


#: The sampling fields :meth:`Model._params` turns into the engine's request itself (a name,
#: a default, text or token ids to resolve); the others pass to the engine as given.
_SHAPED_HERE = frozenset(
    {
        "max_tokens",
        "temperature",
        "top_k",
        "top_p",
        "seed",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "include_stop_str_in_output",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
        "logit_bias",
        "min_tokens",
        "logprobs",
        "prompt_logprobs",
        "guided_json",
        "guided_regex",
        "guided_grammar",
    }
)


def _engine_request(p: Mapping[str, Any]) -> dict[str, Any]:
    """The engine's request (``GenerateRequest``'s fields) of a checked generation
    (:meth:`Model._params`): everything but what stays on the Python side (the prompt, the
    stop strings and whether they stay in the text, the session, the progress callback)."""
    python_side = ("ids", "stops", "include_stop_str_in_output", "session", "prefill_progress")
    return {k: v for k, v in p.items() if k not in python_side}


@dataclass
class BatchEntry:
    """A generation for :meth:`Model._run_continuous`: its id, its checked parameters
    (:meth:`Model._params`), the session it runs on, where its text goes (``on_text``
    returns False to stop it) and an event that cancels it."""

    id: int
    params: Mapping[str, Any]
    session: Session
    on_text: TextSink | None
    cancel: threading.Event | None
    #: Called with each burst of generated token ids as the engine emits them (live
    #: progress: the server's ``/stats``), before the text is decoded.
    on_tokens: Callable[[list[int]], None] | None = None


#: The modules of ``Model``'s and ``Session``'s methods: a warning points past their frames.
_API_MODULES = frozenset(
    {"colibri.model", "colibri._generation", "colibri._chat_api", "colibri.session"}
)


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside this module
    (the user's ``generate``/``chat`` call)."""
    import sys

    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") in _API_MODULES:
        level += 1
        frame = frame.f_back  # type: ignore[assignment]
    return level


def _check_keywords(
    options: Mapping[str, Any], others: str = "sampling_params, n, stream"
) -> dict[str, Any]:
    """``generate``'s keyword arguments (:class:`GenerateOptions`); one it does not take is
    an :class:`InvalidArgumentError` listing those it does (``others`` besides them)."""
    unknown = sorted(set(options) - set(GENERATE_KEYWORDS))
    if unknown:
        raise InvalidArgumentError(
            f"invalid keyword {unknown[0]!r}; generate takes {', '.join(GENERATE_KEYWORDS)}"
            f", {others}"
        )
    return dict(options)
