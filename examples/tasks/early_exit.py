"""An early-exit reader (issue 36): MemAgent that, after each memory turn but the last, may answer and stop.

The exit decision is an answer attempt. After memory turn i the model answers from question + memory with the
final turn's own prompt: a committed answer (finished, boxed, not `task.pass_answer`) ends the trajectory, that
turn its final turn and the rest of the document unread; the pass answer (or no box, or an answer cut at its
limit) reads on, the attempt kept as a `probe` turn, trained like every other. Why this gate: a reader
warm-started to box "unknown" while its memory lacks the fact (the CPU demo's, docs/demo.md) already passes
exactly when it should, so even a tiny model starts from a sensible exit policy, which GRPO refines through the
answers it is rewarded for. A gate of its own words ("stop" / "read") would start at chance, and an exit marker
in the memory is a token such a reader never writes: neither would be explored.

Reward: the terms `outcome` (EM, the task's answer reward) and `unread`, the share of the document's chunks
left unread when the answer is right (0 when wrong: skipping is worth nothing without the answer, else a guess
at the first chunk would pay; None for a one-chunk document, which has nothing to skip). `unread` weighs 0
until `algorithm.reward_weights.unread` sets it; `reward/unread` is logged either way. The share of chunks read
is `reading/chunk_share` in training and `chunks_read` / `num_chunks` on every eval line.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from pydantic import Field

from memrl.memagent.rollout import builder_of, passed_memory
from memrl.memagent.settings import MemAgentSettings
from memrl.memagent.task import MemAgentTask
from memrl.rollout import GroupSlot, RolloutContext
from memrl.task import Phase, score_trajectory
from memrl.types import Trajectory


class EarlyExitSettings(MemAgentSettings):
    pass_answer: str = Field("unknown", description="The answer that reads on: an answer attempt that boxes it "
                             "(or nothing) reads the next chunk, any other answer ends the reading.")


def chunks_read(traj: Trajectory) -> int:
    return sum(turn.kind == "memory" for turn in traj.turns)


def unread_fraction(traj: Trajectory, golds: list[str]) -> float | None:
    """The `unread` term: EM x (1 - chunks read / the document's chunks); None for a one-chunk document."""
    total = traj.metadata["chunks"]["num_chunks"]
    if total < 2:
        return None
    return score_trajectory(traj, golds).em * (1.0 - chunks_read(traj) / total)


def commits(traj: Trajectory, pass_answer: str) -> bool:
    """Whether the answer just sampled ends the reading: finished, boxed, and not the pass answer."""
    score = score_trajectory(traj, [pass_answer])
    return traj.status == "complete" and score.boxed is not None and not score.em


class EarlyExitTask(MemAgentTask):
    Settings = EarlyExitSettings
    reward_weights = {"unread": 0.0}  # EM alone until algorithm.reward_weights.unread sets the bonus

    def reward_terms(self, cfg: Any) -> dict[str, Any]:
        return {**super().reward_terms(cfg), "unread": unread_fraction}

    def max_rows_per_trajectory(self, cfg: Any) -> int:
        return 2 * cfg.task.max_chunks  # a memory turn per chunk, a probe between two, the final turn

    async def keep_reading(self, ctx: RolloutContext, group: GroupSlot, traj: Trajectory) -> bool:
        """Answer from question + the memory just written, as the final turn would: False when the answer
        commits (it is the final turn) or the request failed; else it becomes a `probe` and the reading goes on."""
        builder = builder_of(ctx)
        memory, _ = passed_memory(builder, traj.turns[-1])
        turn = await ctx.sample_turn(group, traj, "final", builder.final_prompt_ids(group.record.question, memory),
                                     ctx.config.task.final_tokens)
        if turn is None or commits(traj, ctx.config.task.pass_answer):
            return False
        turn.kind, traj.answer, traj.status = "probe", "", "complete"  # no answer yet: the final turn comes later
        return True

    def turn_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        """MemAgent's, plus `reading/chunk_share` (chunks read / the documents' chunks: the plain reader's is 1)
        and `reading/stopped_early` (the share of trajectories that answered before the last chunk)."""
        metrics = super().turn_metrics(trajectories)
        total = sum(t.metadata["chunks"]["num_chunks"] for t in trajectories)
        if total:
            metrics["reading/chunk_share"] = sum(chunks_read(t) for t in trajectories) / total
            metrics["reading/stopped_early"] = sum(bool(t.metadata.get("stopped_reading")) for t in trajectories) / len(
                trajectories)
        return metrics

    def log_fields(self, traj: Trajectory | None, phase: Phase) -> dict[str, Any]:
        return {**super().log_fields(traj, phase), "chunks_read": None if traj is None else chunks_read(traj)}
