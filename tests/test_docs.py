"""The docs name what exists: the two layout lists cover every module, paths and `memrl.` names resolve, and no
text uses a config key of the retired `rollout:` section (its keys moved to `sampling:`, `engine:`, `task:`)."""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# docs/real-model.md is kept by the real-model work; bench/README.md's figures name files of their own time.
DOCS = [ROOT / "README.md", ROOT / "docs" / "design.md", ROOT / "docs" / "custom-tasks.md",
        ROOT / "docs" / "engines.md", ROOT / "docs" / "servers.md", ROOT / "docs" / "multinode.md",
        ROOT / "docs" / "algorithms.md", ROOT / "docs" / "demo.md"]
LAYOUTS = [(ROOT / "README.md", "## Layout"), (ROOT / "docs" / "design.md", "### Module layout")]


def modules() -> set[str]:
    package = ROOT / "memrl"
    return {str(p.relative_to(package)) for p in package.rglob("*.py")
            if p.name not in ("__init__.py", "__main__.py")}


def layout_block(path: Path, heading: str) -> list[str]:
    lines = path.read_text().splitlines()
    start = lines.index(heading) + 2  # the heading, then the opening fence
    return lines[start:lines.index("```", start)]


def named_modules(block: list[str]) -> set[str]:
    """Each `name.py` of a layout block, qualified by the package folder whose entry it sits under (a line
    indented by two spaces opens an entry: `  engines/  ...` a folder, `  cli.py ...` a top-level file)."""
    folder, named = "", set()
    for line in block:
        entry = re.match(r"  (\w+)(/?)", line)
        if entry:
            folder = entry.group(1) + "/" if entry.group(2) else ""
        named |= {folder + name for name in re.findall(r"\b(\w+\.py)\b", line)}
    return named


@pytest.mark.parametrize(("path", "heading"), LAYOUTS, ids=["README", "design"])
def test_layout_lists_every_module_and_no_other(path, heading):
    named, existing = named_modules(layout_block(path, heading)), modules()
    assert sorted(existing - named) == [], f"{path.name} {heading!r} does not list these modules"
    assert sorted(named - existing) == [], f"{path.name} {heading!r} lists modules that do not exist"


def quoted(path: Path) -> list[str]:
    return re.findall(r"`([^`\n]+)`", path.read_text())


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_quoted_paths_and_memrl_names_exist(path):
    missing = [m for text in quoted(path) for m in re.findall(r"\bmemrl/[\w/]+\.py\b", text)
               if not (ROOT / m).exists()]
    unresolved = [m for text in quoted(path) for m in re.findall(r"\bmemrl(?:\.\w+)+", text)
                  if not resolves(m)]
    assert missing == [] and unresolved == []


def resolves(dotted: str) -> bool:
    """`memrl.a.b.C.d`: the longest importable module prefix, then attributes."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for name in parts[cut:]:
            if not hasattr(obj, name):
                return False
            obj = getattr(obj, name)
        return True
    return False


@pytest.mark.parametrize("path", DOCS, ids=lambda p: p.name)
def test_no_retired_rollout_config_key(path):
    # `memrl/rollout.py` and `memrl.rollout.X` are the module; `rollout.<key>` would be an old config key.
    keys = [m for text in quoted(path) for m in re.findall(r"(?<![\w/.])rollout\.(\w+)", text) if m != "py"]
    assert keys == []


def test_custom_tasks_shows_the_single_turn_task_as_it_is():
    """docs/custom-tasks.md's whole-task example is memrl/tasks/single_turn.py, less its docstring and
    `from __future__` line: a change to the module or to the Task API it uses shows up in the doc."""
    doc = (ROOT / "docs" / "custom-tasks.md").read_text()
    shown = next(b for b in re.findall(r"```python\n(.*?)```", doc, re.S) if "class SingleTurnTask(Task)" in b)
    module = ast.parse((ROOT / "memrl" / "tasks" / "single_turn.py").read_text())
    body = [node for node in module.body[1:] if not isinstance(node, ast.ImportFrom) or node.module != "__future__"]
    assert ast.dump(ast.parse(shown)) == ast.dump(ast.Module(body=body, type_ignores=[]))


def test_custom_tasks_table_lists_every_task_method():
    """The method table of docs/custom-tasks.md is the Task's overridable API: each public method of
    `memrl.task.Task`, and no other."""
    from memrl.task import Task

    doc = (ROOT / "docs" / "custom-tasks.md").read_text()
    table = doc[doc.index("## The Task"):doc.index("`ctx` (")]
    listed = set(re.findall(r"^\| `(\w+)\(", table, re.M))
    assert listed == {name for name in vars(Task) if callable(vars(Task)[name]) and not name.startswith("_")}
