"""The overlapped schedule (`train.max_staleness = k >= 1`): rollout n+k generates while step n trains.

A producer thread generates and puts each rollout's rows into the transfer queue (the only way rows
travel); the loop's thread trains on them, takes the rest of the rollout for its logs, and publishes the
weights after every step. Which weights a rollout samples with is a pure function of its id, never of
timing, so a run is reproducible and resumes exactly:

    version v = the weights after training step v - 1 (a run that starts at rollout s starts with v = s)
    rollout r samples with version  max(s, r - k, c + 1),  c the last step before r that saves a checkpoint

The third term drains the pipeline at checkpoints: no rollout after a checkpoint samples with weights
older than the checkpoint's, as a run resumed from it does. With k = 0 every rollout samples with
version r: the synchronous loop (which `Trainer` runs itself when k = 0).

Faults: every wait is bounded (`queue.timeout_s`); a producer failure fails its rollout in the queue,
which wakes the trainer with the error; a trainer failure wakes a producer waiting for weights.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from memrl.engines.base import WeightSource
from memrl.train.setup import TrainingError
from memrl.types import RolloutOutput


def sampling_version(rollout_id: int, start: int, max_staleness: int, saves_after: Callable[[int], bool]) -> int:
    """The weight version rollout `rollout_id` samples with (see the module docstring)."""
    version = max(start, rollout_id - max_staleness)
    for step in range(version, rollout_id):  # a checkpoint inside the window drains it
        if saves_after(step):
            version = step + 1
    return version


class WeightBoard:
    """Weight versions the trainer published (each a `WeightSource` frozen then: a snapshot, or a folder of
    its own for a served engine), for the producer to take exactly the one it needs. Versions no rollout
    can still need are dropped (`discard` removes a version's folder), so at most k + 1 are held."""

    def __init__(self, start_version: int, timeout_s: float,
                 discard: Callable[[WeightSource], None] = lambda source: None) -> None:
        self.cond = threading.Condition()
        self.start = start_version
        self.newest = start_version
        self.timeout_s = timeout_s
        self.discard = discard
        self.versions: dict[int, WeightSource] = {}
        self.error: BaseException | None = None

    def publish(self, version: int, source: WeightSource) -> None:
        with self.cond:
            self.versions[version] = source
            self.newest = version
            self.cond.notify_all()

    def take(self, version: int) -> WeightSource | None:
        """Version `version` once published (None: the engine's starting weights), dropping older ones."""
        deadline = time.monotonic() + self.timeout_s
        with self.cond:
            while self.newest < version and self.error is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TrainingError(f"pipeline: weight version {version} not published within "
                                        f"{self.timeout_s:g}s (queue.timeout_s); the trainer is stuck or slow")
                self.cond.wait(left)
            if self.error is not None:
                raise TrainingError(f"pipeline: the trainer failed ({self.error}); generation stops")
            for old in [v for v in self.versions if v < version]:
                self.discard(self.versions.pop(old))
            if version != self.start and version not in self.versions:
                raise TrainingError(f"pipeline: weight version {version} was not kept (the trainer skipped it)")
            return self.versions.get(version)

    def fail(self, error: BaseException) -> None:
        with self.cond:
            self.error = error
            self.cond.notify_all()

    def discard_all(self) -> None:
        with self.cond:
            for version in list(self.versions):
                self.discard(self.versions.pop(version))


@dataclass
class Produced:
    """One rollout as the trainer logs it: `out` without its rows (those went to the queue), `saved` of them."""

    out: RolloutOutput
    saved: int
    seconds: dict[str, float]
    version: int
    waited_s: float


@dataclass
class Producer:
    """The producer thread: for each rollout id, wait for its weight version, sync, generate, put."""

    rollout_ids: range
    produce: Callable[[int], tuple[RolloutOutput, dict[str, float]]]
    deliver: Callable[[int, RolloutOutput], None]
    sync: Callable[[WeightSource], None]
    version_of: Callable[[int], int]
    board: WeightBoard
    fail_rollout: Callable[[int, BaseException], None]
    results: dict[int, Produced] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock)
    stop: threading.Event = field(default_factory=threading.Event)

    def __post_init__(self) -> None:
        self.engine_version = self.board.start  # the engine starts with the run's starting weights
        self.thread = threading.Thread(target=self._run, name="memrl-rollout-producer", daemon=True)

    def start(self) -> None:
        self.thread.start()

    def _run(self) -> None:
        for rollout_id in self.rollout_ids:
            if self.stop.is_set():
                return
            try:
                version = self.version_of(rollout_id)
                start = time.perf_counter()
                weights = self.board.take(version)
                waited = time.perf_counter() - start
                if version != self.engine_version and weights is not None:
                    self.sync(weights)
                    self.engine_version = version
                out, seconds = self.produce(rollout_id)
                logged = dataclasses.replace(out, rows=None)
                with self.lock:  # before the rows are delivered: the trainer takes both once they are
                    self.results[rollout_id] = Produced(logged, len(out.rows), seconds, version, waited)
                self.deliver(rollout_id, out)
            except BaseException as error:  # noqa: BLE001 - every failure must reach the trainer
                self.fail_rollout(rollout_id, error)  # wakes the trainer waiting for these rows
                return

    def take(self, rollout_id: int) -> Produced:
        with self.lock:
            return self.results.pop(rollout_id)

    def close(self, timeout_s: float) -> bool:
        """Stop (a wait for weights ends now, a generation runs to its end); True when the thread is gone."""
        self.stop.set()
        self.board.fail(TrainingError("the run stopped"))
        self.thread.join(timeout_s)
        if self.thread.is_alive():
            return False
        self.board.discard_all()  # never while a generation might still be syncing from one of them
        return True
