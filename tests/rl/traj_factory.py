"""Builders of valid trajectories for the converter tests (tests/rl and tests/memagent import it).

Every turn gets token ids, log-probs and a loss mask that are unique across all trajectories built in
a process, so a test can tell which turn a row came from and whether its values were copied to the
right positions. The loss mask has a 0 every third token, so copying it differs from rebuilding it.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

from memrl.types import Trajectory, TrajectoryStatus, Turn

MEMORY_MAX_TOKENS = 16
FINAL_MAX_TOKENS = 8
_ids = itertools.count(1000)


def make_turn(index: int, kind: str, prompt_len: int = 4, response_len: int = 3,
              max_tokens: int | None = None) -> Turn:
    prompt_ids = [next(_ids) for _ in range(prompt_len)]
    response_ids = [next(_ids) for _ in range(response_len)]
    return Turn(
        index=index,
        kind=kind,  # type: ignore[arg-type]
        prompt_ids=prompt_ids,
        response_ids=response_ids,
        rollout_log_probs=[-(tok % 997) / 100.0 for tok in response_ids],
        loss_mask=[0 if k % 3 == 2 else 1 for k in range(response_len)],
        finish_reason="stop",
        max_tokens=(max_tokens if max_tokens is not None
                    else (FINAL_MAX_TOKENS if kind == "final" else MEMORY_MAX_TOKENS)),
    )


def make_trajectory(trajectory_id: str, group_id: str = "g0", num_memory_turns: int = 2, reward: float | None = 1.0,
                    status: TrajectoryStatus = "complete", sample_index: int = 0, answer: str = "",
                    response_len: int = 3) -> Trajectory:
    """`num_memory_turns` memory turns then one final turn, all valid."""
    turns = [make_turn(i, "memory", response_len=response_len) for i in range(num_memory_turns)]
    turns.append(make_turn(num_memory_turns, "final", response_len=min(response_len, FINAL_MAX_TOKENS)))
    return Trajectory(trajectory_id=trajectory_id, group_id=group_id, sample_index=sample_index, turns=turns,
                      status=status, reward=reward, answer=answer)


def make_group(group_id: str, rewards: Sequence[float], num_memory_turns: int = 2) -> list[Trajectory]:
    """One GRPO group: one trajectory per reward, ids `<group_id>/s<i>`, equal turn counts."""
    return [make_trajectory(f"{group_id}/s{i}", group_id, num_memory_turns, reward=r, sample_index=i)
            for i, r in enumerate(rewards)]
