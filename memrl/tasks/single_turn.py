"""A second, minimal task beside MemAgent: single-turn question answering on the plain 1:1 path.

Each trajectory is one generation (question + context in one prompt, answer in \\boxed{}), one row per
trajectory, no `train_row_count`. It exists to show (and test) the extension points with the least code:

    plugins:
      generate_function: memrl.tasks.single_turn:generate_single_turn
      convert_function:  memrl.rl.plain:convert_one_row_per_trajectory
      reward_function:   memrl.memagent.reward:trajectory_reward
    queue:
      train_sample_expansion_factor: 1     # 1:1, so the rollout announces no row count

See docs/custom-tasks.md for writing your own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from memrl.engines.base import GenerationRequest
from memrl.memagent.rollout import QuestionLike, RolloutContext, request_seed, rollout_metrics
from memrl.types import RolloutOutput, Trajectory, Turn

PROMPT = "Read the text and answer the question. Put the answer in \\boxed{{}}.\n\n{context}\n\nQuestion: {question}"


def prompt_ids(ctx: RolloutContext, record: QuestionLike) -> list[int]:
    text = PROMPT.format(context=record.context, question=record.question)
    return list(ctx.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False,
                                                  enable_thinking=ctx.config.rollout.enable_thinking))


async def _sample(ctx: RolloutContext, record: QuestionLike, slot: int, k: int, prompt: list[int]) -> Trajectory:
    r = ctx.config.rollout
    key = f"{ctx.rollout_id}:{slot}:{record.id}"  # slot: a batch may hold one question twice
    group_id = f"r{key}"
    request = GenerationRequest(prompt, r.final_tokens, r.temperature, r.top_p, ctx.builder.stop_token_ids,
                                seed=request_seed(r.seed, key, k, 0))
    (result,) = await ctx.engine.generate([request])
    traj = Trajectory(trajectory_id=f"{group_id}:s{k}", group_id=group_id, sample_index=k, turns=[],
                      metadata={"question_id": record.id, "golds": list(record.answers)})
    if result.finish_reason == "error" or not result.output_ids:
        traj.status, traj.error, traj.reward = "failed", result.error or "no tokens", 0.0
        return traj
    traj.turns.append(Turn(0, "final", prompt, list(result.output_ids), list(result.log_probs),
                           [1] * len(result.output_ids), result.finish_reason, r.final_tokens))
    traj.answer = ctx.tokenizer.decode([t for t in result.output_ids if t not in ctx.builder.stop_token_ids],
                                       skip_special_tokens=True)
    traj.status = "complete" if result.finish_reason == "stop" else "truncated"
    traj.reward = float(ctx.reward_function(traj, list(record.answers))) if ctx.reward_function else None
    return traj


async def generate_single_turn(ctx: RolloutContext, records: Sequence[QuestionLike]) -> RolloutOutput:
    """`n_samples` one-turn trajectories per question; groups with a failure are left out of training."""
    n = ctx.config.rollout.n_samples
    groups = await asyncio.gather(*(
        asyncio.gather(*(_sample(ctx, rec, slot, k, prompt_ids(ctx, rec)) for k in range(n)))
        for slot, rec in enumerate(records)))
    kept = [t for g in groups if all(t.status != "failed" for t in g) for t in g]
    dropped = [t for g in groups if any(t.status == "failed" for t in g) for t in g]
    return RolloutOutput(trajectories=kept, metrics=rollout_metrics([t for g in groups for t in g]),
                         train_row_count=None, dropped=dropped)
