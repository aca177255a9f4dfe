"""An Engine whose replies a test chooses per request (by the decoded prompt); records every request."""

from __future__ import annotations

from collections.abc import Callable

from memrl.engines.base import GenerationRequest, GenerationResult


class ScriptedEngine:
    """`reply(prompt_text)` gives the response text; it is sent back as its ids + the first stop id."""

    def __init__(self, tokenizer, reply: Callable[[str], str]):
        self.tokenizer = tokenizer
        self.reply = reply
        self.requests: list[GenerationRequest] = []

    def prompt_texts(self) -> list[str]:
        return [self.tokenizer.decode(r.prompt_ids) for r in self.requests]

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        results = []
        for request in requests:
            self.requests.append(request)
            text = self.reply(self.tokenizer.decode(request.prompt_ids))
            ids = list(self.tokenizer(text, add_special_tokens=False)["input_ids"]) + request.stop_token_ids[:1]
            results.append(GenerationResult(ids, [-0.5] * len(ids), "stop"))
        return results

    async def close(self) -> None:
        pass
