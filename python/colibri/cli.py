"""The ``colibri`` command line."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from colibri import __version__, build_info


def _cmd_version(_: argparse.Namespace) -> int:
    print(json.dumps(build_info(), indent=2))
    return 0


def _size(text: str) -> int:
    """Parse a byte size such as ``4GiB``, ``500MB`` or ``1048576``."""
    units = {
        "k": 10**3,
        "m": 10**6,
        "g": 10**9,
        "t": 10**12,
        "ki": 2**10,
        "mi": 2**20,
        "gi": 2**30,
        "ti": 2**40,
    }
    t = text.strip().lower().removesuffix("b")
    for suffix in sorted(units, key=len, reverse=True):
        if t.endswith(suffix):
            return int(float(t[: -len(suffix)]) * units[suffix])
    return int(t)


def _cmd_convert(args: argparse.Namespace) -> int:
    from colibri.convert import convert
    from colibri.errors import ColibriError

    try:
        report = convert(
            args.src,
            args.dst,
            expert_bits=args.expert_bits,
            group_size=args.group_size,
            dense_bits=args.dense_bits,
            mtp_bits=args.mtp_bits,
            embed_bits=args.embed_bits,
            lm_head_bits=args.lm_head_bits,
            indexer_bits=args.indexer_bits,
            max_shard_size=_size(args.max_shard_size),
            progress=not args.quiet,
        )
    except ColibriError as e:
        print(f"colibri convert: {type(e).__name__}: {e}", file=sys.stderr)
        return 1
    formats = ", ".join(f"{k}: {v}" for k, v in sorted(report.formats.items()))
    print(
        f"wrote {report.shards_written} shard(s), skipped {report.shards_skipped} already "
        f"complete, into {report.dst} ({formats})"
    )
    return 0


def _add_convert(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint (BF16/F16/F32 or FP8) into a colibri container",
        description="Quantise a DeepSeek-V3 / GLM-MoE-DSA checkpoint into the int4 container "
        "layout (docs/container.md). Bits: 4 (int4), 8 (int8 per row), 16 (bf16), 32 (f32). "
        "Re-running resumes: complete output shards are skipped.",
    )
    p.add_argument("src", help="source model directory (config.json + *.safetensors)")
    p.add_argument("dst", help="output directory (not inside SRC)")
    p.add_argument("--expert-bits", type=int, default=4, help="routed experts (default 4)")
    p.add_argument(
        "--group-size", type=int, default=64, help="int4 group size, 0 for per-row (default 64)"
    )
    p.add_argument(
        "--dense-bits",
        type=int,
        default=4,
        help="attention, shared experts, dense MLPs (default 4)",
    )
    p.add_argument("--mtp-bits", type=int, default=8, help="the whole MTP layer (default 8)")
    p.add_argument("--embed-bits", type=int, default=8, help="embed_tokens (default 8)")
    p.add_argument("--lm-head-bits", type=int, default=8, help="lm_head (default 8)")
    p.add_argument(
        "--indexer-bits", type=int, default=8, help="GLM DSA indexer projections (default 8)"
    )
    p.add_argument(
        "--max-shard-size",
        default="4GiB",
        help="largest output shard, e.g. 4GiB or 500MB (default 4GiB)",
    )
    p.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    p.set_defaults(func=_cmd_convert)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri",
        description="Run Mixture-of-Experts language models with experts streamed from disk.",
    )
    parser.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("version", help="print version, CPU features and build facts")
    p.set_defaults(func=_cmd_version)
    _add_convert(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``colibri`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    if not hasattr(args, "func"):
        parser.print_help()
        return 2
    return int(args.func(args))


if __name__ == "__main__":
    sys.exit(main())
