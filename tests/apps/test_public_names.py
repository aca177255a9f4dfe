"""The app layer (memrl/apps) talks to the core through public names only, and the core never imports it."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
APPS = sorted((ROOT / "memrl" / "apps").glob("*.py"))


def _imports(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every `from memrl... import name` and every `import memrl...` (name "") in `path`."""
    found = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("memrl"):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Import):
            found += [(alias.name, "") for alias in node.names if alias.name.startswith("memrl")]
    return found


@pytest.mark.parametrize("path", APPS, ids=lambda p: p.name)
def test_apps_import_only_public_names(path):
    for module, name in _imports(path):
        assert not any(part.startswith("_") for part in module.split(".")), (path.name, module)
        assert not name.startswith("_"), f"{path.name} imports the private {module}.{name}"
        exported = getattr(importlib.import_module(module), "__all__", None)
        if name and exported is not None:  # a module that lists its public names: one of those
            assert name in exported, f"{path.name} imports {module}.{name}, not in its __all__"


def test_the_core_never_imports_the_app_layer():
    for path in (ROOT / "memrl").rglob("*.py"):
        if path.parent.name == "apps" or path.name == "cli.py":  # the CLI is the app layer's entry point
            continue
        assert not [m for m, _ in _imports(path) if m.startswith("memrl.apps")], path
