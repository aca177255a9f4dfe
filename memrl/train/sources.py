"""Where a training step's trajectories come from, in one process: `LocalRollout` (the task's `generate`
over one engine) and `ReplayRollout` (the `--save-rollouts` files of an earlier run). Both hand the loop
scored, converted rows (`memrl.train.setup.convert_rollout`); the Ray rollout pool wraps `LocalRollout`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Protocol

from memrl.config import Config
from memrl.data.records import DataError, read_jsonl_lines
from memrl.engines.base import Engine, ScoreResult, SyncProbe, WeightSource
from memrl.engines.factory import served_engine
from memrl.io import atomic_write_text
from memrl.rollout import RolloutContext, record_weight_version
from memrl.task import Task, task_reward
from memrl.train.setup import TrainingError, convert_rollout
from memrl.types import RolloutOutput, Trajectory


class RolloutSource(Protocol):
    """What the loop asks of a rollout source: never its kind, only what it can do. `generates`: it samples
    (a replay does not: nothing to sync-check or re-sample); `in_process`: its engine runs here on its own
    event loop (`engine`, `loop`: validation during training needs them); `takes_folders`: its engines
    reload weights from a folder (served engines). A source that serves dynamic sampling also takes
    `slot_offset=`, the position of `records[0]` in the step's batch (`RolloutContext.slot_offset`)."""

    generates: bool
    in_process: bool
    takes_folders: bool

    def generate(self, rollout_id: int, records: Sequence[Any],
                 weight_version: int | None = None) -> RolloutOutput:
        ...

    def sync_from(self, source: WeightSource) -> None: ...

    def score_probe(self, probe: SyncProbe) -> dict[str, ScoreResult]:
        """Each engine's scores of the weight-sync probe, by engine name (a replay is never asked)."""
        ...

    def close(self) -> None: ...


def raw_rollout_path(directory: Path, rollout_id: int) -> Path:
    return Path(directory) / f"rollout_{rollout_id:07d}.jsonl"


def save_raw_rollout(directory: Path, rollout_id: int, out: RolloutOutput) -> Path:
    """Raw trajectories of one step (debug replay input), written atomically."""
    header = {"rollout_id": rollout_id, "train_row_count": out.train_row_count, "metrics": out.metrics}
    lines = [json.dumps(header), *(json.dumps(traj.to_dict()) for traj in out.trajectories)]
    return atomic_write_text(raw_rollout_path(directory, rollout_id), "".join(line + "\n" for line in lines))


def load_raw_rollout(directory: Path, rollout_id: int) -> RolloutOutput:
    """One step of a `--save-rollouts` folder read back; an empty, torn or edited file is a TrainingError
    naming the file and line."""
    path = raw_rollout_path(directory, rollout_id)
    if not path.is_file():
        raise TrainingError(f"replay: {path} does not exist (saved with --save-rollouts?)")
    damaged = "replay from a folder that --save-rollouts wrote, unedited"
    try:
        lines = read_jsonl_lines(path)
    except DataError as e:
        raise TrainingError(f"replay: {e}; {damaged}") from None
    if not lines:
        raise TrainingError(f"replay: {path} is empty; {damaged}")
    (_, header), *records = lines
    count = header.get("train_row_count", "missing") if isinstance(header, dict) else "missing"
    if not (count is None or type(count) is int):
        raise TrainingError(f"replay: {path}: line 1 is not a rollout header with a train_row_count; {damaged}")
    trajectories = []
    for line, record in records:
        try:
            trajectories.append(Trajectory.from_dict(record))
        except (TypeError, ValueError) as e:  # not an object, or fields missing or unknown
            raise TrainingError(f"replay: {path}: line {line} is not a saved trajectory ({e}); {damaged}") from None
    return RolloutOutput(trajectories, metrics=header.get("metrics", {}), train_row_count=count)


class LocalRollout:
    """The task's `generate` over one engine, on one event loop kept for the run (the engine's batching
    worker lives on it)."""

    generates = True
    in_process = True

    def __init__(self, cfg: Config, engine: Engine, tokenizer: Any, task: Task, progress: bool) -> None:
        self.cfg = cfg
        self.engine = engine
        self.tokenizer = tokenizer
        self.task = task
        self.progress = progress
        self.reward_fn = task_reward(cfg, task)
        self.takes_folders = served_engine(cfg)
        self.loop = asyncio.new_event_loop()

    def generate(self, rollout_id: int, records: Sequence[Any], weight_version: int | None = None,
                 slot_offset: int = 0) -> RolloutOutput:
        ctx = RolloutContext(engine=self.engine, tokenizer=self.tokenizer, config=self.cfg, rollout_id=rollout_id,
                             reward_function=self.reward_fn, progress=self.progress, slot_offset=slot_offset)
        out = self.loop.run_until_complete(self.task.generate(ctx, list(records)))
        out = record_weight_version(out, weight_version)
        return convert_rollout(out, self.tokenizer, self.cfg.algorithm, self.task, rollout_id)

    def sync_from(self, source: WeightSource) -> None:
        self.loop.run_until_complete(self.engine.sync_from(source))

    def score_probe(self, probe: SyncProbe) -> dict[str, ScoreResult]:
        score = self.engine.score(probe.prompt_ids, probe.continuation_ids, probe.temperature)
        return {f"the rollout engine ({type(self.engine).__name__})": self.loop.run_until_complete(score)}

    def close(self) -> None:
        try:
            self.loop.run_until_complete(self.engine.close())
        finally:
            self.loop.close()


class ReplayRollout:
    """Debug replay: a step's trajectories read back from `--save-rollouts` files and converted as they
    were when generated (they keep the weight version they were saved with); nothing generates."""

    generates = False
    in_process = False
    takes_folders = False

    def __init__(self, directory: Path, cfg: Config, tokenizer: Any, task: Task) -> None:
        self.directory = Path(directory)
        self.algorithm = cfg.algorithm
        self.tokenizer = tokenizer
        self.task = task

    def generate(self, rollout_id: int, records: Sequence[Any], weight_version: int | None = None,
                 slot_offset: int = 0) -> RolloutOutput:
        out = load_raw_rollout(self.directory, rollout_id)
        return convert_rollout(out, self.tokenizer, self.algorithm, self.task, rollout_id)

    def sync_from(self, source: WeightSource) -> None:
        pass  # no engine to sync

    def close(self) -> None:
        pass
