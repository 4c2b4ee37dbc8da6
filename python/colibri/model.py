"""``colibri.Model``: load a model, generate text, chat, and inspect logits; ``Session``,
one conversation on it.

The model's parts live by job: ``generate`` and what runs it in :mod:`colibri._generation`,
``chat`` and the OpenAI-shaped calls in :mod:`colibri._chat_api` (``Model`` inherits both),
``Session`` in :mod:`colibri.session`, argument checking in :mod:`colibri.validation`, the
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
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np
import numpy.typing as npt
from tokenizers import Tokenizer

from colibri import _core
from colibri._chat_api import ChatMixin
from colibri._generation import BatchEntry
from colibri._hub import resolve_model_dir
from colibri._pin_mtp import PinMtp, PinMtpChoice, check_pin_mtp, decide, mem_available
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
from colibri.session import Session, _context_path
from colibri.stream import GenerationStream
from colibri.validation import (
    _DECODE_MODES,
    _DRAFT_MODES,
    _IO_MODES,
    _PREFETCH_MODES,
    _PREFILL_MODES,
    MAX_THREADS,
    MIN_BYTES_PER_TOKEN,
    DecodeMode,
    DraftMode,
    IoMode,
    PrefetchMode,
    PrefillMode,
    _check_choice,
    _check_depth,
    _check_int,
    _default_max_new_tokens,
    _parse_bytes,
    _template_text,
    check_engine_request,
)

#: The public names of this module; the helpers' homes are named in the module docstring.
__all__ = [
    "BatchEntry",
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


def _mtp_expert_layers(path: Path) -> list[int]:
    """The MTP layers of the model at ``path`` that have routed experts in its container (a
    config may declare more MTP layers than the checkpoint holds)."""
    cfg = _core.model_config(path)
    first, count = int(cfg["num_hidden_layers"]), int(cfg["num_nextn_predict_layers"])
    found: set[int] = set()
    for name in _core.Container(str(path)).names():
        parts = name.split(".")
        if name.startswith("model.layers.") and ".mlp.experts." in name and parts[2].isdigit():
            layer = int(parts[2])
            if first <= layer < first + count:
                found.add(layer)
    return sorted(found)


def _decide_pin_mtp(
    path: Path, mode: str, *, mtp: bool, budget: int | None, draft: str
) -> PinMtpChoice:
    """``pin_mtp``'s decision for the model at ``path`` (:mod:`colibri._pin_mtp`)."""
    facts = model_info(path, mtp_loaded=mtp)
    mtp_bytes = sum(facts["tensors"].get("mtp_routed_experts", {}).values()) if mtp else 0
    if mtp_bytes and int(_core.model_config(path)["num_nextn_predict_layers"]) == 0:
        mtp_bytes = 0  # tensors past the last layer that the config does not declare
    return decide(
        mode,
        mtp_bytes=mtp_bytes,
        dense_bytes=int(facts["memory"]["dense_bytes"]),
        ram_budget=budget,
        drafting=draft != "off" and mtp,
        available=mem_available(),
    )


def _check_experts_per_token(path: Path, value: int) -> None:
    """``experts_per_token`` is in 1..k, k the routed experts per token of the model at
    ``path`` (the engine checks the same; here a negative value gets the message too)."""
    k = int(_core.model_config(path)["num_experts_per_tok"])
    if not 1 <= value <= k:
        raise InvalidArgumentError(
            f"invalid value for 'experts_per_token': {value}; this model routes each token to "
            f"{k} experts (num_experts_per_tok), so the allowed range is 1..={k}"
        )


class Model(ChatMixin):
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
            all when ``ram_budget`` holds every routed expert: nothing is read twice then,
            or when a streamed layer's share of it holds fewer than 2·k experts: no room
            for a prefetch beside the current token's; ``info()["lookahead"]`` says which).
        draft: default drafter for :meth:`generate`: ``"auto"`` (MTP when the model has a
            head, else n-gram), ``"mtp"``, ``"ngram"`` or ``"off"``.
        draft_depth: default draft depth, 1-8, or ``"auto"`` (chosen online from measured
            acceptance and verify cost).
        threads: compute threads, 0 for all cores.
        decode: the arithmetic of every forward: ``"int8"`` (activations rounded to int8
            per row and block of 64 and summed as integers, as llama.cpp's Q8 activations
            do: decode streams the weights faster, verify rows cost little more than one,
            and prefill runs 1.5-3x faster; logits within a small tolerance of the exact
            ones), ``"exact"`` (f32 dequantisation and accumulation), or ``"auto"`` (int8
            where the CPU has AVX-512 VNNI or AVX2, which run an int8 decode kernel, else
            exact; ``info()["decode"]`` says which). Drafting never changes the output either
            way; when prompts run the same arithmetic (``prefill="auto"``: the defaults on
            AVX-512 VNNI and AVX2, or any ``decode`` given) each row's logits depend on its own
            tokens alone, so the same seed gives the same text whether the prompt was
            prefilled, reused from the cache, restored or batched; see
            docs/architecture.md, "Decode arithmetic".
        prefill: the arithmetic of prompt forwards: ``"auto"`` (the ``decode`` arithmetic
            when ``decode`` is set, else int8 where the CPU has AVX-512 VNNI or AVX2),
            ``"exact"`` or ``"int8"``. One that differs from ``decode``
            applies to prompt chunks of 16 tokens or more (and ``"int8"`` with
            ``decode="exact"`` lets long prompts take a faster attention form); then a
            row's values depend on how its prompt was chunked and the same seed can give
            other text after a cached prefix (``info()["row_invariant"]`` is False).
        mtp: load the MTP head when the checkpoint has one.
        pin_mtp: keep every routed expert of the MTP layer in RAM (loaded at start, beyond
            ``ram_budget``), so a draft step reads nothing from disk (GLM-5.2's int8 MTP
            layer is ~9.7 GB). ``"auto"`` (the default): resident when drafting is enabled
            (``draft`` not ``"off"``, ``mtp=True``, a model with an MTP layer) and the layer
            fits in ``MemAvailable`` less the dense weights, the expert budget and 2 GiB of
            headroom; when it does not fit, MTP drafting starts disabled (``draft="auto"``
            drafts by prompt lookup; ``draft="mtp"`` still runs, streamed). ``True``: always
            resident, an :class:`InvalidArgumentError` when it does not fit; ``False``:
            streamed like any layer. ``info()["memory"]["pin_mtp"]`` reports the choice and
            why; see docs/expert-store.md.
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
        trace_routing: a file (created or replaced) that every forward's routing is written
            to as it runs: per row (prompt, decode, draft, MTP) each MoE layer's routed
            experts, in the routing-trace format that the replay reads
            (``tools/replay_routing.rs --trace``; docs/expert-store.md, "Trace format").
            For measuring the expert levers on your own workload; off by default.
        experts_per_token: route each token, in every MoE layer and the MTP layer alike, to
            the best ``experts_per_token`` of the experts the model would choose, their
            weights normalised as the model normalises its own (over the chosen experts
            when the config's ``norm_topk_prob``, then times ``routed_scaling_factor``).
            ``None`` (the default) is the model's own ``num_experts_per_tok`` (k), and k is
            the model unchanged. **Fewer experts change the model's output** (a lossy speed
            dial for disk-bound runs: fewer expert bytes per token); see
            docs/expert-store.md, "Fewer experts per token", for what it costs on the
            trained models. Outside 1..k it is an :class:`InvalidArgumentError`;
            ``info()["routing"]`` reports the value in effect. Speculation stays lossless
            against the model with the same value.
        experts: ``"ray://ADDRESS"`` (``auto`` or the Ray head's ``host:port``, optionally
            ``?timeout=S&probe=S``) runs the routed experts that Ray worker actors hold in
            their RAM there (``colibri experts-worker``; docs/distributed.md), the others
            from the local store; ``None`` (the default): all local. The tokens are the same
            either way; a worker that fails or is late gives an
            :class:`~colibri.errors.ExpertWorkerWarning` and its experts run locally until it
            answers again. ``info()["experts_workers"]`` reports the workers. Needs
            ``pip install "colibri[distributed]"``.

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
        decode: DecodeMode = "auto",
        mtp: bool = True,
        pin_mtp: PinMtp = "auto",
        max_context: int | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        idle_session_budget: int | str | None = None,
        chat_template: str | os.PathLike[str] | None = None,
        n_ctx: int | None = None,
        load_progress: Callable[[int, int], object] | None = None,
        trace_routing: str | os.PathLike[str] | None = None,
        experts_per_token: int | None = None,
        experts: str | None = None,
    ) -> None:
        if experts is not None:
            from colibri.distributed import parse_address

            parse_address(experts)
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
        _check_choice("decode", decode, _DECODE_MODES)
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
        routed = None
        if experts_per_token is not None:
            routed = _check_int("experts_per_token", experts_per_token)
        pin_mode = check_pin_mtp(pin_mtp)
        budget = _parse_bytes("ram_budget", ram_budget)
        idle = _parse_bytes("idle_session_budget", idle_session_budget)
        self.path: Path = resolve_model_dir(model, revision=revision)
        self._pin_mtp: PinMtpChoice = _decide_pin_mtp(
            self.path, pin_mode, mtp=bool(mtp), budget=budget, draft=self.default_draft
        )
        if routed is not None:
            _check_experts_per_token(self.path, routed)
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
            resident_layers=_mtp_expert_layers(self.path) if self._pin_mtp.resident else None,
            max_context=context,
            cache_dir=None if cache_dir is None else os.fspath(cache_dir),
            idle_session_bytes=idle,
            prefill=prefill,
            decode=decode,
            load_progress=load_progress,
            trace_routing=None if trace_routing is None else os.fspath(trace_routing),
            experts_per_token=routed,
        )
        self.config: dict[str, Any] = json.loads(self._engine.config_json())
        self._remote: Any = None
        if experts is not None:
            from colibri.distributed import connect

            self._remote = connect(experts, hidden_size=int(self.config["hidden_size"]))
            self._experts_source = experts
            self._engine.set_remote_experts(self._remote, self._remote.held)
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

    # ----------------------------------------------------------------------------- sessions
    def session(self) -> Session:
        """A new conversation with its own KV cache: its calls reuse its own earlier turns,
        whatever other sessions and the model itself run in between."""
        return Session(self)

    def load_session(self, path: str | os.PathLike[str]) -> Session:
        """A new :class:`Session` holding the context :meth:`Session.save` wrote to ``path``.

        Raises :class:`SavedContextError` for a truncated or corrupt file, one of another
        format version, or one saved by another model; :class:`ColibriFileNotFoundError`
        when there is no such file."""
        file = _context_path(path)
        with self._lock:
            core = self._engine.load_session(file)
        return Session(self, core)

    # ----------------------------------------------------------------------------- info
    def info(self) -> dict[str, Any]:
        """Config summary, container formats and byte sizes per tensor role, and the memory plan
        (see :func:`model_info`; ``memory["ram_budget_bytes"]`` is the experts' whole allowance,
        ``memory["mtp_resident_bytes"]`` the part of it that ``pin_mtp`` added on top of
        ``ram_budget``, ``memory["pin_mtp"]`` what ``pin_mtp`` decided: ``mode`` (``"auto"``,
        ``"on"``, ``"off"``), ``resident``, ``bytes`` (the MTP layer's routed experts),
        ``reason`` and ``mtp_drafting`` (False when ``"auto"`` could not keep the layer resident:
        ``draft="auto"`` drafts by prompt lookup)), and what was decided at load:
        ``max_context``, ``decode`` and ``prefill`` (the arithmetic of decode steps and of
        prompts, ``"exact"`` or ``"int8"``), ``row_invariant`` (True when they agree: every row's
        logits depend on its own tokens alone), ``lookahead`` (whether decode predicts the next
        layer's experts to prefetch them) and ``routing``: ``experts_per_token`` (routed experts
        per token in effect) and ``num_experts_per_tok`` (the model's own k; the two differ only
        when ``experts_per_token`` chose fewer, which changes the output)."""
        info = model_info(self.path, mtp_loaded=self.has_mtp)
        stats, decided = self._engine.expert_stats(), self._engine.info()
        info["memory"]["ram_budget_bytes"] = stats["budget_bytes"]
        info["memory"]["mtp_resident_bytes"] = stats["resident_bytes"]
        info["memory"]["io_mode"] = stats["io_mode"]
        info["memory"]["pin_mtp"] = self._pin_mtp.as_dict()
        info["max_context"] = self.max_context
        info["prefill"] = decided["prefill"]
        info["decode"] = decided["decode"]
        info["row_invariant"] = decided["row_invariant"]
        info["lookahead"] = decided["lookahead"]
        info["routing"] = {
            "experts_per_token": decided["experts_per_token"],
            "num_experts_per_tok": decided["model_experts_per_token"],
        }
        info["experts_workers"] = None if self._remote is None else self._remote.info()
        return info

    def experts_workers(self) -> list[dict[str, Any]] | None:
        """The expert workers in use (``experts="ray://..."``), or ``None``: per worker its
        name, host, pid, ``up``, the experts and bytes it holds, its calls, failures and
        latency (``mean_ms``, ``last_ms``, ``max_ms`` per layer round trip), bytes sent and
        received, and ``last_error``."""
        return None if self._remote is None else self._remote.info()

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
            if self._live_engine is not None and self._remote is not None:
                self._live_engine.set_remote_experts(None)
                self._remote.close()
            self._live_engine = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._live_engine is None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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


def _read_json(path: Path) -> dict[str, Any]:
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as e:
        raise ColibriError(f"{path}: cannot read JSON: {e}") from e
    return data if isinstance(data, dict) else {}
