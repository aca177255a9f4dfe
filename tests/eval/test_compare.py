"""`memrl compare` (memrl.eval.compare): every refusal, tables, flips, thresholds, report files, exit codes.

Result folders are real `memrl eval` outputs made with the scripted AnswerEngine of test_runner.py,
so which questions each "model" gets right is known.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from test_runner import AnswerEngine, make_records, run_eval, small_config  # noqa: E402
from typer.testing import CliRunner

from memrl.eval.compare import CompareError, compare_results, parse_pairs, parse_thresholds
from memrl.eval.results import RESULTS_FILE, SUMMARY_FILE

BASE_RIGHT = {0, 1, 2, 3}  # EM 25 %
OURS_RIGHT = {2, 3, 4, 5, 6, 7}  # EM 37.5 %: q4..q7 wrong->right, q0, q1 right->wrong


@pytest.fixture(scope="module")
def results(tiny_tokenizer, tmp_path_factory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("compare")
    folders = {"base": BASE_RIGHT, "ours": OURS_RIGHT, "same": BASE_RIGHT}
    out = {}
    for name, right in folders.items():
        out[name] = root / name
        run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer, correct=right), out[name])
    return out


def copy_result(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_summary(folder: Path, **changes) -> None:
    path = folder / SUMMARY_FILE
    summary = json.loads(path.read_text())
    for key, value in changes.items():
        section, _, field = key.partition("__")
        if field:
            summary[section][field] = value
        else:
            summary[section] = value
    path.write_text(json.dumps(summary))


def cli(*args: str):
    from memrl.cli import app  # the real app: its handler makes expected errors one line, exit 2

    return CliRunner().invoke(app, ["compare", *args])


# ------------------------------------------------------------------------------------------ comparisons

def test_metrics_flips_and_thresholds(results, tmp_path):
    report = compare_results([results["base"], results["ours"]], ["base", "ours"],
                             {"em": 12.0, "sub_em": 13.0}, [("base", "ours")])
    (pair,) = report.pairs
    assert pair.diffs["em"] == pytest.approx(12.5)
    assert pair.wrong_to_right == ["q4", "q5", "q6", "q7"] and pair.right_to_wrong == ["q0", "q1"]
    assert pair.both_right == 2 and pair.both_wrong == 8
    assert [(c.metric, c.passed) for c in report.checks] == [("em", False), ("sub_em", True)]
    assert not report.passed
    by_name = {r.name: r for r in report.results}
    assert by_name["ours"].stats["metrics"]["em"]["value"] == pytest.approx(37.5)
    paths = report.write(tmp_path / "cmp")
    md = (tmp_path / "cmp" / "report.md").read_text()
    assert "q4, q5, q6, q7" in md and "| base |" in md and "FAIL" in md
    assert (tmp_path / "cmp" / "comparison.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert json.loads((tmp_path / "cmp" / "comparison.json").read_text())["passed"] is False
    assert len(paths) == 3


def test_a_result_compared_with_itself_passes(results, tmp_path):
    result = cli(str(results["base"]), str(results["base"]), "--max-abs-diff", "sub_em=0", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output
    assert "0 wrong->right, 0 right->wrong" in result.output and (tmp_path / "report.md").is_file()


def test_cli_exit_codes_pass_fail_refuse(results, tmp_path):
    args = [str(results["base"]), str(results["ours"]), "--name", "base", "--name", "ours", "--pair", "base,ours",
            "--out", str(tmp_path)]
    assert cli(*args, "--max-abs-diff", "em=13").exit_code == 0
    failed = cli(*args, "--max-abs-diff", "em=3")
    assert failed.exit_code == 1 and "threshold failed: em base,ours: 12.50 > 3 pp" in failed.output
    other = copy_result(results["ours"], tmp_path / "other")
    edit_summary(other, data__sha256="f" * 64)
    refused = cli(str(results["base"]), str(other), "--out", str(tmp_path))
    assert refused.exit_code == 2 and "data SHA-256 differs" in refused.output and "f" * 64 in refused.output


def test_thresholds_apply_to_the_named_pair_and_flips_to_every_pair(results, tmp_path):
    dirs = [str(results[n]) for n in ("base", "ours", "same")]
    result = cli(*dirs, "--pair", "same,base", "--max-abs-diff", "sub_em=0", "--out", str(tmp_path))
    assert result.exit_code == 0, result.output  # base vs ours differ by 12.5 pp, but only same,base is checked
    report = compare_results([Path(d) for d in dirs], pairs=[("same", "base")], max_abs_diff={"em": 0})
    assert [(p.a, p.b) for p in report.pairs] == [("same", "base"), ("base", "ours"), ("ours", "same")]
    assert [(c.a, c.b) for c in report.checks] == [("same", "base")] and report.passed
    assert "## base vs ours" in result.output and "## same vs base" in result.output


def test_default_pairs_are_all_pairs_in_order(results):
    report = compare_results([results["base"], results["ours"], results["same"]])
    assert [(p.a, p.b) for p in report.pairs] == [("base", "ours"), ("base", "same"), ("ours", "same")]
    assert report.pairs[1].wrong_to_right == report.pairs[1].right_to_wrong == []


# ------------------------------------------------------------------------------------------ refusals

def test_refuses_different_data_naming_both_shas(results, tmp_path):
    other = copy_result(results["ours"], tmp_path / "other")
    edit_summary(other, data__sha256="0" * 64)
    a_sha = json.loads((results["base"] / SUMMARY_FILE).read_text())["data"]["sha256"]
    with pytest.raises(CompareError, match="data SHA-256 differs") as err:
        compare_results([results["base"], other])
    assert f"base={a_sha}" in str(err.value) and f"other={'0' * 64}" in str(err.value)


def test_refuses_different_format_naming_each_key_and_both_values(tiny_tokenizer, results, tmp_path):
    cfg = small_config(sampling={"temperature": 0.7}, chunk_tokens=48)
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path / "long", cfg=cfg)
    with pytest.raises(CompareError) as err:
        compare_results([results["base"], tmp_path / "long"])
    message = str(err.value)
    assert "format.chunk_tokens differs: base=32, long=48" in message
    assert "format.temperature differs: base=0.0, long=0.7" in message
    report = compare_results([results["base"], tmp_path / "long"], allow_diff=["chunk_tokens", "temperature"])
    assert report.allowed_diffs["chunk_tokens"] == {"base": 32, "long": 48}
    assert "--allow-diff" in report.to_text()


def test_refuses_failed_requests(tiny_tokenizer, results, tmp_path):
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer, fail={3, 11}), tmp_path / "flaky")
    with pytest.raises(CompareError, match=r"2 failed requests \(ids q3, q11\).*--retry-failed"):
        compare_results([results["base"], tmp_path / "flaky"])


def test_refuses_empty_results(tiny_tokenizer, tmp_path):
    summary = run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path / "empty", records=[])
    assert summary["total"] == 0 and (tmp_path / "empty" / RESULTS_FILE).read_text() == ""
    with pytest.raises(CompareError, match="empty results"):
        compare_results([tmp_path / "empty"])


def test_refuses_different_question_sets(tiny_tokenizer, results, tmp_path):
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path / "fewer", records=make_records(12))
    with pytest.raises(CompareError, match=r"question ids differ: 4 only in base .*'q12'.*0 only in fewer"):
        compare_results([results["base"], tmp_path / "fewer"])


def test_refuses_unfinished_or_inconsistent_runs(results, tmp_path):
    unfinished = copy_result(results["ours"], tmp_path / "unfinished")
    (unfinished / SUMMARY_FILE).unlink()
    with pytest.raises(CompareError, match="no summary.json"):
        compare_results([results["base"], unfinished])
    short = copy_result(results["ours"], tmp_path / "short")
    lines = (short / RESULTS_FILE).read_text().splitlines(keepends=True)
    (short / RESULTS_FILE).write_text("".join(lines[:-1]))
    with pytest.raises(CompareError, match="holds 15 questions but summary.json counts 16"):
        compare_results([results["base"], short])
    doubled = copy_result(results["ours"], tmp_path / "doubled")
    (doubled / RESULTS_FILE).write_text("".join(lines + lines[:1]))
    with pytest.raises(CompareError, match="appears twice"):
        compare_results([results["base"], doubled])
    with pytest.raises(CompareError, match="no summary.json"):
        compare_results([tmp_path / "does-not-exist"])


def test_every_problem_is_named_at_once(tiny_tokenizer, results, tmp_path):
    other = tmp_path / "other"
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), other, cfg=small_config(max_chunks=2), sha="sha-b")
    with pytest.raises(CompareError) as err:
        compare_results([results["base"], other])
    assert "data SHA-256 differs" in str(err.value) and "format.max_chunks differs" in str(err.value)


@pytest.mark.parametrize("call, words", [
    (lambda r: compare_results([r["base"], r["ours"]], pairs=[("base", "nobody")]), "no result named nobody"),
    (lambda r: compare_results([r["base"], r["ours"]], max_abs_diff={"accuracy": 3}), "unknown metric"),
    (lambda r: compare_results([r["base"], r["ours"]], names=["only-one"]), "1 names for 2"),
    (lambda r: compare_results([r["base"], r["ours"]], names=["x", "x"]), "distinct"),
    (lambda r: compare_results([r["base"]], max_abs_diff={"em": 3}), "needs two result folders"),
    (lambda r: parse_thresholds(["sub_em:3"]), "METRIC=POINTS"),
    (lambda r: parse_thresholds(["sub_em=-1"]), ">= 0"),
    (lambda r: parse_thresholds(["sub_em=nan"]), "finite number >= 0"),  # nan failed every check
    (lambda r: parse_thresholds(["em=inf"]), "finite number >= 0"),  # inf passed every check
    (lambda r: parse_pairs(["a;b"]), "NAME_A,NAME_B"),
])
def test_usage_errors_say_what_to_write(results, call, words):
    with pytest.raises(CompareError, match=words):
        call(results)


def test_threshold_parsing():
    assert parse_thresholds(["sub_em=3", "EM=2.5"]) == {"sub_em": 3.0, "em": 2.5}
    assert parse_pairs(["relax, vime"]) == [("relax", "vime")]
