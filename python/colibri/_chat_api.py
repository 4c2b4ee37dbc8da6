"""``Model.chat``, ``apply_chat_template`` and the OpenAI-shaped calls
(``create_completion``, ``create_chat_completion``: the server's code, in process)."""

from __future__ import annotations

import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, overload

from colibri._generation import GenerationMixin, _check_keywords
from colibri.errors import InvalidArgumentError
from colibri.results import GenerationResult
from colibri.sampling import (
    GenerateOptions,
    SamplingParams,
    Unpack,
)
from colibri.stream import GenerationStream
from colibri.validation import (
    _choices,
)

if TYPE_CHECKING:
    from pathlib import Path

__all__ = ["ChatMixin"]


class ChatMixin(GenerationMixin):
    """Chat on top of :class:`~colibri._generation.GenerationMixin`."""

    if TYPE_CHECKING:
        _tokenizer_config: dict[str, Any]
        _chat_template: str | None
        _max_prompt_chars: int
        path: Path

        def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]: ...

    # ----------------------------------------------------------------------------- chat
    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: Literal[True] = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> list[int]: ...

    @overload
    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: Literal[False],
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str: ...

    def apply_chat_template(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        chat_template: str | None = None,
        **template_kwargs: Any,
    ) -> str | list[int]:
        """Render ``messages`` with the chat template (sandboxed jinja2, as transformers
        renders it), with transformers' defaults: token ids (``tokenize=True``) and no
        generation prompt (``add_generation_prompt=False``; :meth:`chat` adds it).
        ``chat_template`` (template text) replaces the model's template for this call;
        ``Model(chat_template=...)`` for every call. Other keywords are variables of the
        template, as transformers passes them (e.g. ``enable_thinking=False`` for GLM)."""
        from colibri._chat import render_chat

        text = render_chat(
            self._tokenizer_config,
            self.path,
            messages,
            add_generation_prompt,
            max_output=self._max_prompt_chars,
            template=chat_template if chat_template is not None else self._chat_template,
            variables=template_kwargs,
        )
        if tokenize:
            return self.encode(text, add_special_tokens=False)
        return text

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        n: int,
        stream: Literal[False] = False,
        **options: Unpack[GenerateOptions],
    ) -> list[GenerationResult]: ...

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        stream: Literal[False] = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult: ...

    @overload
    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = ...,
        tool_choice: str | Mapping[str, Any] | None = ...,
        stream: Literal[True],
        **options: Unpack[GenerateOptions],
    ) -> GenerationStream: ...

    def chat(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: SamplingParams | None = None,
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        n: int | None = None,
        stream: bool = False,
        **options: Unpack[GenerateOptions],
    ) -> GenerationResult | GenerationStream | list[GenerationResult]:
        """Generate the assistant's reply to ``messages`` (a list of
        ``{"role": ..., "content": ...}`` dicts), rendered with the model's chat template.

        Takes the keyword arguments of :meth:`generate`, with the same meaning; returns a
        :class:`GenerationResult`, or with ``stream=True`` a :class:`GenerationStream`.
        ``tools`` (OpenAI's tool objects) and ``tool_choice`` (``"auto"``, ``"none"``,
        ``"required"`` or ``{"type": "function", "function": {"name": ...}}``) let the
        model call functions, for GLM's and DeepSeek's chat templates: the result's
        ``tool_calls`` holds the calls and ``text`` what came before them (docs/server.md,
        "Tool calls"; not with ``stream=True``).
        """
        kw = _check_keywords(options)
        choices = _choices(n, sampling_params)
        if tools is not None or tool_choice is not None:
            return self._chat_with_tools(
                messages, sampling_params, kw, choices, stream, tools, tool_choice
            )
        if choices > 1:
            return self._n_results(self._chat_ids(messages), sampling_params, kw, choices, stream)
        params = self._params(self._chat_ids(messages), sampling_params, kw)
        return self._launch(params, stream)

    def _chat_with_tools(
        self,
        messages: Sequence[Mapping[str, Any]],
        sampling_params: object,
        kw: dict[str, Any],
        choices: int,
        stream: bool,
        tools: object,
        tool_choice: object,
    ) -> GenerationResult | list[GenerationResult]:
        """:meth:`chat` offering ``tools``: the calls parsed into ``tool_calls``."""
        from dataclasses import replace

        from colibri import _openai, _tools

        def invalid(param: str, message: str) -> InvalidArgumentError:
            return InvalidArgumentError(f"invalid value for '{param}': {message}")

        if stream:
            raise InvalidArgumentError(
                "tools with stream=True: use create_chat_completion(..., stream=True), whose "
                "chunks carry the calls, or stream=False"
            )
        offered, choice, forced = _tools.parse_request(
            {"tools": tools, "tool_choice": tool_choice}, invalid
        )
        template = _openai._template_text(self)
        fmt = _tools.detect(template)
        if fmt is None and choice != "none":
            raise InvalidArgumentError(
                "invalid value for 'tools': this model's chat template writes no tool-call "
                "format colibri reads (GLM's <tool_call>, DeepSeek's tool-call tokens)"
            )
        turns: list[dict[str, Any]] = []
        for i, m in enumerate(messages):
            turn = dict(m)
            if turn.get("tool_calls"):
                where = f"messages[{i}].tool_calls"
                turn["tool_calls"] = _tools.message_calls(where, turn["tool_calls"], fmt, invalid)
            turns.append(turn)
        variables: dict[str, Any] = {}
        if choice != "none" and fmt is not None:
            turns = _tools.offer(turns, variables, offered, fmt, "tools" in template)
        if choice == "required" and fmt is not None:
            if any(
                kw.get(k) is not None for k in ("guided_json", "guided_regex", "guided_grammar")
            ):
                raise invalid("tool_choice", "a forced tool call and guided_*: give one")
            kw["guided_grammar"] = _tools.forced_grammar(
                fmt, [t for t in offered if forced is None or t.name == forced]
            )
        ids = self.apply_chat_template(turns, add_generation_prompt=True, **variables)
        if choices > 1:
            results = self._n_results(ids, sampling_params, kw, choices, False)
        else:
            results = [self._launch(self._params(ids, sampling_params, kw), False)]
        out = []
        for r in results:
            assert isinstance(r, GenerationResult)
            calls: list[_tools.Call] = []
            text = r.text
            if fmt is not None and choice != "none":
                text, calls = _tools.extract(r.text, fmt, offered)
            out.append(replace(r, text=text, tool_calls=[c.openai() for c in calls]))
        return out if choices > 1 else out[0]

    def _chat_ids(self, messages: Sequence[Mapping[str, Any]]) -> list[int]:
        """The prompt ids of a chat: ``messages`` rendered with the generation prompt."""
        return self.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)

    # ----------------------------------------------------------------------------- OpenAI
    def create_completion(
        self, prompt: str | Sequence[int] | Sequence[str | Sequence[int]], **request: Any
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``prompt`` completed as OpenAI's ``/v1/completions`` (and llama-cpp-python's
        ``create_completion``) answers: the keywords are that request's fields
        (``max_tokens`` default 16, ``temperature``, ``top_p``, ``stop``, ``seed``,
        ``logprobs``, ``presence_penalty``, ``logit_bias``, ``echo``, ``stream``, ...; vLLM's
        ``top_k``, ``min_p``, ``repetition_penalty``, ``min_tokens``, ``ignore_eos``; and
        llama.cpp's and vLLM's client fields, docs/server.md), and the result is the response
        body as a dict, or with ``stream=True`` an iterator of its chunks. A list of prompts
        is a batch. The same code answers ``colibri serve`` (``colibri._openai``); a field
        colibri cannot honour is an :class:`InvalidArgumentError` naming it."""
        return self._openai("completion", {"prompt": prompt, **request})

    def create_chat_completion(
        self, messages: Sequence[Mapping[str, Any]], **request: Any
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        """``messages`` answered as OpenAI's ``/v1/chat/completions`` does (the chat
        template, then generation): a ``chat.completion`` dict, or with ``stream=True`` an
        iterator of ``chat.completion.chunk`` dicts. Keywords as
        :meth:`create_completion` (``max_tokens`` defaults to the rest of the context)."""
        return self._openai("chat", {"messages": messages, **request})

    def _openai(
        self, kind: Literal["completion", "chat"], body: dict[str, Any]
    ) -> dict[str, Any] | Iterator[dict[str, Any]]:
        from colibri import _openai

        served = body.get("model") if isinstance(body.get("model"), str) else self.path.name
        try:
            req = _openai.parse(body, kind, self, served)
        except _openai.ApiError as e:  # its message names the field
            raise InvalidArgumentError(e.message) from None
        if req.ignored:
            warnings.warn(
                f"ignored fields: {', '.join(req.ignored)} (colibri accepts them without "
                "effect; docs/server.md lists what each client field does)",
                UserWarning,
                stacklevel=3,
            )
        if req.choices > 1:  # the choices decode together; a stream carries each one whole
            results: list[GenerationResult] = []
            if req.n == 1:  # a list of prompts: one batch, its decode forwards shared
                results = self.generate(req.prompts, **req.generate)
            else:
                for prompt in req.prompts:
                    results.extend(self.generate(prompt, n=req.n, **req.generate))
            if not req.stream:
                return _openai.response(req, results, self)

            def choice_chunks() -> Iterator[dict[str, Any]]:
                for i, r in enumerate(results):
                    yield from _openai.opening_chunks(req, i)
                    splitter = req.choice_stream()
                    yield from _openai.text_chunks(req, splitter, r.text, i)
                    yield from _openai.text_chunks(req, splitter, None, i)
                yield from _openai.closing_chunks(req, results, self)

            return choice_chunks()
        if not req.stream:
            result = self.generate(req.prompt_ids, **req.generate)
            return _openai.response(req, result, self)

        def chunks() -> Iterator[dict[str, Any]]:
            yield from _openai.opening_chunks(req)
            splitter = req.choice_stream()
            with self.generate(req.prompt_ids, stream=True, **req.generate) as stream:
                for text, rows in stream._scored_chunks():
                    yield from _openai.text_chunks(req, splitter, text, 0, rows, self)
                result = stream.result
            yield from _openai.text_chunks(req, splitter, None, 0, (), self)
            if result is not None:
                yield from _openai.closing_chunks(req, result, self, [splitter])

        return chunks()
