"""A second, minimal task beside MemAgent: single-turn question answering on the plain 1:1 path (question
and context in one prompt, one row per trajectory, the framework's converter, reward and view). It shows
(and tests) a whole Task in the least code; it runs through every command with no framework change
(docs/custom-tasks.md: `plugins.task: memrl.tasks.single_turn:SingleTurnTask`).
"""

from __future__ import annotations

import asyncio

from memrl.engines.base import GenerationRequest
from memrl.rollout import GroupSlot, RolloutContext, request_seed
from memrl.task import Task
from memrl.types import Trajectory, Turn

PROMPT = "Read the text and answer the question. Put the answer in \\boxed{{}}.\n\n{context}\n\nQuestion: {question}"


class SingleTurnTask(Task):
    def prompt_ids(self, ctx: RolloutContext, record: object) -> list[int]:
        text = PROMPT.format(context=record.context, question=record.question)
        return list(ctx.tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=True,
                                                      add_generation_prompt=True, return_dict=False,
                                                      enable_thinking=ctx.config.task.enable_thinking))

    async def sample_group(self, ctx: RolloutContext, group: GroupSlot, n: int) -> list[Trajectory]:
        prompt = self.prompt_ids(ctx, group.record)
        return list(await asyncio.gather(*(self.sample(ctx, group, k, prompt) for k in range(n))))

    async def sample(self, ctx: RolloutContext, group: GroupSlot, k: int, prompt: list[int]) -> Trajectory:
        sampling, task, record = ctx.config.sampling, ctx.config.task, group.record
        stops = self.stop_token_ids(ctx.tokenizer, ctx.config)
        request = GenerationRequest(prompt, task.final_tokens, sampling.temperature, sampling.top_p, stops,
                                    seed=request_seed(sampling.seed, group.key, k, 0))
        (result,) = await ctx.engine.generate([request])
        traj = Trajectory(trajectory_id=group.trajectory_id(k), group_id=group.group_id, sample_index=k, turns=[],
                          metadata={"question_id": record.id, "question": record.question,
                                    "golds": list(record.answers)})
        if result.finish_reason == "error" or not result.output_ids:
            traj.status, traj.error, traj.reward = "failed", result.error or "no tokens", 0.0
            return traj
        traj.turns.append(Turn(0, "final", prompt, list(result.output_ids), list(result.log_probs),
                               [1] * len(result.output_ids), result.finish_reason, task.final_tokens))
        traj.answer = ctx.tokenizer.decode([t for t in result.output_ids if t not in stops], skip_special_tokens=True)
        traj.status = "complete" if result.finish_reason == "stop" else "truncated"
        traj.reward = ctx.reward(traj, record.answers)
        return traj
