"""What a generation returns: :class:`GenerationResult` with its :class:`GenerationStats`,
and the finish reasons."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from colibri.errors import InternalError

#: Why a generation ended: ``"length"`` (``max_new_tokens`` or the context limit),
#: ``"stop"`` (an EOS / stop token or a stop string), ``"cancelled"`` (the consumer stopped
#: it: a closed or abandoned stream, an ``on_tokens`` callback).
FinishReason = Literal["length", "stop", "cancelled"]

#: The engine's finish reasons (``FinishReason::as_str`` in src/decode/spec.rs) as reported
#: here: the context filling up ends a generation like ``max_new_tokens`` does.
_ENGINE_FINISH_REASONS: dict[str, FinishReason] = {
    "length": "length",
    "stop": "stop",
    "cancelled": "cancelled",
    "context_full": "length",
}


@dataclass(frozen=True)
class GenerationStats:
    """What one generation cost and how speculation and the expert store behaved.

    The fields are those of the Rust engine's ``GenerationStats`` (``crate::engine::stats``),
    the one source of these names."""

    prompt_tokens: int
    #: Leading prompt tokens whose KV the session (or the model's own conversation) already
    #: held, so the prefill skipped them (a chat's earlier turns; 0 for a new prompt).
    prompt_cached_tokens: int
    #: Tokens emitted, a final stop token included.
    generated_tokens: int
    #: Main-model forwards: prefill chunks plus decode forwards.
    forwards: int
    #: Forwards after the prefill (plain steps and verifies).
    decode_forwards: int
    #: MTP-layer forwards (absorbs and chained drafts).
    mtp_forwards: int
    #: Generated tokens per decode forward (1.0 without drafting).
    tokens_per_forward: float
    #: Decode speed, excluding prefill.
    tokens_per_second: float
    #: Prompt-processing speed: prefilled (not cached) tokens per prefill second.
    prompt_tokens_per_second: float
    prefill_seconds: float
    decode_seconds: float
    #: Draft tokens proposed / accepted, indexed by depth (index 0 is depth 1).
    drafts_proposed: list[int]
    drafts_accepted: list[int]
    acceptance_rate: float
    draft_seconds: float
    verify_seconds: float
    #: Times the pause guard switched drafting off.
    guard_pauses: int
    #: Decode cycles per draft depth (index 0: no draft).
    depth_histogram: list[int]
    #: Routed-expert uses served from memory / read from disk, and the bytes read.
    expert_hits: int
    expert_misses: int
    expert_bytes_read: int
    #: Seconds the forward waited for expert reads.
    expert_wait_seconds: float
    #: Share of the routed experts the router lookahead predicted (None: it predicted none).
    prefetch_recall: float | None
    prefetch_useful: int
    prefetch_wasted: int
    #: The I/O mode in effect (``"direct"`` falls back to ``"pread"`` where refused).
    io_mode: str
    #: Fields a newer engine reports that this class does not name yet.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class GenerationResult:
    """The output of :meth:`Model.generate`."""

    text: str
    token_ids: list[int]
    #: ``"length"`` (max_new_tokens), ``"stop"`` (EOS or a stop string) or ``"cancelled"``.
    finish_reason: FinishReason
    stats: GenerationStats
    #: With ``logprobs=k``: each generated token's log-probability under the distribution
    #: the sampler drew it from (greedy: the softmax of the processed logits).
    logprobs: list[float] | None = None
    #: With ``logprobs=k``: per token, the k most likely ``(token id, logprob)``.
    top_logprobs: list[list[tuple[int, float]]] | None = None
    #: With ``prompt_logprobs=k``: each prompt token's log-probability given the tokens
    #: before it (the model's softmax at temperature 1), ``None`` for the first, as vLLM has.
    prompt_logprobs: list[float | None] | None = None
    #: With ``prompt_logprobs=k``: per prompt token, the k most likely ``(token id,
    #: logprob)`` at its position (``[]`` for the first).
    prompt_top_logprobs: list[list[tuple[int, float]]] | None = None
    #: The tool calls of the answer (``Model.chat(tools=...)``), as OpenAI's ``tool_calls``
    #: (``{"id", "type": "function", "function": {"name", "arguments"}}``, the arguments
    #: JSON text); ``text`` is then what came before them. None without tools.
    tool_calls: list[dict[str, Any]] | None = None

    def __str__(self) -> str:
        return self.text


def _stats(raw: Mapping[str, Any]) -> GenerationStats:
    known = [f for f in GenerationStats.__dataclass_fields__ if f != "extra"]
    missing = [k for k in known if k not in raw]
    if missing:
        raise InternalError(f"the engine's stats lack {', '.join(missing)}")
    extra = {k: v for k, v in raw.items() if k not in GenerationStats.__dataclass_fields__}
    return GenerationStats(**{k: raw[k] for k in known}, extra=extra)
