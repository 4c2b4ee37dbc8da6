"""The generation fields of an OpenAI request as ``Session.generate`` keywords: length,
sampling, stop strings and tokens, drafting, log-probabilities, OpenAI's and vLLM's logit
processing, and structured output (``response_format``, vLLM's ``guided_*``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from colibri._openai_errors import Kind, invalid, is_int, is_num, opt_bool, opt_int, opt_num
from colibri.model import Model


def generation_keywords(
    body: Mapping[str, Any],
    kind: Kind,
    model: Model,
    prompt_ids: list[int],
    logprobs: int | None,
) -> dict[str, Any]:
    """The ``Session.generate`` keywords of the fields colibri reads itself (``prompt_ids``:
    the longest prompt, which bounds the default length of a chat answer)."""
    max_tokens = _max_tokens(body, kind, model, len(prompt_ids))
    temperature = opt_num(body, "temperature", 0.0, 2.0)
    top_p = opt_num(body, "top_p", 0.0, 1.0)
    if top_p == 0.0:
        top_p, temperature = None, 0.0  # no mass left but the most likely token: greedy
    top_k = opt_int(body, "top_k", 0)
    seed = body.get("seed")
    if seed is not None:
        if not is_int(seed):
            raise invalid("seed", f"{seed!r}; expected an integer")
        seed %= 2**64  # OpenAI takes any 64-bit integer, negative ones included
    stop = parse_stop(body.get("stop"))
    greedy = temperature == 0.0 or (
        temperature is None and not model._generation_config.get("do_sample", False)
    )
    gen: dict[str, Any] = {
        "max_new_tokens": max_tokens,
        "temperature": temperature,
        "stop": stop,
    }
    if not greedy:  # they only shape sampling: a greedy generation needs none of them
        gen.update(top_p=top_p, top_k=top_k, seed=seed)
    for name in ("draft", "draft_depth"):
        if body.get(name) is not None:
            gen[name] = body[name]
    stop_ids = _stop_token_ids(body, model)
    if stop_ids is not None:
        gen["stop_token_ids"] = stop_ids
    if logprobs is not None:
        gen["logprobs"] = logprobs
    gen.update(logit_processing(body, model))
    gen.update(structured_output(body))
    return gen


def _max_tokens(body: Mapping[str, Any], kind: Kind, model: Model, prompt_len: int) -> int:
    """The answer's length bound: ``max_tokens`` (a chat's ``max_completion_tokens`` wins),
    else OpenAI's default for the endpoint."""
    max_tokens = opt_int(body, "max_tokens", 1)
    if kind == "chat":
        mct = opt_int(body, "max_completion_tokens", 1)
        if mct is not None:
            max_tokens = mct
        if max_tokens is None:  # OpenAI's (and vLLM's) default: the rest of the context
            max_tokens = max(1, model.max_context - prompt_len)
    elif max_tokens is None:
        max_tokens = 16  # OpenAI's default for /v1/completions
    return max_tokens


def _stop_token_ids(body: Mapping[str, Any], model: Model) -> list[int] | None:
    """The tokens that end the answer, as vLLM has them: ``stop_token_ids`` on top of EOS,
    and ``ignore_eos`` to drop EOS; None when neither is given (the model's EOS)."""
    stop_ids = body.get("stop_token_ids")
    if stop_ids is not None and not isinstance(stop_ids, list):
        raise invalid("stop_token_ids", f"{stop_ids!r}; expected a list of token ids")
    ignore_eos = bool(opt_bool(body, "ignore_eos"))
    if not (stop_ids or ignore_eos):
        return None
    eos = [] if ignore_eos else model.eos_token_ids
    return eos + [t for t in stop_ids or [] if t not in eos]


def parse_logprobs(body: Mapping[str, Any], kind: Kind) -> int | None:
    """How many alternatives per token the request wants, or None for no logprobs."""
    if kind == "chat":
        on = opt_bool(body, "logprobs")
        top = opt_int(body, "top_logprobs", 0, 20)
        return (top or 0) if on else None
    return opt_int(body, "logprobs", 0, 20)


def parse_stop(stop: object) -> list[str] | None:
    """``stop`` as a list of stop strings (None: none)."""
    if stop is None:
        return None
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, list) or not all(isinstance(s, str) for s in stops):
        raise invalid("stop", f"{stop!r}; expected a string or a list of strings")
    if any(not s for s in stops):
        raise invalid("stop", "empty strings never match; remove them")
    return stops or None


def logit_processing(body: Mapping[str, Any], model: Model) -> dict[str, Any]:
    """OpenAI's penalties and ``logit_bias`` and vLLM's ``min_p``, ``repetition_penalty``,
    ``min_tokens``, as ``Model.generate`` keywords (applied in the engine's sampler, also
    on greedy requests, and lossless under speculation)."""
    out: dict[str, Any] = {}
    for pen in ("frequency_penalty", "presence_penalty"):
        v = opt_num(body, pen, -2.0, 2.0)
        if v:
            out[pen] = v
    rep = opt_num(body, "repetition_penalty", 0.0, 10.0)
    if rep is not None:
        if rep <= 0:
            raise invalid("repetition_penalty", f"{rep}; must be > 0 (1 = off)")
        out["repetition_penalty"] = rep
    min_p = opt_num(body, "min_p", 0.0, 1.0)
    if min_p:
        out["min_p"] = min_p
    min_tokens = opt_int(body, "min_tokens", 0)
    if min_tokens:
        out["min_tokens"] = min_tokens
    lb = body.get("logit_bias")
    if lb is not None:
        if not isinstance(lb, Mapping):
            raise invalid("logit_bias", f"{lb!r}; expected a map of token id to bias")
        bias: dict[int, float] = {}
        for k, v in lb.items():
            try:
                tok = int(k)
            except (TypeError, ValueError):
                raise invalid("logit_bias", f"key {k!r} is not a token id") from None
            if not 0 <= tok < model._vocab_size:
                raise invalid("logit_bias", f"token id {tok} is outside the vocabulary")
            if not is_num(v) or not -100 <= v <= 100:
                raise invalid("logit_bias", f"token {tok}: {v!r}; expected a number in [-100, 100]")
            bias[tok] = float(v)
        if bias:
            out["logit_bias"] = bias
    return out


def structured_output(body: Mapping[str, Any]) -> dict[str, Any]:
    """OpenAI's ``response_format`` (``{"type": "json_object"}``, ``{"type": "json_schema",
    "json_schema": {"schema": ...}}``; llama-cpp-python's ``{"type": "json_object", "schema":
    ...}``) and vLLM's ``guided_json`` / ``guided_regex`` / ``guided_grammar``, as
    ``Model.generate`` keywords."""
    out: dict[str, Any] = {}
    for name in ("guided_json", "guided_regex", "guided_grammar"):
        if body.get(name) is not None:
            out[name] = body[name]
    rf = body.get("response_format")
    if rf is None:
        return out
    if not isinstance(rf, dict) or "type" not in rf:
        raise invalid("response_format", f"{rf!r}; expected an object with a 'type'")
    kind = rf["type"]
    if kind == "text":
        return out
    if kind == "json_object":
        schema: object = rf.get("schema", {"type": "object"})
    elif kind == "json_schema":
        spec = rf.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid(
                "response_format",
                "type 'json_schema' needs 'json_schema': {'name': ..., 'schema': {...}}",
            )
        schema = spec["schema"]
    else:
        raise invalid(
            "response_format",
            f"type {kind!r}; expected 'text', 'json_object' or 'json_schema'",
        )
    if not isinstance(schema, (dict, bool)):
        raise invalid("response_format", f"the schema {schema!r} is not a JSON schema object")
    if out:
        raise invalid("response_format", f"give it or {', '.join(out)}, not both")
    return {"guided_json": schema}
