"""colibri and llama.cpp side by side on one synthetic DeepSeek-V3-shaped model.

One command builds everything it needs outside the repository, in a cache directory:

1. a venv with llama-cpp-python (pinned, built from the PyPI sdist with native CPU flags and
   OpenMP) and gguf-py — never a dependency of colibri;
2. a random DeepSeek-V3-shaped BF16 checkpoint (tools/make_big_checkpoint.py's tensors, the
   config below), with a byte-level BPE tokenizer both engines read;
3. the same checkpoint converted for both engines: ``colibri convert`` (defaults) and a BF16
   GGUF (written with gguf-py, no torch), quantised by llama.cpp to Q4_0 and Q4_K_M.

It then measures, each measurement in a fresh process, engines alternated within each round,
medians over the rounds: decode tok/s after 8- and 512-token prompts, prefill tok/s of 512
and 2,048 tokens, and each process's peak RSS; plus, in the same run (before and after the
rounds), the 2-thread streaming-read bandwidth, the f32 FMA ceiling and the int8 VNNI ceiling
(a small probe compiled with rustc, the method of benches/probes.rs). It prints a markdown
table with each ratio beside its goal (colibri over llama.cpp, tok/s times bytes per token over the
measured bandwidth) and writes JSON.

    python tools/bench_llamacpp.py --cache /work/llamabench            # full size, 3 rounds
    python tools/bench_llamacpp.py --cache /tmp/lb --quick             # tiny model, 1 round

Token ids are fed directly (random ids, the same for both engines). colibri runs in the
interpreter that runs this script (or ``--colibri-python``), from a snapshot of its colibri
package copied at the start, so a rebuild during the run cannot change what is measured.

This file is the driver: the command line, the steps of a run and the subcommands its child
processes run. The work is in the modules beside it: ``_bench_llamacpp_model`` (the model,
its flops and tokenizer), ``_bench_llamacpp_gguf`` (the GGUFs), ``_bench_llamacpp_workers``
(one measurement in a process), ``_bench_llamacpp_measure`` (running them on a shared
machine), ``_bench_llamacpp_probe`` (the machine's ceilings), ``_bench_llamacpp_env`` (the
llama.cpp venv, the colibri snapshot, the CPU) and ``_bench_llamacpp_report`` (medians,
ratios, tables).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _bench_llamacpp_env import (
    CMAKE_ARGS,
    colibri_info,
    cpu_flags,
    default_cmake_args,
    llama_facts,
    llama_venv,
    log,
    lscpu,
    snapshot_colibri,
)
from _bench_llamacpp_gguf import gguf_bytes, quantize, write_gguf
from _bench_llamacpp_measure import KINDS, measure
from _bench_llamacpp_model import (
    ROOT,
    bench_config,
    config_hash,
    flops_per_token,
    make_checkpoint,
    matmuls,
    params,
    vocab,
    write_tokenizer,
)
from _bench_llamacpp_probe import probe
from _bench_llamacpp_report import report, results
from _bench_llamacpp_workers import WARMUP_GEN, WARMUP_PROMPT, worker_colibri, worker_llama

#: What tests use of this script, wherever it is defined.
__all__ = [
    "CMAKE_ARGS",
    "bench_config",
    "colibri_info",
    "default_cmake_args",
    "flops_per_token",
    "main",
    "make_checkpoint",
    "matmuls",
    "params",
    "report",
    "results",
    "vocab",
    "write_tokenizer",
]


def parse_args() -> argparse.Namespace:
    """The command line."""
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--cache",
        type=Path,
        default=Path("/work/llamabench"),
        help="where the venv, checkpoints and GGUFs live (outside the repository)",
    )
    ap.add_argument("--quick", action="store_true", help="tiny model, 1 round, short prompts")
    ap.add_argument("--rounds", type=int, default=None, help="rounds (default 3, quick 1)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--gen", type=int, default=None, help="decode tokens (default 64, quick 16)")
    ap.add_argument("--types", nargs="+", default=["Q4_0", "Q4_K_M"], help="llama.cpp quant types")
    ap.add_argument(
        "--colibri-python",
        default=sys.executable,
        help="the interpreter that imports colibri (default: this one)",
    )
    ap.add_argument(
        "--no-snapshot",
        action="store_true",
        help="run the installed colibri package instead of a copy of it",
    )
    ap.add_argument(
        "--cmake-args",
        default=default_cmake_args(cpu_flags()),
        help="llama.cpp's build options (default: native; AMX left out where the CPU has it)",
    )
    ap.add_argument("--probe-gib", type=int, default=1)
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per measurement")
    ap.add_argument("--keep-bf16-gguf", action="store_true")
    ap.add_argument(
        "--max-others",
        type=float,
        default=0.3,
        help="cores other processes may use during a measurement before it is repeated",
    )
    ap.add_argument("--attempts", type=int, default=3, help="tries per measurement")
    ap.add_argument("--quiet-wait", type=float, default=120, help="seconds to wait for quiet")
    ap.add_argument("--json", type=Path, default=None, help="default: CACHE/results-<time>.json")
    return ap.parse_args()


def main() -> None:
    args = parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    args.gen = args.gen or (16 if args.quick else 64)
    cache = args.cache.resolve()
    if cache == ROOT or ROOT in cache.parents:
        raise SystemExit("--cache must be outside the repository")
    cache.mkdir(parents=True, exist_ok=True)

    cfg = bench_config(args.quick)
    tag = ("quick-" if args.quick else "dsv3-") + config_hash(cfg)
    work = cache / tag
    work.mkdir(exist_ok=True)
    llama_py = llama_venv(cache, args.cmake_args)

    hf, col_dir = work / "hf-bf16", work / "colibri"
    if not (hf / "config.json").exists():
        log(f"writing the BF16 checkpoint to {hf}")
        make_checkpoint(hf, cfg)
    snap, col_facts = snapshot_colibri(args.colibri_python, cache)
    col_env = {} if args.no_snapshot else {"PYTHONPATH": str(snap)}
    log(
        f"colibri from {col_facts['source']} (commit {col_facts.get('commit')}, "
        f"dirty {col_facts.get('dirty')}), prefill option: {col_facts['prefill']}"
    )
    if not (col_dir / "config.json").exists():
        convert_for_colibri(args.colibri_python, hf, col_dir, col_env)
    ggufs = write_ggufs(args, llama_py, hf, work)

    total, active = params(cfg)
    model = {
        "config": cfg,
        "params_2d": total,
        "params_per_token": active,
        "flops_per_token": flops_per_token(cfg),
        "hf_bf16_bytes": sum(f.stat().st_size for f in hf.glob("*.safetensors")),
    }
    col = colibri_info(args.colibri_python, snap, col_dir, cfg)
    variants = colibri_variants(args, col_facts, col_dir, col_env, col)
    variants += llama_variants(llama_py, ggufs, hf)
    facts = run_facts(args, rounds, col_facts, llama_py)
    log("probe: bandwidth / FMA / VNNI")
    probes = [probe(cache, args.threads, args.probe_gib)]
    log(f"  {probes[0]}")
    out = args.json or cache / f"results-{tag}-{time.strftime('%Y%m%d-%H%M%S')}.json"
    rows: list[dict[str, Any]] = []
    for rnd in range(rounds):
        order = variants if rnd % 2 == 0 else variants[::-1]
        for kind in KINDS:
            rows += measure_kind(kind, rnd, order, args)
            partial = results(facts, model, col, probes, variants, rows)
            out.write_text(json.dumps(partial, indent=1))
    probes.append(probe(cache, args.threads, args.probe_gib))
    log(f"  {probes[-1]}")
    facts["loadavg_end"] = os.getloadavg()
    res = results(facts, model, col, probes, variants, rows)
    out.write_text(json.dumps(res, indent=1))
    print(report(res))
    print(f"\nJSON: {out}")


def convert_for_colibri(py: str, hf: Path, col_dir: Path, env: dict[str, str]) -> None:
    """``colibri convert`` of the checkpoint, with the interpreter (and snapshot) measured."""
    log(f"colibri convert -> {col_dir}")
    t0 = time.perf_counter()
    code = "import sys; from colibri.convert import convert; convert(sys.argv[1], sys.argv[2])"
    subprocess.run(
        [py, "-c", code, str(hf), str(col_dir)],
        check=True,
        env=dict(os.environ, **env),
    )
    log(f"  {time.perf_counter() - t0:.0f} s")


def write_ggufs(args: argparse.Namespace, llama_py: Path, hf: Path, work: Path) -> dict[str, Path]:
    """The GGUF of each ``--types`` (written once, in the llama.cpp venv): the BF16 GGUF, then
    llama.cpp's quantisations of it."""
    ggufs = {t: work / f"model-{t}.gguf" for t in args.types}
    bf16 = work / "model-BF16.gguf"
    me = str(Path(__file__).resolve())
    if not all(p.exists() for p in ggufs.values()):
        if not bf16.exists():
            log(f"writing {bf16}")
            subprocess.run([str(llama_py), me, "_gguf", str(hf), str(bf16)], check=True)
        for t, p in ggufs.items():
            if not p.exists():
                log(f"llama_model_quantize {t} -> {p}")
                t0 = time.perf_counter()
                subprocess.run(
                    [str(llama_py), me, "_quantize", str(bf16), str(p), t, str(args.threads)],
                    check=True,
                )
                log(f"  {time.perf_counter() - t0:.0f} s")
        if not args.keep_bf16_gguf:
            bf16.unlink()
    return ggufs


def colibri_variants(
    args: argparse.Namespace,
    col_facts: dict[str, Any],
    col_dir: Path,
    col_env: dict[str, str],
    col: dict[str, Any],
) -> list[dict[str, Any]]:
    """colibri's variants: one per prefill arithmetic, then n-gram drafting."""
    variants: list[dict[str, Any]] = []
    # Every prefill arithmetic colibri offers ("auto" picks one of them), else its only one.
    modes = [m for m in col_facts["prefill_modes"] if m != "auto"] if col_facts["prefill"] else []
    modes = modes or [None]
    for mode in modes:
        variants.append(
            {
                "name": "colibri" + (f" prefill={mode}" if mode else ""),
                "engine": "colibri",
                "python": args.colibri_python,
                "worker": "_colibri",
                "model": str(col_dir),
                "prefill": mode,
                "draft": "off",
                "env": col_env,
                "kinds": list(KINDS),
                "bytes_per_token": col["bytes_per_token"],
                "file_bytes": col["file_bytes"],
            }
        )
    variants.append(
        {
            "name": "colibri draft=auto (ngram)",
            "engine": "colibri",
            "python": args.colibri_python,
            "worker": "_colibri",
            "model": str(col_dir),
            "prefill": None,
            "draft": "auto",
            "env": col_env,
            "kinds": ["d8", "p512"],
            "bytes_per_token": col["bytes_per_token"],
            "file_bytes": col["file_bytes"],
        }
    )
    return variants


def llama_variants(llama_py: Path, ggufs: dict[str, Path], hf: Path) -> list[dict[str, Any]]:
    """llama.cpp's variants: one per GGUF, with the bytes a token reads from it."""
    me = str(Path(__file__).resolve())
    variants: list[dict[str, Any]] = []
    for t, p in ggufs.items():
        gb = json.loads(
            subprocess.run(
                [str(llama_py), me, "_ggufbytes", str(p), str(hf / "config.json")],
                check=True,
                capture_output=True,
                text=True,
            ).stdout
        )
        variants.append(
            {
                "name": f"llama.cpp {t}",
                "engine": "llama.cpp",
                "python": str(llama_py),
                "worker": "_llama",
                "model": str(p),
                "kinds": list(KINDS),
                "bytes_per_token": gb["bytes_per_token"],
                "file_bytes": gb["file_bytes"],
                "gguf_types": gb["types"],
            }
        )
    return variants


def run_facts(
    args: argparse.Namespace, rounds: int, col_facts: dict[str, Any], llama_py: Path
) -> dict[str, Any]:
    """The machine, both engines' builds and the run's settings, for the JSON."""
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpu": lscpu("Model name"),
        "cpu_flags": sorted(
            f
            for f in (lscpu("Flags") or "").split()
            if f.startswith(("avx512", "avx_vnni", "amx", "fma", "avx2"))
        ),
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "loadavg_start": os.getloadavg(),
        "colibri": col_facts,
        "llama": {**llama_facts(llama_py), "cmake_args": args.cmake_args},
        "quick": args.quick,
        "rounds": rounds,
        "gen": args.gen,
        "warmup": f"{WARMUP_PROMPT}-token prompt + {WARMUP_GEN} tokens in the same process",
    }


def measure_kind(
    kind: str, rnd: int, order: list[dict[str, Any]], args: argparse.Namespace
) -> list[dict[str, Any]]:
    """Round ``rnd``'s measurements of ``kind``: each variant that has it, in ``order``."""
    rows: list[dict[str, Any]] = []
    for v in order:
        if kind not in v["kinds"]:
            continue
        r = measure(v, kind, args)
        r.update(variant=v["name"], round=rnd)
        rows.append(r)
        log(
            f"round {rnd} {v['name']:<28} {kind:<6} prefill {r['prefill_tok_s']:7.1f} "
            f"decode {r['decode_tok_s'] or 0:6.1f} tok/s  RSS {r['VmHWM'] / 2**20:6.0f} MiB"
            f"  others {r['others_cores']:.2f} cores"
        )
    return rows


def sub() -> None:
    """The internal subcommands this script runs in the child processes."""
    cmd = sys.argv[1]
    if cmd == "_gguf":
        write_gguf(Path(sys.argv[2]), Path(sys.argv[3]))
    elif cmd == "_quantize":
        quantize(Path(sys.argv[2]), Path(sys.argv[3]), sys.argv[4], int(sys.argv[5]))
    elif cmd == "_ggufbytes":
        cfg = json.loads(Path(sys.argv[3]).read_text())
        print(json.dumps(gguf_bytes(Path(sys.argv[2]), cfg)))
    else:
        ap = argparse.ArgumentParser()
        ap.add_argument("model")
        ap.add_argument("--threads", type=int, default=2)
        ap.add_argument("--prompt", type=int, required=True)
        ap.add_argument("--gen", type=int, required=True)
        ap.add_argument("--prefill", default=None)
        ap.add_argument("--draft", default="off")
        a = ap.parse_args(sys.argv[2:])
        r = worker_colibri(a) if cmd == "_colibri" else worker_llama(a)
        print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1].startswith("_"):
        sub()
    else:
        main()
