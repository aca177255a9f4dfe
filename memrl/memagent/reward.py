"""MemAgent's per-turn scores: whether a memory holds a gold answer (`gold_in_text`), for the gold-recall
curve (`MemAgentTask.turn_metrics`) and the built-in turn reward `memory_recall`; the trajectory's own
reward is the framework's answer scorer (memory turns get none of their own, docs/design.md §2).
"""

from __future__ import annotations

from collections.abc import Iterable

from memrl.scoring import normalize_answer
from memrl.types import Trajectory, Turn


def gold_in_text(text: str, golds: Iterable[str]) -> bool:
    """A normalised gold answer occurs in the normalised `text` as whole words (HotpotQA normalisation)."""
    padded = f" {normalize_answer(text)} "
    return any(g and f" {g} " in padded for g in (normalize_answer(str(gold)) for gold in golds))


def memory_recall(turn: Turn, trajectory: Trajectory, golds: Iterable[str]) -> float:
    """The built-in `algorithm.turn_reward_function`: 1.0 when a gold answer occurs in the turn's decoded
    response (`metadata["turn_texts"]`: a memory turn's memory, the final turn's answer), else 0.0."""
    return float(gold_in_text(trajectory.metadata["turn_texts"][turn.index], golds))
