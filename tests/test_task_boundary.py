"""The framework never imports the MemAgent task (issue 25): only the app layer (cli.py and cli_prepare.py, memrl/apps)
and memrl.memagent itself do; everything else reaches a task through `plugins.task` (memrl/task.py). Nor does it
name MemAgent's settings (issue 36): it reads what `memrl.config.TaskSettings` holds and asks the task the rest."""

import ast
import re
from pathlib import Path

from memrl.config import TaskSettings
from memrl.memagent.settings import MemAgentSettings

PACKAGE = Path(__file__).resolve().parents[1] / "memrl"
# Paths under memrl/ that may import memrl.memagent: the task itself and the app layer.
APP_LAYER = ("memagent/", "apps/", "cli.py", "cli_prepare.py", "demo")
# MemAgent's own settings, which only MemAgent, the tasks built on the framework (memrl/tasks/) and the app layer
# may name. data/synthetic.py is the demo's data set (docs/demo.md), sized in MemAgent's chunks: its manifest
# records the chunk_tokens that cut whole facts, a fact of that data, not a setting the framework reads.
MEMAGENT_SETTINGS = ("chunk_tokens", "memory_tokens", "max_chunks", "memory_template", "no_memory_text")
MAY_NAME_SETTINGS = (*APP_LAYER, "tasks/", "data/synthetic.py")
NAMES_A_SETTING = re.compile(r"\b(" + "|".join(MEMAGENT_SETTINGS) + r")\b")


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


def framework_modules(allowed: tuple[str, ...] = APP_LAYER) -> list[Path]:
    return [p for p in sorted(PACKAGE.rglob("*.py"))
            if not p.relative_to(PACKAGE).as_posix().startswith(allowed)]


def named_settings(path: Path) -> list[str]:
    """MemAgent's settings `path` names as whole words (code, strings, comments alike)."""
    return sorted(set(NAMES_A_SETTING.findall(path.read_text(encoding="utf-8"))))


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


def test_no_framework_module_names_memagents_settings():
    assert set(MEMAGENT_SETTINGS) <= set(MemAgentSettings.model_fields) - set(TaskSettings.model_fields)
    offenders = {p.relative_to(PACKAGE).as_posix(): named_settings(p) for p in framework_modules(MAY_NAME_SETTINGS)}
    assert {k: v for k, v in offenders.items() if v} == {}


def test_the_settings_scan_reads_whole_words(tmp_path):
    module = tmp_path / "m.py"
    module.write_text("n = cfg.task.max_chunks  # chunk_tokens\nhead = train.logprob_chunk_tokens\n")
    assert named_settings(module) == ["chunk_tokens", "max_chunks"]  # logprob_chunk_tokens is another word
    assert len(framework_modules(MAY_NAME_SETTINGS)) > 40
