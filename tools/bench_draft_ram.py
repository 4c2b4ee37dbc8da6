"""Drafting with every weight in RAM: decode tok/s of ``draft="off"``, ``"auto"`` and fixed
MTP depths, rounds interleaved in one process, greedy, tokens required identical; beside each,
tokens per forward E and the bound E · bytes(1) / bytes(forward): what drafting could gain if
decode ran at the memory's bandwidth, from the bytes each forward reads (the resident part
once, each MoE layer's union of routed experts over the forward's rows, and the MTP layer's
calls), counted from the engine's own routing trace.

    python tools/bench_draft_ram.py MODEL [--rounds 5] [--gen 128] [--settings off,auto,mtp:1,mtp:2]

MODEL should hold a token's bytes as a real model splits them: e.g. the GLM-like model's
stand-in with wide shared experts (tools/make_standin.py ... --intermediate 8192
--shared-experts 3: resident : routed = 48 : 52 per token). The budget is the default, which
holds every expert of such a stand-in.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import colibri

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_standin
from bench_defaults import CODE_PROMPTS


@dataclass
class Bytes:
    """What a forward reads, by part of the container."""

    dense: int  # main model's resident weights a row reads (not the embedding table)
    expert: dict[int, int]  # layer → bytes of one routed expert
    mtp_dense: int  # the MTP layer's resident weights

    @classmethod
    def of(cls, model: Path) -> Bytes:
        cfg = json.loads((model / "config.json").read_text())
        main = cfg["num_hidden_layers"]
        dense = mtp_dense = 0
        expert: dict[int, int] = {}
        counts: dict[int, set[str]] = {}
        for t in make_standin.list_tensors(model):
            size = t.end - t.start
            m = make_standin.LAYER_RE.match(t.name)
            layer = int(m.group(1)) if m else -1
            if ".mlp.experts." in t.name:
                expert[layer] = expert.get(layer, 0) + size
                counts.setdefault(layer, set()).add(t.name.split(".mlp.experts.")[1].split(".")[0])
            elif "embed_tokens" in t.name:
                continue
            elif layer >= main:
                mtp_dense += size
            else:
                dense += size
        per = {layer: b // len(counts[layer]) for layer, b in expert.items()}
        return cls(dense, per, mtp_dense)


def forward_bytes(trace: Path, b: Bytes) -> tuple[float, float]:
    """Mean bytes per decode forward (with its drafts and MTP calls) and one plain row's."""
    lines = trace.read_text().splitlines()
    head = json.loads(lines[0])
    layers, mtp_layer, k = head["layers"], head.get("mtp_layer"), head["top_k"]
    forwards: dict[int, dict] = {}
    for line in lines[1:]:
        row = json.loads(line)
        if row["kind"] == "prompt":
            continue
        f = forwards.setdefault(row["forward"], {"sets": [set() for _ in layers], "mtp": 0})
        if row["kind"] == "mtp":
            f["mtp"] += b.mtp_dense + len(row["experts"][0]) * b.expert.get(mtp_layer, 0)
            continue
        for s, ids in zip(f["sets"], row["experts"], strict=True):
            s.update(ids)
    decode = [f for f in forwards.values() if any(f["sets"])]
    if not decode:
        raise SystemExit(f"{trace}: no decode forward in the trace")
    total = [
        b.dense
        + sum(len(s) * b.expert[layer] for s, layer in zip(f["sets"], layers, strict=True))
        + f["mtp"]
        for f in decode
    ]
    one = b.dense + sum(k * b.expert[layer] for layer in layers)
    return statistics.mean(total), one


def run_setting(m: colibri.Model, setting: str, gen: int) -> tuple[float, float, list]:
    """Decode tok/s, tokens per forward and the tokens, over the prompts."""
    draft, _, depth = setting.partition(":")
    kw = {"draft": draft}
    if depth:
        kw["draft_depth"] = int(depth)
    toks, secs, forwards, outs = 0, 0.0, 0, []
    for p in CODE_PROMPTS:
        r = m.generate(p, max_new_tokens=gen, temperature=0, stop_token_ids=[], **kw)
        toks += r.stats.generated_tokens
        secs += r.stats.decode_seconds
        forwards += r.stats.decode_forwards
        outs.append(r.token_ids)
    return toks / secs, toks / max(forwards, 1), outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--settings", default="off,auto,mtp:1,mtp:2,mtp:3")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    settings = a.settings.split(",")
    b = Bytes.of(a.model)
    m = colibri.Model(str(a.model), threads=a.threads)
    m.generate(CODE_PROMPTS[0], max_new_tokens=8)
    rates: dict[str, list[float]] = {s: [] for s in settings}
    tpf: dict[str, float] = {}
    want = None
    for r in range(a.rounds):
        order = settings if r % 2 == 0 else settings[::-1]
        for s in order:
            rate, per_forward, outs = run_setting(m, s, a.gen)
            want = want or outs
            if outs != want:
                raise SystemExit(f"round {r}: {s} gave other tokens than {settings[0]}")
            rates[s].append(rate)
            tpf[s] = per_forward
    info = m.info()
    print(
        f"{a.model}: decode {info['decode']}, {a.threads} threads, {a.rounds} rounds x "
        f"{len(CODE_PROMPTS)} prompts x {a.gen} tokens; resident {b.dense / 1e6:.1f} MB and "
        f"{max(b.expert.values()) / 1e6:.2f} MB per routed expert"
    )
    print(
        "| setting | tok/s (median) | x off | tokens / forward | bytes / forward x 1 row | bound |"
    )
    print("|---|---|---|---|---|---|")
    base = statistics.median(rates[settings[0]])
    with tempfile.TemporaryDirectory() as tmp:
        for s in settings:
            trace = Path(tmp) / f"{s.replace(':', '-')}.jsonl"
            traced = colibri.Model(str(a.model), threads=a.threads, trace_routing=str(trace))
            run_setting(traced, s, a.gen)
            del traced
            mean, one = forward_bytes(trace, b)
            med = statistics.median(rates[s])
            print(
                f"| {s} | {med:.1f} | {med / base:.3f} | {tpf[s]:.2f} | {mean / one:.2f} | "
                f"{tpf[s] * one / mean:.2f} |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
