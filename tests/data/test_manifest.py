"""Manifest: hashes, atomic writes, verification naming the changed file, merging of two writers."""

from __future__ import annotations

import hashlib
import json
import re

import pytest

from memrl.data.manifest import (
    MANIFEST_NAME,
    ManifestError,
    OutputFolderError,
    output_folder,
    read_manifest,
    sha256_file,
    verify_manifest,
    write_manifest,
)
from memrl.io import atomic_write_json, atomic_write_text


@pytest.fixture()
def prepared(tmp_path):
    atomic_write_text(tmp_path / "a.jsonl", '{"id": "1"}\n{"id": "2"}\n')
    atomic_write_text(tmp_path / "sub" / "b.json", "[1, 2, 3]\n")
    write_manifest(tmp_path, {"a.jsonl": 2, "sub/b.json": 3}, "test", {"seed": 1})
    return tmp_path


def test_sha256_matches_hashlib(tmp_path):
    data = bytes(range(256)) * 5000  # > one 1 MiB read block
    (tmp_path / "x").write_bytes(data)
    assert sha256_file(tmp_path / "x") == hashlib.sha256(data).hexdigest()


def test_manifest_records_hash_size_and_count(prepared):
    manifest = read_manifest(prepared)
    entry = manifest["files"]["a.jsonl"]
    assert entry == {"sha256": sha256_file(prepared / "a.jsonl"), "bytes": 24, "records": 2}
    assert manifest["files"]["sub/b.json"]["records"] == 3
    assert manifest["created_by"] == "test" and manifest["args"] == {"seed": 1}
    assert verify_manifest(prepared)["files"] == manifest["files"]


def test_one_changed_byte_is_named(prepared):
    path = prepared / "sub" / "b.json"
    data = bytearray(path.read_bytes())
    data[1] = ord("9")  # same size, different content
    path.write_bytes(bytes(data))
    verify_manifest(prepared, ["a.jsonl"])  # the other file still verifies
    with pytest.raises(ManifestError, match=r"sub/b\.json.*changed"):
        verify_manifest(prepared)


def test_missing_unlisted_and_no_manifest(prepared, tmp_path_factory):
    with pytest.raises(ManifestError, match="not listed"):
        verify_manifest(prepared, ["other.jsonl"])
    (prepared / "a.jsonl").unlink()
    with pytest.raises(ManifestError, match=r"a\.jsonl.*missing"):
        verify_manifest(prepared)
    empty = tmp_path_factory.mktemp("empty")
    with pytest.raises(ManifestError, match="no manifest.json"):
        verify_manifest(empty)
    (empty / MANIFEST_NAME).write_text("{not json")
    with pytest.raises(ManifestError, match="not valid JSON"):
        verify_manifest(empty)


def test_second_writer_keeps_other_entries_and_history(prepared):
    atomic_write_text(prepared / "c.txt", "x\n")
    write_manifest(prepared, {"c.txt": 1}, "second", {"seed": 2})
    manifest = verify_manifest(prepared)
    assert set(manifest["files"]) == {"a.jsonl", "sub/b.json", "c.txt"}
    assert manifest["created_by"] == "second"
    assert manifest["history"] == [{"created_by": "test", "args": {"seed": 1}}]


@pytest.mark.parametrize(("edit", "words"), [
    (lambda m: m["files"].update({"a.jsonl": 5}), "malformed entry for 'a.jsonl'"),
    (lambda m: m["files"]["a.jsonl"].pop("sha256"), "malformed entry for 'a.jsonl'"),
    (lambda m: m["files"]["a.jsonl"].update(bytes="24"), "malformed entry for 'a.jsonl'"),
    (lambda m: m["files"]["a.jsonl"].update(bytes=True), "malformed entry for 'a.jsonl'"),
    (lambda m: m.update(history=5), "'history' that is not a list"),
])
def test_an_edited_manifest_is_named_where_it_is_read(prepared, edit, words):
    manifest = json.loads((prepared / MANIFEST_NAME).read_text())
    edit(manifest)
    (prepared / MANIFEST_NAME).write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match=words):
        verify_manifest(prepared)


def test_a_writer_replaces_a_manifest_with_a_broken_history(prepared):
    manifest = json.loads((prepared / MANIFEST_NAME).read_text())
    (prepared / MANIFEST_NAME).write_text(json.dumps({**manifest, "history": 5}))
    write_manifest(prepared, {"a.jsonl": 2}, "again", {})
    assert verify_manifest(prepared)["history"] == []


def test_output_folder_takes_a_folder_or_a_new_path_and_refuses_a_file(tmp_path):
    assert output_folder(tmp_path, "--out") == tmp_path
    assert output_folder(str(tmp_path / "new" / "deeper"), "--out") == tmp_path / "new" / "deeper"
    (tmp_path / "f").write_text("")
    for path, words in [(tmp_path / "f", "is a file"), (tmp_path / "f" / "x" / "y", f"is under {tmp_path / 'f'}")]:
        with pytest.raises(OutputFolderError, match=re.escape(f"--out {path} {words}")):
            output_folder(path, "--out")


def test_listing_a_missing_file_is_an_error(tmp_path):
    with pytest.raises(ManifestError, match="does not exist"):
        write_manifest(tmp_path, {"nope.txt": None}, "test", {})


def test_atomic_writes_leave_no_temporaries_and_normal_permissions(tmp_path):
    atomic_write_json(tmp_path / "x.json", {"b": 1, "a": [1, 2]})
    atomic_write_json(tmp_path / "x.json", {"b": 2})  # replace
    assert json.loads((tmp_path / "x.json").read_text()) == {"b": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"]
    assert (tmp_path / "x.json").stat().st_mode & 0o040, "group-readable like any file the umask allows"
