"""GRPO advantages per trajectory, credit assignment over turns, and expansion into rows (docs/design.md §3).

Order of operations (the point of this module): advantages are computed while each trajectory is
still one record, so a trajectory with more turns does not weigh more in its group's mean and std
(agent-lightning #444). Only afterwards does `expand_rows` turn each turn into a `TrainRow`.

Groups are keyed by `Trajectory.group_id` (one per question and rollout step), never by
trajectory_id (per-trajectory keys make groups of size 1 whose advantage is always 0, rLLM #776) and
never by position in a batch (positional reshapes merge uneven groups, slime).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Literal

import numpy as np

from memrl.errors import MemrlError
from memrl.rl.validate import TrajectoryError
from memrl.types import TrainRow, Trajectory

CreditMode = Literal["split", "share"]


class AdvantageError(ValueError, MemrlError):
    """Rewards or arguments that no advantage can be computed from; the message names the culprit."""


def grpo_advantages(rewards_by_group: Mapping[str, Sequence[float]], std_normalize: bool = True,
                    eps: float = 1e-6, std_ddof: int = 0) -> dict[str, list[float]]:
    """Group-relative advantages: `r - mean(group)`, divided by `std(group) + eps` if `std_normalize`.

    `std_ddof` picks the std: 0 = population std (a normalized group has unit population variance, up
    to eps), 1 = sample std, as verl's `compute_grpo_outcome_advantage` (torch.std) and slime use; the
    sample std is larger by sqrt(n/(n-1)), so its advantages are smaller by sqrt((n-1)/n): for 1 right
    of 8, +2.4749/-0.3536 with ddof=1 against +2.6457/-0.3780 with ddof=0.

    Invariants: output lists align with the input lists; a group whose rewards are all equal
    (including a group of one) gets exactly 0.0 everywhere, not a rounding residue; an empty group
    gives an empty list (verl instead passes a lone sample's raw reward through: memrl does not, a
    group of one carries no relative signal). Non-finite rewards raise `AdvantageError`.
    """
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


def trajectory_advantages(trajectories: Iterable[Trajectory], std_normalize: bool = True,
                          eps: float = 1e-6, std_ddof: int = 0,
                          rewards: Mapping[str, float] | None = None) -> dict[str, float]:
    """GRPO advantage of each trajectory, grouped by `group_id`; each trajectory counts once.

    Needs `reward` on every trajectory (TrajectoryError `reward_present` otherwise) and unique
    trajectory ids (`trajectory_id_unique`). Turn counts play no part here. `rewards` (by trajectory id)
    replaces the raw rewards, e.g. shaped ones (`memrl.rl.shaping`).
    """
    ids_by_group: dict[str, list[str]] = {}
    rewards_by_group: dict[str, list[float]] = {}
    seen: set[str] = set()
    for traj in trajectories:
        if traj.reward is None:
            raise TrajectoryError(traj.trajectory_id, None, "reward_present",
                                  "reward is None; run the reward function before computing advantages")
        if traj.trajectory_id in seen:
            raise TrajectoryError(traj.trajectory_id, None, "trajectory_id_unique",
                                  "another trajectory has the same trajectory_id")
        seen.add(traj.trajectory_id)
        ids_by_group.setdefault(traj.group_id, []).append(traj.trajectory_id)
        reward = traj.reward if rewards is None else rewards[traj.trajectory_id]
        rewards_by_group.setdefault(traj.group_id, []).append(float(reward))
    by_group = grpo_advantages(rewards_by_group, std_normalize=std_normalize, eps=eps, std_ddof=std_ddof)
    return {tid: adv for group_id, ids in ids_by_group.items() for tid, adv in zip(ids, by_group[group_id], strict=True)}


def row_order_key(traj: Trajectory) -> tuple[str, int, str]:
    """Deterministic row order: by group, then sample, then trajectory id (turns follow in order).

    Rollouts finish in whatever order the engine serves them; sorting makes the rows of a step the
    same on every run and in debug replay.
    """
    return traj.group_id, traj.sample_index, traj.trajectory_id


def expand_rows(trajectories: Iterable[Trajectory], advantages: Mapping[str, float], credit: CreditMode,
                rollout_id: int, *, turn_advantages: Mapping[str, Sequence[float]] | None = None,
                mask_trajectory: Callable[[Trajectory], bool] | None = None) -> list[TrainRow]:
    """One `TrainRow` per turn, in `row_order_key` order, with the turn's share of its trajectory's
    advantage (`assign_credit`).

    Every row's `tokens[-response_length:]` is the turn's response, and its `loss_mask` and
    `rollout_log_probs` are copies of the turn's (one value per response token), so the advantage
    applies to exactly the sampled tokens. The inputs are not modified; `advantages` must hold every
    trajectory id. `turn_advantages[tid]` (one value per turn) replaces the credit split of `advantages`;
    a trajectory for which `mask_trajectory` is true gets all-zero loss masks (it trains nothing).
    """
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
                tokens=list(turn.prompt_ids) + list(turn.response_ids),
                response_length=turn.response_length,
                loss_mask=[0] * turn.response_length if masked else list(turn.loss_mask),
                rollout_log_probs=list(turn.rollout_log_probs),
                advantage=turn_advantage,
                group_id=traj.group_id,
                trajectory_id=traj.trajectory_id,
                turn_index=turn.index,
                rollout_id=rollout_id,
                weight_version=traj.metadata.get("weight_version"),
                trajectory_advantage=advantage,
            ))
    return rows
