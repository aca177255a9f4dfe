"""The question record every data source turns into, and our prepared JSONL format.

One JSON object per line: {"id", "question", "answers", "context", "metadata"}; `context` is the whole
document the reader sees, `metadata` what the source adds (gold positions, seeds, ...). Ids are non-empty
and unique within a file, `answers` a non-empty list of strings; a record that breaks this is a
`DataError` naming the file, the record (its line, or its index in a JSON list, and its id) and the field.
"""

from __future__ import annotations

import gzip
import json
import zlib
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memrl.data.manifest import MANIFEST_NAME, verify_manifest
from memrl.errors import MemrlError
from memrl.io import atomic_write_text, jsonl_lines


class Line(int):
    """A record's 1-based line in a JSONL file, passed where a record index goes: errors then name the
    line a user can jump to, not a position among non-blank lines."""


def location(index: int) -> str:
    return f"line {index}" if isinstance(index, Line) else f"record {index}"


class DataError(ValueError, MemrlError):
    """A malformed data record; the message names the file, the record and the field."""

    def __init__(self, source: str | Path, problem: str, index: int | None = None,
                 record_id: Any = None, field: str | None = None):
        where = [str(source)]
        if index is not None:
            where.append(location(index) + (f" (id {record_id!r})" if record_id is not None else ""))
        if field is not None:
            where.append(f"field '{field}'")
        super().__init__(": ".join(where) + f": {problem}")
        self.source, self.index, self.record_id, self.field = str(source), index, record_id, field


class MissingDependencyError(ImportError, MemrlError):
    """An optional package (e.g. `datasets`) is needed for a download path; the message says what to install."""


# What a hub download's missing package can be replaced by (`require_module`'s `instead`).
OFFLINE = "offline, use a local copy instead (--from-file / --from-dir)"


def require_module(name: str, purpose: str, extra: str, instead: str = "") -> Any:
    """Import an optional module lazily, or say how to install it (and what to do `instead`, if anything)."""
    import importlib

    try:
        return importlib.import_module(name)
    except ImportError as e:
        raise MissingDependencyError(f"{purpose} needs the '{name}' package: pip install 'memrl[{extra}]' (or pip "
                                     f"install {name}){'; ' + instead if instead else ''}") from e


@dataclass
class QuestionRecord:
    id: str
    question: str
    answers: list[str]
    context: str
    metadata: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def checked_id(raw: Any, key: str, source: Any, index: int) -> str:
    """The non-empty string id under `key` of the JSON object `raw`, or a `DataError` naming the record."""
    if not isinstance(raw, dict):
        raise DataError(source, f"expected a JSON object, got {type(raw).__name__}", index)
    record_id = raw.get(key)
    if not isinstance(record_id, str) or not record_id:
        raise DataError(source, f"must be a non-empty string, got {record_id!r}", index, record_id, key)
    return record_id


def question_record_from_dict(raw: Any, source: str | Path, index: int) -> QuestionRecord:
    record_id = checked_id(raw, "id", source, index)
    for name in ("question", "context"):
        if not isinstance(raw.get(name), str):
            raise DataError(source, f"must be a string, got {type(raw.get(name)).__name__}", index, record_id, name)
    answers = raw.get("answers")
    if not isinstance(answers, list) or not answers or not all(isinstance(a, str) for a in answers):
        raise DataError(source, f"must be a non-empty list of strings, got {answers!r}", index, record_id, "answers")
    metadata = raw.get("metadata", {})
    if not isinstance(metadata, dict):
        raise DataError(source, f"must be an object, got {type(metadata).__name__}", index, record_id, "metadata")
    return QuestionRecord(record_id, raw["question"], list(answers), raw["context"], dict(metadata))


def write_jsonl(path: str | Path, records: list[QuestionRecord] | list[dict[str, Any]]) -> int:
    """Records (QuestionRecords or dicts) as UTF-8 JSONL, atomically and byte-deterministic; returns the count."""
    lines = [json.dumps(r.to_dict() if isinstance(r, QuestionRecord) else r, ensure_ascii=False) for r in records]
    atomic_write_text(path, "".join(line + "\n" for line in lines))
    return len(lines)


def read_jsonl_lines(path: str | Path) -> list[tuple[Line, Any]]:
    path = Path(path)
    if not path.is_file():
        raise DataError(path, "file does not exist")
    # The last line is read even without its newline: these files are often written by hand or other tools.
    lines = jsonl_lines(path, lambda number, e: DataError(path, f"line {number} is not valid JSON: {e}"))
    return [(Line(number), value) for number, value in lines]


# The most bytes a .gz file may decompress to: a few hundred bytes of a hostile file could otherwise expand to
# gigabytes before anything is checked (the official HotpotQA train file is ~0.57 GB).
GUNZIP_LIMIT = 4 << 30


def _gunzipped(path: Path) -> bytes:
    limit = GUNZIP_LIMIT
    with gzip.open(path, "rb") as f:
        data = f.read(limit + 1)
    if len(data) > limit:
        raise DataError(path, f"decompresses to more than {limit:,} bytes; decompress it yourself if it is what "
                              f"you meant to read")
    return data


def read_json_list(path: Path, what: str) -> list[Any]:
    """The JSON list in the file at `path` (gzip-compressed when its name ends in .gz, as the HotpotQA records
    memrl ships); `what` names its items in the error."""
    try:
        rows = json.loads(_gunzipped(path) if path.suffix == ".gz" else path.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise DataError(path, f"not valid JSON: {e}") from e
    except (gzip.BadGzipFile, EOFError, zlib.error) as e:  # not gzip, cut short, or damaged
        raise DataError(path, f"not a complete gzip file ({e}); pass the .json.gz as written, or the .json") from e
    if not isinstance(rows, list):
        raise DataError(path, f"expected a JSON list of {what}, got {type(rows).__name__}")
    return rows


def check_unique_ids(records: Sequence[Any], source: str | Path,
                     positions: Sequence[int] | None = None) -> None:
    """Ids must be unique; `positions` (e.g. `Line`s) name the records in the error, default their index."""
    positions = positions if positions is not None else list(range(len(records)))
    seen: dict[str, int] = {}
    for at, record in zip(positions, records, strict=True):
        if record.id in seen:
            raise DataError(source, f"duplicate id, first seen at {location(seen[record.id])}", at, record.id, "id")
        seen[record.id] = at


def verify_if_manifest(path: str | Path) -> None:
    path = Path(path)
    if (path.parent / MANIFEST_NAME).is_file():
        verify_manifest(path.parent, [path.name])


def load_questions(path: str | Path, verify: bool = True) -> list[QuestionRecord]:
    """A prepared JSONL file as validated QuestionRecords; with `verify`, first checked against its folder's
    manifest when there is one."""
    path = Path(path)
    if verify:
        verify_if_manifest(path)
    rows = read_jsonl_lines(path)
    records = [question_record_from_dict(raw, path, line) for line, raw in rows]
    check_unique_ids(records, path, [line for line, _ in rows])
    return records
