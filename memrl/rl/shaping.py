"""Trajectories -> rows, validated first (`advantage_rows`, the converters' one path), with what the converter makes
of rewards and turns first (formulas in docs/algorithms.md): reward terms normalised before their weighted sum
(`normalize_then_sum`), truncated completions masked, DAPO's overlong
penalty (on the advantage's reward only: `Trajectory.reward`, read by filtering and the logs, is untouched),
turn rewards mixed into each turn's advantage (with a leave-one-out baseline of the rewards to go, unbiased
whatever turn counts the policy chooses). Every option is off by default, and off the rows are exactly
what they were without it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

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
    if a.multi_objective_aggregation == "normalize_then_sum":
        advantages = term_advantages(trajectories, a)
    else:
        advantages = trajectory_advantages(trajectories, std_normalize=a.std_normalize, eps=a.eps,
                                           std_ddof=a.std_ddof, rewards=shaped_rewards(trajectories, a))
    return expand_rows(trajectories, advantages, credit, rollout_id,
                       turn_advantages=turn_advantages(trajectories, advantages, a),
                       mask_trajectory=final_turn_truncated if a.mask_truncated_completions else None)


def term_advantages(trajectories: Sequence[Trajectory], a: Any) -> dict[str, float]:
    """`normalize_then_sum` (TRL's, GDPO): each reward term's GRPO advantage within its group, over the samples it
    applies to (0 where it returned None), then their weighted sum; the terms and weights are those `ctx.reward`
    recorded. Unlike TRL, the sum is not normalised again over the whole batch: a batch statistic would differ
    where a step's groups are converted apart (Ray rollout workers, dynamic sampling's batches)."""
    out: dict[str, float] = {}
    for group_id, group in by_group(trajectories).items():
        for traj in group:
            if not all(isinstance(traj.metadata.get(key), dict) for key in ("reward_terms", "reward_weights")):
                raise AdvantageError(f"trajectory '{traj.trajectory_id}' has no reward_terms / reward_weights; "
                                     f"multi_objective_aggregation = 'normalize_then_sum' normalises each term, which "
                                     f"the rollout's ctx.reward records")
            out[traj.trajectory_id] = 0.0
        for name in dict.fromkeys(name for t in group for name in t.metadata["reward_terms"]):
            applied = [t for t in group if t.metadata["reward_terms"].get(name) is not None]
            (normalised,) = grpo_advantages({group_id: [t.metadata["reward_terms"][name] for t in applied]},
                                            std_normalize=a.std_normalize, eps=a.eps, std_ddof=a.std_ddof).values()
            for traj, z in zip(applied, normalised, strict=True):
                out[traj.trajectory_id] += traj.metadata["reward_weights"][name] * z
    return out


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
    """Each trajectory's per-turn advantages mixing in its turn rewards (`turn_reward_terms`, docs/algorithms.md);
    None when `a.turn_reward_function` is unset (the plain credit then). A group's samples may take different
    numbers of turns."""
    if a.turn_reward_function is None:
        return None
    for traj in trajectories:
        rewards = traj.metadata.get("turn_rewards")
        if rewards is None or len(rewards) != traj.num_turns:
            raise AdvantageError(f"trajectory '{traj.trajectory_id}' has no turn_rewards "
                                 f"for its {traj.num_turns} turns; "
                                 f"algorithm.turn_reward_function is set, so the trainer scores every turn before "
                                 f"converting (memrl.rl.turn_rewards.score_turns)")
    terms: dict[str, list[float]] = {}
    for group_id, group in by_group(trajectories).items():
        terms.update(turn_reward_terms(group_id, group, a))
    alpha = a.turn_reward_alpha
    return {traj.trajectory_id: [alpha * c + (1 - alpha) * u for c, u in zip(
                assign_credit(advantages[traj.trajectory_id], traj.num_turns, a.credit), terms[traj.trajectory_id],
                strict=True)]
            for traj in trajectories}


def turn_reward_terms(group_id: str, group: Sequence[Trajectory], a: Any) -> dict[str, list[float]]:
    """Turn j of sample i gets G[i, j] - mean over the other samples k of G[k, j], where G[i, j] is the sum of
    i's turn rewards from turn j on (0 past its last turn): what turn j and the turns it led to earned, less
    what the rest of the group earned from the same position. The baseline is a function of the other samples
    only, one number per action, so it stays unbiased however many turns each sample's policy chose to take
    (tests/rl/test_turn_baseline.py); a baseline summed over the sample's own remaining turns would not be
    (verl #7244). `a.std_normalize` divides by the position's std over the group, as GRPO does (a scale that
    is not unbiased, Dr. GRPO); a group of one, or a position where all samples agree, gets 0."""
    n, width = len(group), max(t.num_turns for t in group)
    to_go = np.zeros((n, width))
    for i, traj in enumerate(group):
        rewards = np.asarray(traj.metadata["turn_rewards"], dtype=np.float64)
        if not np.all(np.isfinite(rewards)):
            raise AdvantageError(f"trajectory '{traj.trajectory_id}' of group '{group_id}' has non-finite turn "
                                 f"rewards {rewards.tolist()}")
        to_go[i, :traj.num_turns] = np.cumsum(rewards[::-1])[::-1]
    terms = np.zeros_like(to_go)
    if n > 1:
        terms = to_go - (to_go.sum(axis=0) - to_go) / (n - 1)
        if a.std_normalize:
            terms = terms / (to_go.std(axis=0, ddof=a.std_ddof) + a.eps)
        terms[:, np.all(to_go == to_go[0], axis=0)] = 0.0  # equal values carry no signal, not a rounding residue
    return {traj.trajectory_id: terms[i, :traj.num_turns].tolist() for i, traj in enumerate(group)}
