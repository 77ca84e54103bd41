"""The docs held to the code: every public name and argument is in docs/api.md, and every module
and class docs/architecture.md cites exists.

Why a test: the API reference drifted silently (``system_prompt``, ``push_message``, three of
``ask``'s arguments and more were missing; architecture.md named a module that had been folded
into another). Reading the code's own signatures here makes drift a failing test.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib
import importlib.util
import inspect
import json
import os
import re
import shlex
import subprocess
import tokenize
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


# --- Every code snippet in the README and the docs runs -------------------------------------------
#
# The rule. A fenced block with a language is a snippet; one without (a tree, a diagram, a sample
# log line, a key layout) or marked ``mermaid`` / ``text`` is a figure and is not run.
#
# * ``python``: every block is listed in ``PYTHON_SNIPPETS`` by its file and first line, and the
#   entry says how it runs: "exec" (here, with the placeholders of ``SUBSTITUTIONS`` replaced by
#   the shipped demo model and ``FIXTURES`` giving images), "vllm" (in ``.venv-vllm``, vLLM's own
#   environment), a test function that runs it (a server to answer it, or assertions on what its
#   comments say), or "compile" with the reason it cannot run on a CPU machine without network
#   (it loads a model from the hub into a GPU engine): then it must compile, and every
#   ``kamera_agent`` module and name it imports or names must exist. A new block not listed fails.
# * ``bash``: each command (``&&`` chains split, ``\`` continuations joined, leading ``VAR=value``
#   dropped) is checked by what it runs: ``kamera`` commands are parsed by the real CLI parser;
#   scripts (``bash scripts/…``, ``python benchmarks/…``, ``python examples/…``) must exist;
#   ``python -m`` a module of this package must import; ``pip install`` of this package must be
#   from a clone (``-e ".[extras]"``) with extras pyproject.toml defines; ``vllm serve``'s
#   ``--kv-transfer-config`` must be JSON naming an importable connector; the engines' launchers,
#   ``git clone`` and ``cd`` are taken as they are. Any other command fails the test.

README_PATH = ROOT / "README.md"
HAND_WRITTEN = [
    README_PATH,
    *sorted(path for path in (ROOT / "docs").glob("*.md") if path.name != "results.md"),
    ROOT / "examples" / "README.md",
    ROOT / "kamera_agent" / "models" / "kamera-tiny-vl" / "README.md",
]
SNIPPET_FILES = [README_PATH, *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "results.md")]
SNIPPET_FILES.append(ROOT / "examples" / "README.md")
FENCE = re.compile(
    r"^(?P<indent>[ \t]*)```(?P<lang>[\w+-]*)[ \t]*\n(?P<body>.*?)^(?P=indent)```[ \t]*$", re.M | re.S
)
FIGURES = {"", "mermaid", "text"}
SUBSTITUTIONS = {
    '"path/to/Qwen2.5-VL-3B-Instruct"': "str(DEMO_MODEL_DIR)",
    '"/path/to/checkpoint"': "str(DEMO_MODEL_DIR)",
}
PYTHON_SNIPPETS = {
    (
        "README.md",
        'window = KameraWindow("path/to/Qwen2.5-VL-3B-Instruct", conf',
    ): "test_readme_snippet.py::test_the_window_in_ten_lines_does_what_its_comments_say",
    (
        "README.md",
        "model, tokenizer, image_processor = load_demo_model()  # off",
    ): "test_readme_snippet.py::test_the_offline_demo_snippet_answers_the_binding_question",
    (
        "README.md",
        'client = OpenAI(base_url="http://127.0.0.1:8000/v1", api_key',
    ): "test_readme_snippet.py::test_the_openai_snippet_runs_against_kamera_serve",
    (
        "docs/models.md",
        'window = KameraWindow("/path/to/checkpoint", config=WindowCo',
    ): "exec",
    ("docs/engines.md", "config = KVTransferConfig("): "vllm",
    ("docs/store.md", "class DictTier(Tier):"): "exec",
    ("docs/development.md", "backend, tier = CountingBackend(TinyTorchBackend(seed=0)), F"): "exec",
    (
        "docs/vllm.md",
        'os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # schedu',
    ): "compile: loads Qwen2.5-1.5B-Instruct from the hub into vLLM's engine",
}
LAUNCHERS = {"python -m sglang.launch_server", "python -m pytest", "git clone", "cd"}


def snippets() -> list[tuple[str, int, str, str]]:
    """(file relative to the root, line, language, body) of every fenced block with a language."""
    out = []
    for path in SNIPPET_FILES:
        text = path.read_text()
        for match in FENCE.finditer(text):
            lang = match["lang"]
            if lang in FIGURES:
                continue
            indent = len(match["indent"])
            body = "\n".join(line[indent:] for line in match["body"].splitlines())
            line = text.count("\n", 0, match.start()) + 1
            out.append((str(path.relative_to(ROOT)), line, lang, body))
    return out


SNIPPETS = snippets()


def _first_line(body: str) -> str:
    """The first 60 characters of the block's first line that is not an import: what
    PYTHON_SNIPPETS knows it by."""
    lines = (line for line in body.splitlines() if line.strip() and not line.startswith(("from ", "import ")))
    return next(lines)[:60]


def _fixtures() -> dict[str, object]:
    from kamera_agent.demo.model import DEMO_MODEL_DIR
    from kamera_agent.demo.task import make_items, render_page

    item = make_items(1, seed=3)[0]
    return {
        "DEMO_MODEL_DIR": DEMO_MODEL_DIR,
        "image": render_page(item.pages[0]),
        "screenshot": render_page(item.pages[1]),
    }


def _check_kamera_names(body: str) -> None:
    """Every kamera_agent module (and name) the block imports or names as a string exists."""
    tree = ast.parse(body)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kamera_agent"):
            module = importlib.import_module(node.module)
            for alias in node.names:
                assert hasattr(module, alias.name), f"{node.module} has no {alias.name}"
        named = isinstance(node, ast.Constant) and isinstance(node.value, str)
        if named and re.fullmatch(r"kamera_agent(\.\w+)+", str(node.value)):  # type: ignore[attr-defined]
            assert importlib.util.find_spec(node.value) is not None, f"no module {node.value}"


def test_every_python_snippet_has_a_way_to_run() -> None:
    listed = {(path, _first_line(body)) for path, _, lang, body in SNIPPETS if lang == "python"}
    missing = sorted(listed - set(PYTHON_SNIPPETS))
    assert not missing, f"python snippets with no entry in PYTHON_SNIPPETS (say how each runs): {missing}"
    assert not sorted(set(PYTHON_SNIPPETS) - listed), "PYTHON_SNIPPETS lists snippets the docs no longer hold"
    tests = (ROOT / "tests" / "test_readme_snippet.py").read_text()
    for how in PYTHON_SNIPPETS.values():
        if how.startswith("test_readme_snippet.py::"):
            assert f"def {how.split('::')[1]}" in tests, f"no test runs the snippet: {how}"


@pytest.mark.parametrize(
    ("path", "body"),
    [
        pytest.param(path, body, id=f"{path}:{line}")
        for path, line, lang, body in SNIPPETS
        if lang == "python"
    ],
)
def test_every_python_snippet_runs(path: str, body: str) -> None:
    how = PYTHON_SNIPPETS.get((path, _first_line(body)), "")
    compile(body, path, "exec")
    _check_kamera_names(body)
    if how == "exec":
        source = body
        for placeholder, value in SUBSTITUTIONS.items():
            source = source.replace(placeholder, value)
        exec(compile(source, path, "exec"), _fixtures())
    elif how == "vllm":
        python = ROOT / ".venv-vllm" / "bin" / "python"
        if not python.exists():
            pytest.skip("no .venv-vllm: the vLLM tests build it (scripts/vllm_env.sh)")
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        run = subprocess.run([str(python), "-c", body], capture_output=True, text=True, env=env, timeout=300)
        assert run.returncode == 0, run.stderr[-2000:]


def _commands(body: str) -> list[str]:
    """The block's commands: continuations joined, a quoted argument over several lines kept
    whole, comments dropped, ``&&`` chains split."""
    lines, pending = [], ""
    for raw in re.sub(r"\\\n", " ", body).splitlines():
        pending = f"{pending} {raw.strip()}" if pending else raw.strip()
        if pending.count("'") % 2 == 0:
            lines.append(pending)
            pending = ""
    out = []
    for line in lines:
        words = shlex.split(line, comments=True)
        if not words:
            continue
        command: list[str] = []
        for word in [*words, "&&"]:
            if word == "&&":
                out.append(shlex.join(command))
                command = []
            else:
                command.append(word)
    return out


def _check_command(command: str) -> None:
    words = shlex.split(command)
    while words and re.fullmatch(r"[A-Z_]+=.*", words[0]):
        words = words[1:]
    words[0] = words[0].removeprefix(".venv/bin/")
    head = " ".join(words[:3])
    if words[0] == "kamera":
        from kamera_agent.cli import build_parser

        try:
            build_parser().parse_args(words[1:])
        except SystemExit as exited:
            raise AssertionError(f"the CLI refuses {command!r}") from exited
    elif words[0] == "bash" or (words[0] in ("python", "python3") and words[1] != "-m"):
        assert (ROOT / words[1]).is_file(), f"no script {words[1]}"
    elif words[0] == "python" and words[2].startswith("kamera_agent"):
        assert importlib.util.find_spec(words[2]) is not None, f"no module {words[2]}"
    elif words[:2] == ["pip", "install"]:
        if any("kamera" in word or word.startswith(".[") or word == "." for word in words):
            section = (ROOT / "pyproject.toml").read_text().split("[project.optional-dependencies]")[1]
            extras = re.findall(r"^([\w-]+) = \[", section.split("\n[")[0], re.M)
            assert "-e" in words, f"the package is not on the index: install it from a clone ({command!r})"
            target = words[words.index("-e") + 1]
            match = re.fullmatch(r"\.(?:\[([\w,-]+)\])?", target)
            assert match, f"install from the clone's root: {command!r}"
            for extra in (match[1] or "").split(","):
                assert not extra or extra in extras, f"no extra {extra!r} in pyproject.toml"
    elif words[:2] == ["vllm", "serve"]:
        config = json.loads(words[words.index("--kv-transfer-config") + 1])
        assert importlib.util.find_spec(config["kv_connector_module_path"]) is not None
    else:
        assert any(head.startswith(launcher) for launcher in LAUNCHERS), f"an unchecked command: {command!r}"


@pytest.mark.parametrize(
    ("path", "body"),
    [pytest.param(path, body, id=f"{path}:{line}") for path, line, lang, body in SNIPPETS if lang == "bash"],
)
def test_every_shell_snippet_names_what_exists(path: str, body: str) -> None:
    for command in _commands(body):
        _check_command(command)


def test_the_languages_of_the_snippets_are_known() -> None:
    assert {lang for _, _, lang, _ in SNIPPETS} <= {"python", "bash"}


def test_ci_runs_the_readmes_test_command() -> None:
    quick = README_PATH.read_text().split("## Quick start")[1]
    block = re.search(r"```bash\n(.*?)```", quick, re.S)
    assert block is not None
    demo, tests = block[1].strip().splitlines()
    assert demo == "bash scripts/bootstrap.sh && .venv/bin/kamera demo"
    assert (ROOT / ".ci" / "run").read_text().strip().splitlines()[-1] == tests


# --- No dates and no issue numbers ------------------------------------------------------------------
#
# The rule. The README, the hand-written docs (docs/*.md but docs/results.md, which is generated
# and carries its runs' dates), the examples and the model card, and the comments and docstrings
# of the package hold no date and no number of this project's issues: they say what is true now,
# and history lives in git.
# * A date: an ISO date (2026-12-06) unless a time of day follows it (a sample log line's
#   timestamp), or a month name with a year ("Dec 2026", "December 4, 2026", "4 Dec 2026").
# * An issue number: "issue 31" / "issues 31" / "Issue #31", or a bare "#31" unless the word
#   before it says what it numbers elsewhere (an upstream "PR", "pull request" or "RFC": "vLLM PR
#   #53876") or it labels content (a "page", "frame" or "caption" "#2"), or it is quoted as a
#   literal (after a backtick or a quote mark, as the demo's page captions are).

_MONTH = r"(?:Jan|Feb|Mar|Apr|May|Jun|Jul|Aug|Sep|Sept|Oct|Nov|Dec)[a-z]*\.?"
DATE = re.compile(
    r"\b(?:19|20)\d\d-(?:0[1-9]|1[0-2])-(?:0[1-9]|[12]\d|3[01])\b(?![ T]\d\d:\d\d)"
    rf"|\b{_MONTH}\s+(?:\d{{1,2}},?\s+)?(?:19|20)\d\d\b|\b\d{{1,2}}\s+{_MONTH}\s+(?:19|20)\d\d\b"
)
ISSUE = re.compile(r"\b[Ii]ssues?\s+#?\d+\b")
HASH = re.compile(r"#\d+\b")
HASH_ALLOWED_BEFORE = re.compile(
    r"(?:\bPRs?|\bpull request|\bRFC|\b[Pp]ages?|\b[Ff]rames?|\bcaption(?:ed)?)\s*$|[`'\"]$"
)


def offences(text: str) -> list[str]:
    """The dates and issue numbers in ``text`` (by the rule above)."""
    issues = list(ISSUE.finditer(text))
    found = [m.group(0) for m in DATE.finditer(text)] + [m.group(0) for m in issues]
    for match in HASH.finditer(text):
        if any(issue.start() <= match.start() < issue.end() for issue in issues):
            continue
        before = text[max(0, match.start() - 20) : match.start()]
        if match.start() > 0 and (text[match.start() - 1].isalnum() or text[match.start() - 1] in "&/"):
            continue
        if not HASH_ALLOWED_BEFORE.search(before):
            found.append(match.group(0))
    return found


def comments_and_docstrings(path: Path) -> str:
    """A Python file's comments and docstrings (every string that is a statement of its own)."""
    source = path.read_text()
    parts = []
    with path.open("rb") as handle:
        parts += [tok.string for tok in tokenize.tokenize(handle.readline) if tok.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(source)):
        if (
            isinstance(node, ast.Expr)
            and isinstance(node.value, ast.Constant)
            and isinstance(node.value.value, str)
        ):
            parts.append(node.value.value)
    return "\n".join(parts)


def test_the_rule_catches_dates_and_issue_numbers_and_spares_the_rest() -> None:
    caught = "run on 2026-12-06; Dec 2026; December 4, 2026; 4 Dec 2026; issue 31; Issue #31; see #31; (#56)"
    assert len(offences(caught)) == 8
    spared = (
        'vLLM PR #53876; RFC #12; page #1 and frame #2, captioned `#1`; "#0: a note"; '
        "2025-06-01 12:00:03,114 INFO; docs/models.md#naming-a-model; colour #1f2937; 2,048 tokens"
    )
    assert offences(spared) == []


@pytest.mark.parametrize("path", HAND_WRITTEN, ids=lambda path: str(path.relative_to(ROOT)))
def test_no_date_or_issue_number_in_the_hand_written_docs(path: Path) -> None:
    assert not offences(path.read_text()), f"{path.relative_to(ROOT)}: {offences(path.read_text())}"


def test_no_date_or_issue_number_in_the_packages_comments_and_docstrings() -> None:
    files = sorted((ROOT / "kamera_agent").rglob("*.py")) + sorted((ROOT / "examples").glob("*.py"))
    found = {
        str(path.relative_to(ROOT)): hits
        for path in files
        if (hits := offences(comments_and_docstrings(path)))
    }
    assert not found, f"dates or issue numbers in comments or docstrings: {found}"
