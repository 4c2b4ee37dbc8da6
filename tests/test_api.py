"""The Python API (``colibri.Model``) end to end on the tiny DeepSeek-V3 fixture with a byte
tokenizer (see conftest.py): goldens, streaming, stop strings, chat, the hub resolver,
threads/GIL/Ctrl-C behaviour, bad input, and the ``_core`` stub."""

from __future__ import annotations

import ast
import gc
import inspect
import itertools
import json
import os
import shutil
import signal
import socket
import threading
import time
import typing
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import colibri
import numpy as np
import pytest
from colibri import _core
from colibri._text import IncrementalDecoder, StopMatcher
from colibri.model import model_info
from conftest import EMBEDDED_TINY, ROOT, make_test_model
from tokenizers import Tokenizer

# ----------------------------------------------------------------------------- goldens


def test_logits_match_transformers(model: colibri.Model, golden_a: dict[str, np.ndarray]) -> None:
    ids = [int(t) for t in golden_a["prompt_ids"]]
    got = model.logits(ids)
    want = golden_a["logits"]
    assert isinstance(got, np.ndarray)
    assert got.dtype == np.float32
    assert got.shape == want.shape == (len(ids), 256)
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()


@pytest.mark.parametrize(
    ("draft", "depth"), [("off", 1), ("mtp", 2), ("ngram", 3), ("auto", "auto")]
)
def test_greedy_matches_transformers(
    model: colibri.Model, golden_a: dict[str, np.ndarray], draft: str, depth: Any
) -> None:
    ids = [int(t) for t in golden_a["prompt_ids"]]
    out = model.generate(
        ids,
        max_new_tokens=32,
        temperature=0,
        stop=None,
        stop_token_ids=[],
        draft=draft,
        draft_depth=depth,
    )
    assert out.token_ids == [int(t) for t in golden_a["greedy_ids"]]
    assert out.finish_reason == "length"
    assert out.text == model.decode(out.token_ids)


# ----------------------------------------------------------------------------- results, stats


def test_result_and_stats(model: colibri.Model) -> None:
    out = model.generate(
        "The quick brown fox",
        max_new_tokens=40,
        temperature=0,
        stop_token_ids=[],
        draft="mtp",
        draft_depth=2,
    )
    assert isinstance(out, colibri.GenerationResult)
    assert str(out) == out.text
    s = out.stats
    assert s.prompt_tokens == len(model.encode("The quick brown fox"))
    assert s.generated_tokens == len(out.token_ids) == 40
    # Prefill is one forward; every decode forward emits at least one token.
    assert 1 <= s.forwards <= s.generated_tokens
    assert s.tokens_per_second > 0
    assert s.prefill_seconds > 0 and s.decode_seconds > 0
    assert len(s.drafts_proposed) == len(s.drafts_accepted) >= 2
    assert sum(s.drafts_proposed) > 0
    assert all(0 <= a <= p for a, p in zip(s.drafts_accepted, s.drafts_proposed, strict=True))
    # Depth 2 drafting: nothing is ever proposed deeper than 2.
    assert sum(s.drafts_proposed[2:]) == 0
    assert 0.0 <= s.acceptance_rate <= 1.0
    # Routed experts go through the expert store: 2 MoE layers x top-4 per token at least.
    assert s.expert_hits + s.expert_misses >= 2 * 4 * s.generated_tokens
    assert (s.expert_bytes_read > 0) == (s.expert_misses > 0)
    # The fixture's budget holds every expert, so "auto" runs no lookahead and has no recall.
    assert model.info()["lookahead"] is False
    assert s.prefetch_recall is None


@pytest.mark.parametrize(
    ("kwargs", "lookahead"),
    [
        ({}, False),
        ({"prefetch": "off"}, False),
        ({"prefetch": "real"}, True),
        ({"prefetch": "hint"}, True),
        # Too small for every expert: "auto" keeps the lookahead.
        ({"ram_budget": "200KB"}, True),
    ],
)
def test_lookahead_runs_unless_off_or_every_expert_fits(
    test_model_dir: Path, model: colibri.Model, kwargs: dict[str, Any], lookahead: bool
) -> None:
    m = colibri.Model(test_model_dir, threads=1, **kwargs)
    assert m.info()["lookahead"] is lookahead
    kw: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0, "stop_token_ids": []}
    out = m.generate("The quick brown fox", **kw)
    # The lookahead's predictions are what recall counts; its absence changes no token.
    r = out.stats.prefetch_recall
    assert (r is not None and 0.0 <= r <= 1.0) if lookahead else r is None
    assert out.token_ids == model.generate("The quick brown fox", **kw).token_ids


def test_sampling_is_seeded(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 24, "temperature": 1.0, "top_p": 0.9, "top_k": 50}
    a = model.generate("abc", seed=7, stop_token_ids=[], **kw)
    b = model.generate("abc", seed=7, stop_token_ids=[], **kw)
    c = model.generate("abc", seed=8, stop_token_ids=[], **kw)
    assert a.token_ids == b.token_ids
    assert a.token_ids != c.token_ids


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"top_p": 0.9}, ["top_p"]),
        ({"top_k": 5, "seed": 3}, ["top_k", "seed"]),
        ({"temperature": 0, "top_p": 0.5, "top_k": 2, "seed": 1}, ["top_k", "top_p", "seed"]),
    ],
)
def test_sampling_parameters_on_a_greedy_generation_warn(
    model: colibri.Model, kwargs: dict[str, Any], named: list[str]
) -> None:
    """The test model's generation_config.json does not sample, so without a temperature the
    generation is greedy and top_p/top_k/seed change nothing: say so, as transformers does."""
    greedy = model.generate("abc", max_new_tokens=6, temperature=0, stop_token_ids=[])
    with pytest.warns(UserWarning, match="greedy") as record:
        out = model.generate("abc", max_new_tokens=6, stop_token_ids=[], **kwargs)
    assert out.token_ids == greedy.token_ids
    msg = str(record[0].message)
    assert all(f"'{n}'" in msg for n in named), msg
    assert "temperature" in msg
    assert record[0].filename == __file__, "the warning points at the caller"


def test_sampling_parameters_that_apply_do_not_warn(model: colibri.Model) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model.generate("abc", max_new_tokens=4, temperature=0.7, top_p=0.9, top_k=5, seed=1)
        model.generate("abc", max_new_tokens=4)
        model.chat([{"role": "user", "content": "hi"}], max_new_tokens=2, temperature=0)


def test_generation_config_max_new_tokens_is_the_default(tmp_path: Path) -> None:
    d = make_test_model(tmp_path / "m")
    gc = json.loads((d / "generation_config.json").read_text())
    (d / "generation_config.json").write_text(json.dumps({**gc, "max_new_tokens": 7}))
    m = colibri.Model(d, threads=1)
    kw: dict[str, Any] = {"temperature": 0, "stop_token_ids": []}
    out = m.generate("abc", **kw)
    assert len(out.token_ids) == 7 and out.finish_reason == "length"
    assert len(m.generate("abc", max_new_tokens=3, **kw).token_ids) == 3
    assert len("".join(m.generate("abc", stream=True, **kw))) > 0
    # Without it, the default is 128.
    (d / "generation_config.json").write_text(json.dumps(gc))
    assert len(colibri.Model(d, threads=1).generate("abc", **kw).token_ids) == 128
    (d / "generation_config.json").write_text(json.dumps({**gc, "max_new_tokens": "many"}))
    with pytest.raises(colibri.ConfigError, match=r"generation_config\.json.*max_new_tokens"):
        colibri.Model(d, threads=1)


def test_draft_mtp_without_the_head_is_refused_at_construction(
    test_model_dir: Path, tmp_path: Path
) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=r"'draft'.*mtp=False"):
        colibri.Model(test_model_dir, mtp=False, draft="mtp")
    # The other drafters are fine without the head.
    assert colibri.Model(test_model_dir, mtp=False, draft="ngram").default_draft == "ngram"
    # A checkpoint without an MTP layer.
    d = make_test_model(tmp_path / "no-mtp")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 0}))
    assert not colibri.Model(d, threads=1).has_mtp
    with pytest.raises(colibri.InvalidArgumentError, match=r"'draft'.*has none"):
        colibri.Model(d, threads=1, draft="mtp")


def test_eos_stops_and_is_not_in_the_text(model: colibri.Model) -> None:
    # Make the first greedy token the stop token: generation ends after one token.
    first = model.generate("xyz", max_new_tokens=1, temperature=0, stop_token_ids=[]).token_ids
    out = model.generate("xyz", max_new_tokens=20, temperature=0, stop_token_ids=first)
    assert out.token_ids == first
    assert out.finish_reason == "stop"
    assert out.text == ""


# ----------------------------------------------------------------------------- streaming


def test_stream_concatenation_equals_the_result(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 120, "temperature": 0, "stop_token_ids": []}
    full = model.generate("Once upon a time", **kw)
    chunks = list(model.generate("Once upon a time", stream=True, **kw))
    assert chunks and all(isinstance(c, str) and c for c in chunks)
    assert "".join(chunks) == full.text
    # Random bytes: the held-back incomplete sequences are real in this output.
    assert len(chunks) < len(full.token_ids)


def test_stream_yields_multi_token_bursts(model: colibri.Model) -> None:
    """With drafts accepted, one verify forward hands several tokens to the callback and
    the stream yields them as one chunk."""
    bursts: list[int] = []
    original = model._run

    def spy(p: Any, on_text: Any, cancel: Any = None) -> Any:
        def counting(delta: str) -> bool:
            bursts.append(len(delta))
            return bool(on_text(delta))

        return original(p, counting, cancel)

    ids = list(range(65, 75)) * 6  # a repetitive prompt the n-gram drafter can exploit
    model._run = spy  # type: ignore[method-assign]
    try:
        chunks = list(
            model.generate(
                ids,
                stream=True,
                max_new_tokens=150,
                temperature=0,
                stop_token_ids=[],
                draft="ngram",
                draft_depth=4,
            )
        )
    finally:
        del model._run
    full = model.generate(
        ids, max_new_tokens=150, temperature=0, stop_token_ids=[], draft="ngram", draft_depth=4
    )
    assert "".join(chunks) == full.text
    assert sum(full.stats.drafts_accepted) > 0
    # Fewer forwards than tokens, so some callbacks carried several tokens.
    assert full.stats.forwards < full.stats.generated_tokens
    assert len(chunks) <= full.stats.forwards


def test_stream_result_after_exhaustion(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 50, "temperature": 0, "draft": "mtp"}
    full = model.generate("stream result", **kw)
    stream = model.generate("stream result", stream=True, **kw)
    assert isinstance(stream, colibri.model.GenerationStream)
    assert stream.result is None
    text = "".join(stream)
    assert stream.result is not None
    assert stream.result.text == text == full.text
    assert stream.result.token_ids == full.token_ids
    assert stream.result.finish_reason == full.finish_reason
    assert stream.result.stats.generated_tokens == full.stats.generated_tokens
    assert list(stream) == []  # exhausted stays exhausted


def test_stream_can_be_abandoned(model: colibri.Model) -> None:
    with model.generate("abc", stream=True, max_new_tokens=200, stop_token_ids=[]) as it:
        first = next(it)
        assert first
    # Closing stopped the engine early and left the partial result.
    assert it.result is not None
    assert it.result.finish_reason == "cancelled"
    assert len(it.result.token_ids) < 200
    assert it.result.text.startswith(first)
    # The model is free again.
    assert model.generate("abc", max_new_tokens=3, temperature=0).token_ids


class _SlowEngine:
    """Wraps ``_core.Engine`` so each forward's callback takes ``delay`` seconds (a long
    generation on a tiny model) and records every generation's finish reason and length."""

    def __init__(self, engine: Any, delay: float) -> None:
        self._engine = engine
        self._delay = delay
        self.finished: list[tuple[str, int]] = []

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, ids: list[int], request: Any, *, on_tokens: Any, **kw: Any) -> Any:
        def slow(toks: list[int]) -> bool:
            time.sleep(self._delay)
            return bool(on_tokens(toks))

        raw = self._engine.generate(ids, request, on_tokens=slow, **kw)
        self.finished.append((str(raw["finish_reason"]), len(raw["tokens"])))
        return raw


@pytest.mark.parametrize("how", ["break", "break-held", "raise-held", "del", "gc"])
def test_abandoned_stream_cancels_its_generation(model: colibri.Model, how: str) -> None:
    """Breaking out of ``for chunk in generate(stream=True)`` (or an exception in the loop's
    body, or dropping the stream) stops the engine within a forward, even while a variable
    still holds the stream: the abandoned generation does not run to ``max_new_tokens`` and
    the next call does not wait for it."""
    slow = _SlowEngine(model._engine, 0.01)  # 250 forwards: 2.5 s if it ran to the end
    real_engine = model._engine
    model._engine = slow
    try:
        kw: dict[str, Any] = {"max_new_tokens": 250, "stop_token_ids": [], "draft": "off"}
        held = None
        if how == "break":
            for chunk in model.generate("abc", stream=True, **kw):
                assert chunk
                break
        elif how == "break-held":
            held = model.generate("abc", stream=True, **kw)
            for chunk in held:
                assert chunk
                break
        elif how == "raise-held":
            held = model.generate("abc", stream=True, **kw)
            with pytest.raises(KeyError):
                for _chunk in held:
                    raise KeyError("the consumer failed")
        else:
            stream = model.generate("abc", stream=True, **kw)
            assert next(stream)
            if how == "gc":  # only the cycle collector can reclaim it
                stream.cycle = stream  # type: ignore[attr-defined]
            del stream
            gc.collect()
        t0 = time.perf_counter()
        out = model.generate("abc", max_new_tokens=2, temperature=0)
        waited = time.perf_counter() - t0
    finally:
        model._engine = real_engine
    assert len(out.token_ids) == 2
    assert waited < 1.0, f"the second call waited {waited:.2f}s for the abandoned one"
    reason, n = slow.finished[0]
    assert reason == "cancelled" and n < 50, slow.finished
    if held is not None:  # still referenced: its result is the partial generation
        assert held.result is not None and held.result.finish_reason == "cancelled"
        assert next(held, None) is None


def test_stream_read_with_next_goes_on_after_a_pause(model: colibri.Model) -> None:
    """Only a ``for`` loop's own iterator closes the stream: ``next()`` calls, and a second
    loop over what is left, read the whole generation."""
    kw: dict[str, Any] = {"max_new_tokens": 12, "temperature": 0, "draft": "off"}
    whole = model.generate("abc", **kw).text
    stream = model.generate("abc", stream=True, **kw)
    head = next(stream)
    rest = "".join(stream)
    assert head + rest == whole
    assert stream.result is not None and stream.result.finish_reason != "cancelled"


def test_stream_errors_reach_the_consumer(model: colibri.Model) -> None:
    def boom(p: Any, on_text: Any, cancel: Any = None) -> Any:
        raise colibri.InternalError("boom")

    model._run = boom  # type: ignore[method-assign]
    try:
        with pytest.raises(colibri.InternalError, match="boom"):
            list(model.generate("abc", stream=True, max_new_tokens=4))
    finally:
        del model._run


def byte_tokenizer(model_dir: Path) -> Tokenizer:
    return Tokenizer.from_file(str(model_dir / "tokenizer.json"))


def test_incremental_decoder_splits_multibyte_chars(test_model_dir: Path) -> None:
    tok = byte_tokenizer(test_model_dir)
    text = "é€😀 ok ñ"
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode("utf-8"))  # one token per byte
    dec = IncrementalDecoder(tok)
    deltas = [dec.push([i]) for i in ids]
    deltas.append(dec.flush())
    assert all("\ufffd" not in d for d in deltas)
    assert "".join(deltas) == text == dec.text
    # The 4-byte emoji appears exactly once, whole, on its last byte.
    assert deltas[len("é€".encode()) + 3] == "😀"


def test_incremental_decoder_on_random_bytes(test_model_dir: Path) -> None:
    tok = byte_tokenizer(test_model_dir)
    rng = np.random.default_rng(0)
    for _ in range(20):
        ids = [int(i) for i in rng.integers(0, 256, size=40)]
        dec = IncrementalDecoder(tok)
        pieces, k = [], 0
        while k < len(ids):
            n = int(rng.integers(1, 4))
            pieces.append(dec.push(ids[k : k + n]))
            k += n
        pieces.append(dec.flush())
        assert "".join(pieces) == tok.decode(ids)


# ----------------------------------------------------------------------------- stop strings


def test_stop_matcher_holds_back_only_real_prefixes() -> None:
    m = StopMatcher(["END", "\n\n"])
    assert m.safe_len("abc") == 3
    assert m.safe_len("abcE") == 3
    assert m.safe_len("abcEN") == 3
    assert m.safe_len("abc\n") == 3
    assert m.safe_len("abcEX") == 5
    assert m.check("xxENDyy\n\n") == 2
    assert m.check("no stop here") is None


def _stop_candidate(text: str) -> str:
    """A two-character stop string from the middle of ``text`` (no U+FFFD)."""
    for i in range(len(text) // 3, len(text) - 2):
        s = text[i : i + 2]
        if "\ufffd" not in s and text.find(s) == i:
            return s
    raise AssertionError(f"no stop candidate in {text!r}")


def test_stop_strings(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 80, "temperature": 0, "stop_token_ids": []}
    full = model.generate("Hello", **kw).text
    stop = _stop_candidate(full)
    want = full[: full.index(stop)]
    out = model.generate("Hello", stop=stop, **kw)
    assert out.text == want
    assert out.finish_reason == "stop"
    # Also as one of several; and in streaming, where the stop string arrives one byte per
    # token: its first character must never be shown.
    out2 = model.generate("Hello", stop=["\x00never\x00", stop], **kw)
    assert out2.text == want
    chunks = list(model.generate("Hello", stop=[stop], stream=True, **kw))
    # Joined chunks equal the truncated text: the stop string's first char never leaked.
    assert "".join(chunks) == want


# ----------------------------------------------------------------------------- chat


def test_chat_renders_the_template(model: colibri.Model) -> None:
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi!"},
    ]
    eos = json.loads((model.path / "tokenizer_config.json").read_text())["eos_token"]
    prompt = model.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == f"<|system|>Be brief.{eos}<|user|>Hi!{eos}<|assistant|>"
    out = model.chat(messages, max_new_tokens=12, temperature=0)
    ref = model.generate(
        model.encode(prompt, add_special_tokens=False), max_new_tokens=12, temperature=0
    )
    assert out.token_ids == ref.token_ids
    assert "".join(model.chat(messages, max_new_tokens=12, temperature=0, stream=True)) == out.text


def _model_with_template(tmp_path: Path, template: str) -> colibri.Model:
    d = make_test_model(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    return colibri.Model(d, threads=1)


def test_chat_template_is_sandboxed(tmp_path: Path) -> None:
    m = _model_with_template(
        tmp_path, "{{ ''.__class__.__mro__[1].__subclasses__() }}{{ messages }}"
    )
    with pytest.raises(colibri.ColibriError, match="chat template"):
        m.chat([{"role": "user", "content": "hi"}], max_new_tokens=2)


def test_chat_template_raise_exception(tmp_path: Path) -> None:
    m = _model_with_template(tmp_path, "{{ raise_exception('only user turns please') }}")
    with pytest.raises(colibri.InvalidArgumentError, match="only user turns please"):
        m.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    ("messages", "match"),
    [
        ("hello", r"messages.*str.*list of \{'role'.*generate\(prompt\)"),
        ({"role": "user", "content": "hi"}, "messages.*wrap a single message in a list"),
        (None, "messages.*NoneType"),
        ([{"role": "user", "content": 5}], r"messages\[0\]\['content'\].*int.*string"),
        ([{"role": "user", "content": {"text": "hi"}}], r"messages\[0\]\['content'\]"),
        ([{"role": "user"}], r"messages\[0\].*no 'content'"),
        ([{"content": "hi"}], r"messages\[0\].*no 'role'"),
        ([{"role": "user", "content": "ok"}, "hi"], r"messages\[1\].*str"),
        ([{"role": "user", "content": "a\udc80b"}], r"messages\[0\]\['content'\].*Unicode"),
    ],
)
def test_bad_chat_messages(model: colibri.Model, messages: Any, match: str) -> None:
    """Every malformed conversation is an InvalidArgumentError that says what a conversation
    is (never a jinja TypeError, a string iterated as messages, or a ConfigError)."""
    with pytest.raises(colibri.InvalidArgumentError, match=match):
        model.chat(messages, max_new_tokens=2)
    with pytest.raises(colibri.InvalidArgumentError, match=match):
        model.apply_chat_template(messages)


def test_chat_template_errors_on_messages_are_typed(tmp_path: Path) -> None:
    """A template that fails on the messages it is given (not on itself) blames them."""
    m = _model_with_template(tmp_path, "{{ messages[0]['content'] + 1 }}")
    with pytest.raises(colibri.InvalidArgumentError, match="TypeError"):
        m.apply_chat_template([{"role": "user", "content": "hi"}])


def test_text_with_a_lone_surrogate_is_a_typed_error(model: colibri.Model) -> None:
    for call in (
        lambda: model.generate("a\udc80b", max_new_tokens=2),
        lambda: model.encode("\ud800"),
    ):
        with pytest.raises(colibri.InvalidArgumentError, match="not valid Unicode"):
            call()
    with pytest.raises(colibri.InvalidArgumentError, match=r"text.*bytes.*string"):
        model.encode(b"abc")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [5, 1.5, ["tiny"], object()])
def test_model_of_the_wrong_type(bad: Any) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=r"'model'.*model directory"):
        colibri.Model(bad)


def test_nan_weights_name_the_tensor(tmp_path: Path) -> None:
    """An unconverted checkpoint with a NaN weight: loading fails with a
    NonFiniteWeightError naming the tensor and its file, not an InternalError (the dense
    weights are checked as they are read; more cases in test_hostile.py)."""
    from safetensors.numpy import load_file, save_file

    d = make_test_model(tmp_path / "m")
    weights = load_file(str(d / "model.safetensors"))
    name = "model.layers.1.self_attn.kv_a_proj_with_mqa.weight"
    w = weights[name].copy()
    w[3, 5] = np.nan
    weights[name] = w
    save_file(weights, str(d / "model.safetensors"))
    with pytest.raises(colibri.NonFiniteWeightError) as e:
        colibri.Model(d, threads=1)
    msg = str(e.value)
    assert name in msg and "model.safetensors" in msg and "NaN" in msg, msg
    assert "colibri bug" not in msg
    assert f"flat index {3 * w.shape[1] + 5}" in msg


def test_tokenizer_property(model: colibri.Model) -> None:
    assert isinstance(model.tokenizer, Tokenizer)
    ids = model.encode("héllo")
    assert ids == list("héllo".encode())
    assert model.decode(ids) == "héllo"


# ----------------------------------------------------------------------------- loading


def test_missing_path(tmp_path: Path) -> None:
    missing = tmp_path / "no" / "such" / "model"
    with pytest.raises(colibri.ColibriFileNotFoundError, match="does not exist") as e:
        colibri.Model(missing)
    assert str(missing) in str(e.value)
    assert isinstance(e.value, FileNotFoundError)


def test_directory_without_config(tmp_path: Path) -> None:
    with pytest.raises(colibri.ModelNotFoundError, match=r"config\.json"):
        colibri.Model(tmp_path)


def test_unsupported_model_type(tmp_path: Path) -> None:
    d = make_test_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["model_type"] = "llama"
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(colibri.UnsupportedModelError, match="llama") as e:
        colibri.Model(d)
    assert "deepseek_v3" in str(e.value)


@pytest.fixture
def offline_hub(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_OFFLINE=1, an empty hub cache in tmp, and no sockets at all."""
    cache = tmp_path / "hf" / "hub"
    cache.mkdir(parents=True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"network access attempted: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    monkeypatch.setattr(socket, "create_connection", no_network)
    return cache


def test_repo_id_offline_not_cached(offline_hub: Path) -> None:
    with pytest.raises(colibri.ModelNotFoundError, match="HF_HUB_OFFLINE") as e:
        colibri.Model("colibri-test/not-cached")
    assert "colibri-test/not-cached" in str(e.value)


def test_hub_errors_keep_the_cause_and_the_revision(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An unreachable hub: the message carries the network error underneath the hub's
    wrapper, and the revision asked for."""
    import huggingface_hub
    from huggingface_hub.utils import LocalEntryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))

    def unreachable(*args: object, **kwargs: object) -> None:
        try:
            raise ConnectionError("[Errno -2] Name or service not known")
        except ConnectionError as e:
            raise LocalEntryNotFoundError("cannot find the snapshot folder") from e

    monkeypatch.setattr(huggingface_hub, "snapshot_download", unreachable)
    with pytest.raises(colibri.ModelNotFoundError) as e:
        colibri.Model("colibri-test/tiny", revision="v1.2")
    msg = str(e.value)
    assert "Name or service not known" in msg, msg
    assert "'v1.2'" in msg and "--revision v1.2" in msg, msg
    assert "HF_HUB_OFFLINE is set" not in msg, msg

    def refused(*args: object, **kwargs: object) -> None:
        raise TimeoutError("read timed out")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", refused)
    with pytest.raises(colibri.ModelNotFoundError, match=r"v1\.2.*TimeoutError: read timed out"):
        colibri.Model("colibri-test/tiny", revision="v1.2")


def test_offline_error_names_the_revision(offline_hub: Path) -> None:
    with pytest.raises(colibri.ModelNotFoundError, match=r"'abc123'.*HF_HUB_OFFLINE"):
        colibri.Model("colibri-test/not-cached", revision="abc123")


def test_repo_id_from_the_local_cache(offline_hub: Path, test_model_dir: Path) -> None:
    rev = "0123456789abcdef0123456789abcdef01234567"
    repo = offline_hub / "models--colibri-test--tiny-dsv3"
    snap = repo / "snapshots" / rev
    shutil.copytree(test_model_dir, snap)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(rev)
    m = colibri.Model("colibri-test/tiny-dsv3", threads=1)
    assert m.path.resolve() == snap.resolve()
    ref = colibri.Model(test_model_dir, threads=1)
    kw: dict[str, Any] = {"max_new_tokens": 8, "temperature": 0}
    assert m.generate("hub", **kw).token_ids == ref.generate("hub", **kw).token_ids


def test_default_embedded_model() -> None:
    m = colibri.Model()
    # The installed package's copy (site-packages in CI) of the repository's model.
    assert m.path.name == "tiny"
    assert (m.path / "config.json").read_bytes() == (EMBEDDED_TINY / "config.json").read_bytes()
    assert colibri.DEFAULT_MODEL in colibri.embedded_models()
    out = m.generate("def add(a, b):", max_new_tokens=16, temperature=0)
    assert out.stats.generated_tokens == len(out.token_ids) > 0
    assert out.text == m.decode([t for t in out.token_ids if t not in m.eos_token_ids])


# ----------------------------------------------------------------------------- behaviour


def test_gil_is_released_during_a_forward(model: colibri.Model) -> None:
    """A counting thread advances during long ``logits`` calls (one native call each, no
    callbacks): if the GIL were held it would not move at all."""
    ids = list(range(1, 250))
    count = 0
    stop = threading.Event()

    def counter() -> None:
        nonlocal count
        while not stop.is_set():
            count += 1

    t = threading.Thread(target=counter)
    t.start()
    try:
        during = []
        for _ in range(3):
            before = count
            model.logits(ids)
            during.append(count - before)
        before = count
        model.generate("abc", max_new_tokens=200, temperature=0, stop_token_ids=[])
        gen_count = count - before
    finally:
        stop.set()
        t.join()
    assert min(during) > 1000, during
    assert gen_count > 10_000, gen_count


def ctrl_c() -> None:
    """What Ctrl-C does: SIGINT to the main thread (interrupting a blocking wait there)."""
    signal.pthread_kill(threading.main_thread().ident or 0, signal.SIGINT)


@pytest.fixture(autouse=True)
def _python_sigint_handler() -> Iterator[None]:
    """Python's own Ctrl-C handler, as in an interactive session. A process started in the
    background (CI, nohup) inherits SIGINT ignored, and Python then keeps it ignored."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


class _EngineSpy:
    """Wraps ``_core.Engine`` to watch the per-forward callbacks of ``generate``."""

    def __init__(self, engine: Any, after: int, started: threading.Event) -> None:
        self._engine = engine
        self._after = after
        self._started = started
        self.fired = threading.Event()
        self.calls_after_fire = 0
        self.calls = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)

    def generate(self, ids: list[int], request: Any, *, on_tokens: Any, **kw: Any) -> Any:
        def wrapped(toks: list[int]) -> bool:
            self.calls += 1
            if self.fired.is_set():
                self.calls_after_fire += 1
            if self.calls == self._after:
                self._started.set()
            return bool(on_tokens(toks))

        return self._engine.generate(ids, request, on_tokens=wrapped, **kw)


def test_keyboard_interrupt_stops_generation_and_model_stays_usable(
    model: colibri.Model, golden_a: dict[str, np.ndarray]
) -> None:
    """Ctrl-C (SIGINT) arrives once generation is 5 forwards in; the engine
    must stop within one more forward, raise KeyboardInterrupt, and stay usable."""
    started = threading.Event()
    spy = _EngineSpy(model._engine, 5, started)

    def interrupt() -> None:
        if started.wait(10):
            spy.fired.set()
            ctrl_c()

    real_engine = model._engine
    model._engine = spy
    timer = threading.Thread(target=interrupt)
    timer.start()
    raised = False
    try:
        model.generate("a", max_new_tokens=250, temperature=0, stop_token_ids=[], draft="off")
    except KeyboardInterrupt:
        raised = True
    finally:
        model._engine = real_engine
        timer.join()
    assert spy.fired.is_set()
    assert raised, "KeyboardInterrupt was not raised"
    assert spy.calls < 200, "generation ran to the end"
    assert spy.calls_after_fire <= 1, spy.calls_after_fire
    ids = [int(t) for t in golden_a["prompt_ids"]]
    out = model.generate(ids, max_new_tokens=32, temperature=0, stop_token_ids=[])
    assert out.token_ids == [int(t) for t in golden_a["greedy_ids"]]


def test_keyboard_interrupt_while_streaming(model: colibri.Model) -> None:
    """Ctrl-C reaches the consumer (main thread) while the engine runs on the worker; the
    stream stops the engine within one forward and keeps the partial result."""
    started = threading.Event()
    spy = _EngineSpy(model._engine, 5, started)

    def interrupt() -> None:
        if started.wait(10):
            spy.fired.set()
            ctrl_c()

    real_engine = model._engine
    model._engine = spy
    timer = threading.Thread(target=interrupt)
    timer.start()
    stream = model.generate("a", max_new_tokens=250, stream=True, stop_token_ids=[], draft="off")
    raised = False
    try:
        with stream:
            for _ in stream:
                pass
    except KeyboardInterrupt:
        raised = True
    finally:
        model._engine = real_engine
        timer.join()
    assert raised
    assert stream.result is not None and stream.result.finish_reason == "cancelled"
    assert spy.calls_after_fire <= 2, spy.calls_after_fire
    assert len(stream.result.token_ids) < 200
    assert model.generate("a", max_new_tokens=4, temperature=0).token_ids


def test_properties_do_not_wait_for_a_running_generation(model: colibri.Model) -> None:
    """The engine holds its lock for a whole generation; Model's properties and info() must
    not need it (they would block holding the GIL that the generation's callbacks need)."""
    with model.generate("busy", stream=True, max_new_tokens=200, stop_token_ids=[]) as s:
        next(s)
        assert model.max_context == 256
        assert model.has_mtp
        assert model.eos_token_ids == [1]
        assert model.info()["config"]["vocab_size"] == 256


def test_concurrent_calls_are_serialised(model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 30, "temperature": 0, "stop_token_ids": []}
    prompts = ["alpha", "beta", "gamma", "delta"]
    want = {p: model.generate(p, **kw).token_ids for p in prompts}
    want_logits = model.logits([5, 6, 7])
    results: dict[str, list[int]] = {}
    errors: list[BaseException] = []

    def work(p: str) -> None:
        try:
            for _ in range(2):
                results[p] = model.generate(p, **kw).token_ids
                np.testing.assert_array_equal(model.logits([5, 6, 7]), want_logits)
        except BaseException as e:
            errors.append(e)

    threads = [threading.Thread(target=work, args=(p,)) for p in prompts]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors
    assert results == want


# ----------------------------------------------------------------------------- bad input

BAD_GENERATE: list[tuple[dict[str, Any], str]] = [
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"max_new_tokens": -3}, "max_new_tokens"),
    ({"max_new_tokens": 2.5}, "max_new_tokens"),
    ({"temperature": -0.1}, "temperature"),
    ({"temperature": float("nan")}, "temperature"),
    ({"temperature": float("inf")}, "temperature"),
    ({"temperature": "hot"}, "temperature"),
    ({"top_p": 0.0}, "top_p"),
    ({"top_p": 1.5}, "top_p"),
    ({"top_p": -0.2}, "top_p"),
    ({"top_k": -1}, "top_k"),
    ({"top_k": 2.0}, "top_k"),
    ({"seed": 1.5}, "seed"),
    ({"seed": "42"}, "seed"),
    ({"seed": -1}, "seed"),
    ({"seed": 2**64}, "seed"),
    ({"draft": "eagle"}, "draft"),
    ({"draft": None, "draft_depth": 0}, "draft_depth"),
    ({"draft_depth": 9}, "draft_depth"),
    ({"draft_depth": "deep"}, "draft_depth"),
    ({"stop": 5}, "stop"),
    ({"stop": [""]}, "stop"),
    ({"stop_token_ids": [1000]}, "stop_token_ids"),
    ({"stop_token_ids": "1"}, "stop_token_ids"),
]


@pytest.mark.parametrize(("kwargs", "param"), BAD_GENERATE)
def test_bad_generate_arguments(model: colibri.Model, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=param):
        model.generate("hello", **kwargs)


@pytest.mark.parametrize(
    ("prompt", "match"),
    [
        ("", "empty"),
        ([], "empty"),
        ([1, 2, 256], "vocabulary"),
        ([1, -2], "prompt"),
        ([1, 2**40], "vocabulary"),
        ([1, 2.0], "prompt"),
        (None, "prompt"),
        (42, "prompt"),
        ([7] * 256, "context"),
        ("x" * 300, "context"),
    ],
)
def test_bad_prompts(model: colibri.Model, prompt: Any, match: str) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=match):
        model.generate(prompt, max_new_tokens=4)


def test_bad_logits_input(model: colibri.Model) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match="context"):
        model.logits([3] * 257)
    with pytest.raises(colibri.InvalidArgumentError, match="empty"):
        model.logits([])


def test_long_generation_ends_at_the_context(model: colibri.Model) -> None:
    out = model.generate([5] * 250, max_new_tokens=100, temperature=0, stop_token_ids=[])
    assert out.finish_reason == "length"
    assert len(out.token_ids) == model.max_context - 250


def test_max_context_bounds_the_context(test_model_dir: Path, model: colibri.Model) -> None:
    m = colibri.Model(test_model_dir, threads=1, max_context=40)
    assert m.max_context == 40 and m.info()["max_context"] == 40
    kw: dict[str, Any] = {"temperature": 0, "stop_token_ids": []}
    out = m.generate([5] * 30, max_new_tokens=100, **kw)
    assert out.finish_reason == "length"
    assert len(out.token_ids) == 10
    # The same tokens as the unbounded model: the bound cuts, it does not change the output.
    assert out.token_ids == model.generate([5] * 30, max_new_tokens=10, **kw).token_ids
    with pytest.raises(colibri.InvalidArgumentError, match="max_context"):
        m.generate([5] * 40, max_new_tokens=1)
    with pytest.raises(colibri.InvalidArgumentError, match="max_context"):
        m.logits([3] * 41)
    # The default: the config's limit (this model's KV fits easily).
    assert (
        model.max_context
        == json.loads((test_model_dir / "config.json").read_text())["max_position_embeddings"]
    )


def _glm_dsa_dir(tmp_path: Path, drop_indexer: bool) -> Path:
    from safetensors.numpy import load_file, save_file

    d = make_test_model(tmp_path / "glm_dsa", fixture="glm_dsa")
    if drop_indexer:
        tensors = load_file(str(d / "model.safetensors"))
        kept = {k: v for k, v in tensors.items() if ".indexer." not in k}
        assert len(kept) < len(tensors)
        save_file(kept, str(d / "model.safetensors"))
    return d


def test_glm_dsa_runs_past_index_topk_as_transformers(tmp_path: Path) -> None:
    from safetensors.numpy import load_file

    golden = load_file(str(ROOT / "tests/fixtures/glm_dsa/golden.safetensors"))
    m = colibri.Model(_glm_dsa_dir(tmp_path, drop_indexer=False), threads=1)
    cfg = m.config
    assert m.max_context == cfg["max_position_embeddings"] > 8 * cfg["index_topk"]
    prompt = [int(t) for t in golden["prompt_ids"]]
    assert len(prompt) > cfg["index_topk"]
    got = m.logits(prompt)
    want = golden["logits"]
    assert np.abs(got - want).max() <= 1e-3 * np.abs(want).max()
    out = m.generate(prompt, max_new_tokens=32, temperature=0, stop_token_ids=[])
    assert out.token_ids == [int(t) for t in golden["greedy_ids"]]
    # KV per token: latent + roped key per layer, an indexer key per full layer, and the
    # MTP layer's row with its own indexer key.
    row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    full = cfg["indexer_types"].count("full")
    index_key = cfg["index_head_dim"] * 4
    want_kv = cfg["num_hidden_layers"] * row + full * index_key + row + index_key
    assert m.info()["memory"]["kv_bytes_per_token"] == want_kv


def test_glm_without_indexer_tensors_is_limited_to_index_topk(tmp_path: Path) -> None:
    m = colibri.Model(_glm_dsa_dir(tmp_path, drop_indexer=True), threads=1)
    topk = m.config["index_topk"]
    assert m.max_context == topk
    row = (m.config["kv_lora_rank"] + m.config["qk_rope_head_dim"]) * 4
    assert m.info()["memory"]["kv_bytes_per_token"] == (m.config["num_hidden_layers"] + 1) * row
    with pytest.raises(colibri.InvalidArgumentError, match="max_context"):
        m.logits([3] * (topk + 1))
    with pytest.raises(colibri.InvalidArgumentError, match="index_topk"):
        colibri.Model(_glm_dsa_dir(tmp_path / "b", drop_indexer=True), max_context=topk + 1)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"max_context": 0}, "max_context"),
        ({"max_context": 10**6}, "max_context"),
        ({"max_context": 2**70}, "max_context"),
        ({"max_context": "long"}, "max_context"),
        ({"n_ctx": 0}, "n_ctx"),
        ({"n_ctx": 64, "max_context": 32}, "n_ctx"),
        ({"io": "turbo"}, "io"),
        ({"prefetch": "maybe"}, "prefetch"),
        ({"draft": "eagle"}, "draft"),
        ({"draft_depth": 0}, "draft_depth"),
        ({"threads": -1}, "threads"),
        ({"threads": 1.5}, "threads"),
        ({"ram_budget": "lots"}, "ram_budget"),
        ({"ram_budget": -5}, "ram_budget"),
    ],
)
def test_bad_model_options(test_model_dir: Path, kwargs: dict[str, Any], param: str) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=param):
        colibri.Model(test_model_dir, **kwargs)


def test_n_ctx_is_max_context(test_model_dir: Path) -> None:
    assert colibri.Model(test_model_dir, n_ctx=48).max_context == 48
    assert colibri.Model(test_model_dir, n_ctx=48, max_context=48).max_context == 48


@pytest.mark.parametrize(
    "kwargs",
    [
        {"io": "pread", "prefetch": "off"},
        {"io": "mmap", "prefetch": "real", "ram_budget": "200KB"},
        {"mtp": False, "draft": "ngram", "draft_depth": 3},
    ],
)
def test_model_options_keep_the_output(
    test_model_dir: Path, model: colibri.Model, kwargs: dict[str, Any]
) -> None:
    m = colibri.Model(test_model_dir, threads=1, **kwargs)
    if kwargs.get("mtp") is False:
        assert not m.has_mtp
    kw: dict[str, Any] = {"max_new_tokens": 20, "temperature": 0, "stop_token_ids": []}
    assert m.generate("opts", **kw).token_ids == model.generate("opts", **kw).token_ids


def test_info(model: colibri.Model) -> None:
    info = model.info()
    cfg = json.loads((model.path / "config.json").read_text())
    assert info["config"]["model_type"] == "deepseek_v3"
    assert info["config"]["num_hidden_layers"] == cfg["num_hidden_layers"]
    size = (model.path / "model.safetensors").stat().st_size
    # Every tensor byte is counted once; the rest of the file is the header.
    assert 0 < size - info["total_bytes"] < 64 * 1024
    # The fixture is F32: each routed expert matrix is moe_inter x hidden floats.
    routed = info["tensors"]["routed_experts"]
    n_moe = cfg["num_hidden_layers"] - cfg["first_k_dense_replace"]
    per_expert = 3 * cfg["moe_intermediate_size"] * cfg["hidden_size"] * 4
    assert routed == {"f32": n_moe * cfg["n_routed_experts"] * per_expert}
    mem = info["memory"]
    mtp_experts = cfg["n_routed_experts"] * per_expert
    assert mem["expert_bytes"] == routed["f32"] + mtp_experts
    assert mem["dense_bytes"] + mem["expert_bytes"] == info["total_bytes"]
    kv_row = (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    assert mem["kv_bytes_per_token"] == (cfg["num_hidden_layers"] + 1) * kv_row


# ----------------------------------------------------------------------------- the stub


def _stub_names() -> tuple[set[str], dict[str, set[str]]]:
    tree = ast.parse((ROOT / "python" / "colibri" / "_core.pyi").read_text())
    names: set[str] = set()
    classes: dict[str, set[str]] = {}
    for node in tree.body:
        typed_dict = isinstance(node, ast.ClassDef) and any(
            isinstance(b, ast.Name) and b.id == "TypedDict" for b in node.bases
        )
        if typed_dict:  # a type for checkers only (the dict a function takes)
            continue
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        if isinstance(node, ast.ClassDef):
            classes[node.name] = {n.name for n in node.body if isinstance(n, ast.FunctionDef)}
    return names, classes


def _snapshot(directory: Path) -> dict[str, tuple[int, int]]:
    return {p.name: (p.stat().st_size, p.stat().st_mtime_ns) for p in directory.iterdir()}


def test_routing_history_goes_to_the_cache_not_the_model_dir(
    tmp_path: Path, colibri_cache_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The routing history is per-model state: it is saved in the user cache directory under
    the model's fingerprint, never next to the weights (an installed package, the hub
    cache)."""
    model_dir = make_test_model(tmp_path / "m")
    before = _snapshot(model_dir)
    m = colibri.Model(model_dir)
    m.generate("abc", max_new_tokens=4, temperature=0)
    assert _snapshot(model_dir) == before, "wrote into the model directory"
    path = m.usage_path
    assert path is not None and path.is_file()
    assert path.parent.parent == colibri_cache_dir / "models"
    assert json.loads(path.read_text())["format"] == "colibri-usage"
    # The embedded model (inside the installed package) is left alone too.
    tiny_before = _snapshot(EMBEDDED_TINY)
    colibri.Model().generate("def", max_new_tokens=4, temperature=0)
    assert _snapshot(EMBEDDED_TINY) == tiny_before, "wrote into the installed package"
    # An explicit cache_dir wins over the environment; XDG_CACHE_HOME and HOME follow.
    mine = tmp_path / "mine"
    m = colibri.Model(model_dir, cache_dir=mine)
    m.generate("abc", max_new_tokens=4, temperature=0)
    assert m.usage_path is not None and m.usage_path.is_relative_to(mine)
    assert m.usage_path.is_file()
    monkeypatch.delenv("COLIBRI_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    m = colibri.Model(model_dir)
    assert m.usage_path is not None
    assert m.usage_path.is_relative_to(tmp_path / "xdg" / "colibri" / "models")
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    m = colibri.Model(model_dir)
    assert m.usage_path is not None
    assert m.usage_path.is_relative_to(tmp_path / "home" / ".cache" / "colibri")


def test_a_legacy_history_next_to_the_weights_is_migrated(
    tmp_path: Path, colibri_cache_dir: Path
) -> None:
    """A ``colibri-usage.json`` left in the model directory by an older colibri is read (it
    still picks the pinned set) and its counts move to the cache; the file is not touched."""
    model_dir = tmp_path / "tiny"
    shutil.copytree(EMBEDDED_TINY, model_dir)
    legacy = model_dir / "colibri-usage.json"
    assert legacy.is_file()
    legacy_total = sum(map(sum, json.loads(legacy.read_text())["layers"].values()))
    before = _snapshot(model_dir)
    m = colibri.Model(model_dir, cache_dir=tmp_path / "cache")
    assert m._engine.expert_stats()["pin_set_len"] > 0, "the legacy history was not read"
    m.generate("def", max_new_tokens=8, temperature=0)
    assert _snapshot(model_dir) == before
    assert m.usage_path is not None
    saved = json.loads(m.usage_path.read_text())
    assert sum(map(sum, saved["layers"].values())) > legacy_total


def test_the_engine_request_stub_lists_the_engine_fields() -> None:
    """``_core.pyi``'s ``GenerateRequest`` is the Rust ``GenerateRequest``'s field list, and
    a field the engine does not have is refused by name."""
    tree = ast.parse((ROOT / "python" / "colibri" / "_core.pyi").read_text())
    stub = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "GenerateRequest")
    fields = [n.target.id for n in stub.body if isinstance(n, ast.AnnAssign)]  # type: ignore[union-attr]
    assert fields == _core.request_fields()
    with pytest.raises(colibri.InvalidArgumentError, match="unknown field 'temprature'"):
        _core.check_request({"temprature": 1.0})
    with pytest.raises(colibri.InvalidArgumentError, match=r"'top_k'.*expected an integer"):
        _core.check_request({"top_k": "3"})


def test_core_stub_matches_the_binary() -> None:
    stub, classes = _stub_names()
    runtime = {n for n in dir(_core) if not (n.startswith("__") and n.endswith("__"))}
    runtime.add("__version__")
    stub_public = {n for n in stub if not (n.startswith("__") and n != "__version__")}
    assert runtime == stub_public
    for cls_name, members in classes.items():
        cls = getattr(_core, cls_name)
        real = {n for n in vars(cls) if not n.startswith("_")}
        real |= {n for n in ("__len__", "__contains__") if n in vars(cls)}
        stubbed = {n for n in members if not n.startswith("_")}
        stubbed |= {n for n in ("__len__", "__contains__") if n in members}
        assert real == stubbed, cls_name


_FORK_SCRIPT = """
import os, sys
import colibri

model = colibri.Model(sys.argv[1])
want = model.generate("def", max_new_tokens=4, temperature=0).text
pid = os.fork()
if pid == 0:
    try:
        model.generate("def", max_new_tokens=4, temperature=0)
        code = 2
    except colibri.ForkedProcessError as e:
        code = 0 if "fork" in str(e) and "spawn" in str(e) else 3
    if sys.argv[2] == "os._exit" or code:
        os._exit(code)
    sys.exit(0)  # interpreter teardown drops the model in the child
_, status = os.waitpid(pid, 0)
assert os.waitstatus_to_exitcode(status) == 0, status
assert model.generate("def", max_new_tokens=4, temperature=0).text == want
print("parent ok")
"""


@pytest.mark.parametrize("exit_how", ["os._exit", "normal"])
def test_a_forked_child_gets_a_clear_error(test_model_dir: Path, exit_how: str) -> None:
    """A model loaded before fork() refuses to run in the child (its threads stayed in the
    parent) with ForkedProcessError instead of hanging; the child exits cleanly either way
    (a normal exit drops the model during interpreter teardown), and the parent's model keeps
    working."""
    import subprocess
    import sys

    done = subprocess.run(
        [sys.executable, "-c", _FORK_SCRIPT, str(test_model_dir), exit_how],
        capture_output=True,
        text=True,
        timeout=180,
    )
    assert done.returncode == 0, done.stderr
    assert "parent ok" in done.stdout


# ----------------------------------------------------------------------------- typing


def test_finish_reason_is_a_literal_of_what_the_engine_produces() -> None:
    """``GenerationResult.finish_reason`` is typed as the Literal of its values, and every
    reason the Rust engine can return (FinishReason::as_str) maps onto one of them."""
    from colibri.results import _ENGINE_FINISH_REASONS, FinishReason

    hints = typing.get_type_hints(colibri.GenerationResult)
    assert hints["finish_reason"] == FinishReason
    assert set(typing.get_args(FinishReason)) == {"length", "stop", "cancelled"}
    engine = set(_core.finish_reasons())
    assert engine == set(_ENGINE_FINISH_REASONS), engine
    assert set(_ENGINE_FINISH_REASONS.values()) <= set(typing.get_args(FinishReason))


def test_logits_and_chat_are_typed() -> None:
    import numpy.typing as npt

    hints = typing.get_type_hints(colibri.Model.logits)
    assert hints["return"] == npt.NDArray[np.float32]
    if not hasattr(typing, "get_overloads"):  # Python 3.10
        pytest.skip("typing.get_overloads needs Python 3.11")
    # Each overload as (what it takes: n given, a list of prompts, stream) → what it returns.
    for name in ("generate", "chat"):
        got = []
        for o in typing.get_overloads(getattr(colibri.Model, name)):
            h = typing.get_type_hints(o)
            takes = h.get("prompt", h.get("messages"))
            batch = name == "generate" and "list[str]" in str(takes)
            got.append(("n" in h and h["n"] is int, batch, h["stream"], h["return"]))
        want = [
            (True, False, typing.Literal[False], list[colibri.GenerationResult]),
            (False, False, typing.Literal[False], colibri.GenerationResult),
            (False, False, typing.Literal[True], colibri.GenerationStream),
        ]
        if name == "generate":
            want.append((False, True, typing.Literal[False], list[colibri.GenerationResult]))
        assert sorted(map(str, got)) == sorted(map(str, want)), name
    # chat takes generate's keyword arguments, spelled out, and the tools of a chat.
    gen = inspect.signature(colibri.Model.generate).parameters
    chat = inspect.signature(colibri.Model.chat).parameters
    chat_only = {"messages", "tools", "tool_choice"}
    assert [p for p in gen if p != "prompt"] == [p for p in chat if p not in chat_only]
    assert {"tools", "tool_choice"} <= set(chat)


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 0.9, "seed": 5}])
def test_chat_turns_prefill_only_their_new_tokens(
    test_model_dir: Path, sampling: dict[str, Any]
) -> None:
    """Each turn keeps the earlier turns' KV: it prefills only what follows the previous
    prompt, and its output is what a model that never saw the earlier turns gives. (The
    replies here are fixed text: this model's random bytes do not survive a text round trip,
    and the cache can only hold what the next prompt's tokens repeat.)"""
    warm = colibri.Model(test_model_dir, threads=1)
    fresh = colibri.Model(test_model_dir, threads=1)
    messages: list[dict[str, str]] = []
    previous_prompt = 0
    for turn, text in enumerate(["hello", "tell me more", "and then?", "thanks"]):
        messages.append({"role": "user", "content": text})
        rendered = warm.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        prompt_tokens = len(warm.encode(rendered, add_special_tokens=False))
        out = warm.chat(messages, max_new_tokens=12, **sampling)
        fresh.logits([3])  # empties the fresh model's cache
        assert out.token_ids == fresh.chat(messages, max_new_tokens=12, **sampling).token_ids
        s = out.stats
        assert s.prompt_tokens == prompt_tokens
        if turn == 0:
            assert s.prompt_cached_tokens == 0
        else:
            # The previous prompt (less one token with MTP drafting) comes from the cache.
            assert previous_prompt - 1 <= s.prompt_cached_tokens < prompt_tokens, turn
            new = prompt_tokens - previous_prompt
            assert s.prompt_tokens - s.prompt_cached_tokens <= new + 1, turn
        previous_prompt = prompt_tokens
        messages.append({"role": "assistant", "content": "ok"})


def test_sessions_keep_their_own_conversations(test_model_dir: Path) -> None:
    m = colibri.Model(test_model_dir, threads=1)
    fresh = colibri.Model(test_model_dir, threads=1)
    a, b = m.session(), m.session()
    kw: dict[str, Any] = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": []}
    pa, pb = [5, 6, 7, 8, 9, 10, 11], [40, 41, 42, 43, 44]
    ra, rb = a.generate(pa, **kw), b.generate(pb, **kw)
    m.generate([99, 98, 97], **kw)  # the model's own cache, in between
    # Each session's next turn keeps its whole previous turn, whatever ran in between.
    pa2 = pa + ra.token_ids + [12, 13]
    pb2 = pb + rb.token_ids + [45]
    for s, p2 in [(b, pb2), (a, pa2)]:
        out = s.generate(p2, **kw)
        fresh.logits([3])
        assert out.token_ids == fresh.generate(p2, **kw).token_ids
        assert out.stats.prompt_cached_tokens >= len(p2) - 4
        assert s.kv_tokens == len(p2) + len(out.token_ids) - 1
        assert s.kv_bytes > 0
    # Chat and streaming on a session; reset forgets.
    text = "".join(a.chat([{"role": "user", "content": "hi"}], stream=True, **kw))
    assert isinstance(text, str)
    a.reset()
    assert a.kv_tokens == 0
    assert a.generate(pa, **kw).stats.prompt_cached_tokens == 0
    with pytest.raises(colibri.InvalidArgumentError, match="keyword"):
        a.generate(pa, max_length=3)
    other = colibri.Model(test_model_dir, threads=1).session()
    with pytest.raises(colibri.InvalidArgumentError, match="session"):
        m._start(pa, None, False, dict(kw), other._core)


def test_a_huge_layer_count_in_the_config_allocates_nothing_for_it(tmp_path: Path) -> None:
    """A config may claim 2^24 MTP layers; per-layer state is sized by the tensors that
    exist, so the model opens at once and runs the one MTP layer it has."""
    import resource

    d = make_test_model(tmp_path / "m")
    cfg = json.loads((d / "config.json").read_text())
    cfg["num_nextn_predict_layers"] = 1 << 24
    (d / "config.json").write_text(json.dumps(cfg))
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    m = colibri.Model(d, threads=1)
    grown_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kib < 200 * 1024, f"opening grew the peak RSS by {grown_kib} KiB"
    assert m.has_mtp
    out = m.generate([5, 6, 7], max_new_tokens=4, temperature=0, stop_token_ids=[])
    assert len(out.token_ids) == 4


def test_session_properties_wait_for_its_generation_without_deadlock(
    test_model_dir: Path,
) -> None:
    m = colibri.Model(test_model_dir, threads=1)
    s = m.session()
    kw: dict[str, Any] = {"max_new_tokens": 60, "temperature": 0, "stop_token_ids": []}
    stream = s.generate([5] * 5, stream=True, **kw)
    chunks = iter(stream)
    next(chunks)  # the generation now runs on the session, its callback needing the GIL
    seen: list[int] = []
    reader = threading.Thread(target=lambda: seen.append(s.kv_tokens))
    reader.start()
    rest = list(chunks)
    reader.join(timeout=60)
    assert not reader.is_alive() and seen, "reading the session waited forever"
    assert stream.result is not None and isinstance(rest, list)
    assert s.kv_tokens == 5 + len(stream.result.token_ids) - 1


def test_a_context_saved_with_the_mtp_head_is_refused_without_it(tmp_path: Path) -> None:
    """The docs promise ``SavedContextError`` for a context saved with other options: with
    the MTP head on into a model without it, and the reverse (whose MTP rows would be
    missing, so drafting would throw the whole context away)."""
    with_head, without = colibri.Model(threads=1), colibri.Model(threads=1, mtp=False)
    for saver, loader, needle in [
        (with_head, without, "MTP head on, and this model has it off"),
        (without, with_head, "MTP head off, and this model has it on"),
    ]:
        s = saver.session()
        s.prefill("def add(a, b):")
        path = tmp_path / f"{needle[:11]}.ctx"
        s.save(path)
        with pytest.raises(colibri.SavedContextError, match=needle):
            loader.load_session(path)
        assert saver.load_session(path).token_ids == s.token_ids


def test_a_saved_context_loads_back_and_continues_like_the_live_session(
    test_model_dir: Path, tmp_path: Path
) -> None:
    m = colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path / "cache")
    kw: dict[str, Any] = {"max_new_tokens": 8, "temperature": 0, "stop_token_ids": []}
    doc = list(range(20, 60))
    s = m.session()
    s.prefill(doc)
    assert s.kv_tokens == len(doc) and s.token_ids == doc
    path = tmp_path / "doc.ctx"
    written = s.save(path)
    assert written == path.stat().st_size > 0
    # Another Model (another engine, as another process would be) of the same files.
    other = colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path / "cache")
    loaded = other.load_session(path)
    assert loaded.kv_tokens == len(doc) and loaded.token_ids == doc
    question = [*doc, 7, 8, 9]
    a, b = s.generate(question, **kw), loaded.generate(question, **kw)
    assert a.token_ids == b.token_ids == other.generate(question, **kw).token_ids
    assert b.stats.prompt_cached_tokens == len(doc)
    # Seeded sampling continues the same way too.
    sampled = {**kw, "temperature": 0.8, "seed": 3}
    s2, l2 = m.load_session(path), other.load_session(path)
    assert s2.generate(question, **sampled).token_ids == l2.generate(question, **sampled).token_ids


def test_damaged_foreign_or_missing_contexts_raise_typed_errors(
    test_model_dir: Path, tmp_path: Path
) -> None:
    m = colibri.Model(test_model_dir, threads=1, cache_dir=tmp_path / "cache")
    s = m.session()
    s.prefill([5, 6, 7, 8])
    path = tmp_path / "c.ctx"
    s.save(path)
    good = path.read_bytes()
    for what, data, needle in [
        ("truncated", good[:-3], "truncated"),
        ("not a context", b"{}" * 40, "magic"),
        ("flipped", good[:-8] + bytes([good[-8] ^ 1]) + good[-7:], "checksum"),
    ]:
        path.write_bytes(data)
        with pytest.raises(colibri.SavedContextError, match=needle):
            m.load_session(path)
        assert isinstance(colibri.SavedContextError("x"), ValueError), what
    path.write_bytes(good)
    tiny = colibri.Model(threads=1, cache_dir=tmp_path / "cache")
    with pytest.raises(colibri.SavedContextError, match="another model"):
        tiny.load_session(path)
    with pytest.raises(colibri.ColibriFileNotFoundError):
        m.load_session(tmp_path / "absent.ctx")
    # The model is unharmed and the good file still loads.
    assert m.load_session(path).kv_tokens == 4


def test_idle_sessions_over_the_budget_go_to_disk_and_come_back(
    test_model_dir: Path, tmp_path: Path
) -> None:
    cache = tmp_path / "cache"
    m = colibri.Model(test_model_dir, threads=1, cache_dir=cache, idle_session_budget=0)
    ref = colibri.Model(test_model_dir, threads=1, cache_dir=cache)
    kw: dict[str, Any] = {"max_new_tokens": 6, "temperature": 0, "stop_token_ids": []}
    a, b = m.session(), m.session()
    first = a.generate([5, 6, 7, 8, 9], **kw)
    assert not a.evicted and a.kv_bytes > 0
    b.generate([30, 31, 32], **kw)
    assert a.evicted and a.kv_bytes == 0
    spilled = list((cache / "sessions").glob("*.ctx"))
    assert len(spilled) == 1
    nxt = [5, 6, 7, 8, 9, *first.token_ids, 10]
    out = a.generate(nxt, **kw)
    assert not a.evicted and b.evicted
    assert out.stats.prompt_cached_tokens == 5 + len(first.token_ids) - 1
    assert out.token_ids == ref.generate(nxt, **kw).token_ids
    del a, b
    gc.collect()
    assert list((cache / "sessions").glob("*.ctx")) == []


def test_option_vocabulary_and_stats_names_come_from_the_engine() -> None:
    from colibri import validation

    choices = _core.choices()
    for name, alias in [
        ("io", validation.IoMode),
        ("prefetch", validation.PrefetchMode),
        ("draft", validation.DraftMode),
        ("prefill", validation.PrefillMode),
    ]:
        assert list(typing.get_args(alias)) == choices[name], name
    py_fields = set(colibri.GenerationStats.__dataclass_fields__) - {"extra"}
    assert py_fields == set(_core.generation_stats_fields())


def test_penalties_bias_and_min_tokens_keep_speculation_lossless_on_the_trained_model() -> None:
    m = colibri.Model(threads=1)
    prompt = "def fibonacci(n):\n    "
    kw: dict[str, Any] = {
        "max_tokens": 40,
        "temperature": 0,
        "repetition_penalty": 1.3,
        "presence_penalty": 0.4,
        "frequency_penalty": 0.3,
        "logit_bias": {m.encode("\n", add_special_tokens=False)[0]: -2.0},
    }
    plain = m.generate(prompt, draft="off", **kw)
    raw = m.generate(prompt, draft="off", max_tokens=40, temperature=0)
    assert plain.token_ids != raw.token_ids, "the processing changed nothing"
    for depth in (1, 3, "auto"):
        spec = m.generate(prompt, draft="mtp", draft_depth=depth, **kw)
        assert spec.token_ids == plain.token_ids, depth
    assert any(spec.stats.drafts_accepted), "no draft was accepted: the test shows nothing"
    sampled = {**kw, "temperature": 0.8, "top_p": 0.95, "min_p": 0.05, "seed": 9}
    assert (
        m.generate(prompt, draft="mtp", draft_depth=2, **sampled).token_ids
        == m.generate(prompt, draft="off", **sampled).token_ids
    )
    # min_tokens: the stop token greedy picks first cannot end the generation early.
    first = raw.token_ids[0]
    held = m.generate(prompt, max_tokens=6, temperature=0, stop_token_ids=[first], min_tokens=3)
    assert first not in held.token_ids[:3] and len(held.token_ids) >= 3
    # ignore_eos removes only the EOS ids from the stop set.
    out = m.generate(prompt, max_tokens=4, temperature=0, ignore_eos=True)
    assert len(out.token_ids) == 4


def test_logprobs_match_the_logits_of_an_independent_forward() -> None:
    m = colibri.Model(threads=1)
    prompt = m.encode("import os\nimport ")
    out = m.generate(prompt, max_tokens=6, temperature=0, logprobs=4, stop_token_ids=[])
    assert out.logprobs is not None and out.top_logprobs is not None
    assert len(out.logprobs) == len(out.top_logprobs) == len(out.token_ids)
    ctx = list(prompt)
    for tok, lp, top in zip(out.token_ids, out.logprobs, out.top_logprobs, strict=True):
        row = m.logits(ctx)[-1].astype(np.float64)
        log_softmax = row - row.max() - np.log(np.exp(row - row.max()).sum())
        assert abs(lp - log_softmax[tok]) < 1e-4
        assert len(top) == 4 and top[0][0] == tok
        assert [t for t, _ in top] == list(np.argsort(-row, kind="stable")[:4])
        ctx.append(tok)
    # Sampling reports the law it drew from: a top-k cut token has -inf.
    s = m.generate(prompt, max_tokens=3, temperature=1.0, top_k=2, seed=1, logprobs=3)
    assert s.top_logprobs is not None
    assert all(top[2][1] == float("-inf") for top in s.top_logprobs)
    assert all(lp > float("-inf") for lp in s.logprobs or [])
    assert m.generate(prompt, max_tokens=2).logprobs is None


def test_prompt_logprobs_match_log_softmax_of_an_independent_forward() -> None:
    m = colibri.Model(threads=1)
    prompt = m.encode("def add(a, b):\n    return a")
    m.generate(prompt, max_tokens=2)  # the prompt is now cached: scoring must not reuse it
    out = m.generate(prompt, max_tokens=2, temperature=0, prompt_logprobs=3)
    assert out.stats.prompt_cached_tokens == 0
    assert out.prompt_logprobs is not None and out.prompt_top_logprobs is not None
    assert len(out.prompt_logprobs) == len(out.prompt_top_logprobs) == len(prompt)
    assert out.prompt_logprobs[0] is None and out.prompt_top_logprobs[0] == []
    rows = m.logits(prompt).astype(np.float64)
    log_softmax = rows - rows.max(-1, keepdims=True)
    log_softmax -= np.log(np.exp(log_softmax).sum(-1, keepdims=True))
    for i in range(1, len(prompt)):
        got = out.prompt_logprobs[i]
        assert got is not None and abs(got - log_softmax[i - 1, prompt[i]]) < 1e-4
        top = out.prompt_top_logprobs[i]
        assert [t for t, _ in top] == list(np.argsort(-rows[i - 1], kind="stable")[:3])
    # Scoring the prompt changes nothing generated, with drafting too.
    plain = m.generate(prompt, max_tokens=12, temperature=0, draft="off")
    scored = m.generate(prompt, max_tokens=12, temperature=0, draft="mtp", prompt_logprobs=0)
    assert scored.token_ids == plain.token_ids
    assert m.generate(prompt, max_tokens=2).prompt_logprobs is None
    # A list of prompts scores each one.
    batch = m.generate([prompt, prompt[:5]], max_tokens=2, prompt_logprobs=1)
    for result, n in zip(batch, (len(prompt), 5), strict=True):
        assert result.prompt_logprobs is not None and len(result.prompt_logprobs) == n
        assert result.prompt_logprobs[0] is None
        assert np.allclose(result.prompt_logprobs[1:], out.prompt_logprobs[1:n], atol=1e-5)
    with pytest.raises(colibri.InvalidArgumentError, match="prompt_logprobs"):
        m.generate(prompt, max_tokens=2, prompt_logprobs=21)


def test_sampling_params_object_equals_keywords_and_conflicts_are_errors() -> None:
    m = colibri.Model(threads=1)
    sp = colibri.SamplingParams(max_tokens=8, temperature=0.7, top_k=20, seed=5, min_p=0.02)
    by_object = m.generate("x = ", sp)
    by_keywords = m.generate(
        "x = ", max_new_tokens=8, temperature=0.7, top_k=20, seed=5, min_p=0.02
    )
    assert by_object.token_ids == by_keywords.token_ids
    assert len(m.chat([{"role": "user", "content": "hi"}], sp).token_ids) <= 8
    with pytest.raises(colibri.InvalidArgumentError, match="both"):
        m.generate("x", sp, temperature=0.1)
    with pytest.raises(colibri.InvalidArgumentError, match="not both"):
        m.generate("x", max_tokens=2, max_new_tokens=2)
    with pytest.raises(colibri.InvalidArgumentError, match="sampling_params"):
        m.generate("x", {"temperature": 0})  # type: ignore[call-overload]
    s = m.session()
    assert len(s.generate("x = ", sampling_params=sp).token_ids) <= 8
    for bad, needle in [
        ({"min_p": 2.0}, "min_p"),
        ({"repetition_penalty": 0.0}, "repetition_penalty"),
        ({"presence_penalty": float("nan")}, "presence_penalty"),
        ({"logit_bias": {10**9: 1.0}}, "logit_bias"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logit_bias": [1, 2]}, "logit_bias"),
        ({"logprobs": _core.limits()["max_top_logprobs"] + 1}, "logprobs"),
        ({"min_tokens": -1}, "min_tokens"),
        ({"ignore_eos": "yes"}, "ignore_eos"),
    ]:
        with pytest.raises(colibri.InvalidArgumentError, match=needle):
            m.generate("x", max_tokens=2, **bad)
    # Banning a token with -inf bias keeps it out of a greedy generation.
    greedy = m.generate("x = ", max_tokens=5, temperature=0)
    banned = greedy.token_ids[0]
    out = m.generate("x = ", max_tokens=5, temperature=0, logit_bias={banned: float("-inf")})
    assert banned not in out.token_ids


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"temperature": -1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"stop": 3}, "stop"),
        ({"stop_token_ids": "1"}, "stop_token_ids"),
        ({"ignore_eos": 1}, "ignore_eos"),
        ({"n": 0}, "n"),
        ({"min_p": 1.5}, "min_p"),
        ({"repetition_penalty": -1.0}, "repetition_penalty"),
        ({"logit_bias": {3: float("nan")}}, "logit_bias"),
        ({"logprobs": -1}, "logprobs"),
        ({"guided_regex": ""}, "guided_regex"),
        ({"guided_regex": "a", "guided_json": {"type": "object"}}, "one of"),
    ],
)
def test_sampling_params_are_checked_when_made(fields: dict[str, Any], needle: str) -> None:
    """A bad field is an error where the object is made, not at the first generate."""
    with pytest.raises(colibri.InvalidArgumentError, match=needle):
        colibri.SamplingParams(**fields)


def test_sampling_params_checks_what_needs_the_model_at_generate(model: colibri.Model) -> None:
    sp = colibri.SamplingParams(stop_token_ids=[10**9], max_tokens=2)  # no vocabulary yet
    with pytest.raises(colibri.InvalidArgumentError, match="outside the vocabulary"):
        model.generate("x", sp)


def test_chat_takes_openai_style_content_parts(model: colibri.Model) -> None:
    """A list content of text parts (what OpenAI clients send, and the server accepts) is
    the same conversation as its joined text; other parts are a clear error."""
    kw: dict[str, Any] = {"max_tokens": 6, "temperature": 0}
    plain = model.chat([{"role": "user", "content": "hello there"}], **kw)
    parts = [{"type": "text", "text": "hello "}, {"type": "text", "text": "there"}]
    assert model.chat([{"role": "user", "content": parts}], **kw).token_ids == plain.token_ids
    image = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]
    with pytest.raises(colibri.InvalidArgumentError, match="text only"):
        model.chat([{"role": "user", "content": image}], **kw)
    with pytest.raises(colibri.InvalidArgumentError, match="content part"):
        model.chat([{"role": "user", "content": ["hi"]}], **kw)


def test_close_and_context_manager_release_the_model(test_model_dir: Path) -> None:
    with colibri.Model(test_model_dir, threads=1) as m:
        s = m.session()
        out = m.generate([5, 6, 7], max_new_tokens=3, temperature=0)
        assert len(out.token_ids) == 3 and not m.closed
    assert m.closed and "closed" in repr(m)
    for call in (
        lambda: m.generate([5, 6], max_new_tokens=2),
        lambda: m.logits([5]),
        lambda: s.generate([5, 6], max_new_tokens=2),
        lambda: m.session(),
    ):
        with pytest.raises(colibri.ColibriError, match="closed"):
            call()
    m.close()  # twice is harmless


def test_prefill_progress_reports_each_chunk_and_changes_nothing() -> None:
    m = colibri.Model(threads=1)  # the embedded model: a context of 1,100 tokens fits
    prompt = [(7 * i) % 4000 + 3 for i in range(1100)]
    seen: list[tuple[int, int]] = []
    kw: dict[str, Any] = {"max_new_tokens": 4, "temperature": 0, "stop_token_ids": []}
    with_bar = m.session().generate(prompt, prefill_progress=lambda d, t: seen.append((d, t)), **kw)
    assert seen == [(512, 1100), (1024, 1100), (1100, 1100)]
    alone = colibri.Model(threads=1).session().generate(prompt, **kw)
    assert with_bar.token_ids == alone.token_ids

    # A callback that raises stops the prefill with its exception, the model still usable.
    def boom(done: int, total: int) -> None:
        raise RuntimeError("stop here")

    s = m.session()
    with pytest.raises(RuntimeError, match="stop here"):
        s.generate(prompt, prefill_progress=boom, **kw)
    assert s.kv_tokens == 0
    assert m.generate([5, 6], **kw).token_ids
    with pytest.raises(colibri.InvalidArgumentError, match="prefill_progress"):
        m.generate([5, 6], prefill_progress=3, **kw)  # type: ignore[call-overload]


def test_a_list_of_prompts_is_decoded_together_with_each_result_as_alone() -> None:
    m = colibri.Model(threads=1)
    prompts = ["def add(a, b):", "import os\n", "class Stack:\n    def push(self, x):"]
    kw: dict[str, Any] = {"max_tokens": 10, "stop_token_ids": [], "logprobs": 2}
    for extra in ({"temperature": 0}, {"temperature": 0.9, "seed": 4, "presence_penalty": 0.5}):
        batch = m.generate(prompts, **kw, **extra)
        assert isinstance(batch, list) and len(batch) == 3
        for p, r in zip(prompts, batch, strict=True):
            alone = m.session().generate(p, draft="off", **kw, **extra)
            assert r.token_ids == alone.token_ids and r.text == alone.text
            assert r.logprobs == alone.logprobs
    # Token-id prompts, stop strings per prompt, and the errors.
    ids = [m.encode("x = 1\n"), m.encode("y = ")]
    out = m.generate(ids, max_tokens=6, temperature=0, stop=["\n"])
    assert all("\n" not in r.text for r in out)
    with pytest.raises(colibri.InvalidArgumentError, match="stream"):
        m.generate(prompts, max_tokens=2, stream=True)  # type: ignore[call-overload]
    with pytest.raises(colibri.InvalidArgumentError):
        m.generate(["ok", [10**9]], max_tokens=2)


def test_apply_chat_template_has_transformers_defaults_and_templates_can_be_replaced(
    test_model_dir: Path, tmp_path: Path
) -> None:
    m = colibri.Model(test_model_dir, threads=1)
    msgs = [{"role": "user", "content": "hi"}]
    ids = m.apply_chat_template(msgs)
    text = m.apply_chat_template(msgs, tokenize=False)
    assert isinstance(ids, list) and ids == m.encode(text, add_special_tokens=False)
    assert not text.endswith("<|assistant|>")
    assert m.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True).endswith(
        "<|assistant|>"
    )
    plain = "{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}\n{% endfor %}"
    assert m.apply_chat_template(msgs, tokenize=False, chat_template=plain) == "[user] hi\n"
    f = tmp_path / "t.jinja"
    f.write_text(plain)
    for given in (plain, str(f), f):
        other = colibri.Model(test_model_dir, threads=1, chat_template=given)
        assert other.apply_chat_template(msgs, tokenize=False) == "[user] hi\n"
        kw: dict[str, Any] = {"max_new_tokens": 4, "temperature": 0}
        assert other.chat(msgs, **kw).token_ids == other.generate("[user] hi\n", **kw).token_ids
    with pytest.raises(colibri.InvalidArgumentError, match="chat_template"):
        colibri.Model(test_model_dir, threads=1, chat_template="")


def test_create_completion_and_chat_completion_return_openai_bodies() -> None:
    m = colibri.Model(threads=1)
    body = m.create_completion("def add(a, b):", max_tokens=8, temperature=0, logprobs=1)
    assert isinstance(body, dict) and body["object"] == "text_completion"
    ref = m.generate("def add(a, b):", max_tokens=8, temperature=0)
    choice = body["choices"][0]
    assert choice["text"] == ref.text and choice["finish_reason"] in ("length", "stop")
    assert len(choice["logprobs"]["token_logprobs"]) == len(ref.token_ids)
    assert body["usage"]["completion_tokens"] == len(ref.token_ids)
    chunks = list(m.create_completion("def add(a, b):", max_tokens=8, temperature=0, stream=True))
    assert "".join(c["choices"][0]["text"] for c in chunks) == ref.text
    assert chunks[-1]["choices"][0]["finish_reason"] == choice["finish_reason"]
    msgs = [{"role": "user", "content": "hi"}]
    chat = m.create_chat_completion(msgs, max_tokens=6, temperature=0)
    assert isinstance(chat, dict) and chat["object"] == "chat.completion"
    said = m.chat(msgs, max_tokens=6, temperature=0).text
    assert chat["choices"][0]["message"]["content"] == said
    parts = list(m.create_chat_completion(msgs, max_tokens=6, temperature=0, stream=True))
    assert parts[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
        m.create_completion("x", n=0)
    two = m.create_completion("x", n=2, max_tokens=4, temperature=0.8, seed=4)
    assert isinstance(two, dict) and [c["index"] for c in two["choices"]] == [0, 1]
    assert two["choices"][1]["text"] == m.generate("x", max_tokens=4, temperature=0.8, seed=5).text
    streamed = list(
        m.create_completion("x", n=2, max_tokens=4, temperature=0.8, seed=4, stream=True)
    )
    by_index = {0: "", 1: ""}
    for c in streamed:
        for ch in c["choices"]:
            by_index[ch["index"]] += ch["text"]
    assert [by_index[0], by_index[1]] == [c["text"] for c in two["choices"]]
    with pytest.raises(colibri.InvalidArgumentError, match="'tools'"):
        m.create_chat_completion(msgs, tools=[{"type": "function", "function": {"name": "f"}}])


def test_n_completions_are_the_seeds_alone_and_decode_together() -> None:
    """``n`` returns n results: completion i is the prompt with seed + i alone (so n=1 is
    completion 0); through ``SamplingParams`` too; bad values are typed errors."""
    m = colibri.Model(threads=2)
    outs = m.generate("def add(a, b):", n=3, max_tokens=8, temperature=0.8, seed=7)
    assert isinstance(outs, list) and len(outs) == 3
    for i, out in enumerate(outs):
        alone = m.generate("def add(a, b):", max_tokens=8, temperature=0.8, seed=7 + i)
        assert out.token_ids == alone.token_ids
    sp = colibri.SamplingParams(n=2, max_tokens=8, temperature=0.8, seed=7)
    assert [o.token_ids for o in m.generate("def add(a, b):", sp)] == [
        o.token_ids for o in outs[:2]
    ]
    for bad in (0, -1, "2", 65):
        with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
            m.generate("x", n=bad)
    with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
        m.generate("x", n=2, stream=True)
    with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
        m.generate(["x", "y"], n=2)
    with pytest.raises(colibri.InvalidArgumentError, match="'n'"):
        m.generate("x", colibri.SamplingParams(n=2), n=2)


def test_load_progress_reports_the_resident_bytes_and_its_errors_stop_the_load() -> None:
    """``Model(load_progress=...)``: called per resident tensor with growing byte counts,
    ending with ``done == total`` equal to what the container holds outside the routed
    experts; an exception raised by the callback stops the load and reaches the caller."""
    calls: list[tuple[int, int]] = []
    m = colibri.Model(threads=2, load_progress=lambda d, t: calls.append((d, t)))
    assert len(calls) > 10
    assert all(a[0] <= b[0] for a, b in itertools.pairwise(calls))
    assert all(d <= t for d, t in calls)
    done, total = calls[-1]
    assert done == total > 0
    info = model_info(m.path)
    streamed = ("routed_experts", "mtp_routed_experts")
    resident = sum(sum(fm.values()) for role, fm in info["tensors"].items() if role not in streamed)
    # Not the MTP layer's copies of the embedding and LM head (the head uses the main
    # model's): at most the resident bytes (src/engine/tests.rs checks the exact sum).
    assert 0.5 * resident < total <= resident
    m.close()

    class Stop(Exception):
        pass

    def stop(done: int, total: int) -> None:
        if done > total // 2:
            raise Stop

    with pytest.raises(Stop):
        colibri.Model(threads=2, load_progress=stop)
    with pytest.raises(colibri.InvalidArgumentError, match="'load_progress'"):
        colibri.Model(load_progress=3)  # type: ignore[arg-type]


def test_prefill_arithmetic_option_is_chosen_reported_and_keeps_drafting_lossless() -> None:
    """``prefill="int8"`` changes the prompt's forward only: the first token's logprob moves a
    little against the exact prefill, drafting after it still equals plain decoding after
    the same prefill, and ``info()`` reports what "auto" chose."""
    prompt = (
        "def merge_sorted(a, b):\n    out = []\n    i = j = 0\n"
        "    while i < len(a) and j < len(b):\n"
    )
    exact = colibri.Model(threads=1, prefill="exact")
    int8 = colibri.Model(threads=1, prefill="int8")
    auto = colibri.Model(threads=1)
    assert exact.info()["prefill"] == "exact"
    assert int8.info()["prefill"] == "int8"
    # "auto" is int8 wherever a SIMD int8 kernel runs: AVX-512 VNNI or AVX2 (+ FMA).
    features = set(_core.cpu_features())
    vnni = {"avx512f", "avx512bw", "avx512vl", "avx512vnni"} <= features
    avx2 = {"avx2", "fma"} <= features
    assert auto.info()["prefill"] == ("int8" if vnni or avx2 else "exact")
    assert len(exact.encode(prompt)) >= 16
    kw: dict[str, Any] = {"max_new_tokens": 24, "temperature": 0, "logprobs": 0}
    a = exact.generate(prompt, draft="off", **kw)
    b = int8.generate(prompt, draft="off", **kw)
    assert a.logprobs is not None and b.logprobs is not None
    # The first token comes from the prefill's last row: int8 moves its logprob a little.
    assert a.logprobs[0] != b.logprobs[0]
    assert abs(a.logprobs[0] - b.logprobs[0]) < 0.1
    for draft, depth in [("mtp", 2), ("mtp", "auto"), ("ngram", 3)]:
        out = int8.generate(prompt, draft=draft, draft_depth=depth, **kw)
        assert out.token_ids == b.token_ids, (draft, depth)
    with pytest.raises(colibri.InvalidArgumentError, match="prefill"):
        colibri.Model(prefill="fast")  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [5, None, 1.5, ""])
def test_context_paths_of_the_wrong_type_are_typed_errors(bad: Any, tmp_path: Path) -> None:
    m = colibri.Model(threads=1)
    s = m.session()
    s.prefill("def add(a, b):")
    with pytest.raises(colibri.InvalidArgumentError, match="'path'"):
        s.save(bad)
    with pytest.raises(colibri.InvalidArgumentError, match="'path'"):
        m.load_session(bad)
    as_bytes = os.fsencode(tmp_path / "ctx.colibri")  # bytes paths work, as in os
    s.save(as_bytes)
    assert m.load_session(as_bytes).token_ids == s.token_ids
    with pytest.raises(colibri.InvalidArgumentError, match="not a regular file"):
        s.save("/dev/null")


def test_a_model_with_no_options_opens_the_engine_with_its_defaults() -> None:
    """``colibri.Model()``'s defaults are ``_core.Engine``'s, and those are the arguments the
    Rust test ``an_engine_opened_with_no_options_gets_the_default_options`` holds equal to
    ``EngineOptions::default()``: a user who sets nothing gets the engine's defaults."""
    engine = {
        n: p.default
        for n, p in inspect.signature(_core.Engine).parameters.items()
        if p.default is not inspect.Parameter.empty
    }
    assert engine == {
        "threads": 0,
        "io": "auto",
        "ram_budget": None,
        "prefetch": "auto",
        "prefetch_top_k": 0,
        "mtp": True,
        "usage_file": True,
        "cache_dir": None,
        "pin": "auto",
        "resident_layers": None,
        "max_context": None,
        "idle_session_bytes": None,
        "spill_dir": None,
        "prefill": "auto",
        "load_progress": None,
    }
    model = inspect.signature(colibri.Model).parameters
    shared = set(model) & set(engine)
    assert {"threads", "io", "prefetch", "mtp", "max_context", "prefill"} <= shared
    for name in shared:
        assert model[name].default == engine[name], name
