"""The prompts of OpenAI requests as token ids: a chat's messages (text parts, tool calls and
results, reasoning of earlier turns) rendered with the model's template, and the prompts of
a completions request."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from colibri import _client_fields, _tools
from colibri._openai_errors import ApiError, invalid, is_int, unknown_field, unsupported
from colibri.errors import ColibriError, InvalidArgumentError
from colibri.model import Model


def _chat_prompt(
    messages: object,
    model: Model,
    extra: _client_fields.Normalised | None = None,
    *,
    tools: Sequence[_tools.Tool] | None = None,
    fmt: _tools.Format | None = None,
    template_renders_tools: bool = True,
) -> list[int]:
    """The token ids of ``messages`` rendered with the model's chat template (with the
    template controls of ``extra``: vLLM's ``add_generation_prompt``,
    ``continue_final_message``, ``chat_template_kwargs``)."""
    if extra is None:
        extra = _client_fields.Normalised({}, [])
    if not isinstance(messages, list) or not messages:
        raise invalid("messages", "expected a non-empty list of messages")
    clean: list[dict[str, Any]] = []
    for i, m in enumerate(messages):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            raise invalid(where, "expected an object with 'role' and 'content'")
        for k in m:
            if k not in (
                "role",
                "content",
                "name",
                "refusal",
                "tool_calls",
                "function_call",
                "reasoning_content",
                "tool_call_id",
            ):
                raise unknown_field(f"{where}.{k}")
        role = m.get("role")
        if role == "function":
            raise unsupported(f"{where}.role", "the deprecated 'function' role: use 'tool'")
        if role not in ("system", "developer", "user", "assistant", "tool"):
            raise invalid(
                f"{where}.role", f"{role!r}; expected system, developer, user, assistant or tool"
            )
        if m.get("function_call"):
            raise unsupported(f"{where}.function_call", "the deprecated form: use 'tool_calls'")
        calls = None
        if m.get("tool_calls"):
            if role != "assistant":
                raise invalid(f"{where}.tool_calls", "only an assistant turn makes tool calls")
            if fmt is None:
                raise unsupported(
                    f"{where}.tool_calls", "this model's chat template has no tool calls"
                )
            calls = _tools.message_calls(f"{where}.tool_calls", m["tool_calls"], fmt, invalid)
        content = m.get("content")
        if content is None and role == "assistant":
            content = None if calls and fmt == "deepseek" else ""
        if isinstance(content, list):
            parts = []
            for j, part in enumerate(content):
                pw = f"{where}.content[{j}]"
                if not isinstance(part, dict):
                    raise invalid(pw, "expected a content part object")
                if part.get("type") != "text":
                    raise unsupported(
                        f"{pw}.type", f"'{part.get('type')}' parts: this model reads text only"
                    )
                if not isinstance(part.get("text"), str):
                    raise invalid(f"{pw}.text", "expected a string")
                parts.append(part["text"])
            content = "".join(parts)
        if not isinstance(content, str) and not (content is None and calls):
            raise invalid(f"{where}.content", "expected a string or a list of text parts")
        msg: dict[str, Any] = {
            "role": "system" if role == "developer" else role,
            "content": content,
        }
        if calls:
            msg["tool_calls"] = calls
        if role == "tool" and m.get("tool_call_id") is not None:
            if not isinstance(m["tool_call_id"], str):
                raise invalid(f"{where}.tool_call_id", "expected a string")
            msg["tool_call_id"] = m["tool_call_id"]
        reasoning = m.get("reasoning_content")
        if reasoning is not None:  # a thinking model's earlier turn: its template decides
            if not isinstance(reasoning, str) or role != "assistant":
                raise invalid(
                    f"{where}.reasoning_content", "expected a string on an assistant turn"
                )
            msg["reasoning_content"] = reasoning
        if m.get("name") is not None:
            if not isinstance(m["name"], str):
                raise invalid(f"{where}.name", "expected a string")
            msg["name"] = m["name"]
        clean.append(msg)
    variables = dict(extra.chat_template_kwargs or {})
    if tools:
        assert fmt is not None
        clean = _tools.offer(clean, variables, tools, fmt, template_renders_tools)
    try:
        text = model.apply_chat_template(
            clean,
            tokenize=False,
            add_generation_prompt=extra.add_generation_prompt,
            **variables,
        )
        if extra.continue_final_message:
            text = _continued(text, clean[-1])
        return model.encode(text, add_special_tokens=False)
    except InvalidArgumentError as e:
        raise invalid("messages", str(e)) from e
    except ColibriError as e:  # a model without a chat template, a template that fails
        raise ApiError(400, str(e), param="messages", code="chat_template") from e


def _continued(text: str, last: Mapping[str, str]) -> str:
    """The rendered conversation cut after the last message's content, so that the model
    continues it rather than closing it (vLLM's ``continue_final_message``)."""
    content = last["content"]
    if last["role"] != "assistant" or not content:
        raise invalid(
            "continue_final_message",
            "the last message must be a non-empty assistant message to continue",
        )
    at = text.rfind(content)
    if at < 0:  # the template rewrote it (stripped, escaped): there is no place to continue
        raise invalid(
            "continue_final_message",
            "the chat template does not keep the last message's text as it is",
        )
    return text[: at + len(content)]


def _completion_prompts(prompt: object, model: Model) -> list[list[int]]:
    """The token ids of each prompt of a completions ``prompt``: a string, token ids, or a
    list of strings or of token-id lists (a batch, answered choice by choice in order)."""
    if isinstance(prompt, list) and prompt and all(isinstance(p, (str, list)) for p in prompt):
        return [_completion_prompt(p, model, f"prompt[{i}]") for i, p in enumerate(prompt)]
    return [_completion_prompt(prompt, model)]


def _completion_prompt(prompt: object, model: Model, where: str = "prompt") -> list[int]:
    """The token ids of one completions prompt: a string or token ids."""
    if isinstance(prompt, str):
        if not prompt:
            raise invalid(where, "the prompt is empty")
        if len(prompt) > model._max_prompt_chars:  # bounded before it is tokenised
            raise ApiError(
                400,
                f"invalid value for '{where}': {len(prompt)} characters, more than this "
                f"model's max_context of {model.max_context} tokens can hold; shorten it",
                param=where,
                code="context_length_exceeded",
            )
        try:
            return model.encode(prompt)
        except InvalidArgumentError as e:
            raise invalid(where, str(e)) from e
    if isinstance(prompt, list) and len(prompt) > model.max_context:  # before each id
        raise ApiError(
            400,
            f"invalid value for '{where}': {len(prompt)} tokens, more than this model's "
            f"max_context of {model.max_context}; shorten it",
            param=where,
            code="context_length_exceeded",
        )
    if isinstance(prompt, list) and prompt and all(is_int(t) for t in prompt):
        vocab = int(model.config["vocab_size"])
        for t in prompt:
            if not 0 <= t < vocab:
                raise invalid(where, f"token id {t} is outside the vocabulary (0..{vocab - 1})")
        return list(prompt)
    raise invalid(
        where, "expected a string, a list of token ids, or a list of strings or of token-id lists"
    )
