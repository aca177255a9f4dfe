"""The command line as a user meets it: help, config errors with the key named, exit codes."""

import json
import re
import shutil
import socket
from pathlib import Path

import pytest
from typer.testing import CliRunner

from memrl.cli import app
from memrl.data.manifest import write_manifest
from memrl.data.records import QuestionRecord, write_jsonl

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
                                 "--run-root", str(tmp_path), "--set", "task.chunk_tokens=-5"])
    assert result.exit_code == 2
    assert "task.chunk_tokens = -5" in result.output


def test_missing_model_path_says_what_to_set(tmp_path):
    result = runner.invoke(app, ["train", "--run-root", str(tmp_path)])
    assert result.exit_code == 2
    assert "model.path" in result.output


def test_make_tiny_model_then_convert_errors_clearly(tmp_path):
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "tiny"), "--layers", "1", "--hidden", "32"])
    assert result.exit_code == 0 and (tmp_path / "tiny" / "config.json").is_file()
    result = runner.invoke(app, ["convert-to-hf", str(tmp_path / "nothing"), str(tmp_path / "out")])
    assert result.exit_code == 2 and "error:" in result.output


# ------------------------------------------------------------------------------------------ expected errors
# Every command: an error the user fixes is one line naming it, exit 2; never a traceback.

TRAIN_SETS = ["task.chunk_tokens=16", "task.memory_tokens=8", "task.final_tokens=8", "sampling.n_samples=2",
              "train.rollout_batch_size=2", "train.num_rollout=1"]


@pytest.fixture(autouse=True)
def _quiet_weight_loading():
    # transformers draws a "Loading weights" bar on stderr, which CliRunner mixes into the output.
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    yield
    hf_logging.enable_progress_bar()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A tiny model folder, one of another architecture, and a prepared data folder with a manifest."""
    from memrl.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("cli")
    model = save_tiny_model(root / "model", layers=1, hidden=32)
    other = save_tiny_model(root / "other", layers=1, hidden=64)
    records = [QuestionRecord(f"q{i}", "What?", ["a"], "word " * 20) for i in range(4)]
    write_jsonl(root / "data" / "hotpotqa_train.jsonl", records)
    write_manifest(root / "data", {"hotpotqa_train.jsonl": len(records)}, "test", {})
    return root, model, other


def one_error_line(result) -> str:
    """The single output line of a refused command (exit 2, no traceback)."""
    lines = result.output.strip().splitlines()
    assert result.exit_code == 2, (result.output, result.exception)
    assert "Traceback" not in result.output and len(lines) == 1, result.output
    assert lines[0].startswith("error: ")
    return lines[0]


def train(root, model, *extra):
    sets = [x for s in [*TRAIN_SETS, f"model.path={model}"] for x in ("--set", s)]
    return runner.invoke(app, ["train", "--run-root", str(root / "run"), "--no-progress", *sets, *extra])


def test_train_missing_data_dir_is_one_line(tiny, tmp_path):
    root, model, _ = tiny
    line = one_error_line(train(tmp_path, model, "--set", f"data.dir={tmp_path / 'nodata'}"))
    assert f"{tmp_path / 'nodata' / 'hotpotqa_train.jsonl'}: file does not exist" in line


def test_train_tampered_data_file_is_one_line(tiny, tmp_path):
    root, model, _ = tiny
    shutil.copytree(root / "data", tmp_path / "data")
    with open(tmp_path / "data" / "hotpotqa_train.jsonl", "a") as f:
        f.write("\n")
    line = one_error_line(train(tmp_path, model, "--set", f"data.dir={tmp_path / 'data'}"))
    assert "hotpotqa_train.jsonl' changed since it was prepared" in line


def test_train_bad_load_is_one_line(tiny, tmp_path):
    root, model, _ = tiny
    line = one_error_line(train(tmp_path, model, "--set", f"data.dir={root / 'data'}", "--load", str(tmp_path / "x")))
    assert f"checkpoint path {tmp_path / 'x'} does not exist" in line


def test_train_missing_model_path_says_it_does_not_exist(tiny, tmp_path):
    root, _, _ = tiny
    line = one_error_line(train(tmp_path, tmp_path / "nomodel", "--set", f"data.dir={root / 'data'}"))
    assert f"model path {tmp_path / 'nomodel'} does not exist" in line and "Repo id" not in line


def test_train_checkpoint_of_another_architecture_names_the_mismatch(tiny, tmp_path):
    root, model, other = tiny
    from transformers import AutoModelForCausalLM

    from memrl.train.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "old", 0, AutoModelForCausalLM.from_pretrained(str(other)), None, None, {})
    line = one_error_line(train(tmp_path, model, "--set", f"data.dir={root / 'data'}", "--load", str(ckpt),
                                "--set", "train.num_rollout=2"))  # a step left after the checkpoint's
    assert "another architecture" in line and "model.embed_tokens.weight" in line and "64) vs" in line


@pytest.mark.parametrize(("extra", "words"), [
    (["--load", "{ckpt}"], "checkpoint {ckpt} is at rollout 1 and train.num_rollout is 1: nothing to train; "
                           "raise train.num_rollout above 1"),
    (["--start-rollout-id", "1"], "--start-rollout-id is 1 and train.num_rollout is 1: nothing to train"),
    (["--start-rollout-id", "-1"], "--start-rollout-id is -1: rollout ids start at 0"),
])
def test_train_with_no_step_to_run_is_one_line_not_a_finished_run(tiny, tmp_path, extra, words):
    # A 0-step run used to end "done" (exit 0) with nothing trained.
    root, model, _ = tiny
    from transformers import AutoModelForCausalLM

    from memrl.train.checkpoint import save_checkpoint

    ckpt = save_checkpoint(tmp_path / "old", 0, AutoModelForCausalLM.from_pretrained(str(model)), None, None, {})
    line = one_error_line(train(tmp_path, model, "--set", f"data.dir={root / 'data'}",
                                *[a.format(ckpt=ckpt) for a in extra]))
    assert words.format(ckpt=ckpt) in line
    assert not (tmp_path / "run").exists()  # refused before anything was written


def refused_url() -> str:
    """A loopback URL nothing listens at (a port just freed): connections to it are refused."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{s.getsockname()[1]}"


@pytest.mark.parametrize("max_staleness", [0, 1])
def test_train_against_a_server_that_refuses_every_connection_is_one_line(tiny, tmp_path, max_staleness):
    # It used to end in a traceback of "QueueError: train_row_count must be > 0, got 0".
    # With the weight-sync check on (the default) its start-up probe is the first request to fail; without
    # it, the step's generations fail, and the loop names them before the queue sees 0 rows.
    root, model, _ = tiny
    url = refused_url()
    args = ["--set", f"data.dir={root / 'data'}", "--set", "engine.kind=openai", "--set",
            f"engine.server_url={url}", "--set", f"train.max_staleness={max_staleness}"]
    line = one_error_line(train(tmp_path / "checked", model, *args))
    assert "scoring the weight-sync probe failed" in line
    assert f"{url}/v1/models" in line and "connection refused" in line
    line = one_error_line(train(tmp_path / "unchecked", model, *args, "--set", "train.sync_check=false"))
    assert "rollout 0: no trajectory to train on: 4 of 4 trajectories failed" in line
    assert f"{url}/v1/models" in line and "connection refused" in line


def test_eval_in_which_every_request_failed_is_one_line_and_keeps_its_results(tiny, tmp_path):
    root, model, _ = tiny
    url, out = refused_url(), tmp_path / "eval"
    line = one_error_line(runner.invoke(app, ["eval", "--server-url", url, "--tokenizer", str(model), "--data",
                                              str(root / "data" / "hotpotqa_train.jsonl"), "--out", str(out),
                                              "--no-progress"]))
    assert "all 4 questions failed" in line and f"{url}/v1/models" in line and "connection refused" in line
    from memrl.eval.results import RESULTS_FILE, SUMMARY_FILE, read_results

    assert [r["status"] for r in read_results(out / RESULTS_FILE)] == ["failed"] * 4  # kept for --retry-failed
    assert json.loads((out / SUMMARY_FILE).read_text())["failed"] == 4


@pytest.mark.parametrize(("args", "words"), [
    (["sft", "--model", "{tmp}/nomodel", "--data", "{data}", "--out", "{tmp}/o"], "model path {tmp}/nomodel does not"),
    (["sft", "--model", "{model}", "--data", "{tmp}/none.jsonl", "--out", "{tmp}/o"], "none.jsonl does not exist"),
    (["eval", "--model", "{tmp}/nomodel", "--data", "{data}", "--out", "{tmp}/o"], "model path {tmp}/nomodel does not"),
    (["eval", "--server-url", "http://127.0.0.1:1", "--tokenizer", "{tmp}/notok", "--data", "{data}", "--out",
      "{tmp}/o"], "tokenizer path {tmp}/notok does not exist"),
    (["compare", "{tmp}", "{tmp}", "--max-abs-diff", "bogus"], "write METRIC=POINTS"),
    (["pass-at-k", "--model", "{model}", "--data", "{tmp}/none.jsonl", "--out", "{tmp}/c.json"], "does not exist"),
    (["prepare-data", "hotpotqa", "--from-file", "{tmp}/none.json", "--out", "{tmp}/d"], "none.json: file does not"),
    (["convert-to-hf", "{tmp}/nothing", "{tmp}/out"], "checkpoint path {tmp}/nothing does not exist"),
    (["report", "{tmp}"], "no metrics at"),
    (["serve", "--model", "{tmp}/nomodel"], "model path {tmp}/nomodel does not exist"),
    (["make-tiny-model", "{tmp}/t", "--tokenizer", "{tmp}/notok"], "tokenizer folder {tmp}/notok does not exist"),
    (["demo", "--run-root", "{root}"], "is not empty"),
])
def test_every_command_refuses_in_one_line(tiny, tmp_path, args, words):
    root, model, _ = tiny
    fill = {"tmp": tmp_path, "root": root, "model": model, "data": root / "data" / "hotpotqa_train.jsonl"}
    line = one_error_line(runner.invoke(app, [a.format(**fill) for a in args]))
    assert words.format(**fill) in line


@pytest.mark.parametrize(("path", "local"), [
    ("Qwen/Qwen3-0.6B", False), ("gpt2", False), ("/no/such/model", True), ("./model", True), ("~/model", True),
    ("runs/a/model", True), ("my model", True),
])
def test_a_missing_local_looking_path_is_named_and_a_hub_id_is_left_to_the_hub(path, local):
    from memrl.config import ConfigError, check_model_path

    if local:
        with pytest.raises(ConfigError, match=f"^model path {re.escape(path)} does not exist"):
            check_model_path(path)
    else:
        check_model_path(path)


def test_an_unexpected_error_keeps_its_traceback(monkeypatch, tmp_path):
    # Only the named errors are a user's to fix; anything else is a bug and must stay visible.
    from memrl.train import report

    def broken(run_root):
        raise KeyError("bug")

    monkeypatch.setattr(report, "write_report", broken)
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 1 and isinstance(result.exception, KeyError)
