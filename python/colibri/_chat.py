"""Chat templates, rendered the way transformers renders them: a sandboxed jinja2
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson`` and
``strftime_now``, and the tokenizer's special tokens in scope."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any

from colibri.errors import ConfigError, InvalidArgumentError


def _raise(message: str) -> None:
    raise InvalidArgumentError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"the chat template does not compile: {e}") from e


def _token_text(v: Any) -> str:
    if isinstance(v, dict):
        return str(v.get("content", ""))
    return "" if v is None else str(v)


def template_source(tokenizer_config: Mapping[str, Any], model_dir: Path) -> str:
    """The chat template of a model: ``chat_template.jinja`` or ``tokenizer_config.json``."""
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text(encoding="utf-8")
    tpl = tokenizer_config.get("chat_template")
    if isinstance(tpl, list):  # named templates: use "default"
        named = {t.get("name"): t.get("template") for t in tpl if isinstance(t, dict)}
        tpl = named.get("default")
    if not isinstance(tpl, str) or not tpl:
        raise ConfigError(
            f"{model_dir} has no chat template (tokenizer_config.json 'chat_template' or "
            "chat_template.jinja); use generate() with a plain prompt instead"
        )
    return tpl


def render_chat(
    tokenizer_config: Mapping[str, Any],
    model_dir: Path,
    messages: Sequence[Mapping[str, Any]],
    add_generation_prompt: bool,
) -> str:
    """Render ``messages`` into the prompt text the model was trained on."""
    check_messages(messages)
    from jinja2.exceptions import TemplateError

    template = _compile(template_source(tokenizer_config, model_dir))
    special = {
        k: _token_text(v)
        for k, v in tokenizer_config.items()
        if k.endswith("_token") and isinstance(v, (str, dict))
    }
    try:
        return str(
            template.render(
                messages=[dict(m) for m in messages],
                add_generation_prompt=add_generation_prompt,
                **special,
            )
        )
    except TemplateError as e:
        raise ConfigError(f"the chat template failed to render: {e}") from e
    except InvalidArgumentError:  # raise_exception() in the template
        raise
    except Exception as e:  # the template did something the messages do not support
        raise InvalidArgumentError(
            f"invalid value for 'messages': the chat template cannot render them "
            f"({type(e).__name__}: {e}); give each message a 'role' and a string 'content'"
        ) from e


def check_messages(messages: object) -> None:
    """Check that ``messages`` is a conversation: a non-empty list of ``{"role": str,
    "content": str}`` mappings (an assistant turn may carry ``tool_calls`` instead of
    ``content``, and a content may be a list of parts, as transformers allows)."""
    expected = "a list of {'role': ..., 'content': ...} dicts"
    if isinstance(messages, (str, bytes, Mapping)) or not isinstance(messages, Sequence):
        hint = (
            "; for a plain prompt use generate(prompt)"
            if isinstance(messages, str)
            else "; wrap a single message in a list"
            if isinstance(messages, Mapping)
            else ""
        )
        raise InvalidArgumentError(
            f"invalid value for 'messages': {type(messages).__name__}; expected {expected}{hint}"
        )
    if not messages:
        raise InvalidArgumentError("invalid value for 'messages': the conversation is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping):
            raise InvalidArgumentError(
                f"invalid value for 'messages[{i}]': {type(m).__name__}; expected a dict with "
                "'role' and 'content'"
            )
        if not isinstance(m.get("role"), str):
            raise InvalidArgumentError(
                f"invalid value for 'messages[{i}]': no 'role' string (e.g. 'user', "
                "'assistant', 'system')"
            )
        if "content" not in m:
            if "tool_calls" in m:
                continue
            raise InvalidArgumentError(
                f"invalid value for 'messages[{i}]': no 'content'; give each message a 'role' "
                "and a 'content' string"
            )
        content = m["content"]
        if content is None and "tool_calls" in m:
            continue
        if isinstance(content, str):
            check_text(f"messages[{i}]['content']", content)
        elif not isinstance(content, list):
            raise InvalidArgumentError(
                f"invalid value for 'messages[{i}]['content']': {type(content).__name__}; "
                "expected a string"
            )


def check_text(name: str, text: str) -> None:
    """Text must encode as UTF-8: a lone surrogate (``"\\udc80"``, e.g. from bytes decoded
    with ``errors="surrogateescape"``) cannot be tokenised."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgumentError(
            f"invalid value for '{name}': the text is not valid Unicode ({e.reason} "
            f"{text[e.start : e.end]!r} at index {e.start}); decode bytes with "
            "errors='replace', or remove the character"
        ) from None
