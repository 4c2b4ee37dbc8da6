"""Fill-in-the-middle: the ``suffix`` of a completions request, for models whose tokenizer
has the FIM tokens of a known format. The prompt is the text before the gap, the suffix the
text after it; the model writes the middle.

The formats, by their tokens (the spellings llama.cpp's ``/infill`` also looks for):

- DeepSeek's ``<｜fim▁begin｜>PREFIX<｜fim▁hole｜>SUFFIX<｜fim▁end｜>`` (DeepSeek-Coder and
  the V3 tokenizer; DeepSeek's own FIM completions take this prompt);
- the ``<|fim_prefix|>PREFIX<|fim_suffix|>SUFFIX<|fim_middle|>`` of Qwen's coder models
  and StarCoder's ``<fim_prefix>`` spelling, in the same order;
- GLM's ``<|code_suffix|>SUFFIX<|code_prefix|>PREFIX<|code_middle|>`` (GLM-4.5 and later
  have these tokens; the order, suffix first, is the one Zhipu's CodeGeeX4 documents).
"""

# DeepSeek's FIM tokens are spelled with fullwidth bars and ▁: not typos.
# ruff: noqa: RUF001, RUF002

from __future__ import annotations

from dataclasses import dataclass

from tokenizers import Tokenizer


@dataclass(frozen=True)
class FimFormat:
    """One FIM prompt format: its three tokens, and whether the suffix comes first."""

    name: str
    prefix: str
    suffix: str
    middle: str
    suffix_first: bool = False

    def prompt(self, before: str, after: str) -> str:
        """The prompt text whose continuation is the middle between ``before`` and
        ``after``."""
        if self.suffix_first:
            return f"{self.suffix}{after}{self.prefix}{before}{self.middle}"
        return f"{self.prefix}{before}{self.suffix}{after}{self.middle}"


#: The formats known, tried in this order.
FORMATS: tuple[FimFormat, ...] = (
    FimFormat("deepseek", "<｜fim▁begin｜>", "<｜fim▁hole｜>", "<｜fim▁end｜>"),
    FimFormat("qwen", "<|fim_prefix|>", "<|fim_suffix|>", "<|fim_middle|>"),
    FimFormat("starcoder", "<fim_prefix>", "<fim_suffix>", "<fim_middle>"),
    FimFormat("glm", "<|code_prefix|>", "<|code_suffix|>", "<|code_middle|>", suffix_first=True),
)


def detect(tokenizer: Tokenizer) -> FimFormat | None:
    """The FIM format whose three tokens are all single tokens of ``tokenizer``, or None."""
    for fmt in FORMATS:
        if all(tokenizer.token_to_id(t) is not None for t in (fmt.prefix, fmt.suffix, fmt.middle)):
            return fmt
    return None
