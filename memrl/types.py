"""Record types, one per stage of a rollout step (contracts: docs/design.md, "Record contracts").

    Turn        one generation request and exactly what was sampled (token ids in and out)
    Trajectory  one sample for one question: the task's turns (any kinds), then one final turn
    TrainRow    one training row: a turn expanded with its share of the trajectory's advantage
    RolloutOutput  what a rollout source hands to training: the trajectories, scored and converted to rows

`memrl.rl.validate` checks, and everything else relies on: the lengths and turn order of docs/design.md §3,
masks of 0 or 1, rollout log-probs finite and <= 0, rewards and advantages finite reals (never a bool).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Literal

# Any name a task gives its turns (MemAgent: `memory`; a tool reader: `search`, ...); `final` is reserved for
# the one last turn, whose response is the answer.
TurnKind = str
FinishReason = Literal["stop", "length", "error"]
TrajectoryStatus = Literal["complete", "truncated", "failed"]

# `complete`: the final answer ended on a stop token. `truncated`: it hit its token limit (still a valid
# sample to train on, with reward 0 as docs/design.md §2 says). `failed`: a generation error; such a trajectory
# carries no usable tokens and is never trained on (its whole group is left out of the step).
TRAINABLE_STATUSES: tuple[str, ...] = ("complete", "truncated")


@dataclass
class Turn:
    index: int
    kind: TurnKind
    prompt_ids: list[int]
    response_ids: list[int]
    rollout_log_probs: list[float]
    loss_mask: list[int]
    finish_reason: FinishReason
    max_tokens: int

    @property
    def tokens(self) -> list[int]:
        return self.prompt_ids + self.response_ids

    @property
    def response_length(self) -> int:
        return len(self.response_ids)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Turn:
        return cls(**d)


@dataclass
class Trajectory:
    trajectory_id: str
    group_id: str
    sample_index: int
    turns: list[Turn]
    status: TrajectoryStatus = "complete"
    reward: float | None = None
    answer: str = ""
    metadata: dict[str, Any] = field(default_factory=dict)
    error: str | None = None

    @property
    def num_turns(self) -> int:
        return len(self.turns)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> Trajectory:
        return cls(**{**d, "turns": [Turn.from_dict(t) for t in d.get("turns", [])]})


@dataclass
class TrainRow:
    tokens: list[int]
    response_length: int
    loss_mask: list[int]
    rollout_log_probs: list[float]
    advantage: float
    group_id: str
    trajectory_id: str
    turn_index: int
    rollout_id: int
    is_padding: bool = False
    # The weight version that sampled the response (version v = the weights after training step v - 1;
    # the overlapped pipeline samples with older ones, memrl/train/pipeline.py); None when not known.
    weight_version: int | None = None
    # The GRPO advantage of the whole trajectory (before the credit split), carried for the logs so that
    # nothing recomputes it; None from a converter that does not set it.
    trajectory_advantage: float | None = None

    @property
    def prompt_length(self) -> int:
        return len(self.tokens) - self.response_length

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class RolloutOutput:
    """One rollout step's batch: what a task's `generate` returns (memrl/task.py), then, scored and converted
    where it was generated (`memrl.train.setup.convert_rollout`), what every rollout source hands the loop.
    `train_row_count`: the exact number of rows the converter makes (None on a plain 1:1 rollout)."""

    trajectories: list[Trajectory]
    metrics: dict[str, float] = field(default_factory=dict)
    train_row_count: int | None = None
    # Trajectories left out of training (a failed generation in their group), kept for logs.
    dropped: list[Trajectory] = field(default_factory=list)
    # The converted rows (`TrainRow`s, or on Ray `RowRef`s to rows in the object store,
    # memrl/distributed/rows.py); None only before conversion. The loop hands them to the queue once.
    rows: list[Any] | None = None
    # For the logs, read off the rows where they were made: each trajectory's advantage by id, and each
    # (trajectory id, turn index)'s row advantage (its credit).
    advantages: dict[str, float] = field(default_factory=dict)
    turn_advantages: dict[tuple[str, int], float] = field(default_factory=dict)
