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
    if not messages:
        raise InvalidArgumentError("invalid value for 'messages': the conversation is empty")
    for i, m in enumerate(messages):
        if not isinstance(m, Mapping) or "role" not in m:
            raise InvalidArgumentError(
                f"invalid value for 'messages[{i}]': expected a mapping with 'role' and 'content'"
            )
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
