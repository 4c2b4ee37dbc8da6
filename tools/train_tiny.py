#!/usr/bin/env python3
"""Train colibri's embedded tiny DeepSeek-V3-style MoE model (with an MTP head) on CPU.

Dev-only tool: needs torch, transformers (>= 5.14, for ``MtpModel``) and tokenizers, i.e.
``/opt/devvenv/bin/python``. Never imported by the package or its tests.

What it does, in order (every stage is deterministic given ``--seed``):

1. Corpus: the ``*.py`` sources of the running CPython's standard library (test directories
   and site-packages excluded). Each file is assigned to the held-out split when
   ``sha256(relative path)`` mod 100 < ``--heldout-pct`` (2 by default), i.e. the split is by
   file and does not depend on the seed or on file order.
2. Tokenizer: byte-level BPE trained with ``tokenizers`` on the train split only.
3. Model: transformers' own ``DeepseekV3ForCausalLM`` (MLA, dense first layer, MoE with one
   shared expert and a noaux_tc sigmoid router with group-limited routing) plus transformers'
   own ``MtpModel`` (one MTP layer, sharing the main embedding and lm_head, exactly the module
   that ``generate(use_mtp=True)`` instantiates).
4. Training: AdamW, warmup + cosine LR over a wall-clock budget, loss = main CE +
   ``--mtp-weight`` * MTP depth-1 CE (DeepSeek-V3 §2.2) + a tiny sequence-wise balance loss;
   after every optimiser step the routers' ``e_score_correction_bias`` is updated with the
   aux-loss-free rule ``b_e += u * sign(mean_load - load_e)`` (DeepSeek-V3 §2.1.2).
   Held-out main/MTP loss is evaluated and a checkpoint written periodically.
5. Export: a Hugging Face checkpoint under ``OUT/hf`` with per-expert official tensor names
   and the MTP layer at ``model.layers.{num_hidden_layers}.*`` (official DeepSeek-V3 names).

Usage::

    nice /opt/devvenv/bin/python tools/train_tiny.py --out /work/tiny --minutes 55
    /opt/devvenv/bin/python tools/train_tiny.py --out /work/tiny --export-only

Evaluation of the export (transformers reload, MTP acceptance, expert balance, samples) is in
``tools/tiny_eval.py``.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import sys
import sysconfig
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM
from transformers.modeling_layers import MtpModel
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

# The corpus and tokenizer, and the export, are in the modules beside this file.
sys.path.insert(0, str(Path(__file__).resolve().parent))
from _train_tiny_data import (
    BOS,
    EOS,
    PAD,
    collect_corpus,
    encode_stream,
    read_texts,
    train_tokenizer,
)
from _train_tiny_export import export_hf

# --------------------------------------------------------------------------- model


def make_config(args: argparse.Namespace, tok: Tokenizer) -> DeepseekV3Config:
    """The tiny DeepSeek-V3 configuration."""
    return DeepseekV3Config(
        vocab_size=tok.get_vocab_size(),
        hidden_size=args.hidden,
        intermediate_size=args.dense_intermediate,
        moe_intermediate_size=args.moe_intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.heads,
        n_shared_experts=1,
        n_routed_experts=args.experts,
        num_experts_per_tok=args.top_k,
        n_group=args.n_group,
        topk_group=args.topk_group,
        routed_scaling_factor=args.routed_scaling,
        norm_topk_prob=True,
        first_k_dense_replace=1,
        kv_lora_rank=args.kv_lora_rank,
        q_lora_rank=None,
        qk_nope_head_dim=args.qk_nope,
        qk_rope_head_dim=args.qk_rope,
        v_head_dim=args.v_head,
        max_position_embeddings=args.max_positions,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rope_interleave=True,
        rms_norm_eps=1e-6,
        initializer_range=0.02,
        tie_word_embeddings=False,
        bos_token_id=tok.token_to_id(BOS),
        eos_token_id=tok.token_to_id(EOS),
        pad_token_id=tok.token_to_id(PAD),
        num_nextn_predict_layers=1,
        hidden_act="silu",
    )


def build_models(config: DeepseekV3Config) -> tuple[DeepseekV3ForCausalLM, MtpModel]:
    """The main model and transformers' MTP module (sharing embed and lm_head)."""
    config._attn_implementation = "sdpa"
    model = DeepseekV3ForCausalLM(config)
    mtp = MtpModel(model, config.num_mtp_layers)
    mtp.config._attn_implementation = "sdpa"
    return model, mtp


def unique_params(*mods: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    """Named parameters of several modules, each shared parameter once."""
    seen: set[int] = set()
    out: list[tuple[str, torch.nn.Parameter]] = []
    for i, m in enumerate(mods):
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((f"{i}.{name}", p))
    return out


def count_params(config: DeepseekV3Config) -> dict[str, int]:
    """Total and per-token active parameter counts (main model, MTP layer, container export)."""
    h = config.hidden_size
    v = config.vocab_size
    nh = config.num_attention_heads
    qk = config.qk_nope_head_dim + config.qk_rope_head_dim
    attn = (
        h * nh * qk
        + h * (config.kv_lora_rank + config.qk_rope_head_dim)
        + config.kv_lora_rank
        + config.kv_lora_rank * nh * (config.qk_nope_head_dim + config.v_head_dim)
        + nh * config.v_head_dim * h
    )
    norms = 2 * h
    dense = 3 * h * config.intermediate_size
    expert = 3 * h * config.moe_intermediate_size
    e = config.n_routed_experts
    router = e * h + e
    moe_total = e * expert + config.n_shared_experts * expert + router
    moe_active = config.num_experts_per_tok * expert + config.n_shared_experts * expert + router
    n_dense = config.first_k_dense_replace
    n_moe = config.num_hidden_layers - n_dense
    embed = v * h
    main_total = (
        2 * embed + n_dense * (attn + norms + dense) + n_moe * (attn + norms + moe_total) + h
    )
    main_active = (
        2 * embed + n_dense * (attn + norms + dense) + n_moe * (attn + norms + moe_active) + h
    )
    mtp_extra = 2 * h + 2 * h * h + h + attn + norms
    return {
        "main_total": main_total,
        "main_active": main_active,
        "main_total_non_embedding": main_total - 2 * embed,
        "main_active_non_embedding": main_active - 2 * embed,
        "mtp_layer_total": mtp_extra + moe_total,
        "mtp_layer_active": mtp_extra + moe_active,
        "export_total_with_mtp_copies": main_total + mtp_extra + moe_total + 2 * embed,
    }


class RouterTap:
    """Forward hooks on every router: records router logits and chosen experts of a forward."""

    def __init__(self, mods: list[tuple[str, DeepseekV3TopkRouter]]) -> None:
        self.mods = mods
        self.logits: list[torch.Tensor] = []
        self.indices: list[torch.Tensor] = []
        for _, m in mods:
            m.register_forward_hook(self._hook)

    def _hook(self, module: torch.nn.Module, inputs: Any, outputs: Any) -> None:
        self.logits.append(outputs[0])
        self.indices.append(outputs[2])

    def clear(self) -> None:
        """Forget the recorded outputs."""
        self.logits.clear()
        self.indices.clear()


def routers(model: DeepseekV3ForCausalLM, mtp: MtpModel) -> list[tuple[str, DeepseekV3TopkRouter]]:
    """All routers in forward order: main MoE layers, then the MTP layer."""
    out: list[tuple[str, DeepseekV3TopkRouter]] = []
    for name, m in model.named_modules():
        if isinstance(m, DeepseekV3TopkRouter):
            out.append((f"main.{name}", m))
    for name, m in mtp.named_modules():
        if isinstance(m, DeepseekV3TopkRouter):
            out.append((f"mtp.{name}", m))
    return out


def balance_loss(logits: torch.Tensor, indices: torch.Tensor, batch: int, k: int) -> torch.Tensor:
    """DeepSeek-V3 sequence-wise balance loss (eq. 17-20) without the alpha factor."""
    e = logits.shape[-1]
    scores = logits.sigmoid().view(batch, -1, e)
    p = (scores / scores.sum(-1, keepdim=True)).mean(1)
    t = scores.shape[1]
    counts = torch.zeros(batch, e, dtype=scores.dtype)
    counts.scatter_add_(1, indices.view(batch, -1), torch.ones(batch, t * k, dtype=scores.dtype))
    f = counts * (e / (k * t))
    return (f * p).sum(-1).mean()


@dataclass
class StepOut:
    """Losses of one forward."""

    loss: torch.Tensor
    main: torch.Tensor
    mtp: torch.Tensor
    bal: torch.Tensor


def forward_losses(
    model: DeepseekV3ForCausalLM,
    mtp: MtpModel,
    tap: RouterTap,
    window: torch.Tensor,
    mtp_weight: float,
    bal_alpha: float,
) -> StepOut:
    """Main + MTP (depth 1) losses on windows of L+2 tokens.

    Main: positions 0..L-1 predict t[1..L]. MTP (transformers' convention): row i takes
    ``enorm(embed(t[i+1]))`` and ``hnorm(h_i)``, h_i being the main model's hidden state after
    ``model.norm``, concatenated embedding-first, at position id i+1, and predicts t[i+2].
    """
    tap.clear()
    seq = window.shape[1] - 2
    inp = window[:, :seq]
    out = model.model(input_ids=inp)
    hidden = out.last_hidden_state
    logits = model.lm_head(hidden)
    main = F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(), window[:, 1 : seq + 1].reshape(-1)
    )
    pos = torch.arange(1, seq + 1).unsqueeze(0).expand(window.shape[0], -1)
    z = mtp.forward_layer(0, hidden, pos, None, input_ids=window[:, 1 : seq + 1])
    mlogits = mtp._project_to_logits(z)
    mloss = F.cross_entropy(
        mlogits.reshape(-1, mlogits.shape[-1]).float(), window[:, 2:].reshape(-1)
    )
    bal = torch.zeros(())
    if bal_alpha > 0:
        k = model.config.num_experts_per_tok
        for lg, ix in zip(tap.logits, tap.indices, strict=True):
            bal = bal + balance_loss(lg, ix, window.shape[0], k)
    loss = main + mtp_weight * mloss + bal_alpha * bal
    return StepOut(loss=loss, main=main, mtp=mloss, bal=bal)


@torch.no_grad()
def update_bias(tap: RouterTap, u: float) -> list[float]:
    """Aux-loss-free balancing: ``b += u * sign(mean_load - load)``; returns max/mean load."""
    ratios: list[float] = []
    for (_, router), ix in zip(tap.mods, tap.indices, strict=True):
        load = torch.bincount(ix.reshape(-1), minlength=router.num_experts).float()
        mean = load.mean()
        router.e_score_correction_bias += u * torch.sign(mean - load)
        ratios.append(float(load.max() / mean))
    return ratios


@torch.no_grad()
def evaluate(
    model: DeepseekV3ForCausalLM, mtp: MtpModel, tap: RouterTap, windows: torch.Tensor, bs: int
) -> dict[str, float]:
    """Mean held-out main and MTP loss over fixed windows."""
    model.eval()
    mtp.eval()
    tot_main = 0.0
    tot_mtp = 0.0
    n = 0
    for i in range(0, windows.shape[0], bs):
        w = windows[i : i + bs]
        o = forward_losses(model, mtp, tap, w, 0.0, 0.0)
        tot_main += float(o.main) * w.shape[0]
        tot_mtp += float(o.mtp) * w.shape[0]
        n += w.shape[0]
    tap.clear()
    model.train()
    mtp.train()
    return {"heldout_main_loss": tot_main / n, "heldout_mtp_loss": tot_mtp / n}


def batches(
    stream: np.ndarray, seq: int, bs: int, rng: np.random.Generator
) -> Iterator[torch.Tensor]:
    """Endless random windows of ``seq + 2`` tokens from the train stream."""
    hi = len(stream) - (seq + 2)
    while True:
        starts = rng.integers(0, hi, size=bs)
        yield torch.from_numpy(np.stack([stream[s : s + seq + 2] for s in starts]).astype(np.int64))


def heldout_windows(stream: np.ndarray, seq: int, limit: int) -> torch.Tensor:
    """Consecutive non-overlapping windows of ``seq + 2`` tokens from the held-out stream."""
    n = min(limit, len(stream) // (seq + 2))
    arr = stream[: n * (seq + 2)].reshape(n, seq + 2).astype(np.int64)
    return torch.from_numpy(arr)


def lr_at(progress: float, step: int, args: argparse.Namespace) -> float:
    """Linear warmup over ``--warmup`` steps, then cosine to ``lr * min_lr_frac`` by the end."""
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    c = 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * c)


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command-line options."""
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", type=Path, required=True, help="output dir (hf/ export, ckpt, logs)")
    ap.add_argument("--minutes", type=float, default=55.0, help="wall-clock training budget")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--stdlib", type=Path, default=Path(sysconfig.get_paths()["stdlib"]))
    ap.add_argument("--heldout-pct", type=int, default=2)
    ap.add_argument("--vocab", type=int, default=4096)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--dense-intermediate", type=int, default=512)
    ap.add_argument("--moe-intermediate", type=int, default=128)
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--n-group", type=int, default=4)
    ap.add_argument("--topk-group", type=int, default=2)
    ap.add_argument("--routed-scaling", type=float, default=2.5)
    ap.add_argument("--kv-lora-rank", type=int, default=64)
    ap.add_argument("--qk-nope", type=int, default=32)
    ap.add_argument("--qk-rope", type=int, default=16)
    ap.add_argument("--v-head", type=int, default=32)
    ap.add_argument("--max-positions", type=int, default=2048)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.1)
    ap.add_argument("--warmup", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--mtp-weight", type=float, default=0.3, help="lambda of the MTP loss")
    ap.add_argument("--bias-u", type=float, default=2e-3, help="aux-loss-free bias update speed")
    ap.add_argument("--bal-alpha", type=float, default=1e-4, help="sequence-wise balance loss")
    ap.add_argument("--eval-minutes", type=float, default=6.0)
    ap.add_argument("--eval-windows", type=int, default=32)
    ap.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads; 1 is ~5x more CPU-efficient than 2 when other jobs share the cores",
    )
    ap.add_argument("--max-steps", type=int, default=0, help="stop after N steps (0: time only)")
    ap.add_argument("--export-only", action="store_true", help="export OUT/ckpt.pt, no training")
    return ap.parse_args(argv)


def log(msg: str) -> None:
    """Timestamped log line on stdout."""
    print(f"[{time.strftime('%H:%M:%S', time.gmtime())}] {msg}", flush=True)


def prepare_data(
    args: argparse.Namespace,
) -> tuple[Tokenizer, np.ndarray, np.ndarray, dict[str, Any]]:
    """Corpus, tokenizer (trained or reloaded from OUT/tokenizer.json) and token streams."""
    corpus = collect_corpus(args.stdlib, args.heldout_pct)
    train_texts = read_texts(corpus.train)
    held_texts = read_texts(corpus.heldout)
    tok_path = args.out / "tokenizer.json"
    if tok_path.exists():
        tok = Tokenizer.from_file(str(tok_path))
        log(f"tokenizer reloaded from {tok_path}")
    else:
        t0 = time.time()
        tok = train_tokenizer(train_texts, args.vocab)
        tok.save(str(tok_path))
        log(f"tokenizer trained in {time.time() - t0:.1f}s, vocab {tok.get_vocab_size()}")
    train = encode_stream(tok, train_texts)
    held = encode_stream(tok, held_texts)
    info = {
        "stdlib": str(args.stdlib),
        "python": sys.version.split()[0],
        "train_files": len(train_texts),
        "heldout_files": len(held_texts),
        "heldout_file_list": [p.relative_to(corpus.root).as_posix() for p in corpus.heldout],
        "train_chars": sum(len(t) for t in train_texts),
        "heldout_chars": sum(len(t) for t in held_texts),
        "train_tokens": len(train),
        "heldout_tokens": len(held),
    }
    log(
        f"corpus: {info['train_files']} train files ({info['train_tokens']} tokens), "
        f"{info['heldout_files']} held-out files ({info['heldout_tokens']} tokens)"
    )
    return tok, train, held, info


def main(argv: list[str] | None = None) -> int:
    """Entry point."""
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    torch.set_num_threads(args.threads)
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tok, train, held, info = prepare_data(args)
    (args.out / "data_info.json").write_text(json.dumps(info, indent=2) + "\n")
    config = make_config(args, tok)
    model, mtp = build_models(config)
    counts = count_params(config)
    log("params: " + json.dumps(counts))
    tap = RouterTap(routers(model, mtp))
    ckpt_path = args.out / "ckpt.pt"

    if args.export_only:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
        model.load_state_dict(ckpt["model"])
        mtp.load_state_dict(ckpt["mtp"], strict=False)
        export_hf(model, mtp, tok, args.out / "hf", args.seq)
        log(f"exported {args.out / 'hf'} from step {ckpt['step']}")
        return 0

    run_training(args, model, mtp, tap, tok, train, held, counts, ckpt_path)
    return 0


def make_optimizer(
    params: list[tuple[str, torch.nn.Parameter]], args: argparse.Namespace
) -> torch.optim.AdamW:
    """AdamW with weight decay on the matrices other than the routers' (``gate.weight``)."""
    decay = [p for n, p in params if p.ndim >= 2 and "gate.weight" not in n]
    no_decay = [p for n, p in params if not (p.ndim >= 2 and "gate.weight" not in n)]
    return torch.optim.AdamW(
        [
            {"params": decay, "weight_decay": args.weight_decay},
            {"params": no_decay, "weight_decay": 0.0},
        ],
        lr=args.lr,
        betas=(0.9, 0.95),
        eps=1e-8,
    )


def run_training(
    args: argparse.Namespace,
    model: DeepseekV3ForCausalLM,
    mtp: MtpModel,
    tap: RouterTap,
    tok: Tokenizer,
    train: np.ndarray,
    held: np.ndarray,
    counts: dict[str, int],
    ckpt_path: Path,
) -> None:
    """Train until the wall-clock budget (or ``--max-steps``) is spent, evaluating, saving
    ``ckpt_path`` and exporting every ``--eval-minutes`` and at the end."""
    windows = heldout_windows(held, args.seq, args.eval_windows)
    params = unique_params(model, mtp)
    opt = make_optimizer(params, args)
    rng = np.random.default_rng(args.seed)
    data = batches(train, args.seq, args.batch, rng)
    budget = args.minutes * 60.0
    t_start = time.time()
    last_eval = t_start
    history: list[dict[str, float]] = []
    step = 0
    ema: dict[str, float] = {}

    def checkpoint(final: bool) -> None:
        ev = evaluate(model, mtp, tap, windows, args.batch)
        ev.update(
            step=step, minutes=(time.time() - t_start) / 60, tokens=step * args.batch * args.seq
        )
        history.append(ev)
        log(
            f"eval step {step}: held-out main {ev['heldout_main_loss']:.4f} "
            f"mtp {ev['heldout_mtp_loss']:.4f}"
        )
        torch.save(
            {
                "model": model.state_dict(),
                "mtp": mtp.state_dict(),
                "step": step,
                "args": vars(args) | {"out": str(args.out), "stdlib": str(args.stdlib)},
            },
            ckpt_path,
        )
        summary = {
            "params": counts,
            "history": history,
            "final": final,
            "step": step,
            "args": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
        }
        (args.out / "train_summary.json").write_text(json.dumps(summary, indent=2) + "\n")
        export_hf(model, mtp, tok, args.out / "hf", args.seq)

    model.train()
    mtp.train()
    while True:
        elapsed = time.time() - t_start
        if elapsed >= budget or (args.max_steps and step >= args.max_steps):
            break
        lr = lr_at(elapsed / budget, step, args)
        for g in opt.param_groups:
            g["lr"] = lr
        w = next(data)
        o = forward_losses(model, mtp, tap, w, args.mtp_weight, args.bal_alpha)
        opt.zero_grad(set_to_none=True)
        o.loss.backward()
        gnorm = float(torch.nn.utils.clip_grad_norm_([p for _, p in params], 1.0))
        opt.step()
        ratios = update_bias(tap, args.bias_u)
        step += 1
        for key, val in (("main", o.main.item()), ("mtp", o.mtp.item()), ("bal", o.bal.item())):
            ema[key] = val if key not in ema else 0.9 * ema[key] + 0.1 * val
        if step % 10 == 0 or step <= 3:
            log(
                f"step {step} lr {lr:.2e} main {ema['main']:.4f} mtp {ema['mtp']:.4f} "
                f"bal {ema['bal']:.3f} gnorm {gnorm:.2f} maxload/mean "
                f"{max(ratios):.2f} ({(time.time() - t_start) / step:.2f}s/step)"
            )
        if time.time() - last_eval >= args.eval_minutes * 60:
            checkpoint(False)
            last_eval = time.time()
    checkpoint(True)
    minutes = (time.time() - t_start) / 60
    log(f"done: {step} steps, {step * args.batch * args.seq} tokens, {minutes:.1f} min")


if __name__ == "__main__":
    raise SystemExit(main())
