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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="colibri",
        description="Run Mixture-of-Experts language models with experts streamed from disk.",
    )
    parser.add_argument("--version", action="version", version=f"colibri {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    p = sub.add_parser("version", help="print version, CPU features and build facts")
    p.set_defaults(func=_cmd_version)
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
