"""Transformers goldens for the embedded tiny model (developer tool; needs torch).

Reads the Hugging Face export of ``tools/train_tiny.py`` and writes
``tests/fixtures/tiny_golden.safetensors``: held-out code windows (from files of the
held-out split, see docs/tiny-model.md) and transformers' float32 logits for them, stored
as float16 to stay small. Tests compare the shipped int4 container against these.

    /opt/devvenv/bin/python tools/make_tiny_golden.py --hf /work/tiny/hf \\
        --out tests/fixtures/tiny_golden.safetensors
"""

from __future__ import annotations

import argparse
import sysconfig
from pathlib import Path

import numpy as np
import torch
from safetensors.numpy import save_file
from tokenizers import Tokenizer
from transformers import DeepseekV3ForCausalLM

#: Held-out files (by the split rule of tools/train_tiny.py) used for the windows.
HELD_OUT = ["textwrap.py", "stat.py", "abc.py"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--hf", type=Path, required=True)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--tokens", type=int, default=128, help="tokens per window")
    args = p.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(2)
    tok = Tokenizer.from_file(str(args.hf / "tokenizer.json"))
    model = DeepseekV3ForCausalLM.from_pretrained(str(args.hf), dtype=torch.float32)
    model.eval()
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    windows = []
    for name in HELD_OUT:
        text = (stdlib / name).read_text(encoding="utf-8")
        ids = tok.encode(text).ids[: args.tokens]
        assert len(ids) == args.tokens, name
        windows.append(ids)
    ids = torch.tensor(windows, dtype=torch.long)
    with torch.no_grad():
        logits = model(ids).logits.float()
    logp = torch.log_softmax(logits[:, :-1], dim=-1)
    nll = -logp.gather(-1, ids[:, 1:, None])[..., 0]
    loss = nll.mean(dim=1)
    print("held-out windows:", HELD_OUT, "loss per window:", loss.tolist())
    save_file(
        {
            "ids": ids.numpy().astype(np.int64),
            "logits": logits.numpy().astype(np.float16),
            "loss": loss.numpy().astype(np.float32),
        },
        str(args.out),
        metadata={"source": "tools/make_tiny_golden.py", "files": ",".join(HELD_OUT)},
    )
    print("wrote", args.out, args.out.stat().st_size, "bytes")


if __name__ == "__main__":
    main()
