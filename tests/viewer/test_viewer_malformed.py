"""`memrl view` on files memrl wrote and then broke: every malformed input is one line, exit 2 (ViewerError),
never a traceback; and memrl's own files with line-separator characters in their text open."""

from __future__ import annotations

import json
import re
import shutil

import pytest
from typer.testing import CliRunner
from viewer_fixtures import eval_pair, train_run

from memrl.cli import app
from memrl.eval.results import RESULTS_FILE
from memrl.viewer.build import ViewerError, view_data


@pytest.fixture(scope="module")
def evals(tiny_tokenizer, tmp_path_factory):
    return eval_pair(tiny_tokenizer, tmp_path_factory.mktemp("evals"))


@pytest.fixture(scope="module")
def run_root(tiny_tokenizer, tmp_path_factory):
    # U+2028 / U+2029 / U+0085 are line breaks to str.splitlines but not to JSON lines: memrl writes them as
    # they are (ensure_ascii=False), inside a record.
    return train_run(tiny_tokenizer, tmp_path_factory.mktemp("train"), question="What is\u2028fact0\u2029?\x85")


def test_a_rollout_log_with_line_separators_in_its_text_opens(run_root):
    log = next((run_root / "logs" / "rollouts").glob("rollout_*.jsonl"))
    assert "\u2028" in log.read_text(encoding="utf-8")  # written unescaped: the case that broke
    data = view_data(run_root)
    assert len(data["items"]) == 8 and {it["q"] for it in data["items"]} == {"What is\u2028fact0\u2029?\x85"}


def edit_line(mutate):
    """A change of one parsed line (record 1 of the file), written back as JSON."""
    def apply(lines: list[str]) -> list[str]:
        record = json.loads(lines[1])
        mutate(record)
        return [lines[0], json.dumps(record, ensure_ascii=False), *lines[2:]]
    return apply


def replace_line(text: str):
    return lambda lines: [lines[0], text, *lines[2:]]


def sub_line(pattern: str, text: str):
    """The second line's JSON text with `pattern` (a regex) replaced: values json.dumps never writes."""
    return lambda lines: [lines[0], re.sub(pattern, text, lines[1], count=1), *lines[2:]]


def set_field(name, value):
    return edit_line(lambda r: r.__setitem__(name, value))


def set_turn_field(key, name, value):
    return edit_line(lambda r: r[key][0].__setitem__(name, value))


# (name, eval (results.jsonl) or train (a rollout log), change of its lines, text the message must hold)
MALFORMED = [
    ("em NaN", "eval", sub_line(r'"em": [0-9.]+', '"em": NaN'), "NaN is not a JSON number"),
    ("f1 -Infinity", "eval", sub_line(r'"f1": [0-9.]+', '"f1": -Infinity'), "-Infinity is not a JSON number"),
    ("f1 1e999", "eval", sub_line(r'"f1": [0-9.]+', '"f1": 1e999'), "'f1' is inf, expected a finite number"),
    ("not JSON", "eval", replace_line('{"id": "q1", "em": '), "line 2 is not a JSON record"),
    ("a list, not an object", "eval", replace_line("[1, 2]"), "line 2 is list, not an object"),
    ("a string, not an object", "eval", replace_line('"text"'), "line 2 is str, not an object"),
    ("no id", "eval", edit_line(lambda r: r.pop("id")), "line 2 has no 'id'"),
    ("id a list", "eval", set_field("id", ["q1"]), "'id' is ['q1'], expected a string"),
    ("golds a string", "eval", set_field("golds", "alpha1"), "'golds' is 'alpha1', expected a list of strings"),
    ("trace of strings", "eval", set_field("trace", ["memory"]), "turn 0 is str, not an object"),
    ("turn text a number", "eval", set_turn_field("trace", "text", 5), "turn 0: 'text' is 5, expected a string"),
    ("memory truncations text", "eval", set_field("memory_truncations", "2"), "'memory_truncations' is '2'"),
    ("chunk gold of the wrong shape", "eval", set_field("chunk_golds", [[["x"]]]), "chunk_golds[0] is [['x']]"),
    ("chunk gold of no gold", "eval", set_field("chunk_golds", [[[7, 1, "abc", 0, 1]]]), "chunk_golds[0] is"),
    ("not UTF-8", "eval", replace_line('{"id": "\udcff"}'), "UnicodeDecodeError"),  # the byte 0xff
    ("nested too deep", "eval", replace_line("[" * 100_000), "line 2 is not a JSON record"),
    ("rollout record a number", "train", replace_line("5"), "line 2 is int, not an object"),
    ("rollout record without its id", "train", edit_line(lambda r: r.pop("trajectory_id")), "has no 'trajectory_id'"),
    ("rollout turns an object", "train", set_field("turns", {"kind": "memory"}), "'turns' is {'kind': 'memory'}"),
    ("rollout reward text", "train", set_field("reward", "1"), "'reward' is '1', expected a finite number"),
]


def broken_copy(source, kind, change, tmp_path):
    """A copy of an eval folder or a run root with one file's lines changed; the path to view."""
    root = tmp_path / "broken"
    shutil.copytree(source, root)
    file = root / RESULTS_FILE if kind == "eval" else next((root / "logs" / "rollouts").glob("rollout_*.jsonl"))
    lines = file.read_text(encoding="utf-8").split("\n")[:-1]
    file.write_bytes(("\n".join(change(lines)) + "\n").encode("utf-8", "surrogateescape"))
    return root


@pytest.mark.parametrize("kind, change, message", [m[1:] for m in MALFORMED], ids=[m[0] for m in MALFORMED])
def test_malformed_records_are_one_line_errors_with_exit_2(evals, run_root, tmp_path, kind, change, message):
    path = broken_copy(evals[0] if kind == "eval" else run_root, kind, change, tmp_path)
    with pytest.raises(ViewerError) as info:
        view_data(path)
    assert message in str(info.value) and "\n" not in str(info.value)
    result = CliRunner().invoke(app, ["view", str(path)])
    assert result.exit_code == 2 and result.output.startswith("error: ") and message in result.output
    assert len(result.output.strip().splitlines()) == 1 and "Traceback" not in result.output


@pytest.mark.parametrize("file, text, message", [
    ("config.yaml", "rollout: [unclosed", "is not a YAML config memrl wrote"),
    ("config.yaml", "task:\n  answer_extractor: guess\n", "task.answer_extractor is 'guess'"),
    ("logs/metrics.jsonl", '{"rollout_id": 0}\nnot json\n{"rollout_id": 1}\n', "metrics.jsonl cannot be read"),
    ("logs/metrics.jsonl", '{"reward/mean": 0.5}\n\n', "metrics.jsonl cannot be read"),
])
def test_a_run_roots_other_files_malformed_are_one_line_errors(run_root, tmp_path, file, text, message):
    root = tmp_path / "run"
    shutil.copytree(run_root, root)
    (root / file).write_text(text, encoding="utf-8")
    with pytest.raises(ViewerError, match=message):
        view_data(root)


def test_a_non_finite_step_reward_and_a_broken_summary_still_open(evals, run_root, tmp_path):
    root = tmp_path / "run"
    shutil.copytree(run_root, root)
    (root / "logs" / "metrics.jsonl").write_text('{"rollout_id": 0, "reward/mean": NaN}\n', encoding="utf-8")
    assert view_data(root)["steps"][0]["reward"] is None  # shown as missing; the page's JSON has no NaN
    folder = tmp_path / "eval"
    shutil.copytree(evals[0], folder)
    (folder / "summary.json").write_text("[1, 2]", encoding="utf-8")  # only names the run in the title
    assert view_data(folder)["runs"] == ["eval"]


CODE_A_FOLDER_NAMES = ["os:abort", "builtins:input", "pdb:set_trace", "no_such_package.task:Task"]


def named_task(source, tmp_path, spec):
    """A copy of an eval folder (summary.json) or a run root (config.yaml) naming `spec` as its task."""
    folder = tmp_path / source.name
    shutil.copytree(source, folder)
    if (folder / "summary.json").is_file():
        summary = json.loads((folder / "summary.json").read_text(encoding="utf-8"))
        summary["config"]["plugins"]["task"] = spec
        (folder / "summary.json").write_text(json.dumps(summary), encoding="utf-8")
    else:
        (folder / "config.yaml").write_text(f"plugins:\n  task: '{spec}'\n", encoding="utf-8")
    return folder


@pytest.mark.parametrize("spec", CODE_A_FOLDER_NAMES)
@pytest.mark.parametrize("kind", ["eval", "run"])
def test_a_viewed_folder_never_chooses_code_to_run(evals, run_root, tmp_path, monkeypatch, kind, spec):
    """What a folder names as its task is compared with memrl's own tasks, never imported or called: the page
    shows the text only, with a note saying how to show the task's fields."""
    import builtins
    import os
    import pdb

    def called(*args, **kwargs):
        raise AssertionError("memrl view called code a viewed folder named")

    for module, name in ((os, "abort"), (builtins, "input"), (pdb, "set_trace")):
        monkeypatch.setattr(module, name, called)
    folder = named_task(evals[0] if kind == "eval" else run_root, tmp_path, spec)
    data = view_data(folder)
    assert not {"nc", "mt", "cg"} & {key for item in data["items"] for r in item["r"] for key in r}
    assert f"names the task '{spec}', which memrl does not ship" in data["warning"]
    result = CliRunner().invoke(app, ["view", str(folder)])
    assert result.exit_code == 0 and f"pass --task {spec} to show them" in result.output


def test_a_task_the_user_names_or_memrl_ships_shows_its_fields(evals, tmp_path):
    folder = named_task(evals[0], tmp_path, "somebody.elses:Task")
    shown = view_data(folder, task="memrl.memagent.task:MemAgentTask")
    assert shown["warning"] is None and all("nc" in r for item in shown["items"] for r in item["r"])
    shipped = named_task(evals[0], tmp_path / "shipped", "memrl.memagent.task.MemAgentTask")  # either spelling
    assert view_data(shipped)["warning"] is None
    result = CliRunner().invoke(app, ["view", str(folder), "--task", "os:abort"])
    assert result.exit_code == 2 and "--task = 'os:abort' is a builtin_function_or_method" in result.output


def test_rollout_records_are_scored_as_the_run_reads_answers(run_root, tmp_path):
    """The page scores rollout records with the run's task.answer_after_think, as its reward did."""
    def boxed_in_think(record):
        record.update(answer=f"<think>\\boxed{{{record['golds'][0]}}}</think>\nI am not sure.", status="complete")

    root = broken_copy(run_root, "train", edit_line(boxed_in_think), tmp_path)
    config = root / "config.yaml"
    scores = []
    for on in (False, True):
        config.write_text(f"task:\n  answer_after_think: {str(on).lower()}\n", encoding="utf-8")
        (item,) = [it for it in view_data(root)["items"] if "</think>" in it["r"][0]["a"]]
        scores.append(item["r"][0]["em"])
    assert scores == [1.0, 0.0]
    config.write_text("task:\n  answer_after_think: 2\n", encoding="utf-8")
    with pytest.raises(ViewerError, match="task.answer_after_think is 2, expected true or false"):
        view_data(root)
