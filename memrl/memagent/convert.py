"""The MemAgent converter (`MemAgentTask.convert`, docs/design.md §3): validate every trajectory and group
first (`memrl.rl.validate`: nothing is returned on a violation, so no step trains on part of its rows),
then GRPO per trajectory and one row per turn with its credit (`memrl.rl.shaping.advantage_rows`).
"""

from __future__ import annotations

from collections.abc import Sequence

from memrl.config import AlgorithmConfig
from memrl.rl.shaping import advantage_rows
from memrl.rl.validate import validate_groups
from memrl.types import TrainRow, Trajectory


def convert_trajectories(trajectories: Sequence[Trajectory], algorithm_cfg: AlgorithmConfig,
                         rollout_id: int) -> list[TrainRow]:
    """Rows by group, sample, trajectory id, then turn; the inputs are not modified."""
    trajectories = list(trajectories)
    validate_groups(trajectories)
    return advantage_rows(trajectories, algorithm_cfg, rollout_id, algorithm_cfg.credit)
