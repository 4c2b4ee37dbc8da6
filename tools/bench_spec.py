"""Speculative decoding on a model with a tokenizer (developer tool): greedy generations from
code prompts with drafting off, MTP and n-gram at fixed and auto depth; prints acceptance,
tokens per forward and wall-clock tokens/s (best of --repeats).

    python tools/bench_spec.py            # the embedded tiny model
"""

from __future__ import annotations

import argparse
import time

import colibri

PROMPTS = [
    "def fibonacci(n):",
    "import os\n",
    "class Stack:",
    "    def __init__(self):\n        self.",
    "for i in range(",
    "if __name__ == '__main__':\n",
]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args()
    m = colibri.Model(args.model)
    configs = [("off", 1)] + [(d, g) for d in ("mtp", "ngram") for g in (1, 2, 3, "auto")]
    print("| draft | depth | acceptance (d1/d2/d3) | tokens/forward | tok/s | speed-up |")
    print("|---|---|---|---|---|---|")
    base = None
    for draft, depth in configs:
        best = 0.0
        for _ in range(args.repeats):
            prop = [0] * 8
            acc = [0] * 8
            gen = fw = 0
            t0 = time.perf_counter()
            for prompt in PROMPTS:
                out = m.generate(
                    prompt,
                    max_new_tokens=args.tokens,
                    temperature=0,
                    draft=draft,
                    draft_depth=depth,
                )
                st = out.stats
                gen += st.generated_tokens
                fw += st.extra["decode_forwards"] + 1
                prop = [a + b for a, b in zip(prop, st.drafts_proposed, strict=True)]
                acc = [a + b for a, b in zip(acc, st.drafts_accepted, strict=True)]
            wall = time.perf_counter() - t0
            best = max(best, gen / wall)
        base = base or best
        rates = "/".join(
            f"{a / p:.2f}" if p else "-" for a, p in zip(acc[:3], prop[:3], strict=True)
        )
        print(f"| {draft} | {depth} | {rates} | {gen / fw:.2f} | {best:.0f} | {best / base:.2f}x |")


if __name__ == "__main__":
    main()
