#!/usr/bin/env python3
"""Decode speed with the routed experts on Ray workers against in RAM and on disk (developer
tool; docs/distributed.md).

Starts a local Ray cluster bound to 127.0.0.1 and two expert workers (``colibri.distributed``)
holding all of MODEL's routed experts between them, then runs greedy decoding (draft off
unless ``--draft``) in ``--rounds`` interleaved rounds of three cells:

- ``ram``: every expert in the head's RAM (``ram_budget`` above the experts' bytes, warmed);
- ``disk``: a fresh model per run at ``--budget`` (default 10%) of the experts' bytes, the
  page cache dropped first (cold, as tools/bench_disk.py runs);
- ``ray``: the same budget, the experts on the two workers (``experts="ray://auto"``).

Per cell: the median decode tok/s, and for ``ray`` the workers' mean round trip per MoE
layer (submit to collect, the worker's compute included), the overhead per MoE layer
against ``ram`` ((1/tok/s_ray - 1/tok/s_ram) / MoE layers per forward) and the bytes
exchanged per layer. Tokens must be the same in every cell; the tool checks it.

    python tools/bench_distributed.py python/colibri/models/tiny --rounds 3
    python tools/bench_distributed.py /work/standin-ray45/glmlike --tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path
from typing import Any

os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")  # loopback only

import colibri
from colibri import _core
from colibri.distributed import model_experts, start_worker

PROMPT = "def fibonacci(n):"


def expert_bytes(path: Path) -> int:
    c = _core.Container(str(path))
    total = 0
    for name in c.names():
        if ".mlp.experts." in name:
            info = c.info(name)
            total += int(info["end"]) - int(info["start"])
    return total


def moe_layers(path: Path) -> int:
    return len({layer for layer, _ in model_experts(path)}) - (
        1 if int(_core.model_config(path)["num_nextn_predict_layers"]) > 0 else 0
    )


def run(m: Any, args: argparse.Namespace) -> tuple[float, list[int]]:
    out = m.generate(PROMPT, max_new_tokens=args.tokens, draft=args.draft, ignore_eos=True)
    return float(out.stats.tokens_per_second), list(out.token_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--tokens", type=int, default=48)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--budget", type=float, default=0.1, help="disk and ray cells' budget")
    ap.add_argument("--threads", type=int, default=0, help="the head's compute threads")
    ap.add_argument("--worker-threads", type=int, default=1)
    ap.add_argument("--workers", type=int, default=2, help="expert workers (default 2)")
    ap.add_argument("--draft", default="off")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()

    import ray

    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        namespace="colibri",
        log_to_driver=False,
        configure_logging=False,
    )
    n = args.workers
    workers = [start_worker(args.model, i, n, threads=args.worker_threads) for i in range(1, n + 1)]
    total = expert_bytes(args.model)
    budget = max(1, int(total * args.budget))
    layers = moe_layers(args.model)
    ram = colibri.Model(args.model, threads=args.threads, ram_budget=int(total * 1.5) + (64 << 20))
    _, want = run(ram, args)  # warm: every expert read once
    head = colibri.Model(args.model, threads=args.threads, ram_budget=budget, experts="ray://auto")
    run(head, args)
    tps: dict[str, list[float]] = {"ram": [], "disk": [], "ray": []}
    for r in range(args.rounds):
        cells = ["ram", "disk", "ray"]
        for cell in cells if r % 2 == 0 else cells[::-1]:
            if cell == "disk":
                m = colibri.Model(args.model, threads=args.threads, ram_budget=budget)
                m._engine.drop_page_cache()
                t, ids = run(m, args)
                m.close()
            else:
                t, ids = run(ram if cell == "ram" else head, args)
            tps[cell].append(t)
            if ids != want:
                sys.exit(f"{cell}: tokens differ from the experts-in-RAM run's")
    med = {k: statistics.median(v) for k, v in tps.items()}
    info = head.experts_workers() or []
    calls = sum(w["calls"] for w in info)
    moved = sum(w["bytes_sent"] + w["bytes_received"] for w in info)
    per_layer_ms = 1000.0 * (1 / med["ray"] - 1 / med["ram"]) / layers
    report = {
        "model": str(args.model),
        "expert_bytes": total,
        "budget_bytes": budget,
        "moe_layers": layers,
        "tokens": args.tokens,
        "draft": args.draft,
        "workers": n,
        "rounds": args.rounds,
        "tok_s": med,
        "tok_s_all": tps,
        "ray_over_disk": med["ray"] / med["disk"],
        "overhead_ms_per_moe_layer": per_layer_ms,
        "worker_round_trip_ms": {w["name"]: w["mean_ms"] for w in info},
        "bytes_per_layer_call": moved / max(1, calls),
        "host": os.uname().nodename,
        "cpus": os.cpu_count(),
        "colibri": colibri.__version__,
    }
    print(json.dumps(report, indent=2))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    for w in workers:
        ray.kill(w)
    ray.shutdown()


if __name__ == "__main__":
    main()
