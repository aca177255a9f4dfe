"""The kinds of value a logged record's fields may hold, as `memrl view` checks them (the framework's fields
in memrl.viewer.build, a task's own in its `Task.view_fields`). None, a field the record lacks, passes."""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any


def is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


# kind -> (test, what the value must be)
KINDS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "id": (lambda v: isinstance(v, str) or is_int(v), "a string or integer id"),
    "str": (lambda v: isinstance(v, str), "a string"),
    "number": (lambda v: (is_int(v) or isinstance(v, float)) and math.isfinite(v), "a finite number"),
    "count": (lambda v: is_int(v) and v >= 0, "a whole number >= 0"),
    "bool": (lambda v: isinstance(v, bool), "true or false"),
    "strs": (lambda v: isinstance(v, list) and all(isinstance(x, str) for x in v), "a list of strings"),
    "list": (lambda v: isinstance(v, list), "a list"),
}


def check_kinds(record: dict[str, Any], fields: dict[str, str]) -> None:
    """A ValueError naming the first of `fields` (name -> a `KINDS` key) whose value in `record` is of the
    wrong kind; a task's `view_fields` checks its own fields with it."""
    for name, kind in fields.items():
        value = record.get(name)
        test, what = KINDS[kind]
        if value is not None and not test(value):
            raise ValueError(f"'{name}' is {short_value(value)}, expected {what}")


def short_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."
