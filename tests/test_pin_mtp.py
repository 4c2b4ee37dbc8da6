"""``pin_mtp``: the MTP layer's routed experts resident beyond ``ram_budget`` when drafting can
use them and they fit (``"auto"``, the default), with the decision in
``info()["memory"]["pin_mtp"]`` (python/colibri/_pin_mtp.py)."""

from __future__ import annotations

from pathlib import Path

import colibri
import pytest
from colibri import _pin_mtp
from colibri.info import model_info

from tests.conftest import EMBEDDED_TINY

GIB = 1 << 30


def _sizes(path: Path = EMBEDDED_TINY) -> tuple[int, int, int]:
    """(MTP routed-expert bytes, dense bytes, MTP layer index) from the container's own
    description (colibri.info), not from the code under test."""
    facts = model_info(path)
    mtp = sum(facts["tensors"]["mtp_routed_experts"].values())
    return mtp, int(facts["memory"]["dense_bytes"]), int(facts["config"]["num_hidden_layers"])


def _with_available(monkeypatch: pytest.MonkeyPatch, available: int | None) -> None:
    """Make ``MemAvailable`` read as ``available`` for the next ``Model``."""
    monkeypatch.setattr(colibri.model, "mem_available", lambda: available)


def test_auto_keeps_the_mtp_layer_resident_beyond_the_budget_when_it_fits(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mtp, dense, layer = _sizes()
    budget = 100_000
    # Exactly enough: MemAvailable = dense + budget + headroom + the MTP layer.
    _with_available(monkeypatch, dense + budget + _pin_mtp.HEADROOM_BYTES + mtp)
    m = colibri.Model(cache_dir=tmp_path, ram_budget=budget, prefetch="off")
    mem = m.info()["memory"]
    choice = mem["pin_mtp"]
    assert choice["mode"] == "auto" and choice["resident"] is True, choice
    assert choice["bytes"] == mtp > 0 and choice["mtp_drafting"] is True
    assert choice["reason"].startswith("fits")
    # The resident bytes go beyond the budget: the budget asked for is whole for the rest.
    assert mem["mtp_resident_bytes"] >= mtp
    assert mem["ram_budget_bytes"] == budget + mem["mtp_resident_bytes"]
    out = m.generate("def f(x):", max_new_tokens=12, temperature=0, draft="mtp", draft_depth=2)
    assert out.stats.mtp_forwards > 0
    stats = m._engine.expert_stats()["layers"][layer]
    assert stats["misses"] == 0 and stats["hits_pinned"] > 0, stats


def test_auto_that_does_not_fit_starts_with_mtp_drafting_disabled(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mtp, dense, layer = _sizes()
    budget = 100_000
    _with_available(monkeypatch, dense + budget + _pin_mtp.HEADROOM_BYTES + mtp - 1)
    m = colibri.Model(cache_dir=tmp_path, ram_budget=budget, prefetch="off")
    mem = m.info()["memory"]
    choice = mem["pin_mtp"]
    assert choice["resident"] is False and choice["mtp_drafting"] is False, choice
    assert "does not fit" in choice["reason"] and str(mtp) in choice["reason"]
    assert mem["mtp_resident_bytes"] == 0 and mem["ram_budget_bytes"] == budget
    # draft="auto" drafts by prompt lookup: the MTP layer never runs, and the tokens are the
    # plain ones.
    auto = m.generate("def f(x):", max_new_tokens=16, temperature=0)
    plain = m.generate("def f(x):", max_new_tokens=16, temperature=0, draft="off")
    assert auto.stats.mtp_forwards == 0
    assert auto.token_ids == plain.token_ids
    assert m._engine.expert_stats()["layers"][layer]["misses"] == 0
    # An explicit draft="mtp" at a fixed depth still runs, streamed (at the automatic depth
    # its drafts are priced by the bytes they read).
    mtp_run = m.generate("def f(x):", max_new_tokens=16, temperature=0, draft="mtp", draft_depth=2)
    assert mtp_run.stats.mtp_forwards > 0 and mtp_run.token_ids == plain.token_ids
    assert m._engine.expert_stats()["layers"][layer]["misses"] > 0


def test_pin_mtp_true_that_does_not_fit_says_what_to_do(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mtp, dense, _ = _sizes()
    _with_available(monkeypatch, dense + _pin_mtp.HEADROOM_BYTES + mtp - 1)
    with pytest.raises(colibri.InvalidArgumentError, match="lower ram_budget") as e:
        colibri.Model(cache_dir=tmp_path, ram_budget=0, pin_mtp=True)
    assert f"take {mtp} bytes" in str(e.value) and "pin_mtp='auto'" in str(e.value)
    # Unknown MemAvailable: True cannot be checked either, and is refused.
    _with_available(monkeypatch, None)
    with pytest.raises(colibri.InvalidArgumentError, match="MemAvailable is unknown"):
        colibri.Model(cache_dir=tmp_path, ram_budget=0, pin_mtp=True)
    # When it fits, True is resident and reported as "on".
    _with_available(monkeypatch, dense + _pin_mtp.HEADROOM_BYTES + mtp)
    m = colibri.Model(cache_dir=tmp_path, ram_budget=0, pin_mtp=True)
    assert m.info()["memory"]["pin_mtp"]["mode"] == "on"
    assert m.info()["memory"]["mtp_resident_bytes"] >= mtp


def test_draft_off_or_false_streams_the_mtp_layer(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    mtp, _, _ = _sizes()
    _with_available(monkeypatch, 1 << 50)  # everything fits
    off = colibri.Model(cache_dir=tmp_path, ram_budget=0, draft="off")
    choice = off.info()["memory"]["pin_mtp"]
    assert choice["resident"] is False and choice["bytes"] == mtp and "off" in choice["reason"]
    assert off.info()["memory"]["mtp_resident_bytes"] == 0
    false = colibri.Model(cache_dir=tmp_path, ram_budget=0, pin_mtp=False)
    assert false.info()["memory"]["pin_mtp"]["mode"] == "off"
    assert false.info()["memory"]["pin_mtp"]["resident"] is False
    assert false.info()["memory"]["mtp_resident_bytes"] == 0
    no_head = colibri.Model(cache_dir=tmp_path, ram_budget=0, mtp=False)
    assert no_head.info()["memory"]["pin_mtp"]["resident"] is False


def test_the_automatic_budget_counts_against_the_room(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """``ram_budget=None`` takes half of MemAvailable (the engine's rule): the MTP layer must
    fit in the other half less the dense weights and the headroom."""
    mtp, dense, _ = _sizes()
    need = 2 * (dense + _pin_mtp.HEADROOM_BYTES + mtp)
    assert _pin_mtp.decide(
        "auto", mtp_bytes=mtp, dense_bytes=dense, ram_budget=None, drafting=True, available=need
    ).resident
    assert not _pin_mtp.decide(
        "auto",
        mtp_bytes=mtp,
        dense_bytes=dense,
        ram_budget=None,
        drafting=True,
        available=need - 2,
    ).resident


def test_pin_mtp_values_and_meminfo(tmp_path: Path) -> None:
    assert [_pin_mtp.check_pin_mtp(v) for v in (True, False, "auto", "on", "off")] == [
        "on",
        "off",
        "auto",
        "on",
        "off",
    ]
    for bad in ("yes", 1, None):
        with pytest.raises(colibri.InvalidArgumentError, match="pin_mtp"):
            _pin_mtp.check_pin_mtp(bad)
    with pytest.raises(colibri.InvalidArgumentError, match="pin_mtp"):
        colibri.Model(cache_dir=tmp_path, pin_mtp="always")  # type: ignore[arg-type]
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:  100 kB\nMemAvailable:   12345 kB\n", encoding="ascii")
    assert _pin_mtp.mem_available(meminfo) == 12345 * 1024
    # No /proc/meminfo: half the physical memory (a positive number on any POSIX host).
    fallback = _pin_mtp.mem_available(tmp_path / "absent")
    assert fallback is None or fallback > 0


def test_cli_pin_mtp_flag() -> None:
    """``--pin-mtp auto|on|off``; a bare ``--pin-mtp`` (the flag of before) is on."""
    import argparse

    from colibri._cli_options import _add_model_options

    p = argparse.ArgumentParser()
    _add_model_options(p)
    assert p.parse_args([]).pin_mtp == "auto"
    assert p.parse_args(["--pin-mtp"]).pin_mtp == "on"
    for value in ("auto", "on", "off"):
        assert p.parse_args(["--pin-mtp", value]).pin_mtp == value
    with pytest.raises(SystemExit):
        p.parse_args(["--pin-mtp", "sometimes"])
    # A bare flag before a positional keeps the positional (the CLI rewrites it to "on").
    from colibri._cli_options import bare_pin_mtp

    assert bare_pin_mtp(["--pin-mtp", "def f"]) == ["--pin-mtp=on", "def f"]
    assert bare_pin_mtp(["--pin-mtp"]) == ["--pin-mtp=on"]
    assert bare_pin_mtp(["--pin-mtp", "off", "x"]) == ["--pin-mtp", "off", "x"]
