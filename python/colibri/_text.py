"""Incremental detokenisation and stop strings.

Text is emitted only once it is whole: a token that ends inside a multi-byte UTF-8 character
decodes to U+FFFD, so we hold it back until the next tokens complete it.
"""

from __future__ import annotations

from collections.abc import Sequence

from tokenizers import Tokenizer

_REPLACEMENT = "\ufffd"


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas, UTF-8 safe across token boundaries."""

    def __init__(self, tokenizer: Tokenizer, *, skip_special_tokens: bool = True) -> None:
        self._tok = tokenizer
        self._skip = skip_special_tokens
        self.ids: list[int] = []
        self._prefix = 0  # start of the window decoded for context
        self._read = 0  # ids before this are already emitted
        self.text = ""

    def _decode(self, ids: Sequence[int]) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=self._skip)

    def push(self, new_ids: Sequence[int]) -> str:
        """Add tokens; return the text that became complete (possibly empty)."""
        self.ids.extend(int(i) for i in new_ids)
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        full = self._decode(self.ids[self._prefix :])
        if full.endswith(_REPLACEMENT) or len(full) <= len(prefix_text):
            return ""
        delta = full[len(prefix_text) :]
        self._prefix = self._read
        self._read = len(self.ids)
        self.text += delta
        return delta

    @property
    def pending(self) -> bool:
        """Whether tokens were pushed whose text is not out yet (an incomplete character)."""
        return self._read < len(self.ids)

    def flush(self) -> str:
        """Emit whatever is left, even an incomplete character (end of generation)."""
        full = self._decode(self.ids[self._prefix :])
        prefix_text = self._decode(self.ids[self._prefix : self._read])
        delta = full[len(prefix_text) :] if len(full) > len(prefix_text) else ""
        self._prefix = self._read = len(self.ids)
        self.text += delta
        return delta


class StopMatcher:
    """Finds the first stop string in the generated text and holds back possible prefixes.

    Example:
        >>> m = StopMatcher(["\\n\\n", "END"])
        >>> m.check("a\\nb"), m.safe_len("a\\nb EN")
        (None, 4)
        >>> m.check("ab END cd")
        3
    """

    def __init__(self, stops: Sequence[str]) -> None:
        self.stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self.stops), default=0)

    def check(self, text: str, start: int = 0) -> int | None:
        """Index in ``text`` where the earliest stop string begins, or None. Matches that
        begin before ``start - len(longest stop) + 1`` are not searched again."""
        lo = max(0, start - self._longest + 1)
        hits = [i for i in (text.find(s, lo) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def length_at(self, text: str, at: int) -> int:
        """The length of the stop string found at ``at`` (:meth:`check`'s answer): the
        longest one that ``text`` has there."""
        return max((len(s) for s in self.stops if text.startswith(s, at)), default=0)

    def safe_len(self, text: str) -> int:
        """How much of ``text`` can be shown: all of it but a tail that could still grow into
        a stop string (the longest suffix of ``text`` that is a proper prefix of one)."""
        hold = 0
        for s in self.stops:
            for k in range(min(len(s) - 1, len(text)), hold, -1):
                if text.endswith(s[:k]):
                    hold = k
                    break
        return len(text) - hold
