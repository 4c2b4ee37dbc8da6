"""``colibri plan``: predict decode speed and expert hit rate for a model on this machine, and
the :class:`colibri.Model` keywords that do best.

The prediction replays a routing workload calibrated to GLM-5.2's published routing (or the
model's own routing history, when its container has one) through the expert store's cache
policy, with this host's disk and kernel speeds measured briefly unless given. See
docs/cli.md ("colibri plan") and docs/expert-store.md ("The routing workload").
"""

from __future__ import annotations

import json
import os
from typing import Any

from colibri._core import plan_model
from colibri.errors import InvalidArgumentError
from colibri.validation import parse_size

__all__ = ["parse_rate", "plan"]


def parse_rate(name: str, text: str | float) -> float:
    """A rate in bytes per second: a number, or a size per second such as ``"3.2GB/s"``."""
    if isinstance(text, (int, float)):
        value = float(text)
    else:
        t = text.strip()
        t = t[:-2] if t.lower().endswith("/s") else t
        try:
            value = float(parse_size(name, t))
        except InvalidArgumentError:
            value = float("nan")
    if not value > 0 or value == float("inf"):
        raise InvalidArgumentError(
            f"invalid value for '{name}': {text!r}; must be a positive rate, e.g. '3.2GB/s'"
        )
    return value


def plan(
    model: str | os.PathLike[str],
    ram: int | str,
    *,
    disk_bw: float | str | None = None,
    compute: float | str | None = None,
    cache_dir: str | os.PathLike[str] | None = None,
    reserve: int | str = "4GiB",
    seed: int = 1,
    probe_seconds: float = 2.0,
) -> dict[str, Any]:
    """Plan ``model`` (a container directory, or ``"glm-5.2"`` / ``"deepseek-v3"``) for
    ``ram`` bytes of RAM (an int or a size such as ``"128GB"``).

    ``disk_bw`` (bytes/s or e.g. ``"3.2GB/s"``) skips the disk probe; ``compute`` (weight
    bytes the int4 expert kernels process per second) skips the kernel probe. Returns the
    report: ``predicted_tokens_per_second``, ``hit_rate``, ``bytes_per_token`` (expert bytes
    read from disk per token), ``recommended`` (Model keywords), the same figures with the
    defaults, the probes, and every setting replayed.
    """
    ram_bytes = parse_size("ram", ram) if isinstance(ram, str) else int(ram)
    reserve_bytes = parse_size("reserve", reserve) if isinstance(reserve, str) else int(reserve)
    if ram_bytes <= 0:
        raise InvalidArgumentError(
            f"invalid value for 'ram': {ram!r}; give the machine's RAM, e.g. '128GB'"
        )
    out = plan_model(
        os.fspath(model),
        ram_bytes,
        None if disk_bw is None else parse_rate("disk_bw", disk_bw),
        None if compute is None else parse_rate("compute", compute),
        None if cache_dir is None else os.fspath(cache_dir),
        None,
        reserve_bytes,
        seed,
        probe_seconds,
    )
    result: dict[str, Any] = json.loads(out)
    return result
