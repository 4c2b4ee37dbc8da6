"""What the structured-output mask costs per generated token (docs/benchmarks.md).

Decodes greedily with drafting off, with and without a constraint, and reports decode
seconds per generated token for each; the difference is the mask's cost (llguidance's mask
computation, the matcher's advance, and writing -inf into the row).

    python tools/bench_structured.py [--model DIR] [--runs 5]
"""

from __future__ import annotations

import argparse
import statistics

import colibri

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 200},
        "items": {"type": "array", "items": {"type": "integer"}, "maxItems": 40},
    },
    "required": ["title", "items"],
}
CASES: list[tuple[str, dict[str, object]]] = [
    ("none", {}),
    ("guided_json", {"guided_json": SCHEMA}),
    ("guided_regex", {"guided_regex": r"[a-z][a-z ,.]{0,300}\."}),
]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=96)
    args = ap.parse_args()
    model = colibri.Model(args.model, draft="off")
    vocab = model.config["vocab_size"]
    print(f"model {model.path.name}, vocab {vocab}, {args.tokens} tokens, {args.runs} runs")
    base = None
    for name, kw in CASES:
        per_token = []
        for r in range(args.runs + 1):
            out = model.generate("Write it down:", max_new_tokens=args.tokens, temperature=0, **kw)
            if r > 0:  # the first run warms up (and loads the vocabulary)
                s = out.stats
                per_token.append(s.decode_seconds / max(1, s.generated_tokens - 1))
        us = 1e6 * statistics.median(per_token)
        extra = "" if base is None else f"  (+{us - base:.0f} us for the mask)"
        base = us if base is None else base
        print(f"{name:13s} {us:8.0f} us per token, {out.stats.generated_tokens} tokens{extra}")


if __name__ == "__main__":
    main()
