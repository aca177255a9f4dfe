"""Atomic file writes and JSON-lines reads: the one place for both rules.

- A write goes to a uniquely named temporary file in the target's folder, is fsynced, then moved into
  place with `os.replace` (atomic on POSIX): a reader sees the old file or the new one, never half of one,
  and two writers of one path never share a temporary.
- A JSON-lines file is split at "\\n" only: memrl writes text unescaped (`ensure_ascii=False`), and a
  U+2028 inside a record is no line break (`str.splitlines` would cut the record there).
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from io import BytesIO
from pathlib import Path
from typing import Any


def atomic_write_bytes(path: str | Path, data: bytes) -> Path:
    """Write `data` to `path` (its folder made if needed) via a temporary sibling + `os.replace`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    # A unique sibling opened with "xb" (not mkstemp, whose 0600 mode would stick to the final file).
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        with open(tmp, "xb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return path


@contextmanager
def atomic_folder(out: str | Path) -> Iterator[Path]:
    """A temporary sibling of the folder `out` (not created yet) for the caller to fill; when the block
    ends it replaces `out`, and on any failure it is removed and `out` is left as it was, so an interrupted
    write never looks finished."""
    out = Path(out)
    tmp = out.with_name(f"{out.name}.tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if out.exists():
        # No moment without a complete folder under `out`'s name: the old one is moved aside first and
        # deleted only after the new one is in place (a rerun of `memrl sft --out DIR` replaces DIR/model).
        old = out.with_name(f"{out.name}.old-{os.getpid()}")
        shutil.rmtree(old, ignore_errors=True)
        os.replace(out, old)
        os.replace(tmp, out)
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.replace(tmp, out)


def atomic_write_text(path: str | Path, text: str) -> Path:
    """`text` as UTF-8 (whatever the locale), written atomically."""
    return atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any, indent: int | None = 2) -> Path:
    """Deterministic JSON (UTF-8, keys in insertion order, trailing newline) written atomically."""
    return atomic_write_text(path, json.dumps(obj, ensure_ascii=False, indent=indent) + "\n")


def atomic_save_figure(path: str | Path, fig: Any, dpi: int | None = None) -> Path:
    """A matplotlib figure saved as PNG, atomically (rendered to memory first); `dpi` None: matplotlib's default."""
    buffer = BytesIO()
    fig.savefig(buffer, format="png", dpi=dpi)
    return atomic_write_bytes(path, buffer.getvalue())


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def jsonl_lines(path: str | Path, bad_line: Callable[[int, Exception], Exception], *, torn_tail: bool = False,
               nan_ok: bool = True) -> list[tuple[int, Any]]:
    """(line number from 1, value) of each non-blank line of the JSON-lines file at `path`; a line that is
    not UTF-8 or JSON (or, without `nan_ok`, holds NaN / Infinity) raises what `bad_line(number, error)` returns.
    With `torn_tail`, what follows the last "\\n" is a write cut by a kill (memrl appends whole lines) and is
    left out; without it (files people write may lack the final newline) it is read like any other line."""
    data = Path(path).read_bytes()
    if torn_tail:
        data = data[:data.rfind(b"\n") + 1]
    parse_constant = None if nan_ok else _no_constant
    out = []
    for number, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        try:
            out.append((number, json.loads(raw.decode("utf-8"), parse_constant=parse_constant)))
        except (ValueError, RecursionError) as e:  # not UTF-8, not JSON, NaN / Infinity, nested too deep
            raise bad_line(number, e) from e
    return out


def cut_torn_tail(path: str | Path) -> None:
    """Cut what follows the last "\\n" of `path` off the file (fsynced), so that appends start a new line."""
    with open(path, "r+b") as f:
        data = f.read()
        end = data.rfind(b"\n") + 1
        if end < len(data):
            f.truncate(end)
            f.flush()
            os.fsync(f.fileno())
