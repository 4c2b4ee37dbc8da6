#!/usr/bin/env python3
"""The speed dial (``experts_per_token``): what routing each token to fewer experts costs in
quality and buys in bytes and speed (developer tool).

``quality`` opens each trained model at its own top-k (k) and at k-1, k-2 and k/2 (those
in 1..k-1), every one with exact prefill arithmetic (so only the dial differs), and measures
against full top-k on the held-out code of ``tools/train_tiny.py``'s split (the standard
library's files whose path hash puts them in the 2% held out, ``pydoc_data/topics.py``
excluded as ``tools/tiny_eval.py`` does):

- mean KL(full || k') in nats over every position of ``--windows`` evenly spaced windows of
  ``--seq`` tokens;
- held-out loss (cross-entropy of the next token) of full and of k' on the same positions;
- top-1 agreement (the argmax of the logits equal);
- tokens to the first greedy divergence: ``--prompts`` held-out prefixes of 32 tokens,
  ``--gen`` greedy tokens each (no stop), the index of the first token that differs (``--gen``
  when none does);
- routed-expert bytes a token's forward multiplies: k' x MoE layers x one expert's bytes.

``speed`` runs greedy decoding (draft off) on one model for every ``--budgets`` x k' cell,
cold (a fresh engine per run, as ``tools/bench_disk.py`` runs its cells, whose run it
uses), in ``--rounds`` interleaved rounds (odd rounds reversed) and reports each cell's
medians: tok/s, expert MB read from disk per token (decode only), hit rate. A budget of 1 or
more holds every expert (the trained models in RAM). Tokens must be the same in every round
of a cell; the tool checks it. The machine the numbers come from is shared: tok/s is noisy,
the interleaving spreads that noise over the cells.

    python tools/bench_dial.py quality python/colibri/models/tiny benches/models/glmlike
    python tools/bench_dial.py speed python/colibri/models/tiny --budgets 1 --io mmap
    python tools/bench_dial.py speed /work/standin-dial/tiny --budgets 0.1 0.25
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
import numpy.typing as npt

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_disk
from _train_tiny_data import collect_corpus, encode_stream, read_texts

#: The held-out prose file, left out of the code measurement (as tools/tiny_eval.py does).
PROSE = "pydoc_data/topics.py"
#: Greedy prompts are this many held-out tokens.
PROMPT_TOKENS = 32
#: The speed workload: code prompts (as tools/tiny_eval.py's).
SPEED_PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]


def dial_values(k: int) -> list[int]:
    """k-1, k-2 and k/2 (rounded down) where they are in 1..k-1, largest first."""
    return sorted({v for v in (k - 1, k - 2, k // 2) if 1 <= v < k}, reverse=True)


def heldout_code(model: colibri.Model, stdlib: Path, heldout_pct: int) -> npt.NDArray[np.int32]:
    """The held-out code files as one token stream in the model's tokenizer."""
    corpus = collect_corpus(stdlib, heldout_pct)
    code = [p for p in corpus.heldout if p.relative_to(corpus.root).as_posix() != PROSE]
    if not code:
        raise SystemExit(f"error: no held-out files under {stdlib}")
    return encode_stream(model.tokenizer, read_texts(code))


def heldout_windows(
    model: colibri.Model, args: argparse.Namespace
) -> tuple[npt.NDArray[np.int32], list[list[int]], list[list[int]]]:
    """The held-out stream, ``args.windows`` evenly spaced windows of ``args.seq`` tokens
    over it, and ``args.prompts`` greedy prompts of ``PROMPT_TOKENS`` between them."""
    stream = heldout_code(model, args.stdlib, args.heldout_pct)
    span = len(stream) - args.seq
    starts = np.linspace(0, span, args.windows, dtype=np.int64)
    windows = [[int(t) for t in stream[s : s + args.seq]] for s in starts]
    offsets = np.linspace(0, span, args.prompts, endpoint=False, dtype=np.int64) + span // (
        2 * args.prompts
    )
    prompts = [[int(t) for t in stream[s : s + PROMPT_TOKENS]] for s in offsets]
    return stream, windows, prompts


def _log_softmax(x: npt.NDArray[np.float32]) -> npt.NDArray[np.float64]:
    y = x.astype(np.float64)
    m = y.max(axis=-1, keepdims=True)
    return y - m - np.log(np.exp(y - m).sum(axis=-1, keepdims=True))


def _open(path: Path, k: int | None) -> colibri.Model:
    return colibri.Model(
        path, experts_per_token=k, prefill="exact", draft="off", prefetch="off", mtp=False
    )


def _greedy(model: colibri.Model, prompts: list[list[int]], n: int) -> list[list[int]]:
    return [
        model.generate(p, max_new_tokens=n, temperature=0, draft="off", stop_token_ids=[]).token_ids
        for p in prompts
    ]


def _first_divergence(a: list[int], b: list[int]) -> int:
    return next(
        (i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), min(len(a), len(b))
    )


def quality(path: Path, args: argparse.Namespace) -> list[dict[str, Any]]:
    """The quality rows of one model: full top-k and each dial value."""
    full = _open(path, None)
    info = full.info()
    k = int(info["routing"]["num_experts_per_tok"])
    moe_layers = int(info["config"]["num_hidden_layers"]) - int(
        info["config"]["first_k_dense_replace"]
    )
    expert = bench_disk._expert_bytes(full.path, full.config)
    stream, windows, prompts = heldout_windows(full, args)
    print(
        f"{path}: k = {k}, {moe_layers} MoE layers, expert {expert} B; held-out code "
        f"{len(stream)} tokens, {args.windows} windows x {args.seq}, {args.prompts} prompts",
        file=sys.stderr,
    )
    ref = [_log_softmax(full.logits(w)) for w in windows]
    ref_greedy = _greedy(full, prompts, args.gen)
    full.close()
    targets = [np.asarray(w[1:]) for w in windows]
    ref_loss = float(
        np.mean(
            np.concatenate([-lp[np.arange(len(t)), t] for lp, t in zip(ref, targets, strict=True)])
        )
    )
    rows = [
        {
            "model": path.name,
            "k": k,
            "experts_per_token": k,
            "kl": 0.0,
            "loss": ref_loss,
            "ref_loss": ref_loss,
            "top1": 1.0,
            "divergence": [args.gen] * len(prompts),
            "expert_bytes_per_token": k * moe_layers * expert,
        }
    ]
    for kp in dial_values(k):
        m = _open(path, kp)
        kls, nll, agree = [], [], []
        for w, lp, t in zip(windows, ref, targets, strict=True):
            lq = _log_softmax(m.logits(w))
            kls.append(np.sum(np.exp(lp) * (lp - lq), axis=-1))
            nll.append(-lq[np.arange(len(t)), t])
            agree.append(lp.argmax(-1) == lq.argmax(-1))
        greedy = _greedy(m, prompts, args.gen)
        m.close()
        rows.append(
            {
                "model": path.name,
                "k": k,
                "experts_per_token": kp,
                "kl": float(np.mean(np.concatenate(kls))),
                "loss": float(np.mean(np.concatenate(nll))),
                "ref_loss": ref_loss,
                "top1": float(np.mean(np.concatenate(agree))),
                "divergence": [
                    _first_divergence(a, b) for a, b in zip(ref_greedy, greedy, strict=True)
                ],
                "expert_bytes_per_token": kp * moe_layers * expert,
            }
        )
        print(f"  k' = {kp}: KL {rows[-1]['kl']:.4f}", file=sys.stderr)
    return rows


def _print_quality(rows: list[dict[str, Any]], gen: int) -> None:
    print(
        "\n| model | experts/token | mean KL vs full (nats) | held-out loss (full → k') "
        f"| top-1 agreement | tokens to first greedy divergence (median, min; of {gen}) "
        "| routed-expert kB/token |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        d = r["divergence"]
        never = sum(x >= gen for x in d)
        print(
            f"| {r['model']} | {r['experts_per_token']} of {r['k']} | {r['kl']:.4f} | "
            f"{r['ref_loss']:.4f} → {r['loss']:.4f} ({r['loss'] - r['ref_loss']:+.4f}) | "
            f"{r['top1']:.3f} | {statistics.median(d):.0f}, {min(d)}"
            f"{f' ({never} of {len(d)} never)' if never else ''} | "
            f"{r['expert_bytes_per_token'] / 1e3:.1f} |"
        )


def speed(args: argparse.Namespace) -> None:
    """Interleaved cold runs of every budget x k' cell on ``args.model``."""
    model = args.model
    cfg = json.loads((model / "config.json").read_text())
    k = int(cfg["num_experts_per_tok"])
    ks = [k, *dial_values(k)] if args.ks is None else args.ks
    tok = colibri.Model(model, draft="off", prefetch="off").tokenizer
    ids = [i for p in SPEED_PROMPTS for i in tok.encode(p).ids]
    expert = bench_disk._expert_bytes(model, cfg)
    main_layers = cfg["num_hidden_layers"] - cfg.get("first_k_dense_replace", 0)
    total = expert * cfg["n_routed_experts"] * main_layers
    usage = bench_disk.UsageFile(Path("unused"), Path("unused"))
    cells = [
        {
            "budget": b,
            "draft": "off",
            "prefetch": args.prefetch,
            "pins": "off",
            "experts_per_token": kp,
        }
        for b in args.budgets
        for kp in ks
    ]
    print(
        f"{model}: k = {k}; {main_layers} MoE layers x {cfg['n_routed_experts']} experts x "
        f"{expert / 1e6:.2f} MB = {total / 1e9:.2f} GB; io {args.io}; prompt {len(ids)} tokens, "
        f"{args.tokens} new; {args.rounds} rounds",
        file=sys.stderr,
    )
    runs: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(cells))}
    for r in range(args.rounds):
        order = list(enumerate(cells))
        for i, cell in order if r % 2 == 0 else reversed(order):
            budget = int(cell["budget"] * total) if cell["budget"] < 1 else 4 * total
            res = bench_disk.run_cell(model, ids, cell, args, budget, [], usage)
            if runs[i] and res["tokens"] != runs[i][0]["tokens"]:
                raise SystemExit(f"error: cell {cell} generated different tokens in round {r}")
            runs[i].append(res)
            print(f"  round {r + 1} {cell}: {res['tok_s']:.2f} tok/s", file=sys.stderr)
    _print_speed(cells, runs, k)


def _print_speed(
    cells: list[dict[str, Any]], runs: dict[int, list[dict[str, Any]]], k: int
) -> None:
    print(
        "\n| budget | experts/token | tok/s (median) | x full | tok/s per round "
        "| MB read/token | hit rate |"
    )
    print("|---|---|---|---|---|---|---|")
    full: dict[float, float] = {}
    for i, cell in enumerate(cells):
        rs = runs[i]
        tok_s = statistics.median(x["tok_s"] for x in rs)
        if cell["experts_per_token"] == k:
            full[cell["budget"]] = tok_s
        base = full.get(cell["budget"])
        budget = "all (RAM)" if cell["budget"] >= 1 else f"{cell['budget']:.0%}"
        rounds = ", ".join(f"{x['tok_s']:.1f}" for x in rs)
        print(
            f"| {budget} | {cell['experts_per_token']} of {k} | {tok_s:.2f} | "
            f"{bench_disk.fmt(tok_s / base if base else None)} | {rounds} | "
            f"{statistics.median(x['mb_per_token'] for x in rs):.2f} | "
            f"{statistics.median(x['hit_rate'] for x in rs):.2f} |"
        )


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    q = sub.add_parser("quality", help="quality cost against full top-k on held-out code")
    q.add_argument("models", type=Path, nargs="+", help="trained colibri containers")
    q.add_argument("--windows", type=int, default=32)
    q.add_argument("--seq", type=int, default=256)
    q.add_argument("--prompts", type=int, default=8)
    q.add_argument("--gen", type=int, default=128, help="greedy tokens per prompt")
    q.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    q.add_argument("--heldout-pct", type=int, default=2)
    s = sub.add_parser("speed", help="tok/s and bytes per token, interleaved cold runs")
    s.add_argument("model", type=Path, help="a container or a stand-in (tools/make_standin.py)")
    s.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0.10, 0.25],
        help="RAM budgets as shares of the main layers' routed-expert bytes (>= 1: all)",
    )
    s.add_argument("--ks", type=int, nargs="+", default=None, help="default: k, k-1, k-2, k/2")
    s.add_argument("--rounds", type=int, default=3)
    s.add_argument("--tokens", type=int, default=64)
    s.add_argument("--io", default="direct", choices=["direct", "pread", "mmap"])
    s.add_argument("--prefetch", default="auto", choices=["auto", "off", "hint", "real"])
    s.add_argument("--threads", type=int, default=0)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = _parser().parse_args(argv)
    if args.command == "quality":
        rows = [r for m in args.models for r in quality(m, args)]
        _print_quality(rows, args.gen)
    else:
        speed(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
