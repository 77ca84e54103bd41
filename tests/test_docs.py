"""The docs held to the code: every public name and argument is in docs/api.md, and every module
and class docs/architecture.md cites exists.

Why a test: the API reference drifted silently (``system_prompt``, ``push_message``, three of
``ask``'s arguments and more were missing; architecture.md named a module that had been folded
into another). Reading the code's own signatures here makes drift a failing test.
"""

from __future__ import annotations

import dataclasses
import inspect
import re
import typing
from pathlib import Path

import pytest

import kamera_agent
from kamera_agent import KameraWindow, WindowConfig
from kamera_agent.results import Answer, Edit, EditKind, OpCost, Plan, Probe, WindowStats

ROOT = Path(__file__).resolve().parents[1]
API = (ROOT / "docs" / "api.md").read_text()
ARCHITECTURE = (ROOT / "docs" / "architecture.md").read_text()
TREES = [ROOT / "kamera_agent", ROOT / "tests", ROOT / "benchmarks"]
SOURCE = "\n".join(path.read_text() for tree in TREES for path in tree.rglob("*.py"))


def _public_members(cls: type) -> list[str]:
    return sorted(name for name in vars(cls) if not name.startswith("_"))


def _rows(name: str) -> list[str]:
    """The api.md lines that document ``name`` (a table row or bullet naming it in code)."""
    return [
        line for line in API.splitlines() if f"`{name}" in line or f"{name}(" in line or f"`.{name}" in line
    ]


@pytest.mark.parametrize("name", sorted(kamera_agent.__all__))
def test_every_name_the_package_exports_is_in_the_api_reference(name: str) -> None:
    assert f"`{name}" in API or f"{name}(" in API or f" {name} " in API, f"docs/api.md never names {name}"


@pytest.mark.parametrize("member", _public_members(KameraWindow))
def test_every_window_member_and_each_of_its_arguments_is_documented(member: str) -> None:
    rows = _rows(member)
    assert rows, f"docs/api.md has no row for KameraWindow.{member}"
    attribute = getattr(KameraWindow, member)
    if not callable(attribute) or isinstance(attribute, property):
        return
    text = "\n".join(rows)
    for parameter in list(inspect.signature(attribute).parameters)[1:]:  # self first
        if parameter in ("args", "kwargs", "more"):
            continue
        assert parameter in text, f"docs/api.md documents {member} without its argument {parameter!r}"


def test_the_window_constructors_arguments_are_documented() -> None:
    for parameter in list(inspect.signature(KameraWindow.__init__).parameters)[1:]:
        assert parameter in API.split("## `WindowConfig`")[0], (
            f"KameraWindow({parameter}=...) is undocumented"
        )


@pytest.mark.parametrize("field", sorted(WindowConfig.model_fields))
def test_every_window_config_field_is_documented(field: str) -> None:
    assert f"`{field}`" in API or f"`{field}," in API or f", {field}`" in API, (
        f"docs/api.md has no row for WindowConfig.{field}"
    )


RESULTS = API.split("## Results")[1].split("\n## ")[0]


@pytest.mark.parametrize("result", [OpCost, Answer, Probe, Plan, Edit, WindowStats])
def test_every_result_field_is_documented(result: type) -> None:
    for field in dataclasses.fields(result):
        assert re.search(rf"\b{field.name}\b", RESULTS), (
            f"docs/api.md Results lacks {result.__name__}.{field.name}"
        )


def test_every_edit_kind_is_documented() -> None:
    for kind in typing.get_args(EditKind):
        assert f"`{kind}`" in RESULTS, f"docs/api.md lists no edit kind {kind!r}"


def test_every_module_architecture_md_cites_exists() -> None:
    files = {path.name for tree in TREES for path in tree.rglob("*.py")}
    cited = set(re.findall(r"\b([a-z_]+\.py)\b", ARCHITECTURE))
    missing = sorted(name for name in cited if name not in files)
    assert not missing, f"docs/architecture.md cites modules that do not exist: {missing}"


def test_every_class_architecture_md_cites_exists() -> None:
    cited = set(re.findall(r"\b([A-Z][a-z]+(?:[A-Z][a-z0-9]*)+)\b", ARCHITECTURE))
    outside = {  # other projects' names and plain words
        "FastAPI",
        "PrefillAdder",
        "RadixCache",
        "KVConnectorBase",
        "DynamicCache",
        "ChatML",
        "SGLang",
        "MappingProxyType",
        "RoPE",
    }
    missing = sorted(
        name
        for name in cited - outside
        if not re.search(rf"\b(class {name}\b|{name} = |def {name}\b)", SOURCE)
    )
    assert not missing, f"docs/architecture.md cites names the code does not define: {missing}"
