"""The ``colibri`` command line, in process (``colibri.cli.main``) and as a subprocess, on
the tiny test model (conftest.py). Outputs are compared with what the Python API gives."""

from __future__ import annotations

import io
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import colibri
import pytest
from colibri.cli import main
from colibri.model import model_info

Capsys = pytest.CaptureFixture[str]


def run_json(capsys: Capsys, *argv: str) -> dict[str, Any]:
    capsys.readouterr()
    assert main(list(argv)) == 0
    return dict(json.loads(capsys.readouterr().out))


def test_generate_json_matches_the_api(
    capsys: Capsys, test_model_dir: Path, model: colibri.Model
) -> None:
    got = run_json(
        capsys, "generate", "Hello", "-m", str(test_model_dir), "-n", "24", "-t", "0", "--json"
    )
    want = model.generate("Hello", max_new_tokens=24, temperature=0)
    assert got["token_ids"] == want.token_ids
    assert got["text"] == want.text
    assert got["finish_reason"] == want.finish_reason
    assert got["stats"]["generated_tokens"] == len(want.token_ids)
    assert got["stats"]["tokens_per_second"] > 0
    assert {"forwards", "drafts_proposed", "drafts_accepted", "expert_hits"} <= set(got["stats"])


def test_generate_sampling_and_draft_flags(
    capsys: Capsys, test_model_dir: Path, model: colibri.Model
) -> None:
    argv = ["generate", "abc", "-m", str(test_model_dir), "-n", "30", "--json"]
    flags = ["--temperature", "0.8", "--top-k", "40", "--top-p", "0.9", "--seed", "11"]
    flags += ["--draft", "mtp", "--draft-depth", "2", "--ignore-eos"]
    got = run_json(capsys, *argv, *flags)
    want = model.generate(
        "abc",
        max_new_tokens=30,
        temperature=0.8,
        top_k=40,
        top_p=0.9,
        seed=11,
        draft="mtp",
        draft_depth=2,
        stop_token_ids=[],
    )
    assert got["token_ids"] == want.token_ids
    assert len(got["token_ids"]) == 30
    assert sum(got["stats"]["drafts_proposed"]) > 0
    assert sum(got["stats"]["drafts_proposed"][2:]) == 0


def test_generate_stream_and_stdin(
    capsys: Capsys, test_model_dir: Path, model: colibri.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = ["-m", str(test_model_dir), "-n", "40", "-t", "0", "--ignore-eos"]
    want = model.generate("Tell me", max_new_tokens=40, temperature=0, stop_token_ids=[]).text
    capsys.readouterr()
    assert main(["generate", "Tell me", *base, "--stream", "-v"]) == 0
    out = capsys.readouterr()
    assert out.out == want + "\n"
    assert out.err.startswith("40 tokens, ") and "tok/s" in out.err and "forwards" in out.err
    assert main(["generate", "Tell me", *base, "--no-stream"]) == 0
    assert capsys.readouterr().out == want + "\n"
    monkeypatch.setattr(sys, "stdin", io.StringIO("Tell me"))
    assert main(["generate", *base]) == 0
    assert capsys.readouterr().out == want + "\n"


def test_generate_stop_string(capsys: Capsys, test_model_dir: Path, model: colibri.Model) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 60, "temperature": 0, "stop_token_ids": []}
    full = model.generate("stop?", **kw).text
    stop = next(
        full[i : i + 2]
        for i in range(len(full) // 2, len(full) - 2)
        if "\ufffd" not in full[i : i + 2] and full.find(full[i : i + 2]) == i
    )
    base = ["-m", str(test_model_dir), "-n", "60", "-t", "0", "--ignore-eos", "--json"]
    got = run_json(capsys, "generate", "stop?", *base, "--stop", stop)
    assert got["text"] == full[: full.index(stop)]
    assert got["finish_reason"] == "stop"


@pytest.mark.parametrize(
    "flags",
    [
        ["--threads", "1"],
        ["--io", "pread", "--prefetch", "off"],
        ["--io", "mmap", "--prefetch", "real", "--ram-budget", "100KB"],
        ["--no-mtp", "--draft", "ngram", "--draft-depth", "3"],
        ["--draft", "off"],
    ],
)
def test_model_flags_keep_greedy_output(
    capsys: Capsys, test_model_dir: Path, model: colibri.Model, flags: list[str]
) -> None:
    base = ["generate", "flags", "-m", str(test_model_dir), "-n", "16", "-t", "0", "--json"]
    got = run_json(capsys, *base, "--ignore-eos", *flags)
    want = model.generate("flags", max_new_tokens=16, temperature=0, stop_token_ids=[])
    assert got["token_ids"] == want.token_ids


def test_chat_repl_from_piped_stdin(
    capsys: Capsys, test_model_dir: Path, model: colibri.Model, monkeypatch: pytest.MonkeyPatch
) -> None:
    kw: dict[str, Any] = {"max_new_tokens": 10, "temperature": 0}
    r1 = model.chat([{"role": "user", "content": "hello"}], **kw).text
    r2 = model.chat(
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": r1},
            {"role": "user", "content": "more"},
        ],
        **kw,
    ).text
    r3 = model.chat([{"role": "user", "content": "again"}], **kw).text
    assert r2 != r3  # the history matters, so /reset is observable
    monkeypatch.setattr(sys, "stdin", io.StringIO("hello\nmore\n/reset\nagain\n/exit\nnever\n"))
    capsys.readouterr()
    assert main(["chat", "-m", str(test_model_dir), "-n", "10", "-t", "0"]) == 0
    out = capsys.readouterr().out
    assert out == f"{r1}\n{r2}\n(conversation cleared)\n{r3}\n"


def test_info(capsys: Capsys, test_model_dir: Path) -> None:
    got = run_json(capsys, "info", "-m", str(test_model_dir), "--json")
    assert got == json.loads(json.dumps(model_info(test_model_dir)))
    assert got["memory"]["expert_bytes"] > 0
    assert main(["info", "-m", str(test_model_dir)]) == 0
    text = capsys.readouterr().out
    assert "model_type: deepseek_v3" in text
    assert "routed_experts: f32" in text
    assert "memory plan:" in text
    assert "KV cache per token: 640 B" in text  # 4 layers (3 + MTP) x (32 + 8) x 4 bytes
    # Without the MTP head, its experts are not streamed and its KV rows are not kept.
    no_mtp = run_json(capsys, "info", "-m", str(test_model_dir), "--json", "--no-mtp")
    assert no_mtp["memory"]["kv_bytes_per_token"] == 3 * 40 * 4
    assert no_mtp["memory"]["expert_bytes"] < got["memory"]["expert_bytes"]


def test_bench(capsys: Capsys, test_model_dir: Path) -> None:
    got = run_json(
        capsys,
        "bench",
        "-m",
        str(test_model_dir),
        "-n",
        "12",
        "--runs",
        "2",
        "--warmup",
        "0",
        "--ignore-eos",
        "--compare",
        "off",
        "--compare",
        "mtp",
        "--json",
    )
    assert set(got["modes"]) == {"off", "mtp"}
    for mode, row in got["modes"].items():
        assert len(row["tokens_per_second"]) == 2
        assert row["tokens_per_second_median"] > 0
        assert row["generated_tokens"] == 24
        assert row["expert_hits"] + row["expert_misses"] > 0
        if mode == "off":
            assert row["drafts_proposed"] == 0
    assert got["modes"]["mtp"]["drafts_proposed"] > 0
    assert main(["bench", "-m", str(test_model_dir), "-n", "4", "--runs", "1"]) == 0
    assert "tok/s" in capsys.readouterr().out


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["generate", "x", "-m", "/no/such/model"], "does not exist"),
        (["generate", "x", "--temperature", "-1"], "temperature"),
        (["generate", "x", "--top-p", "2"], "top_p"),
        (["generate", "x", "--max-new-tokens", "0"], "max_new_tokens"),
        (["generate", "x", "--draft-depth", "deep"], "draft_depth"),
        (["generate", "x", "--ram-budget", "lots"], "ram_budget"),
        (["generate", ""], "empty"),
        (["info", "-m", "/no/such/model"], "does not exist"),
        (["bench", "--runs", "0"], "--runs"),
        (["bench", "--runs", "-2"], "--runs"),
        (["bench", "--warmup", "-1"], "--warmup"),
    ],
)
def test_errors_print_one_line(
    capsys: Capsys, test_model_dir: Path, argv: list[str], message: str
) -> None:
    if "-m" not in argv:
        argv = [*argv, "-m", str(test_model_dir)]
    capsys.readouterr()
    assert main(argv) == 1
    err = capsys.readouterr().err
    assert err.startswith("error: ")
    assert message in err
    assert "Traceback" not in err


def test_version(capsys: Capsys) -> None:
    assert main(["version"]) == 0
    assert json.loads(capsys.readouterr().out)["version"] == colibri.__version__


def test_subprocess(test_model_dir: Path, model: colibri.Model) -> None:
    cmd = [sys.executable, "-m", "colibri.cli", "generate", "-m", str(test_model_dir)]
    ok = subprocess.run(
        [*cmd, "-n", "8", "-t", "0", "--json"],
        input="piped prompt",
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert ok.returncode == 0, ok.stderr
    want = model.generate("piped prompt", max_new_tokens=8, temperature=0)
    assert json.loads(ok.stdout)["token_ids"] == want.token_ids
    bad = subprocess.run(
        [*cmd, "x", "--top-k", "-3"], capture_output=True, text=True, timeout=60, check=False
    )
    assert bad.returncode == 1
    assert bad.stderr.startswith("error: ") and "top_k" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_max_context_flag(capsys: Capsys, test_model_dir: Path) -> None:
    argv = ["generate", "Hello", "-m", str(test_model_dir), "-n", "100", "-t", "0"]
    got = run_json(capsys, *argv, "--max-context", "20", "--ignore-eos", "--json")
    assert got["finish_reason"] == "length"
    prompt = len(colibri.Model(test_model_dir).encode("Hello"))
    assert len(got["token_ids"]) == 20 - prompt


@pytest.mark.parametrize(
    "argv",
    [
        ["generate", "Hello", "-n", "64", "--ignore-eos", "--stream"],
        ["generate", "Hello", "-n", "64", "--ignore-eos", "--no-stream"],
        ["generate", "Hello", "-n", "8", "--json"],
        ["info"],
        ["bench", "-n", "4", "--runs", "1", "--warmup", "0"],
        ["version"],
    ],
)
def test_a_closed_pipe_exits_quietly(test_model_dir: Path, argv: list[str]) -> None:
    """``colibri ... | head -c 10``: once the reader has gone, writing to stdout fails
    (EPIPE); the command stops quietly, as Unix tools do (no BrokenPipeError traceback),
    with the status of a process killed by SIGPIPE."""
    if argv[0] != "version":
        argv = [*argv, "-m", str(test_model_dir)]
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader (head) has already exited
    try:
        done = subprocess.run(
            [sys.executable, "-m", "colibri.cli", *argv],
            stdin=subprocess.DEVNULL,
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write_end)
    assert done.stderr == "", done.stderr
    assert done.returncode == 128 + signal.SIGPIPE


def test_piping_into_head(test_model_dir: Path) -> None:
    """The real thing: a long streamed generation piped into ``head -c 10``."""
    cmd = [sys.executable, "-m", "colibri.cli", "generate", "Hello", "-m", str(test_model_dir)]
    cmd += ["-n", "250", "--ignore-eos", "--stream", "--draft", "off"]
    with subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, stdin=subprocess.DEVNULL
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        head = proc.stdout.read(10)
        proc.stdout.close()
        err = proc.stderr.read().decode()
        proc.wait(timeout=60)
    assert len(head) == 10
    assert "Traceback" not in err and "BrokenPipeError" not in err, err


def test_ignored_sampling_flags_warn_on_one_line(capsys: Capsys, test_model_dir: Path) -> None:
    capsys.readouterr()
    argv = ["generate", "Hello", "-m", str(test_model_dir), "-n", "2", "--top-p", "0.5"]
    assert main([*argv, "--no-stream"]) == 0
    err = capsys.readouterr().err
    assert err.startswith("warning: 'top_p' ignored: this generation is greedy"), err
    assert "UserWarning" not in err and "cli.py" not in err


def test_generate_prints_llama_cpp_style_timings_and_takes_the_sampler_flags(
    capsys: Capsys, test_model_dir: Path
) -> None:
    argv = ["generate", "-m", str(test_model_dir), "Hello", "-n", "6", "--no-stream", "-v"]
    flags = ["--repetition-penalty", "1.3", "--presence-penalty", "0.2"]
    flags += ["--frequency-penalty", "0.1", "--min-p", "0.05", "--min-tokens", "3"]
    capsys.readouterr()
    assert main([*argv, *flags, "--ignore-eos"]) == 0
    err = capsys.readouterr().err
    assert re.search(r"prompt eval time = +[\d.]+ ms / +\d+ tokens", err), err
    assert re.search(r"eval time = .* tokens per second\)", err), err
    assert main(["generate", "-m", str(test_model_dir), "x", "--min-p", "3"]) == 1
    assert "min_p" in capsys.readouterr().err


def test_bench_reports_prompt_processing_speed(capsys: Capsys, test_model_dir: Path) -> None:
    argv = ["bench", "-m", str(test_model_dir), "-n", "4", "--runs", "2", "--warmup", "0"]
    row = run_json(capsys, *argv, "--json")["modes"]["off"]
    assert row["prompt_tokens"] > 0
    assert len(row["prompt_tokens_per_second"]) == 2
    assert all(v > 0 for v in row["prompt_tokens_per_second"])
