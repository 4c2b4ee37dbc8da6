"""Chat templates, rendered the way transformers renders them: a sandboxed jinja2
environment with ``trim_blocks``/``lstrip_blocks``, ``raise_exception``, ``tojson`` and
``strftime_now``, and the tokenizer's special tokens in scope.

A template is a file of the model, so it is hostile input: rendering is bounded in time
(:data:`MAX_RENDER_SECONDS`), in steps (:data:`MAX_RENDER_STEPS`, which bounds loop
iterations) and in the size of every value it builds and of its output (``max_output``
characters, derived from the model's context by the caller). String repetition, ``%`` and
``format`` widths, ``center``/``indent``/``ljust``-style widths, ``replace``/``join``
growth and integer powers are checked *before* they run, so no single operation can
allocate past the bound."""

from __future__ import annotations

import json
import re
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from types import FrameType
from typing import Any

from colibri.errors import ColibriError, ConfigError, InvalidArgumentError

#: Wall-clock limit of one render.
MAX_RENDER_SECONDS = 5.0
#: Trace events (template lines and Python calls) one render may take; a loop iteration is a
#: few of them, so this bounds nested loops long before they could run for minutes.
MAX_RENDER_STEPS = 2_000_000
#: Largest value a template may build when the caller sets no output bound (characters or
#: items); also the floor of the bound a caller sets.
MIN_VALUE_LIMIT = 1 << 20
#: Integer results are capped at this many bits (``10**10**10`` would compute for ever).
MAX_INT_BITS = 1 << 16


class _RenderLimit(Exception):
    """A template went past a rendering limit (turned into a ConfigError)."""


def _raise(message: str) -> None:
    raise InvalidArgumentError(f"chat template: {message}")


def _tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, **kw: Any) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, **kw)


def _size(x: object) -> int:
    """Characters, items or (for ints) decimal digits of a value; 0 for anything else."""
    if isinstance(x, (str, bytes, list, tuple, dict, set, frozenset)):
        return len(x)
    if isinstance(x, int):
        return x.bit_length() // 3
    return 0


_NUMBER = re.compile(r"\d{6,}")


class _Limits:
    """The bounds of one render."""

    def __init__(self, max_value: int) -> None:
        self.max_value = max(max_value, MIN_VALUE_LIMIT)

    def value(self, what: str, n: int) -> None:
        if n > self.max_value:
            raise _RenderLimit(
                f"{what} would hold {n} characters or items, over the limit of {self.max_value}"
            )

    def ints(self, what: str, args: Sequence[object], kwargs: Mapping[str, object]) -> None:
        """Integer arguments (widths, counts) and numbers in format strings are bounded."""
        for a in (*args, *kwargs.values()):
            if isinstance(a, int) and not isinstance(a, bool) and abs(a) > self.max_value:
                raise _RenderLimit(f"{what} was given {a}, over the limit of {self.max_value}")
            if isinstance(a, str):
                self.format_string(what, a)

    def format_string(self, what: str, s: str) -> None:
        for m in _NUMBER.finditer(s):
            if int(m.group()) > self.max_value:
                raise _RenderLimit(
                    f"{what}: a width of {m.group()} in a format string, over the limit of "
                    f"{self.max_value}"
                )

    def growth(self, what: str, fn: object, args: Sequence[object], recv: object) -> None:
        """Pre-check the operations whose output can be much larger than their inputs."""
        name = getattr(fn, "__name__", "")
        if name == "replace" and isinstance(recv, str) and len(args) >= 2:
            old, new = args[0], args[1]
            if isinstance(old, str) and isinstance(new, str):
                n = (len(recv) + 1) if old == "" else recv.count(old)
                self.value(what, len(recv) + n * max(0, len(new) - len(old)))
        if name == "join" and isinstance(recv, str) and args:
            items = args[0]
            if isinstance(items, (list, tuple)):
                total = sum(_size(i) for i in items) + len(recv) * len(items)
                self.value(what, total)
        if name in ("format", "format_map") and isinstance(recv, str):
            self.format_string(what, recv)


@lru_cache(maxsize=8)
def _compile(source: str) -> Any:
    from jinja2.exceptions import TemplateError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class LimitedEnvironment(ImmutableSandboxedEnvironment):
        """The sandbox with every size-multiplying operation checked first."""

        intercepted_binops = frozenset({"*", "%", "**", "+"})
        limits = _Limits(MIN_VALUE_LIMIT)

        def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
            lim = self.limits
            if operator == "*":
                for a, b in ((left, right), (right, left)):
                    if isinstance(b, int) and _size(a) and not isinstance(a, int):
                        lim.value(f"'{operator}'", _size(a) * max(b, 0))
            elif operator == "**" and isinstance(left, int) and isinstance(right, int):
                if right > 0 and max(left.bit_length(), 1) * right > MAX_INT_BITS:
                    raise _RenderLimit(f"{left} ** {right} is over {MAX_INT_BITS} bits")
            elif operator == "%" and isinstance(left, str):
                lim.format_string("'%'", left)
                vals = right if isinstance(right, tuple) else (right,)
                if "*" in left:
                    lim.ints("'%' with a '*' width", vals, {})
            out = super().call_binop(context, operator, left, right)
            lim.value(f"the result of '{operator}'", _size(out))
            return out

        def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:
            lim = __self.limits
            what = f"{getattr(__obj, '__name__', type(__obj).__name__)}()"
            lim.ints(what, args, kwargs)
            # The sandbox hands str.format out as a wrapper around the bound method.
            recv = getattr(getattr(__obj, "__wrapped__", __obj), "__self__", None)
            lim.growth(what, __obj, args, recv)
            out = super().call(__context, __obj, *args, **kwargs)
            lim.value(f"the result of {what}", _size(out))
            return out

    env = LimitedEnvironment(trim_blocks=True, lstrip_blocks=True)
    env.filters["tojson"] = _tojson
    for name, f in list(env.filters.items()):
        env.filters[name] = _limited_filter(name, f, env)
    env.globals["raise_exception"] = _raise
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(source)
    except TemplateError as e:
        raise ConfigError(f"the chat template does not compile: {e}") from e


def _limited_filter(name: str, f: Callable[..., Any], env: Any) -> Callable[..., Any]:
    """``f`` with its integer arguments, format strings and growth checked first and its
    result's size after; jinja's pass-context/environment markers are kept."""
    import functools

    @functools.wraps(f)
    def limited(*args: Any, **kwargs: Any) -> Any:
        lim: _Limits = env.limits
        what = f"the '{name}' filter"
        plain = [a for a in args if isinstance(a, (str, int, float, list, tuple, dict))]
        lim.ints(what, plain[1:], kwargs)
        if name == "format" and plain and isinstance(plain[0], str):
            lim.format_string(what, plain[0])
        if name == "replace" and len(plain) >= 3:
            lim.growth(what, str.replace, plain[1:3], plain[0])
        out = f(*args, **kwargs)
        lim.value(f"the result of {what}", _size(out))
        return out

    return limited


class _Budget:
    """A trace function that stops a render past its step or time limit."""

    def __init__(self) -> None:
        self.steps = 0
        self.deadline = time.monotonic() + MAX_RENDER_SECONDS

    def tick(self) -> None:
        self.steps += 1
        if self.steps > MAX_RENDER_STEPS:
            raise _RenderLimit(f"rendering took more than {MAX_RENDER_STEPS} steps")
        if self.steps % 1024 == 0 and time.monotonic() > self.deadline:
            raise _RenderLimit(f"rendering took more than {MAX_RENDER_SECONDS} s")

    def trace(self, frame: FrameType, event: str, arg: object) -> Any:
        self.tick()
        return self.local if frame.f_code.co_filename == "<template>" else None

    def local(self, frame: FrameType, event: str, arg: object) -> Any:
        self.tick()
        return self.local


def _render_bounded(template: Any, max_output: int, context: dict[str, Any]) -> str:
    """Render with the limits in force; the output is collected piece by piece and refused
    as soon as it passes ``max_output`` characters."""
    template.environment.limits = _Limits(2 * max_output)
    budget = _Budget()
    previous = sys.gettrace()
    pieces: list[str] = []
    total = 0
    sys.settrace(budget.trace)
    try:
        for piece in template.generate(**context):
            total += len(piece)
            if total > max_output:
                raise InvalidArgumentError(
                    f"invalid value for 'messages': the rendered chat prompt passes "
                    f"{max_output} characters, more than this model's max_context can hold"
                )
            pieces.append(piece)
    except _RenderLimit as e:
        raise ConfigError(f"the chat template went past a rendering limit: {e}") from None
    finally:
        sys.settrace(previous)
    return "".join(pieces)


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
    max_output: int = 64 << 20,
    template: str | None = None,
    variables: Mapping[str, Any] | None = None,
) -> str:
    """Render ``messages`` into the prompt text the model was trained on, at most
    ``max_output`` characters (longer is an :class:`InvalidArgumentError`), with
    ``template`` instead of the model's own when given, and ``variables`` (e.g.
    ``enable_thinking``) defined for the template."""
    check_messages(messages, max_output)
    from jinja2.exceptions import TemplateError

    source = template if template is not None else template_source(tokenizer_config, model_dir)
    template = _compile(source)
    special = {
        k: _token_text(v)
        for k, v in tokenizer_config.items()
        if k.endswith("_token") and isinstance(v, (str, dict))
    }
    reserved = {"messages", "add_generation_prompt"} & set(variables or {})
    if reserved:
        raise InvalidArgumentError(
            f"invalid keyword {sorted(reserved)[0]!r}: the conversation sets it; give it as "
            "its own argument"
        )
    context = {
        **special,
        **(variables or {}),
        "messages": [_flat_message(i, m) for i, m in enumerate(messages)],
        "add_generation_prompt": add_generation_prompt,
    }
    try:
        return _render_bounded(template, max_output, context)
    except TemplateError as e:
        raise ConfigError(f"the chat template failed to render: {e}") from e
    except ColibriError:  # raise_exception() in the template, or a limit
        raise
    except RecursionError as e:
        raise ConfigError(f"the chat template failed to render: {e}") from None
    except Exception as e:  # the template did something the messages do not support
        raise InvalidArgumentError(
            f"invalid value for 'messages': the chat template cannot render them "
            f"({type(e).__name__}: {e}); give each message a 'role' and a string 'content'"
        ) from e


def check_messages(messages: object, max_chars: int | None = None) -> None:
    """Check that ``messages`` is a conversation: a non-empty list of ``{"role": str,
    "content": str}`` mappings (an assistant turn may carry ``tool_calls`` instead of
    ``content``, and a content may be a list of parts, as transformers allows), whose
    string contents total at most ``max_chars`` characters."""
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
    total = 0
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
            total += len(content)
            if max_chars is not None and total > max_chars:
                raise InvalidArgumentError(
                    f"invalid value for 'messages': the contents pass {max_chars} characters "
                    f"at messages[{i}], more than this model's max_context can hold"
                )
            check_text(f"messages[{i}]['content']", content)
        elif isinstance(content, list):
            total += len(text_of_parts(f"messages[{i}]['content']", content))
            if max_chars is not None and total > max_chars:
                raise InvalidArgumentError(
                    f"invalid value for 'messages': the contents pass {max_chars} characters "
                    f"at messages[{i}], more than this model's max_context can hold"
                )
        else:
            raise InvalidArgumentError(
                f"invalid value for 'messages[{i}]['content']': {type(content).__name__}; "
                "expected a string or a list of text parts"
            )


def text_of_parts(name: str, parts: Sequence[object]) -> str:
    """The text of an OpenAI-style content list (``[{"type": "text", "text": ...}, ...]``),
    its parts joined; any other kind of part is an :class:`InvalidArgumentError` (these
    models read text only)."""
    texts: list[str] = []
    for j, part in enumerate(parts):
        where = f"{name}[{j}]"
        if not isinstance(part, Mapping):
            raise InvalidArgumentError(
                f"invalid value for '{where}': {type(part).__name__}; expected a content part "
                "such as {'type': 'text', 'text': ...}"
            )
        if part.get("type") != "text":
            raise InvalidArgumentError(
                f"invalid value for '{where}': {part.get('type')!r} parts are not supported; "
                "this model reads text only"
            )
        text = part.get("text")
        if not isinstance(text, str):
            raise InvalidArgumentError(f"invalid value for '{where}['text']': expected a string")
        check_text(f"{where}['text']", text)
        texts.append(text)
    return "".join(texts)


def _flat_message(i: int, m: Mapping[str, Any]) -> dict[str, Any]:
    """Message ``i`` as the chat templates of these models read it: a list content (OpenAI's
    text parts) joined into its string, as the server and vLLM give the template."""
    out = dict(m)
    if isinstance(out.get("content"), list):
        out["content"] = text_of_parts(f"messages[{i}]['content']", out["content"])
    return out


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
