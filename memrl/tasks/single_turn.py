"""A second, minimal task beside MemAgent: single-turn question answering on the plain 1:1 path.

Each trajectory is one generation (question + context in one prompt, answer in \\boxed{}), one row per
trajectory, no `train_row_count` (so the loop expects one row per trajectory). It exists to show (and
test) the extension points with the least code:

    plugins:
      generate_function: memrl.tasks.single_turn:generate_single_turn
      convert_function:  memrl.rl.plain:convert_one_row_per_trajectory
      reward_function:   memrl.memagent.reward:trajectory_reward

See docs/custom-tasks.md for writing your own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

from memrl.engines.base import GenerationRequest
from memrl.rollout import GroupSlot, QuestionLike, RolloutContext, finish_rollout, request_seed
from memrl.types import RolloutOutput, Trajectory, Turn

PROMPT = "Read the text and answer the question. Put the answer in \\boxed{{}}.\n\n{context}\n\nQuestion: {question}"


def prompt_ids(ctx: RolloutContext, record: QuestionLike) -> list[int]:
    text = PROMPT.format(context=record.context, question=record.question)
    return list(ctx.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                  add_generation_prompt=True, return_dict=False,
                                                  enable_thinking=ctx.config.rollout.enable_thinking))


async def _sample(ctx: RolloutContext, group: GroupSlot, k: int, prompt: list[int]) -> Trajectory:
    r, record = ctx.config.rollout, group.record
    request = GenerationRequest(prompt, r.final_tokens, r.temperature, r.top_p, ctx.stop_token_ids,
                                seed=request_seed(r.seed, group.key, k, 0))
    (result,) = await ctx.engine.generate([request])
    traj = Trajectory(trajectory_id=group.trajectory_id(k), group_id=group.group_id, sample_index=k, turns=[],
                      metadata={"question_id": record.id, "golds": list(record.answers)})
    if result.finish_reason == "error" or not result.output_ids:
        traj.status, traj.error, traj.reward = "failed", result.error or "no tokens", 0.0
        return traj
    traj.turns.append(Turn(0, "final", prompt, list(result.output_ids), list(result.log_probs),
                           [1] * len(result.output_ids), result.finish_reason, r.final_tokens))
    traj.answer = ctx.tokenizer.decode([t for t in result.output_ids if t not in ctx.stop_token_ids],
                                       skip_special_tokens=True)
    traj.status = "complete" if result.finish_reason == "stop" else "truncated"
    traj.reward = ctx.reward(traj, record.answers)
    return traj


async def generate_single_turn(ctx: RolloutContext, records: Sequence[QuestionLike]) -> RolloutOutput:
    """`n_samples` one-turn trajectories per question; groups with a failure are left out of training."""
    n = ctx.config.rollout.n_samples
    groups = await asyncio.gather(*(
        asyncio.gather(*(_sample(ctx, g, k, prompt_ids(ctx, g.record)) for k in range(n)))
        for g in ctx.groups(records)))
    return finish_rollout(groups, one_row_per_turn=False)


def max_rows_per_trajectory(cfg: object) -> int:
    """The hook memrl.rollout reads: one row per trajectory."""
    return 1
