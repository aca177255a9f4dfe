"""Plugins the Ray tests load by import path in worker processes (tests/distributed is on their PYTHONPATH)."""

import asyncio

from memrl.memagent.rollout import generate_rollout


def parity_reward(traj, golds):
    """A reward that varies within a group even for a random model (the real one is 0 for all)."""
    return float(traj.turns[-1].response_ids[0] % 2 == 0)


async def generate_or_hang(ctx, records):
    """The built-in rollout, except that a question with id "hang" never finishes (a stuck worker)."""
    if any(r.id == "hang" for r in records):
        await asyncio.sleep(3600)
    return await generate_rollout(ctx, records)
