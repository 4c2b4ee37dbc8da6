"""Routed experts on Ray worker actors (colibri.distributed, docs/distributed.md).

One local Ray cluster per module, bound to 127.0.0.1 only, with two worker actors in their
own processes holding all of the shipped tiny model's routed experts between them. The head
(``Model(..., experts="ray://auto")``) must give exactly the local model's tokens: greedy and
seeded sampling, drafting on and off, in batches, in both decode arithmetics; and when a
worker is killed mid-generation, the same tokens with ExpertWorkerWarning only.

Ray is optional (``pip install ".[distributed]"``): without it the Ray tests skip, saying so,
except under ``COLIBRI_REQUIRE_RAY=1`` (CI sets it when Ray installed), where they fail.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import colibri
import pytest
from colibri.distributed import actor_name, model_experts, parse_address, placement
from colibri.errors import ExpertWorkerWarning, InvalidArgumentError

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "python" / "colibri" / "models" / "tiny"
PROMPT = "def add(a, b):"

# Without this Ray swaps 127.0.0.1 for the machine's own address (services.py,
# resolve_ip_for_localhost); with it every Ray process binds and talks on loopback only.
os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
try:
    import ray
except ImportError:  # pragma: no cover - depends on the environment
    ray = None

if ray is None and os.environ.get("COLIBRI_REQUIRE_RAY") == "1":
    raise RuntimeError("COLIBRI_REQUIRE_RAY=1 but Ray is not importable")
needs_ray = pytest.mark.skipif(
    ray is None, reason="Ray is not installed (pip install '.[distributed]')"
)


# ---------------------------------------------------------------------------- no Ray needed
def test_placement_puts_each_expert_once_and_balances_counts() -> None:
    experts = [(layer, e) for layer in (1, 2, 3) for e in range(10)]
    shards = placement(experts, 3)
    flat = [x for s in shards for x in s]
    assert sorted(flat) == experts
    for layer in (1, 2, 3):
        counts = sorted(sum(1 for x in s if x[0] == layer) for s in shards)
        assert counts == [3, 3, 4]
    # Overall counts balanced too (the 4th of each layer goes to a different worker).
    assert sorted(len(s) for s in shards) == [10, 10, 10]


def test_placement_spreads_hot_experts() -> None:
    experts = [(0, e) for e in range(8)]
    # Experts 0..3 are hot: a placement by id alone would put 0 and 2 together (round robin
    # by count), by usage each worker gets two hot ones.
    usage = {(0, 0): 100.0, (0, 1): 90.0, (0, 2): 80.0, (0, 3): 70.0}
    shards = placement(experts, 2, usage)
    loads = [sum(usage.get(x, 0.0) for x in s) for s in shards]
    assert sorted(len(s) for s in shards) == [4, 4]
    assert abs(loads[0] - loads[1]) <= 20.0
    assert {x for s in shards for x in s} == set(experts)
    assert placement(experts, 2, usage) == shards  # deterministic


def test_placement_from_the_shipped_routing_history_balances_each_layers_load() -> None:
    from colibri.distributed import read_usage

    usage = read_usage(TINY / "colibri-usage.json")
    experts = model_experts(TINY)
    shards = placement(experts, 2, usage)
    naive = [[x for x in experts if x[1] % 2 == i] for i in range(2)]
    for layer in (1, 2, 3):

        def spread(ss: list[list[tuple[int, int]]], layer: int = layer) -> float:
            loads = [sum(usage.get(x, 0.0) for x in s if x[0] == layer) for s in ss]
            return abs(loads[0] - loads[1])

        assert spread(shards) <= spread(naive)
        assert spread(shards) <= 0.1 * sum(usage.get((layer, e), 0.0) for e in range(16))
    with pytest.raises(InvalidArgumentError, match="usage"):
        read_usage(TINY / "config.json")


def test_model_experts_lists_the_containers_routed_experts() -> None:
    cfg = colibri._core.model_config(TINY)
    experts = model_experts(TINY)
    n = int(cfg["n_routed_experts"])
    layers = sorted({layer for layer, _ in experts})
    assert len(experts) == n * len(layers)
    assert all(0 <= e < n for _, e in experts)
    assert layers[-1] == int(cfg["num_hidden_layers"])  # the MTP layer's experts too


@pytest.mark.parametrize(
    "bad", ["auto", "http://x", "ray://", "ray://auto?timeout=0", "ray://auto?bogus=1"]
)
def test_a_bad_experts_address_is_refused(bad: str) -> None:
    with pytest.raises(InvalidArgumentError, match="experts"):
        parse_address(bad)
    with pytest.raises(InvalidArgumentError, match="experts"):
        colibri.Model(TINY, experts=bad)


def test_parse_address_reads_options() -> None:
    assert parse_address("ray://127.0.0.1:6379?timeout=2.5&probe=0.5") == (
        "127.0.0.1:6379",
        {"timeout": 2.5, "probe": 0.5},
    )


def test_expert_shard_runs_its_experts() -> None:
    from colibri import _core

    shard = _core.ExpertShard(str(TINY), [(1, 0), (1, 3)], threads=1)
    assert shard.experts == [(1, 0), (1, 3)]
    assert shard.nbytes > 0
    h = shard.hidden_size
    import numpy as np

    x = np.random.default_rng(0).standard_normal((3, h)).astype(np.float32)
    got = shard.run(1, "exact", x, [(0, [0, 2]), (3, [1])])
    assert [e for e, _ in got] == [0, 3]
    assert got[0][1].shape == (2 * h,) and got[1][1].shape == (h,)
    assert np.isfinite(got[0][1]).all() and np.abs(got[0][1]).sum() > 0
    # Row 2 alone gives the same values as row 2 among others (row invariance).
    alone = shard.run(1, "exact", x[2:3], [(0, [0])])
    assert np.array_equal(alone[0][1], got[0][1][h:])
    with pytest.raises(InvalidArgumentError):
        shard.run(1, "exact", x, [(5, [0])])  # not held
    with pytest.raises(InvalidArgumentError):
        shard.run(1, "exact", x, [(0, [3])])  # no such row
    with pytest.raises(InvalidArgumentError):
        shard.run(1, "fp16", x, [(0, [0])])
    with pytest.raises(InvalidArgumentError):
        _core.ExpertShard(str(TINY), [(0, 0)])  # layer 0 is dense


# ---------------------------------------------------------------------------- the cluster
@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    if ray is None:
        pytest.skip("Ray is not installed (pip install '.[distributed]')")
    ray.init(
        _node_ip_address="127.0.0.1",
        include_dashboard=False,
        num_cpus=2,
        namespace="colibri",
        log_to_driver=False,
        configure_logging=False,
    )
    try:
        nodes = ray.nodes()
        assert [n["NodeManagerAddress"] for n in nodes] == ["127.0.0.1"]
        yield ray
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def workers(cluster: Any) -> Iterator[list[Any]]:
    from colibri.distributed import start_worker

    handles = [start_worker(TINY, i, 2, threads=1) for i in (1, 2)]
    yield handles
    for h in handles:
        ray.kill(h)


@pytest.fixture(scope="module")
def local() -> colibri.Model:
    return colibri.Model(TINY, threads=1)


@pytest.fixture(scope="module")
def head(workers: list[Any]) -> colibri.Model:
    return colibri.Model(TINY, threads=1, experts="ray://auto")


@needs_ray
def test_two_workers_hold_every_routed_expert_once(workers: list[Any], head: Any) -> None:
    facts = [ray.get(w.describe.remote()) for w in workers]
    assert [f["name"] for f in facts] == [actor_name(1, 2), actor_name(2, 2)]
    assert len({f["pid"] for f in facts} | {os.getpid()}) == 3  # separate processes
    assert {f["node_ip"] for f in facts} == {"127.0.0.1"}
    held = [{tuple(x) for x in f["experts"]} for f in facts]
    assert not held[0] & held[1]
    assert held[0] | held[1] == set(model_experts(TINY))
    info = head.info()["experts_workers"]
    assert [w["name"] for w in info] == [actor_name(1, 2), actor_name(2, 2)]
    assert all(w["up"] and w["experts"] > 0 and w["bytes"] > 0 for w in info)


def _calls(m: Any) -> int:
    return sum(w["calls"] for w in m.experts_workers())


@needs_ray
@pytest.mark.parametrize("draft", ["off", "mtp"])
def test_greedy_tokens_are_the_local_models(local: Any, head: Any, draft: str) -> None:
    want = local.generate(PROMPT, max_new_tokens=24, draft=draft)
    before = _calls(head)
    got = head.generate(PROMPT, max_new_tokens=24, draft=draft)
    assert got.token_ids == want.token_ids
    assert _calls(head) > before  # the experts did run on the workers
    if draft == "mtp":  # drafts were verified (how many depends on timings: not compared)
        assert sum(got.stats.drafts_proposed) > 0


@needs_ray
@pytest.mark.parametrize("draft", ["off", "mtp"])
def test_seeded_sampled_tokens_are_the_local_models(local: Any, head: Any, draft: str) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 24, "temperature": 0.9, "seed": 11, "draft": draft}
    assert head.generate(PROMPT, **kw).token_ids == local.generate(PROMPT, **kw).token_ids


@needs_ray
def test_batched_tokens_are_the_local_models(local: Any, head: Any) -> None:
    prompts = [PROMPT, "The capital of France is", "for i in range("]
    kw: dict[str, Any] = {"max_new_tokens": 16, "temperature": 0.7, "seed": 3}
    want = [r.token_ids for r in local.generate(prompts, **kw)]
    got = [r.token_ids for r in head.generate(prompts, **kw)]
    assert got == want


@needs_ray
def test_int8_decode_tokens_are_the_local_models(workers: list[Any]) -> None:
    local8 = colibri.Model(TINY, threads=1, decode="int8")
    head8 = colibri.Model(TINY, threads=1, decode="int8", experts="ray://auto")
    for draft in ("off", "mtp"):
        kw: dict[str, Any] = {"max_new_tokens": 16, "draft": draft}
        assert head8.generate(PROMPT, **kw).token_ids == local8.generate(PROMPT, **kw).token_ids
    assert _calls(head8) > 0


@needs_ray
def test_metrics_show_the_workers(head: Any) -> None:
    from colibri.serve.metrics import ServerStats
    from prometheus_client import generate_latest

    head.generate(PROMPT, max_new_tokens=4)
    text = generate_latest(ServerStats(head).registry).decode()
    for i in (1, 2):
        assert f'colibri_expert_worker_up{{worker="{actor_name(i, 2)}"}} 1.0' in text
    assert "colibri_expert_worker_latency_ms" in text
    assert 'colibri_expert_worker_failures{worker="colibri-experts-1-of-2"} 0.0' in text


def test_experts_worker_cli_refuses_a_bad_shard(capsys: pytest.CaptureFixture[str]) -> None:
    from colibri.cli import main

    assert main(["experts-worker", str(TINY), "--address", "auto", "--shard", "3"]) == 1
    assert "--shard" in capsys.readouterr().err


@needs_ray
def test_the_experts_worker_command_serves_a_head(
    local: Any, workers: list[Any], tmp_path: Path
) -> None:
    """`colibri experts-worker` in its own process joins the cluster, holds shard 1/1 (every
    expert), serves a head, and takes its actor away when it stops."""
    import signal
    import subprocess
    import sys
    import time

    address = ray.get_runtime_context().gcs_address
    cmd = [sys.executable, "-m", "colibri.cli", "experts-worker", str(TINY)]
    cmd += ["--address", address, "--shard", "1/1", "--threads", "1", "--max-restarts", "0"]
    log = tmp_path / "worker.log"
    with (
        log.open("w") as err,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True) as proc,
    ):
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert "colibri-experts-1-of-1: holding its experts" in line, log.read_text()
            m = colibri.Model(TINY, threads=1, experts="ray://auto")
            names = [w["name"] for w in m.experts_workers()]
            assert actor_name(1, 1) in names
            kw: dict[str, Any] = {"max_new_tokens": 16, "draft": "off"}
            assert m.generate(PROMPT, **kw).token_ids == local.generate(PROMPT, **kw).token_ids
            served = next(w for w in m.experts_workers() if w["name"] == actor_name(1, 1))
            assert served["up"] and served["calls"] > 0  # it holds every expert, listed first
            m.close()
        finally:
            proc.send_signal(signal.SIGINT)
            proc.wait(timeout=60)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        alive = {a["name"] for a in ray.util.list_named_actors(all_namespaces=True)}
        if actor_name(1, 1) not in alive:
            break
        time.sleep(0.2)
    assert actor_name(1, 1) not in alive


@needs_ray
def test_a_late_worker_times_out_and_comes_back(local: Any, workers: list[Any]) -> None:
    import time

    m = colibri.Model(TINY, threads=1, experts="ray://auto?timeout=0.3&probe=0.2")
    kw: dict[str, Any] = {"max_new_tokens": 24, "temperature": 0.8, "seed": 9, "draft": "mtp"}
    want = local.generate(PROMPT, **kw).token_ids
    one = actor_name(1, 2)

    def worker() -> dict[str, Any]:
        return next(w for w in m.experts_workers() if w["name"] == one)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stall = workers[0].busy.remote(1.5)  # its requests queue behind this
        got = m.generate(PROMPT, **kw).token_ids
        assert worker()["up"] is False and "GetTimeoutError" in str(worker()["last_error"])
        ray.get(stall)
        deadline = time.monotonic() + 20
        while not worker()["up"] and time.monotonic() < deadline:
            time.sleep(0.1)
        calls = worker()["calls"]
        again = m.generate(PROMPT, **kw).token_ids
    assert got == want and again == want
    assert worker()["up"] is True and worker()["calls"] > calls
    assert worker()["failures"] == 1
    assert {w.category for w in caught} == {ExpertWorkerWarning}
    assert any("answers again" in str(w.message) for w in caught)
    m.close()


@needs_ray
def test_a_worker_killed_mid_generation_loses_nothing(local: Any, workers: list[Any]) -> None:
    """Runs last: it kills worker 2 of the module's pair, then starts it again."""
    from colibri.distributed import start_worker

    m = colibri.Model(TINY, threads=1, experts="ray://auto?timeout=5&probe=0.2")
    kw: dict[str, Any] = {"max_new_tokens": 48, "temperature": 0.8, "seed": 5, "draft": "mtp"}
    want = local.generate(PROMPT, **kw).token_ids
    two = actor_name(2, 2)

    def worker(name: str) -> dict[str, Any]:
        return next(w for w in m.experts_workers() if w["name"] == name)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        stream = m.generate(PROMPT, stream=True, **kw)
        for i, _ in enumerate(stream):
            if i == 2:
                served = worker(two)["calls"]
                ray.kill(workers[1])
        assert stream.result is not None
        got = stream.result.token_ids
        # Worker 2 served part of this generation, then failed during it.
        assert served > 0
        assert worker(two)["failures"] == 1 and worker(two)["up"] is False
        after = m.generate(PROMPT, **kw).token_ids  # worker 2 gone from the start
    assert got == want
    assert after == want
    assert caught, "the failure was not reported"
    assert {w.category for w in caught} == {ExpertWorkerWarning}, [str(w.message) for w in caught]
    assert worker(actor_name(1, 2))["up"] is True
    assert worker(actor_name(1, 2))["failures"] == 0

    # Started again (as Ray restarts an actor with max_restarts), it is probed and used.
    import time

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        again_two = start_worker(TINY, 2, 2, threads=1)  # lives while this handle does
        deadline = time.monotonic() + 20
        while not worker(two)["up"] and time.monotonic() < deadline:
            time.sleep(0.1)  # the health thread probes every 0.2 s
        calls = worker(two)["calls"]
        again = m.generate(PROMPT, **kw).token_ids
    assert again == want
    assert worker(two)["up"] is True and worker(two)["calls"] > calls, worker(two)["last_error"]
    assert [w.category for w in caught] == [ExpertWorkerWarning]
    assert "answers again" in str(caught[0].message)
    ray.kill(again_two)
