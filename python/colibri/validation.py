"""Argument checking for :class:`colibri.Model`: the option vocabulary (from the engine),
numbers, byte sizes, draft depths, chat templates, JSON schemas, and the logit-processing
keywords of a generation. Every failure is an :class:`InvalidArgumentError` that names the
argument.

A generation's keywords are checked here for their types and shapes only (what Python must
convert: numbers, token-id lists, mappings, strings); their values (ranges, finiteness, the
engine's limits) are checked once, by the Rust engine's ``GenerateRequest``
(:func:`check_engine_request`)."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from colibri import _core
from colibri.errors import ConfigError, InvalidArgumentError
from colibri.sampling import DraftMode as DraftMode
from colibri.sampling import SamplingParams

IoMode = Literal["auto", "mmap", "pread", "direct"]
PrefetchMode = Literal["auto", "off", "hint", "real"]
PrefillMode = Literal["auto", "exact", "int8"]
DecodeMode = Literal["auto", "exact", "int8"]

# The vocabulary of the string options comes from the Rust engine (crate::engine::CHOICES);
# the Literal types above repeat it for type checkers, and a test keeps them equal.
_CHOICES: dict[str, tuple[str, ...]] = {k: tuple(v) for k, v in _core.choices().items()}
_LIMITS: dict[str, int] = dict(_core.limits())
_DRAFT_MODES = _CHOICES["draft"]
_IO_MODES = _CHOICES["io"]
_PREFETCH_MODES = _CHOICES["prefetch"]
_PREFILL_MODES = _CHOICES["prefill"]
_DECODE_MODES = _CHOICES["decode"]


def _check_choice(name: str, value: object, choices: Sequence[str]) -> str:
    if not isinstance(value, str) or value not in choices:
        raise InvalidArgumentError(
            f"invalid value for '{name}': {value!r}; expected one of {', '.join(choices)}"
        )
    return value


#: Largest integer any parameter takes (the engine's 64-bit sizes and counts).
_MAX_INT = 2**63 - 1
#: Most compute threads a model accepts.
MAX_THREADS = 4096
#: Text bytes one token may stand for, at least: the bound on a prompt's size before it is
#: tokenised is ``max_context`` times this or the vocabulary's longest token, whichever is
#: larger (a normaliser may also drop characters; 32 leaves room for that).
MIN_BYTES_PER_TOKEN = 32


def _check_int(
    name: str, value: object, *, minimum: int | None = None, maximum: int = _MAX_INT
) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise InvalidArgumentError(f"invalid value for '{name}': {value!r}; expected an integer")
    v = int(value)
    if minimum is not None and v < minimum:
        raise InvalidArgumentError(f"invalid value for '{name}': {v}; must be >= {minimum}")
    if v > maximum:
        raise InvalidArgumentError(f"invalid value for '{name}': {v}; must be <= {maximum}")
    return v


_SIZE_UNITS = {
    "k": 10**3,
    "m": 10**6,
    "g": 10**9,
    "t": 10**12,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}


def parse_size(name: str, text: str) -> int:
    """Parse a byte size such as ``"4GiB"``, ``"500MB"`` or ``"1048576"`` for parameter
    ``name``; anything else is an :class:`InvalidArgumentError`."""
    t = text.strip().lower().removesuffix("b")
    try:
        for suffix in sorted(_SIZE_UNITS, key=len, reverse=True):
            if t.endswith(suffix):
                value = int(float(t[: -len(suffix)]) * _SIZE_UNITS[suffix])
                break
        else:
            value = int(t)
    except (ValueError, OverflowError):  # "abc", "nanGB", "infGB"
        raise InvalidArgumentError(
            f"invalid value for '{name}': {text!r}; use bytes or a unit, e.g. '8GB', '512MiB'"
        ) from None
    if value < 0:
        raise InvalidArgumentError(f"invalid value for '{name}': {text!r}; must be >= 0")
    if value > _MAX_INT:
        raise InvalidArgumentError(f"invalid value for '{name}': {text!r}; must be < 2**63")
    return value


def _parse_bytes(name: str, value: int | str | None) -> int | None:
    """``None``, an int of bytes, or a string like ``"8GB"`` / ``"512MiB"``."""
    if value is None:
        return None
    if isinstance(value, str):
        return parse_size(name, value)
    return _check_int(name, value, minimum=0)


def _check_depth(depth: object) -> int:
    """``draft_depth`` as the engine takes it: 0 for ``"auto"``, else the integer (its range
    is the engine's check)."""
    if depth == "auto":
        return 0
    return _check_int("draft_depth", depth, minimum=1)


def _template_text(value: str | os.PathLike[str] | None) -> str | None:
    """A chat template given as text, or as the path of a file holding it."""
    if value is None:
        return None
    if isinstance(value, os.PathLike) or (
        isinstance(value, str) and "{" not in value and Path(value).is_file()
    ):
        path = Path(value)
        try:
            return path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as e:
            raise InvalidArgumentError(
                f"invalid value for 'chat_template': cannot read {path}: {e}"
            ) from e
    if not isinstance(value, str) or not value:
        raise InvalidArgumentError(
            f"invalid value for 'chat_template': {value!r}; expected template text or a file"
        )
    return value


def _schema_text(value: object) -> str:
    """``guided_json`` as JSON text: a dict, JSON text, or a pydantic model class."""
    to_schema = getattr(value, "model_json_schema", None)
    if callable(to_schema):
        value = to_schema()
    if isinstance(value, str):
        if not value.strip():
            raise InvalidArgumentError("invalid value for 'guided_json': the schema is empty")
        return value
    if isinstance(value, (Mapping, bool)):
        try:
            return json.dumps(value)
        except (TypeError, ValueError) as e:
            raise InvalidArgumentError(
                f"invalid value for 'guided_json': the schema is not JSON-serialisable: {e}"
            ) from None
    raise InvalidArgumentError(
        f"invalid value for 'guided_json': {value!r}; expected a JSON schema (a dict or its "
        "JSON text)"
    )


def _is_batch(prompt: object) -> bool:
    """A list of prompts (texts, or token-id lists), as opposed to one prompt's token ids."""
    return (
        isinstance(prompt, (list, tuple))
        and len(prompt) > 0
        and all(isinstance(p, (str, list, tuple)) for p in prompt)
    )


def _choices(n: object, sampling_params: object) -> int:
    """How many completions a call asks for (``n``, as a keyword or in ``sampling_params``)."""
    in_params = sampling_params.n if isinstance(sampling_params, SamplingParams) else None
    if n is not None and in_params is not None:
        raise InvalidArgumentError("'n' is given both as a keyword and in sampling_params")
    value = n if n is not None else in_params
    if value is None:
        return 1
    return _check_int("n", value, minimum=1, maximum=_MAX_CHOICES)


#: Most completions one call may ask for (each decodes in the same batch, on its own KV).
_MAX_CHOICES = 64


def _default_max_new_tokens(gc: Mapping[str, Any], path: Path) -> int:
    """``max_new_tokens`` of ``generation_config.json`` (the model author's default length),
    else 128."""
    value = gc.get("max_new_tokens")
    if value is None:
        return 128
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(
            f"{path}: 'max_new_tokens' must be a positive integer, not {value!r}; fix or remove it"
        )
    return value


def _check_alternatives(name: str, value: object) -> int | None:
    """``logprobs`` / ``prompt_logprobs``: how many most likely alternatives to report
    (``None``: no log-probabilities at all; the most allowed is the engine's check)."""
    if value is None:
        return None
    return _check_int(name, value, minimum=0)


def _number(name: str, value: object) -> float:
    """A number of a generation's keywords (its range, finiteness included, is the engine's
    check)."""
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise InvalidArgumentError(f"invalid value for '{name}': {value!r}; expected a number")
    return float(value)


def _check_processing(
    given: Mapping[str, Any], check_token: Callable[[str, object], int]
) -> dict[str, Any]:
    """The logit-processing, logprobs and progress arguments of a generation (``given``:
    the call's keywords), validated; ``check_token`` checks a token id against the
    vocabulary."""
    out: dict[str, Any] = {}
    out["min_p"] = _number("min_p", given.get("min_p", 0.0))
    out["repetition_penalty"] = _number("repetition_penalty", given.get("repetition_penalty", 1.0))
    for name in ("presence_penalty", "frequency_penalty"):
        out[name] = _number(name, given.get(name, 0.0))
    bias = given.get("logit_bias") or {}
    if not isinstance(bias, Mapping):
        raise InvalidArgumentError(
            f"invalid value for 'logit_bias': {bias!r}; expected a mapping of token id to a number"
        )
    pairs: list[tuple[int, float]] = []
    for tok, value in bias.items():
        t = check_token("logit_bias", tok)
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise InvalidArgumentError(
                f"invalid value for 'logit_bias': token {t}: {value!r} is not a number"
            )
        pairs.append((t, float(value)))
    out["logit_bias"] = pairs
    out["min_tokens"] = _check_int("min_tokens", given.get("min_tokens", 0), minimum=0)
    for name in ("logprobs", "prompt_logprobs"):
        out[name] = _check_alternatives(name, given.get(name))
    progress = given.get("prefill_progress")
    if progress is not None and not callable(progress):
        raise InvalidArgumentError(
            f"invalid value for 'prefill_progress': {progress!r}; expected a callable "
            "taking (done, total)"
        )
    out["prefill_progress"] = progress
    return out


def _check_temperature(value: object) -> float:
    return _number("temperature", value)


def _check_top_p(value: object) -> float:
    return _number("top_p", value)


def _check_seed(value: object) -> int:
    return _check_int("seed", value, minimum=0, maximum=2**64 - 1)


def _check_stops(stop: object) -> list[str]:
    """``stop`` (a string or a list of strings) as a list."""
    if stop is not None and not isinstance(stop, (str, list, tuple)):
        raise InvalidArgumentError(
            f"invalid value for 'stop': {stop!r}; expected a string or a list of strings"
        )
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if not all(isinstance(s, str) and s for s in stops):
        raise InvalidArgumentError("invalid value for 'stop': expected non-empty strings")
    return stops


def _check_stop_ids(value: object, check_token: Callable[[str, object], int]) -> list[int]:
    if isinstance(value, (str, bytes)) or not isinstance(value, (list, tuple, set, frozenset)):
        raise InvalidArgumentError(
            f"invalid value for 'stop_token_ids': {value!r}; expected a list of token ids"
        )
    return [check_token("stop_token_ids", t) for t in value]


def _check_bool(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise InvalidArgumentError(f"invalid value for '{name}': {value!r}; expected a bool")
    return value


_GUIDED_KINDS = {"guided_json": "json", "guided_regex": "regex", "guided_grammar": "grammar"}


def _guided_argument(given: Mapping[str, Any]) -> tuple[str, str] | None:
    """The engine's ``grammar`` argument, ``(kind, text)``, of the ``guided_*`` keywords in
    ``given`` (at most one), before it is compiled against a vocabulary."""
    named = [k for k in _GUIDED_KINDS if given.get(k) is not None]
    if not named:
        return None
    if len(named) > 1:
        raise InvalidArgumentError(
            f"give one of {', '.join(repr(k) for k in named)}: a generation follows one "
            "structured-output constraint"
        )
    name = named[0]
    value = given[name]
    if name == "guided_json":
        value = _schema_text(value)
    elif not isinstance(value, str) or not value.strip():
        raise InvalidArgumentError(
            f"invalid value for {name!r}: {value!r}; expected a non-empty string"
        )
    return _GUIDED_KINDS[name], value


def _token_id_shape(name: str, value: object) -> int:
    """A token id checked without a vocabulary (its range is checked by the model)."""
    return _check_int(name, value, minimum=0)


def check_sampling_fields(fields: Mapping[str, Any]) -> None:
    """Check the set fields of a :class:`SamplingParams` as far as no model is needed (types
    and ranges; token ids against the vocabulary, the prompt's length and the constraint's
    compilation are checked by the generation)."""
    if fields.get("max_tokens") is not None:
        _check_int("max_tokens", fields["max_tokens"], minimum=1)
    if fields.get("temperature") is not None:
        _check_temperature(fields["temperature"])
    if fields.get("top_k") is not None:
        _check_int("top_k", fields["top_k"], minimum=0)
    if fields.get("top_p") is not None:
        _check_top_p(fields["top_p"])
    if fields.get("seed") is not None:
        _check_seed(fields["seed"])
    _check_stops(fields.get("stop"))
    if fields.get("stop_token_ids") is not None:
        _check_stop_ids(fields["stop_token_ids"], _token_id_shape)
    for name in ("ignore_eos", "include_stop_str_in_output"):
        if fields.get(name) is not None:
            _check_bool(name, fields[name])
    if fields.get("n") is not None:
        _check_int("n", fields["n"], minimum=1, maximum=_MAX_CHOICES)
    processing = _check_processing(fields, _token_id_shape)
    _guided_argument(fields)
    request = {k: v for k, v in processing.items() if k != "prefill_progress"}
    for name, check in (("temperature", _check_temperature), ("top_p", _check_top_p)):
        if fields.get(name) is not None:
            request[name] = check(fields[name])
    if fields.get("top_k") is not None:
        request["top_k"] = fields["top_k"]
    check_engine_request(request)


def check_engine_request(request: Mapping[str, Any]) -> None:
    """Check the values of a generation's engine request (``Engine.generate``'s dict, any
    of its fields) as far as no model is needed: the engine's own check, whose
    :class:`InvalidArgumentError` names the field."""
    _core.check_request(dict(request))
