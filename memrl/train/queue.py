"""TransferQueue: hands each rollout id's training rows from the producer (rollout + converter) to the
trainer, with exact row counts, bounded capacity and no silent hang. A rollout is complete when the
`train_row_count` its first put announced (1:N) has arrived, or (1:1, no count) at its `final=True` put;
`get_rollout` waits for that and takes every row, in put order.

Invariants:
- Rows held never exceed `capacity_rows`: a put beyond raises `QueueOverflowError` (never drops or blocks).
- Every wait has a timeout. `fail` wakes that rollout's waiters (`RolloutFailedError` from the error),
  `close` every waiter (`QueueClosedError`). A producer's protocol error (bad or changed count,
  over-count, overflow, a final put short of the count) raises to it and fails the rollout, so the
  consumer wakes at once. A consumed rollout's stats never change: later puts only raise.
- Arguments are checked, not coerced: ids and counts are ints (not bools), timeouts finite and > 0 (a
  NaN timeout waited forever).

Thread-safe (one Condition): the pipeline's producer thread puts while the loop waits; the Ray driver
holds one reference per row in it. Exceptions carry only a message, so they pickle.
"""

from __future__ import annotations

import math
import numbers
import threading
import time
from dataclasses import dataclass, field
from typing import Any, NoReturn

from memrl.config import QueueConfig
from memrl.errors import MemrlError


class QueueError(RuntimeError, MemrlError):
    """Misuse of the queue protocol; the message names the rollout id, the numbers and what to change."""


class QueueOverflowError(QueueError):
    """A put would hold more rows than the queue's capacity."""


class QueueTimeoutError(QueueError, TimeoutError):
    """A wait ran past its timeout; the message says how many rows had arrived out of how many."""


class RolloutFailedError(QueueError):
    """The producer reported the rollout as failed; `__cause__` is the original error."""


class QueueClosedError(QueueError):
    """The queue was closed while waiting, or is used after `close()`."""


@dataclass
class _Rollout:
    expected: int | None = None        # announced train_row_count
    finished: bool = False             # 1:1 path: put(final=True) called
    rows: list[Any] = field(default_factory=list)  # rows put and not yet taken, in put order
    rows_put: int = 0
    taken: bool = False                # a consumer took every row (get_rollout hands them out at once)
    error: BaseException | None = None

    @property
    def target(self) -> int | None:
        """Total rows this rollout will deliver, once known."""
        if self.expected is not None:
            return self.expected
        return self.rows_put if self.finished else None

    @property
    def complete(self) -> bool:
        return self.target is not None and self.rows_put == self.target

    @property
    def status(self) -> str:
        if self.error is not None:
            return "failed"
        if self.taken:
            return "consumed"
        return "complete" if self.complete else "open"


def _is_int(value: object) -> bool:
    """An integer that is not a bool (Python counts True as 1, never a row count)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _checked_int(value: object, name: str) -> int:
    if not _is_int(value):
        raise QueueError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    return int(value)


def _checked_timeout(value: object) -> float:
    """A wait's timeout: NaN made the deadline test never true (a wait forever), inf overflowed the wait."""
    if not (isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value) and value > 0):
        raise QueueError(f"timeout_s (queue.timeout_s) must be a finite number of seconds > 0, got {value!r}")
    return float(value)


class TransferQueue:
    """Rows per rollout id, with exact counts, capacity, timeouts and failure wake-up."""

    def __init__(self, capacity_rows: int, timeout_s: float = 1800.0) -> None:
        capacity_rows = _checked_int(capacity_rows, "capacity_rows")
        timeout_s = _checked_timeout(timeout_s)
        if capacity_rows <= 0:
            raise QueueError(f"capacity_rows must be > 0, got {capacity_rows}")
        self.capacity_rows = capacity_rows
        self.timeout_s = timeout_s
        self._cond = threading.Condition()
        self._rollouts: dict[int, _Rollout] = {}
        self._held = 0
        self._closed = False

    @classmethod
    def from_config(cls, queue_cfg: QueueConfig, rollout_batch_size: int, n_samples: int,
                    rows_per_trajectory: int) -> TransferQueue:
        """Room for `rollout_batch_size` x `n_samples` trajectories at the largest expansion (in rows)."""
        return cls(rollout_batch_size * n_samples * rows_per_trajectory, queue_cfg.timeout_s)

    # ---- producer -------------------------------------------------------------------------------

    def put(self, rollout_id: int, rows: list[Any], train_row_count: int | None = None, final: bool = False) -> None:
        """Add `rows` of `rollout_id` (all or nothing). `train_row_count` announces the exact total (once;
        the same number again is fine); `final=True` ends the rollout (with a count: it must be reached)."""
        rows = list(rows)
        if not isinstance(final, bool):
            raise QueueError(f"rollout {rollout_id}: final must be True or False, got {final!r}")
        with self._cond:
            state = self._producer_state(rollout_id)
            if train_row_count is not None:
                self._announce_locked(rollout_id, state, train_row_count)
            if state.expected is not None and state.rows_put + len(rows) > state.expected:
                self._fail_locked(rollout_id, state, QueueError(
                    f"rollout {rollout_id}: putting {len(rows)} rows after {state.rows_put} exceeds the announced "
                    f"train_row_count = {state.expected}; the converter must produce exactly the count it announces"))
            if self._held + len(rows) > self.capacity_rows:
                self._fail_locked(rollout_id, state, QueueOverflowError(
                    f"rollout {rollout_id}: putting {len(rows)} rows while {self._held} are held exceeds the queue "
                    f"capacity of {self.capacity_rows} rows (rollout_batch_size × n_samples × "
                    f"queue.train_sample_expansion_factor); raise queue.train_sample_expansion_factor"))
            state.rows.extend(rows)
            state.rows_put += len(rows)
            self._held += len(rows)
            if final:
                self._finish_locked(rollout_id, state)
            self._cond.notify_all()

    def fail(self, rollout_id: int, error: BaseException) -> None:
        """Drop `rollout_id`'s rows; its waiters, puts and gets raise `RolloutFailedError` from `error`."""
        with self._cond:
            state = self._rollouts.setdefault(_checked_int(rollout_id, "rollout_id"), _Rollout())
            # A consumed rollout has no waiter left, and its rows were trained on: it stays consumed.
            if state.error is None and not state.taken:
                self._drop_rows_locked(state)
                state.error = error
            self._cond.notify_all()

    def close(self) -> None:
        """Wake every waiter with `QueueClosedError`; every later call raises it too."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    # ---- consumer -------------------------------------------------------------------------------

    def get_rollout(self, rollout_id: int) -> list[Any]:
        """Wait until `rollout_id` is complete, then take all its rows in put order (releasing capacity)."""
        with self._cond:
            state = self._checked(rollout_id)
            self._wait_locked(rollout_id)
            if state.taken:
                raise QueueError(f"rollout {rollout_id} was already consumed ({state.rows_put} rows)")
            rows, state.rows, state.taken = state.rows, [], True
            self._held -= len(rows)
            self._cond.notify_all()
            return rows

    # ---- inspection -----------------------------------------------------------------------------

    def stats(self, rollout_id: int) -> dict[str, Any]:
        """rows_put, rows_taken, expected (None while unknown), held, status (open|complete|consumed|failed)."""
        with self._cond:
            state = self._rollouts.get(_checked_int(rollout_id, "rollout_id"), _Rollout())
            return {"rows_put": state.rows_put, "rows_taken": state.rows_put if state.taken else 0,
                    "expected": state.target, "held": len(state.rows), "status": state.status}

    # ---- internals (call with the lock held) ----------------------------------------------------

    def _producer_state(self, rollout_id: int) -> _Rollout:
        state = self._checked(rollout_id)
        if state.finished:
            raise QueueError(f"rollout {rollout_id} was already finished with {state.rows_put} rows; "
                             f"nothing more can be put for it")
        # Raise to the late producer only: failing the rollout here would rewrite the stats of a step
        # that was already trained on.
        if state.taken:
            raise QueueError(f"rollout {rollout_id} was already consumed ({state.rows_put} rows trained on); "
                             f"nothing more can be put for it (is the producer using a stale rollout id?)")
        return state

    def _checked(self, rollout_id: int) -> _Rollout:
        """The rollout's state, raising if the queue is closed or the rollout failed."""
        if self._closed:
            raise QueueClosedError(f"rollout {rollout_id}: the queue was closed")
        state = self._rollouts.setdefault(_checked_int(rollout_id, "rollout_id"), _Rollout())
        if state.error is not None:
            raise RolloutFailedError(f"rollout {rollout_id} failed: {state.error!r}") from state.error
        return state

    def _announce_locked(self, rollout_id: int, state: _Rollout, count: int) -> None:
        if not _is_int(count):
            problem = f"train_row_count must be an int, got {count!r} ({type(count).__name__})"
        elif state.expected is not None and count != state.expected:
            problem = f"train_row_count = {count} differs from the {state.expected} announced before"
        elif state.expected is not None:
            return
        elif count <= 0:
            problem = f"train_row_count must be > 0, got {count}"
        elif count > self.capacity_rows:
            self._fail_locked(rollout_id, state, QueueOverflowError(
                f"rollout {rollout_id}: train_row_count = {count} exceeds the queue capacity of "
                f"{self.capacity_rows} rows; raise queue.train_sample_expansion_factor"))
        elif count < state.rows_put:
            problem = f"train_row_count = {count} is below the {state.rows_put} rows already put"
        else:
            state.expected = int(count)
            return
        self._fail_locked(rollout_id, state, QueueError(f"rollout {rollout_id}: {problem}"))

    def _finish_locked(self, rollout_id: int, state: _Rollout) -> None:
        if state.expected is not None and state.rows_put != state.expected:
            self._fail_locked(rollout_id, state, QueueError(
                f"rollout {rollout_id}: final put after {state.rows_put} rows, but {state.expected} were announced"))
        state.finished = True

    def _fail_locked(self, rollout_id: int, state: _Rollout, error: QueueError) -> NoReturn:
        """Fail the rollout (waking its waiters with `error` as cause), then raise `error` to the producer."""
        self._drop_rows_locked(state)
        state.error = error
        self._cond.notify_all()
        raise error

    def _drop_rows_locked(self, state: _Rollout) -> None:
        self._held -= len(state.rows)
        state.rows = []

    def _wait_locked(self, rollout_id: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while not self._checked(rollout_id).complete:  # raises on close/failure: how waiters wake with errors
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                state = self._rollouts[rollout_id]
                expected = "not yet announced" if state.target is None else str(state.target)
                raise QueueTimeoutError(
                    f"rollout {rollout_id}: waited {self.timeout_s:.1f} s for all rows; received {state.rows_put} "
                    f"rows so far, expected {expected}; the producer may have died without calling fail(), or "
                    f"raise queue.timeout_s")
            self._cond.wait(remaining)
