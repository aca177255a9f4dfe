"""Per-turn scores the trainer computes after a rollout, before converting (memrl.rl.shaping mixes them in):
every turn's response decoded once into `metadata["turn_texts"]`, `algorithm.turn_reward_function(turn,
trajectory, golds)` into `metadata["turn_rewards"]` when set, and the task's `turn_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from memrl.config import import_object
from memrl.rollout import decode_response
from memrl.types import Trajectory


@lru_cache(maxsize=8)
def load_turn_reward(spec: str) -> Callable[..., float]:
    return import_object(spec)


def score_turns(trajectories: Sequence[Trajectory], tokenizer: Any, algorithm: Any, task: Any) -> dict[str, float]:
    """Annotate `trajectories` in place (module docstring); return the task's turn metrics."""
    reward_fn = load_turn_reward(algorithm.turn_reward_function) if algorithm.turn_reward_function else None
    for traj in trajectories:
        traj.metadata["turn_texts"] = [decode_response(t, tokenizer) for t in traj.turns]
        if reward_fn is not None:
            golds = list(traj.metadata.get("golds") or [])
            traj.metadata["turn_rewards"] = [float(reward_fn(turn, traj, golds)) for turn in traj.turns]
    return task.turn_metrics(trajectories)
