"""End-to-end decode benchmark on any colibri container (developer tool).

Measures tokens/s with the page cache dropped before each run (cold), for each prefetch
mode and draft setting asked for, and prints a markdown table plus JSON lines.

    python tools/bench_decode.py /work/synth/glm52 --tokens 16 --prefetch off hint real
    python tools/bench_decode.py python/colibri/models/tiny --draft off mtp ngram --warm
"""

from __future__ import annotations

import argparse
import json
import time

from colibri import _core


def run(args: argparse.Namespace, prefetch: str, draft: str, depth: int) -> dict[str, object]:
    engine = _core.Engine(
        args.model,
        io=args.io,
        prefetch=prefetch,
        ram_budget=args.ram_budget,
        threads=args.threads,
        usage_file=False,
    )
    ids = [int(t) % 1000 + 2 for t in range(args.prompt_tokens)]
    rows = []
    for rep in range(args.repeats):
        if not args.warm:
            engine.drop_page_cache()
        t0 = time.perf_counter()
        out = engine.generate(
            ids,
            max_new_tokens=args.tokens,
            temperature=0.0,
            draft=draft,
            draft_depth=depth,
            stop_ids=[],
        )
        wall = time.perf_counter() - t0
        st = dict(out["stats"])
        st.update(rep=rep, wall_s=wall, prefetch=prefetch, draft=draft, depth=depth)
        rows.append(st)
        print(json.dumps(st), flush=True)
    best = max(rows, key=lambda r: float(r["tokens_per_second"]))  # type: ignore[arg-type]
    return best


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("model")
    p.add_argument("--tokens", type=int, default=16)
    p.add_argument("--prompt-tokens", type=int, default=8)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--io", default="auto")
    p.add_argument("--ram-budget", type=int, default=None)
    p.add_argument("--threads", type=int, default=0)
    p.add_argument("--prefetch", nargs="+", default=["off", "hint", "real"])
    p.add_argument("--draft", nargs="+", default=["off"])
    p.add_argument("--depth", type=int, default=0, help="draft depth, 0 = auto")
    p.add_argument("--warm", action="store_true", help="do not drop the page cache")
    args = p.parse_args()
    results = [run(args, pf, d, args.depth) for pf in args.prefetch for d in args.draft]
    print(
        "\n| prefetch | draft | tok/s | tokens/forward | expert hits | misses | GB read | "
        "wait s | recall |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        recall = r.get("prefetch_recall")
        print(
            f"| {r['prefetch']} | {r['draft']} | {float(r['tokens_per_second']):.3f} | "  # type: ignore[arg-type]
            f"{float(r['tokens_per_forward']):.2f} | {r['expert_hits']} | {r['expert_misses']} | "  # type: ignore[arg-type]
            f"{int(r['expert_bytes_read']) / 1e9:.2f} | {float(r['expert_wait_seconds']):.2f} | "  # type: ignore[arg-type]
            f"{'-' if recall is None else f'{float(recall):.2f}'} |"  # type: ignore[arg-type]
        )


if __name__ == "__main__":
    main()
