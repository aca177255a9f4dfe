"""`memrl prepare-data` through the `memrl` app: files, id lists, manifests, determinism, errors."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from memrl.data.hotpotqa import read_id_list
from memrl.data.manifest import ManifestError, verify_manifest
from memrl.data.records import DataError, load_questions
from memrl.data.ruler_hqa import RULER_LAYOUTS, load_ruler_file

FILES = ["hotpotqa_train.jsonl", "hotpotqa_heldout.jsonl", "train_ids.txt", "heldout_ids.txt", "manifest.json"]


def invoke(app, *args, env=None):
    return CliRunner().invoke(app, ["prepare-data", *map(str, args)], env=env)


def prepare(app, train_file, out, *extra):
    result = invoke(app, "hotpotqa", "--from-file", train_file, "--num-train", 60, "--num-heldout", 40,
                    "--out", out, *extra)
    assert result.exit_code == 0, result.output
    return result


def test_hotpotqa_writes_questions_id_lists_and_manifest(app, train_file, hotpot_train_records, tmp_path):
    prepare(app, train_file, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(FILES)
    train, heldout = (load_questions(tmp_path / "hotpotqa_train.jsonl"),
                      load_questions(tmp_path / "hotpotqa_heldout.jsonl"))
    assert len(train) == 60 and len(heldout) == 40
    assert [q.id for q in train] == read_id_list(tmp_path / "train_ids.txt")
    assert [q.id for q in heldout] == read_id_list(tmp_path / "heldout_ids.txt")
    assert not {q.id for q in train} & {q.id for q in heldout}
    manifest = verify_manifest(tmp_path)
    assert manifest["files"]["hotpotqa_train.jsonl"]["records"] == 60
    assert manifest["args"]["seed"] == 42 and manifest["args"]["source"]["sha256"]
    positions = {tuple(q.metadata["gold_positions"]) for q in train + heldout}
    assert len(positions) > 10, "per-question shuffles put gold documents at different positions"
    source = {r["_id"]: r for r in hotpot_train_records}
    for q in train[:5]:
        assert q.answers == [source[q.id]["answer"]] and q.question == source[q.id]["question"]


def test_one_edited_byte_makes_the_next_reader_fail_naming_the_file(app, train_file, tmp_path):
    prepare(app, train_file, tmp_path)
    path = tmp_path / "hotpotqa_heldout.jsonl"
    data = bytearray(path.read_bytes())
    data[100] = ord("X") if data[100] != ord("X") else ord("Y")
    path.write_bytes(bytes(data))
    with pytest.raises(ManifestError, match=r"hotpotqa_heldout\.jsonl.*changed"):
        load_questions(path)
    assert len(load_questions(tmp_path / "hotpotqa_train.jsonl")) == 60  # untouched file still reads
    assert len(load_questions(path, verify=False)) == 40


def test_same_seed_gives_byte_identical_files(app, train_file, tmp_path):
    prepare(app, train_file, tmp_path / "a")
    prepare(app, train_file, tmp_path / "b")
    prepare(app, train_file, tmp_path / "c", "--seed", 7)
    for name in FILES:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "heldout_ids.txt").read_bytes() != (tmp_path / "c" / "heldout_ids.txt").read_bytes()


def test_data_dir_env_is_the_default_output(app, train_file, tmp_path):
    result = invoke(app, "hotpotqa", "--from-file", train_file, "--num-train", 5, "--num-heldout", 5,
                    env={"DATA_DIR": str(tmp_path)})
    assert result.exit_code == 0, result.output
    assert len(read_id_list(tmp_path / "train_ids.txt")) == 5


def test_pass_count_selection_keeps_heldout_and_records_counts(app, train_file, hotpot_train_records, tmp_path):
    prepare(app, train_file, tmp_path / "seeded")
    heldout = read_id_list(tmp_path / "seeded" / "heldout_ids.txt")
    ids = [r["_id"] for r in hotpot_train_records]
    counts = {qid: i % 9 for i, qid in enumerate(ids)}  # 0..8: some never, some always solved
    (tmp_path / "counts.json").write_text(json.dumps(counts))
    out = tmp_path / "passk"
    result = invoke(app, "hotpotqa", "--from-file", train_file, "--num-train", 30, "--num-heldout", 40,
                    "--pass-counts", tmp_path / "counts.json", "--pass-k", 8, "--out", out)
    assert result.exit_code == 0, result.output
    assert read_id_list(out / "heldout_ids.txt") == heldout, "held-out never depends on model answers"
    train = read_id_list(out / "train_ids.txt")
    assert len(train) == 30 and not set(train) & set(heldout)
    assert all(0 < counts[qid] < 8 for qid in train)
    recorded = json.loads((out / "train_pass_counts.json").read_text())
    assert recorded["k"] == 8 and recorded["train_pass_counts"] == {qid: counts[qid] for qid in train}
    assert recorded["pass_counts"] == counts
    verify_manifest(out, ["train_pass_counts.json"])
    result = invoke(app, "hotpotqa", "--from-file", train_file, "--num-train", 60, "--num-heldout", 40,
                    "--pass-counts", tmp_path / "counts.json", "--out", tmp_path / "too-many")
    assert result.exit_code == 2 and "0 < passes < 8" in result.output and "lower --num-train" in result.output


def test_malformed_source_fails_with_the_file_record_and_field(app, tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps([{"_id": "x1", "question": "Q?", "supporting_facts": [], "context": [["T", ["s"]]]}]))
    result = invoke(app, "hotpotqa", "--from-file", bad, "--out", tmp_path / "out")
    assert result.exit_code == 2
    assert "bad.json: record 0 (id 'x1'): field 'answer'" in result.output
    assert not (tmp_path / "out").exists(), "nothing is written when the source is malformed"


def test_build_ruler_and_ruler_hqa_commands(app, dev_file, tmp_path):
    result = invoke(app, "build-ruler", "--from-file", dev_file, "--num-docs", 20, 30, "--limit", 12,
                    "--out", tmp_path)
    assert result.exit_code == 0, result.output
    built = tmp_path / "ruler_built"
    verify_manifest(built, ["eval_20.json", "eval_30.json"])
    records = load_ruler_file(built / "eval_20.json")
    assert len(records) == 12 and all(r.metadata["num_docs"] == 20 for r in records)

    # The built folder doubles as a local RULER-HQA folder: normalize it into OUT/ruler_hqa.
    result = invoke(app, "ruler-hqa", "--from-dir", built, "--lengths", "20,30", "--out", tmp_path / "data")
    assert result.exit_code == 0, result.output
    manifest = verify_manifest(tmp_path / "data" / "ruler_hqa")
    assert set(manifest["files"]) == {"eval_20.json", "eval_30.json"}
    assert [r.id for r in load_ruler_file(tmp_path / "data" / "ruler_hqa" / "eval_30.json")] == \
        [r.id for r in records]
    result = invoke(app, "ruler-hqa", "--from-dir", built, "--lengths", "50", "--out", tmp_path / "data")
    assert result.exit_code == 2 and "eval_50.json" in result.output and "does not exist" in result.output
    result = invoke(app, "ruler-hqa", "--from-dir", built, "--lengths", "x", "--out", tmp_path / "data")
    assert result.exit_code == 2


def test_ruler_hqa_index_list_with_pool(app, tmp_path):
    src = tmp_path / "src"
    src.mkdir()
    rows = [{"context": [1, 0], "input": "Q?", "answers": ["A"], "num_docs": 2, "index": 0}]
    (src / "eval_2.json").write_text(json.dumps(rows))
    (tmp_path / "pool.json").write_text(json.dumps(["T0\nzero.", "T1\none."]))
    result = invoke(app, "ruler-hqa", "--from-dir", src, "--lengths", 2, "--out", tmp_path / "out")
    assert result.exit_code == 2 and "--pool" in result.output
    result = invoke(app, "ruler-hqa", "--from-dir", src, "--lengths", 2, "--pool", tmp_path / "pool.json",
                    "--out", tmp_path / "out")
    assert result.exit_code == 0, result.output
    (record,) = load_ruler_file(tmp_path / "out" / "ruler_hqa" / "eval_2.json")
    assert record.context == "Document 1:\nT1\none.\n\nDocument 2:\nT0\nzero."


def test_load_questions_rejects_malformed_lines(tmp_path):
    path = tmp_path / "q.jsonl"
    path.write_text('{"id": "a", "question": "Q", "answers": ["x"], "context": "c", "metadata": {}}\n'
                    '{"id": "b", "question": "Q", "answers": "x", "context": "c"}\n')
    with pytest.raises(DataError, match=r"q\.jsonl: line 2 \(id 'b'\): field 'answers'"):
        load_questions(path)
    path.write_text("{broken\n")
    with pytest.raises(DataError, match="line 1 is not valid JSON"):
        load_questions(path)


def test_build_ruler_layout_flag_is_recorded_in_the_manifest(app, dev_file, tmp_path):
    runs = {"default": [], "official": ["--layout", "official"], "memrl": ["--layout", "memrl"]}
    for name, flag in runs.items():
        result = invoke(app, "build-ruler", "--from-file", dev_file, "--num-docs", 20, "--limit", 5,
                        "--out", tmp_path / name, *flag)
        assert result.exit_code == 0, result.output
    manifests = {name: verify_manifest(tmp_path / name / "ruler_built") for name in runs}
    assert {name: m["args"]["layout"] for name, m in manifests.items()} == \
        {"default": "memrl", "official": "official", "memrl": "memrl"}
    assert manifests["default"]["files"] == manifests["memrl"]["files"]  # memrl's layout stays the default
    official = [r.metadata for r in load_ruler_file(tmp_path / "official" / "ruler_built" / "eval_20.json")]
    assert {m["shuffle_seed"] for m in official} == {4}
    result = invoke(app, "build-ruler", "--from-file", dev_file, "--num-docs", 20, "--layout", "verl",
                    "--out", tmp_path / "bad")
    assert result.exit_code == 2 and "verl" in result.output
    from memrl.cli_prepare import RulerLayout

    assert tuple(RulerLayout) == RULER_LAYOUTS  # the CLI offers exactly the library's layouts


def test_build_ruler_files_records_the_layout_without_args(dev_file, tmp_path):
    from memrl.data.hotpotqa import load_hotpotqa_file
    from memrl.data.prepare import build_ruler_files

    build_ruler_files(load_hotpotqa_file(dev_file), tmp_path, [20], limit=3, layout="official")
    assert verify_manifest(tmp_path / "ruler_built")["args"] == {"layout": "official"}


def test_no_command_writes_over_a_file_it_reads(app, dev_file, train_file, tmp_path):
    """The folder commands refuse, before reading anything, an input that is one of the files they write,
    whatever the spelling (`new/..`, whose `new` the writer would create; a symlink): the input would be
    replaced by what was made from it."""
    assert invoke(app, "build-ruler", "--from-file", dev_file, "--num-docs", 20, "--limit", 4,
                  "--out", tmp_path).exit_code == 0
    built = tmp_path / "ruler_built" / "eval_20.json"
    assert invoke(app, "ruler-hqa", "--from-dir", built.parent, "--lengths", 20, "--out", tmp_path).exit_code == 0
    normalized = tmp_path / "ruler_hqa" / "eval_20.json"
    (tmp_path / "link.json").symlink_to(built)
    before = built.read_bytes(), normalized.read_bytes()
    for args in (("ruler-hqa", "--from-dir", normalized.parent, "--lengths", 20, "--out", tmp_path / "new" / ".."),
                 ("build-ruler", "--from-file", tmp_path / "link.json", "--num-docs", 20, "--out", tmp_path)):
        result = invoke(app, *args)
        assert result.exit_code == 2 and "would be overwritten" in result.output and "eval_20.json" in result.output
        assert len(result.output.strip().splitlines()) == 1 and (built.read_bytes(), normalized.read_bytes()) == before
    prepare(app, train_file, tmp_path / "data")
    counts = tmp_path / "data" / "train_pass_counts.json"
    counts.write_text(json.dumps({"x": 1}))
    result = invoke(app, "hotpotqa", "--from-file", train_file, "--pass-counts", counts, "--out", tmp_path / "data")
    assert result.exit_code == 2 and "--pass-counts" in result.output and counts.read_text() == '{"x": 1}'
