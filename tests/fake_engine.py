"""A scripted Engine for rollout tests: deterministic per seed, records every request it saw."""

from __future__ import annotations

import asyncio
import random

from memrl.engines.base import GenerationRequest, GenerationResult


class FakeEngine:
    def __init__(self, vocab_ids: list[int], stop_id: int, fail_when=None, delay_s: float = 0.0):
        self.vocab_ids = vocab_ids
        self.stop_id = stop_id
        self.fail_when = fail_when  # callable(request) -> bool
        self.delay_s = delay_s
        self.requests: list[GenerationRequest] = []
        self.in_flight = 0
        self.max_in_flight = 0

    async def generate(self, requests):
        self.in_flight += len(requests)
        self.max_in_flight = max(self.max_in_flight, self.in_flight)
        try:
            await asyncio.sleep(self.delay_s)
            return [self._one(r) for r in requests]
        finally:
            self.in_flight -= len(requests)

    def _one(self, req: GenerationRequest) -> GenerationResult:
        self.requests.append(req)
        if self.fail_when is not None and self.fail_when(req):
            return GenerationResult.failed("injected failure")
        rng = random.Random(req.seed)
        n = rng.randint(1, int(req.max_tokens * 1.5) + 1)
        if n > req.max_tokens:
            ids = [rng.choice(self.vocab_ids) for _ in range(req.max_tokens)]
            reason = "length"
        else:
            ids = [rng.choice(self.vocab_ids) for _ in range(n - 1)] + [self.stop_id]
            reason = "stop"
        return GenerationResult(ids, [-rng.random() for _ in ids], reason)

    async def close(self):
        pass
