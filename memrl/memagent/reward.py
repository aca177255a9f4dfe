"""Reward of a MemAgent trajectory (the `plugins.reward_function` extension point), via memrl.scoring.

Only the final answer (`Trajectory.answer`, the final turn's text) is scored; memory turns get no
reward of their own (docs/design.md §2). A trajectory that did not finish its answer scores 0 (docs/design.md §2: "missing
box, mismatch, truncated or failed generation -> 0"): `failed` (generation error) and `truncated`
(the final answer hit its token limit) both count as unfinished.

The answer extractor (`rollout.answer_extractor`) travels with the trajectory: the rollout records it
in `metadata["answer_extractor"]`, since the final prompt it ran asked for that answer format; an
explicit `extractor` argument overrides it, and a trajectory without it (other tasks) is read `boxed`.

Invariant: `trajectory_reward(t, golds) == score_trajectory(t, golds).em`, so the training reward and
the evaluation EM can never disagree. Neither function raises on odd answers.
"""

from __future__ import annotations

from collections.abc import Iterable

from memrl.scoring import AnswerScore, normalize_answer, reward_from_text, score_answer
from memrl.types import Trajectory, Turn

DEFAULT_EXTRACTOR = "boxed"


def _finished(traj: Trajectory) -> bool:
    return traj.status == "complete"


def trajectory_extractor(traj: Trajectory, extractor: str | None = None) -> str:
    """The answer extractor for `traj`: `extractor` if given, else the one its rollout recorded."""
    if extractor is not None:
        return extractor
    return str((traj.metadata or {}).get("answer_extractor", DEFAULT_EXTRACTOR))


def trajectory_reward(traj: Trajectory, golds: Iterable[str], extractor: str | None = None) -> float:
    """1.0 if the finished final answer (read by the trajectory's extractor) matches a gold (HotpotQA EM)."""
    if not _finished(traj):
        return 0.0
    return reward_from_text(traj.answer, golds, trajectory_extractor(traj, extractor))


def score_trajectory(traj: Trajectory, golds: Iterable[str], extractor: str | None = None) -> AnswerScore:
    """EM, sub_EM, F1 and missing-box of the final answer, for metrics and evaluation.

    A failed trajectory is a missing answer. A truncated one keeps what it boxed (and `missing_box`
    says whether it boxed anything) but all its metrics are 0, matching its reward.
    """
    text = traj.answer if traj.status != "failed" else ""
    score = score_answer(text, golds, trajectory_extractor(traj, extractor))
    if _finished(traj):
        return score
    return AnswerScore(boxed=score.boxed, em=0.0, sub_em=0.0, f1=0.0, missing_box=score.missing_box)


def gold_in_text(text: str, golds: Iterable[str]) -> bool:
    """A normalised gold answer occurs in the normalised `text` as whole words (HotpotQA normalisation)."""
    padded = f" {normalize_answer(text)} "
    return any(g and f" {g} " in padded for g in (normalize_answer(str(gold)) for gold in golds))


def memory_recall(turn: Turn, trajectory: Trajectory, golds: Iterable[str]) -> float:
    """The built-in `algorithm.turn_reward_function`: 1.0 when a gold answer occurs in the turn's text (a
    memory turn: the memory it wrote; the final turn: its answer), else 0.0. The text is the decoded
    response the trainer stored in `metadata["turn_texts"]` (memrl.rl.turn_rewards)."""
    return float(gold_in_text(trajectory.metadata["turn_texts"][turn.index], golds))
