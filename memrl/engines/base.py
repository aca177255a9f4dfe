"""The engine contract: token ids in, token ids and their log-probs out, asynchronously.

Engines never take text prompts. A result carries, for every generated token (a sampled stop token
included), its log-prob under the distribution it was sampled from (temperature and top_p applied), and a
finish reason: `stop`, `length`, or `error` (with a message); an engine reports `error` for one bad
request rather than raise, so one failure never kills a batch. Weight sync is part of the contract:
`sync_from(source)` takes the trainer's weights in the form the engine can use (an in-process engine
copies `whole_weights()`, a served one has its server reload `saved_folder()`), and `score` gives the
teacher-forced log-probs the trainer's weight-sync canary compares (memrl/train/sync_check.py).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from memrl.errors import MemrlError

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


class EngineError(RuntimeError, MemrlError):
    """An engine cannot serve at all (model missing, server unreachable after retries)."""


@dataclass(frozen=True)
class SyncProbe:
    """The trainer's teacher-forced log-probs of `continuation_ids` after `prompt_ids` at `temperature`, taken
    while it held weight version `version` (the weights after step version - 1); `dtype` (its forward's),
    `layers` and `width` (depth, widest matrix product) scale the float tolerance of the comparison."""

    prompt_ids: list[int]
    continuation_ids: list[int]
    temperature: float
    log_probs: list[float]
    version: int
    dtype: str
    layers: int
    width: int


@dataclass
class ScoreResult:
    """An engine's teacher-forced log-probs (one per continuation token) and the dtype its forward ran in."""

    log_probs: list[float]
    dtype: str


class WeightSource(Protocol):
    """The trainer's current weights, in the two forms engines take them."""

    def whole_weights(self) -> Mapping[str, Any]:
        """Every tensor of the policy under its Hugging Face name (the engine copies them into its model)."""
        ...

    def saved_folder(self) -> str:
        """A Hugging Face folder holding these weights that the engine's server can read (written on the
        first call for a weight version)."""
        ...


@dataclass
class WeightsInMemory:
    """A `WeightSource` over a state dict already at hand (tests, tools); it has no folder."""

    weights: Mapping[str, Any]
    probe: SyncProbe | None = None  # the trainer's canary for these weights, checked after an engine syncs

    def whole_weights(self) -> Mapping[str, Any]:
        return self.weights

    def saved_folder(self) -> str:
        raise EngineError("these weights exist only in memory; a served engine needs them saved to a folder")


@dataclass
class WeightsOnDisk:
    """A `WeightSource` that is a saved Hugging Face folder (what a served engine's server reloads)."""

    folder: str
    probe: SyncProbe | None = None  # the trainer's canary for these weights, checked after an engine syncs

    def whole_weights(self) -> Mapping[str, Any]:
        raise EngineError(f"these weights are the folder {self.folder}; an in-process engine needs them in memory")

    def saved_folder(self) -> str:
        return self.folder


@runtime_checkable
class Engine(Protocol):
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Generate for every request; results in request order. Concurrent calls are batched together."""
        ...

    async def sync_from(self, source: WeightSource) -> None:
        """Generate with `source`'s weights from the next request on (called between rollout steps)."""
        ...

    async def score(self, prompt_ids: list[int], continuation_ids: list[int], temperature: float) -> ScoreResult:
        """Log-probs of `continuation_ids` following `prompt_ids` under the current weights, teacher-forced
        (nothing sampled), from softmax(logits / temperature) (raw logits at temperature 0; no top_p): the
        weight-sync canary's engine side. An engine that cannot score raises EngineError saying so."""
        ...

    async def close(self) -> None:
        ...
