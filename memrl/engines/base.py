"""The engine contract: token ids in, token ids and their log-probs out, asynchronously.

Engines never take text prompts. A result carries, for every generated token (the stop token included
when one was sampled), its log-prob under the distribution it was sampled from (temperature and top_p
applied), and a finish reason: `stop` (a stop token was sampled), `length` (max_tokens reached), or
`error` (with a message; output may be empty). An engine never raises for one bad request when it can
report `error` instead, so one failure never kills a batch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

FinishReason = Literal["stop", "length", "error"]


@dataclass
class GenerationRequest:
    prompt_ids: list[int]
    max_tokens: int
    temperature: float = 1.0
    top_p: float = 1.0
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int | None = None

    def __post_init__(self) -> None:
        if not self.prompt_ids:
            raise ValueError("GenerationRequest.prompt_ids is empty; an engine needs at least one prompt token")
        if self.max_tokens <= 0:
            raise ValueError(f"GenerationRequest.max_tokens must be > 0, got {self.max_tokens}")


@dataclass
class GenerationResult:
    output_ids: list[int]
    log_probs: list[float]
    finish_reason: FinishReason
    error: str | None = None

    @classmethod
    def failed(cls, message: str) -> GenerationResult:
        return cls(output_ids=[], log_probs=[], finish_reason="error", error=message)


class EngineError(RuntimeError):
    """An engine cannot serve at all (model missing, server unreachable after retries)."""


@runtime_checkable
class Engine(Protocol):
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for every request; results in request order. Concurrent calls are batched together."""
        ...

    async def close(self) -> None:
        ...
