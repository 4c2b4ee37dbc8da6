"""The results: each variant's medians, the ratios against the goals, and the markdown tables."""

from __future__ import annotations

import statistics
from typing import Any

from _bench_llamacpp_measure import KINDS


def med(rows: list[dict[str, Any]], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def report(res: dict[str, Any]) -> str:
    """The markdown tables."""
    bw = res["ceilings"]["read_GBps"] * 1e9
    fma = res["ceilings"]["fma_f32_GFLOPs"] * 1e9
    vnni = res["ceilings"].get("vnni_int8_GOPs")
    fpt = res["model"]["flops_per_token"]
    lines = [
        "| engine | bytes/token MB | decode tok/s after 8 | decode tok/s after 512 | "
        "prefill tok/s 512 | prefill tok/s 2048 | decode % of BW | prefill % of FMA | "
        "peak RSS MiB | others' CPU (cores) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v in res["variants"]:
        s = v["summary"]
        bpt = v["bytes_per_token"]

        def f(x: float | None, fmt: str = "{:.1f}") -> str:
            return "—" if x is None else fmt.format(x)

        d8, d512, p512, p2048 = (
            s.get(k) for k in ("decode_8", "decode_512", "prefill_512", "prefill_2048")
        )
        pct_bw = None if d8 is None else 100 * d8 * bpt / bw
        best_p = max([x for x in (p512, p2048) if x is not None], default=None)
        pct_fma = None if best_p is None else 100 * best_p * fpt / fma
        lines.append(
            f"| {v['name']} | {bpt / 1e6:.0f} | {f(d8)} | {f(d512)} | {f(p512)} | {f(p2048)} | "
            f"{f(pct_bw, '{:.0f}%')} | {f(pct_fma, '{:.0f}%')} | "
            f"{f(s.get('peak_rss'), '{:.0f}')} | {f(s.get('others_cores'), '{:.2f}')} |"
        )
    lines.append("")
    lines.append(
        f"Bandwidth {res['ceilings']['read_GBps']:.1f} GB/s (2-thread streaming read), "
        f"FMA ceiling {res['ceilings']['fma_f32_GFLOPs']:.0f} GFLOP/s f32"
        + (f", VNNI ceiling {vnni:.0f} GOP/s int8" if vnni else "")
        + f"; {fpt / 1e9:.3f} GFLOP per token."
    )
    floor = res["ceilings"].get("exact_floor_GBps")
    if floor:
        lines.append(
            f"Exact-arithmetic stream floor {floor:.1f} GB/s ({100 * floor * 1e9 / bw:.0f}% of the "
            "bandwidth): the same stream with one f32 FMA lane per int4 weight and no decoding, "
            "the most an exact S = 1 decode can reach on this machine."
        )
    if res.get("ratios"):
        lines.append("")
        lines.append("| ratio (one run) | value | goal |")
        lines.append("|---|---|---|")
        for name, val, goal in res["ratios"]:
            lines.append(f"| {name} | {'—' if val is None else f'{val:.2f}'} | {goal} |")
    return "\n".join(lines)


def ratios(res: dict[str, Any]) -> list[tuple[str, float | None, str]]:
    by = {v["name"]: v for v in res["variants"]}
    llama = [v for v in res["variants"] if v["engine"] == "llama.cpp"]
    col = [v for v in res["variants"] if v["engine"] == "colibri" and v.get("draft") == "off"]
    if not llama or not col:
        return []
    bw = res["ceilings"]["read_GBps"] * 1e9
    fma = res["ceilings"]["fma_f32_GFLOPs"] * 1e9
    vnni = res["ceilings"].get("vnni_int8_GOPs")
    fpt = res["model"]["flops_per_token"]
    out: list[tuple[str, float | None, str]] = []

    def best(vs: list[dict[str, Any]], key: str) -> tuple[str, float] | None:
        got = [(v["name"], v["summary"][key]) for v in vs if v["summary"].get(key)]
        return max(got, key=lambda x: x[1]) if got else None

    for key, goal in (
        ("prefill_512", "≥ 1.5"),
        ("prefill_2048", "≥ 1.5"),
        ("decode_8", "≥ 1.2"),
        ("decode_512", "≥ 1.2"),
    ):
        c, ll = best(col, key), best(llama, key)
        if c and ll:
            out.append((f"colibri / llama.cpp {key} ({c[0]} / {ll[0]})", c[1] / ll[1], goal))
    for key in ("decode_8", "decode_512"):
        c = best(col, key)
        if c:
            bpt = by[c[0]]["bytes_per_token"]
            out.append(
                (f"{c[0]} {key}: tok/s x bytes/token / bandwidth", c[1] * bpt / bw, "≥ 0.85")
            )
    floor = res["ceilings"].get("exact_floor_GBps")
    if floor:
        out.append(
            (
                "exact-arithmetic stream floor / bandwidth (what exact decode could reach here)",
                floor * 1e9 / bw,
                "≥ 0.85 for the 85% goal to be reachable",
            )
        )
    for key in ("prefill_512", "prefill_2048"):
        c = best(col, key)
        if c:
            out.append(
                (f"{c[0]} {key}: tok/s x flops/token / FMA ceiling", c[1] * fpt / fma, "≥ 0.60")
            )
            if vnni:
                out.append(
                    (
                        f"{c[0]} {key}: tok/s x flops/token / VNNI ceiling",
                        c[1] * fpt / (vnni * 1e9),
                        "(≥ 0.60 if VNNI is the path)",
                    )
                )
    return out


def results(
    facts: dict[str, Any],
    model: dict[str, Any],
    col: dict[str, Any],
    probes: list[dict[str, Any]],
    variants: list[dict[str, Any]],
    rows: list[dict[str, Any]],
) -> dict[str, Any]:
    """Everything measured so far, with each variant's medians and the goals' ratios."""
    ceilings = {
        "read_GBps": max(p["read_GBps"] for p in probes),
        "fma_f32_GFLOPs": max(p["fma_f32_GFLOPs"] for p in probes),
        "vnni_int8_GOPs": max((p["vnni_int8_GOPs"] or 0) for p in probes) or None,
        "exact_floor_GBps": max((p.get("exact_floor_GBps") or 0) for p in probes) or None,
        "probes": probes,
        "method": "rustc-compiled probe (benches/probes.rs method), before and after; max",
    }
    out = []
    for v in variants:
        mine = [r for r in rows if r["variant"] == v["name"]]
        by = {k: [r for r in mine if r["kind"] == k] for k in KINDS}
        v = {k: x for k, x in v.items() if k != "env"}
        v["summary"] = {
            "decode_8": med(by["d8"], "decode_tok_s"),
            "decode_512": med(by["p512"], "decode_tok_s"),
            "prefill_512": med(by["p512"], "prefill_tok_s"),
            "prefill_2048": med(by["p2048"], "prefill_tok_s"),
            "peak_rss": max((r["VmHWM"] for r in mine), default=0) / 2**20,
            "others_cores": med(mine, "others_cores"),
            "n": {k: len(x) for k, x in by.items()},
        }
        out.append(v)
    res = {
        "facts": facts,
        "model": model,
        "colibri_bytes": col,
        "ceilings": ceilings,
        "variants": out,
        "rows": rows,
    }
    res["ratios"] = ratios(res)
    return res
