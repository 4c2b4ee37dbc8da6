#!/usr/bin/env python3
"""What the int8 decode arithmetic costs in quality against exact f32 (developer tool).

Opens each trained model twice, ``decode="exact", prefill="exact"`` (the reference) and
``decode="int8"`` (``prefill="auto"`` then follows it: every forward row-invariant int8), and
measures on the held-out code of ``tools/train_tiny.py``'s split, as ``tools/bench_dial.py``
measures the speed dial:

- mean KL(exact || int8) in nats over every position of ``--windows`` windows of ``--seq``
  tokens (the logits of a window are its rows' decode logits: int8 is row-invariant);
- held-out loss (next-token cross-entropy) of both on the same positions;
- top-1 agreement (the argmax of the logits equal);
- tokens to the first greedy divergence over ``--prompts`` held-out prefixes of 32 tokens,
  ``--gen`` greedy tokens each.

    python tools/bench_decode_accuracy.py python/colibri/models/tiny benches/models/glmlike
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import sysconfig
from pathlib import Path
from typing import Any

import colibri
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_dial import _first_divergence, _greedy, _log_softmax, heldout_windows


def _open(path: Path, decode: str) -> colibri.Model:
    prefill = "exact" if decode == "exact" else "auto"
    return colibri.Model(
        path, decode=decode, prefill=prefill, draft="off", prefetch="off", mtp=False
    )


def accuracy(path: Path, args: argparse.Namespace) -> dict[str, Any]:
    """One model's row: int8 decode against exact."""
    exact = _open(path, "exact")
    _, windows, prompts = heldout_windows(exact, args)
    ref = [_log_softmax(exact.logits(w)) for w in windows]
    ref_greedy = _greedy(exact, prompts, args.gen)
    exact.close()
    int8 = _open(path, "int8")
    if not int8.info().get("row_invariant"):
        raise SystemExit(f"error: {path}: decode='int8' is not row-invariant here")
    kls, nll_ref, nll, agree = [], [], [], []
    for w, lp in zip(windows, ref, strict=True):
        t = np.asarray(w[1:])
        lq = _log_softmax(int8.logits(w))
        kls.append(np.sum(np.exp(lp) * (lp - lq), axis=-1))
        nll_ref.append(-lp[np.arange(len(t)), t])
        nll.append(-lq[np.arange(len(t)), t])
        agree.append(lp.argmax(-1) == lq.argmax(-1))
    greedy = _greedy(int8, prompts, args.gen)
    int8.close()
    div = [_first_divergence(a, b) for a, b in zip(ref_greedy, greedy, strict=True)]
    return {
        "model": path.name,
        "kl": float(np.mean(np.concatenate(kls))),
        "loss_exact": float(np.mean(np.concatenate(nll_ref))),
        "loss_int8": float(np.mean(np.concatenate(nll))),
        "top1": float(np.mean(np.concatenate(agree))),
        "divergence": div,
        "gen": args.gen,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("models", type=Path, nargs="+", help="trained colibri containers")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--gen", type=int, default=128, help="greedy tokens per prompt")
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--heldout-pct", type=int, default=2)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args(argv)
    rows = [accuracy(p, args) for p in args.models]
    if args.json:
        print(json.dumps(rows, indent=2))
        return 0
    print(
        "| model | KL(exact ‖ int8) | top-1 agreement | held-out loss exact → int8 | "
        "first greedy divergence (median, min) |"
    )
    print("|---|---|---|---|---|")
    for r in rows:
        d = r["divergence"]
        print(
            f"| {r['model']} | {r['kl']:.2e} | {100 * r['top1']:.1f}% | "
            f"{r['loss_exact']:.4f} → {r['loss_int8']:.4f} | "
            f"{statistics.median(d):.0f}, {min(d)} of {r['gen']} |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
