"""Saved context files (``Session.save`` / ``Model.load_session``) mutated by ``hypothesis``:
bit flips, truncations, splices (of the file itself and of another context), inserted and
deleted bytes, and edits of the header's JSON. Every load either gives back the identical
context (only when the bytes are unchanged) or raises ``SavedContextError``: never another
exception, a hang or a crash. Bounded and derandomised, so CI runs the same cases each time.
"""

from __future__ import annotations

import json
import struct
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import colibri
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

PREFIX = 16 + 4 + 4 + 8  # magic, version, header CRC-32, header length (src/engine/saved.rs)
FUZZ = settings(
    max_examples=300,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)

Mutation = Callable[[bytes], bytes]


class Contexts:
    """One model, the file it saved for a prompt, and another context to splice from."""

    def __init__(self, model: colibri.Model, tmp: Path) -> None:
        self.model, self.tmp = model, tmp
        s = model.session()
        s.prefill([5, 6, 7, 8, 9])
        self.tokens = s.token_ids
        s.save(tmp / "good.ctx")
        self.good = (tmp / "good.ctx").read_bytes()
        other = model.session()
        other.prefill([11, 12, 13, 14, 15, 16, 17])
        other.save(tmp / "other.ctx")
        self.other = (tmp / "other.ctx").read_bytes()
        self.header_len = struct.unpack_from("<Q", self.good, 24)[0]
        self.header = json.loads(self.good[PREFIX : PREFIX + self.header_len])

    def load(self, data: bytes) -> colibri.Session:
        path = self.tmp / "fuzzed.ctx"
        path.write_bytes(data)
        return self.model.load_session(path)


@pytest.fixture(scope="module")
def ctx(test_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Contexts:
    tmp = tmp_path_factory.mktemp("fuzz-ctx")
    model = colibri.Model(test_model_dir, threads=1, cache_dir=tmp / "cache")
    return Contexts(model, tmp)


def _with_header(data: bytes, header: bytes, crc: int | None) -> bytes:
    """``data`` with its header JSON replaced by ``header``; the prefix's header CRC kept as
    it was (``crc=None``) or set to ``crc``."""
    old_len = struct.unpack_from("<Q", data, 24)[0]
    prefix = bytearray(data[:PREFIX])
    struct.pack_into("<Q", prefix, 24, len(header))
    if crc is not None:
        struct.pack_into("<I", prefix, 20, crc)
    return bytes(prefix) + header + data[PREFIX + old_len :]


# Byte-level mutations of the whole file.
positions = st.integers(min_value=0, max_value=1 << 30)


@st.composite
def byte_mutations(draw: st.DrawFn) -> Any:
    kind = draw(st.sampled_from(["flip", "truncate", "splice_self", "splice_other", "insert"]))
    a, b, c = draw(positions), draw(positions), draw(positions)
    n = draw(st.integers(min_value=1, max_value=64))
    bits = draw(st.lists(st.integers(0, 7), min_size=1, max_size=4))
    extra = draw(st.binary(min_size=1, max_size=32))
    return kind, a, b, c, n, bits, extra


def _apply_bytes(m: Any, data: bytes, other: bytes, focus_header: bool) -> bytes:
    kind, a, b, c, n, bits, extra = m
    # Half the cases aim at the prefix and header, where the fields are.
    span = min(len(data), PREFIX + 400) if focus_header else len(data)
    at = a % span
    out = bytearray(data)
    if kind == "flip":
        for k, bit in enumerate(bits):
            out[(at + k * (b % 97)) % len(out)] ^= 1 << bit
    elif kind == "truncate":
        del out[at:]
    elif kind == "splice_self":
        src = b % len(data)
        out[at : at + n] = data[src : src + n]
    elif kind == "splice_other":
        src = b % len(other)
        out[at : at + n] = other[src : src + n] if c % 2 else other[src:]
    else:  # insert or delete
        if c % 2:
            out[at:at] = extra
        else:
            del out[at : at + n]
    return bytes(out)


# Edits of the header JSON (the interesting ones reach the checks behind the header CRC only
# when it is recomputed, as a deliberate edit would).
values = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.sampled_from([0, 1, 2, 4, 5, 6, 2**32, 2**63, 2**64 - 1]),
    st.text(max_size=8),
    st.lists(st.integers(min_value=-1, max_value=2**33), max_size=8),
    st.lists(st.lists(st.integers(0, 512), min_size=3, max_size=3), max_size=4),
)
header_edits = st.tuples(
    st.sampled_from(
        [
            "fingerprint",
            "widths",
            "main_rows",
            "mtp_rows",
            "hidden_size",
            "pending_rows",
            "tokens",
            "payload_bytes",
            "crc32",
            "mtp_head",
            "unknown_field",
        ]
    ),
    st.sampled_from(["set", "delete", "token", "nudge"]),
    values,
    st.integers(min_value=-3, max_value=3),
    st.sampled_from(["kept", "recomputed"]),
)


def _edit_header(ctx: Contexts, edit: Any) -> tuple[bytes, dict[str, Any] | None]:
    field, how, value, delta, crc = edit
    h = json.loads(json.dumps(ctx.header))
    if how == "delete":
        h.pop(field, None)
    elif how == "token" and h["tokens"]:
        h["tokens"][abs(delta) % len(h["tokens"])] ^= 1 << (abs(delta) % 8)
    elif how == "nudge" and isinstance(h.get(field), int) and not isinstance(h[field], bool):
        h[field] = h[field] + (delta or 1)
    else:
        h[field] = value
    raw = json.dumps(h, separators=(",", ":")).encode()
    crc_value = {"kept": None, "recomputed": max(1, zlib.crc32(raw))}[crc]
    return _with_header(ctx.good, raw, crc_value), h


def _check(ctx: Contexts, data: bytes, claimed: dict[str, Any] | None = None) -> None:
    """Loading ``data`` is the identical context when the bytes are the saved ones, else a
    ``SavedContextError``. With ``claimed`` (a header edited and given a valid checksum, as
    only a deliberate edit does) a load may also succeed, with what that header says."""
    try:
        s = ctx.load(data)
    except colibri.SavedContextError:
        assert data != ctx.good, "the saved file itself was refused"
        return
    if data == ctx.good:
        assert s.token_ids == ctx.tokens and s.kv_tokens == len(ctx.tokens)
        s.save(ctx.tmp / "again.ctx")  # the same caches and tokens write the same bytes
        assert (ctx.tmp / "again.ctx").read_bytes() == ctx.good
        return
    assert claimed is not None, "a damaged file loaded as a valid context"
    assert s.token_ids == claimed["tokens"] and s.kv_tokens == len(claimed["tokens"])
    s.prefill([*claimed["tokens"], 1])  # and the session it gave works
    assert s.kv_tokens == len(claimed["tokens"]) + 1


def test_the_unmutated_file_loads_back_identical(ctx: Contexts) -> None:
    _check(ctx, ctx.good)


@pytest.mark.timeout(120)
@FUZZ
@given(m=byte_mutations(), focus_header=st.booleans())
def test_mutated_context_bytes_are_refused_with_saved_context_error(
    ctx: Contexts, m: Any, focus_header: bool
) -> None:
    _check(ctx, _apply_bytes(m, ctx.good, ctx.other, focus_header))


@pytest.mark.timeout(120)
@FUZZ
@given(edit=header_edits)
def test_edited_context_headers_are_refused_with_saved_context_error(
    ctx: Contexts, edit: Any
) -> None:
    data, h = _edit_header(ctx, edit)
    _check(ctx, data, claimed=h if edit[4] == "recomputed" else None)


def test_another_contexts_header_on_this_payload_is_refused(ctx: Contexts) -> None:
    """A whole valid header from another save (same model, same shapes) over this file's
    payload: both checksums are of real data, and the payload's is not this payload's."""
    s = ctx.model.session()
    s.prefill([9, 8, 7, 6, 5])  # as many tokens (and digits) as ``good``: the sizes agree
    s.save(ctx.tmp / "same-size.ctx")
    third = (ctx.tmp / "same-size.ctx").read_bytes()
    n = struct.unpack_from("<Q", third, 24)[0]
    spliced = third[: PREFIX + n] + ctx.good[PREFIX + ctx.header_len :]
    assert len(spliced) == len(ctx.good)
    with pytest.raises(colibri.SavedContextError, match="checksum"):
        ctx.load(spliced)


def test_a_header_edit_with_its_checksum_zeroed_is_refused(ctx: Contexts) -> None:
    h = json.loads(json.dumps(ctx.header))
    h["tokens"][0] ^= 1
    raw = json.dumps(h, separators=(",", ":")).encode()
    with pytest.raises(colibri.SavedContextError):
        ctx.load(_with_header(ctx.good, raw, 0))
