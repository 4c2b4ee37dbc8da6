"""``/tokenize`` and ``/detokenize`` as llama-server answers them (and vLLM's field names
accepted), so editor plugins can count and cut their prompts with the model's own
tokenizer. Bodies are checked field by field like the completions endpoints (400s naming
the field), and text is bounded before it is tokenised."""

from __future__ import annotations

from typing import Any

from colibri._openai import check_fields, invalid
from colibri.errors import InvalidArgumentError
from colibri.model import Model


def tokenize(body: object, model: Model) -> dict[str, Any]:
    """``{"content": str, "add_special": bool, "with_pieces": bool}`` (llama-server; vLLM's
    ``prompt`` and ``add_special_tokens`` are the same fields) → ``{"tokens": [...],
    "count": n, "max_model_len": max_context}``; with ``with_pieces`` each token is
    ``{"id", "piece"}``, the piece its text (or its bytes as a list when they are not
    valid UTF-8 on their own)."""
    b = check_fields(
        body, {"content", "prompt", "add_special", "add_special_tokens", "with_pieces", "model"}
    )
    _model_name(b)
    text = _one_of(b, "content", "prompt")
    if not isinstance(text, str):
        raise invalid("content", f"{type(text).__name__}; expected a string")
    limit = model._max_prompt_chars
    if len(text) > limit:
        raise invalid(
            "content",
            f"{len(text)} characters; at most {limit} (what this model's max_context can hold)",
        )
    special = _flag(b, "add_special", "add_special_tokens")
    pieces = _flag(b, "with_pieces")
    try:
        ids = model.encode(text, add_special_tokens=special)
    except InvalidArgumentError as e:
        raise invalid("content", str(e)) from e
    tokens: list[Any] = ids
    if pieces:
        tokens = [{"id": t, "piece": _piece(model, t)} for t in ids]
    return {"tokens": tokens, "count": len(ids), "max_model_len": model.max_context}


def detokenize(body: object, model: Model) -> dict[str, Any]:
    """``{"tokens": [ids]}`` → ``{"content": text}`` (special tokens kept, as
    llama-server does: it is the text of exactly these tokens)."""
    b = check_fields(body, {"tokens", "model"})
    _model_name(b)
    ids = b.get("tokens")
    if not isinstance(ids, list):
        raise invalid("tokens", f"{ids!r}; expected a list of token ids")
    vocab = model._vocab_size
    for i, t in enumerate(ids):
        if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t < vocab:
            raise invalid(f"tokens[{i}]", f"{t!r}; expected a token id in 0..{vocab - 1}")
    return {"content": model.decode(ids, skip_special_tokens=False)}


def _model_name(b: dict[str, Any]) -> None:
    if b.get("model") is not None and not isinstance(b["model"], str):
        raise invalid("model", f"{b['model']!r}; expected a string")


def _one_of(b: dict[str, Any], name: str, alias: str) -> object:
    """The value of the field ``name`` or its ``alias`` (null is absent), not both."""
    given = [key for key in (name, alias) if b.get(key) is not None]
    if len(given) == 2:
        raise invalid(name, f"give '{name}' or '{alias}' (the same field), not both")
    if not given:
        raise invalid(name, "missing: the text to tokenise")
    return b[given[0]]


def _flag(b: dict[str, Any], name: str, alias: str | None = None) -> bool:
    """A true/false field (or its alias: each one given is checked; two must agree)."""
    values = []
    for key in (name, alias):
        if key is not None and b.get(key) is not None:
            if not isinstance(b[key], bool):
                raise invalid(key, f"{b[key]!r}; expected true or false")
            values.append(b[key])
    if len(set(values)) > 1:
        raise invalid(name, f"'{name}' and '{alias}' are the same field: give one")
    return bool(values and values[0])


def _piece(model: Model, token: int) -> str | list[int]:
    raw = model.tokenizer.id_to_token(token) or ""
    text = model.decode([token], skip_special_tokens=False)
    if "\ufffd" in text and "\ufffd" not in raw:  # a byte fragment of a character
        return list(text.encode("utf-8", "surrogatepass"))
    return text
