"""Trajectories -> rows, validated first (`advantage_rows`, the converters' one path), with what the converter makes
of rewards and turns first (formulas in docs/algorithms.md): truncated completions masked, DAPO's overlong
penalty (on the advantage's reward only: `Trajectory.reward`, read by filtering and the logs, is untouched),
turn rewards mixed into each turn's advantage. Every option is off by default, and off the rows are exactly
what they were without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from memrl.config import ConfigError
from memrl.rl.advantages import (
    AdvantageError,
    assign_credit,
    by_group,
    expand_rows,
    grpo_advantages,
    trajectory_advantages,
)
from memrl.rl.validate import validate_groups
from memrl.types import TrainRow, Trajectory


def advantage_rows(trajectories: Sequence[Trajectory], a: Any, rollout_id: int, credit: str) -> list[TrainRow]:
    """Validate every trajectory and group first (nothing is returned on a violation, so no step trains on part
    of its rows), then (shaped) rewards -> GRPO per trajectory -> per-turn advantages -> rows, in
    `row_order_key` order; the inputs are not modified. `a` is the AlgorithmConfig."""
    trajectories = list(trajectories)
    validate_groups(trajectories)
    advantages = trajectory_advantages(trajectories, std_normalize=a.std_normalize, eps=a.eps, std_ddof=a.std_ddof,
                                       rewards=shaped_rewards(trajectories, a))
    return expand_rows(trajectories, advantages, credit, rollout_id,
                       turn_advantages=turn_advantages(trajectories, advantages, a),
                       mask_trajectory=final_turn_truncated if a.mask_truncated_completions else None)


def final_turn_truncated(traj: Trajectory) -> bool:
    """The final turn stopped at its token limit."""
    return traj.turns[-1].finish_reason == "length"


def overlong_penalty(length: int, max_tokens: int, buffer_len: int, factor: float) -> float:
    """DAPO's soft penalty of a `length`-token answer whose limit is `max_tokens` (module docstring)."""
    exceed = length - (max_tokens - buffer_len)
    return min(0.0, -exceed / buffer_len * factor)


def shaped_rewards(trajectories: Sequence[Trajectory], a: Any) -> dict[str, float] | None:
    """The reward the advantage is computed from, per trajectory id; None when no shaping is on (the raw
    reward then). `a` is the AlgorithmConfig."""
    if a.overlong_buffer_len is None:
        return None
    out = {}
    for traj in trajectories:
        final = traj.turns[-1]
        # The config check compares B with task.final_tokens; a task whose final turn has another limit
        # is checked here, never clamped (a clamped buffer shapes other rewards than the configured ones).
        if a.overlong_buffer_len > final.max_tokens:
            raise ConfigError(f"algorithm.overlong_buffer_len = {a.overlong_buffer_len} is longer than the final "
                              f"turn's limit {final.max_tokens} (trajectory '{traj.trajectory_id}'); set "
                              f"overlong_buffer_len <= {final.max_tokens}")
        out[traj.trajectory_id] = float(traj.reward) + overlong_penalty(
            final.response_length, final.max_tokens, a.overlong_buffer_len, a.overlong_penalty_factor)
    return out


def turn_advantages(trajectories: Sequence[Trajectory], advantages: Mapping[str, float],
                    a: Any) -> dict[str, list[float]] | None:
    """Each trajectory's per-turn advantages mixing in its turn rewards (docs/algorithms.md); None when
    `a.turn_reward_function` is unset (the plain credit then). A group's samples have equal turn counts
    (`validate_groups`), so turn j's rewards form one GRPO group per prompt group."""
    if a.turn_reward_function is None:
        return None
    for traj in trajectories:
        rewards = traj.metadata.get("turn_rewards")
        if rewards is None or len(rewards) != traj.num_turns:
            raise AdvantageError(f"trajectory '{traj.trajectory_id}' has no turn_rewards "
                                 f"for its {traj.num_turns} turns; "
                                 f"algorithm.turn_reward_function is set, so the trainer scores every turn before "
                                 f"converting (memrl.rl.turn_rewards.score_turns)")
    turn_norm: dict[tuple[str, int], float] = {}
    for group_id, group in by_group(trajectories).items():
        for j in range(group[0].num_turns):
            key = f"{group_id}\x00{j}"
            column = grpo_advantages({key: [float(t.metadata["turn_rewards"][j]) for t in group]},
                                     std_normalize=a.std_normalize, eps=a.eps, std_ddof=a.std_ddof)[key]
            turn_norm.update(((t.trajectory_id, j), v) for t, v in zip(group, column, strict=True))
    alpha = a.turn_reward_alpha
    return {traj.trajectory_id: [alpha * c + (1 - alpha) * turn_norm[(traj.trajectory_id, j)]
                                 for j, c in enumerate(assign_credit(advantages[traj.trajectory_id], traj.num_turns,
                                                                     a.credit))]
            for traj in trajectories}
