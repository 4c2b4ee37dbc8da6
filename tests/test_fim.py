"""Fill-in-the-middle (``suffix`` in ``/v1/completions``, ``colibri._fim``): with a
tokenizer that has a format's FIM tokens the prompt is built in that format and the answer
is the middle the model writes there; without them ``suffix`` is a 400 naming it.

The embedded tiny model has no FIM tokens. The tests copy it and rename three of its
special tokens (``<|system|>``, ``<|user|>``, ``<|assistant|>``, unused by completions) to
a format's FIM tokens: the model is the same, its tokenizer now offers FIM."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import colibri
import httpx
import pytest
from colibri import _fim
from colibri import _openai as protocol
from conftest import EMBEDDED_TINY
from helpers.serve import MODEL, Live

PREFIX = "def add(a, b):\n    "
SUFFIX = "\n\nprint(add(1, 2))\n"


def _with_fim_tokens(dst: Path, fmt: _fim.FimFormat) -> Path:
    """The tiny model with ``fmt``'s three FIM tokens in place of three unused specials."""
    shutil.copytree(EMBEDDED_TINY, dst)
    renames = {"<|system|>": fmt.prefix, "<|user|>": fmt.suffix, "<|assistant|>": fmt.middle}
    tok = json.loads((dst / "tokenizer.json").read_text(encoding="utf-8"))
    for added in tok["added_tokens"]:
        added["content"] = renames.get(added["content"], added["content"])
    vocab = tok["model"]["vocab"]
    for old, new in renames.items():
        vocab[new] = vocab.pop(old)
    (dst / "tokenizer.json").write_text(json.dumps(tok, ensure_ascii=False), encoding="utf-8")
    cfg = json.loads((dst / "tokenizer_config.json").read_text(encoding="utf-8"))
    for entry in cfg.get("added_tokens_decoder", {}).values():
        entry["content"] = renames.get(entry["content"], entry["content"])
    (dst / "tokenizer_config.json").write_text(json.dumps(cfg, ensure_ascii=False), "utf-8")
    return dst


@pytest.mark.parametrize("name", ["deepseek", "glm"])
def test_suffix_builds_the_tokenizers_fim_prompt(tmp_path: Path, name: str) -> None:
    fmt = next(f for f in _fim.FORMATS if f.name == name)
    model = colibri.Model(_with_fim_tokens(tmp_path / "tiny", fmt), threads=2)
    assert _fim.detect(model.tokenizer) == fmt
    ids = {t: model.tokenizer.token_to_id(t) for t in (fmt.prefix, fmt.suffix, fmt.middle)}
    body = {"prompt": PREFIX, "suffix": SUFFIX, "max_tokens": 12, "temperature": 0}
    req = protocol.parse(dict(body), "completion", model, "m")
    prompt = req.prompt_ids
    # The three FIM tokens, each one token, around the two texts in the format's order.
    before, after = (
        model.encode(PREFIX, add_special_tokens=False),
        model.encode(SUFFIX, add_special_tokens=False),
    )
    p, s, m = ids[fmt.prefix], ids[fmt.suffix], ids[fmt.middle]
    body_ids = [s, *after, p, *before, m] if fmt.suffix_first else [p, *before, s, *after, m]
    assert prompt[-len(body_ids) :] == body_ids
    assert prompt[: -len(body_ids)] == model.encode("", add_special_tokens=True)  # the BOS
    # The answer is the middle: what the model generates after that prompt.
    got = model.create_completion(**body)
    assert isinstance(got, dict)
    want = model.generate(prompt, max_new_tokens=12, temperature=0)
    assert got["choices"][0]["text"] == want.text
    assert got["usage"]["prompt_tokens"] == len(prompt)
    # echo repeats the prompt (the text before the gap), not the FIM prompt.
    echoed = model.create_completion(**body, echo=True)
    assert isinstance(echoed, dict)
    assert echoed["choices"][0]["text"] == PREFIX + want.text
    # A list of prompts takes the suffix each; token-id prompts are refused with it.
    batch = model.create_completion(**{**body, "prompt": [PREFIX, "x = "]})
    assert isinstance(batch, dict) and batch["choices"][0]["text"] == want.text
    with pytest.raises(colibri.InvalidArgumentError, match=r"'prompt'.*before the gap"):
        model.create_completion(**{**body, "prompt": [1, 2, 3]})
    with pytest.raises(colibri.InvalidArgumentError, match="'suffix'"):
        model.create_completion(**{**body, "suffix": 3})
    with pytest.raises(colibri.InvalidArgumentError, match="'truncate_prompt_tokens'"):
        model.create_completion(**body, truncate_prompt_tokens=4)


def test_without_fim_tokens_suffix_is_a_400_naming_it(server: Live) -> None:
    url = server.url + "/v1/completions"
    r = httpx.post(url, json={"model": MODEL, "prompt": PREFIX, "suffix": SUFFIX}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "suffix" and "fill-in-the-middle tokens" in err["message"]
    # An empty suffix is no suffix (what OpenAI's clients send by default).
    ok = httpx.post(url, json={"model": MODEL, "prompt": PREFIX, "suffix": "", "max_tokens": 2})
    assert ok.status_code == 200, ok.text
