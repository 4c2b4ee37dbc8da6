"""Opening a ``colibri.Model``: paths and bad checkpoints, the hub resolver (offline, no
network), the embedded model, the model options and ``info()``, the load progress callback,
closing, and where the routing history is written."""

from __future__ import annotations

import itertools
import json
import shutil
import socket
from pathlib import Path
from typing import Any

import colibri
import numpy as np
import pytest
from colibri.model import model_info
from conftest import EMBEDDED_TINY, ROOT, make_test_model
from tokenizers import Tokenizer

# Python's own Ctrl-C handler around every test, as in a terminal (see conftest.py).
pytestmark = pytest.mark.usefixtures("_python_sigint_handler")


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


def test_a_fifo_named_like_a_shard_is_a_container_error_not_a_wait(tmp_path: Path) -> None:
    """``open()`` of a FIFO waits for a writer: the model's open must fail at once instead.
    Run in a child process, so that a regression fails on the timeout instead of hanging
    the suite (shards are also opened non-blocking: ``container::regular_file``)."""
    import os
    import subprocess
    import sys

    d = make_test_model(tmp_path / "m")
    (shard,) = d.glob("*.safetensors")
    shard.unlink()
    os.mkfifo(shard)
    code = (
        "import colibri, sys\n"
        "try:\n"
        "    colibri.Model(sys.argv[1], threads=1)\n"
        "except colibri.ContainerError as e:\n"
        "    print(type(e).__name__, e)\n"
    )
    run = subprocess.run(
        [sys.executable, "-c", code, str(d)], capture_output=True, text=True, timeout=60
    )
    assert run.returncode == 0, run.stderr
    # The directory's listing skips what is not a regular file, so the model has no shard.
    assert run.stdout.startswith("ContainerError"), run.stdout
    assert "no *.safetensors shards" in run.stdout, run.stdout


def test_trace_routing_writes_a_trace_of_every_forward(tmp_path: Path) -> None:
    """``Model(trace_routing=FILE)``: a routing trace in the replay's format, one row per
    prompt token, one decode row per decode forward; the text is the untraced one."""
    path = tmp_path / "trace.jsonl"
    kwargs: dict[str, Any] = {"max_new_tokens": 6, "temperature": 0, "draft": "off"}
    plain = colibri.Model(threads=1).generate([5, 6, 7, 8], **kwargs)
    m = colibri.Model(threads=1, trace_routing=path)
    traced = m.generate([5, 6, 7, 8], **kwargs)
    m.close()
    assert traced.token_ids == plain.token_ids
    header, *rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert header["format"] == "colibri-routing-trace" and header["version"] == 1
    assert header["experts"] == m.config["n_routed_experts"]
    kinds = [r["kind"] for r in rows]
    assert kinds == ["prompt"] * 4 + ["decode"] * traced.stats.decode_forwards, kinds
    assert all(len(r["experts"]) == len(header["layers"]) for r in rows)
    assert all(len(ids) == header["top_k"] for r in rows for ids in r["experts"])


def test_tokenizer_property(model: colibri.Model) -> None:
    assert isinstance(model.tokenizer, Tokenizer)
    ids = model.encode("héllo")
    assert ids == list("héllo".encode())
    assert model.decode(ids) == "héllo"


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


# ----------------------------------------------------------------------------- the hub


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


# ----------------------------------------------------------------------------- model options


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


# ----------------------------------------------------------------------------- the routing history


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


def test_pin_mtp_goes_beyond_the_budget_while_the_history_pins_the_rest(
    tmp_path: Path,
) -> None:
    """``pin_mtp`` keeps the MTP layer's experts in RAM on top of ``ram_budget``, while the
    routing history (the shipped one routes the MTP layer too) pins hot experts of the other
    layers within the budget. A budget that holds some of those pins once made the store
    refuse to open ("the pinned experts take ... bytes, over the ...-byte budget")."""
    model_dir = tmp_path / "tiny"
    shutil.copytree(EMBEDDED_TINY, model_dir)
    budget = 1_000_000
    m = colibri.Model(
        model_dir, cache_dir=tmp_path / "cache", ram_budget=budget, pin_mtp=True, prefetch="off"
    )
    mem, st = m.info()["memory"], m._engine.expert_stats()
    mtp_data = sum(m.info()["tensors"]["mtp_routed_experts"].values())
    assert mem["mtp_resident_bytes"] >= mtp_data > 0
    assert mem["ram_budget_bytes"] == budget + mem["mtp_resident_bytes"]
    # Pinned: the MTP layer's experts (loaded at open) and some history pins (loaded on use).
    assert st["pinned_bytes"] == mem["mtp_resident_bytes"]
    assert st["pin_set_len"] > m.info()["config"]["n_routed_experts"], "no history pins"
    plain = colibri.Model(model_dir, cache_dir=tmp_path / "cache", ram_budget=budget, pin_mtp=False)
    assert plain.info()["memory"]["mtp_resident_bytes"] == 0
    assert plain.info()["memory"]["ram_budget_bytes"] == budget
    a = m.generate("def f(x):", max_new_tokens=12, temperature=0, draft="mtp", draft_depth=2)
    b = plain.generate("def f(x):", max_new_tokens=12, temperature=0, draft="off")
    assert a.token_ids == b.token_ids
