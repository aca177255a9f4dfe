"""What the example tasks' command tests share: a tiny model and a manifested data folder, and the CLI."""

from __future__ import annotations

from pathlib import Path


def model_and_data(root: Path, records: list) -> tuple[Path, Path]:
    """A tiny model folder and a data folder of `records` (all to train on, the first 2 held out)."""
    from memrl.data.manifest import write_manifest
    from memrl.data.records import write_jsonl
    from memrl.tiny import save_tiny_model

    model = save_tiny_model(root / "model", layers=1, hidden=32)
    write_jsonl(root / "data" / "hotpotqa_train.jsonl", records)
    write_jsonl(root / "data" / "hotpotqa_heldout.jsonl", records[:2])
    write_manifest(root / "data", {"hotpotqa_train.jsonl": len(records), "hotpotqa_heldout.jsonl": 2}, "test", {})
    return root, model


def invoke(*args) -> str:
    """`memrl ARGS...` in process; its output, asserting it exited 0."""
    from typer.testing import CliRunner

    from memrl.cli import app

    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output
