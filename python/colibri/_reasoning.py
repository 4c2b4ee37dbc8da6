"""The reasoning of thinking models (GLM-4.5 and later, DeepSeek-V3.1 and R1) split from
their answer: the text between ``<think>`` and ``</think>`` becomes the chat message's
``reasoning_content``, the rest its ``content``, as vLLM's reasoning parsers give them.

A generation may start inside the reasoning: DeepSeek-V3.1's template ends the prompt with
``<think>`` when thinking is on, so the model writes only the closing tag. Only a
``<think>`` at the start of the answer (after blanks) opens reasoning; later, and once the
answer has begun, the tags are the answer's own text.

Example:
    >>> split("<think>Two and two.</think>\\nFour.", in_reasoning=False)
    ('Two and two.', 'Four.')
    >>> s = ReasoningSplitter(in_reasoning=True)
    >>> s.push("Two and two.</thi") + s.push("nk>Four.") + s.flush()
    [('reasoning', 'Two and two.'), ('content', 'Four.')]
"""

from __future__ import annotations

from typing import Literal

OPEN = "<think>"
CLOSE = "</think>"

Piece = tuple[Literal["reasoning", "content"], str]


def _held(text: str, tag: str) -> int:
    """How many trailing characters of ``text`` could begin ``tag`` (kept back)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ReasoningSplitter:
    """Splits a generation's text, chunk by chunk, into reasoning and answer pieces,
    holding back what could still become a tag."""

    def __init__(self, in_reasoning: bool) -> None:
        self.inside = in_reasoning
        #: Whether there was reasoning (it started inside, or a ``<think>`` opened it).
        self.reasoned = in_reasoning
        #: Whether the answer (content) has begun: from then on every tag is text.
        self.answering = False
        #: Reasoning ended: the blank line after ``</think>`` is not the answer's.
        self._after_close = False
        self._buf = ""

    def push(self, text: str) -> list[Piece]:
        """The pieces ``text`` completes (empty pieces are not returned)."""
        self._buf += text
        out: list[Piece] = []
        while self._buf:
            if self.inside:
                at = self._buf.find(CLOSE)
                if at < 0:
                    keep = _held(self._buf, CLOSE)
                    self._emit(out, "reasoning", self._buf[: len(self._buf) - keep])
                    self._buf = self._buf[len(self._buf) - keep :]
                    break
                self._emit(out, "reasoning", self._buf[:at])
                self._buf = self._buf[at + len(CLOSE) :]
                self.inside, self._after_close = False, True
                continue
            if not self.answering:
                stripped = self._buf.lstrip()
                if self._after_close:
                    if not stripped:
                        break  # blanks after </think>: wait for the answer's first text
                    self._buf, self._after_close = stripped, False
                    continue
                if stripped.startswith(OPEN):
                    self._buf = stripped[len(OPEN) :]
                    self.inside = self.reasoned = True
                    continue
                if OPEN.startswith(stripped):  # could still be "<think>"
                    break
            self.answering = True
            self._emit(out, "content", self._buf)
            self._buf = ""
        return out

    def flush(self) -> list[Piece]:
        """The pieces held back, at the end of the generation."""
        rest, self._buf = self._buf, ""
        if not rest or (self._after_close and not rest.strip()):
            return []
        if self.inside:
            return [("reasoning", rest)]
        self.answering = True
        return [("content", rest)]

    @staticmethod
    def _emit(out: list[Piece], kind: Literal["reasoning", "content"], text: str) -> None:
        if text:
            out.append((kind, text))


def split(text: str, in_reasoning: bool) -> tuple[str | None, str]:
    """``(reasoning, content)`` of a whole generation's text; reasoning is None when there
    was none."""
    s = ReasoningSplitter(in_reasoning)
    pieces = s.push(text) + s.flush()
    reasoning = "".join(t for k, t in pieces if k == "reasoning")
    content = "".join(t for k, t in pieces if k == "content")
    return (reasoning if s.reasoned else None), content


def template_thinks(template: str) -> bool:
    """Whether a chat template is a thinking model's (it writes or strips ``</think>``)."""
    return CLOSE in template


def prompt_opens_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt leaves the model inside its reasoning (it ends with an
    open ``<think>``, as DeepSeek-V3.1's does with thinking on)."""
    tail = prompt_text.rstrip()
    return tail.endswith(OPEN)
