"""HotpotQA parsing (official and hub-row formats), per-question contexts, id selection."""

from __future__ import annotations

import copy
import json
import re
import sys
import types

import pytest

from memrl.data.hotpotqa import (
    HOTPOTQA_REPO,
    HOTPOTQA_REVISION,
    SHIPPED_DIR,
    SHIPPED_FILES,
    SelectionError,
    load_hotpotqa_file,
    load_hotpotqa_hub,
    parse_hotpot_records,
    parse_official_record,
    read_pass_counts,
    select_by_pass_counts,
    select_by_seed,
    select_heldout,
    shuffled_context,
    to_question_record,
)
from memrl.data.records import DataError, MissingDependencyError


def to_hub_row(official: dict) -> dict:
    """The shape `datasets` gives rows of hotpotqa/hotpot_qa (distractor)."""
    return {
        "id": official["_id"], "question": official["question"], "answer": official["answer"],
        "type": official["type"], "level": official["level"],
        "supporting_facts": {"title": [t for t, _ in official["supporting_facts"]],
                             "sent_id": [s for _, s in official["supporting_facts"]]},
        "context": {"title": [t for t, _ in official["context"]],
                    "sentences": [list(s) for _, s in official["context"]]},
    }


SMALL = {
    "_id": "q1", "question": "Which?", "answer": "B", "type": "bridge", "level": "easy",
    "supporting_facts": [["Beta", 0], ["Delta", 1]],
    "context": [["Alpha", ["A one.", " A two."]], ["Beta", ["B one."]], ["Gamma", ["G."]],
                ["Delta", ["D one.", " D two."]]],
}


def test_the_shipped_records_are_the_originals_and_gzip_reads_like_json(tmp_path):
    import gzip
    import hashlib

    originals = {"dev": ("f3d9574a22880e0aa898b824b90cf782131c3539632dc64090b7612b021dc652", 200),
                 "train": ("6c0e2689d03c94b3bb4d5f94ed806ea4f4eb4f46c12132f8e91df774ad5c5a22", 100)}
    for split, path in SHIPPED_FILES.items():  # the sha256 the folder's README.md (its license note) states
        data = gzip.decompress(path.read_bytes())
        assert (hashlib.sha256(data).hexdigest(), len(load_hotpotqa_file(path))) == originals[split], split
        (tmp_path / f"{split}.json").write_bytes(data)
        assert load_hotpotqa_file(tmp_path / f"{split}.json") == load_hotpotqa_file(path)
    assert sorted(p.name for p in SHIPPED_DIR.iterdir()) == sorted([*(p.name for p in SHIPPED_FILES.values()),
                                                                    "README.md"])
    cut = tmp_path / "cut.json.gz"
    cut.write_bytes(SHIPPED_FILES["train"].read_bytes()[:1000])
    with pytest.raises(DataError, match="cut.json.gz: not a complete gzip file"):
        load_hotpotqa_file(cut)
    damaged = bytearray(SHIPPED_FILES["train"].read_bytes())  # flipped bytes early in the stream: a zlib.error
    damaged[20:28] = bytes(255 - b for b in damaged[20:28])
    cut.write_bytes(bytes(damaged))
    with pytest.raises(DataError, match="cut.json.gz: not a complete gzip file"):
        load_hotpotqa_file(cut)


def test_a_gzip_file_that_decompresses_past_the_limit_is_refused_before_it_is_parsed(tmp_path, monkeypatch):
    import gzip

    from memrl.data import records

    bomb = tmp_path / "bomb.json.gz"
    bomb.write_bytes(gzip.compress(b"[" + b" " * 100_000 + b"]"))  # 100 kB from a few hundred bytes
    monkeypatch.setattr(records, "GUNZIP_LIMIT", 10_000)
    with pytest.raises(DataError, match="bomb.json.gz: decompresses to more than 10,000 bytes"):
        load_hotpotqa_file(bomb)


def test_official_and_hub_rows_parse_to_the_same_example(hotpot_dev_records):
    official = parse_hotpot_records(hotpot_dev_records[:50], "dev")
    hub = parse_hotpot_records([to_hub_row(r) for r in hotpot_dev_records[:50]], "hub")
    assert official == hub
    first = official[0]
    assert first.id == hotpot_dev_records[0]["_id"] and first.answer == hotpot_dev_records[0]["answer"]
    assert len(first.paragraphs) == len(hotpot_dev_records[0]["context"])


def test_context_layout_and_gold_positions():
    example = parse_official_record(SMALL, "small", 0)
    context, gold = shuffled_context(example, seed=7)
    blocks = context.split("\n\n")
    assert len(blocks) == 4
    titles = []
    for i, block in enumerate(blocks, start=1):
        header, title, text = block.split("\n")
        assert header == f"Document {i}:"
        titles.append(title)
        assert text == "".join(dict((t, s) for t, s in SMALL["context"])[title])
    assert sorted(titles) == ["Alpha", "Beta", "Delta", "Gamma"]
    assert gold == sorted(i for i, t in enumerate(titles, start=1) if t in {"Beta", "Delta"})
    assert shuffled_context(example, seed=7) == (context, gold)  # deterministic


def test_shuffles_differ_across_questions_and_seeds(hotpot_dev_records):
    examples = parse_hotpot_records(hotpot_dev_records, "dev")
    tens = [e for e in examples if len(e.paragraphs) == 10]
    gold_positions = {tuple(shuffled_context(e, 0)[1]) for e in tens}
    assert len(gold_positions) > 20, "per-question seeds must spread gold documents over positions"
    first_titles = {re.search(r"Document 1:\n(.*)\n", shuffled_context(e, 0)[0]).group(1) == e.paragraphs[0][0]
                    for e in tens}
    assert first_titles == {True, False}, "order is shuffled, not the source order"
    changed = sum(shuffled_context(e, 0)[0] != shuffled_context(e, 1)[0] for e in tens)
    assert changed > len(tens) * 0.9


def synthetic(qid: str) -> dict:
    """Same paragraphs and gold for every id: only the per-question seed can tell questions apart."""
    return {"_id": qid, "question": "Q?", "answer": "A", "type": "bridge", "level": "easy",
            "supporting_facts": [["P0", 0], ["P1", 0]],
            "context": [[f"P{i}", [f"text {i}."]] for i in range(10)]}


def test_identical_questions_get_their_own_orders():
    examples = parse_hotpot_records([synthetic(f"q{i}") for i in range(40)], "synthetic")
    positions = [tuple(shuffled_context(e, 0)[1]) for e in examples]
    assert len(set(positions)) > 20, "one global shuffle would give every question the same positions"


def test_question_record_metadata(hotpot_dev_records):
    example = parse_hotpot_records(hotpot_dev_records[:1], "dev")[0]
    record = to_question_record(example, seed=3)
    assert record.answers == [example.answer] and record.question == example.question
    assert record.metadata["gold_positions"] == shuffled_context(example, 3)[1]
    assert record.metadata["num_docs"] == record.context.count("Document ") == len(example.paragraphs)
    assert record.metadata["seed"] == 3 and record.metadata["supporting_facts"]
    json.dumps(record.to_dict())  # serializable


@pytest.mark.parametrize(("mutate", "field"), [
    (lambda r: r.pop("answer"), "answer"),
    (lambda r: r.update(question=""), "question"),
    (lambda r: r.update(context=[["T", "not a list"]]), "context"),
    (lambda r: r.update(context=[]), "context"),
    (lambda r: r.update(supporting_facts=[["T", "0"]]), "supporting_facts"),
    (lambda r: r.update(_id=5), "_id"),
])
def test_malformed_record_names_file_record_and_field(tmp_path, mutate, field):
    records = [copy.deepcopy(SMALL), copy.deepcopy(SMALL)]
    records[1]["_id"] = "q2"
    mutate(records[1])
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(records))
    with pytest.raises(DataError) as err:
        load_hotpotqa_file(path)
    message = str(err.value)
    assert str(path) in message and "record 1" in message and f"field '{field}'" in message
    if field != "_id":
        assert "'q2'" in message


def test_malformed_hub_row_and_duplicates():
    row = to_hub_row(SMALL)
    row["context"]["sentences"].pop()
    with pytest.raises(DataError, match=r"record 0 \(id 'q1'\): field 'context'"):
        parse_hotpot_records([row], "hub")
    with pytest.raises(DataError, match=r"record 1 .*duplicate id"):
        parse_hotpot_records([SMALL, SMALL], "dup")


def test_file_errors(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        load_hotpotqa_file(tmp_path / "missing.json")
    (tmp_path / "obj.json").write_text('{"a": 1}')
    with pytest.raises(DataError, match="JSON list"):
        load_hotpotqa_file(tmp_path / "obj.json")
    (tmp_path / "rows.jsonl").write_text(json.dumps(to_hub_row(SMALL)) + "\n")
    assert load_hotpotqa_file(tmp_path / "rows.jsonl")[0].id == "q1"


def test_jsonl_errors_name_the_line_of_the_file(tmp_path):
    # Lines count from 1 and blank ones count too: the line an editor jumps to, not the row index.
    bad = to_hub_row(SMALL) | {"id": "q2", "question": ""}
    path = tmp_path / "rows.jsonl"
    path.write_text(json.dumps(to_hub_row(SMALL)) + "\n\n" + json.dumps(bad) + "\n")
    with pytest.raises(DataError, match=r"rows\.jsonl: line 3 \(id 'q2'\): field 'question'"):
        load_hotpotqa_file(path)
    path.write_text(json.dumps(to_hub_row(SMALL)) + "\n\n" + json.dumps(to_hub_row(SMALL)) + "\n")
    with pytest.raises(DataError, match=r"line 3 \(id 'q1'\): field 'id': duplicate id, first seen at line 1"):
        load_hotpotqa_file(path)
    path.write_text(json.dumps(to_hub_row(SMALL)) + "\n{broken\n")
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        load_hotpotqa_file(path)


def test_hub_path_without_datasets_says_what_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails
    with pytest.raises(MissingDependencyError, match=r"memrl\[hub\].*--from-file"):
        load_hotpotqa_hub()


def test_hub_path_pins_the_revision_and_parses_rows(monkeypatch):
    calls = {}

    def load_dataset(repo, config, split, revision, cache_dir):
        calls.update(repo=repo, config=config, split=split, revision=revision)
        return [to_hub_row(SMALL)]

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    examples = load_hotpotqa_hub(split="validation")
    assert examples == [parse_official_record(SMALL, "x", 0)]
    assert calls == {"repo": HOTPOTQA_REPO, "config": "distractor", "split": "validation",
                     "revision": HOTPOTQA_REVISION}


def test_heldout_and_seeded_training_ids():
    ids = [f"id{i:03d}" for i in range(100)]
    heldout = select_heldout(ids, 30, seed=5)
    assert len(set(heldout)) == 30 and heldout == select_heldout(list(reversed(ids)), 30, seed=5)
    assert heldout != select_heldout(ids, 30, seed=6)
    rest = [i for i in ids if i not in set(heldout)]
    train = select_by_seed(rest, 50, seed=5)
    assert len(set(train)) == 50 and not set(train) & set(heldout)
    assert train != sorted(train), "training order is a seeded draw, not sorted"
    with pytest.raises(SelectionError, match="--num-heldout"):
        select_heldout(ids, 101, seed=5)
    with pytest.raises(SelectionError, match="--num-train"):
        select_by_seed(rest, 71, seed=5)


def test_select_by_pass_counts():
    counts = {"a": 0, "b": 3, "c": 8, "d": 1, "e": 7, "f": 0, "g": 4}
    assert select_by_pass_counts(counts, 8, 3) == ["b", "d", "e"]  # candidate order, 0 and k excluded
    assert select_by_pass_counts(counts, 8, 4) == ["b", "d", "e", "g"]
    seeded = select_by_pass_counts(counts, 8, 4, seed=1)
    assert sorted(seeded) == ["b", "d", "e", "g"] and seeded == select_by_pass_counts(counts, 8, 4, seed=1)
    with pytest.raises(SelectionError, match="only 4 of 7"):
        select_by_pass_counts(counts, 8, 5)
    with pytest.raises(SelectionError, match=r"'c' is 8.*\[0, 4\]"):
        select_by_pass_counts(counts, 4, 1)
    with pytest.raises(SelectionError, match="k < 2"):
        select_by_pass_counts(counts, 1, 1)
    with pytest.raises(SelectionError, match="integers"):
        select_by_pass_counts({"a": 1.5}, 8, 1)


def test_read_pass_counts_forms(tmp_path):
    (tmp_path / "plain.json").write_text('{"a": 1, "b": 0}')
    assert read_pass_counts(tmp_path / "plain.json", 8) == ({"a": 1, "b": 0}, None)
    (tmp_path / "ours.json").write_text('{"k": 4, "pass_counts": {"a": 2}}')
    assert read_pass_counts(tmp_path / "ours.json", 4) == ({"a": 2}, 4)
    with pytest.raises(DataError, match="--pass-k 4"):
        read_pass_counts(tmp_path / "ours.json", 8)
    (tmp_path / "list.json").write_text("[1, 2]")
    with pytest.raises(DataError, match="JSON object"):
        read_pass_counts(tmp_path / "list.json", 8)
