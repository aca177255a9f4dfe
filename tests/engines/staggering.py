"""Driving an engine in the engine tests: one call then close (`generate`), and rows joining a running
batch, made deterministic (`staggered`: hold the batch at a decode step, send more calls, let it go on)."""

from __future__ import annotations

import asyncio
import threading
from typing import Any


def generate(engine: Any, requests: list) -> list:
    """`requests` as one call on a fresh event loop, the engine closed after it (also when it raises)."""
    async def main():
        try:
            return await engine.generate(requests)
        finally:
            await engine.close()
    return asyncio.run(main())


async def staggered(engine: Any, first: list, later: list, *, hold: tuple[Any, str],
                    after_steps: int = 3) -> tuple[list, list, list[str]]:
    """Send `first`; when the batch reaches decode step `after_steps` (the engine's own count), hold it
    there, send each of `later` as its own call, then let it go on. `hold` names the callable every step
    goes through, `(object, attribute)`: `(engine, "_forward")` for the dynamic path, `(engine.static_decoder,
    "forward")` for the static one; it is patched for the call and restored after. Returns both result
    lists and the completion order ('first' / 'later:i'), recorded as each call's result arrives."""
    engine.reset_stats()  # the gate counts this call's decode steps
    loop = asyncio.get_running_loop()
    reached, gate = asyncio.Event(), threading.Event()
    owner, name = hold
    original = getattr(owner, name)

    def gated(*args):
        if engine.stats.decode_steps == after_steps and not gate.is_set():
            loop.call_soon_threadsafe(reached.set)
            gate.wait(10)
        return original(*args)

    setattr(owner, name, gated)
    order: list[str] = []

    async def call(tag: str, requests: list) -> list:
        results = await engine.generate(requests)
        order.append(tag)
        return results

    try:
        first_task = asyncio.ensure_future(call("first", first))
        await asyncio.wait_for(reached.wait(), 10)
        later_tasks = [asyncio.ensure_future(call(f"later:{i}", [r])) for i, r in enumerate(later)]
        await asyncio.sleep(0)  # the later calls run up to their await: they are queued
        gate.set()
        first_results = await asyncio.wait_for(first_task, 30)
        later_results = [(await asyncio.wait_for(t, 30))[0] for t in later_tasks]
    finally:
        gate.set()
        setattr(owner, name, original)
    return first_results, later_results, order
