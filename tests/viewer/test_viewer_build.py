"""memrl.viewer.build and the record fields it reads: gold positions, turn traces, advantages, safe embedding,
old files, errors. The page itself is checked in a real browser by test_viewer_browser.py."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner
from viewer_fixtures import INJECTED, eval_pair, train_run

from memrl.eval.results import RESULTS_FILE, read_results
from memrl.scoring import gold_spans, normalize_answer
from memrl.viewer.build import ViewerError, embed_json, render_html, view_data, write_viewer


@pytest.fixture(scope="module")
def evals(tiny_tokenizer, tmp_path_factory):
    return eval_pair(tiny_tokenizer, tmp_path_factory.mktemp("evals"))


@pytest.fixture(scope="module")
def run_root(tiny_tokenizer, tmp_path_factory):
    return train_run(tiny_tokenizer, tmp_path_factory.mktemp("train"))


def test_gold_spans_are_whole_normalized_words():
    text = "The capital is Paris, in the U.S.; 1990 and 1."
    spans = gold_spans(text, ["paris", "US", "1", "the capital", "Lyon"])
    assert [(g, text[s:e]) for g, s, e in spans] == [(0, "Paris,"), (1, "U.S.;"), (2, "1."), (3, "capital")]
    assert gold_spans(text, ["capital is paris"]) and not gold_spans(text, ["is capital"])
    assert gold_spans("x", None) == [] and gold_spans(None, ["x"]) == []  # bad input finds nothing


def test_eval_lines_keep_turns_and_chunk_golds(evals):
    lines = {line["id"]: line for line in read_results(evals[0] / RESULTS_FILE)}
    q2 = lines["q2"]
    assert [t["kind"] for t in q2["trace"]] == ["memory"] * q2["num_chunks"] + ["final"]
    assert "item 2 is alpha2" in q2["trace"][0]["text"] and q2["trace"][0]["response_length"] > 0
    # q2's document: "item0 is alpha0. item1 is alpha1. ..." -> the gold is in exactly one chunk.
    found = [hits for hits in q2["chunk_golds"] if hits]
    assert len(q2["chunk_golds"]) == q2["num_chunks"] and len(found) == 1
    gold, count, excerpt, start, end = found[0][0]
    assert (gold, count, normalize_answer(excerpt[start:end])) == (0, 1, "alpha2")


def test_rollout_logs_keep_groups_advantages_and_credit(run_root):
    (log,) = sorted((run_root / "logs" / "rollouts").glob("rollout_*.jsonl"))
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 8 and len({r["group_id"] for r in records}) == 1
    rewards = [r["reward"] for r in records]
    assert 0 < sum(rewards) < 8  # parity reward: the group has signal
    for r in records:
        assert (r["advantage"] > 0) == (r["reward"] > sum(rewards) / 8)
        # default credit "split": each turn's row carries advantage / T
        credits = [t["advantage"] for t in r["turns"]]
        assert credits == pytest.approx([r["advantage"] / len(r["turns"])] * len(r["turns"]), rel=1e-6)
        assert r["question"] == "What is fact0?" and len(r["chunk_golds"]) == r["num_chunks"] == 3
        assert any(hits for hits in r["chunk_golds"])  # "Paris" is in the document


def test_view_data_of_a_compare_and_of_a_run(evals, run_root):
    data = view_data(evals[0], evals[1])
    assert data["kind"] == "eval" and len(data["items"]) == 16 and len(data["runs"]) == 2
    q2 = next(it for it in data["items"] if it["id"] == "q2")
    memory = q2["r"][0]["t"][0]
    assert memory[0] == "memory" and memory[5] and memory[1][memory[5][0][1]:memory[5][0][2]] == "alpha2"
    train = view_data(run_root)
    assert train["kind"] == "train" and len(train["items"]) == 8
    (step,) = train["steps"]
    assert step["id"] == 0 and len(step["groups"]) == 1 and step["groups"][0]["items"] == list(range(8))
    assert step["reward"] == pytest.approx(sum(it["r"][0]["rw"] for it in train["items"]) / 8)
    one_log = view_data(run_root / "logs" / "rollouts" / "rollout_0000000.jsonl")  # a log file alone
    assert [it["r"] for it in one_log["items"]] == [it["r"] for it in train["items"]] and one_log["steps"][0]["id"] == 0


def test_embedded_json_cannot_close_its_script_element(evals, tmp_path):
    assert "<" not in embed_json({"a": "</script><!--\u2028&"}) and json.loads(embed_json({"a": "</script>"})) == {
        "a": "</script>"}
    page = render_html(view_data(evals[0], evals[1]))
    assert INJECTED not in page and page.count("</script>") == 2  # the data element's and the code's own


def test_files_written_before_the_new_fields_still_open(evals, tmp_path):
    old = tmp_path / "old_eval"
    old.mkdir()
    lines = read_results(evals[0] / RESULTS_FILE)
    for line in lines:
        line.pop("trace"), line.pop("chunk_golds")
    (old / RESULTS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    data = view_data(old)
    assert len(data["items"]) == 16 and data["items"][0]["r"][0]["t"] == []


def test_bad_paths_are_named_errors_and_exit_2(evals, tmp_path):
    from memrl.cli import app

    with pytest.raises(ViewerError, match="does not exist"):
        view_data(tmp_path / "missing")
    with pytest.raises(ViewerError, match="neither an eval folder"):
        view_data(tmp_path)
    with pytest.raises(ViewerError, match="two eval folders"):
        view_data(evals[0], tmp_path)
    result = CliRunner().invoke(app, ["view", str(tmp_path)])
    assert result.exit_code == 2 and "neither an eval folder" in result.output
    out = tmp_path / "page.html"
    result = CliRunner().invoke(app, ["view", str(evals[0]), "--compare", str(evals[1]), "--out", str(out)])
    assert result.exit_code == 0 and "16 questions" in result.output and out.is_file()


def test_different_question_sets_are_refused(evals, tmp_path):
    fewer = tmp_path / "fewer"
    fewer.mkdir()
    lines = read_results(evals[1] / RESULTS_FILE)[:-1]
    (fewer / RESULTS_FILE).write_text("".join(json.dumps(line) + "\n" for line in lines))
    with pytest.raises(ViewerError, match="different questions"):
        write_viewer(evals[0], fewer)
