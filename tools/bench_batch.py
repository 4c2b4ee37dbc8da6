#!/usr/bin/env python3
"""Batched decode across sessions, measured where experts stream from disk.

For B in ``--sessions`` (default 1 2 4 8), B different prompts are generated at once
(``Model.generate(list_of_prompts)``: each on its own session, one decode forward for all
of them) on a disk-scale stand-in (``tools/make_standin.py``), cold: a fresh model per run
with ``io="direct"`` (O_DIRECT: nothing served from the page cache) and the given RAM budget.
Each B runs with every drafter of ``--drafts`` (default ``off`` and ``auto``: each session
drafts on its own and its drafts are verified in the shared forward), interleaved.
Reports total generated tok/s (all sessions' tokens / wall time of the decode phase), its
ratio to B = 1 without drafting, tokens per forward, expert MB read per generated token, and
the disk's random-read bandwidth measured in the same round (``tools/bench_disk.py``'s
probe). Every run's tokens must equal each prompt's tokens generated alone (asserted: the
same prompts run one by one, without drafting).

    python tools/bench_batch.py /work/standin/glmlike-prop --runs 2 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_disk
import colibri

PROMPTS = [
    bench_disk.TEST_PROMPT,
    *bench_disk.LEARN_PROMPTS,
    "def quicksort(xs):\n    if len(xs) <= 1:\n        return xs\n",
    "import json\n\n\ndef load(path):\n    with open(path) as f:\n",
    "class Point:\n    def __init__(self, x, y):\n        self.x = x\n",
]


def run(
    model_dir: Path, prompts: list[str], tokens: int, budget: int, draft: str = "off"
) -> dict[str, Any]:
    m = colibri.Model(
        model_dir, io="direct", ram_budget=budget, prefetch="off", threads=0, draft=draft
    )
    t0 = time.perf_counter()
    results = m.generate(prompts, max_tokens=tokens, temperature=0, stop_token_ids=[])
    wall = time.perf_counter() - t0
    prefill = sum(r.stats.prefill_seconds for r in results)
    decoded = sum(r.stats.generated_tokens - 1 for r in results)
    decode_secs = max(r.stats.decode_seconds for r in results)
    # The store's counters are the whole batch's (every result carries the same totals).
    bytes_read = results[0].stats.expert_bytes_read
    m.close()
    return {
        "wall": wall,
        "prefill": prefill,
        "decode_tok_s": decoded / decode_secs if decode_secs else 0.0,
        "mb_per_token": bytes_read / 1e6 / max(1, sum(r.stats.generated_tokens for r in results)),
        "tokens_per_forward": statistics.mean(r.stats.tokens_per_forward for r in results),
        "tokens": [r.token_ids for r in results],
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--sessions", type=int, nargs="+", default=[1, 2, 4, 8])
    ap.add_argument("--tokens", type=int, default=16)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--budget", type=float, default=0.0, help="RAM budget, bytes")
    ap.add_argument("--drafts", nargs="+", default=["off", "auto"], help="drafters to compare")
    args = ap.parse_args(argv)
    cfg = json.loads((args.model / "config.json").read_text())
    expert = bench_disk._expert_bytes(args.model, cfg)
    cells = [(b, d) for b in args.sessions for d in args.drafts]
    rows: dict[tuple[int, str], list[dict[str, Any]]] = {c: [] for c in cells}
    probes = []
    for r in range(args.runs):
        probes.append(bench_disk.disk_bandwidth(args.model, expert, 4, 24, seed=r))
        for b, d in cells:
            out = run(args.model, PROMPTS[:b], args.tokens, int(args.budget), d)
            rows[(b, d)].append(out)
            print(
                f"round {r} B={b} draft={d}: {out['decode_tok_s']:.2f} tok/s total, "
                f"{out['tokens_per_forward']:.2f} tok/forward, {out['mb_per_token']:.1f} MB/token",
                file=sys.stderr,
            )
    # Each prompt alone without drafting: every batch, drafting or not, must give its tokens.
    for i in range(max(args.sessions)):
        alone_i = run(args.model, [PROMPTS[i]], args.tokens, int(args.budget))["tokens"][0]
        for (b, d), outs in rows.items():
            for out in outs:
                if i < b:
                    assert out["tokens"][i] == alone_i, f"prompt {i}, batch of {b}, {d} differs"
    base = statistics.median(o["decode_tok_s"] for o in rows[(args.sessions[0], args.drafts[0])])
    print(f"disk random-read bandwidth: {[round(p / 1e9, 2) for p in probes]} GB/s")
    print("| sessions | draft | total tok/s | x 1 session | tok/forward | MB read / token |")
    print("|---|---|---|---|---|---|")
    for b, d in cells:
        outs = rows[(b, d)]
        tps = statistics.median(o["decode_tok_s"] for o in outs)
        tpf = statistics.median(o["tokens_per_forward"] for o in outs)
        mb = statistics.median(o["mb_per_token"] for o in outs)
        print(f"| {b} | {d} | {tps:.2f} | {tps / base:.2f} | {tpf:.2f} | {mb:.1f} |")
    print("outputs identical to each prompt run alone: yes (asserted)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
