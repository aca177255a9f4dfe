"""The lockstep MemAgent schedule, as a baseline for bench/rollout.py only (never used for training).

    turn 0:  one engine call with turn 0 of every trajectory          -> wait for all of them
    turn i:  one engine call with turn i of every trajectory that still has a chunk i -> wait for all
    final:   one engine call with every final turn, after the last chunk of the longest document

This is the official MemAgent sync path (docs/design.md, pitfall "Lockstep turns"): every step waits for its slowest
request, and every final turn waits for the longest document. It uses the same `PromptBuilder`, caps,
stop tokens and per-request seeds as `memrl.memagent.rollout.run_trajectory`, so only the schedule
differs: with a seeded engine both schedules sample the same tokens (up to batch-dependent float
rounding), and the wall times compare like with like.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from memrl.data.records import QuestionRecord
from memrl.engines.base import GenerationRequest, GenerationResult
from memrl.memagent.chunking import Chunks
from memrl.memagent.rollout import builder_of, document_chunks, rollout_metrics
from memrl.rollout import RolloutContext, finish_rollout, request_seed
from memrl.types import RolloutOutput, Trajectory, Turn


@dataclass
class _State:
    """One trajectory in flight: its chunks, current memory (None = no memory yet) and record."""

    trajectory: Trajectory
    question: str
    chunks: Chunks
    seed_key: str
    memory_ids: list[int] | None = None
    truncations: int = 0


def _turn(index: int, kind: str, prompt: list[int], result: GenerationResult, max_tokens: int) -> Turn:
    return Turn(index=index, kind=kind, prompt_ids=prompt, response_ids=list(result.output_ids),
                rollout_log_probs=list(result.log_probs), loss_mask=[1] * len(result.output_ids),
                finish_reason=result.finish_reason, max_tokens=max_tokens)


async def _call(ctx: RolloutContext, requests: list[GenerationRequest]) -> list[GenerationResult]:
    """One engine call for a whole turn; an engine exception fails every request of it, not the run."""
    if not requests:
        return []
    try:
        return await ctx.engine.generate(requests)
    except Exception as error:
        return [GenerationResult.failed(f"{type(error).__name__}: {error}") for _ in requests]


async def generate_rollout_lockstep(ctx: RolloutContext, records: Sequence[QuestionRecord]) -> RolloutOutput:
    """Same output contract as `MemAgentTask.generate`, with every turn of the batch advanced together."""
    start = time.perf_counter()
    sampling, task, builder = ctx.config.sampling, ctx.config.task, builder_of(ctx)
    stop_ids = builder.stop_token_ids
    states: list[_State] = []
    for group in ctx.groups(records):  # the framework's slots and keys: same ids and seeds as MemAgentTask.generate
        record = group.record
        chunks = document_chunks(ctx.tokenizer, task, record.context)
        for k in range(sampling.n_samples):
            traj = Trajectory(trajectory_id=group.trajectory_id(k), group_id=group.group_id, sample_index=k,
                              turns=[], metadata={"chunks": chunks.to_metadata(), "question_id": record.id,
                                                  "golds": list(record.answers)})
            states.append(_State(traj, record.question, chunks, group.key))

    def fail(state: _State, message: str) -> None:
        state.trajectory.status, state.trajectory.error = "failed", message

    longest = max((s.chunks.num_chunks for s in states), default=0)
    for i in range(longest):
        active = [s for s in states if s.trajectory.status != "failed" and i < s.chunks.num_chunks]
        prompts = [builder.memory_prompt_ids(s.question, s.memory_ids, s.chunks.chunks[i]) for s in active]
        requests = [GenerationRequest(p, task.memory_tokens, sampling.temperature, sampling.top_p, stop_ids,
                                      seed=request_seed(sampling.seed, s.seed_key, s.trajectory.sample_index, i))
                    for s, p in zip(active, prompts, strict=True)]
        for state, prompt, result in zip(active, prompts, await _call(ctx, requests), strict=True):
            if result.finish_reason == "error" or not result.output_ids:
                fail(state, f"memory turn {i}: {result.error or 'engine returned no tokens'}")
                continue
            state.trajectory.turns.append(_turn(i, "memory", prompt, result, task.memory_tokens))
            state.memory_ids, recut = builder.cap_memory(result.output_ids)
            state.truncations += int(recut or result.finish_reason == "length")

    # Final turns only now, after the longest document's last chunk (the lockstep cost measured).
    active = [s for s in states if s.trajectory.status != "failed"]
    prompts = [builder.final_prompt_ids(s.question, s.memory_ids) for s in active]
    requests = [GenerationRequest(p, task.final_tokens, sampling.temperature, sampling.top_p, stop_ids,
                                  seed=request_seed(sampling.seed, s.seed_key, s.trajectory.sample_index,
                                                    len(s.trajectory.turns)))
                for s, p in zip(active, prompts, strict=True)]
    for state, prompt, result in zip(active, prompts, await _call(ctx, requests), strict=True):
        traj = state.trajectory
        if result.finish_reason == "error" or not result.output_ids:
            fail(state, f"final turn: {result.error or 'engine returned no tokens'}")
            continue
        traj.turns.append(_turn(len(traj.turns), "final", prompt, result, task.final_tokens))
        traj.answer = builder.tokenizer.decode([t for t in result.output_ids if t not in stop_ids],
                                               skip_special_tokens=True)
        traj.status = "complete" if result.finish_reason == "stop" else "truncated"
    for state in states:
        state.trajectory.metadata.update(memory_truncations=state.truncations,
                                         final_memory_length=len(state.memory_ids or []))

    # As in MemAgentTask.generate: a group with a failed trajectory is left out whole (GRPO needs the group).
    trajectories = [s.trajectory for s in states]
    groups: dict[str, list[Trajectory]] = {}
    for traj in trajectories:
        groups.setdefault(traj.group_id, []).append(traj)
    metrics = rollout_metrics(trajectories)
    metrics["time/generate_s"] = time.perf_counter() - start
    return finish_rollout(list(groups.values()), metrics)
