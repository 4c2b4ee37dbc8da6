"""``colibri.Model``: load a model, generate text, chat, and inspect logits; ``Session``,
one conversation on it.

The model's helpers live by job: argument checking in :mod:`colibri.validation`, the
streaming iterator and each generation's text side in :mod:`colibri.stream`, the result
types in :mod:`colibri.results`, ``colibri info``'s description of a model directory in
:mod:`colibri.info`. The names they export that this module has always offered
(``colibri.model.GenerationResult``, ``model_info``, ...) are imported here as well.
"""

from __future__ import annotations

import json
import os
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, overload

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from colibri import _core
from colibri._hub import resolve_model_dir
from colibri.errors import (
    ColibriError,
    InvalidArgumentError,
    ModelNotFoundError,
    NonFiniteWeightError,
)
from colibri.info import model_info
from colibri.results import (
    FinishReason,
    GenerationResult,
    GenerationStats,
)
from colibri.sampling import (
    GENERATE_KEYWORDS,
    SAMPLING_FIELDS,
    GenerateOptions,
    SamplingParams,
    Unpack,
)
from colibri.stream import GenerationStream, _Lane
from colibri.validation import (
    _DRAFT_MODES,
    _IO_MODES,
    _PREFETCH_MODES,
    _PREFILL_MODES,
    MAX_THREADS,
    MIN_BYTES_PER_TOKEN,
    DraftMode,
    IoMode,
    PrefetchMode,
    PrefillMode,
    _check_choice,
    _check_depth,
    _check_ignore_eos,
    _check_int,
    _check_processing,
    _check_seed,
    _check_stop_ids,
    _check_stops,
    _check_temperature,
    _check_top_p,
    _choices,
    _default_max_new_tokens,
    _guided_argument,
    _is_batch,
    _parse_bytes,
    _template_text,
    check_engine_request,
)

#: The public names of this module; the helpers' homes are named in the module docstring.
__all__ = [
    "DraftMode",
    "FinishReason",
    "GenerationResult",
    "GenerationStats",
    "GenerationStream",
    "IoMode",
    "Model",
    "PrefetchMode",
    "Session",
    "model_info",
]


def _mtp_layers(path: Path) -> list[int]:
    """The MTP layers' indices (``num_hidden_layers`` onwards) of the model at ``path``."""
    cfg = _core.model_config(path)
    first, count = int(cfg["num_hidden_layers"]), int(cfg["num_nextn_predict_layers"])
    if count == 0:
        raise InvalidArgumentError("pin_mtp=True, but this model has no MTP layer")
    return list(range(first, first + count))


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
            ``"real"`` (loads into the cache), or ``"auto"`` (``"real"``, and no lookahead at
            all when ``ram_budget`` holds every routed expert: nothing is read twice then;
            ``info()["lookahead"]`` says which).
        draft: default drafter for :meth:`generate`: ``"auto"`` (MTP when the model has a
            head, else n-gram), ``"mtp"``, ``"ngram"`` or ``"off"``.
        draft_depth: default draft depth, 1-8, or ``"auto"`` (chosen online from measured
            acceptance and verify cost).
        threads: compute threads, 0 for all cores.
        prefill: the arithmetic of prompt forwards of 16 tokens or more: ``"exact"`` (the
            exact f32 kernels, as every decode step uses), ``"int8"`` (activations rounded
            to int8 per block of 64 and summed as integers: 1.5-3x faster prefill on CPUs with
            AVX-512 VNNI or AVX2, logits within a small tolerance of the exact ones), or
            ``"auto"`` (int8 where the CPU has AVX-512 VNNI or AVX2, else exact;
            ``info()["prefill"]`` says which). Decoding after the prompt is exact either
            way, so drafting never changes the output; see docs/architecture.md, "Prefill
            arithmetic".
        mtp: load the MTP head when the checkpoint has one.
        pin_mtp: keep every routed expert of the MTP layer in RAM (loaded at start, on top
            of ``ram_budget``), so a draft step reads nothing from disk. Worth it when the
            experts stream from disk and the RAM is there (GLM-5.2's int8 MTP layer is
            ~9.7 GB); see docs/benchmarks.md for what it changes.
        max_context: the longest context (prompt + generated tokens) in tokens; it bounds
            the KV cache's memory. ``None`` takes the model's limit
            (``max_position_embeddings``), lowered to what fits in half of the memory left
            after the dense weights and the expert budget. A generation that reaches it ends
            with ``finish_reason == "length"``; a longer prompt is an
            :class:`InvalidArgumentError`.
        n_ctx: llama-cpp-python's name for ``max_context`` (give one, or both equal).
        load_progress: called as ``load_progress(done, total)`` (bytes) after each resident
            tensor (dense weights, norms, routers, shared experts, embeddings) is read and
            checked, the last call with ``done == total``: the progress of opening a large
            model. Ctrl-C stops a long load within one tensor.
        cache_dir: where per-model state (the routing history that picks the pinned
            experts) is kept, under a directory named by the model's fingerprint. ``None``:
            ``$COLIBRI_CACHE_DIR``, else ``$XDG_CACHE_HOME/colibri``, else
            ``~/.cache/colibri``. Nothing is ever written into the model directory.
        chat_template: a chat template (jinja text, or the path of a file holding it) to
            use instead of the model's (``tokenizer_config.json`` / ``chat_template.jinja``).
        idle_session_budget: bytes (or ``"2GB"``) of RAM that the KV caches of sessions not
            generating right now may hold together; beyond it the least recently used are
            written to ``sessions/`` in the cache directory and read back, unchanged, when
            next used. ``None``: one full context (``max_context`` tokens of KV).

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
        prefill: PrefillMode = "auto",
        mtp: bool = True,
        pin_mtp: bool = False,
        max_context: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        idle_session_budget: int | str | None = None,
        chat_template: str | os.PathLike[str] | None = None,
        n_ctx: int | None = None,
        load_progress: Callable[[int, int], object] | None = None,
    ) -> None:
        if load_progress is not None and not callable(load_progress):
            raise InvalidArgumentError(
                f"invalid value for 'load_progress': {load_progress!r}; expected a callable "
                "taking (done, total)"
            )
        if n_ctx is not None:
            if max_context is not None and max_context != n_ctx:
                raise InvalidArgumentError(
                    f"invalid value for 'n_ctx': {n_ctx!r} while max_context is "
                    f"{max_context!r}; they are the same setting, give one"
                )
            max_context = _check_int("n_ctx", n_ctx, minimum=1)
        _check_choice("io", io, _IO_MODES)
        self._chat_template = _template_text(chat_template)
        _check_choice("prefetch", prefetch, _PREFETCH_MODES)
        _check_choice("prefill", prefill, _PREFILL_MODES)
        self.default_draft: DraftMode = _check_choice("draft", draft, _DRAFT_MODES)  # type: ignore[assignment]
        self.default_draft_depth = _check_depth(draft_depth)
        check_engine_request({"draft_depth": self.default_draft_depth})
        if self.default_draft == "mtp" and not mtp:
            raise InvalidArgumentError(
                "invalid value for 'draft': 'mtp' drafts with the MTP head, which mtp=False "
                "does not load; use draft='auto', 'ngram' or 'off', or keep mtp=True"
            )
        threads = _check_int("threads", threads, minimum=0, maximum=MAX_THREADS)
        context = None if max_context is None else _check_int("max_context", max_context, minimum=1)
        if context is not None and context >= 1 << 63:
            raise InvalidArgumentError(
                f"invalid value for 'max_context': {context} tokens is beyond any model's limit"
            )
        budget = _parse_bytes("ram_budget", ram_budget)
        idle = _parse_bytes("idle_session_budget", idle_session_budget)
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
        self.default_max_new_tokens: int = _default_max_new_tokens(
            self._generation_config, self.path / "generation_config.json"
        )
        self._live_engine: Any = _core.Engine(
            str(self.path),
            threads=threads,
            io=io,
            ram_budget=budget,
            prefetch=prefetch,
            mtp=bool(mtp),
            resident_layers=_mtp_layers(self.path) if pin_mtp and mtp else None,
            max_context=context,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            idle_session_bytes=idle,
            prefill=prefill,
            load_progress=load_progress,
        )
        self.config: dict[str, Any] = json.loads(self._engine.config_json())
        facts = self._engine.info()
        self._has_mtp = bool(facts["has_mtp"])
        self._max_context = int(facts["max_context"])
        self._eos_token_ids = [int(t) for t in facts["eos_token_ids"]]
        self._vocab_size = int(facts["vocab_size"])
        self._kv_bytes_per_token = int(facts["kv_bytes_per_token"])
        self._usage_path = self._engine.usage_path
        self._lock = threading.Lock()
        self._max_prompt_chars = self._max_context * max(
            MIN_BYTES_PER_TOKEN,
            max((len(t.encode("utf-8")) for t in self.tokenizer.get_vocab()), default=1),
        )
        if mtp and not self._has_mtp:
            _warn_incomplete_mtp(self.path)
        if self.default_draft == "mtp" and not self._has_mtp:
            raise InvalidArgumentError(
                "invalid value for 'draft': 'mtp' needs an MTP head and this model has none "
                "(num_nextn_predict_layers is 0, or its weights are absent); use draft='auto', "
                "'ngram' or 'off'"
            )

    # ----------------------------------------------------------------------------- helpers
    @property
    def has_mtp(self) -> bool:
        """Whether the MTP head is loaded (self-speculative drafting available)."""
        return self._has_mtp

    @property
    def max_context(self) -> int:
        """The longest context (prompt + generated tokens) this model runs: the
        ``max_context`` it was opened with, or the default (see the class docstring)."""
        return self._max_context

    @property
    def usage_path(self) -> Path | None:
        """The file the routing history is saved to (in the cache directory), or ``None``
        when none could be determined."""
        path = self._usage_path
        return None if path is None else Path(path)

    @property
    def eos_token_ids(self) -> list[int]:
        """Token ids that end a generation."""
        return list(self._eos_token_ids)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Tokenise ``text`` with the model's tokenizer.

        Raises:
            InvalidArgumentError: ``text`` is not a string, or not valid Unicode (a lone
                surrogate).
        """
        from colibri._chat import check_text

        if not isinstance(text, str):
            raise InvalidArgumentError(
                f"invalid value for 'text': {type(text).__name__}; expected a string"
            )
        check_text("text", text)
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        """Turn token ids back into text."""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def _check_token(self, name: str, value: object) -> int:
        t = _check_int(name, value, minimum=0)
        vocab = self._vocab_size
        if t >= vocab:
            raise InvalidArgumentError(
                f"invalid value for '{name}': token id {t} is outside the vocabulary "
                f"(0..{vocab - 1})"
            )
        return t

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidArgumentError(
                    "invalid value for 'prompt': the prompt is empty; pass some text or ids"
                )
            from colibri._chat import check_text

            if len(prompt) > self._max_prompt_chars:
                raise InvalidArgumentError(
                    f"invalid value for 'prompt': {len(prompt)} characters cannot fit in this "
                    f"model's max_context ({self.max_context} tokens, at most "
                    f"{self._max_prompt_chars // self.max_context} bytes each); shorten the "
                    "prompt (it was not tokenised)"
                )
            check_text("prompt", prompt)
            ids = self.encode(prompt)
        elif isinstance(prompt, (list, tuple, np.ndarray)):
            if len(prompt) > self.max_context:  # before checking each id
                raise InvalidArgumentError(
                    f"invalid value for 'prompt': {len(prompt)} tokens exceed this model's "
                    f"max_context ({self.max_context} tokens)"
                )
            ids = [self._check_token("prompt", t) for t in prompt]
        else:
            raise InvalidArgumentError(
                f"invalid value for 'prompt': {type(prompt).__name__}; expected a string or a "
                "list of token ids"
            )
        if not ids:
            raise InvalidArgumentError(
                "invalid value for 'prompt': the prompt is empty; pass some text or ids"
            )
        return ids

    # ----------------------------------------------------------------------------- logits
    def logits(self, ids: Sequence[int]) -> npt.NDArray[np.float32]:
        """Logits of one forward over ``ids`` as a fresh sequence: float32 ``[len(ids), vocab]``."""
        toks = self._prompt_ids(ids)
        if len(toks) > self.max_context:
            raise InvalidArgumentError(
                f"invalid value for 'ids': {len(toks)} tokens exceed this model's max_context "
                f"({self.max_context} tokens)"
            )
        with self._lock:
            out = self._engine.logits(toks)
        if not np.isfinite(out).all():
            row, tok = (int(i) for i in np.argwhere(~np.isfinite(out))[0])
            what = (
                f"logits() computed a non-finite logit ({out[row, tok]} at row {row}, "
                f"token id {tok})"
            )
            why = _core.Container(str(self.path)).diagnose_non_finite()
            raise NonFiniteWeightError(f"{what}: {why}")
        return out

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
        if given.get("ignore_eos") is not None and _check_ignore_eos(given["ignore_eos"]):
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
        on_text: Callable[[str], bool] | None,
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
                lambda i, ids: lanes[i].on_tokens(ids),
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

        def on_tokens(i: int, ids: list[int]) -> bool:
            hook = progress.get(i)
            if hook is not None:
                hook(ids)
            return lanes[i].on_tokens(ids)

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

    # ----------------------------------------------------------------------------- chat
    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: Literal[True] = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: Literal[False],
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the chat template (sandboxed jinja2, as transformers
        renders it), with transformers' defaults: token ids (``tokenize=True``) and no
        generation prompt (``add_generation_prompt=False``; :meth:`chat` adds it).
        ``chat_template`` (template text) replaces the model's template for this call;
        ``Model(chat_template=...)`` for every call. Other keywords are variables of the
        template, as transformers passes them (e.g. ``enable_thinking=False`` for GLM)."""
        from colibri._chat import render_chat

        text = render_chat(
            self._tokenizer_config,
            self.path,
            messages,
            add_generation_prompt,
            max_output=self._max_prompt_chars,
            template=chat_template if chat_template is not None else self._chat_template,
            variables=template_kwargs,
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        n: int,
        stream: Literal[False] = False,
        **options: Unpack[GenerateOptions],
    ) -> list[GenerationResult]: ...

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        stream: Literal[False] = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult: ...

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        stream: Literal[True],
        **options: Unpack[GenerateOptions],
    ) -> GenerationStream: ...

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        n: int | None = None,
        stream: bool = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult | GenerationStream | list[GenerationResult]:
        """Generate the assistant's reply to ``messages`` (a list of
        ``{"role": ..., "content": ...}`` dicts), rendered with the model's chat template.

        Takes the keyword arguments of :meth:`generate`, with the same meaning; returns a
        :class:`GenerationResult`, or with ``stream=True`` a :class:`GenerationStream`.
        ``tools`` (OpenAI's tool objects) and ``tool_choice`` (``"auto"``, ``"none"``,
        ``"required"`` or ``{"type": "function", "function": {"name": ...}}``) let the
        model call functions, for GLM's and DeepSeek's chat templates: the result's
        ``tool_calls`` holds the calls and ``text`` what came before them (docs/server.md,
        "Tool calls"; not with ``stream=True``).
        """
        kw = _check_keywords(options)
        choices = _choices(n, sampling_params)
        if tools is not None or tool_choice is not None:
            return self._chat_with_tools(
                messages, sampling_params, kw, choices, stream, tools, tool_choice
            )
        if choices > 1:
            return self._n_results(self._chat_ids(messages), sampling_params, kw, choices, stream)
        params = self._params(self._chat_ids(messages), sampling_params, kw)
        return self._launch(params, stream)

    def _chat_with_tools(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: object,
        kw: dict[str, Any],
        choices: int,
        stream: bool,
        tools: object,
        tool_choice: object,
    ) -> GenerationResult | list[GenerationResult]:
        """:meth:`chat` offering ``tools``: the calls parsed into ``tool_calls``."""
        from dataclasses import replace

        from colibri import _openai, _tools

        def invalid(param: str, message: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"invalid value for '{param}': {message}")

        if stream:
            raise InvalidArgumentError(
                "tools with stream=True: use create_chat_completion(..., stream=True), whose "
                "chunks carry the calls, or stream=False"
            )
        offered, choice, forced = _tools.parse_request(
            {"tools": tools, "tool_choice": tool_choice}, invalid
        )
        template = _openai._template_text(self)
        fmt = _tools.detect(template)
        if fmt is None and choice != "none":
            raise InvalidArgumentError(
                "invalid value for 'tools': this model's chat template writes no tool-call "
                "format colibri reads (GLM's <tool_call>, DeepSeek's tool-call tokens)"
            )
        turns: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            turn = dict(m)
            if turn.get("tool_calls"):
                where = f"messages[{i}].tool_calls"
                turn["tool_calls"] = _tools.message_calls(where, turn["tool_calls"], fmt, invalid)
            turns.append(turn)
        variables: dict[str, Any] = {}
        if choice != "none" and fmt is not None:
            turns = _tools.offer(turns, variables, offered, fmt, "tools" in template)
        if choice == "required" and fmt is not None:
            if any(
                kw.get(k) is not None for k in ("guided_json", "guided_regex", "guided_grammar")
            ):
                raise invalid("tool_choice", "a forced tool call and guided_*: give one")
            kw["guided_grammar"] = _tools.forced_grammar(
                fmt, [t for t in offered if forced is None or t.name == forced]
            )
        ids = self.apply_chat_template(turns, add_generation_prompt=True, **variables)
        if choices > 1:
            results = self._n_results(ids, sampling_params, kw, choices, False)
        else:
            results = [self._launch(self._params(ids, sampling_params, kw), False)]
        out = []
        for r in results:
            assert isinstance(r, GenerationResult)
            calls: list[_tools.Call] = []
            text = r.text
            if fmt is not None and choice != "none":
                text, calls = _tools.extract(r.text, fmt, offered)
            out.append(replace(r, text=text, tool_calls=[c.openai() for c in calls]))
        return out if choices > 1 else out[0]

    def _chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt ids of a chat: ``messages`` rendered with the generation prompt."""
        return self.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)

    def _launch(self, params: dict[str, Any], stream: bool) -> GenerationResult | GenerationStream:
        """Run prepared ``params``: now, or as a :class:`GenerationStream`."""
        if stream:
            if params["grammar"] is not None:  # a bad constraint is an error of this call
                self._engine.check_grammar(*params["grammar"])
            return GenerationStream(lambda on_text, cancel: self._run(params, on_text, cancel))
        return self._run(params, on_text=None)

    # ----------------------------------------------------------------------------- sessions
    def session(self) -> Session:
        """A new conversation with its own KV cache: its calls reuse its own earlier turns,
        whatever other sessions and the model itself run in between."""
        return Session(self)

    # ----------------------------------------------------------------------------- OpenAI
    def create_completion(
        self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], **request: Any
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``prompt`` completed as OpenAI's ``/v1/completions`` (and llama-cpp-python's
        ``create_completion``) answers: the keywords are that request's fields
        (``max_tokens`` default 16, ``temperature``, ``top_p``, ``stop``, ``seed``,
        ``logprobs``, ``presence_penalty``, ``logit_bias``, ``echo``, ``stream``, ...; vLLM's
        ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``; and
        llama.cpp's and vLLM's client fields, docs/server.md), and the result is the response
        body as a dict, or with ``stream=True`` an iterator of its chunks. A list of prompts
        is a batch. The same code answers ``colibri serve`` (``colibri._openai``); a field
        colibri cannot honour is an :class:`InvalidArgumentError` naming it."""
        return self._openai("completion", {"prompt": prompt, **request})

    def create_chat_completion(
        self, messages: Sequence[Mapping[str, Any]], **request: Any
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``messages`` answered as OpenAI's ``/v1/chat/completions`` does (the chat
        template, then generation): a ``chat.completion`` dict, or with ``stream=True`` an
        iterator of ``chat.completion.chunk`` dicts. Keywords as
        :meth:`create_completion` (``max_tokens`` defaults to the rest of the context)."""
        return self._openai("chat", {"messages": messages, **request})

    def _openai(
        self, kind: Literal["completion", "chat"], body: dict[str, Any]
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        from colibri import _openai

        served = body.get("model") if isinstance(body.get("model"), str) else self.path.name
        try:
            req = _openai.parse(body, kind, self, served)
        except _openai.ApiError as e:  # its message names the field
            raise InvalidArgumentError(e.message) from None
        if req.ignored:
            warnings.warn(
                f"ignored fields: {', '.join(req.ignored)} (colibri accepts them without "
                "effect; docs/server.md lists what each client field does)",
                UserWarning,
                stacklevel=3,
            )
        if req.choices > 1:  # the choices decode together; a stream carries each one whole
            results: list[GenerationResult] = []
            if req.n == 1:  # a list of prompts: one batch, its decode forwards shared
                results = self.generate(req.prompts, **req.generate)
            else:
                for prompt in req.prompts:
                    results.extend(self.generate(prompt, n=req.n, **req.generate))
            if not req.stream:
                return _openai.response(req, results, self)

            def choice_chunks() -> Iterator[dict[str, Any]]:
                for i, r in enumerate(results):
                    yield from _openai.opening_chunks(req, i)
                    splitter = req.choice_stream()
                    yield from _openai.text_chunks(req, splitter, r.text, i)
                    yield from _openai.text_chunks(req, splitter, None, i)
                yield from _openai.closing_chunks(req, results, self)

            return choice_chunks()
        if not req.stream:
            result = self.generate(req.prompt_ids, **req.generate)
            return _openai.response(req, result, self)

        def chunks() -> Iterator[dict[str, Any]]:
            yield from _openai.opening_chunks(req)
            splitter = req.choice_stream()
            with self.generate(req.prompt_ids, stream=True, **req.generate) as stream:
                for text in stream:
                    yield from _openai.text_chunks(req, splitter, text)
                result = stream.result
            yield from _openai.text_chunks(req, splitter, None)
            if result is not None:
                yield from _openai.closing_chunks(req, result, self)

        return chunks()

    def load_session(self, path: str | os.PathLike[str]) -> Session:
        """A new :class:`Session` holding the context :meth:`Session.save` wrote to ``path``.

        Raises :class:`SavedContextError` for a truncated or corrupt file, one of another
        format version, or one saved by another model; :class:`ColibriFileNotFoundError`
        when there is no such file."""
        file = _context_path(path)
        with self._lock:
            core = self._engine.load_session(file)
        return Session(self, core)

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

    # ----------------------------------------------------------------------------- info
    def info(self) -> dict[str, Any]:
        """Config summary, container formats and byte sizes per tensor role, and the memory
        plan (see :func:`model_info`), and what was decided at load: ``max_context``,
        ``prefill`` (the arithmetic of long prefills, ``"exact"`` or ``"int8"``) and
        ``lookahead`` (whether decode predicts the next layer's experts to prefetch them)."""
        info = model_info(self.path, mtp_loaded=self.has_mtp)
        stats, decided = self._engine.expert_stats(), self._engine.info()
        info["memory"]["ram_budget_bytes"] = stats["budget_bytes"]
        info["memory"]["io_mode"] = stats["io_mode"]
        info["max_context"] = self.max_context
        info["prefill"] = decided["prefill"]
        info["lookahead"] = decided["lookahead"]
        return info

    def __repr__(self) -> str:
        state = ", closed" if self._live_engine is None else ""
        return f"colibri.Model({str(self.path)!r}, mtp={self.has_mtp}{state})"

    # ----------------------------------------------------------------------------- lifetime
    @property
    def _engine(self) -> Any:
        engine = self._live_engine
        if engine is None:
            raise ColibriError(
                "this model was closed (Model.close() or the end of its `with` block); open "
                "it again to use it"
            )
        return engine

    @_engine.setter
    def _engine(self, engine: Any) -> None:
        self._live_engine = engine

    def close(self) -> None:
        """Release the model now: its weights, expert cache, KV caches and threads (waits
        for a running generation to finish). Later calls raise :class:`ColibriError`;
        closing twice is harmless. ``with colibri.Model(...) as m:`` closes at the end."""
        with self._lock:
            self._live_engine = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._live_engine is None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    stop strings, the session, the progress callback)."""
    python_side = ("ids", "stops", "session", "prefill_progress")
    return {k: v for k, v in p.items() if k not in python_side}


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


@dataclass
class BatchEntry:
    """A generation for :meth:`Model._run_continuous`: its id, its checked parameters
    (:meth:`Model._params`), the session it runs on, where its text goes (``on_text``
    returns False to stop it) and an event that cancels it."""

    id: int
    params: Mapping[str, Any]
    session: Session
    on_text: Callable[[str], bool] | None
    cancel: threading.Event | None
    #: Called with each burst of generated token ids as the engine emits them (live
    #: progress: the server's ``/stats``), before the text is decoded.
    on_tokens: Callable[[list[int]], None] | None = None


#: What an MTP head needs besides its attention and MoE (the engine's `MtpHead::present`).
_MTP_HEAD_TENSORS = ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight")


def _warn_incomplete_mtp(path: Path) -> None:
    """The config declares an MTP layer whose head the engine did not load: warn naming the
    tensors that are missing, unless the whole layer is absent (a checkpoint shipped without
    it on purpose)."""
    cfg = _core.model_config(path)
    if cfg["num_nextn_predict_layers"] <= 0:
        return
    first = int(cfg["num_hidden_layers"])
    names = _core.Container(str(path)).names()
    prefix = f"model.layers.{first}."
    if not any(x.startswith(prefix) for x in names):
        return
    have = set(names)
    missing = [prefix + t for t in _MTP_HEAD_TENSORS if prefix + t not in have]
    if missing:
        warnings.warn(
            f"{path}: config.json declares an MTP layer ({first}) but the checkpoint lacks "
            f"{', '.join(missing)}; the MTP head is disabled (draft='auto' drafts with n-grams)",
            UserWarning,
            stacklevel=3,
        )


def _caller_stacklevel() -> int:
    """The ``stacklevel`` that makes a warning point at the first frame outside this module
    (the user's ``generate``/``chat`` call)."""
    import sys

    level, frame = 1, sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
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


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ColibriError(f"{path}: cannot read JSON: {e}") from e
    return data if isinstance(data, dict) else {}
