"""The defaults against ``draft="off"``: rounds interleaved in one process, 3 prompts each,
greedy, tokens required identical; prints each round's ratio of decode tok/s and the median.

    python tools/bench_defaults.py MODEL [--rounds 7] [--gen 128] [--prompt-tokens 512]
"""

from __future__ import annotations

import argparse
import statistics

import colibri

CODE_PROMPTS = [
    "def quicksort(arr):\n",
    "import numpy as np\n\nclass Matrix:\n",
    "fn main() {\n    let v = vec![1, 2, 3];\n",
]


def decode_rate(m: colibri.Model, prompts: list, gen: int, draft: str) -> tuple[float, list]:
    """Decode tok/s over `prompts` and the tokens generated."""
    toks, secs, outs = 0, 0.0, []
    for p in prompts:
        r = m.generate(p, max_new_tokens=gen, temperature=0, draft=draft, stop_token_ids=[])
        toks += r.stats.generated_tokens
        secs += r.stats.decode_seconds
        outs.append(r.token_ids)
    return toks / secs, outs


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--gen", type=int, default=128)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="token-id prompts this long")
    a = ap.parse_args()
    m = colibri.Model(a.model, threads=2)
    prompts: list = CODE_PROMPTS
    if a.prompt_tokens:
        prompts = [[(7 * i + k) % 200 + 3 for i in range(a.prompt_tokens)] for k in range(3)]
    m.generate(prompts[0], max_new_tokens=8)
    ratios = []
    for r in range(a.rounds):
        order = ["off", "auto"] if r % 2 == 0 else ["auto", "off"]
        got = {d: decode_rate(m, prompts, a.gen, d) for d in order}
        if got["off"][1] != got["auto"][1]:
            raise SystemExit(f"round {r}: the defaults' tokens differ from draft='off'")
        ratios.append(got["auto"][0] / got["off"][0])
        off, auto = got["off"][0], got["auto"][0]
        print(f"round {r}: off {off:.0f} auto {auto:.0f} tok/s, {ratios[-1]:.3f}")
    print(
        f"{a.model}: defaults / off, median {statistics.median(ratios):.3f} "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}) over {a.rounds} rounds"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
