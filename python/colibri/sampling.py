"""``SamplingParams``: the sampling settings of a generation as one object, with vLLM's names.

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

import dataclasses
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["SamplingParams"]


@dataclass(frozen=True)
class SamplingParams:
    """How a generation picks its tokens (vLLM's ``SamplingParams`` names and meanings).

    Every logit processing step (``logit_bias``, the penalties, ``min_tokens``, the
    ``guided_*`` structured-output mask) is applied inside the Rust sampler to every row it
    picks from, the verify rows of speculative decoding included, so drafting never changes
    the output distribution with them.
    """

    #: At most this many new tokens (``max_new_tokens`` is the same).
    max_tokens: int | None = None
    #: 0 is greedy; ``None`` takes ``generation_config.json`` (greedy unless it samples).
    temperature: float | None = None
    #: Keep the k most likely tokens (0 = off).
    top_k: int | None = None
    #: Nucleus mass in (0, 1] (1 = off).
    top_p: float | None = None
    #: Keep tokens at least this share as likely as the most likely one, in [0, 1] (0 = off).
    min_p: float | None = None
    #: Makes sampling reproducible; ``None`` picks a random seed.
    seed: int | None = None
    #: Strings that end the generation (not included in the text).
    stop: str | Sequence[str] | None = None
    #: Token ids that end it; ``None``: the model's EOS ids.
    stop_token_ids: Sequence[int] | None = None
    #: Keep generating past EOS (other stop token ids still stop).
    ignore_eos: bool | None = None
    #: > 1 discourages every token already in the prompt or output (1 = off).
    repetition_penalty: float | None = None
    #: Subtracted from the logit of every token the output already holds (OpenAI's).
    presence_penalty: float | None = None
    #: Subtracted once per occurrence in the output (OpenAI's).
    frequency_penalty: float | None = None
    #: Token id → value added to its logit before sampling (``-inf`` bans it).
    logit_bias: Mapping[int, float] | None = None
    #: Stop tokens cannot end the generation before this many tokens.
    min_tokens: int | None = None
    #: Report each generated token's log-probability and this many most likely
    #: alternatives (0: the token's only); ``None``: none.
    logprobs: int | None = None
    #: Completions to generate (:meth:`colibri.Model.generate` returns a list of them).
    n: int | None = None
    #: Structured output: the text is JSON matching this JSON schema (a dict, its JSON text,
    #: or a pydantic model class).
    guided_json: str | Mapping[str, Any] | None = None
    #: Structured output: the text matches this regular expression (Rust ``regex`` syntax).
    guided_regex: str | None = None
    #: Structured output: the text follows this grammar (llguidance's Lark syntax).
    guided_grammar: str | None = None
    #: Report each prompt token's log-probability given the tokens before it and this many
    #: alternatives (vLLM's ``prompt_logprobs``); ``None``: none.
    prompt_logprobs: int | None = None

    def __post_init__(self) -> None:
        # A mistake is reported where the object is made, not at the first generate; what
        # needs the model (token ids against its vocabulary, the prompt's length, compiling
        # a guided_* constraint) is checked there.
        from colibri.validation import check_sampling_fields

        check_sampling_fields(self.fields())

    def fields(self) -> dict[str, Any]:
        """The fields that are set (not ``None``)."""
        return {
            f.name: getattr(self, f.name)
            for f in dataclasses.fields(self)
            if getattr(self, f.name) is not None
        }
