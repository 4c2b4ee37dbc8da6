"""``colibri.Model``: load a model, generate text, chat, and inspect logits."""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
from tokenizers import Tokenizer

from colibri import _core
from colibri._hub import resolve_model_dir
from colibri._text import IncrementalDecoder, StopMatcher
from colibri.errors import ColibriError, InvalidArgumentError, ModelNotFoundError

DraftMode = Literal["auto", "mtp", "ngram", "off"]
IoMode = Literal["auto", "mmap", "pread", "direct"]
PrefetchMode = Literal["auto", "off", "hint", "real"]

_DRAFT_MODES = ("auto", "mtp", "ngram", "off")
_IO_MODES = ("auto", "mmap", "pread", "direct")
_PREFETCH_MODES = ("auto", "off", "hint", "real")


@dataclass(frozen=True)
class GenerationStats:
    """What one generation cost and how speculation and the expert store behaved."""

    prompt_tokens: int
    generated_tokens: int
    #: Main-model forwards (prefill counts as one).
    forwards: int
    #: Generated tokens per decode forward (1.0 without drafting).
    tokens_per_forward: float
    #: Decode speed, excluding prefill.
    tokens_per_second: float
    prefill_seconds: float
    decode_seconds: float
    #: Draft tokens proposed / accepted, indexed by depth (index 0 is depth 1).
    drafts_proposed: list[int]
    drafts_accepted: list[int]
    acceptance_rate: float
    draft_seconds: float
    verify_seconds: float
    expert_hits: int
    expert_misses: int
    expert_bytes_read: int
    prefetch_recall: float | None
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationResult:
    """The output of :meth:`Model.generate`."""

    text: str
    token_ids: list[int]
    #: ``"length"`` (max_new_tokens), ``"stop"`` (EOS or a stop string) or ``"cancelled"``.
    finish_reason: str
    stats: GenerationStats

    def __str__(self) -> str:
        return self.text


def _check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(
            f"invalid value for '{name}': {value!r}; expected one of {', '.join(choices)}"
        )
    return value


def _check_int(name: str, value: object, *, minimum: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(
            f"invalid value for '{name}': {value!r}; expected an integer"
        )
    v = int(value)
    if minimum is not None and v < minimum:
        raise InvalidArgumentError(f"invalid value for '{name}': {v}; must be >= {minimum}")
    return v


def _parse_bytes(name: str, value: int | str | None) -> int | None:
    """``None``, an int of bytes, or a string like ``"8GB"`` / ``"512MiB"``."""
    if value is None:
        return None
    if isinstance(value, str):
        units = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12,
                 "ki": 2**10, "mi": 2**20, "gi": 2**30, "ti": 2**40}
        s = value.strip().lower().removesuffix("b")
        num = s.rstrip("kmgti")
        unit = s[len(num):]
        try:
            return int(float(num) * units.get(unit, 1) if unit else float(num))
        except ValueError:
            raise InvalidArgumentError(
                f"invalid value for '{name}': {value!r}; use bytes or e.g. '8GB', '512MiB'"
            ) from None
    return _check_int(name, value, minimum=0)


class Model:
    """A Mixture-of-Experts language model run by colibri.

    Args:
        model: a local model directory, a Hugging Face repo id (``"owner/name"``, fetched
            through ``huggingface_hub`` and its cache; ``HF_HUB_OFFLINE=1`` is honoured), or
            ``None``/``"tiny"`` for the small model embedded in the package.
        revision: the hub revision (branch, tag or commit) when ``model`` is a repo id.
        ram_budget: bytes (or ``"8GB"``) the routed-expert cache may hold; ``None`` sizes it
            from available memory.
        io: how experts are read: ``"mmap"``, ``"pread"``, ``"direct"`` (O_DIRECT), or
            ``"auto"``.
        prefetch: router-lookahead prefetch: ``"off"``, ``"hint"`` (page-cache hints),
            ``"real"`` (loads into the cache), or ``"auto"``.
        draft: default drafter for :meth:`generate`: ``"auto"`` (MTP when the model has a
            head, else n-gram), ``"mtp"``, ``"ngram"`` or ``"off"``.
        draft_depth: default draft depth, 1–8, or ``"auto"`` (chosen online from measured
            acceptance and verify cost).
        threads: compute threads, 0 for all cores.
        mtp: load the MTP head when the checkpoint has one.

    Example:
        >>> import colibri
        >>> m = colibri.Model()
        >>> out = m.generate("def add(a, b):", max_new_tokens=16)
        >>> isinstance(out.text, str)
        True
    """

    def __init__(
        self,
        model: str | os.PathLike[str] | None = None,
        *,
        revision: str | None = None,
        ram_budget: int | str | None = None,
        io: IoMode = "auto",
        prefetch: PrefetchMode = "auto",
        draft: DraftMode = "auto",
        draft_depth: int | Literal["auto"] = "auto",
        threads: int = 0,
        mtp: bool = True,
    ) -> None:
        _check_choice("io", io, _IO_MODES)
        _check_choice("prefetch", prefetch, _PREFETCH_MODES)
        self.default_draft: DraftMode = _check_choice("draft", draft, _DRAFT_MODES)  # type: ignore[assignment]
        self.default_draft_depth = self._check_depth(draft_depth)
        threads = _check_int("threads", threads, minimum=0)
        budget = _parse_bytes("ram_budget", ram_budget)
        self.path: Path = resolve_model_dir(model, revision=revision)
        tok_file = self.path / "tokenizer.json"
        if not tok_file.is_file():
            raise ModelNotFoundError(
                f"{self.path} has no tokenizer.json; colibri needs the model's Hugging Face "
                "tokenizer next to config.json"
            )
        self.tokenizer: Tokenizer = Tokenizer.from_file(str(tok_file))
        self._tokenizer_config = _read_json(self.path / "tokenizer_config.json")
        self._generation_config = _read_json(self.path / "generation_config.json")
        self._engine = _core.Engine(
            str(self.path),
            threads=threads,
            io=io,
            ram_budget=budget,
            prefetch=prefetch,
            mtp=bool(mtp),
        )
        self.config: dict[str, Any] = json.loads(self._engine.config_json())
        self._lock = threading.Lock()

    # ----------------------------------------------------------------------------- helpers
    @staticmethod
    def _check_depth(depth: object) -> int:
        if depth == "auto":
            return 0
        d = _check_int("draft_depth", depth, minimum=1)
        if d > 8:
            raise InvalidArgumentError(f"invalid value for 'draft_depth': {d}; must be 1..8 or 'auto'")
        return d

    @property
    def has_mtp(self) -> bool:
        """Whether the MTP head is loaded (self-speculative drafting available)."""
        return bool(self._engine.has_mtp)

    @property
    def max_context(self) -> int:
        """The longest context (prompt + generated tokens) the engine computes exactly."""
        return int(self._engine.max_context)

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a generation."""
        return list(self._engine.eos_token_ids)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenise ``text`` with the model's tokenizer."""
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError("invalid value for 'prompt': the prompt is empty")
            ids = self.encode(prompt)
        else:
            ids = [_check_int("prompt token", t, minimum=0) for t in prompt]
        if not ids:
            raise InvalidArgumentError("invalid value for 'prompt': the prompt is empty")
        return ids

    # ----------------------------------------------------------------------------- logits
    def logits(self, ids: Sequence[int]) -> np.ndarray:
        """Logits of one forward over ``ids`` as a fresh sequence: float32 ``[len(ids), vocab]``."""
        toks = self._prompt_ids(ids)
        with self._lock:
            return self._engine.logits(toks)

    # ----------------------------------------------------------------------------- generate
    @overload
    def generate(
        self, prompt: str | Sequence[int], *, stream: Literal[False] = False, **kwargs: Any
    ) -> GenerationResult: ...

    @overload
    def generate(
        self, prompt: str | Sequence[int], *, stream: Literal[True], **kwargs: Any
    ) -> Iterator[str]: ...

    def generate(
        self,
        prompt: str | Sequence[int],
        *,
        max_new_tokens: int = 128,
        temperature: float | None = None,
        top_k: int | None = None,
        top_p: float | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        draft: DraftMode | None = None,
        draft_depth: int | Literal["auto"] | None = None,
        stream: bool = False,
    ) -> GenerationResult | Iterator[str]:
        """Continue ``prompt`` (text or token ids).

        Args:
            max_new_tokens: at most this many new tokens (≥ 1).
            temperature: 0 for greedy decoding; default from ``generation_config.json``
                (greedy when it does not ask for sampling).
            top_k: keep the k most likely tokens (0 = off).
            top_p: nucleus sampling mass in (0, 1] (1 = off).
            seed: makes sampling reproducible; ``None`` picks a random seed.
            stop: strings that end the generation (not included in the text).
            draft: drafter for speculative decoding (defaults to the Model's).
            draft_depth: tokens drafted per step, 1–8 or ``"auto"``.
            stream: if true, return an iterator of text chunks as tokens are accepted.

        Returns:
            A :class:`GenerationResult`, or with ``stream=True`` an iterator of strings.
        """
        params = self._params(
            prompt, max_new_tokens, temperature, top_k, top_p, seed, stop, draft, draft_depth
        )
        if stream:
            return self._stream(params)
        return self._run(params, on_text=None)

    def _params(
        self,
        prompt: str | Sequence[int],
        max_new_tokens: object,
        temperature: object,
        top_k: object,
        top_p: object,
        seed: object,
        stop: str | Sequence[str] | None,
        draft: object,
        draft_depth: object,
    ) -> dict[str, Any]:
        ids = self._prompt_ids(prompt)
        n = _check_int("max_new_tokens", max_new_tokens, minimum=1)
        gc = self._generation_config
        sampling = bool(gc.get("do_sample", False))
        if temperature is None:
            temperature = float(gc.get("temperature", 1.0)) if sampling else 0.0
        if top_k is None:
            top_k = int(gc.get("top_k", 0)) if sampling else 0
        if top_p is None:
            top_p = float(gc.get("top_p", 1.0)) if sampling else 1.0
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise InvalidArgumentError(f"invalid value for 'temperature': {temperature!r}")
        if isinstance(top_p, bool) or not isinstance(top_p, (int, float)):
            raise InvalidArgumentError(f"invalid value for 'top_p': {top_p!r}")
        top_k = _check_int("top_k", top_k)
        if seed is None:
            seed = int.from_bytes(os.urandom(8), "little")
        seed = _check_int("seed", seed, minimum=0)
        if seed >= 2**64:
            raise InvalidArgumentError("invalid value for 'seed': must be < 2**64")
        stops = [stop] if isinstance(stop, str) else list(stop or [])
        if not all(isinstance(s, str) for s in stops):
            raise InvalidArgumentError("invalid value for 'stop': expected a string or strings")
        d = self.default_draft if draft is None else _check_choice("draft", draft, _DRAFT_MODES)
        depth = (
            self.default_draft_depth if draft_depth is None else self._check_depth(draft_depth)
        )
        if len(ids) + n > self.max_context:
            raise InvalidArgumentError(
                f"prompt ({len(ids)} tokens) plus max_new_tokens ({n}) exceeds the context "
                f"this model is computed exactly for ({self.max_context} tokens)"
            )
        return {
            "ids": ids,
            "max_new_tokens": n,
            "temperature": float(temperature),
            "top_k": top_k,
            "top_p": float(top_p),
            "seed": seed,
            "stops": stops,
            "draft": d,
            "draft_depth": depth,
        }

    def _run(
        self, p: Mapping[str, Any], on_text: Callable[[str], bool] | None
    ) -> GenerationResult:
        decoder = IncrementalDecoder(self.tokenizer)
        matcher = StopMatcher(p["stops"])
        shown = 0
        stopped_by_string = False

        def on_tokens(new_ids: list[int]) -> bool:
            nonlocal shown, stopped_by_string
            decoder.push(new_ids)
            cut = matcher.check(decoder.text)
            if cut is not None:
                stopped_by_string = True
                if on_text is not None and cut > shown:
                    on_text(decoder.text[shown:cut])
                shown = cut
                return False
            if on_text is not None:
                upto = matcher.safe_len(decoder.text)
                if upto > shown:
                    keep_going = on_text(decoder.text[shown:upto])
                    shown = upto
                    return keep_going
            return True

        with self._lock:
            raw = self._engine.generate(
                p["ids"],
                max_new_tokens=p["max_new_tokens"],
                temperature=p["temperature"],
                top_k=p["top_k"],
                top_p=p["top_p"],
                seed=p["seed"],
                draft=p["draft"],
                draft_depth=p["draft_depth"],
                on_tokens=on_tokens,
            )
        tokens: list[int] = list(raw["tokens"])
        finish = str(raw["finish_reason"])
        if stopped_by_string:
            text = decoder.text[: matcher.check(decoder.text)]
            finish = "stop"
        else:
            decoder.flush()
            text = decoder.text
            if on_text is not None and len(text) > shown:
                on_text(text[shown:])
        return GenerationResult(
            text=text,
            token_ids=tokens,
            finish_reason=finish,
            stats=_stats(raw["stats"]),
        )

    def _stream(self, p: Mapping[str, Any]) -> Iterator[str]:
        chunks: queue.Queue[object] = queue.Queue()
        cancelled = threading.Event()
        done = object()

        def on_text(delta: str) -> bool:
            chunks.put(delta)
            return not cancelled.is_set()

        def worker() -> None:
            try:
                self._run(p, on_text)
            except BaseException as e:  # forwarded to the consumer
                chunks.put(e)
            finally:
                chunks.put(done)

        thread = threading.Thread(target=worker, name="colibri-generate", daemon=True)
        thread.start()
        try:
            while True:
                item = chunks.get()
                if item is done:
                    break
                if isinstance(item, BaseException):
                    raise item
                assert isinstance(item, str)
                if item:
                    yield item
        finally:
            cancelled.set()
            thread.join()

    # ----------------------------------------------------------------------------- chat
    def apply_chat_template(
        self, messages: Sequence[Mapping[str, Any]], *, add_generation_prompt: bool = True
    ) -> str:
        """Render ``messages`` with the tokenizer's chat template (sandboxed jinja2, as
        transformers renders it)."""
        from colibri._chat import render_chat

        return render_chat(self._tokenizer_config, self.path, messages, add_generation_prompt)

    def chat(
        self, messages: Sequence[Mapping[str, Any]], *, stream: bool = False, **kwargs: Any
    ) -> GenerationResult | Iterator[str]:
        """Generate the assistant's reply to ``messages`` (``[{"role": ..., "content": ...}]``).

        Accepts the keyword arguments of :meth:`generate`.
        """
        prompt = self.apply_chat_template(messages, add_generation_prompt=True)
        ids = self.encode(prompt, add_special_tokens=False)
        if stream:
            return self.generate(ids, stream=True, **kwargs)
        return self.generate(ids, **kwargs)

    # ----------------------------------------------------------------------------- info
    def info(self) -> dict[str, Any]:
        """Config summary, container formats and sizes, and the memory plan."""
        return dict(self._engine.info())

    def __repr__(self) -> str:
        return f"colibri.Model({str(self.path)!r}, mtp={self.has_mtp})"


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ColibriError(f"{path}: cannot read JSON: {e}") from e
    return data if isinstance(data, dict) else {}


def _stats(raw: Mapping[str, Any]) -> GenerationStats:
    known = {f for f in GenerationStats.__dataclass_fields__ if f != "extra"}
    fields = {k: raw[k] for k in known if k in raw}
    extra = {k: v for k, v in raw.items() if k not in known}
    defaults: dict[str, Any] = {
        "prompt_tokens": 0, "generated_tokens": 0, "forwards": 0, "tokens_per_forward": 0.0,
        "tokens_per_second": 0.0, "prefill_seconds": 0.0, "decode_seconds": 0.0,
        "drafts_proposed": [], "drafts_accepted": [], "acceptance_rate": 0.0,
        "draft_seconds": 0.0, "verify_seconds": 0.0, "expert_hits": 0, "expert_misses": 0,
        "expert_bytes_read": 0, "prefetch_recall": None,
    }
    defaults.update(fields)
    return GenerationStats(**defaults, extra=extra)
