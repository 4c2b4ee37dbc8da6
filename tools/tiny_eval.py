#!/usr/bin/env python3
"""Evaluate the tiny model's Hugging Face export with transformers (dev-only).

Loads ``OUT/hf`` with ``DeepseekV3ForCausalLM.from_pretrained`` and the MTP layer with
transformers' own ``MtpModel.from_pretrained`` (the loader behind ``generate(use_mtp=True)``),
then measures, on the held-out split of ``tools/train_tiny.py``:

- held-out loss (main and MTP depth 1), on the same windows as the training-time evaluation
  and on a larger set;
- MTP acceptance: depth 1 teacher-forced on held-out code (draft from (h_i, t_{i+1}) vs the
  main model's argmax for position i+2), and depth 1..3 on the main model's own greedy
  continuations of held-out prompts (exactly what greedy speculative decoding accepts);
- per-layer expert load on held-out tokens;
- greedy continuations of a few code prompts, and a ``generate(use_mtp=True)`` cross-check.

Usage::

    nice /opt/devvenv/bin/python tools/tiny_eval.py --out /work/tiny
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

sys.path.insert(0, str(Path(__file__).resolve().parent))
import train_tiny as tt

PROMPTS = ["def fibonacci(n):", "import os\n", "class Stack:"]
PROSE = "pydoc_data/topics.py"


def load(hf: Path) -> tuple[DeepseekV3ForCausalLM, MtpModel, Tokenizer, dict[str, Any]]:
    """Load the export with transformers: main model, MTP module, tokenizer, loading report."""
    model, info = DeepseekV3ForCausalLM.from_pretrained(
        str(hf), dtype=torch.float32, output_loading_info=True
    )
    model.eval()
    n = model.config.num_hidden_layers
    # transformers' DeepSeek-V3 class hard-codes the MTP key pattern of the 61-layer model
    # (``model.layers.61``); point it at this model's MTP index so MtpModel finds the tensors.
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{n}\..*"]
    mtp = MtpModel.from_pretrained(model)
    mtp.eval()
    tok = Tokenizer.from_file(str(hf / "tokenizer.json"))
    report = {k: sorted(v) if isinstance(v, (set, list)) else str(v) for k, v in info.items()}
    unexpected = report.get("unexpected_keys", [])
    report["unexpected_keys"] = [f"{len(unexpected)} keys, all under model.layers.{n}."]
    if any(not k.startswith(f"model.layers.{n}.") for k in unexpected):
        raise RuntimeError(f"unexpected non-MTP keys: {unexpected}")
    return model, mtp, tok, report


def container_estimate(hf: Path, model: DeepseekV3ForCausalLM) -> dict[str, Any]:
    """Bytes of the colibri container with defaults of docs/container.md, from the export's tensors.

    int8 per-row (O*I bytes + O f32 scales): embed_tokens, lm_head and every 2-D tensor of the
    MTP layer except its router; int4 gs64 (O*ceil(I/2) bytes + O*ceil(I/64) scales): every
    other 2-D weight; router weights and all 1-D tensors stay F32.
    """
    from safetensors import safe_open

    n = model.config.num_hidden_layers
    sizes = {"int8": 0, "int4": 0, "f32": 0}
    with safe_open(str(hf / "model.safetensors"), framework="pt") as f:
        for name in f.keys():  # noqa: SIM118 (safe_open has no __iter__)
            shape = f.get_slice(name).get_shape()
            if len(shape) != 2 or name.endswith("mlp.gate.weight"):
                sizes["f32"] += 4 * int(np.prod(shape))
                continue
            o, i = shape
            if name.startswith(f"model.layers.{n}.") or "embed_tokens" in name or "lm_head" in name:
                sizes["int8"] += o * i + 4 * o
            else:
                sizes["int4"] += o * ((i + 1) // 2) + 4 * o * ((i + 63) // 64)
    total = sum(sizes.values())
    return {"bytes": sizes, "total_bytes": total, "total_mb": total / 1e6}


def mtp_rows(
    mtp: MtpModel,
    tokens: list[torch.Tensor],
    hiddens: list[torch.Tensor],
    positions: list[torch.Tensor],
) -> torch.Tensor:
    """Run the MTP layer over stacked depth blocks with decode-time causality.

    Block d (0-based) holds one row per base position i: (embed(tokens[d][:, i]),
    hiddens[d][:, i]) at position ``positions[d][:, i]``. Row (d, i) attends to depth-0 rows
    j <= i (the absorbed, true history) and to rows (d', i) for 1 <= d' <= d (its own chain),
    which is what the KV cache holds when drafting d+1 tokens after position i.
    Returns the (post-normed) outputs of the last block.
    """
    depth = len(tokens)
    b, length = tokens[0].shape
    emb = torch.cat([mtp.embed_tokens(t) for t in tokens], dim=1)
    hid = torch.cat(hiddens, dim=1)
    pos = torch.cat(positions, dim=1)
    q_d = torch.arange(depth).repeat_interleave(length)
    q_i = torch.arange(length).repeat(depth)
    causal = (q_d[None, :] == 0) & (q_i[None, :] <= q_i[:, None])
    chain = (q_d[None, :] >= 1) & (q_d[None, :] <= q_d[:, None]) & (q_i[None, :] == q_i[:, None])
    mask = (causal | chain)[None, None].expand(b, 1, -1, -1)
    cos_sin = mtp.rotary_emb(emb, position_ids=pos)
    out = mtp.layers[0](
        emb, hid, position_embeddings=cos_sin, attention_mask=mask, position_ids=pos, cache=None
    )
    return out[:, (depth - 1) * length :]


@torch.no_grad()
def chained_drafts(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, x: torch.Tensor, depth: int
) -> tuple[torch.Tensor, list[torch.Tensor], list[torch.Tensor]]:
    """Main argmax a[:, i] (token i+1) and chained drafts d_k[:, i] (token i+1+k), k = 1..depth.

    Rows i = 0..L-2 (t_{i+1} must exist). Chaining follows transformers' MtpModel loop: the
    next step gets (draft token, previous MTP output after shared_head.norm), position + 1.
    Also returns the MTP logits of depth 1.
    """
    out = model.model(input_ids=x)
    h = out.last_hidden_state
    a = model.lm_head(h).argmax(-1)
    length = x.shape[1] - 1
    base = torch.arange(1, length + 1).unsqueeze(0).expand(x.shape[0], -1)
    toks = [x[:, 1:]]
    hids = [h[:, :length]]
    poss = [base]
    drafts: list[torch.Tensor] = []
    logits1: list[torch.Tensor] = []
    for k in range(depth):
        z = mtp_rows(mtp, toks, hids, poss)
        lg = mtp._project_to_logits(z)
        if k == 0:
            logits1.append(lg)
        d = lg.argmax(-1)
        drafts.append(d)
        toks.append(d)
        hids.append(z)
        poss.append(base + k + 1)
    return a, drafts, logits1


@torch.no_grad()
def heldout_losses(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, windows: torch.Tensor, bs: int
) -> dict[str, float]:
    """Main and MTP-depth-1 loss, and depth-1 teacher-forced acceptance, over the windows."""
    main_sum = 0.0
    mtp_sum = 0.0
    n_main = 0
    n_mtp = 0
    agree = 0
    n_agree = 0
    for s in range(0, windows.shape[0], bs):
        w = windows[s : s + bs]
        seq = w.shape[1] - 2
        inp = w[:, :seq]
        out = model(input_ids=inp)
        main_sum += float(
            torch.nn.functional.cross_entropy(
                out.logits.reshape(-1, out.logits.shape[-1]),
                w[:, 1 : seq + 1].reshape(-1),
                reduction="sum",
            )
        )
        n_main += inp.numel()
        a, drafts, lg = chained_drafts(model, mtp, w[:, : seq + 1], 1)
        mtp_sum += float(
            torch.nn.functional.cross_entropy(
                lg[0].reshape(-1, lg[0].shape[-1]), w[:, 2:].reshape(-1), reduction="sum"
            )
        )
        n_mtp += inp.numel()
        # draft for token i+2 vs the main model's argmax for token i+2 (row i+1)
        agree += int((drafts[0][:, : seq - 1] == a[:, 1:seq]).sum())
        n_agree += drafts[0][:, : seq - 1].numel()
    return {
        "main_loss": main_sum / n_main,
        "mtp_loss": mtp_sum / n_mtp,
        "mtp_depth1_acceptance_teacher_forced": agree / n_agree,
        "tokens": n_main,
    }


@torch.no_grad()
def greedy_acceptance(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, prompts: torch.Tensor, new: int, depth: int
) -> dict[str, Any]:
    """Acceptance per depth on the main model's own greedy continuations of ``prompts``."""
    gen = model.generate(
        input_ids=prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=new,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=model.config.pad_token_id,
    )
    a, drafts, _ = chained_drafts(model, mtp, gen, depth)
    p = prompts.shape[1]
    length = gen.shape[1] - 1
    # drafting after position i (i >= p-1: the continuation), k-th draft is token i+1+k,
    # verified against a[:, i+k]; only rows whose whole chain can be verified
    rows = torch.arange(p - 1, length - depth)
    ok = torch.ones(gen.shape[0], len(rows), dtype=torch.bool)
    per_depth: list[dict[str, float]] = []
    for k in range(1, depth + 1):
        hit = drafts[k - 1][:, rows] == a[:, rows + k]
        cond = float((hit & ok).sum()) / max(1, int(ok.sum()))
        ok = ok & hit
        per_depth.append(
            {
                "depth": k,
                "conditional": cond,
                "cumulative": float(ok.float().mean()),
                "unconditional": float(hit.float().mean()),
            }
        )
    expected = 1.0 + sum(d["cumulative"] for d in per_depth)
    return {
        "rows": int(ok.numel()),
        "per_depth": per_depth,
        "tokens_per_forward_at_depth_max": expected,
    }


@torch.no_grad()
def oracle_mtp_generate(
    model: DeepseekV3ForCausalLM, prompts: torch.Tensor, new: int
) -> dict[str, Any]:
    """Tokens per main-model forward of transformers' own ``generate(use_mtp=True)``.

    With one MTP layer transformers drafts one token per forward, so tokens/forward - 1
    estimates the depth-1 greedy acceptance on the oracle side. Also checks that the output
    equals plain greedy decoding.
    """
    calls = 0

    def count(_m: torch.nn.Module, _a: Any) -> None:
        nonlocal calls
        calls += 1

    tokens = 0
    forwards = 0
    identical = True
    for row in prompts:
        ids = row[None]
        plain = model.generate(
            input_ids=ids, max_new_tokens=new, do_sample=False, eos_token_id=None
        )
        calls = 0
        hook = model.model.register_forward_pre_hook(count)
        try:
            g = model.generate(
                input_ids=ids, max_new_tokens=new, do_sample=False, eos_token_id=None, use_mtp=True
            )
        finally:
            hook.remove()
        identical = identical and bool(torch.equal(plain, g))
        tokens += g.shape[1] - ids.shape[1]
        forwards += calls
    return {
        "prompts": len(prompts),
        "new_tokens": tokens,
        "main_forwards": forwards,
        "tokens_per_forward": tokens / max(1, forwards),
        "identical_to_greedy": identical,
    }


@torch.no_grad()
def expert_load(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, windows: torch.Tensor, bs: int
) -> list[dict[str, Any]]:
    """Tokens per expert for every MoE layer (main and MTP) on held-out windows."""
    counts: dict[str, torch.Tensor] = {}
    hooks = []
    names: list[str] = []
    for prefix, mod in (("model", model), ("mtp", mtp)):
        for name, m in mod.named_modules():
            if isinstance(m, DeepseekV3TopkRouter):
                key = f"{prefix}.{name}"
                names.append(key)
                counts[key] = torch.zeros(m.num_experts, dtype=torch.long)

                def hook(_m: torch.nn.Module, _i: Any, o: Any, key: str = key) -> None:
                    counts[key] += torch.bincount(o[2].reshape(-1), minlength=counts[key].numel())

                hooks.append(m.register_forward_hook(hook))
    for s in range(0, windows.shape[0], bs):
        w = windows[s : s + bs]
        chained_drafts(model, mtp, w[:, :-1], 1)
    for hk in hooks:
        hk.remove()
    out = []
    for key in names:
        c = counts[key].float()
        out.append(
            {
                "router": key,
                "tokens_per_expert": counts[key].tolist(),
                "max_over_mean": float(c.max() / c.mean()),
                "min_over_mean": float(c.min() / c.mean()),
                "cv": float(c.std() / c.mean()),
            }
        )
    return out


@torch.no_grad()
def samples(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, tok: Tokenizer, new: int
) -> list[dict[str, Any]]:
    """Greedy continuations; also checks that ``generate(use_mtp=True)`` gives the same text."""
    out = []
    for prompt in PROMPTS:
        ids = torch.tensor([tok.encode(prompt).ids])
        g = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False)
        new_ids = g[0, ids.shape[1] :].tolist()
        text = tok.decode(g[0].tolist(), skip_special_tokens=True)
        rec: dict[str, Any] = {
            "prompt": prompt,
            "greedy": text,
            "new_tokens": len(new_ids),
            "stopped_at_eos": model.config.eos_token_id in new_ids,
        }
        try:
            g2 = model.generate(input_ids=ids, max_new_tokens=new, do_sample=False, use_mtp=True)
            rec["use_mtp_identical"] = bool(torch.equal(g, g2))
        except Exception as e:  # report, don't hide: the oracle path may not support this model
            rec["use_mtp_error"] = f"{type(e).__name__}: {e}"
        out.append(rec)
    return out


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="train_tiny.py output dir")
    ap.add_argument("--windows", type=int, default=512, help="max held-out windows per eval set")
    ap.add_argument(
        "--prompts", type=int, default=16, help="held-out prompts for greedy acceptance"
    )
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=128)
    ap.add_argument("--oracle-prompts", type=int, default=4, help="prompts for use_mtp generate")
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    hf = args.out / "hf"
    model, mtp, tok, report = load(hf)
    summary = json.loads((args.out / "train_summary.json").read_text())
    targs = summary["args"]
    train_args = tt.parse_args(
        [
            "--out",
            str(args.out),
            "--stdlib",
            targs["stdlib"],
            "--heldout-pct",
            str(targs["heldout_pct"]),
            "--seq",
            str(targs["seq"]),
            "--eval-windows",
            str(targs["eval_windows"]),
        ]
    )
    seq = int(train_args.seq)
    corpus = tt.collect_corpus(train_args.stdlib, train_args.heldout_pct)
    held = tt.encode_stream(tok, tt.read_texts(corpus.heldout))
    res: dict[str, Any] = {"loading": report, "container_estimate": container_estimate(hf, model)}
    print(json.dumps(res["container_estimate"]), flush=True)
    w_train = tt.heldout_windows(held, seq, train_args.eval_windows)
    res["heldout_train_eval_windows"] = heldout_losses(model, mtp, w_train, 8)
    res["heldout_train_eval_windows"]["training_time"] = summary["history"][-1]
    print(json.dumps(res["heldout_train_eval_windows"]), flush=True)
    # pydoc_data/topics.py (reST prose in a dict literal) is 70% of the held-out tokens: report
    # the held-out *code* (all other held-out files) separately from all held-out text
    code_paths = [p for p in corpus.heldout if p.relative_to(corpus.root).as_posix() != PROSE]
    code = tt.encode_stream(tok, tt.read_texts(code_paths))
    w_code = tt.heldout_windows(code, seq, args.windows)
    res["heldout_code"] = heldout_losses(model, mtp, w_code, 8)
    res["heldout_code"]["files"] = len(code_paths)
    print(json.dumps(res["heldout_code"]), flush=True)
    n_all = len(held) // (seq + 2)
    pick = np.linspace(0, n_all - 1, min(args.windows, n_all)).astype(np.int64)
    w_all = tt.heldout_windows(held, seq, n_all)[torch.from_numpy(pick)]
    res["heldout_all"] = heldout_losses(model, mtp, w_all, 8)
    res["heldout_all"]["files"] = len(corpus.heldout)
    print(json.dumps(res["heldout_all"]), flush=True)
    res["expert_load"] = expert_load(model, mtp, w_code, 8)
    # greedy prompts: prompt_len tokens at evenly spaced offsets of the held-out code stream
    stride = (len(code) - args.prompt_len) // args.prompts
    prompts = torch.from_numpy(
        np.stack(
            [code[i * stride : i * stride + args.prompt_len] for i in range(args.prompts)]
        ).astype(np.int64)
    )
    res["greedy_acceptance"] = greedy_acceptance(model, mtp, prompts, args.new, 3)
    print(json.dumps(res["greedy_acceptance"]), flush=True)
    res["oracle_generate_use_mtp"] = oracle_mtp_generate(
        model, prompts[: args.oracle_prompts], args.new
    )
    print(json.dumps(res["oracle_generate_use_mtp"]), flush=True)
    res["samples"] = samples(model, mtp, tok, 64)
    res["seconds"] = time.time() - t0
    (args.out / "eval.json").write_text(json.dumps(res, indent=2) + "\n")
    for s in res["samples"]:
        print("----", repr(s["prompt"]), {k: v for k, v in s.items() if k.startswith("use_mtp")})
        print(s["greedy"])
    for r in res["expert_load"]:
        print(f"{r['router']}: max/mean {r['max_over_mean']:.2f} min/mean {r['min_over_mean']:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
