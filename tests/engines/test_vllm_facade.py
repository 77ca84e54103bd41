"""`KameraConnector` is a facade: every method hands its call to a half, none holds logic.

Read from the source (no vLLM needed): a method's body is one statement, a call of the half this
process runs (``self.sides.scheduler`` / ``.worker`` / ``.side``) or of a metrics class, passing
its own parameters through; ``__init__`` builds the base and the halves, nothing else. Logic
added to the facade (a branch, a loop, a computed argument) fails here: it belongs in a half.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CONNECTOR = ROOT / "kamera_agent" / "engines" / "vllm" / "connector.py"
HALVES = {"scheduler", "worker", "side"}
FACTORIES = {"KameraConnectorStats", "KameraPromMetrics"}


def _facade() -> ast.ClassDef:
    tree = ast.parse(CONNECTOR.read_text())
    return next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "KameraConnector")


def _methods() -> list[ast.FunctionDef]:
    return [n for n in _facade().body if isinstance(n, ast.FunctionDef)]


def _body(method: ast.FunctionDef) -> list[ast.stmt]:
    """The statements after the docstring."""
    first = method.body[0]
    docstring = isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
    return method.body[1:] if docstring else method.body


def _callee(call: ast.Call) -> str:
    """``self.sides.worker.flush`` or ``KameraConnectorStats.of``, as a dotted name."""
    parts, node = [], call.func
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    assert isinstance(node, ast.Name), ast.unparse(call)
    return ".".join([node.id, *reversed(parts)])


def test_the_facade_has_no_branch_loop_or_handler() -> None:
    logic = (ast.If, ast.For, ast.While, ast.Try, ast.With, ast.IfExp, ast.BoolOp, ast.Compare, ast.Match)
    found = [ast.unparse(n)[:60] for n in ast.walk(_facade()) if isinstance(n, logic)]
    assert not found, found


@pytest.mark.parametrize("method", [m for m in _methods() if m.name != "__init__"], ids=lambda m: m.name)
def test_each_method_is_one_delegation(method: ast.FunctionDef) -> None:
    body = _body(method)
    assert len(body) == 1, f"{method.name}: {len(body)} statements"
    statement = body[0]
    assert isinstance(statement, ast.Return | ast.Expr) and isinstance(statement.value, ast.Call)
    call = statement.value
    callee = _callee(call).split(".")
    to_half = callee[:2] == ["self", "sides"] and len(callee) == 4 and callee[2] in HALVES
    assert to_half or (callee[0] in FACTORIES and len(callee) <= 2), f"{method.name} calls {_callee(call)}"
    if to_half:  # the hook of the same name (the half's own name for it, not another hook)
        assert callee[3] == method.name, f"{method.name} calls {_callee(call)}"
    params = {a.arg for a in [*method.args.args, *method.args.kwonlyargs]}
    passed = [*call.args, *(k.value for k in call.keywords)]
    assert all(isinstance(a, ast.Name) and a.id in params for a in passed), ast.unparse(call)


def test_init_builds_the_base_and_the_halves_only() -> None:
    (init,) = [m for m in _methods() if m.name == "__init__"]
    statements = [ast.unparse(s) for s in _body(init)]
    assert len(statements) == 2, statements
    assert statements[0].startswith("super().__init__(")
    assert statements[1].startswith("self.sides = Sides.of(")
