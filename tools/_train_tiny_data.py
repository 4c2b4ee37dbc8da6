"""train_tiny.py's data: the corpus (the standard library's sources, split by file) and the
byte-level BPE tokenizer trained on it, with the files colibri reads it from."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<|bos|>"
EOS = "<|endoftext|>"
PAD = "<|pad|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>\\n' + message['content'] + '\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)
EXCLUDED_DIRS = {"site-packages", "test", "tests", "idle_test", "__pycache__"}


# --------------------------------------------------------------------------- corpus


@dataclass
class Corpus:
    """Source files of the corpus, split by file."""

    root: Path
    train: list[Path]
    heldout: list[Path]


def is_heldout(rel: str, pct: int) -> bool:
    """Whether the file with relative path ``rel`` belongs to the held-out split."""
    digest = hashlib.sha256(rel.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "little") % 100 < pct


def collect_corpus(root: Path, heldout_pct: int) -> Corpus:
    """List the stdlib ``*.py`` files under ``root`` (sorted) and split them by path hash."""
    train: list[Path] = []
    heldout: list[Path] = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        if any(part in EXCLUDED_DIRS for part in rel.parts[:-1]):
            continue
        (heldout if is_heldout(rel.as_posix(), heldout_pct) else train).append(path)
    return Corpus(root=root, train=train, heldout=heldout)


def read_text(path: Path) -> str | None:
    """Read a source file as UTF-8; ``None`` when it is not valid UTF-8 or is empty."""
    try:
        text = path.read_text(encoding="utf-8")
    except (UnicodeDecodeError, OSError):
        return None
    return text if text.strip() else None


def read_texts(paths: list[Path]) -> list[str]:
    """Read all readable files of ``paths`` in order."""
    return [t for t in (read_text(p) for p in paths) if t is not None]


# --------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer that prepends ``<|bos|>`` to every encoded sequence."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer=trainer, length=len(texts))
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)]
    )
    return tok


def encode_stream(tok: Tokenizer, texts: list[str]) -> np.ndarray:
    """Encode documents as one stream: ``<|bos|> doc <|endoftext|>`` for each document."""
    eos_id = tok.token_to_id(EOS)
    parts: list[np.ndarray] = []
    for enc in tok.encode_batch(texts, add_special_tokens=True):
        ids = np.asarray([*enc.ids, eos_id], dtype=np.int32)
        parts.append(ids)
    return np.concatenate(parts)


def save_tokenizer_files(tok: Tokenizer, out: Path, max_len: int) -> None:
    """Write ``tokenizer.json`` and a ``tokenizer_config.json`` with bos/eos and a chat template."""
    out.mkdir(parents=True, exist_ok=True)
    tok.save(str(out / "tokenizer.json"))
    added = {
        str(tok.token_to_id(t)): {
            "content": t,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": True,
        }
        for t in SPECIAL_TOKENS
    }
    cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "add_bos_token": True,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_len,
        "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    (out / "tokenizer_config.json").write_text(json.dumps(cfg, indent=2) + "\n")
