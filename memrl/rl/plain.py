"""The plain 1:1 converter (`Task.convert`'s default) for trajectories of exactly one turn (`single_turn`),
whose row carries the full advantage; the rollout then announces no `train_row_count`.
"""

from __future__ import annotations

from collections.abc import Sequence

from memrl.config import AlgorithmConfig
from memrl.rl.shaping import advantage_rows
from memrl.rl.validate import TrajectoryError
from memrl.types import TrainRow, Trajectory


def convert_one_row_per_trajectory(trajectories: Sequence[Trajectory], algorithm_cfg: AlgorithmConfig,
                                   rollout_id: int) -> list[TrainRow]:
    """One row per trajectory; raises `TrajectoryError` before producing anything on a bad input."""
    for traj in trajectories:
        if traj.num_turns != 1:
            raise TrajectoryError(traj.trajectory_id, None, "single_turn",
                                  f"{traj.num_turns} turns; the plain converter takes single-turn trajectories "
                                  "(a multi-turn task converts its own rows, as MemAgentTask does)")
    return advantage_rows(trajectories, algorithm_cfg, rollout_id, "share")
