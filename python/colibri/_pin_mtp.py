"""``pin_mtp``: whether the MTP layer's routed experts are kept resident in RAM, beyond
``ram_budget``, and why (``Model.info()["memory"]["pin_mtp"]``).

``pin_mtp="auto"`` (the default) keeps them resident when drafting can use them (a draft mode
other than ``"off"``, ``mtp=True``, a model with an MTP layer) and they fit::

    resident bytes <= MemAvailable - dense bytes - expert budget - 2 GiB headroom

(``MemAvailable`` from ``/proc/meminfo``; where it cannot be read, half of the physical memory
``os.sysconf`` reports, else nothing fits). When they do not fit, MTP drafting starts disabled:
a streamed MTP layer reads its experts from disk for every draft and every absorbed row, which
made the defaults lose to plain decoding on disk-bound hosts (docs/benchmarks.md, disk-bound
decode). ``pin_mtp=True`` that does not fit is an :class:`InvalidArgumentError` naming what to
change; ``pin_mtp=False`` streams the MTP layer like any other (drafting priced as usual).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from colibri.errors import InvalidArgumentError

PinMtp = bool | Literal["auto"]

#: RAM left free beyond the dense weights, the expert budget and the resident MTP layer: the
#: KV cache, activations, the page cache of the container's dense shards, the OS.
HEADROOM_BYTES = 2 << 30
#: The engine's budget when ``ram_budget`` is ``None``: this share of ``MemAvailable``
#: (``experts::auto_budget``), 4 GiB where it cannot be read.
AUTO_BUDGET_SHARE = 0.5
FALLBACK_AUTO_BUDGET = 4 << 30

__all__ = ["HEADROOM_BYTES", "PinMtp", "PinMtpChoice", "check_pin_mtp", "decide", "mem_available"]


@dataclass(frozen=True)
class PinMtpChoice:
    """What ``pin_mtp`` decided at load (``info()["memory"]["pin_mtp"]``)."""

    #: ``"auto"``, ``"on"`` or ``"off"``: what was asked.
    mode: str
    #: Whether the MTP layer's routed experts are resident (loaded at open, beyond the budget).
    resident: bool
    #: Bytes of the MTP layer's routed experts (resident or not).
    bytes: int
    #: Why, in words.
    reason: str
    #: Whether MTP drafting is available: False when ``"auto"`` could not keep the layer
    #: resident (``draft="auto"`` then drafts by prompt lookup, ``draft="mtp"`` still runs).
    mtp_drafting: bool

    def as_dict(self) -> dict[str, object]:
        """The report's fields."""
        return {
            "mode": self.mode,
            "resident": self.resident,
            "bytes": self.bytes,
            "reason": self.reason,
            "mtp_drafting": self.mtp_drafting,
        }


def check_pin_mtp(value: object) -> str:
    """``pin_mtp`` as one of ``"auto"``, ``"on"``, ``"off"`` (True/False are on/off)."""
    if value is True or value == "on":
        return "on"
    if value is False or value == "off":
        return "off"
    if value == "auto":
        return "auto"
    raise InvalidArgumentError(
        f"invalid value for 'pin_mtp': {value!r}; expected True, False or 'auto'"
    )


def mem_available(meminfo: str | os.PathLike[str] = "/proc/meminfo") -> int | None:
    """``MemAvailable`` in bytes; where ``meminfo`` cannot be read, half the physical memory
    (``os.sysconf``), else ``None``."""
    try:
        for line in Path(meminfo).read_text(encoding="ascii").splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError, UnicodeDecodeError):
        pass
    try:
        return int(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")) // 2
    except (AttributeError, ValueError, OSError):
        return None


def decide(
    mode: str,
    *,
    mtp_bytes: int,
    dense_bytes: int,
    ram_budget: int | None,
    drafting: bool,
    available: int | None,
) -> PinMtpChoice:
    """Decide ``pin_mtp`` (``mode`` from :func:`check_pin_mtp`).

    Args:
        mtp_bytes: the MTP layer's routed-expert bytes (0: the model has no MTP layer, or the
            head is not loaded).
        dense_bytes: resident weights besides the routed experts.
        ram_budget: the expert budget asked for (``None``: the engine's automatic one).
        drafting: whether drafting can use the MTP layer (draft not ``"off"``, ``mtp=True``).
        available: ``MemAvailable`` (:func:`mem_available`), ``None`` when unknown.

    Raises:
        InvalidArgumentError: ``mode == "on"`` and the layer does not fit, or there is none.
    """
    budget = ram_budget
    if budget is None:
        budget = FALLBACK_AUTO_BUDGET if available is None else int(available * AUTO_BUDGET_SHARE)
    room = None if available is None else available - dense_bytes - budget - HEADROOM_BYTES
    fits = room is not None and mtp_bytes <= room
    room_text = (
        "MemAvailable is unknown"
        if room is None
        else f"{max(room, 0)} bytes are free after MemAvailable ({available}) less the dense "
        f"weights ({dense_bytes}), the expert budget ({budget}) and {HEADROOM_BYTES} of headroom"
    )
    if mode == "off":
        return PinMtpChoice("off", False, mtp_bytes, "pin_mtp=False: streamed", True)
    if mtp_bytes <= 0:
        if mode == "on":
            raise InvalidArgumentError(
                "pin_mtp=True, but this model has no MTP layer (or mtp=False); use "
                "pin_mtp='auto' or False"
            )
        return PinMtpChoice("auto", False, 0, "no MTP layer (or mtp=False)", False)
    if mode == "on":
        if not fits:
            raise InvalidArgumentError(
                f"pin_mtp=True: the MTP layer's experts take {mtp_bytes} bytes and {room_text}; "
                "lower ram_budget, free memory, or use pin_mtp='auto' (drafting starts "
                "disabled when it does not fit) or False (the MTP layer streamed from disk)"
            )
        return PinMtpChoice("on", True, mtp_bytes, f"pin_mtp=True: fits ({room_text})", True)
    if not drafting:
        return PinMtpChoice(
            "auto", False, mtp_bytes, "drafting is off (draft='off'): not needed", True
        )
    if fits:
        return PinMtpChoice("auto", True, mtp_bytes, f"fits: {room_text}", True)
    return PinMtpChoice(
        "auto",
        False,
        mtp_bytes,
        f"does not fit ({mtp_bytes} bytes; {room_text}): MTP drafting starts disabled "
        "(draft='auto' drafts by prompt lookup); pin_mtp=False streams it instead",
        False,
    )
