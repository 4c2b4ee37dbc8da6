# DeepSeek's tool-call tokens are spelled with fullwidth bars (｜) and ▁: not typos.
# ruff: noqa: RUF001, RUF002, RUF003
"""Tool calls in the formats of the models colibri runs, as OpenAI's API carries them.

- **GLM** (4.5 and later; the template writes ``<arg_key>``)::

      <tool_call>get_weather
      <arg_key>city</arg_key>
      <arg_value>Paris</arg_value>
      </tool_call>

  Argument values are text; a parameter whose schema is not a string is read as JSON.
- **DeepSeek** (V3.1; the template writes ``<｜tool▁calls▁begin｜>``)::

      <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Paris"}
      <｜tool▁call▁end｜><｜tool▁calls▁end｜>      (one line)

  and V3-0324's ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME`` followed by a fenced JSON
  block.

This module finds the format from the chat template, extracts calls from generated text
(:func:`extract`), holds them back from a stream (:class:`CallFilter`), and writes the
grammar that forces a call when ``tool_choice`` requires one (:func:`forced_grammar`: the
arguments are JSON matching the tool's schema, through llguidance's ``%json``).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

Format = Literal["glm", "deepseek"]

GLM_OPEN, GLM_CLOSE = "<tool_call>", "</tool_call>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_BEGIN, DS_SEP, DS_END = "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>", "<｜tool▁call▁end｜>"

#: Where a call starts in the generated text, per format (the stream holds text back from
#: the first of these on).
_STARTS: dict[Format, tuple[str, ...]] = {
    "glm": (GLM_OPEN,),
    "deepseek": (DS_CALLS_BEGIN, DS_BEGIN),
}


def detect(template: str) -> Format | None:
    """The tool-call format a chat template writes, or None for one colibri does not know."""
    if "<arg_key>" in template and GLM_OPEN in template:
        return "glm"
    if DS_BEGIN in template or DS_CALLS_BEGIN in template:
        return "deepseek"
    return None


@dataclass(frozen=True)
class Tool:
    """One function a request offers the model."""

    name: str
    description: str
    parameters: dict[str, Any]

    def openai(self) -> dict[str, Any]:
        """The tool as OpenAI's request writes it (what templates iterate)."""
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": self.parameters,
            },
        }


@dataclass(frozen=True)
class Call:
    """A call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = ""

    def openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out = {"index": index, **out}
        return out


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _schema_type(tools: Sequence[Tool], name: str, key: str) -> object:
    for t in tools:
        if t.name == name:
            props = t.parameters.get("properties")
            if isinstance(props, Mapping) and isinstance(props.get(key), Mapping):
                enum = props[key].get("enum")
                if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
                    return "enum-of-strings"
                return props[key].get("type")
    return None


def _glm_value(raw: str, kind: object) -> object:
    if kind in ("string", "enum-of-strings"):
        return raw
    try:
        return json.loads(raw)
    except ValueError:
        return raw


_GLM_CALL = re.compile(re.escape(GLM_OPEN) + r"(.*?)" + re.escape(GLM_CLOSE), re.S)
_GLM_PAIR = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.S)
_DS_CALL = re.compile(
    re.escape(DS_BEGIN) + r"(.*?)" + re.escape(DS_SEP) + r"(.*?)" + re.escape(DS_END), re.S
)
_FENCED = re.compile(r"^\s*(\S+)\s*```(?:json)?\s*(.*?)\s*```\s*$", re.S)


def extract(text: str, fmt: Format, tools: Sequence[Tool]) -> tuple[str, list[Call]]:
    """The answer's text before its calls, and the calls (complete ones only: a call cut
    off by ``max_tokens`` stays text)."""
    start = _first_start(text, fmt)
    if start is None:
        return text, []
    head, tail = text[:start], text[start:]
    calls: list[Call] = []
    if fmt == "glm":
        for m in _GLM_CALL.finditer(tail):
            body = m.group(1)
            name = body.split("<arg_key>", 1)[0].strip()
            args = {
                k.strip(): _glm_value(v, _schema_type(tools, name, k.strip()))
                for k, v in _GLM_PAIR.findall(body)
            }
            calls.append(Call(name, json.dumps(args, ensure_ascii=False), new_call_id()))
    else:
        for m in _DS_CALL.finditer(tail):
            name, args = m.group(1).strip(), m.group(2)
            fenced = _FENCED.match(args) if name == "function" else None
            if fenced:  # V3-0324: function<sep>NAME ```json {...} ```
                name, args = fenced.group(1), fenced.group(2)
            calls.append(Call(name, args.strip(), new_call_id()))
    if not calls:
        return text, []
    return head.rstrip(), calls


def _first_start(text: str, fmt: Format) -> int | None:
    found = [i for i in (text.find(s) for s in _STARTS[fmt]) if i >= 0]
    return min(found) if found else None


class CallFilter:
    """A streamed answer's text with its tool calls held back: :meth:`push` returns the
    text that is surely not part of a call (what could still begin one waits)."""

    def __init__(self, fmt: Format) -> None:
        self.fmt = fmt
        self._buf = ""
        self._shown = 0
        self.calling = False

    def push(self, text: str) -> str:
        self._buf += text
        if self.calling:
            return ""
        start = _first_start(self._buf, self.fmt)
        if start is not None:
            self.calling = True
            out = self._buf[self._shown : start].rstrip() if start > self._shown else ""
            self._shown = len(self._buf)
            return out
        hold = max(_held(self._buf, s) for s in _STARTS[self.fmt])
        upto = len(self._buf) - hold
        out = self._buf[self._shown : upto]
        self._shown = max(self._shown, upto)
        return out

    def flush(self) -> str:
        """What was held back when no call followed."""
        if self.calling:
            return ""
        out = self._buf[self._shown :]
        self._shown = len(self._buf)
        return out


def _held(text: str, tag: str) -> int:
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


def _lark_string(s: str) -> str:
    return json.dumps(s, ensure_ascii=False)


def _json_rule(schema: Mapping[str, Any]) -> str:
    compact = {"x-guidance": {"whitespace_flexible": False}, **schema}
    return "%json " + json.dumps(compact, ensure_ascii=False)


def forced_grammar(fmt: Format, tools: Sequence[Tool]) -> str:
    """A Lark grammar whose every text is one call of one of ``tools`` in ``fmt``, its
    arguments JSON matching the tool's parameter schema (GLM: each value matching its
    property's schema, text for strings)."""
    rules: list[str] = []
    alts = []
    for i, t in enumerate(tools):
        alts.append(f"call_{i}")
        if fmt == "deepseek":
            rules.append(f"call_{i}: {_lark_string(t.name + DS_SEP)} args_{i}")
            rules.append(f"args_{i}: {_json_rule(t.parameters or {'type': 'object'})}")
            continue
        props = t.parameters.get("properties") if isinstance(t.parameters, Mapping) else None
        required = t.parameters.get("required") if isinstance(t.parameters, Mapping) else None
        required = set(required) if isinstance(required, list) else set()
        name = _lark_string(t.name + "\n")
        if not isinstance(props, Mapping):  # no schema of its arguments: any pairs
            free = '"<arg_key>" /[^<]+/ "</arg_key>\\n<arg_value>" /[^<]*/ "</arg_value>\\n"'
            rules.append(f"call_{i}: {name} ({free})*")
            continue
        # Each parameter at most once, in the schema's order (as GLM writes them); the
        # required ones always.
        seq = []
        for j, (key, schema) in enumerate(props.items()):
            enum = schema.get("enum") if isinstance(schema, Mapping) else None
            if isinstance(enum, list) and enum and all(isinstance(e, str) for e in enum):
                value = "(" + " | ".join(_lark_string(e) for e in enum) + ")"  # as text
            elif not isinstance(schema, Mapping) or schema.get("type") == "string":
                value = "/[^<]*/"
            else:
                value = f"value_{i}_{j}"
                rules.append(f"value_{i}_{j}: {_json_rule(schema)}")
            key_text = "<arg_key>" + str(key) + "</arg_key>\n<arg_value>"
            rules.append(
                f"pair_{i}_{j}: {_lark_string(key_text)} {value} "
                f"{_lark_string('</arg_value>' + chr(10))}"
            )
            seq.append(f"pair_{i}_{j}" + ("" if key in required else "?"))
        rules.append(f"call_{i}: {name} {' '.join(seq)}".rstrip())
    if fmt == "deepseek":
        head = f"start: {_lark_string(DS_CALLS_BEGIN + DS_BEGIN)} ({' | '.join(alts)}) "
        head += _lark_string(DS_END + DS_CALLS_END)
    else:
        head = f"start: {_lark_string(GLM_OPEN)} ({' | '.join(alts)}) {_lark_string(GLM_CLOSE)}"
    return "\n".join([head, *rules])


def offer(
    messages: list[dict[str, Any]],
    variables: dict[str, Any],
    tools: Sequence[Tool],
    fmt: Format,
    template_renders_tools: bool,
) -> list[dict[str, Any]]:
    """Show ``tools`` to the model: as the template's ``tools`` variable (set in
    ``variables``), or, for a template that does not describe them itself (DeepSeek-V3.1's
    leaves it to the caller), as a system message first; returns the messages to render."""
    if template_renders_tools:
        variables["tools"] = [t.openai() for t in tools]
        return messages
    return [{"role": "system", "content": tools_system_prompt(tools, fmt)}, *messages]


def tools_system_prompt(tools: Sequence[Tool], fmt: Format) -> str:
    """A system message describing ``tools`` and the call format, for templates that do not
    render the tools themselves (DeepSeek-V3.1's leaves it to the caller)."""
    lines = ["## Tools", "You have access to the following tools:", ""]
    for t in tools:
        lines += [f"### {t.name}", f"Description: {t.description}", "",
                  f"Parameters: {json.dumps(t.parameters, ensure_ascii=False)}", ""]  # fmt: skip
    if fmt == "deepseek":
        lines.append(
            "To call tools, write exactly: " + DS_CALLS_BEGIN + DS_BEGIN + "tool_name" + DS_SEP
            + "{json arguments}" + DS_END + DS_CALLS_END
        )  # fmt: skip
    else:
        lines.append(
            "To call a tool, write: <tool_call>tool_name\n<arg_key>name</arg_key>\n"
            "<arg_value>value</arg_value>\n</tool_call>"
        )
    return "\n".join(lines)


# ----------------------------------------------------------------------------- requests

Choice = Literal["none", "auto", "required"]
_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")


def parse_request(body: Mapping[str, Any], invalid: Any) -> tuple[list[Tool], Choice, str | None]:
    """``tools``, ``tool_choice`` of a chat request: the tools, the choice, and the one tool
    a named choice forces (``invalid(param, message)`` makes the 400)."""
    raw = body.get("tools")
    tools: list[Tool] = []
    if raw is not None:
        if not isinstance(raw, list):
            raise invalid("tools", f"{raw!r}; expected a list of tools")
        for i, t in enumerate(raw):
            where = f"tools[{i}]"
            if not isinstance(t, Mapping) or t.get("type") != "function":
                raise invalid(where, "expected {'type': 'function', 'function': {...}}")
            f = t.get("function")
            if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
                raise invalid(f"{where}.function", "expected an object with a 'name'")
            if not _NAME.fullmatch(f["name"]):
                raise invalid(f"{where}.function.name", f"{f['name']!r}; letters, digits, _ . : -")
            if any(x.name == f["name"] for x in tools):
                raise invalid(f"{where}.function.name", f"{f['name']!r} is given twice")
            params = f.get("parameters", {"type": "object", "properties": {}})
            if not isinstance(params, Mapping):
                raise invalid(f"{where}.function.parameters", "expected a JSON schema object")
            desc = f.get("description", "")
            if not isinstance(desc, str):
                raise invalid(f"{where}.function.description", "expected a string")
            tools.append(Tool(f["name"], desc, dict(params)))
    choice = body.get("tool_choice")
    if choice is None:
        return tools, ("auto" if tools else "none"), None
    if choice in ("none", "auto", "required"):
        if choice != "none" and not tools:
            raise invalid("tool_choice", f"{choice!r} needs 'tools'")
        return tools, choice, None
    if isinstance(choice, Mapping) and choice.get("type") == "function":
        name = (choice.get("function") or {}).get("name")
        if not any(t.name == name for t in tools):
            raise invalid("tool_choice", f"{name!r} is not one of the request's tools")
        return tools, "required", str(name)
    raise invalid(
        "tool_choice",
        f"{choice!r}; expected 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
    )


def message_calls(
    where: str, value: object, fmt: Format | None, invalid: Any
) -> list[dict[str, Any]]:
    """An assistant message's ``tool_calls`` as the template reads them: OpenAI's shape,
    the arguments parsed into an object for GLM's template (which iterates them)."""
    if not isinstance(value, list):
        raise invalid(where, "expected a list of tool calls")
    out = []
    for i, c in enumerate(value):
        w = f"{where}[{i}]"
        f = c.get("function") if isinstance(c, Mapping) else None
        if not isinstance(f, Mapping) or not isinstance(f.get("name"), str):
            raise invalid(w, "expected {'type': 'function', 'function': {'name', 'arguments'}}")
        args = f.get("arguments", "{}")
        if not isinstance(args, str):
            raise invalid(f"{w}.function.arguments", "expected the arguments' JSON text")
        if fmt == "glm":
            try:
                parsed = json.loads(args)
            except ValueError:
                raise invalid(f"{w}.function.arguments", "is not valid JSON") from None
            if not isinstance(parsed, dict):
                raise invalid(f"{w}.function.arguments", "expected a JSON object")
            args_value: object = parsed
        else:
            args_value = args
        out.append(
            {
                "id": c.get("id") or new_call_id(),
                "type": "function",
                "function": {"name": f["name"], "arguments": args_value},
            }
        )
    return out
