"""The extension's stubs (``colibri/_core.pyi``) state the binary's real signatures.

PyO3 gives every function and method of ``colibri._core`` a ``__text_signature__`` from its
``#[pyo3(signature = ...)]``; each is compared with the stub's ``def``: the same parameters
in the same order, of the same kinds (positional, keyword-only, ``*args``/``**kwargs``),
with the same defaults where the stub writes one out. A parameter added, renamed, reordered
or given another default on one side only fails here.
"""

from __future__ import annotations

import ast
import inspect
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import colibri
import pytest
from colibri import _core

STUB = Path(colibri.__file__).parent / "_core.pyi"

_KINDS = {
    "posonly": inspect.Parameter.POSITIONAL_ONLY,
    "arg": inspect.Parameter.POSITIONAL_OR_KEYWORD,
    "vararg": inspect.Parameter.VAR_POSITIONAL,
    "kwonly": inspect.Parameter.KEYWORD_ONLY,
    "kwarg": inspect.Parameter.VAR_KEYWORD,
}
_UNKNOWN = object()  # a stub default written as ``...``


def _stub_defs() -> Iterator[tuple[str, Any, ast.FunctionDef]]:
    """(qualified name, runtime object, stub def) of every function and method stubbed,
    properties and dunder protocol methods aside (``__init__`` stands for the class)."""
    tree = ast.parse(STUB.read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.FunctionDef):
            yield node.name, getattr(_core, node.name), node
        elif isinstance(node, ast.ClassDef):
            if any(isinstance(b, ast.Name) and b.id == "TypedDict" for b in node.bases):
                continue  # a type for checkers only: the dict a function takes
            cls = getattr(_core, node.name)
            for item in node.body:
                if not isinstance(item, ast.FunctionDef):
                    continue
                if any(isinstance(d, ast.Name) and d.id == "property" for d in item.decorator_list):
                    continue
                if item.name in ("__init__", "__new__"):
                    yield f"{node.name}()", cls, item
                elif not item.name.startswith("__"):
                    yield f"{node.name}.{item.name}", getattr(cls, item.name), item


def _stub_params(fn: ast.FunctionDef, method: bool) -> list[tuple[str, Any, object]]:
    a = fn.args
    positional = [*a.posonlyargs, *a.args]
    defaults: list[ast.expr | None] = [None] * (len(positional) - len(a.defaults)) + list(
        a.defaults
    )
    out: list[tuple[str, Any, object]] = []
    for i, arg in enumerate(positional):
        kind = _KINDS["posonly"] if i < len(a.posonlyargs) else _KINDS["arg"]
        out.append((arg.arg, kind, _default(defaults[i])))
    if a.vararg is not None:
        out.append((a.vararg.arg, _KINDS["vararg"], inspect.Parameter.empty))
    for arg, d in zip(a.kwonlyargs, a.kw_defaults, strict=True):
        out.append((arg.arg, _KINDS["kwonly"], _default(d)))
    if a.kwarg is not None:
        out.append((a.kwarg.arg, _KINDS["kwarg"], inspect.Parameter.empty))
    return out[1:] if method else out  # self


def _default(node: ast.expr | None) -> object:
    if node is None:
        return inspect.Parameter.empty
    if isinstance(node, ast.Constant) and node.value is Ellipsis:
        return _UNKNOWN
    try:
        return ast.literal_eval(node)
    except ValueError:  # an expression such as 4 << 30
        return eval(compile(ast.Expression(node), "<stub>", "eval"), {})


def _runtime_params(obj: Any) -> list[tuple[str, Any, object]]:
    params = list(inspect.signature(obj).parameters.values())
    if params and params[0].name in ("self", "$self", "cls"):
        params = params[1:]
    return [(p.name, p.kind, p.default) for p in params]


DEFS = list(_stub_defs())


def test_every_public_name_of_the_binary_is_stubbed() -> None:
    tree = ast.parse(STUB.read_text(encoding="utf-8"))
    stubbed = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))} | {
        t.id
        for n in tree.body
        if isinstance(n, (ast.Assign, ast.AnnAssign))
        for t in (n.targets if isinstance(n, ast.Assign) else [n.target])
        if isinstance(t, ast.Name)
    }
    public = {n for n in vars(_core) if not n.startswith("__")}
    assert not sorted(public - stubbed), f"not in _core.pyi: {sorted(public - stubbed)}"


@pytest.mark.parametrize(("name", "obj", "fn"), DEFS, ids=[d[0] for d in DEFS])
def test_stub_signature_equals_the_binary(name: str, obj: Any, fn: ast.FunctionDef) -> None:
    if getattr(obj, "__text_signature__", None) is None:
        pytest.fail(f"{name} has no __text_signature__ to compare (give it a pyo3 signature)")
    method = "." in name or name.endswith("()")
    stub = _stub_params(fn, method)
    real = _runtime_params(obj)
    assert [(n, k) for n, k, _ in stub] == [(n, k) for n, k, _ in real], name
    for (n, _, sd), (_, _, rd) in zip(stub, real, strict=True):
        # PyO3 writes a default it cannot spell as a literal as "...".
        if sd is not _UNKNOWN and rd is not Ellipsis:
            assert sd == rd, f"{name}: parameter {n!r} defaults to {rd!r}, the stub says {sd!r}"


def test_the_comparison_catches_a_drifted_stub() -> None:
    """Negative control: a stub with a renamed parameter and another default differs."""
    fn = next(f for n, _, f in DEFS if n == "Engine.generate")
    text = ast.unparse(fn)
    assert "session: Session | None=None" in text
    drifted = ast.parse(text.replace("session: Session | None=None", "sess: Session | None=None"))
    changed = drifted.body[0]
    assert isinstance(changed, ast.FunctionDef)
    real = _runtime_params(_core.Engine.generate)
    assert [n for n, _, _ in _stub_params(changed, True)] != [n for n, _, _ in real]
    regressed = ast.parse(text.replace("session: Session | None=None", "session: Session | None=0"))
    changed = regressed.body[0]
    assert isinstance(changed, ast.FunctionDef)
    stub = dict((n, d) for n, _, d in _stub_params(changed, True))
    assert stub["session"] != dict((n, d) for n, _, d in real)["session"]
