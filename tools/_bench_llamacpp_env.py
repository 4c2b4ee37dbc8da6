"""What the benchmark runs on and with: the llama-cpp-python venv and its build options, the
colibri snapshot and its provenance, colibri's bytes per token, the CPU's facts, the log."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

LLAMA_CPP_PYTHON = "0.3.36"
GGUF = "0.19.0"
CMAKE_ARGS = "-DGGML_NATIVE=ON -DGGML_OPENMP=ON -DCMAKE_BUILD_TYPE=Release"
# CPU flags (lscpu, /proc/cpuinfo's names) -> the ggml option that compiles for them.
GGML_FEATURES = [
    ("avx", "GGML_AVX"),
    ("avx2", "GGML_AVX2"),
    ("bmi2", "GGML_BMI2"),
    ("fma", "GGML_FMA"),
    ("f16c", "GGML_F16C"),
    ("avx_vnni", "GGML_AVX_VNNI"),
    ("avx512f", "GGML_AVX512"),
    ("avx512vbmi", "GGML_AVX512_VBMI"),
    ("avx512_vnni", "GGML_AVX512_VNNI"),
    ("avx512_bf16", "GGML_AVX512_BF16"),
]


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cpu_flags() -> set[str]:
    """The CPU's feature flags as lscpu names them (empty where it cannot tell)."""
    return set((lscpu("Flags") or "").split())


def default_cmake_args(flags: set[str]) -> str:
    """llama.cpp's build: native (``-march=native``), except on CPUs with AMX.

    There ``GGML_NATIVE`` compiles ggml's AMX extra buffer type, which takes the Q4_0 expert
    tensors of this MoE model, and then no backend can run their ``MUL_MAT_ID``: every
    measurement aborts with ``GGML_ASSERT(*cur_backend_id != -1)`` (ggml-backend.cpp:1294,
    llama-cpp-python 0.3.36, seen 2026-12-03). On such CPUs the build names the CPU's other
    features itself (the same kernels a native build picks on an AVX-512 CPU without AMX).
    """
    if "amx_int8" not in flags:
        return CMAKE_ARGS
    on = " ".join(f"-D{opt}=ON" for flag, opt in GGML_FEATURES if flag in flags)
    return f"-DGGML_NATIVE=OFF {on} -DGGML_OPENMP=ON -DCMAKE_BUILD_TYPE=Release"


def llama_venv(cache: Path, cmake_args: str) -> Path:
    """The venv with llama-cpp-python built from the sdist (made once per build options, then
    reused)."""
    venv = cache / "venv"
    py = venv / "bin" / "python"
    check = f"import llama_cpp, gguf; assert llama_cpp.__version__ == '{LLAMA_CPP_PYTHON}'"
    record = cache / "llama-build.json"
    built_with = json.loads(record.read_text()).get("CMAKE_ARGS") if record.exists() else None
    if (
        built_with == cmake_args
        and py.exists()
        and subprocess.run([str(py), "-c", check], capture_output=True).returncode == 0
    ):
        return py
    if venv.exists():
        log(f"{venv} was built with {built_with!r}; rebuilding with {cmake_args!r}")
        shutil.rmtree(venv)
    log(f"building llama-cpp-python {LLAMA_CPP_PYTHON} from the sdist in {venv} (minutes)")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(py), "-m", "pip", "install", "-q"]
    subprocess.run([*pip, "-U", "pip"], check=True)
    env = dict(os.environ, CMAKE_ARGS=cmake_args, CMAKE_BUILD_PARALLEL_LEVEL=str(os.cpu_count()))
    nice = ["nice", "-n", "10"] if shutil.which("nice") else []  # a long build, others first
    with open(cache / "llama-build.log", "w") as logf:
        subprocess.run(
            [
                *nice,
                *pip,
                "-v",
                # Not pip's wheel cache: a wheel built with other CMAKE_ARGS would be reused.
                "--no-cache-dir",
                "--no-binary",
                "llama-cpp-python",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON}",
            ],
            check=True,
            env=env,
            stdout=logf,
            stderr=subprocess.STDOUT,
        )
    subprocess.run([*pip, f"gguf=={GGUF}", "numpy"], check=True)
    (cache / "llama-build.json").write_text(json.dumps({"CMAKE_ARGS": cmake_args}))
    return py


def llama_facts(py: Path) -> dict[str, Any]:
    code = (
        "import json, llama_cpp as L; L.llama_backend_init(); print(json.dumps({"
        "'llama_cpp_python': L.__version__, "
        "'system_info': L.llama_print_system_info().decode()}))"
    )
    out = subprocess.run([str(py), "-c", code], check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def snapshot_colibri(py: str, cache: Path) -> tuple[Path, dict[str, Any]]:
    """Copy the colibri package ``py`` imports to CACHE/colibri-snapshot; its provenance."""
    code = (
        "import json, inspect, colibri; from colibri import _core; "
        "print(json.dumps({'file': colibri.__file__, "
        "'prefill': 'prefill' in inspect.signature(colibri.Model.__init__).parameters or "
        "'prefill' in inspect.signature(colibri.Model.generate).parameters, "
        "'prefill_modes': list(getattr(getattr(colibri, 'validation', None), "
        "'_PREFILL_MODES', None) or ['fast', 'exact']), "
        "'version': getattr(colibri, '__version__', None)}))"
    )
    out = subprocess.run([py, "-c", code], check=True, capture_output=True, text=True)
    facts = json.loads(out.stdout.strip().splitlines()[-1])
    pkg = Path(facts["file"]).parent
    snap = cache / "colibri-snapshot"
    shutil.rmtree(snap, ignore_errors=True)
    snap.mkdir(parents=True)
    shutil.copytree(pkg, snap / "colibri", ignore=shutil.ignore_patterns("__pycache__"))
    facts["source"] = str(pkg)
    facts.update(provenance(pkg))
    ext = sorted(pkg.glob("_core*.so"))
    if ext:  # when the extension was built: a checkout's HEAD may have moved on since
        facts["extension_built"] = time.strftime(
            "%Y-%m-%dT%H:%M:%SZ", time.gmtime(ext[0].stat().st_mtime)
        )
    return snap, facts


def provenance(pkg: Path) -> dict[str, Any]:
    """The git commit the colibri package was built from, where that can be told: an editable
    install lives in a checkout; a plain install records its source in direct_url.json."""
    where: Path | None = pkg
    for d in pkg.parent.glob("colibri-*.dist-info/direct_url.json"):
        url = json.loads(d.read_text()).get("url", "")
        if url.startswith("file://"):
            where = Path(url[7:])
    try:
        root = subprocess.run(
            ["git", "-C", str(where), "rev-parse", "--show-toplevel"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        head = subprocess.run(
            ["git", "-C", root, "log", "-1", "--format=%h %cI %s"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        dirty = subprocess.run(
            ["git", "-C", root, "status", "--porcelain", "--untracked-files=no"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        return {"checkout": root, "commit": head, "dirty": bool(dirty)}
    except (subprocess.CalledProcessError, FileNotFoundError):
        return {"commit": None}


def colibri_info(py: str, snap: Path, model: Path, cfg: dict[str, Any]) -> dict[str, Any]:
    """colibri's bytes: file total and the weights one token reads (embedding excluded,
    routed experts scaled by experts-per-token / experts)."""
    code = (
        "import json, sys, colibri; m = colibri.Model(sys.argv[1], threads=1); "
        "print(json.dumps(m.info()))"
    )
    env = dict(os.environ, PYTHONPATH=str(snap))
    out = subprocess.run(
        [py, "-c", code, str(model)], check=True, capture_output=True, text=True, env=env
    )
    info = json.loads(out.stdout.strip().splitlines()[-1])
    roles = {r: sum(f.values()) for r, f in info["tensors"].items()}
    frac = cfg["num_experts_per_tok"] / cfg["n_routed_experts"]
    per_token = sum(b for r, b in roles.items() if r not in ("embed", "routed_experts"))
    per_token += roles.get("routed_experts", 0) * frac
    return {
        "file_bytes": info["total_bytes"],
        "bytes_per_token": int(per_token),
        "roles": roles,
        "kv_bytes_per_token": info["memory"]["kv_bytes_per_token"],
    }


def lscpu(field: str) -> str | None:
    """One field of lscpu's output (None where lscpu is missing or lacks it)."""
    try:
        text = subprocess.run(["lscpu"], capture_output=True, text=True).stdout
    except FileNotFoundError:
        return None
    m = re.search(rf"^{field}:\s*(.+)$", text, re.M)
    return m.group(1).strip() if m else None
