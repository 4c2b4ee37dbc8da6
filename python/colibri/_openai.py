"""The OpenAI wire format: request bodies checked field by field and turned into colibri
generation arguments (``colibri._openai_errors`` has the error bodies and the value
checks, ``colibri._openai_prompts`` the prompts, ``colibri._openai_sampling`` the generation
keywords, ``colibri._openai_answer`` the response, chunk and usage bodies; this module
re-exports what the server and the library use).

Every field of OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` requests is either
honoured or refused with a 400 that names it (``param``): nothing is silently ignored. The
extra fields llama.cpp's and vLLM's clients send are in ``colibri._client_fields``: honoured,
mapped, refused, or ignored with a ``Warning`` header naming them. This
module needs no web framework: `colibri serve` answers with it, and
``Model.create_completion`` / ``Model.create_chat_completion`` return the same bodies.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from colibri import _client_fields, _fim, _reasoning, _tools
from colibri._gbnf import gbnf_to_lark
from colibri._openai_answer import (
    FINISH_REASONS,
    Scored,
    closing_chunks,
    colibri_stats,
    finish_chunk,
    logprobs_body,
    opening_chunks,
    response,
    scored_body,
    system_fingerprint,
    text_chunks,
    usage,
    usage_chunk,
)
from colibri._openai_errors import (
    ApiError,
    Kind,
    check_fields,
    from_colibri_error,
    invalid,
    is_int,
    must_be_off,
    opt_bool,
    unknown_field,
    unsupported,
)
from colibri._openai_prompts import _chat_prompt, _completion_prompt, _completion_prompts
from colibri._openai_sampling import generation_keywords, parse_logprobs
from colibri.errors import ColibriError, InvalidArgumentError
from colibri.model import Model
from colibri.sampling import SAMPLING_FIELDS

__all__ = [
    "FINISH_REASONS",
    "ApiError",
    "ChoiceStream",
    "Kind",
    "Request",
    "ToolUse",
    "check_fields",
    "closing_chunks",
    "colibri_stats",
    "finish_chunk",
    "from_colibri_error",
    "ignored_warning",
    "invalid",
    "logprobs_body",
    "opening_chunks",
    "parse",
    "response",
    "system_fingerprint",
    "text_chunks",
    "unknown_field",
    "unsupported",
    "usage",
    "usage_chunk",
]


# ----------------------------------------------------------------------------- requests


@dataclass
class Request:
    """A checked request: what to generate and how to answer."""

    kind: Kind
    #: The prompts as token ids (a chat: one, rendered with the model's template; a
    #: completions request may carry several).
    prompts: list[list[int]]
    #: Keywords for ``Session.generate`` (``max_new_tokens``, ``temperature``, ...).
    generate: dict[str, Any]
    stream: bool = False
    include_usage: bool = False
    #: Completions' ``echo``: each prompt's text, put before its completions.
    echoes: list[str] = field(default_factory=list)
    #: Top alternatives per token when log-probabilities are asked for, else None.
    logprobs: int | None = None
    model: str = ""
    created: int = field(default_factory=lambda: int(time.time()))
    id: str = ""
    #: Choices to generate per prompt (OpenAI's ``n``): they decode together; choice
    #: ``p * n + j`` is prompt p's j-th, sampled with seed ``seed + j``.
    n: int = 1
    #: Extra client fields accepted without effect (said in a ``Warning`` header).
    ignored: list[str] = field(default_factory=list)
    #: A thinking model's chat: its ``<think>`` text is split into ``reasoning_content``
    #: (``opens_reasoning``: the prompt left the model inside it); ``include_reasoning``
    #: false (vLLM's) leaves the reasoning out of the answer.
    reasoning: bool = False
    opens_reasoning: bool = False
    include_reasoning: bool = True

    #: Tools the model may call (``tool_choice`` not ``none``), else None.
    tool_use: ToolUse | None = None

    def choice_stream(self) -> ChoiceStream:
        """The state of one choice's streamed text (its reasoning and tool-call split)."""
        return ChoiceStream(self)

    def answer(self, text: str) -> tuple[str | None, str | None, list[_tools.Call]]:
        """A finished choice's text as ``(reasoning, content, tool calls)``; content is None
        when the answer is only calls."""
        reasoning = None
        if self.reasoning:
            reasoning, text = _reasoning.split(text, self.opens_reasoning)
        calls: list[_tools.Call] = []
        if self.tool_use is not None:
            text, calls = _tools.extract(text, self.tool_use.format, self.tool_use.tools)
            if not self.tool_use.parallel:
                calls = calls[:1]
        content: str | None = text
        if calls and not text.strip():
            content = None
        return reasoning, content, calls

    @property
    def prompt_ids(self) -> list[int]:
        """The first (for a chat, the only) prompt."""
        return self.prompts[0]

    @property
    def choices(self) -> int:
        """Choices in the answer: ``n`` per prompt."""
        return len(self.prompts) * self.n

    def choice_prompt(self, i: int) -> list[int]:
        """The prompt of choice ``i``."""
        return self.prompts[i // self.n]

    def choice_echo(self, i: int) -> str:
        """The echoed prompt text of choice ``i`` ("" without ``echo``)."""
        return self.echoes[i // self.n] if self.echoes else ""

    def choice_generate(self, i: int) -> dict[str, Any]:
        """The ``Session.generate`` keywords of choice ``i``: the request's, its seed (when
        one was given) advanced by its place among its prompt's ``n``."""
        g = dict(self.generate)
        j = i % self.n
        if j and g.get("seed") is not None:
            g["seed"] = (int(g["seed"]) + j) % 2**64
        return g


@dataclass
class ToolUse:
    """The tools a chat request offers: their format (the template's), the choice, and
    whether several calls may come at once."""

    tools: list[_tools.Tool]
    format: _tools.Format
    choice: _tools.Choice
    parallel: bool = True


class ChoiceStream:
    """One streamed choice: reasoning split from the answer, tool calls held back, and the
    log-probabilities sent so far (each chunk carries those of the tokens it completes)."""

    def __init__(self, req: Request) -> None:
        self.reasoning = (
            _reasoning.ReasoningSplitter(req.opens_reasoning) if req.reasoning else None
        )
        self.calls = None if req.tool_use is None else _tools.CallFilter(req.tool_use.format)
        #: Scored tokens received but not sent yet (their text made no chunk so far).
        self.pending: list[Scored] = []
        #: How many tokens' log-probabilities chunks carried, and where their text ended
        #: (completions' ``text_offset``).
        self.sent = 0
        self.offset = 0

    def logprobs(self, model: Model, req: Request, scored: Sequence[Scored]) -> dict[str, Any]:
        """The ``logprobs`` object of the next ``scored`` tokens, counted as sent."""
        assert req.logprobs is not None
        body, self.offset = scored_body(model, scored, req.kind, req.logprobs, self.offset)
        self.sent += len(scored)
        return body


#: Most choices one request may ask for (``n``).
MAX_CHOICES = 16
#: Most prompts times ``n`` one completions request may carry (each is a job in the batch).
MAX_BATCH_CHOICES = 64

#: The sampling fields of colibri's (:class:`colibri.sampling.SamplingOptions`) this parser
#: reads itself, with OpenAI's ranges and names.
_PARSED = {
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "logprobs",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_p",
    "min_tokens",
    "logit_bias",
    "guided_json",
    "guided_regex",
    "guided_grammar",
}
#: Sampling fields the server does not take: their results have no place in its answers.
_NOT_SERVED = {"prompt_logprobs"}
#: Every other sampling field is taken as it is (as vLLM takes its extra sampling fields),
#: its value checked by the engine: a new one is served without a change here.
_PASSED_THROUGH = tuple(f for f in SAMPLING_FIELDS if f not in _PARSED | _NOT_SERVED)

#: Fields both endpoints accept, with no meaning of their own beyond what is checked below.
_COMMON = set(_PASSED_THROUGH) | {
    "model",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "seed",
    "stop",
    "stream",
    "stream_options",
    "n",
    "frequency_penalty",
    "presence_penalty",
    "logit_bias",
    "logprobs",
    "user",
    "safety_identifier",
    "draft",
    "draft_depth",
    "ignore_eos",
    "stop_token_ids",
    "min_p",
    "repetition_penalty",
    "min_tokens",
    "guided_json",
    "guided_regex",
    "guided_grammar",
}
_CHAT_ONLY = {
    "messages",
    "max_completion_tokens",
    "top_logprobs",
    "tools",
    "tool_choice",
    "parallel_tool_calls",
    "functions",
    "function_call",
    "response_format",
    "store",
    "metadata",
    "modalities",
    "audio",
    "prediction",
    "reasoning_effort",
    "service_tier",
    "web_search_options",
    "verbosity",
    "prompt_cache_key",
    "include_reasoning",
}
_COMPLETION_ONLY = {"prompt", "best_of", "echo", "suffix"}


def parse(body: object, kind: Kind, model: Model, served: str) -> Request:
    """Check an OpenAI request body for ``kind`` and prepare its generation.

    Raises :class:`ApiError` (400 naming the field; 404 for another model name)."""
    body = check_fields(body, set())  # an object; its fields are checked once normalised
    extra = _client_fields.normalise(body, kind, invalid, unsupported, _grammar_field)
    body = check_fields(extra.body, _COMMON | (_CHAT_ONLY if kind == "chat" else _COMPLETION_ONLY))
    # The steps run in this order so that a body with several bad fields is always
    # refused for the same one.
    _check_model(body, served)
    n = _parse_n(body)
    # What colibri cannot do (yet): a 400 that says so, never a silent default.
    if kind == "chat":
        _refuse_chat_features(body)
    else:
        _refuse_completion_features(body)
    stream, include_usage = _parse_stream(body)
    logprobs = parse_logprobs(body, kind)

    tool_use: ToolUse | None = None
    forced: str | None = None
    if kind == "chat":
        prompts, tool_use, forced = _chat_prompts(body, model, extra)
        texts = None
    else:
        prompts, texts = _completion_batch(body, model, n)
    if extra.truncate_prompt_tokens is not None:
        if texts is not None:
            raise invalid("truncate_prompt_tokens", "with 'suffix': a FIM prompt is not cut")
        prompts = [p[-extra.truncate_prompt_tokens :] for p in prompts]
    echoes: list[str] = []
    if kind == "completion" and opt_bool(body, "echo"):
        echoes = texts if texts is not None else [model.decode(p) for p in prompts]
    prompt_ids = max(prompts, key=len)
    thinks = kind == "chat" and _reasoning.template_thinks(_template_text(model))
    include_reasoning = opt_bool(body, "include_reasoning")

    gen = generation_keywords(body, kind, model, prompt_ids, logprobs)
    gen.update({f: body[f] for f in _PASSED_THROUGH if body.get(f) is not None})
    if tool_use is not None and tool_use.choice == "required":
        gen["guided_grammar"] = _forced_call_grammar(gen, tool_use, forced)
    for text_field in ("user", "safety_identifier", "prompt_cache_key"):
        v = body.get(text_field)
        if v is not None and not isinstance(v, str):
            raise invalid(text_field, f"{v!r}; expected a string")
    prefix = "chatcmpl-" if kind == "chat" else "cmpl-"
    return Request(
        kind=kind,
        prompts=prompts,
        generate=gen,
        stream=stream,
        include_usage=include_usage,
        echoes=echoes,
        logprobs=logprobs,
        model=served,
        id=prefix + uuid.uuid4().hex[:24],
        n=n,
        ignored=extra.ignored,
        reasoning=thinks,
        opens_reasoning=thinks
        and _reasoning.prompt_opens_reasoning(
            model.decode(prompt_ids[-16:], skip_special_tokens=False)
        ),
        include_reasoning=include_reasoning is not False,
        tool_use=tool_use,
    )


def _check_model(body: Mapping[str, Any], served: str) -> None:
    """The 404 for a request naming a model other than the one served."""
    name = body.get("model")
    if name is not None and name != served:
        raise ApiError(
            404,
            f"the model '{name}' does not exist; this server serves '{served}' (GET /v1/models)",
            param="model",
            code="model_not_found",
        )


def _parse_n(body: Mapping[str, Any]) -> int:
    """OpenAI's ``n``: choices per prompt (1 when absent or null)."""
    n = body.get("n", 1)
    if n is None:
        n = 1
    if not is_int(n) or not 1 <= n <= MAX_CHOICES:
        raise invalid("n", f"{n!r}; expected an integer in 1..{MAX_CHOICES}")
    return n


def _parse_stream(body: Mapping[str, Any]) -> tuple[bool, bool]:
    """``stream`` and ``stream_options``: whether to stream, and whether the stream ends
    with a usage chunk."""
    stream = bool(opt_bool(body, "stream"))
    include_usage = False
    so = body.get("stream_options")
    if so is not None:
        if not stream:
            raise invalid("stream_options", "only allowed when 'stream' is true")
        if not isinstance(so, dict):
            raise invalid("stream_options", f"{so!r}; expected an object")
        for k in so:
            if k not in ("include_usage", "include_obfuscation"):
                raise unknown_field(f"stream_options.{k}")
        include_usage = bool(opt_bool(so, "include_usage"))
        if so.get("include_obfuscation"):
            raise unsupported(
                "stream_options.include_obfuscation", "chunks are sent without padding"
            )
    return stream, include_usage


def _chat_prompts(
    body: Mapping[str, Any], model: Model, extra: _client_fields.Normalised
) -> tuple[list[list[int]], ToolUse | None, str | None]:
    """A chat's one prompt, the tools it offers (None: no tool use) and the one tool a named
    ``tool_choice`` forces."""
    template = _template_text(model)
    fmt = _tools.detect(template)
    tools, choice, forced = _tools.parse_request(body, invalid)
    tool_use: ToolUse | None = None
    if tools and choice != "none":
        if fmt is None:
            raise unsupported(
                "tools",
                "this model's chat template writes no tool-call format colibri reads "
                "(GLM's <tool_call>, DeepSeek's tool-call tokens)",
            )
        parallel = opt_bool(body, "parallel_tool_calls")
        tool_use = ToolUse(tools, fmt, choice, parallel is not False)
    prompt = _chat_prompt(
        body.get("messages"),
        model,
        extra,
        tools=tool_use.tools if tool_use else None,
        fmt=fmt,
        template_renders_tools="tools" in template,
    )
    return [prompt], tool_use, forced


def _completion_batch(
    body: Mapping[str, Any], model: Model, n: int
) -> tuple[list[list[int]], list[str] | None]:
    """A completions request's prompts, at most :data:`MAX_BATCH_CHOICES` choices in all,
    and with a ``suffix`` (fill-in-the-middle) the prompts' texts (what ``echo`` repeats)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
        _check_batch_size(len(prompt), n)  # before any prompt is tokenised
    texts = _fim_texts(body, model)
    if texts is None:
        prompts = _completion_prompts(body.get("prompt"), model)
    else:
        prompts = [_completion_prompt(t, model) for t in texts]
        texts = [body["prompt"]] if isinstance(body["prompt"], str) else list(body["prompt"])
    _check_batch_size(len(prompts), n)
    return prompts, texts


def _check_batch_size(prompts: int, n: int) -> None:
    """At most :data:`MAX_BATCH_CHOICES` choices (prompts times ``n``) per request."""
    if prompts * n > MAX_BATCH_CHOICES:
        raise invalid(
            "prompt",
            f"{prompts} prompts times n={n} choices; at most {MAX_BATCH_CHOICES} per "
            "request: split the batch",
        )


def _fim_texts(body: Mapping[str, Any], model: Model) -> list[str] | None:
    """With a ``suffix``, each prompt's fill-in-the-middle prompt text in the format of the
    model's tokenizer (``colibri._fim``); None without one. A tokenizer with no FIM tokens
    is a 400 naming ``suffix``."""
    suffix = body.get("suffix")
    if suffix is None or suffix == "":
        return None
    if not isinstance(suffix, str):
        raise invalid("suffix", f"{suffix!r}; expected a string")
    fmt = _fim.detect(model.tokenizer)
    if fmt is None:
        raise unsupported(
            "suffix",
            "this model's tokenizer has no fill-in-the-middle tokens (DeepSeek's, Qwen's or "
            "StarCoder's, GLM's code tokens), so there is no prompt that inserts text",
        )
    prompt = body.get("prompt")
    texts = prompt if isinstance(prompt, list) and prompt else [prompt]
    if not all(isinstance(t, str) for t in texts):
        raise invalid(
            "prompt", "with 'suffix', expected the text before the gap, or a list of texts"
        )
    return [fmt.prompt(t, suffix) for t in texts]


def _forced_call_grammar(gen: Mapping[str, Any], tool_use: ToolUse, forced: str | None) -> str:
    """The grammar of ``tool_choice: required`` (or a named tool): the answer is one call
    of an offered tool (``forced``, when named)."""
    if any(k in gen for k in ("guided_json", "guided_regex", "guided_grammar")):
        raise invalid("tool_choice", "a forced tool call and response_format/guided_*: give one")
    offered = [t for t in tool_use.tools if forced is None or t.name == forced]
    return _tools.forced_grammar(tool_use.format, offered)


def _template_text(model: Model) -> str:
    """The model's chat template ("" when it has none)."""
    from colibri._chat import template_source

    try:
        return model._chat_template or template_source(model._tokenizer_config, model.path)
    except ColibriError:
        return ""


def _grammar_field(text: str) -> str:
    """llama.cpp's ``grammar`` (GBNF) as ``guided_grammar`` text, or the 400 naming it."""
    try:
        return gbnf_to_lark(text)
    except InvalidArgumentError as e:
        raise ApiError(400, str(e), param="grammar", code="invalid_value") from None


def ignored_warning(req: Request) -> str | None:
    """The ``Warning`` header (RFC 9111's 299, "miscellaneous persistent warning") of a
    request whose extra fields were accepted without effect, or None."""
    if not req.ignored:
        return None
    return f'299 colibri "ignored fields: {", ".join(req.ignored)} (see docs/server.md)"'


def _refuse_completion_features(body: Mapping[str, Any]) -> None:
    """The 400 for the completions feature colibri has not got: several candidates."""
    best_of = body.get("best_of")
    if best_of is not None and not is_int(best_of):  # true == 1 in Python
        raise invalid("best_of", f"{best_of!r}; expected an integer")
    if best_of is not None and best_of != 1:
        raise unsupported("best_of", "one candidate per request")


def _refuse_chat_features(body: Mapping[str, Any]) -> None:
    """The 400s for chat features colibri has not got: tools, audio,
    stored completions, predicted outputs, reasoning controls."""
    if body.get("functions") not in (None, []):
        raise unsupported("functions", "the deprecated form: give 'tools'")
    if body.get("function_call") not in (None, "none"):
        raise unsupported("function_call", "the deprecated form: give 'tool_choice'")
    if body.get("parallel_tool_calls") is not None:
        opt_bool(body, "parallel_tool_calls")
    must_be_off(body, "store", [False], "completions are not stored")
    md = body.get("metadata")
    if md not in (None, {}):
        raise unsupported("metadata", "completions are not stored, so there is none to tag")
    mods = body.get("modalities")
    if mods is not None and mods != ["text"]:
        raise unsupported("modalities", "colibri generates text only")
    for name, why in (
        ("audio", "colibri generates text only"),
        ("prediction", "predicted outputs are not used (drafting is the model's own MTP)"),
        ("reasoning_effort", "this server has no reasoning controls"),
        ("web_search_options", "colibri does not search the web"),
        ("verbosity", "this server has no verbosity control"),
    ):
        if body.get(name) is not None:
            raise unsupported(name, why)
    tier = body.get("service_tier")
    if tier not in (None, "auto", "default"):
        raise unsupported("service_tier", f"'{tier}': there is one tier, 'default'")
    if body.get("top_logprobs") is not None and not body.get("logprobs"):
        raise invalid("top_logprobs", "requires 'logprobs': true")
