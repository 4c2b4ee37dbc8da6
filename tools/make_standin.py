#!/usr/bin/env python3
"""Build a disk-scale stand-in of a trained colibri container (developer tool).

The routed experts of a small trained model are a few kilobytes each, so every run of it is
compute-bound: the page cache and the expert LRU hold everything. A *stand-in* keeps the
model's function and routing and makes every expert as large as a real one, by zero-padding
the intermediate dimension of every routed and shared expert:

* ``gate_proj`` / ``up_proj`` [I, H] get ``I' - I`` extra rows whose weights are exactly 0,
  so their activations are ``silu(0) * 0 = 0``;
* ``down_proj`` [H, I] gets ``I' - I`` extra columns of exact zeros.

Every added weight is a stored zero (int4 nibble 8, int8 0, with the quantiser's floor scale
1e-8), so the stand-in computes the same logits as the original; ``tests/test_standin.py``
checks logits and greedy tokens. ``moe_intermediate_size`` is one config value, so the MTP
layer's experts and the shared experts grow too (the shared experts stay resident; the MTP
layer's routed experts are streamed unless the engine pins them, see docs/benchmarks.md).
By default (``--mtp keep``) the MTP layer keeps its trained expert size instead, recorded
as ``colibri_mtp_moe_intermediate_size`` in config.json (a key only stand-ins carry): in a
shallow model an inflated MTP layer would make a draft step cost a large share of a token,
which no real model does (GLM-5.2's is one layer of 79).

The target is the size of one routed expert of the main layers, default GLM-5.2's
21,233,664 bytes at int4-gs64 (3 x 2048 x 6144 weights); ``I'`` is the smallest multiple
of 64 (so int4 groups stay aligned) whose expert reaches it. Output shards hold one layer
each, every expert's tensors back to back, as ``colibri convert`` writes them. The source is
read-only; nothing but the container files is written.

    python tools/make_standin.py python/colibri/models/tiny /work/standin/tiny
    python tools/make_standin.py /work/glmlike/container /work/standin/glmlike
    python tools/make_standin.py SRC DST --intermediate 1024    # small, for tests
    python tools/make_standin.py benches/models/glmlike DST --intermediate 8192 \
        --shared-experts 3                  # dense : routed bytes per token 48 : 52

``--shared-experts N`` pads the shared experts to ``N`` times a routed one (zeros again, and
``n_shared_experts`` = N in config.json, which only sets their width), so that a token's
bytes split between the resident part and the routed experts as in a real model (GLM-5.2:
about 45 : 55); the MTP layer's shared expert grows with it, its routed ones keep their size.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import struct
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

#: GLM-5.2's routed expert at int4-gs64: 3 x 2048 x 6144 weights, 4-byte scales per 64.
GLM52_EXPERT_BYTES = 21_233_664
#: Smallest scale the converter's quantiser writes (docs/container.md).
FLOOR_SCALE = np.float32(1e-8)
#: Stored zeros: an int4 byte of two nibbles 8 (q = 0) and an int8 0.
ZERO_INT4 = 0x88
ZERO_INT8 = 0
#: Files that are the model's, copied as they are (never our own sidecars or other weights).
SIDECARS = (
    "tokenizer.json",
    "tokenizer_config.json",
    "generation_config.json",
    "special_tokens_map.json",
    "chat_template.jinja",
    "vocab.json",
    "merges.txt",
)
EXPERT_RE = re.compile(
    r"^model\.layers\.(\d+)\.mlp\.(?:experts\.\d+|shared_experts)\.(gate|up|down)_proj\.weight$"
)
LAYER_RE = re.compile(r"^model\.layers\.(\d+)\.")


@dataclass
class Tensor:
    """One stored tensor of the source container."""

    name: str
    dtype: str
    shape: list[int]
    shard: Path
    start: int
    end: int
    fmt: str | None


def read_header(path: Path) -> tuple[int, dict]:
    """The safetensors header of ``path`` and the offset its data starts at."""
    with path.open("rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        return 8 + n, json.loads(f.read(n))


def list_tensors(src: Path) -> list[Tensor]:
    """Every tensor of the container at ``src``, in file order."""
    out: list[Tensor] = []
    for shard in sorted(src.glob("*.safetensors")):
        base, header = read_header(shard)
        meta = header.pop("__metadata__", {}) or {}
        for name, info in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
            a, b = info["data_offsets"]
            out.append(
                Tensor(
                    name, info["dtype"], info["shape"], shard, base + a, base + b, meta.get(name)
                )
            )
    return out


def expert_bytes(fmt: str, hidden: int, inter: int) -> int:
    """Stored bytes of one expert (gate, up, down and their scales) at intermediate ``inter``."""
    if fmt == "int8":
        return 3 * hidden * inter + 4 * (2 * inter + hidden)
    m = re.fullmatch(r"int4_g(\d+)", fmt)
    if not m:
        raise SystemExit(f"error: expert format {fmt!r} is not supported (int4_gN or int8)")
    gs = int(m.group(1))
    packed = 2 * inter * ((hidden + 1) // 2) + hidden * ((inter + 1) // 2)
    scales = 2 * inter * -(-hidden // gs) + hidden * -(-inter // gs)
    return packed + 4 * scales


def pad_weight(
    data: np.ndarray,
    scales: np.ndarray,
    fmt: str,
    proj: str,
    hidden: int,
    inter: int,
    new_inter: int,
) -> tuple[np.ndarray, np.ndarray]:
    """The packed bytes and scales of one projection with the intermediate dimension padded."""
    add = new_inter - inter
    if fmt == "int8":
        zero_byte, per_group = ZERO_INT8, None
    else:
        zero_byte, per_group = ZERO_INT4, int(fmt.split("_g")[1])
    if proj in ("gate", "up"):  # [I, H]: append rows
        row_bytes = data.size // inter
        row_scales = scales.size // inter
        pad_d = np.full(add * row_bytes, zero_byte, dtype=np.uint8)
        pad_s = np.full(add * row_scales, FLOOR_SCALE, dtype=np.float32)
        return np.concatenate([data, pad_d]), np.concatenate([scales, pad_s])
    # down [H, I]: append columns to every row
    if fmt == "int8":
        rows = data.reshape(hidden, inter)
        pad = np.full((hidden, add), zero_byte, dtype=np.uint8)
        return np.concatenate([rows, pad], axis=1).reshape(-1), scales
    assert per_group is not None
    if inter % 2 or inter % per_group or add % per_group:
        raise SystemExit(
            f"error: moe_intermediate_size {inter} and the padding must be multiples of the "
            f"group size {per_group}"
        )
    rows = data.reshape(hidden, inter // 2)
    pad = np.full((hidden, add // 2), zero_byte, dtype=np.uint8)
    srows = scales.reshape(hidden, inter // per_group)
    spad = np.full((hidden, add // per_group), FLOOR_SCALE, dtype=np.float32)
    return (
        np.concatenate([rows, pad], axis=1).reshape(-1),
        np.concatenate([srows, spad], axis=1).reshape(-1),
    )


def load(t: Tensor) -> np.ndarray:
    """The raw bytes of tensor ``t``."""
    with t.shard.open("rb") as f:
        f.seek(t.start)
        return np.frombuffer(f.read(t.end - t.start), dtype=np.uint8)


def padded_size(t: Tensor, fmt: str, proj: str, scales: bool, old: int, new: int) -> int:
    """Bytes of a projection's data (or scales) once its intermediate dimension is padded."""
    size = t.end - t.start
    if scales and proj == "down" and fmt == "int8":
        return size  # one scale per row of down, and its rows are the hidden dimension
    return size * new // old  # every other count is proportional to the intermediate size


def write_shard(
    path: Path, items: list[tuple[str, str, list[int], int, object]], meta: dict[str, str]
) -> None:
    """Write one safetensors shard atomically: the header first (from the known sizes), then
    each tensor as ``produce()`` makes it, so a layer never has to fit in memory."""
    header: dict[str, object] = {"__metadata__": meta}
    off = 0
    for name, dtype, shape, size, _ in items:
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [off, off + size]}
        off += size
    blob = json.dumps(header, separators=(",", ":")).encode()
    blob += b" " * (-len(blob) % 8)
    tmp = path.with_suffix(".tmp")
    with tmp.open("wb") as f:
        f.write(struct.pack("<Q", len(blob)))
        f.write(blob)
        for name, _, _, size, produce in items:
            raw = produce()  # type: ignore[operator]
            if raw.size != size:
                raise AssertionError(f"{name}: produced {raw.size} bytes, expected {size}")
            f.write(raw.tobytes())
    tmp.replace(path)


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("src", type=Path, help="a colibri container (e.g. the shipped tiny model)")
    ap.add_argument("dst", type=Path, help="output directory (created; must not exist)")
    ap.add_argument(
        "--expert-bytes",
        type=int,
        default=GLM52_EXPERT_BYTES,
        help="target bytes of one main-layer routed expert (default GLM-5.2's)",
    )
    ap.add_argument(
        "--intermediate",
        type=int,
        default=0,
        help="padded moe_intermediate_size (overrides --expert-bytes)",
    )
    ap.add_argument(
        "--mtp",
        choices=["keep", "pad"],
        default="keep",
        help="keep: the MTP layer's experts stay at their trained size (recorded as "
        "colibri_mtp_moe_intermediate_size), so a draft step costs about what one layer of "
        "GLM-5's 79 costs (the proportional stand-in); pad: inflate them like the main "
        "layers' (moe_intermediate_size is one config value; each draft step then costs "
        "one layer of this shallow model: the naive stand-in)",
    )
    ap.add_argument(
        "--shared-experts",
        type=int,
        default=0,
        help="pad the shared experts to N routed experts' width (n_shared_experts = N; "
        "default: the source's count)",
    )
    ap.add_argument("-q", "--quiet", action="store_true")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = _parser().parse_args(argv)

    cfg = json.loads((args.src / "config.json").read_text())
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    tensors = list_tensors(args.src)
    probe_fmt, new_inter = _padded_intermediate(args, cfg, tensors)
    if args.shared_experts < 0 or (args.shared_experts and not cfg.get("n_shared_experts")):
        raise SystemExit(
            "error: --shared-experts needs a positive count and a model with shared experts"
        )
    if args.dst.exists():
        raise SystemExit(f"error: {args.dst} exists; choose a new directory")
    args.dst.mkdir(parents=True)

    total = _write_shards(args, cfg, tensors, new_inter)
    if args.mtp == "keep" and cfg.get("num_nextn_predict_layers", 0):
        cfg["colibri_mtp_moe_intermediate_size"] = cfg.get(
            "colibri_mtp_moe_intermediate_size", inter
        )
    cfg["moe_intermediate_size"] = new_inter
    if args.shared_experts:
        cfg["n_shared_experts"] = args.shared_experts
    (args.dst / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")
    for name in SIDECARS:
        if (args.src / name).exists():
            shutil.copy2(args.src / name, args.dst / name)
    per_expert = expert_bytes(probe_fmt, hidden, new_inter)
    print(
        json.dumps(
            {
                "moe_intermediate_size": new_inter,
                "expert_bytes": per_expert,
                "total_bytes": total,
                "dst": str(args.dst),
            }
        )
    )
    return 0


def _padded_intermediate(
    args: argparse.Namespace, cfg: dict[str, Any], tensors: list[Tensor]
) -> tuple[str, int]:
    """The format of a main layer's routed expert and the padded ``moe_intermediate_size``:
    ``--intermediate``, else the smallest multiple-of-64 step that reaches
    ``--expert-bytes``."""
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    main_layers = cfg["num_hidden_layers"]
    probe = next(
        (
            t
            for t in tensors
            if ".mlp.experts." in t.name
            and t.fmt
            and LAYER_RE.match(t.name)
            and int(LAYER_RE.match(t.name).group(1))  # type: ignore[union-attr]
            < main_layers
        ),
        None,
    )
    if probe is None or probe.fmt is None:
        raise SystemExit("error: no routed expert with colibri format metadata in the source")
    if args.intermediate:
        new_inter = args.intermediate
    else:
        new_inter = inter
        while expert_bytes(probe.fmt, hidden, new_inter) < args.expert_bytes:
            new_inter += 64
    if new_inter < inter or new_inter % 64:
        raise SystemExit(
            f"error: the padded intermediate {new_inter} must be a multiple of 64 "
            f"and at least {inter}"
        )
    return probe.fmt, new_inter


def _write_shards(
    args: argparse.Namespace, cfg: dict[str, Any], tensors: list[Tensor], new_inter: int
) -> int:
    """Write the stand-in's shards under ``args.dst``: one per layer (and one for the rest),
    each expert's tensors back to back. Returns their total bytes."""
    by_name = {t.name: t for t in tensors}
    groups: dict[str, list[Tensor]] = {}
    for t in tensors:
        if t.name.endswith(".qs"):
            continue
        m = LAYER_RE.match(t.name)
        groups.setdefault(f"layer{int(m.group(1)):03d}" if m else "other", []).append(t)
    total = 0
    names = sorted(groups)
    for k, key in enumerate(names):
        items, meta = _shard_items(
            groups[key], by_name, cfg, args.mtp, new_inter, args.shared_experts
        )
        path = args.dst / f"model-{k + 1:05d}-of-{len(names):05d}.safetensors"
        write_shard(path, items, meta)
        total += path.stat().st_size
        if not args.quiet:
            print(f"{path.name}: {path.stat().st_size / 1e9:.2f} GB", file=sys.stderr)
    return total


def _shard_items(
    group: list[Tensor],
    by_name: dict[str, Tensor],
    cfg: dict[str, Any],
    mtp: str,
    new_inter: int,
    shared_experts: int = 0,
) -> tuple[list[tuple[str, str, list[int], int, object]], dict[str, str]]:
    """The tensors of one output shard, as :func:`write_shard` takes them (the experts'
    padded to ``new_inter``, the shared ones to ``shared_experts`` times it when given, the
    rest copied; each with its ``.qs`` scales), and the shard's metadata."""
    hidden, inter = cfg["hidden_size"], cfg["moe_intermediate_size"]
    main_layers = cfg["num_hidden_layers"]
    shared_old = cfg.get("n_shared_experts", 1)
    shared_new = shared_experts or shared_old
    items: list[tuple[str, str, list[int], int, object]] = []
    meta: dict[str, str] = {"colibri_format_version": "1"}
    for t in group:
        qs = by_name.get(t.name + ".qs")
        m = EXPERT_RE.match(t.name)
        if t.fmt:
            meta[t.name] = t.fmt
        mtp_layer = m is not None and int(m.group(1)) >= main_layers
        shared = ".shared_experts." in t.name
        # (old, new) intermediate width of this projection.
        width = (inter * shared_old, new_inter * shared_new) if shared else (inter, new_inter)
        if m and mtp_layer and mtp == "keep":
            if shared and shared_new != shared_old:
                # n_shared_experts is one config value: the MTP layer's shared expert grows
                # to its count at the layer's kept width.
                width = (inter * shared_old, inter * shared_new)
            else:
                m = None  # copied as it is, below
        if m and qs is not None and t.fmt:
            proj, fmt = m.group(2), t.fmt
            padded: dict[str, tuple[np.ndarray, np.ndarray]] = {}

            def weight(t=t, qs=qs, proj=proj, fmt=fmt, width=width, padded=padded):
                padded["w"] = pad_weight(
                    load(t), load(qs).view(np.float32), fmt, proj, hidden, *width
                )
                return padded["w"][0]

            def scales(padded=padded):
                return padded.pop("w")[1].view(np.uint8)

            n_w = padded_size(t, fmt, proj, False, *width)
            n_s = padded_size(qs, fmt, proj, True, *width)
            items.append((t.name, t.dtype, [n_w], n_w, weight))
            items.append((qs.name, qs.dtype, [n_s // 4], n_s, scales))
        elif m:
            raise SystemExit(f"error: {t.name} is not a quantised colibri weight")
        else:
            items.append((t.name, t.dtype, t.shape, t.end - t.start, lambda t=t: load(t)))
            if qs is not None:
                items.append(
                    (qs.name, qs.dtype, qs.shape, qs.end - qs.start, lambda qs=qs: load(qs))
                )
    return items, meta


if __name__ == "__main__":
    raise SystemExit(main())
