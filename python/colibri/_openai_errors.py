"""The OpenAI wire format's errors: the 400 (and other) bodies every endpoint answers with,
and the checks of a request body's shape and of its fields' values that they come from."""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from colibri.errors import ColibriError, InvalidArgumentError

Kind = Literal["chat", "completion"]


def is_int(v: object) -> bool:
    """An integer, not a bool."""
    return isinstance(v, int) and not isinstance(v, bool)


class ApiError(Exception):
    """An error answered with an OpenAI-shaped body:
    ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        type: str | None = None,
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.type = type or _ERROR_TYPES.get(status, "server_error")
        self.headers = dict(headers or {})

    def body(self) -> dict[str, Any]:
        """The JSON body of the error response."""
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "invalid_request_error",
    403: "invalid_request_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    408: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    429: "rate_limit_error",
    503: "server_error",
}


def unsupported(param: str, why: str) -> ApiError:
    """The 400 for a field (or a value of it) that colibri cannot honour."""
    return ApiError(400, f"'{param}' is not supported: {why}", param=param, code="unsupported")


def invalid(param: str, message: str) -> ApiError:
    """The 400 for a field with a bad value."""
    return ApiError(
        400, f"invalid value for '{param}': {message}", param=param, code="invalid_value"
    )


_PARAM_IN_MESSAGE = re.compile(r"invalid (?:value for|keyword) '([^']+)'")

#: colibri's own parameter names in its error messages, as the request spells them.
_WIRE_NAMES = {
    "max_new_tokens": "max_tokens",
    "stop_token_ids": "stop_token_ids",
    "prompt": "prompt",
    "text": "prompt",
}


def from_colibri_error(e: ColibriError, kind: Kind, body: object = None) -> ApiError:
    """A colibri error met while preparing a request (``body``), as the 400 (or 500) to
    answer; its ``param`` is the field the request spelled."""
    if not isinstance(e, InvalidArgumentError):
        return ApiError(500, f"{type(e).__name__}: {e}", code="internal_error")
    message = str(e)
    m = _PARAM_IN_MESSAGE.search(message)
    param = m.group(1) if m else None
    if param is not None:
        param = _WIRE_NAMES.get(param, param)
        if param == "prompt" and kind == "chat":
            param = "messages"
        if isinstance(body, dict):
            sent = {"guided_json": "response_format", "guided_grammar": "grammar"}
            if param in sent and sent[param] in body:
                param = sent[param]
            elif param == "guided_grammar" and "guided_choice" in body:
                param = "guided_choice"
    code = "context_length_exceeded" if "max_context" in message else "invalid_value"
    return ApiError(400, message, param=param, code=code)


def unknown_field(name: str) -> ApiError:
    """The 400 for a field the endpoint does not define (OpenAI's wording)."""
    return ApiError(
        400,
        f"unrecognized request argument supplied: '{name}'",
        param=name,
        code="unknown_parameter",
    )


def check_fields(body: object, allowed: set[str]) -> dict[str, Any]:
    """``body`` as a JSON object whose fields are all in ``allowed`` (an empty set: any),
    else the 400."""
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    for name in body:
        if allowed and name not in allowed:
            raise unknown_field(name)
    return body


# The checks of one optional field's value: None when the body leaves it out, else the
# value, or the 400 that names the field.


def is_num(v: object) -> bool:
    """A finite number, not a bool."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def opt_int(body: Mapping[str, Any], name: str, lo: int, hi: int | None = None) -> int | None:
    """Field ``name`` as an integer in ``[lo, hi]`` (``hi`` None: no upper bound)."""
    v = body.get(name)
    if v is None:
        return None
    if not is_int(v):
        raise invalid(name, f"{v!r}; expected an integer")
    if v < lo or (hi is not None and v > hi):
        bound = f">= {lo}" if hi is None else f"in [{lo}, {hi}]"
        raise invalid(name, f"{v}; must be {bound}")
    return int(v)


def opt_num(body: Mapping[str, Any], name: str, lo: float, hi: float) -> float | None:
    """Field ``name`` as a number in ``[lo, hi]``."""
    v = body.get(name)
    if v is None:
        return None
    if not is_num(v):
        raise invalid(name, f"{v!r}; expected a number")
    if not lo <= v <= hi:
        raise invalid(name, f"{v}; must be in [{lo:g}, {hi:g}]")
    return float(v)


def opt_bool(body: Mapping[str, Any], name: str) -> bool | None:
    """Field ``name`` as a bool."""
    v = body.get(name)
    if v is None:
        return None
    if not isinstance(v, bool):
        raise invalid(name, f"{v!r}; expected true or false")
    return v


def must_be_off(body: Mapping[str, Any], name: str, off: Sequence[object], why: str) -> None:
    """The 400 (``unsupported``, saying ``why``) unless field ``name`` is absent or one of
    the ``off`` values, of the same type."""
    v = body.get(name)
    if v is None or any(v == o and type(v) is type(o) for o in off):
        return
    raise unsupported(name, why)
