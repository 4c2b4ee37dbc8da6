"""The examples in docs/python-api.md and docs/cli.md run as written.

Every ```python block of python-api.md runs, in order, in one namespace; every ``$`` line of
every ```console block of cli.md runs in a shell and must exit 0. Both run in a scratch
directory holding ``./my-model`` and ``./hf-checkpoint`` (the test model of conftest.py).
``colibri.Model()`` / a command without ``-m`` means the embedded model; until
``python/colibri/models/tiny`` is built, the test model stands in for it.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import colibri.model
import pytest
from conftest import EMBEDDED_TINY, ROOT

DOCS = ROOT / "docs"
HAS_EMBEDDED = (EMBEDDED_TINY / "config.json").is_file()


def blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", path.read_text(), flags=re.S | re.M)


@pytest.fixture
def workdir(tmp_path: Path, test_model_dir: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    shutil.copytree(test_model_dir, tmp_path / "my-model")
    shutil.copytree(test_model_dir, tmp_path / "hf-checkpoint")
    monkeypatch.chdir(tmp_path)
    # The hub example must see an empty cache and must not reach the network.
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf-cache"))
    return tmp_path


def test_python_api_examples(
    workdir: Path, test_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    code = blocks(DOCS / "python-api.md", "python")
    assert len(code) >= 8
    if not HAS_EMBEDDED:
        real = colibri.model.resolve_model_dir

        def resolve(model: object, *, revision: str | None = None) -> Path:
            if model is None or model == colibri.DEFAULT_MODEL:
                return test_model_dir
            return real(model, revision=revision)  # type: ignore[arg-type]

        monkeypatch.setattr(colibri.model, "resolve_model_dir", resolve)

    def no_network(*args: object, **kwargs: object) -> None:
        raise AssertionError(f"a docs example reached for the network: {args!r}")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    namespace: dict[str, object] = {"__name__": "__docs__"}
    for i, source in enumerate(code):
        try:
            exec(compile(source, f"docs/python-api.md[python block {i}]", "exec"), namespace)
        except Exception as e:
            raise AssertionError(f"python block {i} failed:\n{source}") from e
    assert "HF_HUB_OFFLINE" not in os.environ


def console_commands() -> list[str]:
    cmds = []
    for block in blocks(DOCS / "cli.md", "console"):
        cmds += [line[2:] for line in block.splitlines() if line.startswith("$ ")]
    return cmds


def test_cli_examples(workdir: Path, test_model_dir: Path) -> None:
    cmds = console_commands()
    assert len(cmds) >= 10
    colibri_cmd = f"{shlex.quote(sys.executable)} -m colibri.cli"
    for cmd in cmds:
        line = cmd
        if not HAS_EMBEDDED and " -m " not in line:
            line = re.sub(
                r"\bcolibri (generate|chat|info|bench)\b",
                rf"colibri \1 -m {shlex.quote(str(test_model_dir))}",
                line,
            )
        line = re.sub(r"(^|\| )colibri ", rf"\g<1>{colibri_cmd} ", line)
        r = subprocess.run(
            line, shell=True, cwd=workdir, capture_output=True, text=True, timeout=120, check=False
        )
        assert r.returncode == 0, f"$ {cmd}\n{r.stdout}\n{r.stderr}"
        assert "Traceback" not in r.stderr
    # The converted container is real and different from its source.
    assert (workdir / "my-model-int4" / "config.json").is_file()


def test_docstring_examples_run(workdir: Path) -> None:
    """The ``>>>`` examples in the public API's docstrings run as written."""
    import doctest

    result = doctest.testmod(colibri.model, optionflags=doctest.ELLIPSIS)
    assert result.attempted >= 3 and result.failed == 0, result
