"""One measurement in its own process: colibri's or llama.cpp's warm-up, then one prompt's
prefill and decode, timed, with the process's peak memory."""

from __future__ import annotations

import argparse
import inspect
import time
from pathlib import Path
from typing import Any

from _bench_llamacpp_model import CTX

# Long enough that the warm-up routes tokens to every expert (64 experts, top 8: a 128-token
# warm-up left ~170 MB of experts for colibri to read inside the measured 512-token prefill,
# where llama.cpp's mapped file was already warm).
WARMUP_PROMPT = 512
WARMUP_GEN = 8
_KEEP: list[Any] = []


def prompt_ids(vocab_size: int, n: int, seed: int) -> list[int]:
    import numpy as np

    return [int(x) for x in np.random.default_rng(seed).integers(2, vocab_size, size=n)]


def vm_status() -> dict[str, int]:
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmHWM", "VmRSS", "RssAnon", "RssFile"):
            out[key] = int(rest.split()[0]) * 1024
    return out


def worker_colibri(a: argparse.Namespace) -> dict[str, Any]:
    import colibri

    kw: dict[str, Any] = {"threads": a.threads, "max_context": CTX, "draft": a.draft}
    gen_kw: dict[str, Any] = {}
    if a.prefill:
        if "prefill" in inspect.signature(colibri.Model.__init__).parameters:
            kw["prefill"] = a.prefill
        else:
            gen_kw["prefill"] = a.prefill
    t0 = time.perf_counter()
    m = colibri.Model(a.model, **kw)
    load_s = time.perf_counter() - t0
    vs = m.config["vocab_size"]
    common = {"temperature": 0, "stop_token_ids": [], **gen_kw}
    warm = m.session()
    warm.generate(prompt_ids(vs, WARMUP_PROMPT, 7), max_new_tokens=WARMUP_GEN, **common)
    s = m.session()
    ids = prompt_ids(vs, a.prompt, 1234)
    t0 = time.perf_counter()
    out = s.generate(ids, max_new_tokens=a.gen, **common)
    wall = time.perf_counter() - t0
    st = out.stats
    return {
        "load_s": load_s,
        "wall_s": wall,
        "prefill_tok_s": st.prompt_tokens_per_second,
        "decode_tok_s": st.tokens_per_second if a.gen > 1 else None,
        "tokens_per_forward": st.tokens_per_forward,
        "generated": st.generated_tokens,
        "expert_misses": st.expert_misses,
        "expert_bytes_read": st.expert_bytes_read,
        "prefill_resolved": m.info().get("prefill"),  # the arithmetic "auto" chose
        "tokens": list(out.token_ids[:16]),
        **vm_status(),
    }


def worker_llama(a: argparse.Namespace) -> dict[str, Any]:
    import ctypes

    import llama_cpp as L
    import numpy as np

    _KEEP.append(L.llama_log_callback(lambda *_: None))  # alive while llama.cpp may call it
    L.llama_log_set(_KEEP[-1], ctypes.c_void_p())
    L.llama_backend_init()
    t0 = time.perf_counter()
    mp = L.llama_model_default_params()
    mp.n_gpu_layers = 0
    model = L.llama_model_load_from_file(a.model.encode(), mp)
    if not model:
        raise SystemExit(f"llama.cpp could not load {a.model}")
    cp = L.llama_context_default_params()
    cp.n_ctx, cp.n_batch, cp.n_ubatch = CTX, 2048, 512
    cp.n_threads = cp.n_threads_batch = a.threads
    ctx = L.llama_init_from_model(model, cp)
    if not ctx:
        raise SystemExit("llama.cpp could not create a context")
    load_s = time.perf_counter() - t0
    n_vocab = L.llama_vocab_n_tokens(L.llama_model_get_vocab(model))
    batch = L.llama_batch_init(2048, 0, 1)
    mem = L.llama_get_memory(ctx)

    def run(tokens: list[int], pos: int) -> None:
        for i0 in range(0, len(tokens), 2048):
            part = tokens[i0 : i0 + 2048]
            batch.n_tokens = len(part)
            for i, t in enumerate(part):
                batch.token[i] = t
                batch.pos[i] = pos + i0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = 0
                batch.logits[i] = i == len(part) - 1
            rc = L.llama_decode(ctx, batch)
            if rc != 0:
                raise SystemExit(f"llama_decode failed: {rc}")

    def argmax() -> int:
        p = L.llama_get_logits_ith(ctx, -1)
        return int(np.ctypeslib.as_array(p, shape=(n_vocab,)).argmax())

    def generate(ids: list[int], n: int) -> tuple[float, float, list[int]]:
        L.llama_memory_clear(mem, True)
        t0 = time.perf_counter()
        run(ids, 0)
        out = [argmax()]
        t1 = time.perf_counter()
        for j in range(n - 1):
            run([out[-1]], len(ids) + j)
            out.append(argmax())
        t2 = time.perf_counter()
        return t1 - t0, t2 - t1, out

    generate(prompt_ids(n_vocab, WARMUP_PROMPT, 7), WARMUP_GEN)
    ids = prompt_ids(n_vocab, a.prompt, 1234)
    t0 = time.perf_counter()
    pre, dec, out = generate(ids, a.gen)
    wall = time.perf_counter() - t0
    res = {
        "load_s": load_s,
        "wall_s": wall,
        "prefill_tok_s": len(ids) / pre,
        "decode_tok_s": (a.gen - 1) / dec if a.gen > 1 else None,
        "tokens_per_forward": 1.0,
        "generated": len(out),
        "tokens": out[:16],
        **vm_status(),
    }
    L.llama_batch_free(batch)
    L.llama_free(ctx)
    L.llama_model_free(model)
    return res
