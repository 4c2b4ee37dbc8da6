"""The ``_core`` stub against the binary, the names and defaults the Python layer takes
from the engine, and the public API's types."""

from __future__ import annotations

import ast
import inspect
import typing

import colibri
import numpy as np
import pytest
from colibri import _core
from conftest import ROOT

# Python's own Ctrl-C handler around every test, as in a terminal (see conftest.py).
pytestmark = pytest.mark.usefixtures("_python_sigint_handler")


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


def test_option_vocabulary_and_stats_names_come_from_the_engine() -> None:
    from colibri import validation

    choices = _core.choices()
    for name, alias in [
        ("io", validation.IoMode),
        ("prefetch", validation.PrefetchMode),
        ("draft", validation.DraftMode),
        ("prefill", validation.PrefillMode),
        ("decode", validation.DecodeMode),
    ]:
        assert list(typing.get_args(alias)) == choices[name], name
    py_fields = set(colibri.GenerationStats.__dataclass_fields__) - {"extra"}
    assert py_fields == set(_core.generation_stats_fields())


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
        "decode": "auto",
        "load_progress": None,
        "trace_routing": None,
        "experts_per_token": None,
    }
    model = inspect.signature(colibri.Model).parameters
    shared = set(model) & set(engine)
    assert {
        "threads",
        "io",
        "prefetch",
        "mtp",
        "max_context",
        "prefill",
        "experts_per_token",
    } <= shared
    for name in shared:
        assert model[name].default == engine[name], name


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
