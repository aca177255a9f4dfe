"""One `MemrlError` base for every error a user can meet; the CLI turns any of them into one line, exit 2."""

import ast
import importlib
from pathlib import Path

from typer.testing import CliRunner

from memrl.cli import app
from memrl.errors import MemrlError

PACKAGE = Path(__file__).resolve().parents[1] / "memrl"
# Error classes a command never shows a user, each with the reason.
NOT_USER_FACING = {
    "memrl.engines.server_requests:APIError": "a request the server refuses: it becomes an HTTP error response",
}


def error_classes() -> dict[str, type]:
    """Every class named `*Error` defined at the top level of a module of the package, by "module:name"."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")
        for node in ast.parse(path.read_text(encoding="utf-8")).body:
            if isinstance(node, ast.ClassDef) and node.name.endswith("Error"):
                found[f"{module}:{node.name}"] = getattr(importlib.import_module(module), node.name)
    return found


def test_every_error_class_a_user_can_meet_is_a_memrl_error():
    classes = error_classes()
    assert "memrl.train.packing:PackingError" in classes  # the scan sees the package
    assert all(issubclass(cls, Exception) for cls in classes.values())
    assert set(NOT_USER_FACING) <= set(classes), "an exemption names a class that no longer exists"
    missing = [name for name, cls in classes.items() if name not in NOT_USER_FACING and not issubclass(cls, MemrlError)]
    assert not missing, f"derive these from memrl.errors.MemrlError (or list why not in NOT_USER_FACING): {missing}"


def test_error_classes_keep_their_builtin_base():
    # Callers that catch ValueError / RuntimeError / TimeoutError / ImportError still catch them.
    from memrl.config import ConfigError
    from memrl.data.records import MissingDependencyError
    from memrl.distributed.workers import WorkerTimeoutError
    from memrl.train.packing import PackingError
    from memrl.train.setup import TrainingError

    assert issubclass(ConfigError, ValueError) and issubclass(PackingError, ValueError)
    assert issubclass(TrainingError, RuntimeError) and issubclass(MissingDependencyError, ImportError)
    assert issubclass(WorkerTimeoutError, TimeoutError) and issubclass(WorkerTimeoutError, MemrlError)


def test_packing_error_is_one_line_exit_2(monkeypatch, tmp_path):
    # PackingError (e.g. train.packing with a sliding-window model) was missing from the CLI's list of
    # expected errors and ended in a traceback.
    from memrl.train import packing, report

    def refuse(run_root):
        raise packing.PackingError("train.packing does not support sliding-window attention layers;\n"
                                   "set train.packing to false for this model")

    monkeypatch.setattr(report, "write_report", refuse)
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert lines == ["error: train.packing does not support sliding-window attention layers; set train.packing to "
                     "false for this model"]


def test_a_damaged_metrics_line_is_one_line_exit_2(tmp_path):
    # read_metrics raised a plain ValueError: `memrl report` ended in a traceback.
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text('garbage\n{"rollout_id": 0, "reward/mean": 0.5}\n')
    result = CliRunner().invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert result.output.strip().splitlines() == [f"error: {tmp_path / 'logs' / 'metrics.jsonl'}:1 is not valid JSON "
                                                  f"(Expecting value: line 1 column 1 (char 0)); "
                                                  f"fix or delete that line"]
