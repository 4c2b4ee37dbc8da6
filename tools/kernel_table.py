"""Turn the output of the kernel benches into the ratio tables of docs/benchmarks.md.

    cargo bench --features testing --bench main -- \\
        '^(bandwidth|compute|kernels|expert_ffn|kernel_l2)/' | tee bench.txt \\
        | python tools/kernel_table.py

Reads criterion's console output (stdin or a file argument), takes the middle estimate of
each throughput, and prints per format and shape: the paired read of the same matrices
(`.../read`), S = 1 as a share of it and of the 1 GiB references, the S4/S1 and S8/S1 time
ratios, and S = 8 against the FMA ceiling (`compute/fma_peak_2threads`).
"""

from __future__ import annotations

import re
import sys
from collections import defaultdict

NAME = re.compile(r"^((?:bandwidth|compute|kernels|expert_ffn|kernel_l2)/\S+)")
THRPT = re.compile(r"thrpt:\s+\[\S+ \S+ (\S+) (\S+) \S+ \S+\]")
UNITS = {"GiB/s": 1.0, "MiB/s": 1 / 1024, "Gelem/s": 1.0, "Melem/s": 1e-3}
SHAPE = re.compile(r"(?:^|_)(\d+)x(\d+)$")


def parse(lines: list[str]) -> dict[str, float]:
    """Bench id -> middle throughput estimate (GiB/s, or Gelem/s for compute)."""
    out: dict[str, float] = {}
    name = None
    for line in lines:
        m = NAME.match(line)
        if m:
            name = m.group(1)
        t = THRPT.search(line)
        if t and name:
            out[name] = float(t.group(1)) * UNITS.get(t.group(2), float("nan"))
            name = None
    return out


def table(r: dict[str, float]) -> str:
    refs = {k.split("/", 1)[1]: v for k, v in r.items() if k.startswith("bandwidth/")}
    ref = max(refs.values(), default=float("nan"))
    peak = next((v for k, v in r.items() if k.startswith("compute/fma_peak")), float("nan"))
    rows: dict[tuple[str, str], dict[str, float]] = defaultdict(dict)
    for k, v in r.items():
        parts = k.split("/")
        if parts[0] == "kernels" and len(parts) == 4:
            rows[(parts[1], parts[2])][parts[3]] = v
        elif parts[0] == "expert_ffn" and len(parts) == 4:
            rows[("fused " + parts[1], parts[2])][parts[3]] = v
    lines = [
        "references: "
        + ", ".join(f"{k} {v:.1f} GiB/s" for k, v in refs.items())
        + f"; FMA ceiling {peak:.0f} GFLOP/s",
        "",
        "| format | shape | paired read | S=1 GiB/s | % read | % 1 GiB ref | S4/S1 | S8/S1 "
        "| S=8 GFLOP/s (% ceiling) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for (fmt, shape), v in rows.items():
        s1, s4, s8, rd = (v.get(x, float("nan")) for x in ("S1", "S4", "S8", "read"))
        m = SHAPE.search(shape)
        flops = float("nan")
        if m:
            o, i = int(m.group(1)), int(m.group(2))
            weights = o * i * (3 if fmt.startswith("fused") else 1)
            per_weight = {"int4_g64": 0.5 + 4 / 64, "int8": 1 + 4 / i, "bf16": 2.0}
            bpw = per_weight.get(fmt.removeprefix("fused "), float("nan"))
            flops = 2 * 8 * weights / (weights * bpw / (s8 * 2**30)) / 1e9
        gf = f"{flops:.0f} ({flops / peak:.0%})" if flops == flops else "-"
        rd_s = f"{rd:.1f}" if rd == rd else "-"
        pr = f"{s1 / rd:.0%}" if rd == rd else "-"
        lines.append(
            f"| {fmt} | {shape} | {rd_s} | {s1:.1f} | {pr} | {s1 / ref:.0%} | {s1 / s4:.2f} "
            f"| {s1 / s8:.2f} | {gf} |"
        )
    l2 = {k: v for k, v in r.items() if k.startswith("kernel_l2/")}
    if l2:
        lines += [
            "",
            "kernel_l2 (1 thread, L2-resident): "
            + ", ".join(f"{k.split('/')[3]} {k.split('/')[5]} {v:.2f}" for k, v in l2.items()),
        ]
    return "\n".join(lines)


def main() -> None:
    if len(sys.argv) > 1:
        with open(sys.argv[1]) as f:
            lines = f.readlines()
    else:
        lines = sys.stdin.readlines()
    print(table(parse(lines)))


if __name__ == "__main__":
    main()
