"""Inputs a user gets wrong, met at the command line: each is one line naming it, exit 2, no traceback.

(Issue 24, items 19-21 and 24: a seed past 64 bits, an edited manifest, an output folder that is a file,
a damaged replay file, a non-finite --lr or --max-abs-diff, a recipe that is not UTF-8 or repeats a key,
a make-tiny-model into a folder that holds a model.)
"""

from __future__ import annotations

import json
import shutil

import pytest

# The CLI tests' runner and settings, and their fixtures (imported, so that pytest finds them here: `tiny`, a
# tiny model and a prepared data folder, and the quiet weight loading; pyproject lets tests take them, F811).
from test_cli import TRAIN_SETS, _quiet_weight_loading, one_error_line, runner, tiny  # noqa: F401

from memrl.cli import app
from memrl.data.manifest import MANIFEST_NAME


def train(run_root, model, data, *extra):
    sets = [x for s in [*TRAIN_SETS, f"model.path={model}", f"data.dir={data}"] for x in ("--set", s)]
    return runner.invoke(app, ["train", "--run-root", str(run_root), "--no-progress", *sets, *extra])


# ------------------------------------------------------------------------------------------ item 19

def test_a_seed_past_64_bits_is_named(tiny, tmp_path):
    root, model, _ = tiny
    line = one_error_line(train(tmp_path / "run", model, root / "data", "--set", f"train.seed={2**64}"))
    assert f"train.seed = {2**64}" in line


@pytest.mark.parametrize(("edit", "words"), [
    (lambda m: m["files"].update({"hotpotqa_train.jsonl": 5}), "malformed entry for 'hotpotqa_train.jsonl'"),
    (lambda m: m.update(history=5), "'history' that is not a list"),
])
def test_an_edited_manifest_is_named(tiny, tmp_path, edit, words):
    root, model, _ = tiny
    shutil.copytree(root / "data", tmp_path / "data")
    manifest = json.loads((tmp_path / "data" / MANIFEST_NAME).read_text())
    edit(manifest)
    (tmp_path / "data" / MANIFEST_NAME).write_text(json.dumps(manifest))
    line = one_error_line(train(tmp_path / "run", model, tmp_path / "data"))
    assert words in line and MANIFEST_NAME in line


@pytest.mark.parametrize("args", [
    ["prepare-data", "synthetic", "--out", "{out}"],
    ["prepare-data", "hotpotqa", "--from-file", "{tmp}/none.json", "--out", "{out}"],
    ["prepare-data", "ruler-hqa", "--from-dir", "{tmp}", "--out", "{out}"],
    ["prepare-data", "build-ruler", "--from-file", "{tmp}/none.json", "--out", "{out}"],
    ["compare", "{tmp}", "{tmp}", "--out", "{out}"],
    ["sft", "--model", "{model}", "--data", "{file}", "--out", "{out}"],
    ["make-tiny-model", "{out}"],
    ["train", "--run-root", "{out}", "--set", "model.path={model}"],
    ["demo", "--run-root", "{out}"],
    ["demo-long", "--run-root", "{out}"],
    ["demo-consistency", "--run-root", "{out}"],
])
@pytest.mark.parametrize(("out", "words"), [
    ("{file}", "{file} is a file"),
    ("{file}/sub", "{file}/sub is under {file}, which is a file"),
])
def test_an_output_folder_that_is_a_file_is_refused_before_any_work(tiny, tmp_path, args, out, words):
    _, model, _ = tiny
    file = tmp_path / "taken"
    file.write_text("not a folder\n")
    fill = {"tmp": tmp_path, "model": model, "file": file}
    fill["out"] = out.format(**fill)
    line = one_error_line(runner.invoke(app, [a.format(**fill) for a in args]))
    assert words.format(**fill) in line and "pass a new or existing folder" in line
    assert file.read_text() == "not a folder\n"


HEADER = json.dumps({"rollout_id": 0, "train_row_count": 2, "metrics": {}})


@pytest.mark.parametrize(("text", "words"), [
    ("", "rollout_0000000.jsonl is empty"),
    (HEADER + '\n{"trajectory_id": "r0:0:q0:s0", "group_', "line 2 is not valid JSON"),  # cut mid-line
    (HEADER[:40], "line 1 is not valid JSON"),
    ('[1, 2]\n', "line 1 is not a rollout header"),
    (HEADER + '\n{"trajectory_id": "r0:0:q0:s0"}\n', "line 2 is not a saved trajectory"),
])
def test_a_damaged_replay_file_is_named(tiny, tmp_path, text, words):
    root, model, _ = tiny
    (tmp_path / "replay").mkdir()
    (tmp_path / "replay" / "rollout_0000000.jsonl").write_text(text)
    line = one_error_line(train(tmp_path / "run", model, root / "data", "--replay-rollouts", str(tmp_path / "replay")))
    assert line.startswith("error: replay: ") and words in line


@pytest.mark.parametrize("lr", ["nan", "inf", "-1", "0"])
def test_sft_refuses_a_learning_rate_that_cannot_train(tiny, tmp_path, lr):
    _, model, _ = tiny
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps({"turns": [{"prompt": "Q", "response": "A"}]}) + "\n")
    line = one_error_line(runner.invoke(app, ["sft", "--model", str(model), "--data", str(data),
                                              "--out", str(tmp_path / "o"), "--lr", lr]))
    assert f"SFT option lr = {float(lr)!r}: Input should be" in line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("command", [["config"], ["train", "--run-root", "{tmp}/run"]])
def test_a_recipe_that_is_not_utf8_is_named(tmp_path, command):
    recipe = tmp_path / "latin1.yaml"
    recipe.write_bytes("train:\n  lr: 1.0e-3  # café\n".encode("latin-1"))
    line = one_error_line(runner.invoke(app, [*(a.format(tmp=tmp_path) for a in command), "--recipe", str(recipe)]))
    assert f"recipe '{recipe}' is not UTF-8 text" in line and "save it as UTF-8" in line


# ------------------------------------------------------------------------------------------ item 20

@pytest.mark.parametrize("command", [["config"], ["train", "--run-root", "{tmp}/run"]])
def test_a_recipe_with_a_second_train_block_is_refused(tmp_path, command):
    recipe = tmp_path / "twice.yaml"
    recipe.write_text("train:\n  lr: 1.0e-3\nsampling:\n  seed: 1\ntrain:\n  seed: 3\n")
    line = one_error_line(runner.invoke(app, [*(a.format(tmp=tmp_path) for a in command), "--recipe", str(recipe)]))
    assert "duplicate key 'train' on lines 1 and 5" in line


# ------------------------------------------------------------------------------------------ item 21

@pytest.mark.parametrize("limit", ["nan", "inf", "-inf", "-1"])
def test_compare_refuses_a_limit_that_cannot_be_checked(tmp_path, limit):
    line = one_error_line(runner.invoke(app, ["compare", str(tmp_path), str(tmp_path),
                                              "--max-abs-diff", f"sub_em={limit}"]))
    assert f"'sub_em={limit}': the limit must be a finite number >= 0" in line


# ------------------------------------------------------------------------------------------ item 24

def test_make_tiny_model_refuses_a_folder_with_a_model_unless_told_to_overwrite(tmp_path):
    out = tmp_path / "tiny"
    out.mkdir()
    (out / "config.json").write_text('{"mine": true}\n')
    line = one_error_line(runner.invoke(app, ["make-tiny-model", str(out), "--layers", "1", "--hidden", "32"]))
    assert f"{out} is not empty" in line and "--overwrite" in line
    assert (out / "config.json").read_text() == '{"mine": true}\n' and len(list(out.iterdir())) == 1
    result = runner.invoke(app, ["make-tiny-model", str(out), "--layers", "1", "--hidden", "32", "--overwrite"])
    assert result.exit_code == 0, result.output
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 1


def test_make_tiny_model_writes_into_an_empty_folder(tmp_path):
    (tmp_path / "empty").mkdir()
    result = runner.invoke(app, ["make-tiny-model", str(tmp_path / "empty"), "--layers", "1", "--hidden", "32"])
    assert result.exit_code == 0, result.output
    assert (tmp_path / "empty" / "model.safetensors").is_file()
