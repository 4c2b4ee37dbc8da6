#!/usr/bin/env python3
"""Paired A/B of two sets of ``colibri.Model`` options, in one process.

Decode speed on the shared 2-vCPU hosts drifts by ±15% between processes and minutes, more
than most changes worth measuring. Here both variants run in the same process, in
alternation, and the statistic is the paired difference of each round. Two precautions,
both measured (docs/benchmarks.md, "Measuring small decode changes in one process"):

- a sacrificial model is loaded and run first and never measured. The first model a
  process loads decoded 3-8% slower than the later ones in an A/A test (the same options
  twice: the second was +7.7% ± 2.4%);
- the measured models are loaded in the order A, B, B, A, and each round runs them forward
  or backward in turn, so neither load slot nor position in a round favours a variant.

The standard error is that of the rounds within this process. It does not include the
persistent difference between two model instances of one variant (their memory lies on
different physical pages; slot medians of one variant differed by up to 7%), so a result
is worth believing when it holds in several processes: ``--processes N`` runs the whole
A/B in N fresh processes and reports the standard error across them.

Every model is warmed up with one generation before the rounds. A model's routed experts are
copied into its own cache, so each model holds its own copy: memory is about four times a
single model's.

    python tools/ab_inprocess.py MODEL '{}' '{"prefetch": "off"}' --gen 64 --rounds 12 \
        --max-context 4096

The options are JSON objects of ``colibri.Model`` keywords (``threads=2`` and
``draft="off"`` unless given; ``--max-context`` sets every model's). The script prints one
line per round, the median of each load slot, and the paired difference of B against A
(mean ± standard error, how many rounds B was faster). With ``--json`` the summary is one
JSON object on the last line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from typing import Any


def parse_options(text: str) -> dict[str, Any]:
    """One variant's ``colibri.Model`` keywords from JSON text."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise SystemExit(
            f'options must be a JSON object, e.g. \'{{"prefetch": "off"}}\': {e}'
        ) from None
    if not isinstance(value, dict):
        raise SystemExit(f"options must be a JSON object, not {type(value).__name__}")
    return value


def paired(a: list[float], b: list[float]) -> dict[str, float]:
    """B against A per round, (b - a) / a: mean, standard error, rounds B was faster."""
    d = [(y - x) / x for x, y in zip(a, b, strict=True)]
    se = statistics.stdev(d) / len(d) ** 0.5 if len(d) > 1 else float("nan")
    return {
        "mean": statistics.mean(d),
        "se": se,
        "b_faster": sum(v > 0 for v in d),
        "rounds": len(d),
        "a_median": statistics.median(a),
        "b_median": statistics.median(b),
    }


def across_processes(args: argparse.Namespace) -> dict[str, Any]:
    """Run the one-process A/B in ``args.processes`` fresh processes and summarise: each
    process's paired mean, and their mean with the standard error across processes (which,
    unlike one process's, includes where each process's models landed in memory)."""
    import subprocess

    cmd = [sys.executable, __file__, args.model, json.dumps(args.a), json.dumps(args.b)]
    cmd += ["--gen", str(args.gen), "--rounds", str(args.rounds), "--prompt", str(args.prompt)]
    if args.max_context is not None:
        cmd += ["--max-context", str(args.max_context)]
    runs: list[dict[str, Any]] = []
    for i in range(args.processes):
        done = subprocess.run([*cmd, "--json"], capture_output=True, text=True)
        if done.returncode != 0:
            raise SystemExit(f"process {i + 1} failed ({done.returncode}):\n{done.stderr[-2000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        p = runs[-1]["b_vs_a"]
        print(
            f"process {i + 1}: B vs A {100 * p['mean']:+.1f}% ± {100 * p['se']:.1f}%",
            flush=True,
        )
    means = [r["b_vs_a"]["mean"] for r in runs]
    summary: dict[str, Any] = {
        "processes": runs,
        "mean": statistics.mean(means),
        "se": statistics.stdev(means) / len(means) ** 0.5,
        "same_tokens": all(r["same_tokens"] for r in runs),
    }
    print(
        f"B vs A over {len(runs)} processes: {100 * summary['mean']:+.1f}% ± "
        f"{100 * summary['se']:.1f}% (mean ± standard error across processes); "
        f"same tokens: {summary['same_tokens']}"
    )
    if args.json:
        print(json.dumps(summary))
    return summary


def main(argv: list[str] | None = None) -> dict[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", help="model directory")
    ap.add_argument("a", type=parse_options, help="variant A's Model options (JSON)")
    ap.add_argument("b", type=parse_options, help="variant B's Model options (JSON)")
    ap.add_argument("--gen", type=int, default=64, help="tokens per generation (default 64)")
    ap.add_argument("--rounds", type=int, default=12, help="rounds (default 12)")
    ap.add_argument("--prompt", type=int, default=8, help="prompt tokens (default 8)")
    ap.add_argument(
        "--max-context",
        type=int,
        default=None,
        help="each model's max_context (default: the model's own); bounds the KV memory",
    )
    ap.add_argument(
        "--processes",
        type=int,
        default=1,
        help="repeat the whole A/B in this many fresh processes, one after the other, and "
        "summarise across them (default 1)",
    )
    ap.add_argument("--json", action="store_true", help="print the summary as JSON")
    args = ap.parse_args(argv)
    if args.rounds < 2 or args.gen < 2:
        raise SystemExit("--rounds and --gen must be at least 2")
    if args.processes < 1:
        raise SystemExit("--processes must be at least 1")
    if args.processes > 1:
        return across_processes(args)

    import colibri

    def load(options: dict[str, Any]) -> colibri.Model:
        kw: dict[str, Any] = {"threads": 2, "draft": "off", "max_context": args.max_context}
        kw.update(options)
        return colibri.Model(args.model, **kw)

    gen_kw: dict[str, Any] = {"temperature": 0, "stop_token_ids": []}
    sacrificial = load({})
    vocab = int(sacrificial.config["vocab_size"])
    ids = [(1234 * 7 + i * 7919) % vocab for i in range(args.prompt)]
    sacrificial.session().generate(ids, max_new_tokens=args.gen, **gen_kw)
    slots = [("A", args.a), ("B", args.b), ("B", args.b), ("A", args.a)]
    models = []
    for _, options in slots:
        m = load(options)
        m.session().generate(ids, max_new_tokens=args.gen, **gen_kw)
        models.append(m)
    speeds: list[list[float]] = [[] for _ in slots]
    tokens: list[list[int]] = [[] for _ in slots]
    for r in range(args.rounds):
        order = range(len(slots)) if r % 2 == 0 else reversed(range(len(slots)))
        for i in order:
            out = models[i].session().generate(ids, max_new_tokens=args.gen, **gen_kw)
            speeds[i].append(out.stats.tokens_per_second)
            tokens[i] = list(out.token_ids)
        print(r, [round(s[-1], 1) for s in speeds], flush=True)
    a = [(x + y) / 2 for x, y in zip(speeds[0], speeds[3], strict=True)]
    b = [(x + y) / 2 for x, y in zip(speeds[1], speeds[2], strict=True)]
    summary: dict[str, Any] = {
        "slot_medians": {
            f"{n}{i}": statistics.median(s)
            for i, ((n, _), s) in enumerate(zip(slots, speeds, strict=True))
        },
        "b_vs_a": paired(a, b),
        "same_tokens": tokens[0] == tokens[1] == tokens[2] == tokens[3],
    }
    p = summary["b_vs_a"]
    print(
        "tok/s medians by load slot:", {k: round(v, 1) for k, v in summary["slot_medians"].items()}
    )
    print(
        f"B vs A: {100 * p['mean']:+.1f}% ± {100 * p['se']:.1f}% (mean ± standard error), "
        f"B faster in {p['b_faster']}/{p['rounds']} rounds; medians A {p['a_median']:.1f}, "
        f"B {p['b_median']:.1f} tok/s; same tokens: {summary['same_tokens']}"
    )
    if args.json:
        print(json.dumps(summary))
    return summary


if __name__ == "__main__":
    main(sys.argv[1:])
