"""`memrl demo-long`: the length evaluation (base vs trained at every document length), its table and plot,
and the command's errors. The full run (training included) is measured in docs/demo.md."""

from __future__ import annotations

import json

import pytest

from memrl.apps.demo_long import LongDemoSettings, evaluate_lengths, format_table, plot_lengths, target_met


@pytest.fixture(scope="module")
def two_models():
    from memrl.data.synthetic import task_tokenizer
    from memrl.tiny import build_tiny_model

    tok = task_tokenizer()
    return {name: (build_tiny_model(len(tok), seed=seed, eos_token_id=tok.eos_token_id), tok)
            for name, seed in (("base", 0), ("trained", 1))}


def test_every_length_is_evaluated_for_both_models_on_documents_of_that_length(tmp_path, two_models):
    settings = LongDemoSettings(lengths=(8, 1), questions_per_length=5)
    rows = evaluate_lengths(two_models, settings, tmp_path, progress=False)
    assert [r["length"] for r in rows] == [1, 8]
    for row in rows:
        length = row["length"]
        assert row["document_tokens"] == 21 * length
        for name in ("base", "trained"):
            summary = json.loads((tmp_path / f"len{length}" / name / "summary.json").read_text())
            lines = [json.loads(x)
                     for x in (tmp_path / f"len{length}" / name / "results.jsonl").read_text().splitlines()]
            assert summary["total"] == 5 and row[name]["em"] == summary["metrics"]["em"]["value"]
            # Every document read whole (max_chunks = the longest length): L memory turns + the final one.
            assert all(x["num_chunks"] == length and not x["document_truncated"] and x["turns"] == length + 1
                       for x in lines)
            assert row[name]["memory_max_tokens"] <= summary["config"]["task"]["memory_tokens"]
        # One recipe for all lengths: the result folders share one format (compare would refuse otherwise).
        assert summary["config"]["task"]["max_chunks"] == 8
        assert row["wrong_to_right"] + row["right_to_wrong"] <= 5 and 0.0 <= row["mcnemar_p"] <= 1.0
        assert (tmp_path / f"len{length}" / "compare" / "report.md").is_file()
        assert (tmp_path / "data" / f"length_{length}.jsonl").is_file()
        assert set(row["first_match"]) == {"base", "trained"}
    table = format_table(rows)
    assert table.count("\n") == 3 and "| 8 | 168 |" in table
    assert plot_lengths(rows, ["base", "trained"], tmp_path / "em.png").stat().st_size > 0


def test_the_target_is_trained_above_base_at_every_length_of_8_chunks_or_more():
    def row(length, diff):
        return {"length": length, "diff_pp": diff}

    assert target_met([row(1, -5.0), row(8, 0.5), row(64, 3.0)])  # short lengths do not count
    assert not target_met([row(8, 4.0), row(64, 0.0)])
    assert not target_met([row(1, 9.0), row(3, 9.0)])  # no long length evaluated: not shown


def test_demo_long_errors_are_one_line_before_any_training(tmp_path):
    from typer.testing import CliRunner

    from memrl.cli import app

    (tmp_path / "old.txt").write_text("x")
    result = CliRunner().invoke(app, ["demo-long", "--quick", "--run-root", str(tmp_path)])
    assert result.exit_code == 2 and "not empty" in result.output and "Traceback" not in result.output
    for args, needle in ((["--set", "train.lr=-1"], "train.lr"), (["--length", "0"], "--lengths"),
                         (["--questions", "0"], "--questions")):
        result = CliRunner().invoke(app, ["demo-long", "--run-root", str(tmp_path / "new"), *args])
        assert result.exit_code == 2 and needle in result.output, result.output
        assert not (tmp_path / "new").exists()


def test_first_match_rates_spot_a_reader_that_keeps_the_first_attribute_match():
    from memrl.apps.demo_long import first_match_rates
    from memrl.data.synthetic import make_length_set

    records = make_length_set(60, 8, seed=0)
    firsts = [next(f for f in r.metadata["facts"] if f[0] == r.metadata["attribute"]) for r in records]
    lines = {r.id: {"boxed": f" {first[2]} "} for r, first in zip(records, firsts, strict=True)}
    rates = first_match_rates(records, lines)
    assert rates["answers_first_match_pct"] == 100.0
    expected = 100 * sum(first[1] == r.metadata["entity"] for r, first in zip(records, firsts, strict=True)) / 60
    assert rates["first_match_is_answer_pct"] == expected and 0 < expected < 100
    # A reader that always answers right matches the first fact only where that fact is the answer.
    right = first_match_rates(records, {r.id: {"boxed": r.answers[0]} for r in records})
    assert right["answers_first_match_pct"] == expected


def test_demo_long_trains_on_padded_documents_unless_told_otherwise():
    from dataclasses import replace

    from memrl.apps.demo import FULL, QUICK
    from memrl.apps.demo_long import long_settings

    padded = long_settings()
    assert padded.train == replace(FULL, filler=True, max_chunks=4, eval_interval=0) and padded.lengths[-1] == 64
    assert long_settings(filler=False).train == FULL  # exactly memrl demo's training
    quick = long_settings(quick=True, filler=False, overrides=["train.lr=1e-4"], lengths=[8], questions_per_length=7)
    assert quick.train == replace(QUICK, overrides=("train.lr=1e-4",)) and quick.lengths == (8,)
    assert quick.questions_per_length == 7
