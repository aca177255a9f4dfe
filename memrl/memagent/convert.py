"""The MemAgent converter (`MemAgentTask.convert`): trajectories -> rows.

    convert_trajectories(trajectories, algorithm_cfg, rollout_id) -> list[TrainRow]

Three stages, in this order (docs/design.md §3):
1. validate every trajectory and every group (`memrl.rl.validate`); the first violation raises
   `TrajectoryError` and nothing is returned, so no step is ever trained on part of its rows;
2. GRPO advantages while each trajectory is still one record (`trajectory_advantages`), from the raw
   reward or a shaped one (`memrl.rl.shaping`: overlong penalty);
3. expand every turn into a `TrainRow` with its credit (`split` or `share`), mixed with its turn reward
   when `algorithm.turn_reward_function` is set; truncated answers masked when asked.

Invariant: `len(convert_trajectories(ts, ...)) == count_train_rows(ts)` for every valid `ts`; the rollout
announces that count to the transfer queue before the rows exist.
"""

from __future__ import annotations

from collections.abc import Sequence

from memrl.config import AlgorithmConfig
from memrl.rl.shaping import advantage_rows
from memrl.rl.validate import validate_groups
from memrl.types import TRAINABLE_STATUSES, TrainRow, Trajectory


def count_train_rows(trajectories: Sequence[Trajectory]) -> int:
    """Rows the converter will produce: one per turn of every trainable trajectory.

    Failed trajectories count 0 here and are rejected by the converter, so the rollout must drop them
    before converting (the count it announces then matches the rows exactly).
    """
    return sum(traj.num_turns for traj in trajectories if traj.status in TRAINABLE_STATUSES)


def convert_trajectories(trajectories: Sequence[Trajectory], algorithm_cfg: AlgorithmConfig,
                         rollout_id: int) -> list[TrainRow]:
    """Validate, compute GRPO advantages per trajectory, then expand turns into rows.

    Rows are ordered by group_id, then sample_index and trajectory_id, then turn index. The input
    trajectories are not modified. Raises `TrajectoryError` (validation) before producing any row.
    """
    trajectories = list(trajectories)
    validate_groups(trajectories)
    return advantage_rows(trajectories, algorithm_cfg, rollout_id, algorithm_cfg.credit)
