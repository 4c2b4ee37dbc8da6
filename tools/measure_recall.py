"""Router-lookahead recall on a model (developer tool): share of each layer's routed experts
that the predictor named before the layer ran, per layer, for several widths K, measured
while decoding (S = 1 rows) with sampling at temperature 1 from short code prompts.

    python tools/measure_recall.py python/colibri/models/tiny --k 2 3 4
"""

from __future__ import annotations

import argparse

from colibri import _core
from tokenizers import Tokenizer

PROMPTS = ["def ", "import ", "class ", "    return ", "if __name__", "for i in "]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--k", type=int, nargs="+", default=[2, 4])
    p.add_argument("--tokens", type=int, default=200)
    args = p.parse_args()
    tok = Tokenizer.from_file(f"{args.model}/tokenizer.json")
    print("| K | predictor | " + " | ".join(f"layer {x}" for x in range(1, 4)) + " | all |")
    print("|---|---|" + "---|" * 4)
    for k in args.k:
        e = _core.Engine(args.model, prefetch="real", prefetch_top_k=k, usage_file=False)
        sums: dict[str, dict[int, list[int]]] = {"router": {}, "previous": {}}
        for i, prompt in enumerate(PROMPTS):
            ids = tok.encode(prompt).ids
            e.generate(
                ids, max_new_tokens=args.tokens, temperature=1.0, seed=i, draft="off", stop_ids=[]
            )
            for layer, st in e.expert_stats()["layers"].items():
                for name in ("router", "previous"):
                    acc = sums[name].setdefault(int(layer), [0, 0])
                    acc[0] += int(st[f"recalled_{name}"])
                    acc[1] += int(st[f"routed_{name}"])
        for name in ("router", "previous"):
            cells = []
            tot = [0, 0]
            for layer in sorted(sums[name]):
                a, b = sums[name][layer]
                if b:
                    cells.append(f"{a / b:.3f}")
                    tot[0] += a
                    tot[1] += b
            print(f"| {k} | {name} | " + " | ".join(cells) + f" | {tot[0] / max(tot[1], 1):.3f} |")


if __name__ == "__main__":
    main()
