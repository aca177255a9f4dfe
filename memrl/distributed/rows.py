"""Training rows that go from the rollout worker that made them straight to the trainer ranks.

A slice's rows go once into Ray's object store (`put_rows`); the driver's queue holds and counts one
`RowRef` per row, and each rank fetches the slices itself (`fetch_rows`). The object belongs to the
worker that put it: if that worker dies before the fetch, the fetch fails with an error that says so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from memrl.errors import MemrlError
from memrl.types import TrainRow


class RowFetchError(RuntimeError, MemrlError):
    """A trainer rank could not fetch a step's rows (the driver names the rank that raised it)."""


@dataclass(frozen=True)
class RowRef:
    """Row `index` of the list of rows held in the object store under `slice_ref`; `group_id` is the row's
    prompt group, so the driver can keep or drop a group's rows without fetching them (dynamic sampling)."""

    slice_ref: Any  # ray.ObjectRef of a list[TrainRow]
    index: int
    group_id: str = ""


def put_rows(rows: list[TrainRow]) -> list[RowRef]:
    """`rows` into the object store as one object; one reference per row, in order."""
    import ray

    ref = ray.put(rows)
    return [RowRef(ref, k, row.group_id) for k, row in enumerate(rows)]


def fetch_rows(refs: Sequence[RowRef], timeout_s: float) -> list[TrainRow]:
    """The rows behind `refs`, in order: each slice fetched once, within `timeout_s`."""
    import ray
    from ray.exceptions import GetTimeoutError, RayError

    slices = list(dict.fromkeys(r.slice_ref for r in refs))
    try:
        fetched = dict(zip(slices, ray.get(slices, timeout=timeout_s), strict=True))
    except GetTimeoutError as error:
        raise RowFetchError(f"the step's rows ({len(slices)} slices) could not be fetched within {timeout_s:g}s "
                          f"(ray.sync_timeout_s)") from error
    except RayError as error:  # e.g. the rollout worker that owned the rows died
        raise RowFetchError(f"the step's rows could not be fetched: the rollout worker that made them is gone? "
                          f"({type(error).__name__}: {error})") from error
    rows = []
    for ref in refs:
        held = fetched[ref.slice_ref]
        if not 0 <= ref.index < len(held):
            raise RowFetchError(f"a row reference points at row {ref.index} of a slice of {len(held)} rows")
        rows.append(held[ref.index])
    return rows
