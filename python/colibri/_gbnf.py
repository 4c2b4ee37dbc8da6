"""GBNF (llama.cpp's grammar format) translated to the Lark syntax our structured output
compiles (llguidance's), so llama.cpp clients' ``grammar`` field works unchanged.

GBNF, as llama.cpp's ``grammars/README.md`` defines it: rules ``name ::= alternatives``
(names of letters, digits and ``-``; ``root`` is the start), string literals ``"..."``,
character classes ``[...]`` / ``[^...]``, ``.`` for any character, grouping ``( )``,
alternation ``|``, repetition ``*`` ``+`` ``?`` ``{m}`` ``{m,}`` ``{m,n}``, comments from
``#`` to the end of the line; a rule may continue over several lines.

Example:
    >>> print(gbnf_to_lark('root ::= "yes" | "no"  # an answer'))
    start: "yes" | "no"
"""

from __future__ import annotations

import re

from colibri.errors import InvalidArgumentError

__all__ = ["gbnf_to_lark"]

_NAME = re.compile(r"[A-Za-z0-9_-]+")
_RULE_START = re.compile(r"\s*([A-Za-z0-9_-]+)\s*::=")
#: Characters a Rust regex character class treats as syntax (set operations, nesting, the
#: Lark regex's own delimiter), escaped when GBNF means them literally.
_CLASS_SPECIAL = set("[&~/")


def _bad(message: str) -> InvalidArgumentError:
    return InvalidArgumentError(f"invalid value for 'grammar': {message} (GBNF, llama.cpp's)")


class _Reader:
    def __init__(self, text: str) -> None:
        self.text = text
        self.i = 0

    def skip_space(self, newlines: bool) -> None:
        """Skip blanks and comments; a newline only when ``newlines`` (inside parentheses,
        or when the next line does not start a new rule)."""
        t = self.text
        while self.i < len(t):
            c = t[self.i]
            if c == "#":
                while self.i < len(t) and t[self.i] != "\n":
                    self.i += 1
            elif c in " \t\r":
                self.i += 1
            elif c == "\n" and (newlines or not _RULE_START.match(t, self.i + 1)):
                if not newlines and self._blank_to_end(self.i + 1):
                    return
                self.i += 1
            else:
                return

    def _blank_to_end(self, at: int) -> bool:
        return not self.text[at:].strip()

    def peek(self) -> str:
        return self.text[self.i] if self.i < len(self.text) else ""

    def where(self) -> str:
        line = self.text.count("\n", 0, self.i) + 1
        return f"line {line}"


def _names(text: str) -> dict[str, str]:
    """GBNF rule names → Lark rule names (lowercase, ``_`` for ``-``, ``root`` → ``start``),
    kept distinct."""
    defined = [m.group(1) for m in re.finditer(r"(?m)^\s*([A-Za-z0-9_-]+)\s*::=", text)]
    out: dict[str, str] = {}
    taken = {"start"}
    for name in defined:
        if name in out:
            continue
        if name == "root":
            out[name] = "start"
            continue
        base = "r_" + re.sub(r"[^a-z0-9_]", "_", name.lower())
        lark, k = base, 1
        while lark in taken:
            k += 1
            lark = f"{base}_{k}"
        taken.add(lark)
        out[name] = lark
    return out


def _string(r: _Reader) -> str:
    """A ``"..."`` literal, as a Lark string."""
    t, start = r.text, r.i
    r.i += 1
    out = ['"']
    while True:
        if r.i >= len(t) or t[r.i] == "\n":
            raise _bad(f"unterminated string at {_at(r, start).where()}")
        c = t[r.i]
        if c == '"':
            r.i += 1
            break
        if c == "\\":
            c, r.i = _escape(t, r.i)
        else:
            r.i += 1
        out.append(_LARK_STRING_ESCAPES.get(c, c))
    out.append('"')
    return "".join(out)


_LARK_STRING_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\r": "\\r", "\t": "\\t"}
_SIMPLE_ESCAPES = {"n": "\n", "r": "\r", "t": "\t"}


def _escape(t: str, i: int) -> tuple[str, int]:
    """The character the escape at ``t[i]`` (a backslash) stands for, and where it ends."""
    if i + 1 >= len(t):
        raise _bad("a backslash ends the grammar")
    c = t[i + 1]
    if c in _SIMPLE_ESCAPES:
        return _SIMPLE_ESCAPES[c], i + 2
    for prefix, width in (("x", 2), ("u", 4), ("U", 8)):
        if c == prefix:
            digits = t[i + 2 : i + 2 + width]
            if len(digits) != width or not all(d in "0123456789abcdefABCDEF" for d in digits):
                raise _bad(f"'\\{c}' needs {width} hex digits")
            code = int(digits, 16)
            if code > 0x10FFFF or 0xD800 <= code <= 0xDFFF:
                raise _bad(f"'\\{c}{digits}' is not a Unicode character")
            return chr(code), i + 2 + width
    if c.isalnum():
        raise _bad(f"unknown escape '\\{c}'")
    return c, i + 2  # \\, \", \], \-, ...: the character itself


def _class(r: _Reader) -> str:
    """A ``[...]`` character class, as a Lark regex (Rust ``regex`` syntax)."""
    t, start = r.text, r.i
    r.i += 1
    out = ["/["]
    if r.peek() == "^":
        out.append("^")
        r.i += 1
    while True:
        if r.i >= len(t) or t[r.i] == "\n":
            raise _bad(f"unterminated character class at {_at(r, start).where()}")
        c = t[r.i]
        if c == "]":
            r.i += 1
            break
        if c == "\\":  # an escaped character is always literal: written by its code point
            ch, r.i = _escape(t, r.i)
            out.append(f"\\x{{{ord(ch):X}}}")
            continue
        out.append("\\" + c if c in _CLASS_SPECIAL else c)
        r.i += 1
    out.append("]/")
    return "".join(out)


def _at(r: _Reader, i: int) -> _Reader:
    copy = _Reader(r.text)
    copy.i = i
    return copy


def _alternatives(r: _Reader, names: dict[str, str], depth: int) -> str:
    parts = [_sequence(r, names, depth)]
    while r.peek() == "|":
        r.i += 1
        r.skip_space(newlines=depth > 0)
        parts.append(_sequence(r, names, depth))
    return " | ".join(parts)


def _sequence(r: _Reader, names: dict[str, str], depth: int) -> str:
    items: list[str] = []
    while True:
        r.skip_space(newlines=depth > 0)
        c = r.peek()
        if c == "" or c in "|)" or c == "\n":
            break
        if c == '"':
            item = _string(r)
        elif c == "[":
            item = _class(r)
        elif c == ".":
            r.i += 1
            item = "/(?s:.)/"
        elif c == "(":
            r.i += 1
            r.skip_space(newlines=True)
            inner = _alternatives(r, names, depth + 1)
            r.skip_space(newlines=True)
            if r.peek() != ")":
                raise _bad(f"a '(' is not closed at {r.where()}")
            r.i += 1
            item = f"({inner})"
        else:
            m = _NAME.match(r.text, r.i)
            if not m:
                raise _bad(f"unexpected {c!r} at {r.where()}")
            if _RULE_START.match(r.text, r.i):
                break  # the next rule begins (on a continuation line)
            name = m.group(0)
            if name not in names:
                raise _bad(f"rule {name!r} is used at {r.where()} but never defined")
            r.i = m.end()
            item = names[name]
        items.append(item + _repetition(r))
    if not items:
        return '""'
    return " ".join(items)


def _repetition(r: _Reader) -> str:
    c = r.peek()
    if c in "*+?":
        r.i += 1
        return c
    if c == "{":
        m = re.compile(r"\{\s*(\d+)\s*(,\s*(\d*)\s*)?\}").match(r.text, r.i)
        if not m:
            raise _bad(f"a repetition '{{m,n}}' is malformed at {r.where()}")
        r.i = m.end()
        lo, comma, hi = m.group(1), m.group(2), m.group(3)
        if comma is None:
            return f"{{{lo}}}"
        if not hi:  # {m,}: m copies, then any more
            return f"{{{lo},}}"
        if int(hi) < int(lo):
            raise _bad(f"a repetition {{{lo},{hi}}} has its bounds reversed")
        return f"{{{lo},{hi}}}"
    return ""


def gbnf_to_lark(text: str) -> str:
    """The Lark grammar of GBNF ``text`` (start rule ``root``); a malformed one is an
    :class:`InvalidArgumentError` naming the ``grammar`` field and the line."""
    if not isinstance(text, str) or not text.strip():
        raise _bad("expected a non-empty grammar")
    names = _names(text)
    if "root" not in names:
        raise _bad("no 'root ::= ...' rule (the grammar starts there)")
    r = _Reader(text)
    rules: list[str] = []
    while True:
        r.skip_space(newlines=True)
        if r.i >= len(text):
            break
        m = _RULE_START.match(text, r.i)
        if not m:
            raise _bad(f"expected 'name ::= ...' at {r.where()}")
        r.i = m.end()
        r.skip_space(newlines=False)
        body = _alternatives(r, names, 0)
        rules.append(f"{names[m.group(1)]}: {body}")
    return "\n".join(rules)
