"""Measurements on a shared machine: each in a fresh process of bench_llamacpp.py, after a quiet
moment and with the files in the page cache, repeated when other processes took the CPU."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

from _bench_llamacpp_env import log


def warm(paths: list[Path]) -> None:
    """Read every file once so the measurement finds it in the page cache."""
    for p in paths:
        for f in sorted(p.glob("*")) if p.is_dir() else [p]:
            if f.is_file():
                with open(f, "rb", buffering=0) as fh:
                    while fh.read(1 << 23):
                        pass


#: The entry script: each measurement runs it again as a worker (``_colibri``, ``_llama``).
SCRIPT = Path(__file__).resolve().with_name("bench_llamacpp.py")

KINDS = {"d8": 8, "p512": 512, "p2048": 2048}


def run_one(variant: dict[str, Any], kind: str, args: argparse.Namespace) -> dict[str, Any]:
    prompt = KINDS[kind] if not args.quick else {"d8": 8, "p512": 64, "p2048": 128}[kind]
    gen = 1 if kind == "p2048" else args.gen
    cmd = [
        variant["python"],
        str(SCRIPT),
        variant["worker"],
        variant["model"],
        "--threads",
        str(args.threads),
        "--prompt",
        str(prompt),
        "--gen",
        str(gen),
    ]
    if variant.get("prefill"):
        cmd += ["--prefill", variant["prefill"]]
    if variant.get("draft"):
        cmd += ["--draft", variant["draft"]]
    env = dict(os.environ, **variant.get("env", {}))
    busy0, mine0 = cpu_busy(), children_cpu()
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=args.timeout)
    wall = time.perf_counter() - t0
    # CPU the rest of the machine used meanwhile, in cores (the measurement's own excluded).
    others = (cpu_busy() - busy0 - (children_cpu() - mine0)) / wall
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            r = json.loads(line[7:])
            r.update(kind=kind, prompt=prompt, gen=gen, process_s=wall, others_cores=others)
            r["loadavg"] = os.getloadavg()[0]
            return r
    raise RuntimeError(f"{variant['name']} {kind} failed (rc {p.returncode}):\n{p.stderr[-3000:]}")


def quiet(max_others: float, timeout: float) -> float:
    """Wait (up to ``timeout`` s) until the rest of the machine uses at most ``max_others``
    cores over a 1-s sample; return the last sample."""
    end = time.monotonic() + timeout
    while True:
        b0, t0 = cpu_busy(), time.perf_counter()
        time.sleep(1.0)
        others = (cpu_busy() - b0) / (time.perf_counter() - t0)
        if others <= max_others or time.monotonic() > end:
            return others


def measure(v: dict[str, Any], kind: str, args: argparse.Namespace) -> dict[str, Any]:
    """One measurement on a machine others share: wait for a quiet moment, warm the page
    cache, run; when other processes took more than ``--max-others`` cores meanwhile, run it
    again (``--attempts`` in all) and keep the least disturbed attempt."""
    best: dict[str, Any] | None = None
    tried = []
    for _ in range(args.attempts):
        before = quiet(args.max_others, args.quiet_wait)
        warm([Path(v["model"])])
        r = run_one(v, kind, args)
        r["others_before"] = before
        tried.append(r["others_cores"])
        if best is None or r["others_cores"] < best["others_cores"]:
            best = r
        if r["others_cores"] <= args.max_others:
            break
        log(f"  {v['name']} {kind}: others used {r['others_cores']:.2f} cores, again")
    assert best is not None
    best["attempts_others"] = tried
    return best


def cpu_busy() -> float:
    """CPU seconds every process on the machine has used (all cores), from /proc/stat."""
    f = Path("/proc/stat").read_text().splitlines()[0].split()[1:]
    idle = int(f[3]) + int(f[4])
    return (sum(int(x) for x in f[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def children_cpu() -> float:
    import resource

    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
