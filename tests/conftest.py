"""Shared fixtures: a loadable test model built from the tiny random DeepSeek-V3 fixture.

``tests/fixtures/dsv3_a`` has weights and a config but no tokenizer. The ``test_model_dir``
fixture copies it and adds what a Hugging Face model directory carries next to the weights:
a byte-level ``tokenizer.json`` with exactly 256 tokens (token id ``b`` is byte ``b``, so
the fixture's vocabulary of 256 lines up), a ``tokenizer_config.json`` with a chat template
and an EOS token, and a ``generation_config.json``. The model's output is random bytes,
which is what the UTF-8-safe streaming tests want: random bytes form incomplete and invalid
multi-byte sequences.

Also shared by the test modules split by topic: ``_python_sigint_handler`` (every
``test_api_*`` module uses it for all its tests) and the module-scoped ``server``, ``client``
and ``local`` of the ``test_serve*`` modules (a live ``colibri serve``, tests/helpers/serve.py).
"""

from __future__ import annotations

import json
import shutil
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import pytest
from safetensors.numpy import load_file

if TYPE_CHECKING:
    import colibri
    import openai
    from helpers.serve import Live

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = ROOT / "tests" / "fixtures"
EMBEDDED_TINY = ROOT / "python" / "colibri" / "models" / "tiny"

#: A transformers-style chat template (ChatML-like) in the jinja dialect HF uses.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|' + message['role'] + '|>' + message['content'] + eos_token }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)


def byte_alphabet() -> list[str]:
    """GPT-2's bytes→unicode table: ``alphabet[b]`` is the printable char for byte ``b``."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    table: dict[int, str] = {b: chr(b) for b in printable}
    n = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + n)
            n += 1
    return [table[b] for b in range(256)]


def write_byte_tokenizer(directory: Path, *, eos_id: int = 1) -> None:
    """A 256-token byte-level BPE tokenizer (no merges) and its sidecar configs."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = byte_alphabet()
    vocab = {ch: b for b, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    assert tok.get_vocab_size() == 256
    tok.save(str(directory / "tokenizer.json"))
    eos = alphabet[eos_id]
    (directory / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "eos_token": eos,
                "bos_token": None,
                "chat_template": CHAT_TEMPLATE,
                "model_max_length": 256,
            },
            indent=2,
        )
    )
    (directory / "generation_config.json").write_text(
        json.dumps({"eos_token_id": eos_id, "do_sample": False}, indent=2)
    )


def make_test_model(dst: Path, fixture: str = "dsv3_a") -> Path:
    """Copy a fixture checkpoint into ``dst`` and give it a tokenizer."""
    dst.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "model.safetensors"):
        shutil.copy2(FIXTURES / fixture / name, dst / name)
    write_byte_tokenizer(dst)
    return dst


@pytest.fixture(scope="session", autouse=True)
def colibri_cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Per-model state (the routing history) goes to a scratch cache for the whole run, so
    tests never write into the real ``~/.cache/colibri`` (subprocesses inherit it)."""
    cache = tmp_path_factory.mktemp("colibri-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("COLIBRI_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="session")
def test_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory: the ``dsv3_a`` fixture plus a byte-level tokenizer."""
    return make_test_model(tmp_path_factory.mktemp("model") / "dsv3_a")


@pytest.fixture(scope="session")
def model(test_model_dir: Path) -> Iterator[object]:
    """One loaded :class:`colibri.Model` shared by the tests that only read from it."""
    import colibri

    m = colibri.Model(test_model_dir, threads=2)
    yield m


@pytest.fixture(scope="session")
def golden_a() -> dict[str, np.ndarray]:
    """The transformers goldens of ``dsv3_a`` (see docs/fixtures.md)."""
    return load_file(str(FIXTURES / "dsv3_a" / "golden.safetensors"))


@pytest.fixture
def _python_sigint_handler() -> Iterator[None]:
    """Python's own Ctrl-C handler, as in an interactive session. A process started in the
    background (CI, nohup) inherits SIGINT ignored, and Python then keeps it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


@pytest.fixture(scope="module")
def server() -> Iterator[Live]:
    """A live ``colibri serve`` of the embedded model, one per test module."""
    from helpers.serve import start_server, stop_server

    # The lookahead on (the tiny model fits any budget, which turns "auto" off): the
    # dashboard and metrics show its recall.
    live = start_server(
        "--max-queue", "3", "--sessions", "4", "--max-batch", "2", "--prefetch", "real"
    )
    yield live
    stop_server(live)


@pytest.fixture(scope="module")
def client(server: Live) -> openai.OpenAI:
    return server.client()


@pytest.fixture(scope="module")
def local() -> colibri.Model:
    """The same model in this process: what the server's answers must equal."""
    import colibri

    return colibri.Model(threads=2)
