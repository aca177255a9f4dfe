"""memrl.io: atomic writes (old file or new, never half, no temporary left) and the one JSON-lines reader."""

import json
import os

import pytest

from memrl.data.records import DataError, read_jsonl_lines
from memrl.eval.results import EvalError, read_results
from memrl.io import (
    atomic_folder,
    atomic_save_figure,
    atomic_write_bytes,
    atomic_write_json,
    cut_torn_tail,
    jsonl_lines,
)
from memrl.train.checkpoint import COMPLETE_MARKER, write_best
from memrl.train.run_log import RunLogger, read_metrics
from memrl.train.sources import save_raw_rollout
from memrl.types import RolloutOutput

# A record holding characters that `str.splitlines` takes for line breaks (json.dumps leaves them unescaped
# with ensure_ascii=False, as memrl writes its logs).
BREAKS = "a\u2028b\u2029c\x85d\x1ce"


class Refused:
    """A reader's `bad_line`: the caller's error class, with the line number and what was wrong."""

    def __init__(self, error):
        self.error = error

    def __call__(self, number, error):
        return self.error(f"line {number}: {type(error).__name__}")


def lines_of(path, **options):
    return jsonl_lines(path, Refused(ValueError), **options)


# ------------------------------------------------------------------------------------------ writes

def test_atomic_write_replaces_whole_file_and_leaves_no_temporary(tmp_path):
    atomic_write_json(tmp_path / "sub" / "x.json", {"b": 1, "é": [1, 2]})
    atomic_write_bytes(tmp_path / "sub" / "x.json", b"new")
    assert [p.name for p in (tmp_path / "sub").iterdir()] == ["x.json"]
    assert (tmp_path / "sub" / "x.json").read_bytes() == b"new"


def test_a_failed_write_keeps_the_old_file(tmp_path, monkeypatch):
    atomic_write_bytes(tmp_path / "x.json", b"old")

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        atomic_write_bytes(tmp_path / "x.json", b"new")
    assert [p.name for p in tmp_path.iterdir()] == ["x.json"] and (tmp_path / "x.json").read_bytes() == b"old"


def test_an_atomic_folder_replaces_a_folder_that_holds_files_and_a_failure_keeps_it(tmp_path):
    # `memrl sft --out DIR` run twice writes DIR/model twice: the second must replace the first.
    out = tmp_path / "model"
    for weights in (b"first", b"second"):
        with atomic_folder(out) as tmp:
            tmp.mkdir()
            (tmp / "weights.bin").write_bytes(weights)
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (out / "weights.bin").read_bytes() == b"second"
    with pytest.raises(RuntimeError, match="killed"), atomic_folder(out) as tmp:
        tmp.mkdir()
        raise RuntimeError("killed while writing")
    assert [p.name for p in tmp_path.iterdir()] == ["model"] and (out / "weights.bin").read_bytes() == b"second"


def best_json(root):
    (root / "checkpoints" / "iter_0000000").mkdir(parents=True)
    (root / "checkpoints" / "iter_0000000" / COMPLETE_MARKER).write_text("")
    return lambda: write_best(root, 0, "em", 1.0, "max")


def rollout_log(root):
    def write():
        with RunLogger(root, use_tensorboard=False) as run:
            run.log_rollout(0, [{"text": BREAKS}])

    RunLogger(root, use_tensorboard=False).close()  # the logger's own files exist before the write
    return write


def raw_rollout(root):
    (root / "raw").mkdir()
    return lambda: save_raw_rollout(root / "raw", 0, RolloutOutput([]))


def figure(root):
    from matplotlib.figure import Figure

    return lambda: atomic_save_figure(root / "plot.png", Figure())


# Writers of memrl's result files, each through memrl.io: the hand-written copies it replaced left their
# temporary file behind when the final rename failed.
@pytest.mark.parametrize("prepare", [best_json, rollout_log, raw_rollout, figure])
def test_a_failed_write_leaves_no_temporary(prepare, tmp_path, monkeypatch):
    write = prepare(tmp_path)
    before = sorted(tmp_path.rglob("*"))

    def refuse(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(OSError, match="disk full"):
        write()
    assert sorted(tmp_path.rglob("*")) == before


# ------------------------------------------------------------------------------------------ JSON lines

def test_lines_end_at_newline_only(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in [{"t": BREAKS}, {"t": "z"}]),
                    encoding="utf-8")
    assert BREAKS.splitlines() != [BREAKS]  # what a reader splitting at these characters would cut
    assert lines_of(path) == [(1, {"t": BREAKS}), (2, {"t": "z"})]


def test_torn_tail_is_left_out_or_read_as_asked(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n\n  \n{"a": 2}\n{"a": 3}')  # blank lines skipped, numbers kept
    assert lines_of(path, torn_tail=True) == [(1, {"a": 1}), (4, {"a": 2})]
    assert lines_of(path) == [(1, {"a": 1}), (4, {"a": 2}), (5, {"a": 3})]  # a file without its last newline
    path.write_bytes(b'{"a": 1}\n{"a"')
    assert lines_of(path, torn_tail=True) == [(1, {"a": 1})]
    with pytest.raises(ValueError, match="line 2: JSONDecodeError"):
        lines_of(path)


@pytest.mark.parametrize(("data", "found"), [(b'{"a": 1}\n\xff\n', "UnicodeDecodeError"),
                                             (b'{"a": 1}\n{"a"\n{"a": 2}\n', "JSONDecodeError"),
                                             (b'{"a": 1}\n' + b"[" * 100_000 + b"\n", "RecursionError")])
def test_a_bad_line_raises_the_callers_error_with_its_number(tmp_path, data, found):
    path = tmp_path / "x.jsonl"
    path.write_bytes(data)
    with pytest.raises(KeyError, match=f"line 2: {found}"):
        jsonl_lines(path, Refused(KeyError), torn_tail=True)


def test_nan_only_where_allowed(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": NaN}\n')
    assert lines_of(path)[0][1]["a"] != lines_of(path)[0][1]["a"]
    with pytest.raises(ValueError, match="line 1"):
        lines_of(path, nan_ok=False)


def test_cut_torn_tail(tmp_path):
    path = tmp_path / "x.jsonl"
    path.write_bytes(b'{"a": 1}\n{"a"')
    cut_torn_tail(path)
    assert path.read_bytes() == b'{"a": 1}\n'
    cut_torn_tail(path)  # a whole file stays as it is
    assert path.read_bytes() == b'{"a": 1}\n'


# The readers that were hand-written: U+2028 cut a record (str.splitlines), a byte that is not UTF-8 was a
# UnicodeDecodeError traceback instead of the reader's named error.

def test_metrics_reader_keeps_a_record_with_line_separators(tmp_path):
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text(json.dumps({"rollout_id": 0, "note": BREAKS},
                                                                ensure_ascii=False) + "\n", encoding="utf-8")
    assert read_metrics(tmp_path) == [{"rollout_id": 0, "note": BREAKS}]


def test_sft_reader_keeps_a_demonstration_with_line_separators(tmp_path):
    from memrl.tiny import build_tiny_tokenizer
    from memrl.train.sft_data import load_demonstrations

    tok = build_tiny_tokenizer()
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"turns": [{"prompt": "Q", "response": BREAKS}]}, ensure_ascii=False) + "\n",
                    encoding="utf-8")
    ((_, response),) = load_demonstrations(path, tok)[0]
    assert tok.decode(response[:-1]) == BREAKS


def test_data_reader_names_a_line_that_is_not_utf8(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "\xff"}\n')
    with pytest.raises(DataError, match="line 2 is not valid JSON"):
        read_jsonl_lines(path)


def test_results_reader_names_a_line_that_is_not_utf8(tmp_path):
    path = tmp_path / "results.jsonl"
    path.write_bytes(b'{"id": "a"}\n{"id": "\xff"}\n{"id": "b"')
    with pytest.raises(EvalError, match="line 2 is not valid JSON"):
        read_results(path, repair=True)
    assert path.read_bytes() == b'{"id": "a"}\n{"id": "\xff"}\n'  # the torn write was cut off first
