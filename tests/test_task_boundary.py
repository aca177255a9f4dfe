"""The framework never imports the MemAgent task (issue 25): only the app layer (cli.py and cli_prepare.py, memrl/apps)
and memrl.memagent itself do; everything else reaches a task through `plugins.task` (memrl/task.py)."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "memrl"
# Paths under memrl/ that may import memrl.memagent: the task itself and the app layer.
APP_LAYER = ("memagent/", "apps/", "cli.py", "cli_prepare.py", "demo")


def imported_modules(path: Path) -> set[str]:
    """Every module `path` imports, at any depth (function-level imports included)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def framework_modules() -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if not p.relative_to(PACKAGE).as_posix().startswith(APP_LAYER)]


def test_no_framework_module_imports_memagent():
    offenders = {p.relative_to(PACKAGE).as_posix(): sorted(m for m in imported_modules(p)
                                                           if m == "memrl.memagent" or m.startswith("memrl.memagent."))
                 for p in framework_modules()}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_scan_sees_function_level_imports(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from memrl.memagent.prompts import PromptBuilder\n    import memrl.memagent\n")
    assert {"memrl.memagent.prompts", "memrl.memagent"} <= imported_modules(module)
    assert len(framework_modules()) > 40  # the scan covers the package, not an empty glob
