"""The OpenAI wire format's answers: response, chunk, usage and logprobs bodies of a
checked request (``colibri._openai.Request``) and its generations."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from colibri import _reasoning
from colibri.model import Model
from colibri.results import GenerationResult, GenerationStats

if TYPE_CHECKING:
    from colibri._openai import ChoiceStream, Request
    from colibri._openai_errors import Kind


#: One scored token: its id, its log-probability and the top alternatives ``(id, logprob)``.
Scored = tuple[int, float, Sequence[tuple[int, float]]]


def logprobs_body(
    model: Model, result: GenerationResult, kind: Kind, top: int
) -> dict[str, Any] | None:
    """The OpenAI ``logprobs`` object of a choice, from the engine's per-token
    log-probabilities (``result.logprobs[i]`` for generated token ``i``,
    ``result.top_logprobs[i]``: the ``top`` most likely ``(token_id, logprob)`` there).

    Chat: ``{"content": [{"token", "logprob", "bytes", "top_logprobs": [...]}],
    "refusal": None}``; completions: ``{"tokens", "token_logprobs", "top_logprobs",
    "text_offset"}``. The one place that maps them, for JSON and SSE answers alike (a
    stream sends the tokens' entries chunk by chunk, :func:`scored_body`)."""
    scored = result_scored(result)
    return None if scored is None else scored_body(model, scored, kind, top)[0]


def result_scored(result: GenerationResult) -> list[Scored] | None:
    """The scored tokens of a result (None when it has no log-probabilities)."""
    lps: Sequence[float] | None = getattr(result, "logprobs", None)
    if lps is None:
        return None
    tops: Sequence[Sequence[tuple[int, float]]] = getattr(result, "top_logprobs", None) or [
        [] for _ in lps
    ]
    return list(zip(result.token_ids[: len(lps)], lps, tops, strict=False))


def rows_scored(rows: Sequence[Mapping[str, Any]]) -> list[Scored]:
    """The engine's log-probability rows (``on_tokens``'s) as scored tokens."""
    return [
        (int(r["token"]), float(r["logprob"]), [(int(t), float(lp)) for t, lp in r["top"]])
        for r in rows
    ]


def scored_body(
    model: Model, scored: Sequence[Scored], kind: Kind, top: int, offset: int = 0
) -> tuple[dict[str, Any], int]:
    """The ``logprobs`` object of ``scored`` tokens, and the text offset after them
    (completions' ``text_offset`` counts from ``offset``, where the earlier tokens ended)."""

    def text(t: int) -> str:
        return model.decode([t], skip_special_tokens=False)

    if kind == "chat":
        content = []
        for t, lp, alts in scored:
            s = text(t)
            content.append(
                {
                    "token": s,
                    "logprob": float(lp),
                    "bytes": list(s.encode("utf-8")),
                    "top_logprobs": [
                        {"token": text(a), "logprob": float(b), "bytes": list(text(a).encode())}
                        for a, b in list(alts)[:top]
                    ],
                }
            )
        return {"content": content, "refusal": None}, offset
    tokens = [text(t) for t, _, _ in scored]
    offsets, at = [], offset
    for s in tokens:
        offsets.append(at)
        at += len(s)
    body = {
        "tokens": tokens,
        "token_logprobs": [float(lp) for _, lp, _ in scored],
        "top_logprobs": [{text(a): float(b) for a, b in list(alts)[:top]} for _, _, alts in scored]
        if top
        else None,
        "text_offset": offsets,
    }
    return body, at


FINISH_REASONS = {"length": "length", "stop": "stop", "cancelled": "stop"}


def usage(stats: GenerationStats | Sequence[GenerationStats], n: int = 1) -> dict[str, Any]:
    """OpenAI's ``usage`` object; ``prompt_tokens_details.cached_tokens`` counts the prompt
    tokens whose KV a session already held (not prefilled again). ``stats`` are the choices',
    ``n`` per prompt: each prompt counts once and the completion tokens are summed."""
    every = [stats] if isinstance(stats, GenerationStats) else list(stats)
    firsts = every[::n]
    prompt = sum(s.prompt_tokens for s in firsts)
    completion = sum(s.generated_tokens for s in every)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(s.prompt_cached_tokens for s in firsts)},
    }


def colibri_stats(stats: GenerationStats) -> dict[str, Any]:
    """The extension object ``"colibri"`` of a response: how the generation ran (of choice
    0 when there are several)."""
    return {
        "prompt_cached_tokens": stats.prompt_cached_tokens,
        "prefilled_tokens": stats.prompt_tokens - stats.prompt_cached_tokens,
        "tokens_per_second": stats.tokens_per_second,
        "prompt_tokens_per_second": stats.prompt_tokens_per_second,
        "tokens_per_forward": stats.tokens_per_forward,
        "forwards": stats.forwards,
        "drafts_proposed": list(stats.drafts_proposed),
        "drafts_accepted": list(stats.drafts_accepted),
        "expert_hits": stats.expert_hits,
        "expert_misses": stats.expert_misses,
        "expert_bytes_read": stats.expert_bytes_read,
        "expert_wait_seconds": stats.expert_wait_seconds,
        "prefetch_recall": stats.prefetch_recall,
    }


def _results(results: GenerationResult | Sequence[GenerationResult]) -> list[GenerationResult]:
    return [results] if isinstance(results, GenerationResult) else list(results)


def response(
    req: Request, results: GenerationResult | Sequence[GenerationResult], model: Model
) -> dict[str, Any]:
    """The JSON body of a finished, non-streamed request (one result per choice)."""
    every = _results(results)
    choices = []
    for index, result in enumerate(every):
        finish = FINISH_REASONS[result.finish_reason]
        lp = None if req.logprobs is None else logprobs_body(model, result, req.kind, req.logprobs)
        if req.kind == "chat":
            reasoning, content, calls = req.answer(result.text)
            message: dict[str, Any] = {"role": "assistant", "content": content}
            if reasoning is not None and req.include_reasoning:
                message["reasoning_content"] = reasoning
            if calls:
                message["tool_calls"] = [c.openai() for c in calls]
                finish = "tool_calls"
            message["refusal"] = None
            choices.append(
                {
                    "index": index,
                    "message": message,
                    "logprobs": lp,
                    "finish_reason": finish,
                }
            )
        else:
            choices.append(
                {
                    "index": index,
                    "text": req.choice_echo(index) + result.text,
                    "logprobs": lp,
                    "finish_reason": finish,
                }
            )
    obj = "chat.completion" if req.kind == "chat" else "text_completion"
    return {
        **_envelope(req, obj),
        "choices": choices,
        "usage": usage([r.stats for r in every], req.n),
        "colibri": colibri_stats(every[0].stats),
    }


def chunk(
    req: Request,
    *,
    text: str | None = None,
    role: bool = False,
    finish: str | None = None,
    logprobs: dict[str, Any] | None = None,
    index: int = 0,
    reasoning: str | None = None,
) -> dict[str, Any]:
    """One SSE chunk (``chat.completion.chunk`` / ``text_completion``) of a streamed answer,
    for choice ``index`` (``reasoning``: a thinking model's reasoning delta)."""
    if req.kind == "chat":
        delta: dict[str, Any] = {}
        if role:
            delta["role"] = "assistant"
        if reasoning is not None:
            delta["reasoning_content"] = reasoning
        if text is not None:
            delta["content"] = text
        choice: dict[str, Any] = {
            "index": index,
            "delta": delta,
            "logprobs": logprobs,
            "finish_reason": finish,
        }
        obj = "chat.completion.chunk"
    else:
        choice = {"index": index, "text": text or "", "logprobs": logprobs, "finish_reason": finish}
        obj = "text_completion"
    body: dict[str, Any] = {**_envelope(req, obj), "choices": [choice]}
    if req.include_usage:
        body["usage"] = None
    return body


def text_chunks(
    req: Request,
    state: ChoiceStream,
    text: str | None,
    index: int = 0,
    rows: Sequence[Mapping[str, Any]] = (),
    model: Model | None = None,
) -> list[dict[str, Any]]:
    """The chunks of a streamed text delta of choice ``index``: split into reasoning and
    content deltas, tool calls held back for the end (``text=None``: what ``state`` still
    holds, at the end of the choice). ``rows`` are the log-probability rows of the tokens
    the delta completes: the first chunk made carries them (with those of earlier deltas
    that made none), in the ``logprobs`` shape of the request (``model`` names tokens)."""
    pieces: list[_reasoning.Piece]
    if state.reasoning is None:
        pieces = [] if text is None else [("content", text)]
    else:
        pieces = state.reasoning.flush() if text is None else state.reasoning.push(text)
    out = []
    for kind, piece in pieces:
        if kind == "content":
            shown = piece if state.calls is None else state.calls.push(piece)
            if shown:
                out.append(chunk(req, text=shown, index=index))
        elif req.include_reasoning:
            out.append(chunk(req, reasoning=piece, index=index))
    if text is None and state.calls is not None:
        rest = state.calls.flush()
        if rest:
            out.append(chunk(req, text=rest, index=index))
    if req.logprobs is not None:
        state.pending.extend(rows_scored(rows))
        if out and state.pending and model is not None:
            out[0]["choices"][0]["logprobs"] = state.logprobs(model, req, state.pending)
            state.pending = []
    return out


def opening_chunks(req: Request, index: int = 0) -> list[dict[str, Any]]:
    """The chunks a stream (of choice ``index``) starts with: the assistant role (chat), or
    the echoed prompt."""
    if req.kind == "chat":
        return [chunk(req, text="", role=True, index=index)]
    echo = req.choice_echo(index)
    return [chunk(req, text=echo, index=index)] if echo else []


def finish_chunk(
    req: Request,
    result: GenerationResult,
    model: Model,
    index: int = 0,
    state: ChoiceStream | None = None,
) -> dict[str, Any]:
    """The chunk that ends choice ``index``: its finish reason, with the log-probabilities
    of the tokens no earlier chunk carried (``state``: what the stream sent; without it,
    all of them): those of a stop string or stop token, or of text held back."""
    lp = None
    scored = None if req.logprobs is None else result_scored(result)
    if scored is not None:
        if state is None:
            lp = scored_body(model, scored, req.kind, req.logprobs)[0]
        elif scored[state.sent :]:
            lp = state.logprobs(model, req, scored[state.sent :])
    finish = FINISH_REASONS[result.finish_reason]
    body = chunk(req, text=None if req.kind == "chat" else "", logprobs=lp, index=index)
    if req.tool_use is not None:
        calls = req.answer(result.text)[2]
        if calls:  # held back from the stream: here whole, as OpenAI's deltas carry them
            body["choices"][0]["delta"]["tool_calls"] = [
                c.openai(index=k) for k, c in enumerate(calls)
            ]
            finish = "tool_calls"
    body["choices"][0]["finish_reason"] = finish
    return body


def closing_chunks(
    req: Request,
    results: GenerationResult | Sequence[GenerationResult],
    model: Model,
    states: Sequence[ChoiceStream] | None = None,
) -> list[dict[str, Any]]:
    """The chunks a finished stream ends with: each choice's finish chunk (``states``: each
    choice's stream, for the log-probabilities it has not sent) and, when asked, the
    usage."""
    every = _results(results)
    out = [
        finish_chunk(req, r, model, i, None if states is None else states[i])
        for i, r in enumerate(every)
    ]
    if req.include_usage:
        out.append(usage_chunk(req, every))
    return out


def usage_chunk(
    req: Request, results: GenerationResult | Sequence[GenerationResult]
) -> dict[str, Any]:
    """The last chunk of a stream with ``stream_options.include_usage``: no choices, the
    usage (and the ``colibri`` extension object)."""
    every = _results(results)
    obj = "chat.completion.chunk" if req.kind == "chat" else "text_completion"
    return {
        **_envelope(req, obj),
        "choices": [],
        "usage": usage([r.stats for r in every], req.n),
        "colibri": colibri_stats(every[0].stats),
    }


def _envelope(req: Request, obj: str) -> dict[str, Any]:
    """The fields every response and chunk body starts with."""
    return {
        "id": req.id,
        "object": obj,
        "created": req.created,
        "model": req.model,
        "system_fingerprint": system_fingerprint(),
    }


def system_fingerprint() -> str:
    """``colibri-<version>``: the backend configuration a response came from."""
    from colibri import __version__

    return f"colibri-{__version__}"
