"""Per-turn scores the trainer computes after a rollout, before converting (memrl.rl.shaping mixes them in).

`score_turns` decodes every turn's response once into `metadata["turn_texts"]`, calls the configured
`algorithm.turn_reward_function(turn, trajectory, golds) -> float` on every turn into
`metadata["turn_rewards"]` (when set), and returns the memory curve a MemAgent researcher watches every
step, whether or not it is a reward: `memory/gold_recall/turn_{j}`, the share of trajectories whose j-th
memory turn holds a gold answer (`memrl.memagent.reward.gold_in_text`), and its mean over memory turns.
Trajectories without `metadata["golds"]` (other tasks) give no recall and the golds `[]`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import lru_cache
from typing import Any

from memrl.config import import_object
from memrl.memagent.reward import gold_in_text
from memrl.rollout import decode_response
from memrl.types import Trajectory


@lru_cache(maxsize=8)
def load_turn_reward(spec: str) -> Callable[..., float]:
    return import_object(spec)


def score_turns(trajectories: Sequence[Trajectory], tokenizer: Any, algorithm: Any) -> dict[str, float]:
    """Annotate `trajectories` in place (module docstring); return the gold-recall metrics."""
    reward_fn = load_turn_reward(algorithm.turn_reward_function) if algorithm.turn_reward_function else None
    hits: dict[int, list[float]] = {}
    for traj in trajectories:
        texts = [decode_response(t, tokenizer) for t in traj.turns]
        traj.metadata["turn_texts"] = texts
        golds = list(traj.metadata.get("golds") or [])
        if reward_fn is not None:
            traj.metadata["turn_rewards"] = [float(reward_fn(turn, traj, golds)) for turn in traj.turns]
        if golds:
            for turn, text in zip(traj.turns, texts, strict=True):
                if turn.kind == "memory":
                    hits.setdefault(turn.index, []).append(float(gold_in_text(text, golds)))
    metrics = {f"memory/gold_recall/turn_{j}": sum(v) / len(v) for j, v in sorted(hits.items())}
    if hits:
        metrics["memory/gold_recall/mean"] = sum(metrics.values()) / len(metrics)
    return metrics
