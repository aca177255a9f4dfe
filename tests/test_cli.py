"""The command line as a user meets it: help, config errors with the key named, exit codes."""

from pathlib import Path

from typer.testing import CliRunner

from memrl.cli import app

ROOT = Path(__file__).resolve().parents[1]
runner = CliRunner()


def test_help_lists_the_real_commands():
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    for command in ["demo", "train", "serve", "convert-to-hf", "report", "make-tiny-model", "prepare-data", "eval",
                    "compare", "pass-at-k", "sft"]:
        assert command in result.output


def test_bad_override_fails_naming_the_key(tmp_path):
    result = runner.invoke(app, ["train", "--recipe", str(ROOT / "recipes" / "qwen3-0.6b-hotpotqa.yaml"),
                                 "--run-root", str(tmp_path), "--set", "rollout.chunk_tokens=-5"])
    assert result.exit_code == 2
    assert "rollout.chunk_tokens = -5" in result.output


def test_missing_model_path_says_what_to_set(tmp_path):
    result = runner.invoke(app, ["train", "--run-root", str(tmp_path)])
    assert result.exit_code == 2
    assert "model.path" in result.output


def test_make_tiny_model_then_convert_errors_clearly(tmp_path):
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "tiny"), "--layers", "1", "--hidden", "32"])
    assert result.exit_code == 0 and (tmp_path / "tiny" / "config.json").is_file()
    result = runner.invoke(app, ["convert-to-hf", str(tmp_path / "nothing"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "error:" in result.output
