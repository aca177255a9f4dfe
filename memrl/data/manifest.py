"""SHA-256 manifests for prepared data, and the check of an output folder option.

Every folder `memrl prepare-data` writes holds a `manifest.json`:

    {"files": {"<relative POSIX path>": {"sha256": "...", "bytes": 123, "records": 60}, ...},
     "created_by": "memrl prepare-data hotpotqa", "args": {...}, "history": [...]}

written atomically and last, after every file it lists. The checks of a command's outputs are here too:
`output_folder`, `output_file`, and `refuse_inputs_as_outputs` (no command writes over a file it reads).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from memrl.errors import MemrlError
from memrl.io import atomic_write_json

MANIFEST_NAME = "manifest.json"


class ManifestError(ValueError, MemrlError):
    """A prepared file is missing, changed, or not listed in its folder's manifest."""


class OutputFolderError(ValueError, MemrlError):
    """An output (a command's --out, --run-root, OUT) that cannot be written as asked: a folder where a file
    goes or the reverse, or a file the command also reads."""


def output_folder(path: str | Path, option: str) -> Path:
    """`path` as a Path if a folder can be made there (it is one, or its first existing parent is one).
    Commands check it before reading their inputs: a file there was a traceback at the first write, after
    the work. `option` names the flag in the message."""
    path = Path(path)
    existing = next((p for p in (path, *path.parents) if p.exists()), None)
    if existing is not None and not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise OutputFolderError(f"{option} {path} {where}; pass a new or existing folder")
    return path


def output_file(path: str | Path, option: str, inputs: Iterable[tuple[str, str | Path | None]] = ()) -> Path:
    """`path` as a Path if a file can be written there (not a folder, under no file) that is none of
    `inputs` (`refuse_inputs_as_outputs`); checked before any input is read."""
    path = Path(path)
    if path.is_dir():
        raise OutputFolderError(f"{option} {path} is a folder; pass a file path, e.g. {path / 'out.jsonl'}")
    output_folder(path.parent, f"the folder of {option}")
    refuse_inputs_as_outputs([path], inputs)
    return path


def refuse_inputs_as_outputs(outputs: Iterable[str | Path], inputs: Iterable[tuple[str, str | Path | None]]) -> None:
    """An `OutputFolderError` when a file the command will write is one it reads (`inputs`: (option, path)
    pairs), whatever the spelling: another relative path, a symlink or a hard link to it (os.path.samefile).
    Writing it would replace the input with what was made from it, silently. An output not there yet is
    compared by where it would be (`sub/../data.jsonl`, whose missing `sub` the writer creates, is the input)."""
    inputs = [(option, Path(p)) for option, p in inputs if p is not None and Path(p).exists()]

    def same(out: Path, source: Path) -> bool:
        return os.path.samefile(out, source) if out.exists() else os.path.realpath(out) == os.path.realpath(source)

    for out in map(Path, outputs):
        clash = next(((option, p) for option, p in inputs if same(out, p)), None)
        if clash is not None:
            raise OutputFolderError(f"{clash[0]} {clash[1]} would be overwritten: the command writes {out}, the same "
                                    f"file; write the output elsewhere (or move the input)")


def sha256_file(path: str | Path) -> str:
    """Hex SHA-256 of a file, read in blocks (prepared files can be hundreds of MB)."""
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def read_manifest(folder: str | Path) -> dict[str, Any]:
    path = Path(folder) / MANIFEST_NAME
    if not path.is_file():
        raise ManifestError(f"no {MANIFEST_NAME} in '{folder}'; prepare the data with `memrl prepare-data`")
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise ManifestError(f"'{path}' is not valid JSON ({e}); re-run `memrl prepare-data`") from e
    problem = _shape_problem(manifest)
    if problem is not None:
        raise ManifestError(f"'{path}' {problem}; re-run `memrl prepare-data`")
    return manifest


def _shape_problem(manifest: Any) -> str | None:
    """What makes a parsed manifest unusable (None if nothing): checked once, where it is read, so that
    an edited entry (`"a.jsonl": 5`, `"history": 5`) is named here instead of failing in a reader."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        return "has no 'files' mapping"
    for name, entry in manifest["files"].items():
        if not (isinstance(entry, dict) and isinstance(entry.get("sha256"), str)
                and type(entry.get("bytes")) is int):
            return (f"has a malformed entry for '{name}' (expected {{\"sha256\": \"...\", \"bytes\": N}}, "
                    f"got {json.dumps(entry)})")
    if not isinstance(manifest.get("history", []), list):
        return f"has a 'history' that is not a list (got {json.dumps(manifest['history'])})"
    return None


def write_manifest(folder: str | Path, records: dict[str, int | None], created_by: str,
                   args: dict[str, Any]) -> Path:
    """Hash the files named in `records` (relative path -> record count or None) and write the manifest.
    Entries of an existing manifest for other files that still exist are kept (two commands may write
    into one folder); the previous `created_by`/`args` move into `history`."""
    folder = Path(folder)
    try:
        previous = read_manifest(folder)
    except ManifestError:  # none yet, or broken: replaced wholesale; its files are re-listed below if named
        previous = {}
    files: dict[str, Any] = {
        name: entry for name, entry in previous.get("files", {}).items()
        if name not in records and (folder / name).is_file()
    }
    for name, count in records.items():
        path = folder / name
        if not path.is_file():
            raise ManifestError(f"cannot list '{path}' in the manifest: the file does not exist")
        files[Path(name).as_posix()] = {"sha256": sha256_file(path), "bytes": path.stat().st_size,
                                        "records": count}
    history = list(previous.get("history", []))
    if previous.get("created_by"):
        history.append({"created_by": previous["created_by"], "args": previous.get("args", {})})
    manifest = {"files": dict(sorted(files.items())), "created_by": created_by, "args": args,
                "history": history}
    return atomic_write_json(folder / MANIFEST_NAME, manifest)


def verify_manifest(folder: str | Path, files: list[str] | None = None) -> dict[str, Any]:
    """Check size and SHA-256 of `files` (relative to `folder`; default: every listed file); returns the
    manifest, or raises `ManifestError` naming the first file that is missing, unlisted or changed."""
    folder = Path(folder)
    manifest = read_manifest(folder)
    listed: dict[str, Any] = manifest["files"]
    names = list(listed) if files is None else [Path(f).as_posix() for f in files]
    for name in names:
        entry = listed.get(name)
        path = folder / name
        if entry is None:
            raise ManifestError(f"'{path}' is not listed in '{folder / MANIFEST_NAME}'; "
                                f"prepare it with `memrl prepare-data` (or pass verify=False)")
        if not path.is_file():
            raise ManifestError(f"'{path}' is listed in the manifest but missing; re-run `memrl prepare-data`")
        size = path.stat().st_size
        if size != entry.get("bytes") or sha256_file(path) != entry.get("sha256"):
            raise ManifestError(f"'{path}' changed since it was prepared (SHA-256/size differ from "
                                f"{MANIFEST_NAME}); re-run `memrl prepare-data` rather than editing it")
    return manifest
