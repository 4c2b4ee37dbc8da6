"""The extra request fields llama.cpp's and vLLM's clients send, and what colibri does with
each: honour it, map it onto its own field, accept and ignore it (the response then says
so in a ``Warning`` header, and ``create_completion`` warns), or refuse it with a 400 when
it changes the answer's meaning and cannot be done. docs/server.md has the table; a test
walks it.

:func:`normalise` runs before the OpenAI fields are checked: it returns the body with the
mapped fields rewritten to the names ``colibri._openai`` checks, and the ignored ones
removed, plus what it ignored and what it honours itself.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, Literal

Treatment = Literal["honoured", "mapped", "ignored", "refused"]
Kind = Literal["completion", "chat"]


@dataclass(frozen=True)
class ClientField:
    """One field of the table: who sends it, what colibri does, and how."""

    name: str
    client: str
    treatment: Treatment
    how: str
    #: ``None``: both endpoints; else the one that has it.
    kind: Kind | None = None


#: Every extra field colibri knows. The order is the documented table's.
FIELDS: tuple[ClientField, ...] = (
    ClientField(
        "cache_prompt",
        "llama.cpp",
        "honoured",
        "always on: a request reuses the KV its session holds for the common prefix; "
        "false changes nothing the client sees",
    ),
    ClientField("n_predict", "llama.cpp", "mapped", "max_tokens (-1: the default)"),
    ClientField(
        "n_probs", "llama.cpp", "mapped", "logprobs (completions) / logprobs + top_logprobs (chat)"
    ),
    ClientField(
        "repeat_penalty",
        "llama.cpp",
        "mapped",
        "repetition_penalty, over the prompt and the output (llama.cpp's looks back "
        "repeat_last_n tokens)",
    ),
    ClientField(
        "grammar", "llama.cpp", "mapped", "GBNF translated to guided_grammar (llguidance's Lark)"
    ),
    ClientField("typical_p", "llama.cpp", "ignored", "1 (off) is silent; other values are ignored"),
    ClientField(
        "mirostat",
        "llama.cpp",
        "ignored",
        "0 (off) is silent; 1 and 2 are ignored (top-k/top-p sampling runs)",
    ),
    ClientField("mirostat_tau", "llama.cpp", "ignored", "only used by mirostat"),
    ClientField("mirostat_eta", "llama.cpp", "ignored", "only used by mirostat"),
    ClientField("tfs_z", "llama.cpp", "ignored", "1 (off) is silent; other values are ignored"),
    ClientField(
        "repeat_last_n",
        "llama.cpp",
        "ignored",
        "repetition_penalty looks at the whole prompt and output",
    ),
    ClientField("penalize_nl", "llama.cpp", "ignored", "newlines are penalised like any token"),
    ClientField("n_keep", "llama.cpp", "ignored", "the context is never shifted"),
    ClientField("id_slot", "llama.cpp", "ignored", "sessions are chosen by common prefix"),
    ClientField("min_keep", "llama.cpp", "ignored", "top-k/top-p keep at least one token"),
    ClientField("top_k", "vLLM", "mapped", "-1 (vLLM's off) is 0, colibri's off"),
    ClientField(
        "include_stop_str_in_output",
        "vLLM",
        "honoured",
        "true keeps the stop string that ended the text (and a stop token's text) at its end",
    ),
    ClientField(
        "skip_special_tokens",
        "vLLM",
        "honoured",
        "true (the default) is what colibri does; false is ignored",
    ),
    ClientField(
        "spaces_between_special_tokens",
        "vLLM",
        "ignored",
        "special tokens are skipped, so there is nothing to space",
    ),
    ClientField(
        "add_generation_prompt",
        "vLLM",
        "honoured",
        "passed to the chat template (default true)",
        "chat",
    ),
    ClientField(
        "continue_final_message",
        "vLLM",
        "honoured",
        "the last (assistant) message is continued, not closed; needs add_generation_prompt false",
        "chat",
    ),
    ClientField(
        "chat_template_kwargs",
        "vLLM",
        "honoured",
        "passed to the chat template as variables (e.g. enable_thinking)",
        "chat",
    ),
    ClientField(
        "guided_choice", "vLLM", "mapped", "guided_grammar whose text is one of the choices"
    ),
    ClientField("best_of", "vLLM", "refused", "1 is silent; more is a 400 (one candidate)"),
    ClientField(
        "echo",
        "vLLM",
        "refused",
        "in chat: false is silent, true a 400 (completions honour it)",
        "chat",
    ),
    ClientField("use_beam_search", "vLLM", "refused", "false is silent; true is a 400"),
    ClientField("length_penalty", "vLLM", "ignored", "only used by beam search"),
    ClientField("truncate_prompt_tokens", "vLLM", "honoured", "the prompt keeps its last k tokens"),
    ClientField("priority", "vLLM", "ignored", "requests are served in arrival order"),
    ClientField("request_id", "vLLM", "ignored", "the response has its own id"),
)

_BY_NAME = {f.name: f for f in FIELDS}


@dataclass
class Normalised:
    """:func:`normalise`'s answer."""

    body: dict[str, Any]
    #: The fields accepted but without effect (for the ``Warning`` header).
    ignored: list[str]
    #: ``truncate_prompt_tokens``: keep the prompt's last this many tokens.
    truncate_prompt_tokens: int | None = None
    #: Chat template controls: ``add_generation_prompt``, ``continue_final_message`` and
    #: ``chat_template_kwargs``.
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


def known(name: str, kind: Kind) -> bool:
    """Whether ``name`` is an extra field this table handles for ``kind``."""
    f = _BY_NAME.get(name)
    return f is not None and f.kind in (None, kind)


def normalise(
    body: Mapping[str, Any],
    kind: Kind,
    invalid: Callable[[str, str], Exception],
    unsupported: Callable[[str, str], Exception],
    gbnf_to_lark: Callable[[str], str],
) -> Normalised:
    """``body`` with the table's fields applied (see the module docstring); ``invalid`` and
    ``unsupported`` make the 400s."""
    fields = _Fields(body, kind, invalid, unsupported)
    # The order of the steps is the order of the checks: a body with several bad fields
    # is refused for the same one every time.
    fields.llama_cpp_mapped(gbnf_to_lark)
    fields.sampling_ignored()
    fields.output_controls()
    fields.template_controls("add_generation_prompt" in body)
    fields.vllm_rest()
    return fields.normalised


class _Fields:
    """A body being normalised: the fields not yet taken, and what was made of the others."""

    def __init__(
        self,
        body: Mapping[str, Any],
        kind: Kind,
        invalid: Callable[[str, str], Exception],
        unsupported: Callable[[str, str], Exception],
    ) -> None:
        self.out = dict(body)
        self.ignored: list[str] = []
        self.normalised = Normalised(self.out, self.ignored)
        self.kind = kind
        self.invalid = invalid
        self.unsupported = unsupported

    def take(self, name: str) -> Any:
        """The value of a table field of this endpoint, removed from the body (None when
        absent or not this endpoint's)."""
        return self.out.pop(name, None) if known(name, self.kind) else None

    def mapped(self, name: str, target: str, value: object) -> None:
        """``value`` (from ``name``) set as ``target``, unless the body gave another."""
        out = self.out
        if out.get(target) is not None and out[target] != value:
            raise self.invalid(name, f"{value!r}, and '{target}' is {out[target]!r}: give one")
        out[target] = value

    def boolean(self, name: str, v: object) -> bool:
        if not isinstance(v, bool):
            raise self.invalid(name, f"{v!r}; expected true or false")
        return v

    def number(self, name: str, v: object) -> float:
        if isinstance(v, bool) or not isinstance(v, (int, float)):
            raise self.invalid(name, f"{v!r}; expected a number")
        return float(v)

    def llama_cpp_mapped(self, gbnf_to_lark: Callable[[str], str]) -> None:
        """llama.cpp's ``cache_prompt`` checked, and its fields with an OpenAI (or vLLM)
        counterpart rewritten to it."""
        invalid, take, mapped = self.invalid, self.take, self.mapped
        if (v := take("cache_prompt")) is not None:
            self.boolean("cache_prompt", v)
        if (v := take("n_predict")) is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < -1 or v == 0:
                raise invalid("n_predict", f"{v!r}; expected a positive integer, or -1")
            if v > 0:
                mapped("n_predict", "max_tokens", v)
        if (v := take("n_probs")) is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise invalid("n_probs", f"{v!r}; expected an integer >= 0")
            if v > 0:
                if self.kind == "chat":
                    mapped("n_probs", "logprobs", True)
                    mapped("n_probs", "top_logprobs", v)
                else:
                    mapped("n_probs", "logprobs", v)
        if (v := take("repeat_penalty")) is not None:
            mapped("repeat_penalty", "repetition_penalty", self.number("repeat_penalty", v))
        if (v := take("grammar")) is not None:
            if not isinstance(v, str):
                raise invalid("grammar", f"{v!r}; expected GBNF text")
            if v.strip():
                mapped("grammar", "guided_grammar", gbnf_to_lark(v))

    def sampling_ignored(self) -> None:
        """The sampling and context fields colibri has no counterpart for: checked, and
        listed as ignored unless they are at their off value."""
        take, ignored = self.take, self.ignored
        for name, off in (("typical_p", 1.0), ("tfs_z", 1.0), ("mirostat", 0.0)):
            if (v := take(name)) is not None and self.number(name, v) != off:
                ignored.append(name)
        for name in ("mirostat_tau", "mirostat_eta", "length_penalty"):
            if (v := take(name)) is not None:
                self.number(name, v)
                if "mirostat" in ignored or name == "length_penalty":
                    ignored.append(name)
        for name in ("repeat_last_n", "n_keep", "id_slot", "min_keep"):
            if (v := take(name)) is not None:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise self.invalid(name, f"{v!r}; expected an integer")
                ignored.append(name)
        if (v := take("penalize_nl")) is not None and self.boolean("penalize_nl", v):
            ignored.append("penalize_nl")

    def output_controls(self) -> None:
        """vLLM's ``top_k`` off value, and its controls of the output text."""
        take, out = self.take, self.out
        if out.get("top_k") == -1 and not isinstance(out.get("top_k"), bool):
            out.pop("top_k")
        if (v := take("include_stop_str_in_output")) is not None and self.boolean(
            "include_stop_str_in_output", v
        ):
            out["include_stop_str_in_output"] = True  # colibri's sampling field
        if (v := take("skip_special_tokens")) is not None and not self.boolean(
            "skip_special_tokens", v
        ):
            self.ignored.append("skip_special_tokens")
        if (v := take("spaces_between_special_tokens")) is not None:
            self.boolean("spaces_between_special_tokens", v)

    def template_controls(self, generation_prompt_given: bool) -> None:
        """vLLM's chat template controls, kept in :class:`Normalised`
        (``generation_prompt_given``: the body set ``add_generation_prompt`` itself)."""
        take, invalid, n = self.take, self.invalid, self.normalised
        if (v := take("add_generation_prompt")) is not None:
            n.add_generation_prompt = self.boolean("add_generation_prompt", v)
        if (v := take("continue_final_message")) is not None:
            n.continue_final_message = self.boolean("continue_final_message", v)
        if n.continue_final_message and n.add_generation_prompt and generation_prompt_given:
            raise invalid(
                "continue_final_message",
                "true with add_generation_prompt true: the last message is either continued "
                "or answered; set add_generation_prompt false",
            )
        if n.continue_final_message:
            n.add_generation_prompt = False
        if (v := take("chat_template_kwargs")) is not None:
            if not isinstance(v, dict) or not all(isinstance(k, str) for k in v):
                raise invalid("chat_template_kwargs", f"{v!r}; expected an object")
            reserved = {"messages", "add_generation_prompt"} & set(v)
            if reserved:
                raise invalid(
                    "chat_template_kwargs",
                    f"{sorted(reserved)[0]!r} is set by the request itself, not here",
                )
            n.chat_template_kwargs = v

    def vllm_rest(self) -> None:
        """vLLM's ``guided_choice`` as a grammar, its candidate and beam fields refused
        past their defaults, ``truncate_prompt_tokens`` kept, and its bookkeeping fields
        ignored."""
        take, invalid, unsupported = self.take, self.invalid, self.unsupported
        if (v := take("guided_choice")) is not None:
            if not isinstance(v, list) or not v or not all(isinstance(c, str) and c for c in v):
                raise invalid("guided_choice", f"{v!r}; expected a list of non-empty strings")
            grammar = "start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in v)
            self.mapped("guided_choice", "guided_grammar", grammar)
        if self.kind == "chat":
            if (v := take("best_of")) is not None:
                if isinstance(v, bool) or not isinstance(v, int):
                    raise invalid("best_of", f"{v!r}; expected an integer")
                if v != 1:
                    raise unsupported("best_of", "one candidate per request")
            if (v := take("echo")) is not None and self.boolean("echo", v):
                raise unsupported("echo", "a chat answer does not repeat the conversation")
        if (v := take("use_beam_search")) is not None and self.boolean("use_beam_search", v):
            raise unsupported("use_beam_search", "colibri samples or decodes greedily, no beams")
        if (v := take("truncate_prompt_tokens")) is not None:
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise invalid("truncate_prompt_tokens", f"{v!r}; expected an integer >= 1")
            self.normalised.truncate_prompt_tokens = v
        for name in ("priority", "request_id"):
            if take(name) is not None:
                self.ignored.append(name)
