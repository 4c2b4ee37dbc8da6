#!/usr/bin/env python3
"""Paired A/B of two builds of colibri (two Python environments), process by process.

Each round runs one fresh process of each build, in alternating order (A B, B A, ...), and
each process loads the model, warms up, then times a prefill of ``--prompt`` tokens and a
greedy decode of ``--gen`` tokens (``draft="off"`` and the default drafter) from the
engine's own stats. The statistic is the paired ratio B / A of each round, so a drift of
the machine's speed between rounds cancels.

    python tools/ab_builds.py --a /tmp/old/bin/python --b .venv/bin/python \\
        --model python/colibri/models/tiny --rounds 6

``--one`` is the measuring process itself (what each round runs); it prints one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from typing import Any


def measure(model: str, prompt: int, gen: int, threads: int) -> dict[str, float]:
    """Prefill and decode rates of one process (tokens per second)."""
    import colibri

    m = colibri.Model(model, threads=threads)
    ids = [(7 * i) % 200 + 3 for i in range(prompt)]
    common: dict[str, Any] = {"temperature": 0, "stop_token_ids": []}
    m.generate(ids[:64], max_new_tokens=8, **common)  # warm-up: pages, pools, caches
    out: dict[str, float] = {}
    for draft in ("off", "auto"):
        s = m.session()
        r = s.generate(ids, max_new_tokens=gen, draft=draft, **common)
        st = r.stats
        out[f"decode_{draft}_tok_s"] = st.generated_tokens / max(st.decode_seconds, 1e-9)
        if draft == "off":
            out["prefill_tok_s"] = st.prompt_tokens / max(st.prefill_seconds, 1e-9)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--a", help="the Python of build A")
    p.add_argument("--b", help="the Python of build B")
    p.add_argument("--model", default=None, help="a model directory (default: the embedded)")
    p.add_argument("--prompt", type=int, default=512, help="prompt tokens (default 512)")
    p.add_argument("--gen", type=int, default=64, help="decoded tokens (default 64)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--one", action="store_true", help="measure in this process, print JSON")
    a = p.parse_args()
    if a.one:
        print(json.dumps(measure(a.model, a.prompt, a.gen, a.threads)))
        return 0
    if not (a.a and a.b):
        p.error("give --a and --b (or --one)")
    cmd = [__file__, "--one", "--prompt", str(a.prompt), "--gen", str(a.gen)]
    cmd += ["--threads", str(a.threads)] + (["--model", a.model] if a.model else [])
    rows: list[tuple[dict[str, float], dict[str, float]]] = []
    for r in range(a.rounds):
        order = [("A", a.a), ("B", a.b)] if r % 2 == 0 else [("B", a.b), ("A", a.a)]
        got: dict[str, dict[str, float]] = {}
        for name, python in order:
            done = subprocess.run([python, *cmd], capture_output=True, text=True, check=True)
            got[name] = json.loads(done.stdout.strip().splitlines()[-1])
        rows.append((got["A"], got["B"]))
        print(f"round {r}: A {got['A']}  B {got['B']}", flush=True)
    summary: dict[str, dict[str, float]] = {}
    for key in rows[0][0]:
        ratios = [b[key] / x[key] for x, b in rows]
        se = statistics.stdev(ratios) / len(ratios) ** 0.5 if len(ratios) > 1 else float("nan")
        summary[key] = {
            "a_median": statistics.median(x[key] for x, _ in rows),
            "b_median": statistics.median(b[key] for _, b in rows),
            "b_over_a": statistics.mean(ratios),
            "se": se,
            "b_faster_rounds": sum(q > 1 for q in ratios),
        }
        s = summary[key]
        print(
            f"{key}: A {s['a_median']:.1f}  B {s['b_median']:.1f}  B/A {s['b_over_a']:.3f} "
            f"± {s['se']:.3f}  (B faster in {s['b_faster_rounds']}/{len(ratios)})"
        )
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
