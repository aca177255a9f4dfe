"""The no-context filter: `pass-at-k --no-context` counts, `prepare-data hotpotqa --drop-answerable-without-context`."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from memrl.data.hotpotqa import read_id_list
from memrl.data.manifest import verify_manifest


def invoke(*args):
    from memrl.cli import app

    return CliRunner().invoke(app, ["prepare-data", *map(str, args)])


def test_training_keeps_only_questions_never_solved_without_the_document(train_file, hotpot_train_records, tmp_path):
    ids = [r["_id"] for r in hotpot_train_records]
    # judged: all but the last 10 ids; solved without the document: every third judged id
    counts = {qid: (2 if i % 3 == 0 else 0) for i, qid in enumerate(ids[:-10])}
    (tmp_path / "nc.json").write_text(json.dumps({"k": 4, "no_context": True, "pass_counts": counts}))
    plain = tmp_path / "plain"
    assert invoke("hotpotqa", "--from-file", train_file, "--num-train", 20, "--num-heldout", 30,
                  "--out", plain).exit_code == 0
    out = tmp_path / "filtered"
    result = invoke("hotpotqa", "--from-file", train_file, "--num-train", 20, "--num-heldout", 30,
                    "--drop-answerable-without-context", tmp_path / "nc.json", "--out", out)
    assert result.exit_code == 0, result.output
    heldout = read_id_list(out / "heldout_ids.txt")
    assert heldout == read_id_list(plain / "heldout_ids.txt"), "the held-out set never depends on the filter"
    train = read_id_list(out / "train_ids.txt")
    assert len(train) == 20 and all(counts.get(qid) == 0 for qid in train)
    candidates = [i for i in ids if i not in set(heldout)]
    answerable = [i for i in candidates if counts.get(i, 0) > 0]
    assert read_id_list(out / "answerable_without_context_ids.txt") == answerable
    manifest = verify_manifest(out)
    recorded = manifest["args"]["no_context_filter"]
    assert recorded["answerable_dropped"] == len(answerable)
    assert recorded["judged"] == sum(i in counts for i in candidates)
    assert recorded["unjudged_dropped"] == sum(i not in counts for i in candidates)
    assert manifest["args"]["drop_answerable_without_context"]["k"] == 4
    assert manifest["files"]["answerable_without_context_ids.txt"]["records"] == len(answerable)


def test_a_count_file_made_with_the_documents_is_refused(train_file, tmp_path):
    (tmp_path / "pc.json").write_text(json.dumps({"k": 4, "pass_counts": {}}))
    result = invoke("hotpotqa", "--from-file", train_file, "--num-train", 5, "--num-heldout", 5,
                    "--drop-answerable-without-context", tmp_path / "pc.json", "--out", tmp_path / "o")
    assert result.exit_code == 2 and "pass-at-k --no-context" in result.output


def test_pass_at_k_no_context_asks_the_question_alone(tiny_tokenizer, tmp_path, monkeypatch):
    """The final turn is the first and only one, and its prompt holds no word of the document."""
    from memrl.data.records import QuestionRecord, write_jsonl
    from memrl.engines.base import GenerationResult
    from memrl.eval import pass_at_k, runner

    prompts = []

    class Recorder:
        async def generate(self, requests):
            prompts.extend(tiny_tokenizer.decode(r.prompt_ids) for r in requests)
            ids = (tiny_tokenizer(r"\boxed{Paris}", add_special_tokens=False)["input_ids"]
                   + [tiny_tokenizer.eos_token_id])
            return [GenerationResult(ids, [-0.1] * len(ids), "stop") for _ in requests]

        async def close(self):
            pass

    records = [QuestionRecord(id=f"q{i}", question=f"Where is item{i}?", answers=["Paris"],
                              context="zebra document " * 40, metadata={}) for i in range(2)]
    write_jsonl(tmp_path / "cands.jsonl", records)
    monkeypatch.setattr(runner, "open_engine", lambda cfg, model, url, tok: (tiny_tokenizer, Recorder(), {"kind": "x"}))
    sets = ["task.chunk_tokens=16", "task.memory_tokens=8", "task.final_tokens=8"]
    result = pass_at_k.pass_at_k_command("m", None, None, tmp_path / "cands.jsonl", tmp_path / "nc.json", 3, sets,
                                         tokenizer="t", progress=False, no_context=True)
    assert result["no_context"] is True and result["pass_counts"] == {"q0": 3, "q1": 3}
    assert len(prompts) == 2 * 3 and not any("zebra" in p for p in prompts)
    assert json.loads((tmp_path / "nc.json").read_text())["no_context"] is True
    prompts.clear()
    with_doc = pass_at_k.pass_at_k_command("m", None, None, tmp_path / "cands.jsonl", tmp_path / "wc.json", 3, sets,
                                           tokenizer="t", progress=False)
    assert "no_context" not in with_doc and any("zebra" in p for p in prompts)  # the default reads the document
