"""What ``colibri serve`` shows of itself: Prometheus metrics, ``/stats`` (live and totals),
and the dashboard in a headless Chromium (tests/helpers/serve.py starts the server).

Set ``COLIBRI_DASHBOARD_SCREENSHOT=docs/dashboard.png`` to write the dashboard screenshot of
the browser test where the docs show it."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from colibri.serve.scheduler import Job
from conftest import EMBEDDED_TINY, ROOT
from helpers.serve import (
    MODEL,
    PROMPT,
    Live,
    long_stream,
    start_server,
    stop_server,
    wait_for,
)
from prometheus_client.parser import text_string_to_metric_families

# ----------------------------------------------------------------------------- metrics


def test_metrics_are_prometheus_text(server: Live, client: openai.OpenAI) -> None:
    client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=0)
    text = httpx.get(server.url + "/metrics").text
    fams = {f.name: f for f in text_string_to_metric_families(text)}
    for name in (
        "colibri_requests",
        "colibri_generated_tokens",
        "colibri_prompt_tokens",
        "colibri_prompt_cached_tokens",
        "colibri_tokens_per_second",
        "colibri_tokens_per_forward",
        "colibri_drafts_proposed",
        "colibri_drafts_accepted",
        "colibri_draft_acceptance",
        "colibri_expert_hits",
        "colibri_expert_misses",
        "colibri_expert_bytes_read",
        "colibri_expert_wait_seconds",
        "colibri_expert_layer_hits",
        "colibri_prefetch_recall",
        "colibri_queue_depth",
        "colibri_memory_bytes",
        "colibri_request_seconds",
    ):
        assert name in fams, name

    def value(name: str, **labels: str) -> float:
        return sum(
            s.value
            for s in fams[name].samples
            if s.name.endswith("_total") or s.name == name
            if all(s.labels.get(k) == v for k, v in labels.items())
        )

    assert value("colibri_generated_tokens") >= 8
    assert value("colibri_requests", endpoint="/v1/completions", status="200") >= 1
    assert value("colibri_expert_hits") > 0
    assert value("colibri_tokens_per_second") > 0
    assert value("colibri_memory_bytes", kind="expert_budget") > 0
    assert value("colibri_queue_depth") == 0


# ----------------------------------------------------------------------------- dashboard


CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")


CHROMEDRIVER = shutil.which("chromedriver")


@contextlib.contextmanager
def _browser() -> Iterator[Any]:
    """A headless Chromium under selenium (skipped without it, failed in CI)."""
    if CHROMIUM is None or CHROMEDRIVER is None:
        why = (
            "needs Debian's chromium and chromium-driver (apt-get install chromium "
            "chromium-driver; .ci/run installs them)"
        )
        if os.environ.get("COLIBRI_REQUIRE_BROWSER"):  # CI: the browser must be there
            pytest.fail(why)
        pytest.skip(why)
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    opts = webdriver.ChromeOptions()
    opts.binary_location = str(CHROMIUM)
    for a in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
              "--window-size=1280,1180", "--hide-scrollbars"):  # fmt: skip
        opts.add_argument(a)
    os.environ.setdefault("SE_OFFLINE", "true")  # never let selenium fetch a driver
    driver = webdriver.Chrome(options=opts, service=Service(str(CHROMEDRIVER)))
    try:
        yield driver
    finally:
        driver.quit()


def _running_row(driver: Any) -> dict[str, str] | None:
    """The first row of the page's "Running now" table, by column, or None."""
    # Read in one script: the page rewrites the table at each poll.
    cells = driver.execute_script(
        "const r = document.querySelector('#active tr');"
        "return r ? [...r.cells].map(c => c.textContent) : null;"
    )
    if not cells:
        return None
    names = ("request", "phase", "prompt", "generated", "tps", "tpf", "wait", "elapsed", "eta")
    return dict(zip(names, cells, strict=True))


def test_dashboard_updates_in_a_browser(server: Live, tmp_path: Path) -> None:
    with _browser() as driver:
        driver.get(server.url + "/")

        def text(id_: str) -> str:
            return str(driver.find_element("id", id_).text)

        def polls() -> int:
            return int(driver.find_element("tag name", "body").get_attribute("data-polls") or 0)

        wait_for(lambda: polls() >= 1, what="the first poll")
        assert "live" in text("status")
        n0, tokens0 = int(text("generations")), int(text("tokens"))
        c = server.client()
        for q in ("class Node:", "def walk(tree):"):
            c.chat.completions.create(
                model=MODEL,
                messages=[{"role": "user", "content": q}],
                max_tokens=20,
                temperature=0,
            )
        wait_for(lambda: int(text("generations")) == n0 + 2, what="the dashboard to update")
        assert int(text("tokens")) == tokens0 + 40
        # While a long generation runs, its row in "Running now" counts up.
        seen, stop = [0], threading.Event()
        runner = threading.Thread(target=long_stream, args=(server, seen, stop), daemon=True)
        runner.start()
        try:

            def generated() -> int:
                # Poll now rather than wait for the page's 1 s timer: on the tiny model
                # the whole generation takes about two seconds (the stand-in test below
                # leaves the page to its timer).
                driver.execute_script("return poll();")
                row = _running_row(driver)
                return 0 if row is None else int(row["generated"].split(" / ")[0])

            a = wait_for(lambda: generated() >= 5, what="a running row on the page")
            wait_for(lambda: generated() > a, what="the row to count up")
            assert not driver.find_element("id", "active-empty").is_displayed()
        finally:
            stop.set()
            runner.join(timeout=60)
        wait_for(lambda: driver.find_element("id", "active-empty").is_displayed(),
                 what="the row to go when the generation ends")  # fmt: skip
        assert float(text("tps")) > 0
        assert float(text("tpf")) >= 1.0
        assert text("hitrate").endswith("%")
        assert text("recall").endswith("%")
        # The charts drew: the heat map has coloured cells (not only the background).
        coloured = driver.execute_script(
            """const c = document.getElementById('c-heat');
            const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
            let n = 0; for (let i = 0; i < d.length; i += 4) if (d[i + 1] > 150) n++;
            return n;"""
        )
        assert coloured > 500
        logs = [e for e in driver.get_log("browser") if e["level"] == "SEVERE"]
        assert not logs, logs
        shot = tmp_path / "dashboard.png"
        driver.save_screenshot(str(shot))
        assert shot.stat().st_size > 10_000
        if target := os.environ.get("COLIBRI_DASHBOARD_SCREENSHOT"):
            shutil.copyfile(shot, ROOT / target)


@pytest.fixture(scope="module")
def standin_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Live]:
    """``colibri serve`` on the disk stand-in of the tiny model (every expert padded to
    885 kB), its experts read with ``io=direct`` through a 4 MB budget: disk-bound."""
    dst = tmp_path_factory.mktemp("standin") / "tiny-standin"
    subprocess.run(
        [sys.executable, str(ROOT / "tools" / "make_standin.py"), str(EMBEDDED_TINY), str(dst),
         "--intermediate", "2048", "-q"], check=True, capture_output=True,
    )  # fmt: skip
    live = start_server(
        str(dst), "--ram-budget", "4MB", "--io", "direct", "--served-model-name", MODEL
    )
    yield live
    stop_server(live)


def test_the_page_follows_a_disk_bound_generation_by_itself(standin_server: Live) -> None:
    """The page polls ``/stats`` every second by itself: during a long generation on the
    disk stand-in its "Running now" row counts up at least once a second, with a speed,
    the expert wait growing and an ETA; the page's polling counts no request."""
    with _browser() as driver:
        driver.get(standin_server.url + "/")
        body = driver.find_element("tag name", "body")
        wait_for(lambda: int(body.get_attribute("data-polls") or 0) >= 1, what="a first poll")
        requests0 = int(driver.find_element("id", "requests").text)
        seen, stop = [0], threading.Event()
        runner = threading.Thread(
            target=long_stream, args=(standin_server, seen, stop), daemon=True
        )
        runner.start()
        try:
            wait_for(lambda: _running_row(driver), what="a running row", timeout=30)
            # Sample the page, never prompting it, for four of its polls (or 4 s).
            samples: list[tuple[float, int, dict[str, str]]] = []
            t0 = time.monotonic()
            while time.monotonic() - t0 < 4.0 and len(samples) < 4:
                row = _running_row(driver)
                polls = int(body.get_attribute("data-polls") or 0)
                if row is not None and (not samples or polls != samples[-1][1]):
                    samples.append((time.monotonic(), polls, row))
                time.sleep(0.05)
        finally:
            stop.set()
            runner.join(timeout=60)
    assert len(samples) == 4, samples  # four updates in 4 s
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(samples)]
    assert max(gaps) < 1.6, gaps  # a 1 s timer (and the time a poll takes)
    generated = [int(r["generated"].split(" / ")[0]) for _, _, r in samples]
    assert generated == sorted(generated) and generated[-1] > generated[0], generated
    last = samples[-1][2]
    assert last["phase"] == "decode" and last["generated"].endswith(" / 1900")
    assert float(last["tps"]) > 0 and float(last["tpf"]) >= 1.0
    waits = [float(r["wait"].removesuffix(" s")) for _, _, r in samples]
    assert waits[-1] > 0 and waits[-1] >= waits[0], waits  # the experts come from disk
    assert last["eta"].endswith(" s")
    # The page's own polls counted no request: the one generation is the only API request.
    assert standin_server.stats()["totals"]["requests"] == requests0 + 1


def test_a_running_requests_speed_is_its_current_one() -> None:
    """The speed ``/stats`` shows for a running request is over the last seconds: one that
    slowed from 100 to 10 tokens/s shows about 10, not its average, and its ETA follows."""
    job = Job([1, 2, 3], {"max_new_tokens": 1000})
    job._began = 0.0
    t = 0.0
    for _ in range(500):  # 5 s at 100 tokens/s
        t += 0.01
        job._count([7], now=t)
    for _ in range(50):  # then 5 s at 10 tokens/s
        t += 0.1
        job._count([7], now=t)
    p = job.progress(t, 0.0)
    assert p["generated_tokens"] == 550 and p["phase"] == "decode"
    assert 9.0 < p["tokens_per_second"] < 11.0, p
    assert p["eta_seconds"] == pytest.approx(450 / p["tokens_per_second"])
    # While no token comes, the speed falls.
    assert job.progress(t + 3.0, 0.0)["tokens_per_second"] < p["tokens_per_second"] / 2
    # Young: the speed since the first token.
    young = Job([1], {"max_new_tokens": 10})
    young._count([7], now=1.0)
    young._count([7, 7], now=1.1)
    assert young.progress(1.2, 0.0)["tokens_per_second"] == pytest.approx(2 / 0.2)


def test_stats_show_running_requests_live(server: Live) -> None:
    """``/stats`` describes a generation while it runs, not only when it ends: its tokens
    grow between polls, with its speed and an ETA against ``max_tokens``."""
    seen, stop = [0], threading.Event()
    t = threading.Thread(target=long_stream, args=(server, seen, stop), daemon=True)
    t.start()
    try:
        first = wait_for(
            lambda: [a for a in server.stats()["active"] if a["generated_tokens"] >= 5],
            what="a running generation in /stats",
        )[0]
        assert first["endpoint"] == "/v1/completions" and first["phase"] == "decode"
        assert first["max_tokens"] == 1900 and first["prompt_tokens"] > 0
        later = wait_for(
            lambda: [
                a
                for a in server.stats()["active"]
                if a["generated_tokens"] >= first["generated_tokens"] + 20
            ],
            what="its token count to grow",
        )[0]
        assert later["tokens_per_second"] > 0 and later["eta_seconds"] is not None
        assert later["tokens_per_forward"] >= 1.0 and later["elapsed_seconds"] > 0
    finally:
        stop.set()
        t.join(timeout=60)
    wait_for(lambda: not server.stats()["active"], what="the generation to end")


def test_stats_json(server: Live) -> None:
    s = server.stats()
    assert s["served_model"] == MODEL
    # The request count is of API requests: the dashboard's polling and scrapes add none.
    for _ in range(3):
        server.stats()
        httpx.get(server.url + "/health", timeout=10)
        httpx.get(server.url + "/metrics", timeout=10)
    assert server.stats()["totals"]["requests"] == s["totals"]["requests"]
    httpx.get(server.url + "/v1/models", timeout=10)
    assert server.stats()["totals"]["requests"] == s["totals"]["requests"] + 1
    assert s["totals"]["generations"] == len(s["history"]) or len(s["history"]) == 120
    # A layer no expert was routed to yet has no rate (the MTP layer, when the defaults
    # priced drafting out); every other rate is a share.
    rates = [v["hit_rate"] for v in s["layers"].values()]
    assert any(r is not None for r in rates)
    assert all(r is None or 0.0 <= r <= 1.0 for r in rates)
    assert all(v["hit_rate"] is None for v in s["layers"].values() if v["hits"] + v["misses"] == 0)
    # The server runs the model's own top-k (no --experts-per-token).
    k = s["routing"]["num_experts_per_tok"]
    assert s["routing"] == {"experts_per_token": k, "num_experts_per_tok": k} and k >= 1
    json.dumps(s)
