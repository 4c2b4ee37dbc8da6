"""Load cost of a model: wall time of ``Model()``, of its first generation, and the RSS
(anonymous and file-backed) after each, in a fresh process per run, page cache warm
(one unmeasured run first). Used for docs/benchmarks.md "Dense weights in owned memory".

    python tools/bench_load.py MODEL_DIR [--runs 3] [--io pread]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys

CHILD = r"""
import json, sys, time
def status():
    out = {}
    for line in open("/proc/self/status"):
        k, _, v = line.partition(":")
        if k in ("VmRSS", "RssAnon", "RssFile", "VmHWM"):
            out[k] = int(v.split()[0]) / 1024
    return out
import colibri
t0 = time.perf_counter()
m = colibri.Model(sys.argv[1], threads=2, io=sys.argv[2], mtp=False)
t1 = time.perf_counter()
after_load = status()
m.generate([5, 6, 7], max_new_tokens=4, temperature=0, stop_token_ids=[], draft="off")
t2 = time.perf_counter()
print(json.dumps({"load_s": t1 - t0, "first_generate_s": t2 - t1,
                  "after_load_mib": after_load, "after_generate_mib": status()}))
"""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--runs", type=int, default=3)
    ap.add_argument("--io", default="pread")
    a = ap.parse_args()
    runs = []
    for i in range(a.runs + 1):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, a.model, a.io],
            capture_output=True,
            text=True,
            check=True,
        ).stdout
        if i:
            runs.append(json.loads(out.strip().splitlines()[-1]))

    def med(f: str, *k: str) -> float:
        vals = []
        for r in runs:
            v = r[f]
            for key in k:
                v = v[key]
            vals.append(float(v))
        return statistics.median(vals)

    print(
        json.dumps(
            {
                "model": a.model,
                "runs": a.runs,
                "load_s": round(med("load_s"), 4),
                "first_generate_s": round(med("first_generate_s"), 4),
                "after_load_rss_mib": round(med("after_load_mib", "VmRSS"), 1),
                "after_load_anon_mib": round(med("after_load_mib", "RssAnon"), 1),
                "after_load_file_mib": round(med("after_load_mib", "RssFile"), 1),
                "after_generate_rss_mib": round(med("after_generate_mib", "VmRSS"), 1),
                "after_generate_anon_mib": round(med("after_generate_mib", "RssAnon"), 1),
                "after_generate_file_mib": round(med("after_generate_mib", "RssFile"), 1),
            }
        )
    )


if __name__ == "__main__":
    main()
