"""Plugins the Ray tests load by import path in worker processes (tests/distributed is on their PYTHONPATH)."""

import asyncio

from memrl.memagent.task import MemAgentTask


def parity_reward(traj, golds):
    """A reward that varies within a group even for a random model (the real one is 0 for all)."""
    return float(traj.turns[-1].response_ids[0] % 2 == 0)


class HangingTask(MemAgentTask):
    """The built-in task, except that a question with id "hang" never finishes (a stuck worker)."""

    async def generate(self, ctx, records):
        if any(r.id == "hang" for r in records):
            await asyncio.sleep(3600)
        return await super().generate(ctx, records)
