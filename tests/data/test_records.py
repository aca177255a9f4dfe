"""Prepared JSONL records: a malformed or duplicate record is named by its 1-based line in the file."""

from __future__ import annotations

import json

import pytest

from memrl.data.records import DataError, load_questions


def record(qid: str, **fields) -> str:
    return json.dumps({"id": qid, "question": "Q", "answers": ["x"], "context": "c", **fields}) + "\n"


def test_a_bad_record_is_named_by_its_line_not_its_index(tmp_path):
    # Line 4 is the third record (index 2): a blank line before it must not shift the number.
    path = tmp_path / "q.jsonl"
    path.write_text(record("a") + record("b") + "\n" + record("c", answers=[]))
    with pytest.raises(DataError, match=r"q\.jsonl: line 4 \(id 'c'\): field 'answers'"):
        load_questions(path)


def test_a_duplicate_id_names_both_lines(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text(record("a") + "\n" + record("b") + record("a"))
    with pytest.raises(DataError, match=r"line 4 \(id 'a'\): field 'id': duplicate id, first seen at line 1"):
        load_questions(path)

