"""The server's OpenAPI 3.1 description (``GET /openapi.json``): its paths, the request
bodies with their fields' types and ranges, and the error body. The field lists come from
the parser's own (``colibri._openai``, ``colibri._client_fields``), so a field the server
accepts is one the document names; ``tests/test_serve_fuzz.py`` fuzzes the server from it."""

from __future__ import annotations

from typing import Any

from colibri import _client_fields, _openai
from colibri.model import Model

_INT = {"type": "integer"}
_BOOL = {"type": "boolean"}
_STRINGS = {"oneOf": [{"type": "string"}, {"type": "array", "items": {"type": "string"}}]}

_ERROR = {
    "type": "object",
    "required": ["error"],
    "properties": {
        "error": {
            "type": "object",
            "required": ["message", "type", "param", "code"],
            "properties": {
                "message": {"type": "string"},
                "type": {"type": "string"},
                "param": {"type": ["string", "null"]},
                "code": {"type": ["string", "null"]},
            },
        }
    },
}


#: The types of llama.cpp's and vLLM's fields (colibri._client_fields says what each does).
_CLIENT_TYPES: dict[str, Any] = {
    "cache_prompt": _BOOL,
    "n_predict": {"type": "integer", "minimum": -1},
    "n_probs": {"type": "integer", "minimum": 0, "maximum": 20},
    "repeat_penalty": {"type": "number", "exclusiveMinimum": 0},
    "grammar": {"type": "string"},
    "typical_p": {"type": "number"},
    "mirostat": {"type": "number"},  # 0 is off; any other value is ignored
    "mirostat_tau": {"type": "number"},
    "mirostat_eta": {"type": "number"},
    "tfs_z": {"type": "number"},
    "repeat_last_n": _INT,
    "penalize_nl": _BOOL,
    "n_keep": _INT,
    "id_slot": _INT,
    "min_keep": _INT,
    "include_stop_str_in_output": _BOOL,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "add_generation_prompt": _BOOL,
    "continue_final_message": _BOOL,
    "chat_template_kwargs": {"type": "object"},
    "guided_choice": {"type": "array", "items": {"type": "string"}},
    "best_of": _INT,
    "use_beam_search": _BOOL,
    "length_penalty": {"type": "number"},
    "truncate_prompt_tokens": {"type": "integer", "minimum": 1},
}  # priority and request_id: any value (ignored)


def _object(props: dict[str, Any], required: list[str], **more: Any) -> dict[str, Any]:
    """An object of ``props`` (no others); a field that is not required may also be null,
    which the server reads as absent (as OpenAI's API does)."""
    nullable = {
        name: schema if name in required or not schema else {"anyOf": [schema, {"type": "null"}]}
        for name, schema in props.items()
    }
    out = {"type": "object", "properties": nullable, "additionalProperties": False, **more}
    if required:
        out["required"] = required
    return out


def _num(lo: float | None = None, hi: float | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "number"}
    if lo is not None:
        out["minimum"] = lo
    if hi is not None:
        out["maximum"] = hi
    return out


def _sampling_fields(vocab: int) -> dict[str, Any]:
    """The fields both endpoints read with a known type (the others are in the documents
    as any value, checked by the server)."""
    return {
        "model": {"type": "string"},
        "max_tokens": {"type": "integer", "minimum": 1},
        "temperature": _num(0, 2),
        "top_p": _num(0, 1),
        "top_k": {"type": "integer", "minimum": -1},
        "min_p": _num(0, 1),
        "seed": _INT,
        "stop": _STRINGS,
        "stream": _BOOL,
        "stream_options": {"type": "object", "properties": {"include_usage": _BOOL}},
        "n": {"type": "integer", "minimum": 1, "maximum": _openai.MAX_CHOICES},
        "frequency_penalty": _num(-2, 2),
        "presence_penalty": _num(-2, 2),
        "repetition_penalty": {"type": "number", "exclusiveMinimum": 0},
        "min_tokens": {"type": "integer", "minimum": 0},
        "ignore_eos": _BOOL,
        "stop_token_ids": {
            "type": "array",
            "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
        },
        "logit_bias": {"type": "object", "additionalProperties": _num(-100, 100)},
        "user": {"type": "string"},
        "safety_identifier": {"type": "string"},
        "draft": {"enum": ["auto", "mtp", "ngram", "off"]},
        "draft_depth": {
            "oneOf": [{"type": "integer", "minimum": 1, "maximum": 8}, {"const": "auto"}]
        },
        "guided_regex": {"type": "string"},
        "guided_grammar": {"type": "string"},
        "guided_json": {"type": "object"},
    }


def _body(kind: _openai.Kind, model: Model) -> dict[str, Any]:
    """The request body of ``kind``: every field the parser accepts, typed where the
    document says more than "any value"; other names are a 400 ``unknown_parameter``."""
    vocab = int(model.config["vocab_size"])
    token = {"type": "integer", "minimum": 0, "maximum": vocab - 1}
    own = _openai._CHAT_ONLY if kind == "chat" else _openai._COMPLETION_ONLY
    names = set(_openai._COMMON) | own
    names |= {f.name for f in _client_fields.FIELDS if f.kind in (None, kind)}
    props: dict[str, Any] = {name: _CLIENT_TYPES.get(name, {}) for name in sorted(names)}
    props.update(_sampling_fields(vocab))
    if kind == "chat":
        part = {
            "type": "object",
            "required": ["type", "text"],
            "properties": {"type": {"const": "text"}, "text": {"type": "string"}},
            "additionalProperties": False,
        }
        message = {
            "type": "object",
            "required": ["role", "content"],
            "properties": {
                "role": {"enum": ["system", "developer", "user", "assistant", "tool"]},
                "content": {"oneOf": [{"type": "string"}, {"type": "array", "items": part}]},
                "name": {"type": "string"},
                "tool_calls": {"type": "array", "items": {"type": "object"}},
                "tool_call_id": {"type": "string"},
            },
            "additionalProperties": False,
        }
        props.update(
            messages={"type": "array", "items": message, "minItems": 1},
            max_completion_tokens={"type": "integer", "minimum": 1},
            logprobs=_BOOL,
            top_logprobs={"type": "integer", "minimum": 0, "maximum": 20},
            response_format={"type": "object", "required": ["type"]},
            tools={"type": "array", "items": {"type": "object"}},
            parallel_tool_calls=_BOOL,
            include_reasoning=_BOOL,
        )
        required = ["messages"]
    else:
        ids = {"type": "array", "items": token, "minItems": 1, "maxItems": model.max_context}
        text = {"type": "string", "minLength": 1, "maxLength": model._max_prompt_chars}
        props.update(
            prompt={
                "oneOf": [
                    text,
                    ids,
                    {"type": "array", "items": text, "minItems": 1, "maxItems": 64},
                    {"type": "array", "items": ids, "minItems": 1, "maxItems": 64},
                ]
            },
            logprobs={"type": "integer", "minimum": 0, "maximum": 20},
            echo=_BOOL,
        )
        required = ["prompt"]
    return _object(props, required)


def _operation(summary: str, body: dict[str, Any] | None = None) -> dict[str, Any]:
    op: dict[str, Any] = {
        "summary": summary,
        "responses": {
            "200": {"description": "the answer"},
            "4XX": {
                "description": "the client's mistake",
                "content": {"application/json": {"schema": _ERROR}},
            },
        },
    }
    if body is not None:
        op["requestBody"] = {
            "required": True,
            "content": {"application/json": {"schema": body}},
        }
    return op


def openapi_schema(model: Model, served_name: str) -> dict[str, Any]:
    """The OpenAPI document of a server of ``model`` under the id ``served_name``."""
    text = {"type": "string", "maxLength": model._max_prompt_chars}
    tokenize = _object(
        {
            "content": text,
            "prompt": text,
            "add_special": _BOOL,
            "add_special_tokens": _BOOL,
            "with_pieces": _BOOL,
            "model": {"type": "string"},
        },
        [],
        # The text in one of two names (llama-server's and vLLM's), not both.
        oneOf=[
            {"required": [name], "properties": {name: {"type": "string"}}}
            for name in ("content", "prompt")
        ],
    )
    vocab = int(model.config["vocab_size"])
    detokenize = _object(
        {
            "tokens": {
                "type": "array",
                "items": {"type": "integer", "minimum": 0, "maximum": vocab - 1},
            },
            "model": {"type": "string"},
        },
        ["tokens"],
    )
    name_param = {"name": "name", "in": "path", "required": True, "schema": {"type": "string"}}
    card = _operation("one model's card (404 for another id)")
    card["parameters"] = [name_param]
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "colibri serve",
            "version": "1",
            "description": f"An OpenAI-compatible server of the model '{served_name}' "
            "(docs/server.md).",
        },
        "paths": {
            "/health": {"get": _operation("liveness, the queue")},
            "/metrics": {"get": _operation("Prometheus metrics")},
            "/stats": {"get": _operation("the dashboard's JSON")},
            "/v1/models": {"get": _operation("the served model")},
            "/v1/models/{name}": {"get": card},
            "/v1/completions": {"post": _operation("a completion", _body("completion", model))},
            "/v1/chat/completions": {"post": _operation("a chat completion", _body("chat", model))},
            "/tokenize": {"post": _operation("text to token ids", tokenize)},
            "/detokenize": {"post": _operation("token ids to text", detokenize)},
        },
    }
