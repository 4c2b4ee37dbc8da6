"""Hostile files and faults (docs/reliability.md): shards that change under a
running model, stored non-finite values, and what the process does about them. Anything that
could kill the process before its fix runs in a subprocess, so a regression is a failed test
(with the signal named), not a dead test run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import colibri
import numpy as np
import pytest
from conftest import make_test_model
from safetensors.numpy import load_file, save_file


def run_python(code: str, *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    """Run ``code`` in a fresh interpreter; the result says how it ended."""
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONFAULTHANDLER": "1"},
    )


def describe(proc: subprocess.CompletedProcess[str]) -> str:
    how = f"signal {-proc.returncode}" if proc.returncode < 0 else f"exit {proc.returncode}"
    return f"{how}\nstdout:\n{proc.stdout}\nstderr:\n{proc.stderr[-3000:]}"


def header_end(shard: Path) -> int:
    with shard.open("rb") as f:
        return 8 + int.from_bytes(f.read(8), "little")


# ------------------------------------------------------------------ files changing under us


@pytest.mark.parametrize("io", ["pread", "direct"])
def test_truncating_the_dense_shard_of_a_running_model_is_an_error_not_a_signal(
    tmp_path: Path, io: str
) -> None:
    """The fixture is one shard holding dense weights and experts. Cutting it back to its
    header while the model is loaded must not kill the process (dense weights live in owned
    memory): the dense part keeps working, an expert read is a ContainerError
    naming the shard, and once the file is back the model generates what it did before."""
    d = make_test_model(tmp_path / "m")
    shard = d / "model.safetensors"
    proc = run_python(
        f"""
        import os, colibri
        shard = {str(shard)!r}
        m = colibri.Model({str(d)!r}, io={io!r}, threads=1, ram_budget=0, mtp=False)
        kw = dict(max_new_tokens=4, temperature=0, stop_token_ids=[], draft="off")
        before = m.generate([5, 6, 7], **kw).token_ids
        original = open(shard, "rb").read()
        with open(shard, "r+b") as f:
            f.truncate({header_end(shard)})
        try:
            m.generate([5, 6, 7], **kw)
            print("OUTCOME ok")
        except colibri.ColibriError as e:
            print("OUTCOME", type(e).__name__, e)
        with open(shard, "wb") as f:
            f.write(original)
        after = m.generate([5, 6, 7], **kw).token_ids
        print("SAME", before == after)
        """
    )
    assert proc.returncode == 0, describe(proc)
    outcome = next(line for line in proc.stdout.splitlines() if line.startswith("OUTCOME"))
    assert outcome.startswith("OUTCOME ContainerError"), outcome
    assert "model.safetensors" in outcome and "experts" in outcome, outcome
    assert "SAME True" in proc.stdout, describe(proc)


def test_a_weight_read_from_a_shard_that_shrank_is_a_container_error(tmp_path: Path) -> None:
    """The container reads a tensor when asked: after a truncation that is a typed error
    naming the file and tensor (it was a SIGBUS through the old mapping)."""
    d = make_test_model(tmp_path / "m")
    shard = d / "model.safetensors"
    name = "model.layers.0.self_attn.q_a_proj.weight"
    proc = run_python(
        f"""
        from colibri import _core, errors
        c = _core.Container({str(d)!r})
        with open({str(shard)!r}, "r+b") as f:
            f.truncate({header_end(shard)})
        for read in (c.dequantize, c.raw):
            try:
                read({name!r})
                print("OUTCOME ok")
            except errors.ColibriError as e:
                print("OUTCOME", type(e).__name__, e)
        """
    )
    assert proc.returncode == 0, describe(proc)
    outcomes = [line for line in proc.stdout.splitlines() if line.startswith("OUTCOME")]
    assert len(outcomes) == 2, describe(proc)
    for line in outcomes:
        assert line.startswith("OUTCOME ContainerError"), line
        assert name in line and "model.safetensors" in line and "truncated" in line, line


# ------------------------------------------------------------------ non-finite stored values


def _poke(d: Path, name: str, value: float, index: int = 3) -> int:
    """Set flat element ``index`` of tensor ``name`` to ``value``; returns the index."""
    shard = next(p for p in sorted(d.glob("*.safetensors")) if name in load_file(str(p)))
    weights = load_file(str(shard))
    with shard.open("rb") as f:
        meta = json.loads(f.read(int.from_bytes(f.read(8), "little"))).get("__metadata__")
    w = weights[name].copy()
    w.reshape(-1)[index] = value
    weights[name] = w
    save_file(weights, str(shard), metadata=meta)
    return index


BAD_VALUES = [np.nan, np.inf, -3e38]
DENSE = [
    "model.layers.0.input_layernorm.weight",  # norm
    "model.layers.1.mlp.gate.weight",  # router
    "model.layers.1.mlp.gate.e_score_correction_bias",  # router bias
    "model.layers.0.self_attn.q_a_proj.weight",  # dense weight
    "model.norm.weight",
]


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf", "-3e38"])
@pytest.mark.parametrize("name", DENSE)
def test_bad_stored_floats_are_refused_at_load_naming_the_tensor(
    tmp_path: Path, name: str, value: float
) -> None:
    d = make_test_model(tmp_path / "m")
    index = _poke(d, name, value)
    with pytest.raises(colibri.NonFiniteWeightError) as e:
        colibri.Model(d, threads=1)
    msg = str(e.value)
    assert name in msg and "model.safetensors" in msg and f"flat index {index}" in msg, msg
    assert "colibri bug" not in msg


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf", "-3e38"])
def test_a_bad_expert_value_is_refused_at_its_first_load(tmp_path: Path, value: float) -> None:
    """Experts are read when routed to: every expert of layer 1 holds the bad value, so the
    first generation fails naming one of them, and so does the next (no bad state kept)."""
    d = make_test_model(tmp_path / "m")
    weights = load_file(str(d / "model.safetensors"))
    for e in range(16):
        w = weights[f"model.layers.1.mlp.experts.{e}.up_proj.weight"]
        w.reshape(-1)[7] = value
    save_file(weights, str(d / "model.safetensors"))
    m = colibri.Model(d, threads=1, mtp=False)
    for _ in range(2):
        with pytest.raises(colibri.NonFiniteWeightError) as e:
            m.generate([5, 6, 7], max_new_tokens=2, temperature=0)
        msg = str(e.value)
        assert "model.layers.1.mlp.experts." in msg and ".up_proj.weight" in msg, msg
        assert "flat index 7" in msg and "colibri bug" not in msg, msg


@pytest.fixture(scope="module")
def quantised_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The fixture converted to int4 (experts and dense weights with f32 scales)."""
    from colibri.convert import convert

    root = tmp_path_factory.mktemp("q")
    src = make_test_model(root / "src")
    dst = root / "q"
    convert(src, dst, expert_bits=4, dense_bits=4, group_size=0, progress=False)
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        (dst / f).write_bytes((src / f).read_bytes())
    return dst


@pytest.mark.parametrize("value", BAD_VALUES, ids=["nan", "inf", "-3e38"])
@pytest.mark.parametrize(
    ("name", "at_load"),
    [
        ("model.layers.0.self_attn.q_b_proj.weight.qs", True),
        ("model.layers.1.mlp.shared_experts.down_proj.weight.qs", True),
        ("model.layers.1.mlp.experts.*.gate_proj.weight.qs", False),
    ],
)
def test_bad_scales_of_a_quantised_container_name_the_scales_tensor(
    tmp_path: Path, quantised_model: Path, name: str, at_load: bool, value: float
) -> None:
    d = tmp_path / "q"
    d.mkdir()
    for p in quantised_model.iterdir():
        (d / p.name).write_bytes(p.read_bytes())
    names = [name.replace("*", str(e)) for e in range(16)] if "*" in name else [name]
    for n in names:
        _poke(d, n, value, index=1)
    pattern = name.replace(".", r"\.").replace("*", r"\d+")
    if at_load:
        with pytest.raises(colibri.NonFiniteWeightError, match=pattern + r".*flat index 1"):
            colibri.Model(d, threads=1)
        return
    m = colibri.Model(d, threads=1, mtp=False)
    with pytest.raises(colibri.NonFiniteWeightError, match=pattern + r".*flat index 1"):
        m.generate([5, 6, 7], max_new_tokens=2, temperature=0)


def test_logits_that_overflow_are_an_error_not_nan(tmp_path: Path) -> None:
    """Stored values within the accepted range can still overflow float32 (1e19 norm and LM
    head weights make 1e38-sized logits): logits() raises instead of returning Inf/NaN, and
    the message names the largest stored value."""
    d = make_test_model(tmp_path / "m")
    weights = load_file(str(d / "model.safetensors"))
    weights["model.norm.weight"] = np.full_like(weights["model.norm.weight"], 1e19)
    weights["lm_head.weight"] = np.full_like(weights["lm_head.weight"], 1e19)
    save_file(weights, str(d / "model.safetensors"))
    m = colibri.Model(d, threads=1)
    with pytest.raises(colibri.NonFiniteWeightError) as e:
        m.logits([5, 6, 7])
    msg = str(e.value)
    assert "logit" in msg and "colibri bug" not in msg, msg
    assert "lm_head.weight" in msg or "model.norm.weight" in msg, msg


# ------------------------------------------------------------------ Python-side bounds


def test_a_huge_prompt_is_refused_before_it_is_tokenised(model: colibri.Model) -> None:
    """50 MB of text cannot fit in 256 tokens: refused from its length alone (tokenising it
    took minutes and gigabytes before), and the model stays usable."""
    import time

    t0 = time.monotonic()
    with pytest.raises(colibri.InvalidArgumentError, match=r"prompt.*max_context.*not tokenised"):
        model.generate("x" * 50_000_000, max_new_tokens=2)
    assert time.monotonic() - t0 < 2.0
    assert model.generate("hi", max_new_tokens=2, temperature=0).token_ids


def test_a_huge_id_list_is_refused_from_its_length(model: colibri.Model) -> None:
    import time

    ids = [5] * 20_000_000
    t0 = time.monotonic()
    for call in (lambda: model.generate(ids, max_new_tokens=2), lambda: model.logits(ids)):
        with pytest.raises(colibri.InvalidArgumentError, match="max_context"):
            call()
    assert time.monotonic() - t0 < 1.0


HOSTILE_TEMPLATES = [
    "{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}",
    "{{ 'x' * 10**10 }}",
    "{{ ['x'] * 10**10 }}",
    "{{ '%*d' % (10**9, 1) }}",
    "{{ '%999999999d' % 1 }}",
    "{{ 'x'|center(10**9) }}",
    "{{ 'x'|indent(10**9) }}",
    "{{ '%999999999d'|format(1) }}",
    "{{ 'x'.ljust(10**9) }}",
    "{{ 'x'.zfill(10**9) }}",
    "{{ '{:>999999999}'.format(1) }}",
    "{{ 10 ** (10 ** 10) }}",  # jinja's ** is left-associative
    "{% set ns = namespace(s='x') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s|replace('x', 'xx') %}{% endfor %}{{ ns.s|length }}",
    "{% set ns = namespace(s='xx') %}{% for i in range(40) %}"
    "{% set ns.s = ns.s.replace('x', 'xx') %}{% endfor %}{{ ns.s|length }}",
    "{% macro f() %}{{ f() }}{% endmacro %}{{ f() }}",
    "{% for i in range(100000) %}{{ 'y' * 1000 }}{% endfor %}",
]


@pytest.mark.parametrize("template", HOSTILE_TEMPLATES)
def test_a_hostile_chat_template_is_stopped_with_a_typed_error(
    tmp_path: Path, template: str
) -> None:
    """Loops, huge strings, widths, powers and runaway output inside the jinja sandbox end
    in bounded time and memory with a ConfigError (the template's fault) or, for output
    longer than the context, an InvalidArgumentError."""
    import resource
    import time

    d = make_test_model(tmp_path / "m")
    cfg = json.loads((d / "tokenizer_config.json").read_text())
    cfg["chat_template"] = template
    (d / "tokenizer_config.json").write_text(json.dumps(cfg))
    m = colibri.Model(d, threads=1)
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.monotonic()
    with pytest.raises((colibri.ConfigError, colibri.InvalidArgumentError)) as e:
        m.chat([{"role": "user", "content": "hi"}], max_new_tokens=2)
    elapsed = time.monotonic() - t0
    grown_mib = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    assert "chat" in str(e.value) or "messages" in str(e.value), e.value
    assert elapsed < 10, f"{elapsed:.1f} s"
    assert grown_mib < 200, f"peak RSS grew {grown_mib:.0f} MiB"
    assert m.generate("hi", max_new_tokens=2, temperature=0).token_ids


def test_ordinary_templates_still_render_under_the_limits(model: colibri.Model) -> None:
    long = "word " * 1000
    text = model.apply_chat_template(
        [{"role": "user", "content": long}] * 1, tokenize=False, add_generation_prompt=True
    )
    assert long in text


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"top_k": 2**64}, "top_k"),
        ({"max_new_tokens": 2**64}, "max_new_tokens"),
        ({"stop_token_ids": [2**64]}, "stop_token_ids"),
    ],
)
def test_huge_integers_are_typed_errors(
    model: colibri.Model, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=param):
        model.generate("hi", **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"threads": 2**64}, "threads"),
        ({"threads": 10**6}, "threads"),
        ({"ram_budget": "infGB"}, "ram_budget"),
        ({"ram_budget": "nanGB"}, "ram_budget"),
        ({"ram_budget": "1e30GB"}, "ram_budget"),
        ({"ram_budget": 2**64}, "ram_budget"),
    ],
)
def test_huge_model_options_are_typed_errors(
    test_model_dir: Path, kwargs: dict[str, object], param: str
) -> None:
    with pytest.raises(colibri.InvalidArgumentError, match=param):
        colibri.Model(test_model_dir, **kwargs)  # type: ignore[arg-type]


def test_a_missing_mtp_tensor_warns_naming_it(tmp_path: Path) -> None:
    d = make_test_model(tmp_path / "m")
    weights = load_file(str(d / "model.safetensors"))
    del weights["model.layers.3.hnorm.weight"]
    save_file(weights, str(d / "model.safetensors"))
    with pytest.warns(UserWarning, match=r"model\.layers\.3\.hnorm\.weight.*MTP head is disabled"):
        m = colibri.Model(d, threads=1)
    assert not m.has_mtp


def test_a_checkpoint_without_its_mtp_layer_loads_quietly(tmp_path: Path) -> None:
    import warnings

    d = make_test_model(tmp_path / "m")
    weights = load_file(str(d / "model.safetensors"))
    weights = {k: v for k, v in weights.items() if not k.startswith("model.layers.3.")}
    save_file(weights, str(d / "model.safetensors"))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        m = colibri.Model(d, threads=1)
    assert not m.has_mtp


# ------------------------------------------------------------------ shared routing history

USAGE_WORKER = """
import json, os, sys, time
from pathlib import Path
import colibri
model, cache, go, rounds = sys.argv[1], sys.argv[2], Path(sys.argv[3]), int(sys.argv[4])
m = colibri.Model(model, threads=1, mtp=False, cache_dir=cache)
while not go.exists():
    time.sleep(0.001)
for i in range(rounds):
    m.generate([5 + i % 7, 6, 7], max_new_tokens=3, temperature=0, stop_token_ids=[],
               draft="off")
print(m.usage_path)
"""


def _history_total(path: Path) -> int:
    layers = json.loads(path.read_text())["layers"]
    return sum(sum(c) for c in layers.values())


def test_processes_sharing_a_routing_history_lose_no_counts(tmp_path: Path) -> None:
    """Each generation saves the history (re-read, merged, renamed). Four processes saving
    30 times each at once must add up to four times what one process adds alone: the save
    runs under a lock file (it lost 1-9% of the counts before)."""
    d = make_test_model(tmp_path / "m")
    rounds = 30

    def run(n: int, cache: Path) -> Path:
        go = tmp_path / f"go-{cache.name}"
        procs = [
            subprocess.Popen(
                [sys.executable, "-c", USAGE_WORKER, str(d), str(cache), str(go), str(rounds)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for _ in range(n)
        ]
        # Let every worker load before any generates, so the saves overlap.
        import time

        time.sleep(3.0)
        go.touch()
        outs = [p.communicate(timeout=300) for p in procs]
        for p, (_out, err) in zip(procs, outs, strict=True):
            assert p.returncode == 0, err[-2000:]
        return Path(outs[0][0].strip().splitlines()[-1])

    alone = _history_total(run(1, tmp_path / "cache1"))
    assert alone > 0
    path = run(4, tmp_path / "cache4")
    assert _history_total(path) == 4 * alone
    leftovers = [p.name for p in path.parent.iterdir() if ".tmp-" in p.name]
    assert not leftovers, leftovers
