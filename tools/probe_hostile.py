"""Re-runs the hostile-input probe of saved contexts, the spill directory, the server and the
converter, point by point, and prints one JSON object of findings (docs/reliability.md,
"The hostile-input probe", has the figures).

Everything is built in a temporary directory from the model shipped in the package
(``python/colibri/models/tiny``, or ``--model``); the server listens on 127.0.0.1 only. Each
check that could hang runs in a subprocess under a timeout, so a hang is reported, not
waited for. Budgets are small by default (a few minutes on two cores); ``--only`` runs some
sections (``saved``, ``spill``, ``server``, ``rss``, ``convert``), ``--quick`` fewer cases.

    python tools/probe_hostile.py                   # every section
    python tools/probe_hostile.py --only rss        # peak RSS above idle per request kind

Each finding has ``ok`` (the promise held) and what was counted; the exit status is 1 when
any finding is not ok. Some checks need root (a character device made with ``mknod``) and
are reported as skipped otherwise.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import http.client
import json
import os
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "python" / "colibri" / "models" / "tiny"
PREFIX = 16 + 4 + 4 + 8  # magic, version, header CRC, header length
MIB = 2**20

Finding = dict[str, Any]


def _env(**extra: str) -> dict[str, str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT / "python"), **extra}
    return env


def run_py(
    code: str, *args: str, timeout: float = 120, env: dict[str, str] | None = None
) -> Finding:
    """``code`` in a fresh interpreter under ``timeout``: its exit status, last stdout line
    (JSON when it printed one), stderr tail and whether it hung."""
    t = time.monotonic()
    try:
        r = subprocess.run(
            [sys.executable, "-c", code, *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env or _env(),
            cwd=ROOT,
        )
    except subprocess.TimeoutExpired:
        return {"hung": True, "seconds": round(time.monotonic() - t, 2)}
    out: Finding = {"hung": False, "rc": r.returncode, "seconds": round(time.monotonic() - t, 2)}
    lines = r.stdout.strip().splitlines()
    if lines:
        try:
            out["result"] = json.loads(lines[-1])
        except json.JSONDecodeError:
            out["stdout"] = lines[-1][-500:]
    if r.returncode != 0:
        out["stderr"] = r.stderr[-1500:]
    return out


# ------------------------------------------------------------------------- saved contexts

_CLASSIFY = """
import json, sys, colibri
def kind(e):
    if not isinstance(e, colibri.ColibriError) or isinstance(e, colibri.InternalError):
        return "untyped:" + type(e).__name__
    return type(e).__name__
"""


def probe_fifo_load(tmp: Path, model: Path) -> Finding:
    fifo = tmp / "ctx.fifo"
    os.mkfifo(fifo)
    code = _CLASSIFY + (
        "m = colibri.Model(sys.argv[1], threads=1)\n"
        "try:\n    m.load_session(sys.argv[2]); print(json.dumps('loaded'))\n"
        "except Exception as e:\n    print(json.dumps([kind(e), str(e)[:200]]))\n"
    )
    r = run_py(code, str(model), str(fifo), timeout=60)
    err = (r.get("result") or ["?"])[0]
    ok = not r["hung"] and err == "SavedContextError"
    return {"ok": ok, **r}


def _saved_context(model: Any, path: Path, prompt: str = "def add(a, b):") -> bytes:
    s = model.session()
    s.prefill(prompt)
    s.save(path)
    return path.read_bytes()


def probe_header_flips(tmp: Path, model: Any, quick: bool) -> Finding:
    """Every bit of the prefix and header JSON flipped, one at a time: how many load."""
    import colibri

    good = _saved_context(model, tmp / "good.ctx")
    header_end = PREFIX + struct.unpack_from("<Q", good, 24)[0]
    bits = range(0, header_end * 8, 7 if quick else 1)
    loaded, untyped, kinds = 0, 0, {}
    path = tmp / "flip.ctx"
    for bit in bits:
        data = bytearray(good)
        data[bit // 8] ^= 1 << (bit % 8)
        path.write_bytes(data)
        try:
            model.load_session(path)
            loaded += 1
        except colibri.ColibriError as e:
            if isinstance(e, colibri.InternalError):
                untyped += 1
            kinds[type(e).__name__] = kinds.get(type(e).__name__, 0) + 1
        except Exception as e:
            untyped += 1
            kinds["untyped:" + type(e).__name__] = kinds.get("untyped:" + type(e).__name__, 0) + 1
    return {
        "ok": loaded == 0 and untyped == 0,
        "flips": len(bits),
        "header_bytes": header_end,
        "loaded": loaded,
        "untyped": untyped,
        "errors": kinds,
    }


def probe_concurrent_saves(tmp: Path, model_dir: Path, quick: bool) -> Finding:
    """Two Models of one process save to one path from two threads while a third reads it."""
    import colibri

    a, b = colibri.Model(model_dir, threads=1), colibri.Model(model_dir, threads=1)
    path = tmp / "shared.ctx"
    sa, sb = a.session(), b.session()
    sa.prefill("def add(a, b):")
    sb.prefill("class Stack:\n    def push(self, x):")
    sa.save(path)
    rounds = 100 if quick else 200
    failures: list[str] = []
    stop = threading.Event()
    seen = {"reads": 0, "torn": 0, "tokens": set()}

    def saver(s: Any) -> None:
        for _ in range(rounds):
            try:
                s.save(path)
            except Exception as e:
                failures.append(f"{type(e).__name__}: {e}"[:200])

    def reader() -> None:
        while not stop.is_set():
            try:
                got = a.load_session(path)
                seen["tokens"].add(len(got.token_ids))
            except Exception:
                seen["torn"] += 1
            seen["reads"] += 1

    rd = threading.Thread(target=reader)
    rd.start()
    threads = [threading.Thread(target=saver, args=(s,)) for s in (sa, sb)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    stop.set()
    rd.join()
    temps = [p.name for p in tmp.iterdir() if p.name.startswith(".shared.ctx.tmp.")]
    return {
        "ok": not failures and seen["torn"] == 0 and not temps,
        "saves": 2 * rounds,
        "failed": len(failures),
        "first_failure": failures[:1],
        "reads": seen["reads"],
        "torn_reads": seen["torn"],
        "token_counts_seen": sorted(seen["tokens"]),
        "temporaries_left": len(temps),
    }


_SAVE_LOOP = """
import sys, colibri
m = colibri.Model(sys.argv[1], threads=1)
s = m.session()
s.prefill("def add(a, b):\\n    return a + b\\n" * 150)  # ~1,950 tokens, 4.5 MB
print("ready", flush=True)
while True:
    s.save(sys.argv[2])
"""


def probe_kills_mid_save(tmp: Path, model: Any, model_dir: Path, quick: bool) -> Finding:
    """SIGKILL a process that saves in a loop, many times; count the temporaries left, then
    save once from this process (the sweep) and count again."""
    import random

    d = tmp / "kills"
    d.mkdir()
    path = d / "ctx.ctx"
    rng = random.Random(0x5EED)
    kills = 10 if quick else 30
    left_by_a_kill = 0
    for _ in range(kills):
        p = subprocess.Popen(
            [sys.executable, "-c", _SAVE_LOOP, str(model_dir), str(path)],
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        assert p.stdout is not None
        p.stdout.readline()
        time.sleep(rng.uniform(0.0, 0.3))
        p.send_signal(signal.SIGKILL)
        p.wait()
        p.stdout.close()
        # (the next process's first save sweeps what this kill left: counted here)
        left_by_a_kill += any(q.name.startswith(".ctx.ctx.tmp.") for q in d.iterdir())
    left = [q for q in d.iterdir() if q.name.startswith(".ctx.ctx.tmp.")]
    left_bytes = sum(q.stat().st_size for q in left)
    # Saves still running must keep their temporaries: one of a live pid here, and one whose
    # pid is gone here but whose lock is held (a saver in another pid namespace).
    import fcntl

    pid_max = int(Path("/proc/sys/kernel/pid_max").read_text())
    alive = d / f".ctx.ctx.tmp.{os.getpid()}.999.0000000000000000"
    alive.write_bytes(b"x")
    elsewhere = d / f".ctx.ctx.tmp.{pid_max + 1}.999.0000000000000000"
    elsewhere.write_bytes(b"x")
    dead = d / f".ctx.ctx.tmp.{pid_max + 2}.999.0000000000000000"
    dead.write_bytes(b"x")
    with elsewhere.open("rb") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        s = model.session()
        s.prefill("x = 1")
        s.save(path)
    after = sorted(q.name for q in d.iterdir() if q.name.startswith(".ctx.ctx.tmp."))
    loads = True
    try:
        model.load_session(path)
    except Exception:
        loads = False
    ok = after == sorted([alive.name, elsewhere.name]) and loads
    return {
        "ok": ok,
        "kills": kills,
        "kills_that_left_a_temporary": left_by_a_kill,
        "temporaries_after_the_last_kill": len(left),
        "their_bytes": left_bytes,
        "dead_unlocked_left_after_next_save": dead.name in after,
        "live_pid_temporary_kept": alive.name in after,
        "locked_temporary_of_a_pid_gone_here_kept": elsewhere.name in after,
        "target_loads": loads,
    }


def probe_non_regular_targets(tmp: Path, model: Any) -> Finding:
    """Save over a FIFO, a directory and (as root) a character device made like /dev/full:
    refused, typed, and the thing at the path unchanged; never a wait."""
    import colibri

    s = model.session()
    s.prefill("x = 1")
    out: Finding = {}
    fifo = tmp / "target.fifo"
    os.mkfifo(fifo)
    targets: list[tuple[str, Path, Callable[[os.stat_result], bool]]] = [
        ("fifo", fifo, lambda m: stat.S_ISFIFO(m.st_mode)),
        ("directory", tmp, lambda m: stat.S_ISDIR(m.st_mode)),
    ]
    if os.geteuid() == 0:
        dev = tmp / "full"
        os.mknod(dev, 0o666 | stat.S_IFCHR, os.makedev(1, 7))
        targets.append(("char_device", dev, lambda m: stat.S_ISCHR(m.st_mode)))
    else:
        out["char_device"] = "skipped (not root: mknod needs it)"
    ok = True
    for name, path, same in targets:
        result = {"ok": False}
        done = threading.Event()

        def attempt(
            path: Path = path, result: Finding = result, done: threading.Event = done
        ) -> None:
            try:
                s.save(path)
                result["error"] = "saved"
            except colibri.ColibriError as e:
                result["error"] = type(e).__name__
                result["ok"] = not isinstance(e, colibri.InternalError)
            except Exception as e:
                result["error"] = "untyped:" + type(e).__name__
            done.set()

        threading.Thread(target=attempt, daemon=True).start()
        if not done.wait(30):
            result["error"] = "hung"
        result["unchanged"] = same(os.lstat(path))
        result["ok"] = result["ok"] and result["unchanged"]
        out[name] = result
        ok = ok and result["ok"]
    out["ok"] = ok
    return out


def probe_bad_path_types(tmp: Path, model: Any) -> Finding:
    import colibri

    s = model.session()
    s.prefill("x = 1")
    got: dict[str, dict[str, str]] = {}
    ok = True
    for label, value in [
        ("int", 3),
        ("None", None),
        ("float", 1.5),
        ("list", ["a"]),
        ("empty", ""),
        ("bytes", os.fsencode(tmp / "b.ctx")),
    ]:
        got[label] = {}
        for op, call in [
            ("save", lambda v=value: s.save(v)),
            ("load_session", lambda v=value: model.load_session(v)),
        ]:
            try:
                call()
                got[label][op] = "ok"
                ok = ok and label == "bytes"  # a bytes path is a path
            except colibri.ColibriError as e:
                got[label][op] = type(e).__name__
                ok = ok and not isinstance(e, colibri.InternalError)
            except Exception as e:
                got[label][op] = "untyped:" + type(e).__name__
                ok = False
    return {"ok": ok, **got}


def _rewrite(good: bytes, edit: Callable[[dict[str, Any], bytearray], None]) -> bytes:
    """``good`` with its header JSON and payload edited by ``edit`` and both checksums
    recomputed, as a deliberate writer (not damage) would."""
    n = struct.unpack_from("<Q", good, 24)[0]
    header = json.loads(good[PREFIX : PREFIX + n])
    payload = bytearray(good[PREFIX + n :])
    edit(header, payload)
    header["crc32"] = zlib.crc32(payload)
    text = json.dumps(header, separators=(",", ":")).encode()
    prefix = good[:20] + struct.pack("<I", max(zlib.crc32(text), 1)) + struct.pack("<Q", len(text))
    return prefix + text + bytes(payload)


def probe_nan_context(tmp: Path, model: Any) -> Finding:
    import colibri

    good = _saved_context(model, tmp / "nan-source.ctx")
    out: Finding = {}
    ok = True
    for label, value in [("nan", float("nan")), ("inf", float("inf"))]:

        def fill(header: dict[str, Any], payload: bytearray, value: float = value) -> None:
            struct.pack_into("<4f", payload, 0, value, value, value, value)

        path = tmp / f"{label}.ctx"
        path.write_bytes(_rewrite(good, fill))
        try:
            model.load_session(path)
            out[label] = "loaded"
            ok = False
        except colibri.SavedContextError as e:
            out[label] = "SavedContextError: " + str(e)[:120]
        except Exception as e:
            out[label] = type(e).__name__
            ok = False
    # The checksum recomputation itself is right: an unedited rewrite loads.
    (tmp / "same.ctx").write_bytes(_rewrite(good, lambda h, p: None))
    try:
        model.load_session(tmp / "same.ctx")
        out["control_rewrite_loads"] = True
    except Exception as e:
        out["control_rewrite_loads"] = f"no: {type(e).__name__}: {e}"[:200]
        ok = False
    out["ok"] = ok
    return out


def section_saved(tmp: Path, model_dir: Path, quick: bool) -> dict[str, Finding]:
    import colibri

    model = colibri.Model(model_dir, threads=1, cache_dir=tmp / "cache")
    return {
        "fifo_to_load_session": probe_fifo_load(tmp, model_dir),
        "header_bit_flips": probe_header_flips(tmp, model, quick),
        "two_models_saving_to_one_path": probe_concurrent_saves(tmp, model_dir, quick),
        "kills_mid_save": probe_kills_mid_save(tmp, model, model_dir, quick),
        "save_over_non_regular_files": probe_non_regular_targets(tmp, model),
        "path_types": probe_bad_path_types(tmp, model),
        "nan_context": probe_nan_context(tmp, model),
    }


# ------------------------------------------------------------------------- spill directory

_SPILL_FIFO = (
    _CLASSIFY
    + """
import os, time
cache = sys.argv[2]
m = colibri.Model(sys.argv[1], threads=1, cache_dir=cache, idle_session_budget=0)
kw = {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": []}
a, b = m.session(), m.session()
a.generate([5, 6, 7, 8], **kw)
b.generate([9, 10], **kw)
assert a.evicted
d = os.path.join(cache, "sessions")
names = sorted(os.listdir(d))
[spilled] = [n for n in names if n.endswith(".ctx")]
os.remove(os.path.join(d, spilled))
os.mkfifo(os.path.join(d, spilled))
t = time.monotonic()
try:
    out = a.generate([5, 6, 7, 8, 11], **kw)
    res = ["generated", out.stats.prompt_cached_tokens]
except Exception as e:
    res = [kind(e), str(e)[:200]]
# the session stays usable (or is an error each time, never a wait)
try:
    a.generate([1, 2], **kw); res.append("usable")
except Exception as e:
    res.append("after: " + kind(e))
res.append(round(time.monotonic() - t, 2))
res.append(names)
print(json.dumps(res))
"""
)

_SPILL_NAMES = """
import json, os, sys, colibri
m = colibri.Model(sys.argv[1], threads=1, cache_dir=sys.argv[2], idle_session_budget=0)
kw = {"max_new_tokens": 2, "temperature": 0, "stop_token_ids": []}
a, b = m.session(), m.session()
a.generate([5, 6, 7], **kw)
b.generate([8, 9], **kw)
d = os.path.join(sys.argv[2], "sessions")
print(json.dumps([os.getpid(), sorted(os.listdir(d))]), flush=True)
if len(sys.argv) > 3:
    sys.stdin.readline()  # hold the spill until told
    out = a.generate([5, 6, 7, 1], **kw)
    print(json.dumps(["restored", out.stats.prompt_cached_tokens]), flush=True)
"""

_NO_CACHE = """
import gc, json, os, stat, sys, colibri
m = colibri.Model(sys.argv[1], threads=1, idle_session_budget=0)
kw = {"max_new_tokens": 2, "temperature": 0, "stop_token_ids": []}
a, b = m.session(), m.session()
a.generate([5, 6, 7], **kw)
b.generate([8, 9], **kw)
tmp = os.environ["TMPDIR"]
dirs = [x for x in os.listdir(tmp) if x.startswith("colibri-sessions-")]
d = os.path.join(tmp, dirs[0])
files = os.listdir(d)
mode = lambda p: oct(stat.S_IMODE(os.lstat(p).st_mode))
res = {"dirs": dirs, "dir_mode": mode(d), "file_modes": [mode(os.path.join(d, f)) for f in files]}
del a, b, m
gc.collect()
res["removed_with_model"] = not os.path.exists(d)
print(json.dumps(res))
"""


def probe_spill_fifo(tmp: Path, model_dir: Path) -> Finding:
    r = run_py(_SPILL_FIFO, str(model_dir), str(tmp / "fifo-cache"), timeout=90)
    res = r.get("result") or []
    ok = not r["hung"] and bool(res) and not str(res[0]).startswith("untyped")
    ok = ok and len(res) > 2 and res[2] == "usable"
    return {"ok": ok, **r}


def probe_spill_names(tmp: Path, model_dir: Path) -> Finding:
    """Two processes spill into one cache directory: their files are named apart (a random
    part, not only the pid), and neither restores the other's."""
    cache = tmp / "shared-cache"
    runs = [run_py(_SPILL_NAMES, str(model_dir), str(cache), timeout=90) for _ in range(2)]
    names = [n for r in runs for n in (r.get("result") or [0, []])[1]]
    parts = [n.split("-") for n in names if n.endswith(".ctx")]
    random_part = all(len(p) >= 4 and len(p[1]) == 16 for p in parts)
    distinct = len({p[1] for p in parts}) == 2 if len(parts) >= 2 else False
    return {
        "ok": random_part and distinct,
        "names": names,
        "random_part_per_process": random_part and distinct,
    }


def probe_spill_crash_sweep(tmp: Path, model_dir: Path) -> Finding:
    """Processes killed with sessions spilled leave files; the next open sweeps them."""
    cache = tmp / "crash-cache"
    d = cache / "sessions"
    left_by_a_kill = 0
    for _ in range(3):
        p = subprocess.Popen(
            [sys.executable, "-c", _SPILL_NAMES, str(model_dir), str(cache), "hold"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env=_env(),
        )
        assert p.stdout is not None
        p.stdout.readline()
        p.kill()
        p.wait()
        p.stdout.close()
        # (the next process's open sweeps what this kill left: counted here)
        left_by_a_kill += any(n.name.endswith(".ctx") for n in d.iterdir())
    left = len(list(d.iterdir()))
    r = run_py(
        "import colibri, sys, os, json\n"
        "m = colibri.Model(sys.argv[1], threads=1, cache_dir=sys.argv[2])\n"
        "print(json.dumps(len(os.listdir(os.path.join(sys.argv[2], 'sessions')))))",
        str(model_dir),
        str(cache),
        timeout=60,
    )
    after = r.get("result")
    return {
        "ok": left_by_a_kill == 3 and after == 0,
        "kills": 3,
        "kills_that_left_spill_files": left_by_a_kill,
        "files_after_the_last_kill": left,
        "after_next_open": after,
    }


def probe_spill_other_namespace(tmp: Path, model_dir: Path) -> Finding:
    """Two "containers" share a cache volume: a live process holds a spilled session, and a
    process in another PID namespace (``unshare --pid``, where the first one's pid does not
    exist) opens a model on the same directory. The live process's spill file must survive
    its sweep, and the session come back from it."""
    if os.geteuid() != 0:
        return {"ok": True, "skipped": "not root (unshare --pid needs it)"}
    cache = tmp / "volume"
    holder = subprocess.Popen(
        [sys.executable, "-c", _SPILL_NAMES, str(model_dir), str(cache), "hold"],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
        env=_env(),
    )
    assert holder.stdin is not None and holder.stdout is not None
    first = json.loads(holder.stdout.readline())
    code = (
        "import colibri, sys, os, json\n"
        "m = colibri.Model(sys.argv[1], threads=1, cache_dir=sys.argv[2])\n"
        "d = os.path.join(sys.argv[2], 'sessions')\n"
        "print(json.dumps([os.getpid(), sorted(os.listdir(d))]))"
    )
    try:
        r = subprocess.run(
            [
                "unshare",
                "--pid",
                "--fork",
                "--mount-proc",
                sys.executable,
                "-c",
                code,
                str(model_dir),
                str(cache),
            ],
            capture_output=True,
            text=True,
            timeout=90,
            env=_env(),
        )
    except (FileNotFoundError, subprocess.TimeoutExpired) as e:
        holder.kill()
        holder.wait()
        return {"ok": True, "skipped": f"unshare: {e}"}
    if r.returncode != 0:
        holder.kill()
        holder.wait()
        return {"ok": True, "skipped": "unshare failed: " + r.stderr[-300:]}
    other = json.loads(r.stdout.strip().splitlines()[-1])
    holder.stdin.write("\n")
    holder.stdin.flush()
    restored = holder.stdout.readline().strip()
    holder.wait(timeout=60)
    restored_json = json.loads(restored) if restored else None
    spilled = [n for n in first[1] if n.endswith(".ctx")]
    kept = all(n in other[1] for n in spilled)
    reused = bool(restored_json) and restored_json[1] > 0
    return {
        "ok": kept and reused,
        "holder_pid": first[0],
        "holder_files": first[1],
        "other_namespace_pid": other[0],
        "files_after_its_open": other[1],
        "live_spill_kept": kept,
        "holder_restored": restored_json,
    }


def probe_private_spill_dir(tmp: Path, model_dir: Path) -> Finding:
    """No HOME, XDG_CACHE_HOME or COLIBRI_CACHE_DIR: a private 0700 directory, files 0600,
    removed with the model; a /tmp/sessions planted by someone else with a link is not
    followed."""
    ttmp = tmp / "tmpdir"
    ttmp.mkdir()
    planted = ttmp / "sessions"
    planted.mkdir(mode=0o777)
    planted.chmod(0o777)
    victim = tmp / "victim"
    victim.write_bytes(b"secret")
    victim.chmod(0o600)
    env = {
        k: v for k, v in _env().items() if k not in ("HOME", "XDG_CACHE_HOME", "COLIBRI_CACHE_DIR")
    }
    env["TMPDIR"] = str(ttmp)
    r = run_py(_NO_CACHE, str(model_dir), timeout=90, env=env)
    res = r.get("result") or {}
    ok = (
        res.get("dir_mode") == "0o700"
        and set(res.get("file_modes", [])) == {"0o600"}
        and res.get("removed_with_model") is True
        and victim.read_bytes() == b"secret"
        and list(planted.iterdir()) == []
    )
    return {"ok": ok, **r}


def section_spill(tmp: Path, model_dir: Path, quick: bool) -> dict[str, Finding]:
    return {
        "fifo_at_a_spill_file": probe_spill_fifo(tmp, model_dir),
        "spill_names": probe_spill_names(tmp, model_dir),
        "spill_files_after_crashes": probe_spill_crash_sweep(tmp, model_dir),
        "shared_volume_other_pid_namespace": probe_spill_other_namespace(tmp, model_dir),
        "private_spill_dir": probe_private_spill_dir(tmp, model_dir),
    }


# ------------------------------------------------------------------------- server


class Server:
    """``colibri serve`` of the model on a free loopback port."""

    def __init__(self, model_dir: Path, *args: str, cache: Path) -> None:
        cmd = [
            sys.executable,
            "-m",
            "colibri.cli",
            "serve",
            "-m",
            str(model_dir),
            "--port",
            "0",
            "--threads",
            "1",
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=ROOT,
            env=_env(COLIBRI_CACHE_DIR=str(cache)),
        )
        self.log: list[str] = []
        assert self.proc.stdout is not None
        deadline = time.monotonic() + 90
        self.host, self.port = "", 0
        for line in self.proc.stdout:
            self.log.append(line)
            if line.startswith("colibri serve: model"):
                url = line.split(" at ")[1].split("/v1")[0]
                hostport = url.split("://")[1]
                self.host, self.port = hostport.rsplit(":", 1)[0], int(hostport.rsplit(":", 1)[1])
                break
            if time.monotonic() > deadline:
                break
        if not self.port:
            self.proc.kill()
            raise SystemExit("the server did not start:\n" + "".join(self.log))
        threading.Thread(target=self._pump, daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.log.append(line)

    def request(
        self,
        method: str,
        path: str,
        body: bytes | None = None,
        headers: dict[str, str] | None = None,
        timeout: float = 120,
    ) -> tuple[int, bytes]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=timeout)
        try:
            hdrs = {"Content-Type": "application/json", **(headers or {})}
            conn.request(method, path, body=body, headers=hdrs)
            r = conn.getresponse()
            return r.status, r.read()
        finally:
            conn.close()

    def post(self, path: str, obj: Any, **kw: Any) -> tuple[int, bytes]:
        return self.request("POST", path, json.dumps(obj).encode(), **kw)

    def rss(self) -> int:
        return _status_kb(self.proc.pid, "VmRSS") * 1024

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def _code(body: bytes) -> str | None:
    try:
        return json.loads(body)["error"].get("code")
    except (ValueError, KeyError, TypeError, AttributeError):
        return None


def probe_server_guards(model_dir: Path, tmp: Path) -> dict[str, Finding]:
    srv = Server(model_dir, cache=tmp / "srv-cache")
    out: dict[str, Finding] = {}
    try:
        ok_body = {"model": "tiny", "prompt": "def f(", "max_tokens": 2}
        st, body = srv.request("POST", "/v1/completions", b"[" * 200_000)
        out["deep_json_body"] = {
            "ok": st == 400 and _code(body) == "invalid_json",
            "status": st,
            "code": _code(body),
        }
        # Nested under the parser's limit but deep for whatever walks it afterwards (JSON
        # text built by hand: the encoder's own recursion limit is lower).
        depth = 450
        schema = '{"type":"object","properties":{"a":' * depth + '{"type":"string"}' + "}}" * depth
        hi = '"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":"hi"}]'
        st_f, b_f = srv.request(
            "POST",
            "/v1/chat/completions",
            (
                "{" + hi + ',"response_format":{"type":"json_schema","json_schema":{"name":"x",'
                '"schema":' + schema + "}}}"
            ).encode(),
        )
        st_t, b_t = srv.request(
            "POST",
            "/v1/chat/completions",
            (
                "{"
                + hi
                + ',"tools":[{"type":"function","function":{"name":"f","parameters":'
                + schema
                + "}}]}"
            ).encode(),
        )
        nested = "[" * 900 + '"x"' + "]" * 900
        st_m, b_m = srv.request(
            "POST",
            "/v1/chat/completions",
            (
                '{"model":"tiny","max_tokens":2,"messages":[{"role":"user","content":'
                + nested
                + "}]}"
            ).encode(),
        )
        st_g, b_g = srv.request(
            "POST",
            "/v1/completions",
            (
                '{"model":"tiny","prompt":"x","max_tokens":2,"logit_bias":'
                + "[" * 900
                + "]" * 900
                + "}"
            ).encode(),
        )
        out["deep_json_fields"] = {
            "ok": all(400 <= s < 500 or s == 200 for s in (st_f, st_t, st_m, st_g)),
            "json_schema": [st_f, _code(b_f)],
            "tool_parameters": [st_t, _code(b_t)],
            "message_content": [st_m, _code(b_m)],
            "logit_bias": [st_g, _code(b_g)],
        }
        t = time.monotonic()
        st, body = srv.post("/v1/completions", {"model": "tiny", "prompt": "a" * (31 * MIB)})
        out["huge_string_prompt"] = {
            "ok": st == 400,
            "status": st,
            "code": _code(body),
            "seconds": round(time.monotonic() - t, 2),
        }
        st, _ = srv.request("GET", "/stats", headers={"Host": "evil.example"})
        st2, _ = srv.request(
            "POST",
            "/v1/completions",
            json.dumps(ok_body).encode(),
            headers={"Host": "evil.example"},
        )
        out["host_evil_example"] = {"ok": st == 403 and st2 == 403, "stats": st, "completions": st2}
        st, _ = srv.request(
            "POST",
            "/v1/completions",
            json.dumps(ok_body).encode(),
            headers={"Content-Type": "text/plain"},
        )
        st2, _ = srv.request(
            "POST",
            "/v1/completions",
            json.dumps(ok_body).encode(),
            headers={"Origin": "http://evil.example"},
        )
        st3, _ = srv.request(
            "POST",
            "/v1/completions",
            b"prompt=x",
            headers={"Content-Type": "application/x-www-form-urlencoded"},
        )
        st4, _ = srv.request("POST", "/v1/completions", json.dumps(ok_body).encode())
        out["cross_site_posts"] = {
            "ok": st in (403, 415) and st2 == 403 and st3 in (403, 415) and st4 == 200,
            "text_plain": st,
            "evil_origin": st2,
            "form": st3,
            "control_json": st4,
        }
    finally:
        srv.stop()
    return out


def probe_shutdown_503(model_dir: Path, tmp: Path) -> Finding:
    srv = Server(model_dir, "--max-batch", "1", "--sessions", "1", cache=tmp / "shut-cache")
    long = {
        "model": "tiny",
        "prompt": "def f(",
        "max_tokens": 1900,
        "ignore_eos": True,
        "temperature": 0,
        "stream": True,
        "draft": "off",
    }
    started = threading.Event()

    def run_long() -> None:
        conn = http.client.HTTPConnection(srv.host, srv.port, timeout=60)
        with contextlib.suppress(OSError, http.client.HTTPException):
            conn.request(
                "POST", "/v1/completions", json.dumps(long), {"Content-Type": "application/json"}
            )
            r = conn.getresponse()
            started.set()
            while r.read(256):
                pass
        conn.close()

    threading.Thread(target=run_long, daemon=True).start()
    started.wait(30)
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        queued = pool.submit(
            srv.post, "/v1/completions", {"model": "tiny", "prompt": "x", "max_tokens": 4}
        )
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            _, body = srv.request("GET", "/stats")
            if json.loads(body).get("queue_depth") == 1:
                break
            time.sleep(0.05)
        srv.proc.send_signal(signal.SIGINT)
        try:
            st, body = queued.result(timeout=60)
        except Exception as e:
            st, body = -1, str(e).encode()
    srv.stop()
    return {"ok": st == 503 and _code(body) == "shutting_down", "status": st, "code": _code(body)}


def probe_idle_sockets(quick: bool) -> Finding:
    n, seconds = (2000, 8) if quick else (10000, 20)
    cmd = [
        sys.executable,
        str(ROOT / "tools" / "probe_idle_sockets.py"),
        "--sockets",
        str(n),
        "--fd-limit",
        "1024",
        "--seconds",
        str(seconds),
        "--mode",
        "mixed",
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=seconds + 120, env=_env())
    except subprocess.TimeoutExpired:
        return {"ok": False, "hung": True}
    try:
        res = json.loads(r.stdout[r.stdout.index("{") :])
    except ValueError:
        return {"ok": False, "rc": r.returncode, "stderr": r.stderr[-800:]}
    ok = (
        res.get("health_failed", 1) == 0
        and res.get("health_ok", 0) > 0
        and res.get("server_alive") is True
        and res.get("server_emfile", 1) == 0
    )
    return {"ok": ok, "sockets": n, "seconds": seconds, **res}


def section_server(tmp: Path, model_dir: Path, quick: bool) -> dict[str, Finding]:
    out = probe_server_guards(model_dir, tmp)
    out["queued_request_at_shutdown"] = probe_shutdown_503(model_dir, tmp)
    out["idle_sockets"] = probe_idle_sockets(quick)
    return out


# ------------------------------------------------------------------------- RSS per request


class PeakSampler:
    """The server's RSS sampled from /proc every 2 ms, and its VmHWM reset through
    ``clear_refs`` where allowed: the peak during a request."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.peak = 0
        self._stop = threading.Event()
        self.hwm_reset = False
        with contextlib.suppress(OSError):
            Path(f"/proc/{pid}/clear_refs").write_text("5")
            self.hwm_reset = True
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, _status_kb(self.pid, "VmRSS") * 1024)
            time.sleep(0.002)

    def stop(self) -> int:
        self._stop.set()
        self._t.join()
        if self.hwm_reset:
            self.peak = max(self.peak, _status_kb(self.pid, "VmHWM") * 1024)
        return self.peak


def _worst_requests() -> list[tuple[str, list[bytes], str]]:
    """(kind, bodies sent at once, path): the issue's worst requests."""
    big = "a" * (31 * MIB)
    ucs4 = "a" * (31 * MIB - 8) + "\U0001f600"  # one astral character: 4 bytes per character
    chat = {"model": "tiny", "messages": [{"role": "user", "content": big}], "max_tokens": 4}
    comp = {"model": "tiny", "prompt": big, "max_tokens": 4}
    wide_lists = (
        b'{"model":"tiny","prompt":"x","max_tokens":2,"stop":[' + b"[]," * (10 * MIB) + b"[]]}"
    )
    wide_strings = b'{"model":"tiny","max_tokens":2,"prompt":["ab"' + b',"ab"' * (6 * MIB) + b"]}"
    ids = b'{"model":"tiny","max_tokens":2,"prompt":[' + b"1000," * (6 * MIB) + b"1]}"
    bias = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 2,
        "logit_bias": {str(i): 1 for i in range(1_500_000)},
    }
    stops = {"model": "tiny", "prompt": "x", "max_tokens": 2, "stop": ["s" * 30] * 900_000}
    # Just under the server's limit on JSON values (serve/app.py's MAX_JSON_VALUES, 2**21,
    # an upper bound counted from the , [ and : outside strings): the most a body that is
    # parsed can hold. An empty list counts 2 (its [ and the , after it), a message 4.
    under = 2**21 - 64
    wide_under = (
        b'{"model":"tiny","prompt":"x","max_tokens":2,"stop":['
        + b"[]," * (under // 2 - 8)
        + b"[]]}"
    )
    bias_under = {
        "model": "tiny",
        "prompt": "x",
        "max_tokens": 2,
        "logit_bias": {str(i): 1 for i in range(under // 2 - 8)},
    }
    many_messages = {
        "model": "tiny",
        "max_tokens": 2,
        "messages": [{"role": "user", "content": "a"}] * (under // 4 - 8),
    }
    enc = lambda o: json.dumps(o).encode()  # noqa: E731
    return [
        ("completions_31MiB_string", [enc(comp)], "/v1/completions"),
        ("completions_31MiB_string_ucs4", [enc({**comp, "prompt": ucs4})], "/v1/completions"),
        ("chat_31MiB_string", [enc(chat)], "/v1/chat/completions"),
        ("completions_31MiB_x3_at_once", [enc(comp)] * 3, "/v1/completions"),
        ("chat_31MiB_x3_at_once", [enc(chat)] * 3, "/v1/chat/completions"),
        ("deep_json_31MiB", [b"[" * (31 * MIB)], "/v1/completions"),
        ("wide_json_10M_empty_lists", [wide_lists], "/v1/completions"),
        ("prompt_list_6M_strings", [wide_strings], "/v1/completions"),
        ("prompt_6M_token_ids", [ids], "/v1/completions"),
        ("wide_json_1M_empty_lists_under_the_limit", [wide_under], "/v1/completions"),
        ("logit_bias_1M_entries_under_the_limit", [enc(bias_under)], "/v1/completions"),
        ("chat_500k_messages_under_the_limit", [enc(many_messages)], "/v1/chat/completions"),
        (
            "max_tokens_huge",
            [enc({"model": "tiny", "prompt": "def f(", "max_tokens": 2**62, "ignore_eos": True})],
            "/v1/completions",
        ),
        ("stop_900k_strings", [enc(stops)], "/v1/completions"),
        ("logit_bias_1.5M_entries", [enc(bias)], "/v1/completions"),
        (
            "n_16",
            [
                enc(
                    {
                        "model": "tiny",
                        "prompt": "def f(",
                        "max_tokens": 256,
                        "n": 16,
                        "ignore_eos": True,
                    }
                )
            ],
            "/v1/completions",
        ),
        (
            "batch_4_prompts_n_16",
            [
                enc(
                    {
                        "model": "tiny",
                        "prompt": ["def f("] * 4,
                        "max_tokens": 256,
                        "n": 16,
                        "ignore_eos": True,
                    }
                )
            ],
            "/v1/completions",
        ),
    ]


def section_rss(tmp: Path, model_dir: Path, quick: bool) -> dict[str, Finding]:
    """Peak RSS above idle of ``colibri serve`` for each worst request kind, each on a fresh
    server (warmed by one small request), so one kind's freed-but-kept heap is not the next
    one's idle."""
    out: dict[str, Finding] = {}
    limit = 512 * MIB
    kinds = _worst_requests()
    if quick:
        kinds = [k for k in kinds if "x3" not in k[0]]
    if os.environ.get("PROBE_RSS_KINDS"):  # a comma-separated subset, by name
        kinds = [k for k in kinds if k[0] in os.environ["PROBE_RSS_KINDS"].split(",")]
    for kind, bodies, path in kinds:
        srv = Server(model_dir, cache=tmp / "rss-cache")
        try:
            srv.post("/v1/completions", {"model": "tiny", "prompt": "def f(", "max_tokens": 8})
            time.sleep(0.3)
            idle = srv.rss()
            sampler = PeakSampler(srv.proc.pid)
            t = time.monotonic()
            with concurrent.futures.ThreadPoolExecutor(len(bodies)) as pool:
                results = list(
                    pool.map(
                        lambda b, p=path, srv=srv: srv.request("POST", p, b, timeout=300), bodies
                    )
                )
            seconds = time.monotonic() - t
            above = sampler.stop() - idle
            st, _ = srv.request("GET", "/health")
        finally:
            srv.stop()
        out[kind] = {
            "ok": above <= limit and all(s < 500 for s, _ in results) and st == 200,
            "status": sorted({s for s, _ in results}),
            "code": _code(results[0][1]),
            "seconds": round(seconds, 2),
            "body_mib": round(len(bodies[0]) / MIB, 1),
            "at_once": len(bodies),
            "idle_mib": round(idle / MIB, 1),
            "peak_above_idle_mib": round(above / MIB, 1),
        }
    return out


# ------------------------------------------------------------------------- converter


@contextlib.contextmanager
def _helpers() -> Iterator[Any]:
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        from helpers import community

        yield community
    finally:
        sys.path.remove(str(ROOT / "tests"))


def section_convert(tmp: Path, model_dir: Path, quick: bool) -> dict[str, Finding]:
    """A source changed in place, renamed over, or truncated in the middle of a shard; then a
    re-run: an error naming the file (and offset), or the shard redone; never a mix."""
    from colibri import _core
    from colibri.convert import convert
    from colibri.errors import ColibriError

    shard = 60_000
    out: dict[str, Finding] = {}

    def files(d: Path) -> dict[str, bytes]:
        return {
            p.name: p.read_bytes()
            for p in d.iterdir()
            if p.is_file() and not p.name.startswith(".")
        }

    with _helpers() as community:
        cfg = community.tiny_config()

        def source(name: str) -> Path:
            src = tmp / name
            community.write_hf_checkpoint(src, cfg, community.random_weights(cfg, seed=21))
            hour_ago = time.time_ns() - 3600 * 10**9
            for p in src.glob("*.safetensors"):
                os.utime(p, ns=(hour_ago, hour_ago))
            return src

        def first(src: Path) -> Path:
            return sorted(src.glob("*.safetensors"))[0]

        def start(p: Path) -> int:
            return 8 + int.from_bytes(p.read_bytes()[:8], "little")

        def in_place(p: Path) -> None:
            st = p.stat()
            data = bytearray(p.read_bytes())
            for k in range(start(p), len(data), 2):
                data[k] ^= 0x5A
            with p.open("r+b") as f:
                f.write(data)
            os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))

        def renamed_over(p: Path) -> None:
            data = bytearray(p.read_bytes())
            s = start(p)
            data[s:] = bytes(len(data) - s)
            tmpf = p.with_name("new.tmp")
            tmpf.write_bytes(data)
            os.replace(tmpf, p)

        def truncated(p: Path) -> None:
            os.truncate(p, start(p) + 10)

        for label, change in [
            ("rewritten_in_place", in_place),
            ("zero_copy_renamed_over", renamed_over),
            ("truncated", truncated),
        ]:
            src, dst = source(f"src-{label}"), tmp / f"dst-{label}"
            path = first(src)
            size0 = path.stat().st_size
            job = _core.ConvertJob(str(src), str(dst), max_shard_bytes=shard)
            calls: list[int] = []

            def hook(
                n: int,
                path: Path = path,
                change: Callable[[Path], None] = change,
                calls: list[int] = calls,
            ) -> None:
                calls.append(n)
                if len(calls) == 2:
                    change(path)

            res: Finding = {}
            message = ""
            try:
                job.write_shard(0, hook)
                res["error"] = None
            except ColibriError as e:
                res["error"] = type(e).__name__
                res["names_file"] = e.filename == str(path) or str(path) in str(e)
                message = str(e)
                res["message"] = message[:300]
            except Exception as e:
                res["error"] = "untyped:" + type(e).__name__
                res["message"] = str(e)[:300]
            del job
            if label == "truncated":
                res["names_offset"] = " at offset " in message
                res["sizes_named"] = f"it had {size0}" in message
                res["no_bare_io_message"] = "failed to fill whole buffer" not in message
                with path.open("r+b") as f:  # put some length back so a re-run can read it
                    f.truncate(size0)
            # A re-run must convert the source as it is now, never keep a mix.
            try:
                convert(src, dst, progress=False, max_shard_size=shard)
                fresh = tmp / f"fresh-{label}"
                convert(src, fresh, progress=False, max_shard_size=shard)
                res["rerun_equals_fresh_conversion"] = files(dst) == files(fresh)
            except ColibriError as e:
                res["rerun_equals_fresh_conversion"] = f"typed error: {type(e).__name__}"
            mid_ok = (
                res["error"] is not None
                and not str(res["error"]).startswith("untyped")
                and res.get("names_file")
            )
            res["ok"] = bool(mid_ok) and res["rerun_equals_fresh_conversion"] is True
            if label == "truncated":
                res["ok"] = (
                    res["ok"]
                    and res["names_offset"]
                    and res["sizes_named"]
                    and res["no_bare_io_message"]
                )
            out[label] = res
    return out


# ------------------------------------------------------------------------- main

SECTIONS: dict[str, Callable[[Path, Path, bool], dict[str, Finding]]] = {
    "saved": section_saved,
    "spill": section_spill,
    "server": section_server,
    "rss": section_rss,
    "convert": section_convert,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=TINY, help="model directory (default: tiny)")
    ap.add_argument("--only", action="append", choices=sorted(SECTIONS), help="sections to run")
    ap.add_argument("--quick", action="store_true", help="fewer cases per check")
    args = ap.parse_args()
    sys.path.insert(0, str(ROOT / "python"))
    report: dict[str, Any] = {"host": socket.gethostname(), "date": time.strftime("%Y-%m-%d")}
    bad: list[str] = []
    with tempfile.TemporaryDirectory(prefix="probe-hostile-") as d:
        tmp = Path(d)
        for name in args.only or list(SECTIONS):
            t = time.monotonic()
            sec_dir = tmp / name
            sec_dir.mkdir()
            findings = SECTIONS[name](sec_dir, args.model, args.quick)
            report[name] = findings
            report[name + "_seconds"] = round(time.monotonic() - t, 1)
            bad += [f"{name}.{k}" for k, v in findings.items() if not v.get("ok", False)]
            print(
                f"[{name}] {round(time.monotonic() - t, 1)} s, not ok: "
                f"{[k for k, v in findings.items() if not v.get('ok', False)]}",
                file=sys.stderr,
                flush=True,
            )
    report["not_ok"] = bad
    print(json.dumps(report, default=str))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
