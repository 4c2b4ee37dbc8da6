#!/usr/bin/env python3
"""The disk-bound decode benchmark: the three levers measured where experts stream from disk.

Runs greedy decoding on a disk-scale stand-in (``tools/make_standin.py``) for every cell of

    RAM budget (share of the main layers' routed-expert bytes) x draft x prefetch x pins

cold: every run opens a fresh engine (empty expert cache) with ``io="direct"`` (O_DIRECT
reads bypass the page cache, so nothing is served from memory the budget does not pay for).
Runs are interleaved (round r runs every cell once, odd rounds in reverse order) and each
cell reports the median of its runs; use an even ``--runs`` for an unbiased order. The
disk's own bandwidth is measured in every round the way the store reads: random
expert-sized O_DIRECT reads on the store's demand thread count, over the model's shards.

Columns (decode only: the prefill's loads are subtracted, snapshot at the first token):
tok/s, tokens per forward, expert loads and MB read per generated token, I/O wait and
compute (decode time minus wait) per token, hit rate, prefetch recall (share of routed
experts the router lookahead predicted) and precision (share of issued prefetches that were
used), and ``ceiling = disk_BW / bytes_read_per_token`` (the tok/s the disk allows for the
bytes this cell reads). Greedy output must be the same in every cell; the tool asserts it.

    python tools/bench_disk.py /work/standin/tiny --pin-mtp            # the proportional table
    python tools/bench_disk.py /work/standin/tiny                      # naive (MTP streamed)
    python tools/bench_disk.py S --budgets 0.1 --drafts off auto --prefetch real --pins off

Pins ``learned``: the routing history of a *different* workload (``LEARN_PROMPTS``, or with
``--learn-workload same`` unseen prompts of the measured kind, ``SAME_KIND_PROMPTS``; generated
once, draft off, into a scratch cache) is put in a fresh scratch cache directory before each
such run and removed after it, so measured runs never teach the pins what they are then tested
on (nor write into the stand-in or the user's cache).
``--pin-mtp`` (or ``--pin-mtp on``) keeps the MTP layer's experts resident (loaded at open, beyond
the budget), as a user with RAM to spare would, so a draft step costs compute, not disk
(docs/benchmarks.md). ``--pin-mtp auto`` decides per cell as ``colibri.Model``'s default does
(``colibri._pin_mtp``): resident when the cell drafts and the layer fits in this host's free
memory, else the cell's ``draft="auto"`` starts with MTP drafting disabled (prompt lookup).
"""

from __future__ import annotations

import argparse
import itertools
import json
import mmap
import os
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

from colibri import _core
from tokenizers import Tokenizer

#: The measured workload: numpy-style code, as in the issue's first look.
TEST_PROMPT = (
    "import numpy as np\n\n\n"
    "def normalize(x):\n"
    '    """Return x scaled to unit norm."""\n'
    "    x = np.asarray(x, dtype=float)\n"
    "    n = np.linalg.norm(x)\n"
)
#: A different workload that teaches the pins (stdlib-style code, other topics).
LEARN_PROMPTS = [
    "import os\nimport sys\n\n\ndef main(argv):\n    parser = argparse.ArgumentParser()\n",
    'class Queue:\n    """A FIFO queue."""\n\n    def __init__(self, maxsize=0):\n',
    "def read_config(path):\n    with open(path, encoding='utf-8') as f:\n        for line in f:\n",
    "import re\n\n_pattern = re.compile(r'\\s+')\n\n\ndef split_words(text):\n",
]
#: The same kind of workload as the measured one (numpy-style code), other functions: what a
#: user's own history looks like (``--learn-workload same``). None of it is the test prompt.
SAME_KIND_PROMPTS = [
    "import numpy as np\n\n\ndef moving_average(a, n=3):\n    a = np.asarray(a, dtype=float)\n",
    "import numpy as np\n\n\ndef softmax(z):\n    z = z - z.max(axis=-1, keepdims=True)\n",
    "import numpy as np\n\n\ndef pairwise_distances(a, b):\n    a = np.atleast_2d(a)\n",
    "import numpy as np\n\n\ndef standardize(x):\n    mu, sd = x.mean(axis=0), x.std(axis=0)\n",
]
DRAFTS = {
    "off": ("off", 0),
    "mtp1": ("mtp", 1),
    "mtp2": ("mtp", 2),
    "mtp3": ("mtp", 3),
    "auto": ("auto", 0),
    "ngram": ("ngram", 0),
}
USAGE = "colibri-usage.json"


def expert_shards(model: Path) -> list[Path]:
    """The shards that hold routed experts (the big ones)."""
    shards = sorted(model.glob("*.safetensors"), key=lambda p: p.stat().st_size)
    return [p for p in shards if p.stat().st_size >= shards[-1].stat().st_size // 4]


def disk_bandwidth(model: Path, read_bytes: int, threads: int, reads: int, seed: int) -> float:
    """Bytes/s of random ``read_bytes`` O_DIRECT reads on ``threads`` threads (the store's
    demand path: one pread per expert, ``io_threads`` workers)."""
    files = expert_shards(model)
    rng = random.Random(seed)
    size = read_bytes // 4096 * 4096
    jobs = []
    for _ in range(reads):
        f = rng.choice(files)
        jobs.append((f, rng.randrange(0, max(1, (f.stat().st_size - size) // 4096)) * 4096))
    lock = threading.Lock()

    def worker() -> None:
        buf = mmap.mmap(-1, size)
        fds: dict[Path, int] = {}
        try:
            while True:
                with lock:
                    if not jobs:
                        return
                    f, off = jobs.pop()
                if f not in fds:
                    fds[f] = _open_direct(f)
                os.preadv(fds[f], [buf], off)
        finally:
            for fd in fds.values():
                os.close(fd)
            buf.close()

    t0 = time.perf_counter()
    ts = [threading.Thread(target=worker) for _ in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return reads * size / (time.perf_counter() - t0)


def _open_direct(path: Path) -> int:
    """An O_DIRECT descriptor, or a buffered one where the filesystem refuses it (tmpfs), as
    the store itself falls back."""
    try:
        return os.open(path, os.O_RDONLY | getattr(os, "O_DIRECT", 0))
    except OSError:
        return os.open(path, os.O_RDONLY)


class UsageFile:
    """The stand-in's routing history: the learned copy, put in a scratch cache directory
    (at the path relative to the cache the engine keeps it at) around pinned runs."""

    def __init__(self, learned: Path, relative: Path) -> None:
        self.learned, self.relative = learned, relative
        self.cache = Path(os.environ.get("TMPDIR", "/tmp")) / f"colibri-cache-{os.getpid()}"

    def install(self) -> None:
        path = self.cache / self.relative
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(self.learned, path)

    def remove(self) -> None:
        shutil.rmtree(self.cache, ignore_errors=True)


def learn(
    model: Path,
    tok: Tokenizer,
    tokens: int,
    resident: list[int],
    out: Path,
    budget: int,
    prompts: list[str],
) -> Path:
    """Generate the learn workload (``prompts``) once with the history on (in a scratch
    cache), keep the file it wrote as ``out``, and return its path relative to the cache
    directory (routing does not depend on the budget; a cache only makes this faster)."""
    scratch = Path(os.environ.get("TMPDIR", "/tmp")) / f"colibri-learn-{os.getpid()}"
    shutil.rmtree(scratch, ignore_errors=True)
    (model / USAGE).unlink(missing_ok=True)  # a legacy history would be merged in
    eng = _core.Engine(
        str(model),
        io="direct",
        ram_budget=budget,
        prefetch="off",
        pin="off",
        usage_file=True,
        cache_dir=str(scratch),
        resident_layers=resident,
    )
    for p in prompts:
        eng.generate(tok.encode(p).ids, max_new_tokens=tokens, draft="off", stop_ids=[])
    written = eng.usage_path
    del eng
    assert written is not None
    shutil.move(written, out)
    shutil.rmtree(scratch, ignore_errors=True)
    return Path(written).relative_to(scratch)


def run_cell(
    model: Path,
    ids: list[int],
    cell: dict[str, Any],
    args: argparse.Namespace,
    budget: int,
    resident: list[int],
    usage: UsageFile,
) -> dict[str, Any]:
    """One cold run of one cell; decode-only counters."""
    draft, depth = DRAFTS[cell["draft"]]
    if getattr(args, "pin_mtp", "off") == "auto" and args.mtp_layer is not None:
        from colibri.model import _decide_pin_mtp

        choice = _decide_pin_mtp(model, "auto", mtp=True, budget=budget, draft=draft)
        resident = [args.mtp_layer] if choice.resident else []
        if draft == "auto" and not choice.mtp_drafting:
            draft = "ngram"  # as Model does: MTP drafting starts disabled
    learned = cell["pins"] == "learned"
    if learned:
        usage.install()
    try:
        eng = _core.Engine(
            str(model),
            io=args.io,
            ram_budget=budget,
            prefetch=cell["prefetch"],
            pin="history" if learned else "off",
            usage_file=learned,
            cache_dir=str(usage.cache),
            resident_layers=resident,
            threads=args.threads,
            experts_per_token=cell.get("experts_per_token"),
        )
        after_prefill: dict[str, Any] = {}

        def on_tokens(_toks: list[int], _scored: object) -> bool:
            if not after_prefill:
                snap = eng.expert_stats()
                after_prefill.update(snap["total"], io_busy=snap["io_busy_seconds"])
            return True

        out = eng.generate(
            ids,
            max_new_tokens=args.tokens,
            draft=draft,
            draft_depth=depth,
            stop_ids=[],
            on_tokens=on_tokens,
        )
        end = eng.expert_stats()
    finally:
        if learned:
            usage.remove()
    st = out["stats"]
    tot = end["total"]
    d = {k: tot[k] - after_prefill.get(k, 0) for k in tot}
    busy = end["io_busy_seconds"] - after_prefill.get("io_busy", 0.0)
    n = max(1, st["generated_tokens"] - 1)
    secs = st["decode_seconds"]
    wait = d["wait_ns"] / 1e9
    hits = d["hits_pinned"] + d["hits_lru"] + d["hits_prefetched"] + d["hits_inflight"]
    return {
        **cell,
        "budget_bytes": budget,
        "tokens": out["tokens"],
        "tok_s": n / secs if secs > 0 else 0.0,
        "tokens_per_forward": st["tokens_per_forward"],
        "loads_per_token": d["misses"] / n,
        "mb_per_token": d["bytes_read"] / n / 1e6,
        "wait_ms_per_token": 1e3 * wait / n,
        "compute_ms_per_token": 1e3 * max(0.0, secs - wait) / n,
        "hit_rate": hits / max(1, hits + d["misses"]),
        "store_gb_s": d["bytes_read"] / busy / 1e9 if busy > 0 else None,
        "io_busy_share": busy / secs if secs > 0 else None,
        "recall": d["recalled_router"] / d["routed_router"] if d["routed_router"] else None,
        "precision": d["prefetch_useful"] / d["prefetch_issued"] if d["prefetch_issued"] else None,
        "acceptance": st["acceptance_rate"],
        "draft_s": st["draft_seconds"],
        "verify_s": st["verify_seconds"],
        "depth_histogram": st["depth_histogram"],
        "pinned_bytes": end["pinned_bytes"],
        "mtp_resident": bool(resident),
        "draft_run": draft,
    }


def _parse_cell(text: str, ap: argparse.ArgumentParser) -> tuple[float, str, str, str]:
    """``BUDGET:DRAFT:PREFETCH:PINS`` as a grid tuple."""
    parts = text.split(":")
    if len(parts) != 4 or parts[1] not in DRAFTS or parts[3] not in ("off", "learned"):
        ap.error(f"bad cell {text!r}; expected BUDGET:DRAFT:PREFETCH:PINS, e.g. 0.1:auto:real:off")
    try:
        budget = float(parts[0])
    except ValueError:
        ap.error(f"bad budget in cell {text!r}")
    return budget, parts[1], parts[2], parts[3]


def fmt(v: Any, spec: str = ".2f") -> str:
    return "-" if v is None else format(v, spec)


def _parser() -> argparse.ArgumentParser:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("model", type=Path, help="a stand-in (tools/make_standin.py)")
    ap.add_argument(
        "--budgets",
        type=float,
        nargs="+",
        default=[0.0, 0.10, 0.25, 0.50],
        help="RAM budgets as shares of the main layers' routed-expert bytes",
    )
    ap.add_argument("--drafts", nargs="+", default=list(DRAFTS), choices=list(DRAFTS))
    ap.add_argument(
        "--prefetch", nargs="+", default=["off", "real"], choices=["off", "hint", "real", "auto"]
    )
    ap.add_argument("--pins", nargs="+", default=["off", "learned"], choices=["off", "learned"])
    ap.add_argument(
        "--cells",
        nargs="+",
        default=None,
        metavar="BUDGET:DRAFT:PREFETCH:PINS",
        help="an explicit list of cells (e.g. 0.1:auto:real:learned) instead of the grid",
    )
    ap.add_argument(
        "--runs", type=int, default=4, help="interleaved rounds, odd ones reversed (median)"
    )
    ap.add_argument("--tokens", type=int, default=64, help="new tokens per run")
    ap.add_argument("--learn-tokens", type=int, default=64)
    ap.add_argument(
        "--learn-workload",
        default="other",
        choices=["other", "same"],
        help="what teaches the learned pins: a different workload (stdlib-style code, the "
        "default) or unseen prompts of the measured kind (numpy-style code)",
    )
    ap.add_argument("--io", default="direct", choices=["direct", "pread", "mmap"])
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument(
        "--pin-mtp",
        nargs="?",
        const="on",
        default="off",
        choices=["off", "on", "auto"],
        help="keep the MTP layer resident (on: the proportional table; auto: per cell, as "
        "colibri.Model's default pin_mtp='auto' decides)",
    )
    ap.add_argument("--io-threads", type=int, default=4, help="the store's demand threads")
    ap.add_argument("--jsonl", type=Path, default=None, help="append every run here")
    return ap


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    ap = _parser()
    args = ap.parse_args(argv)
    if args.runs < 1 or args.tokens < 2:
        ap.error("--runs must be >= 1 and --tokens >= 2")

    model = args.model
    cfg = json.loads((model / "config.json").read_text())
    tok = Tokenizer.from_file(str(model / "tokenizer.json"))
    ids = tok.encode(TEST_PROMPT).ids
    probe = _core.Engine(
        str(model), io=args.io, ram_budget=0, prefetch="off", pin="off", usage_file=False
    )
    shape = probe.expert_stats()["layers"]
    mtp_layer = cfg["num_hidden_layers"]
    del probe
    # Bytes of one main-layer expert and of all of them (the budget's 100%).
    expert_bytes = _expert_bytes(model, cfg)
    layers = sorted(int(layer) for layer in shape)
    main_layers = [layer for layer in layers if layer < mtp_layer]
    total = expert_bytes * cfg["n_routed_experts"] * len(main_layers)
    resident = [mtp_layer] if args.pin_mtp == "on" and mtp_layer in layers else []
    args.mtp_layer = mtp_layer if mtp_layer in layers else None
    cells = _cells(args, ap)
    learned_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"colibri-learned-{os.getpid()}.json"
    relative = Path("unused")
    same = args.learn_workload == "same"
    kind = "unseen prompts of the same kind" if same else "a different workload"
    if "learned" in args.pins:
        prompts = SAME_KIND_PROMPTS if same else LEARN_PROMPTS
        print(f"learning pins on {kind} ...", file=sys.stderr)
        relative = learn(model, tok, args.learn_tokens, resident, learned_file, total // 2, prompts)
    usage = UsageFile(learned_file, relative)
    where = "resident" if resident else "streamed"
    where = "per cell (pin_mtp auto)" if args.pin_mtp == "auto" else where
    print(
        f"model {model}: {len(main_layers)} MoE layers x {cfg['n_routed_experts']} experts x "
        f"{expert_bytes / 1e6:.1f} MB = {total / 1e9:.2f} GB routed; top-"
        f"{cfg['num_experts_per_tok']}; MTP layer "
        f"{where}; "
        f"io {args.io}; prompt {len(ids)} tokens, {args.tokens} new",
        file=sys.stderr,
    )
    results, bandwidths = _run_rounds(model, ids, cells, args, total, expert_bytes, resident, usage)
    learned_file.unlink(missing_ok=True)
    bw = statistics.median(bandwidths)
    print(
        f"\ndisk bandwidth (random {expert_bytes / 1e6:.1f} MB O_DIRECT reads, "
        f"{args.io_threads} threads): median {bw / 1e9:.2f} GB/s "
        f"(rounds: {', '.join(f'{b / 1e9:.2f}' for b in bandwidths)})"
    )
    if args.pin_mtp == "auto":
        print("MTP layer: pin_mtp auto (per cell: resident when the cell drafts and it fits)")
    else:
        print("MTP layer: " + ("resident (proportional table)" if resident else "streamed (naive)"))
    if "learned" in args.pins:
        print(f"learned pins: taught by {kind}")
    _print_table(cells, results, bw)
    return 0


def _cells(args: argparse.Namespace, ap: argparse.ArgumentParser) -> list[dict[str, Any]]:
    """The cells to run (``--cells``, else the grid; none with pins and no budget), and
    ``args.pins`` made to say whether any of them learns pins."""
    grid = itertools.product(args.budgets, args.drafts, args.prefetch, args.pins)
    if args.cells:
        grid = (_parse_cell(c, ap) for c in args.cells)  # type: ignore[assignment]
    cells = [
        {"budget": b, "draft": d, "prefetch": p, "pins": pin}
        for b, d, p, pin in grid
        if not (pin == "learned" and b == 0)  # no budget, no pins
    ]
    if not any(c["pins"] == "learned" for c in cells):
        args.pins = [p for p in args.pins if p != "learned"]
    elif "learned" not in args.pins:
        args.pins = [*args.pins, "learned"]
    return cells


def _run_rounds(
    model: Path,
    ids: list[int],
    cells: list[dict[str, Any]],
    args: argparse.Namespace,
    total: int,
    expert_bytes: int,
    resident: list[int],
    usage: UsageFile,
) -> tuple[dict[int, list[dict[str, Any]]], list[float]]:
    """``--runs`` rounds of every cell, each after a measurement of the disk: the runs of
    each cell (by its index) and the disk bandwidth of each round. Exits when a cell's
    greedy tokens differ from the first run's."""
    results: dict[int, list[dict[str, Any]]] = {i: [] for i in range(len(cells))}
    bandwidths = []
    reference: list[int] | None = None
    for r in range(args.runs):
        bw = disk_bandwidth(model, expert_bytes, args.io_threads, 24, seed=r)
        bandwidths.append(bw)
        print(f"round {r + 1}/{args.runs}: disk {bw / 1e9:.2f} GB/s", file=sys.stderr)
        # Odd rounds run the cells in reverse: on a virtual disk whose host caches re-read
        # blocks, a cell run right after another of the same routing reads faster, and a
        # fixed order biased every "x plain" ratio by its cell's position (docs/benchmarks.md).
        order = list(enumerate(cells))
        for i, cell in order if r % 2 == 0 else reversed(order):
            res = run_cell(model, ids, cell, args, int(cell["budget"] * total), resident, usage)
            res.update(round=r, disk_bw=bw)
            if reference is None:
                reference = res["tokens"]
            if res["tokens"] != reference:
                raise SystemExit(f"error: cell {cell} generated different tokens")
            results[i].append(res)
            if args.jsonl:
                with args.jsonl.open("a") as f:
                    f.write(json.dumps(res) + "\n")
            print(f"  {cell}: {res['tok_s']:.2f} tok/s", file=sys.stderr)
    return results, bandwidths


def _print_table(
    cells: list[dict[str, Any]], results: dict[int, list[dict[str, Any]]], bw: float
) -> None:
    """The markdown table: each cell's medians, its speed-up over the cell without draft and
    prefetch, and the tok/s the disk's bandwidth ``bw`` allows for the bytes it reads."""
    print(
        "\n| budget | draft | prefetch | pins | tok/s | x plain | tok/fwd | loads/tok | MB/tok "
        "| wait ms/tok | compute ms/tok | hit rate | recall | precision | store GB/s "
        "| ceiling tok/s |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    med: dict[tuple[Any, ...], float] = {}
    for i, cell in enumerate(cells):
        runs = results[i]

        def m(key: str, runs: list[dict[str, Any]] = runs) -> float | None:
            vals = [x[key] for x in runs if x[key] is not None]
            return statistics.median(vals) if vals else None

        tok_s = m("tok_s") or 0.0
        med[(cell["budget"], cell["draft"], cell["prefetch"], cell["pins"])] = tok_s
        plain = med.get((cell["budget"], "off", "off", cell["pins"]))
        mb = m("mb_per_token") or 0.0
        ceiling = bw / (mb * 1e6) if mb > 0 else None
        print(
            f"| {cell['budget']:.0%} | {cell['draft']} | {cell['prefetch']} | {cell['pins']} | "
            f"{tok_s:.2f} | {fmt(tok_s / plain if plain else None)} | "
            f"{fmt(m('tokens_per_forward'))} | {fmt(m('loads_per_token'))} | {mb:.1f} | "
            f"{fmt(m('wait_ms_per_token'), '.0f')} | {fmt(m('compute_ms_per_token'), '.0f')} | "
            f"{fmt(m('hit_rate'))} | {fmt(m('recall'))} | {fmt(m('precision'))} | "
            f"{fmt(m('store_gb_s'))} | {fmt(ceiling)} |"
        )


def _expert_bytes(model: Path, cfg: dict[str, Any]) -> int:
    """Stored bytes of one main-layer routed expert (its six tensors)."""
    import struct

    prefix = "model.layers.{}.mlp.experts.0.".format(cfg.get("first_k_dense_replace", 1))
    total = 0
    for shard in model.glob("*.safetensors"):
        with shard.open("rb") as f:
            (n,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(n))
        for name, info in header.items():
            if name.startswith(prefix) and isinstance(info, dict):
                a, b = info["data_offsets"]
                total += b - a
    if not total:
        raise SystemExit(f"error: no routed expert {prefix}* in {model}")
    return total


if __name__ == "__main__":
    raise SystemExit(main())
