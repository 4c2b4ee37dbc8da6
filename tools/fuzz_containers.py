"""Mutation fuzzer for whole model directories: copies a small model, mutates its shard
(header JSON fields, bit flips, truncation, non-finite floats) or its config.json, then opens
and runs it in a worker subprocess and classifies what happened:

- ``ok``: it loaded and generated;
- ``typed``: a ``ColibriError`` other than ``InternalError`` (the promise for bad files);
- ``untyped``: any other exception, or ``InternalError``;
- ``crash``: the worker died of a signal; ``hang``: it passed the per-case time limit.

Workers run many cases each (one process per case would spend its time importing); a worker
that crashes or hangs is replaced and its case recorded. Exits non-zero if any case was
``untyped``, ``crash`` or ``hang``, printing the seeds to reproduce them.

    python tools/fuzz_containers.py --model DIR --seconds 60 [--workers 2] [--seed 0]
    python tools/fuzz_containers.py --model DIR --replay 1234      # one case, verbose

``--model`` defaults to the ``dsv3_a`` test fixture with a byte tokenizer (built in a
temporary directory). Cases are deterministic functions of (seed, case number).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import struct
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

#: Seconds one case may take (load + a 4-token generation + logits of the tiny model).
CASE_TIMEOUT = 20.0

WORKER = r"""
import sys, json, traceback
import colibri
from colibri import errors
for line in sys.stdin:
    d = line.strip()
    print("START", flush=True)
    try:
        m = colibri.Model(d, threads=1, ram_budget="16MiB")
        m.generate([5, 6, 7], max_new_tokens=4, temperature=0, stop_token_ids=[])
        m.generate("hi", max_new_tokens=2, temperature=0.7, seed=1, draft="off")
        m.logits([1, 2, 3])
        out = "ok"
    except errors.InternalError as e:
        out = "untyped InternalError: " + str(e)[:300]
    except errors.ColibriError as e:
        out = "typed " + type(e).__name__ + ": " + str(e)[:200]
    except Exception as e:
        tb = traceback.format_exc()[-600:].replace("\n", " | ")
        out = "untyped " + type(e).__name__ + ": " + str(e)[:300] + " " + tb
    print("DONE " + out.replace("\n", " "), flush=True)
"""


def read_shard(p: Path) -> tuple[dict[str, object], bytes]:
    raw = p.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def write_shard(p: Path, header: dict[str, object], data: bytes) -> None:
    text = json.dumps(header).encode()
    p.write_bytes(struct.pack("<Q", len(text)) + text + data)


INTERESTING_INTS = [0, 1, -1, 2, 7, 8, 255, 256, 2**31 - 1, 2**31, 2**32, 2**53, 2**63 - 1, 2**64]
INTERESTING_FLOATS = [float("nan"), float("inf"), -float("inf"), 3e38, -3e38, 1e20, 0.0, -0.0]
DTYPES = ["U8", "I8", "F16", "BF16", "F32", "F64", "I64", "BOOL", "F8_E4M3", "F8_E5M2", "X"]


def mutate(rng: random.Random, d: Path) -> str:
    """Apply one or two random mutations to the model at ``d``; returns what was done."""
    shard = next(iter(sorted(d.glob("*.safetensors"))))
    done = []
    for _ in range(rng.choice([1, 1, 2])):
        kind = rng.choice(
            ["field", "field", "bitflip", "truncate", "float", "float", "config", "meta"]
        )
        try:
            header, data = read_shard(shard)
        except (ValueError, struct.error, UnicodeDecodeError):
            break  # an earlier mutation broke the header: nothing structured to change
        names = [k for k in header if k != "__metadata__"]
        if not names:
            break
        name = rng.choice(names)
        info = header[name]
        assert isinstance(info, dict)
        if kind == "field":
            what = rng.choice(["dtype", "shape", "offsets", "drop", "dup"])
            if what == "dtype":
                info["dtype"] = rng.choice(DTYPES)
            elif what == "shape":
                shape = list(info["shape"])
                if shape and rng.random() < 0.7:
                    shape[rng.randrange(len(shape))] = rng.choice(INTERESTING_INTS)
                else:
                    shape = [rng.choice(INTERESTING_INTS) for _ in range(rng.randrange(4))]
                info["shape"] = shape
            elif what == "offsets":
                offs = list(info["data_offsets"])
                offs[rng.randrange(2)] = rng.choice([*INTERESTING_INTS, offs[0] + 1])
                info["data_offsets"] = offs
            elif what == "drop":
                del header[name]
            else:
                header[name + rng.choice(["", ".qs", "x"])] = dict(info)
            write_shard(shard, header, data)
            done.append(f"{what}:{name}")
        elif kind == "bitflip":
            raw = bytearray(shard.read_bytes())
            for _ in range(rng.randrange(1, 8)):
                i = rng.randrange(min(len(raw), 8 + 4096) if rng.random() < 0.5 else len(raw))
                raw[i] ^= 1 << rng.randrange(8)
            shard.write_bytes(bytes(raw))
            done.append("bitflip")
        elif kind == "truncate":
            raw = shard.read_bytes()
            cut = rng.randrange(len(raw))
            shard.write_bytes(raw[:cut])
            done.append(f"truncate:{cut}")
        elif kind == "float":
            if info.get("dtype") != "F32":
                continue
            start, end = info["data_offsets"]
            if end <= start:
                continue
            buf = bytearray(data)
            i = start + 4 * rng.randrange((end - start) // 4)
            buf[i : i + 4] = struct.pack("<f", rng.choice(INTERESTING_FLOATS))
            write_shard(shard, header, bytes(buf))
            done.append(f"float:{name}")
        elif kind == "config":
            cfg_path = d / "config.json"
            cfg = json.loads(cfg_path.read_text())
            key = rng.choice(sorted(cfg))
            cfg[key] = rng.choice(
                [*INTERESTING_INTS, *INTERESTING_FLOATS[:3], None, "x", [], {}, True]
            )
            cfg_path.write_text(json.dumps(cfg))
            done.append(f"config:{key}={cfg[key]!r}")
        else:
            meta = header.setdefault("__metadata__", {})
            assert isinstance(meta, dict)
            meta[rng.choice([name, "colibri_format_version"])] = rng.choice(
                ["int4", "int8", "int4_g64", "f32", "bf16", "2", "x"]
            )
            write_shard(shard, header, data)
            done.append(f"meta:{name}")
    return ",".join(done) or "none"


class Worker:
    def __init__(self, cache: Path) -> None:
        import queue
        import threading

        env = {**os.environ, "COLIBRI_CACHE_DIR": str(cache), "PYTHONFAULTHANDLER": "1"}
        self.proc = subprocess.Popen(
            [sys.executable, "-u", "-c", WORKER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
            env=env,
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # EOF

    def run(self, d: Path) -> str:
        """The outcome of one case (``ok``/``typed …``/``untyped …``/``crash …``/``hang``)."""
        import queue

        assert self.proc.stdin
        self.proc.stdin.write(f"{d}\n")
        self.proc.stdin.flush()
        deadline = time.monotonic() + CASE_TIMEOUT
        while True:
            try:
                line = self.lines.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                self.proc.kill()
                self.proc.wait()
                return "hang"
            if not line:
                code = self.proc.wait()
                return f"crash signal {-code}" if code < 0 else f"crash exit {code}"
            if line.startswith("DONE "):
                return line[5:].strip()

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self) -> None:
        if self.alive():
            self.proc.kill()
            self.proc.wait()


def default_model(tmp: Path) -> Path:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_test_model  # type: ignore[import-not-found]

    return make_test_model(tmp / "base")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path)
    ap.add_argument("--seconds", type=float, default=60.0)
    ap.add_argument("--cases", type=int, default=0, help="stop after this many (0: time only)")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--replay", type=int, help="run one case number and print it")
    a = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="colibri-fuzz-"))
    try:
        base = a.model or default_model(tmp)
        workers = [Worker(tmp / "cache") for _ in range(max(1, a.workers))]
        counts: Counter[str] = Counter()
        kinds: Counter[str] = Counter()
        bad: list[tuple[int, str, str]] = []
        samples: dict[str, str] = {}
        start = time.monotonic()
        case = a.replay if a.replay is not None else 0
        from concurrent.futures import ThreadPoolExecutor

        def one(i: int, w: int) -> tuple[int, str, str]:
            d = tmp / f"case-{w}"
            shutil.rmtree(d, ignore_errors=True)
            shutil.copytree(base, d)
            what = mutate(random.Random(f"{a.seed}:{i}"), d)
            if not workers[w].alive():
                workers[w] = Worker(tmp / "cache")
            out = workers[w].run(d)
            if out.startswith(("crash", "hang")):
                workers[w].close()
            return i, what, out

        with ThreadPoolExecutor(len(workers)) as pool:
            while True:
                if a.replay is not None:
                    batch = [(case, 0)]
                else:
                    batch = [(case + w, w) for w in range(len(workers))]
                for i, what, out in pool.map(lambda iw: one(*iw), batch):
                    cls = out.split(" ", 1)[0]
                    counts[cls] += 1
                    if cls == "typed":
                        kinds[out.split(" ", 2)[1].rstrip(":")] += 1
                    key = out[:60] if cls == "typed" else cls
                    samples.setdefault(key, f"case {i} [{what}]: {out[:300]}")
                    if cls in ("untyped", "crash", "hang"):
                        bad.append((i, what, out))
                    if a.replay is not None:
                        print(f"case {i} [{what}]: {out}")
                case += len(batch)
                if a.replay is not None:
                    break
                if time.monotonic() - start > a.seconds or (a.cases and case >= a.cases):
                    break
        for w in workers:
            w.close()
        elapsed = time.monotonic() - start
        print(
            f"fuzz_containers: {sum(counts.values())} cases in {elapsed:.0f} s (seed {a.seed}): "
            + ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
        )
        print("  typed: " + ", ".join(f"{k} {v}" for k, v in kinds.most_common()))
        distinct = sorted(k for k in samples if k not in ("ok",))
        print(f"  {len(distinct)} distinct outcomes; e.g.:")
        for k in distinct[:12]:
            print("   ", samples[k])
        for i, what, out in bad[:20]:
            print(f"  BAD case {i} [{what}]: {out[:500]}")
            print(f"    replay: python tools/fuzz_containers.py --seed {a.seed} --replay {i}")
        return 1 if bad else 0
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
