"""Reward of a MemAgent trajectory (the `plugins.reward_function` extension point), via memrl.scoring.

Only the final answer (`Trajectory.answer`, the final turn's text) is scored; memory turns get no
reward of their own (SPEC §2). A trajectory that did not finish its answer scores 0 (SPEC §2: "missing
box, mismatch, truncated or failed generation -> 0"): `failed` (generation error) and `truncated`
(the final answer hit its token limit) both count as unfinished.

Invariant: `trajectory_reward(t, golds) == score_trajectory(t, golds).em`, so the training reward and
the evaluation EM can never disagree. Neither function raises on odd answers.
"""

from __future__ import annotations

from memrl.scoring import AnswerScore, reward_from_text, score_answer
from memrl.types import Trajectory


def _finished(traj: Trajectory) -> bool:
    return traj.status == "complete"


def trajectory_reward(traj: Trajectory, golds: list[str]) -> float:
    """1.0 if the finished final answer's last `\\boxed{}` matches a gold answer (HotpotQA EM), else 0.0."""
    if not _finished(traj):
        return 0.0
    return reward_from_text(traj.answer, golds)


def score_trajectory(traj: Trajectory, golds: list[str]) -> AnswerScore:
    """EM, sub_EM, F1 and missing-box of the final answer, for metrics and evaluation.

    A failed trajectory is a missing answer. A truncated one keeps what it boxed (and `missing_box`
    says whether it boxed anything) but all its metrics are 0, matching its reward.
    """
    score = score_answer(traj.answer if traj.status != "failed" else "", golds)
    if _finished(traj):
        return score
    return AnswerScore(boxed=score.boxed, em=0.0, sub_em=0.0, f1=0.0, missing_box=score.missing_box)
