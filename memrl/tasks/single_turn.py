"""A second, minimal task beside MemAgent: single-turn question answering on the plain 1:1 path (question
and context in one prompt, one row per trajectory, the framework's converter, reward and view). It shows
(and tests) a whole Task in the least code; it runs through every command with no framework change
(docs/custom-tasks.md: `plugins.task: memrl.tasks.single_turn:SingleTurnTask`).
"""

from __future__ import annotations

import asyncio

from memrl.rollout import GroupSlot, RolloutContext
from memrl.task import Task
from memrl.types import Trajectory

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
        record = group.record
        traj = Trajectory(trajectory_id=group.trajectory_id(k), group_id=group.group_id, sample_index=k, turns=[],
                          metadata={"question_id": record.id, "question": record.question,
                                    "golds": list(record.answers)})
        await ctx.sample_turn(group, traj, "final", prompt, ctx.config.task.final_tokens)  # None: traj failed
        traj.reward = ctx.reward(traj, record.answers)
        return traj
