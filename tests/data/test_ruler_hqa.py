"""RULER-HQA: reading (string and index-list contexts), validation, offline building, hub download."""

from __future__ import annotations

import json
import random
import sys
import types

import pytest

from memrl.data.hotpotqa import format_documents, parse_hotpot_records
from memrl.data.manifest import ManifestError, write_manifest
from memrl.data.records import DataError
from memrl.data.ruler_hqa import (
    OFFICIAL_SHUFFLE_SEED,
    RULER_REPO,
    RULER_REVISION,
    RulerBuildError,
    build_ruler_set,
    download_ruler_file,
    load_pool,
    load_ruler_file,
    read_ruler_file,
    write_ruler_file,
)


@pytest.fixture(scope="module")
def dev_examples(hotpot_dev_records):
    return parse_hotpot_records(hotpot_dev_records, "dev")


def split_documents(context: str) -> list[tuple[str, str]]:
    out = []
    for i, block in enumerate(context.split("\n\n"), start=1):
        header, title, text = block.split("\n", 2)
        assert header == f"Document {i}:"
        out.append((title, text))
    return out


def test_built_set_of_20_reads_back_through_the_ruler_reader(dev_examples, tmp_path):
    records = build_ruler_set(dev_examples, 20, seed=11)
    assert len(records) == len(dev_examples)
    path = tmp_path / "eval_20.json"
    write_ruler_file(path, records)
    loaded = load_ruler_file(path)
    assert [q.id for q in loaded] == [e.id for e in dev_examples]
    for example, record, question in zip(dev_examples, records, loaded, strict=True):
        docs = split_documents(record["context"])
        titles = [t for t, _ in docs]
        assert len(docs) == record["num_docs"] == 20 and len(set(titles)) == 20
        assert {t for t, _ in example.paragraphs} <= set(titles), "a question keeps all its own paragraphs"
        assert record["gold_positions"] == [i for i, t in enumerate(titles, 1) if t in example.gold_titles]
        assert record["gold_positions"], "every dev question has gold paragraphs"
        assert question.question == example.question and question.answers == [example.answer]
        assert question.context == record["context"]
        assert question.metadata["gold_positions"] == record["gold_positions"]
        assert question.metadata["num_docs"] == 20 and question.metadata["seed"] == 11
    assert len({tuple(r["gold_positions"]) for r in records}) > 50, "gold positions vary per question"
    assert build_ruler_set(dev_examples[:5], 20, seed=11, pool=dev_examples) == records[:5]
    assert build_ruler_set(dev_examples, 20, seed=12) != records


def test_identical_questions_get_their_own_orders():
    rows = [{"_id": f"q{i}", "question": "Q?", "answer": "A", "type": "", "level": "",
             "supporting_facts": [["P0", 0], ["P1", 0]],
             "context": [[f"P{i}" if j < 2 else f"D{i}-{j}", ["x."]] for j in range(4)]} for i in range(30)]
    for row in rows:  # the same two gold titles in every question
        row["context"][0][0], row["context"][1][0] = "P0", "P1"
    records = build_ruler_set(parse_hotpot_records(rows, "synthetic"), 12, seed=0)
    assert len({tuple(r["gold_positions"]) for r in records}) > 15


def test_fewer_documents_than_own_paragraphs_keeps_gold(dev_examples):
    for record, example in zip(build_ruler_set(dev_examples[:20], 3, seed=0), dev_examples[:20], strict=True):
        titles = [t for t, _ in split_documents(record["context"])]
        assert len(titles) == 3 and example.gold_titles <= set(titles)
    with pytest.raises(RulerBuildError, match="below the 2 gold paragraphs"):
        build_ruler_set(dev_examples[:1], 1, seed=0)


def test_pool_too_small_is_an_error(dev_examples):
    with pytest.raises(RulerBuildError, match="pool has only .* distinct paragraphs"):
        build_ruler_set(dev_examples[:3], 40, seed=0)


def test_index_list_context_needs_a_pool(tmp_path):
    pool = ["T0\nzero.", {"title": "T1", "text": "one."}, ["T2", ["two", " more."]]]
    rows = [{"context": [2, 0], "input": "Q?", "answers": ["A"], "num_docs": 2, "index": 0},
            {"context": "Document 1:\nT1\none.", "input": "R?", "answers": ["B", "b"], "num_docs": 1, "index": 1}]
    path = tmp_path / "eval_2.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError, match=r"eval_2\.json: record 0 \(id 0\): field 'context': .*--pool"):
        read_ruler_file(path)
    (tmp_path / "pool.json").write_text(json.dumps(pool))
    records = load_ruler_file(path, pool=tmp_path / "pool.json")
    assert records[0].context == format_documents(["T2\ntwo more.", "T0\nzero."])
    assert records[1].context == rows[1]["context"] and records[1].answers == ["B", "b"]
    assert [r.id for r in records] == ["0", "1"]
    rows[0]["context"] = [0, 3]
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError, match="item 1 = 3 is not an index into the pool of 3"):
        read_ruler_file(path, pool=pool)
    rows[0]["context"] = [0]
    path.write_text(json.dumps(rows))
    with pytest.raises(DataError, match="lists 1 documents but num_docs is 2"):
        read_ruler_file(path, pool=pool)


def test_load_pool_rejects_unknown_documents():
    assert load_pool(["a\nb", ["t", "text"]]) == ["a\nb", "t\ntext"]
    with pytest.raises(DataError, match="record 1: field 'pool'"):
        load_pool(["ok", 5])


@pytest.mark.parametrize(("field", "value"), [
    ("answers", "A"), ("answers", []), ("input", ""), ("num_docs", "2"), ("index", None), ("context", 3.5),
])
def test_malformed_ruler_record_names_file_record_and_field(tmp_path, field, value):
    good = {"context": "Document 1:\nT\nx.", "input": "Q?", "answers": ["A"], "num_docs": 1, "index": 0}
    bad = dict(good, index=1, id="qid-1")
    bad[field] = value
    path = tmp_path / "eval_1.json"
    path.write_text(json.dumps([good, bad]))
    with pytest.raises(DataError) as err:
        read_ruler_file(path)
    assert str(path) in str(err.value) and "record 1 (id 'qid-1')" in str(err.value)
    assert f"field '{field}'" in str(err.value)


def test_not_a_list_and_duplicate_ids(tmp_path):
    path = tmp_path / "eval_1.json"
    path.write_text('{"context": "x"}')
    with pytest.raises(DataError, match="JSON list"):
        read_ruler_file(path)
    row = {"context": "c", "input": "Q?", "answers": ["A"], "num_docs": 1, "index": 0}
    path.write_text(json.dumps([row, row]))
    with pytest.raises(DataError, match="duplicate id"):
        load_ruler_file(path)


def test_reader_verifies_the_manifest(tmp_path):
    row = {"context": "c", "input": "Q?", "answers": ["A"], "num_docs": 1, "index": 0}
    write_ruler_file(tmp_path / "eval_1.json", [row])
    write_manifest(tmp_path, {"eval_1.json": 1}, "test", {})
    assert len(load_ruler_file(tmp_path / "eval_1.json")) == 1
    (tmp_path / "eval_1.json").write_text(json.dumps([dict(row, answers=["B"])]))
    with pytest.raises(ManifestError, match=r"eval_1\.json"):
        load_ruler_file(tmp_path / "eval_1.json")
    assert load_ruler_file(tmp_path / "eval_1.json", verify=False)[0].answers == ["B"]


def test_download_uses_the_pinned_dataset_revision(monkeypatch, tmp_path):
    calls = {}

    def hf_hub_download(**kwargs):
        calls.update(kwargs)
        return str(tmp_path / kwargs["filename"])

    monkeypatch.setitem(sys.modules, "huggingface_hub", types.SimpleNamespace(hf_hub_download=hf_hub_download))
    assert download_ruler_file(200) == tmp_path / "eval_200.json"
    assert calls == {"repo_id": RULER_REPO, "filename": "eval_200.json", "repo_type": "dataset",
                     "revision": RULER_REVISION, "cache_dir": None}


# --- The official layout (MemAgent's different_docs_eval.py) -------------------------------------------
def official_permutation(num_docs: int) -> list[int]:
    """Slot i (0-based) of the official files holds pre-shuffle document perm[i], for every question."""
    perm = list(range(num_docs))
    random.Random(4).shuffle(perm)
    return perm


def test_official_layout_puts_every_question_on_the_same_slots(dev_examples):
    records = build_ruler_set(dev_examples, 50, seed=11, layout="official")
    slot_of = {j: i + 1 for i, j in enumerate(official_permutation(50))}  # pre-shuffle index -> "Document N"
    full = [(e, r) for e, r in zip(dev_examples, records, strict=True) if len(e.paragraphs) == 10]
    assert len(full) == 199
    for example, record in full:
        docs = split_documents(record["context"])
        assert len(docs) == 50 and record["shuffle_seed"] == OFFICIAL_SHUFFLE_SEED == 4
        # Own paragraph j (HotpotQA source order) sits at the same "Document N" in every question.
        for j, (title, sentences) in enumerate(example.paragraphs):
            assert docs[slot_of[j] - 1] == (title, "".join(sentences))
        gold_js = [j for j, (t, _) in enumerate(example.paragraphs) if t in example.gold_titles]
        assert record["gold_positions"] == sorted(slot_of[j] for j in gold_js)
    # So questions whose gold paragraphs have the same source indices share their gold slots; memrl's vary.
    by_gold_indices: dict[tuple[int, ...], set[tuple[int, ...]]] = {}
    for example, record in full:
        key = tuple(j for j, (t, _) in enumerate(example.paragraphs) if t in example.gold_titles)
        by_gold_indices.setdefault(key, set()).add(tuple(record["gold_positions"]))
    assert len(by_gold_indices) < len(full) and all(len(v) == 1 for v in by_gold_indices.values())
    memrl = build_ruler_set(dev_examples, 50, seed=11)
    assert len({tuple(r["gold_positions"]) for r in memrl}) > 100
    assert build_ruler_set(dev_examples, 50, seed=11, layout="official") == records  # deterministic


def hotpot_row(qid: str, paragraphs: list[tuple[str, str]], gold: list[str]) -> dict:
    return {"_id": qid, "question": f"{qid}?", "answer": "A", "type": "", "level": "",
            "supporting_facts": [[t, 0] for t in gold], "context": [[t, [text]] for t, text in paragraphs]}


def test_official_layout_deduplicates_by_text_memrl_by_title():
    # Two questions quote the article "Shared" differently: one title, two texts.
    examples = parse_hotpot_records([
        hotpot_row("q0", [("Shared", "version a."), ("A1", "x.")], ["Shared", "A1"]),
        hotpot_row("q1", [("Shared", "version b."), ("B1", "y.")], ["B1", "Shared"]),
        hotpot_row("q2", [("C0", "z."), ("C1", "w.")], ["C0", "C1"]),
    ], "synthetic")
    official = build_ruler_set(examples, 6, seed=0, layout="official")  # 6 distinct texts, 5 distinct titles
    q0 = split_documents(official[0]["context"])
    assert ("Shared", "version a.") in q0 and ("Shared", "version b.") in q0
    # Gold is the question's own paragraph, not every document with a gold title.
    assert [q0[p - 1] for p in official[0]["gold_positions"]] == sorted(
        [("Shared", "version a."), ("A1", "x.")], key=q0.index)
    with pytest.raises(RulerBuildError, match="pool has only 3 distinct paragraphs"):
        build_ruler_set(examples, 6, seed=0)  # by title, q0 has only 3 others
    memrl = split_documents(build_ruler_set(examples, 5, seed=0)[0]["context"])
    assert ("Shared", "version a.") in memrl and ("Shared", "version b.") not in memrl
    with pytest.raises(RulerBuildError, match="pool has only 4 distinct paragraphs"):
        build_ruler_set(examples, 7, seed=0, layout="official")


def test_official_layout_with_the_whole_pool_uses_it_in_sorted_order():
    # As the official builder: num_docs equal to the pool is the whole pool, sorted by text, then shuffled.
    examples = parse_hotpot_records([hotpot_row("q0", [("B", "b."), ("A", "a.")], ["A"]),
                                     hotpot_row("q1", [("C", "c.")], ["C"])], "synthetic")
    records = build_ruler_set(examples, 3, seed=0, layout="official")
    pre = [("A", "a."), ("B", "b."), ("C", "c.")]
    expected = [pre[j] for j in official_permutation(3)]
    assert [split_documents(r["context"]) for r in records] == [expected, expected]


def test_unknown_layout_is_a_named_error(dev_examples):
    with pytest.raises(RulerBuildError, match="layout = 'verl'; use one of memrl, official"):
        build_ruler_set(dev_examples[:2], 20, seed=0, layout="verl")
