"""The keywords of a generation, declared once: :class:`SamplingOptions` (how tokens are
picked, vLLM's names), :class:`GenerateOptions` (those and how the engine runs the
generation), and :class:`SamplingParams`, the sampling settings as one object.

:meth:`colibri.Model.generate`, :meth:`~colibri.Model.chat`, :class:`colibri.Session`, the
batch and streaming calls take ``**GenerateOptions``; the server's request parser and the CLI
read the field names from here, and the Rust engine (``GenerateRequest``) checks every value.

Every field is optional: ``None`` means "the default" (the model's
``generation_config.json`` for ``temperature``/``top_k``/``top_p``, off for the rest). Pass
one to :meth:`colibri.Model.generate` / :meth:`~colibri.Model.chat`; keywords given to
the call as well must not repeat its fields.

Example:
    >>> import colibri
    >>> sp = colibri.SamplingParams(max_tokens=8, temperature=0.7, seed=1, presence_penalty=0.5)
    >>> colibri.Model().generate("def add(a, b):", sp).finish_reason in ("length", "stop")
    True
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, TypedDict

if sys.version_info >= (3, 11):
    from typing import Unpack
else:  # pragma: no cover - Python 3.10
    from typing_extensions import Unpack

__all__ = ["DraftMode", "GenerateOptions", "SamplingOptions", "SamplingParams"]

#: The drafters of speculative decoding (the engine's vocabulary; a test keeps them equal).
DraftMode = Literal["auto", "mtp", "ngram", "off"]


class SamplingOptions(TypedDict, total=False):
    """How a generation picks its tokens (vLLM's ``SamplingParams`` names and meanings).
    Every field is optional; ``None`` means "the default" (the model's
    ``generation_config.json`` for ``temperature``/``top_k``/``top_p``, off for the rest).

    Every logit processing step (``logit_bias``, the penalties, ``min_tokens``, the
    ``guided_*`` structured-output mask) is applied inside the Rust sampler to every row it
    picks from, the verify rows of speculative decoding included, so drafting never changes
    the output distribution with them.
    """

    #: At most this many new tokens (≥ 1; ``max_new_tokens`` is the same); default
    #: ``generation_config.json``'s ``max_new_tokens``, else 128.
    max_tokens: int | None
    #: 0 is greedy; ``None`` takes ``generation_config.json`` (greedy unless it samples).
    #: ``top_k``, ``top_p``, ``min_p`` and ``seed`` only shape sampling: given for a greedy
    #: generation they are ignored with a ``UserWarning``.
    temperature: float | None
    #: Keep the k most likely tokens (0 = off).
    top_k: int | None
    #: Nucleus mass in (0, 1] (1 = off).
    top_p: float | None
    #: Keep tokens at least this share as likely as the most likely one, in [0, 1] (0 = off).
    min_p: float | None
    #: Makes sampling reproducible; ``None`` picks a random seed.
    seed: int | None
    #: Strings that end the generation (not included in the text).
    stop: str | Sequence[str] | None
    #: Token ids that end it; ``None``: the model's EOS ids; ``[]`` never stops on a token.
    #: The stopping token is kept in ``token_ids``, not in ``text`` (unless
    #: ``include_stop_str_in_output``).
    stop_token_ids: Sequence[int] | None
    #: Keep the stop string that ended the generation at the end of the text, and a stop
    #: token's text (vLLM's; default false: both are left out).
    include_stop_str_in_output: bool | None
    #: Keep generating past EOS (other stop token ids still stop).
    ignore_eos: bool | None
    #: > 1 discourages every token already in the prompt or output (transformers' and
    #: vLLM's rule; 1 = off).
    repetition_penalty: float | None
    #: Subtracted from the logit of every token the output already holds (OpenAI's; 0 = off).
    presence_penalty: float | None
    #: Subtracted once per occurrence in the output (OpenAI's; 0 = off).
    frequency_penalty: float | None
    #: Token id → value added to its logit before sampling (``-inf`` bans it).
    logit_bias: Mapping[int, float] | None
    #: Stop tokens cannot end the generation before this many tokens.
    min_tokens: int | None
    #: Report each generated token's log-probability (``GenerationResult.logprobs``) and
    #: this many most likely alternatives (``top_logprobs``; 0: the token's only).
    logprobs: int | None
    #: Structured output: the text is JSON matching this JSON schema (a dict, its JSON text,
    #: or a pydantic model class), generated compact.
    guided_json: str | Mapping[str, Any] | None
    #: Structured output: the text matches this regular expression (Rust ``regex`` syntax).
    guided_regex: str | None
    #: Structured output: the text follows this grammar (llguidance's Lark syntax). At most
    #: one ``guided_*`` per generation; it ends with a stop token once the text is complete.
    guided_grammar: str | None
    #: Report each prompt token's log-probability given the tokens before it and this many
    #: alternatives (vLLM's ``prompt_logprobs``); computed in the prefill, which then reuses
    #: no cached prefix.
    prompt_logprobs: int | None


class GenerateOptions(SamplingOptions, total=False):
    """The keyword arguments of :meth:`colibri.Model.generate` (besides ``sampling_params``,
    ``n`` and ``stream``): the :class:`SamplingOptions` and how the engine runs it."""

    #: The same as ``max_tokens`` (give one of them).
    max_new_tokens: int | None
    #: Called as ``prefill_progress(done, total)`` after each chunk of the prompt (chunks of
    #: 512 tokens; tokens reused from the session's cache are not counted). Ctrl-C stops a
    #: long prefill within one chunk, with or without it.
    prefill_progress: Callable[[int, int], object] | None
    #: Drafter for speculative decoding (default: the Model's).
    draft: DraftMode | None
    #: Tokens drafted per step, 1-8 or ``"auto"`` (default: the Model's).
    draft_depth: int | Literal["auto"] | None


#: The names of :class:`SamplingOptions` and of :class:`GenerateOptions`, in order.
SAMPLING_FIELDS: tuple[str, ...] = tuple(SamplingOptions.__annotations__)
GENERATE_KEYWORDS: tuple[str, ...] = tuple(GenerateOptions.__annotations__)


class SamplingParams:
    """The sampling settings of a generation as one object (vLLM's ``SamplingParams``): any
    of the :class:`SamplingOptions` fields, and ``n`` (completions to generate:
    :meth:`colibri.Model.generate` returns a list of them). Pass one to
    :meth:`colibri.Model.generate` / :meth:`~colibri.Model.chat`; keywords given to the call
    as well must not repeat its fields. Immutable; a field not given reads ``None``.

    A bad value is an :class:`~colibri.InvalidArgumentError` where the object is made; what
    needs the model (token ids against its vocabulary, the prompt's length, compiling a
    ``guided_*`` constraint) is checked by the generation.
    """

    __slots__ = ("_fields",)
    _fields: dict[str, Any]

    def __init__(self, *, n: int | None = None, **fields: Unpack[SamplingOptions]) -> None:
        unknown = [k for k in fields if k not in SAMPLING_FIELDS]
        if unknown:
            raise TypeError(
                f"SamplingParams() got an unexpected keyword argument {unknown[0]!r}; the "
                f"fields are {', '.join(SAMPLING_FIELDS)}, n"
            )
        given: dict[str, Any] = {k: v for k, v in fields.items() if v is not None}
        if n is not None:
            given["n"] = n
        from colibri.validation import check_sampling_fields

        check_sampling_fields(given)
        object.__setattr__(self, "_fields", given)

    def __getattr__(self, name: str) -> Any:
        if name in SAMPLING_FIELDS or name == "n":
            return self._fields.get(name)
        raise AttributeError(f"'SamplingParams' object has no attribute {name!r}")

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError("SamplingParams is immutable; make a new one")

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, SamplingParams):
            return NotImplemented
        return self._fields == other._fields

    __hash__ = None  # type: ignore[assignment]  # its fields may be lists and dicts

    def __repr__(self) -> str:
        inner = ", ".join(f"{k}={v!r}" for k, v in self._fields.items())
        return f"SamplingParams({inner})"

    def fields(self) -> dict[str, Any]:
        """The fields that are set (not ``None``)."""
        return dict(self._fields)
