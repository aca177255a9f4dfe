"""GRPO advantages per trajectory, credit over turns, and expansion into rows (docs/design.md §3).

Advantages are computed while each trajectory is one record, so one with more turns does not weigh more
in its group's mean and std (agent-lightning #444); only then does `expand_rows` make a row per turn.
Groups are keyed by `group_id`, never by trajectory id (groups of one, rLLM #776) or by batch position.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Literal

import numpy as np

from memrl.errors import MemrlError
from memrl.rl.validate import TrajectoryError
from memrl.types import TrainRow, Trajectory

CreditMode = Literal["split", "share"]


class AdvantageError(ValueError, MemrlError):
    """Rewards or arguments that no advantage can be computed from; the message names the culprit."""


def grpo_advantages(rewards_by_group: Mapping[str, Sequence[float]], std_normalize: bool = True,
                    eps: float = 1e-6, std_ddof: int = 0) -> dict[str, list[float]]:
    """Group-relative advantages: `r - mean(group)`, divided by `std(group, ddof=std_ddof) + eps` if
    `std_normalize` (ddof 1 is verl's and slime's sample std). A group of equal rewards (one of one too:
    verl passes its raw reward through) gets exactly 0.0, not a rounding residue."""
    if eps <= 0:
        raise AdvantageError(f"eps = {eps} must be > 0 (it keeps the std division finite)")
    if std_ddof not in (0, 1):
        raise AdvantageError(f"std_ddof = {std_ddof!r} must be 0 (population std) or 1 (sample std)")
    advantages: dict[str, list[float]] = {}
    for group_id, rewards in rewards_by_group.items():
        values = np.asarray(list(rewards), dtype=np.float64)
        if not np.all(np.isfinite(values)):
            raise AdvantageError(f"group '{group_id}' has non-finite rewards {values.tolist()}")
        if values.size == 0 or np.all(values == values[0]):
            # mean() of equal floats can differ from them by an ulp; equal rewards carry no signal.
            advantages[group_id] = [0.0] * int(values.size)
            continue
        centred = values - values.mean()
        if std_normalize:
            centred = centred / (values.std(ddof=std_ddof) + eps)
        advantages[group_id] = [float(a) for a in centred]
    return advantages


def assign_credit(advantage: float, num_turns: int, mode: CreditMode) -> list[float]:
    """Per-turn advantages of one trajectory: `split` gives each of T turns advantage/T (they sum to
    the trajectory's advantage), `share` gives each turn the full advantage."""
    if num_turns <= 0:
        raise AdvantageError(f"num_turns = {num_turns}; a trajectory has at least one turn")
    if mode == "split":
        return [advantage / num_turns] * num_turns
    if mode == "share":
        return [float(advantage)] * num_turns
    raise AdvantageError(f"credit mode {mode!r} is unknown; use 'split' or 'share' (algorithm.credit)")


def by_group(items: Iterable[Any]) -> dict[str, list[Any]]:
    """Trajectories (or rows) by `group_id`, groups in order of first appearance."""
    groups: dict[str, list[Any]] = {}
    for item in items:
        groups.setdefault(item.group_id, []).append(item)
    return groups


def trajectory_advantages(trajectories: Iterable[Trajectory], std_normalize: bool = True,
                          eps: float = 1e-6, std_ddof: int = 0,
                          rewards: Mapping[str, float] | None = None) -> dict[str, float]:
    """GRPO advantage of each trajectory, grouped by `group_id`, each counted once whatever its turns.
    `rewards` (by trajectory id) replaces the raw rewards, e.g. shaped ones (`memrl.rl.shaping`)."""
    trajectories = list(trajectories)
    seen: set[str] = set()
    for traj in trajectories:
        if traj.reward is None:
            raise TrajectoryError(traj.trajectory_id, None, "reward_present",
                                  "reward is None; run the reward function before computing advantages")
        if traj.trajectory_id in seen:
            raise TrajectoryError(traj.trajectory_id, None, "trajectory_id_unique",
                                  "another trajectory has the same trajectory_id")
        seen.add(traj.trajectory_id)
    groups = by_group(trajectories)
    rewards_by_group = {group_id: [float(t.reward if rewards is None else rewards[t.trajectory_id]) for t in group]
                        for group_id, group in groups.items()}
    by_group_id = grpo_advantages(rewards_by_group, std_normalize=std_normalize, eps=eps, std_ddof=std_ddof)
    return {t.trajectory_id: adv for group_id, group in groups.items()
            for t, adv in zip(group, by_group_id[group_id], strict=True)}


def row_order_key(traj: Trajectory) -> tuple[str, int, str]:
    """Rows by group, sample, trajectory id: rollouts finish in any order, and a step's rows must be the
    same on every run and in debug replay."""
    return traj.group_id, traj.sample_index, traj.trajectory_id


def expand_rows(trajectories: Iterable[Trajectory], advantages: Mapping[str, float], credit: CreditMode,
                rollout_id: int, *, turn_advantages: Mapping[str, Sequence[float]] | None = None,
                mask_trajectory: Callable[[Trajectory], bool] | None = None) -> list[TrainRow]:
    """One `TrainRow` per turn (copies: inputs are not modified), in `row_order_key` order, with the
    turn's share of its trajectory's advantage (`assign_credit`), or `turn_advantages[tid]` per turn. A
    trajectory for which `mask_trajectory` is true gets all-zero loss masks (it trains nothing)."""
    rows: list[TrainRow] = []
    for traj in sorted(trajectories, key=row_order_key):
        if traj.trajectory_id not in advantages:
            raise AdvantageError(f"no advantage for trajectory '{traj.trajectory_id}'; compute advantages first")
        advantage = advantages[traj.trajectory_id]
        if not math.isfinite(advantage):
            raise AdvantageError(f"advantage of trajectory '{traj.trajectory_id}' is {advantage!r}")
        per_turn = (assign_credit(advantage, traj.num_turns, credit) if turn_advantages is None
                    else list(turn_advantages[traj.trajectory_id]))
        masked = mask_trajectory is not None and mask_trajectory(traj)
        for turn, turn_advantage in zip(traj.turns, per_turn, strict=True):
            if not math.isfinite(turn_advantage):
                raise AdvantageError(f"turn {turn.index} of trajectory '{traj.trajectory_id}' has advantage "
                                     f"{turn_advantage!r}")
            rows.append(TrainRow(
                tokens=list(turn.prompt_ids) + list(turn.response_ids), response_length=turn.response_length,
                loss_mask=[0] * turn.response_length if masked else list(turn.loss_mask),
                rollout_log_probs=list(turn.rollout_log_probs), advantage=turn_advantage,
                group_id=traj.group_id, trajectory_id=traj.trajectory_id, turn_index=turn.index,
                rollout_id=rollout_id, weight_version=traj.metadata.get("weight_version"),
                trajectory_advantage=advantage,
            ))
    return rows
