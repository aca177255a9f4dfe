"""What `memrl serve` accepts and how it refuses: request bodies, their bounds, OpenAI-style error bodies.

Every malformed request is refused here with a 4xx and a body {"error": {"message", "type", "code"}}
before it reaches the engine; numeric fields are finite and in range, so no request carries a value an
engine would overflow on (a seed past int64) or sample nonsense from (an infinite temperature).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import chain
from typing import Annotated, Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, StrictFloat, StrictInt, field_validator

# Seeds and token ids travel as int64 (torch tensors, SGLang, vLLM); torch.Generator takes < 2**64, but
# int64 is what every engine behind this API accepts. HFEngine draws its own random seeds below 2**63.
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**63 - 1
# A positive temperature below this makes logits / T overflow float32 (NaN log-probs); 0 means greedy.
# Above the maximum the distribution is uniform to float precision: no sampling setting needs more.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0

TEXT_PROMPT_MESSAGE = (
    "memrl serve takes token-id prompts only: send `prompt` as a list of ints (or a list of lists of "
    "ints for a batch), tokenized on the client with the model's tokenizer and chat template"
)


class APIError(Exception):
    """A request the server refuses; becomes an OpenAI-style error response with `status`."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.kind = kind


def _parse_prompt(value: Any) -> list[list[int]]:
    """A prompt as a batch of token-id lists; ValueError with a message that says what to send."""
    if isinstance(value, str) or (isinstance(value, list) and value and all(isinstance(v, str) for v in value)):
        raise ValueError(TEXT_PROMPT_MESSAGE)
    if not isinstance(value, list) or not value:
        raise ValueError("`prompt` must be a non-empty list of token ids (ints) or a non-empty list of such lists")
    batch = value if isinstance(value[0], list) else [value]
    for i, ids in enumerate(batch):
        if not isinstance(ids, list) or not ids:
            raise ValueError(f"prompt {i} must be a non-empty list of token ids (ints)")
        # bool is an int subclass in Python; a JSON `true` in a prompt is a client bug, not token 1.
        bad = next((t for t in ids if not isinstance(t, int) or isinstance(t, bool)), None)
        if bad is not None:
            raise ValueError(f"prompt {i} holds {bad!r} ({type(bad).__name__}); token ids must be ints")
    return batch


def _temperature_in_range(value: float) -> float:
    if value != 0 and not MIN_TEMPERATURE <= value <= MAX_TEMPERATURE:
        raise ValueError(f"must be 0 (greedy) or between {MIN_TEMPERATURE:g} and {MAX_TEMPERATURE:g}, got {value!r}")
    return value


# Strict types: a JSON `true` or "0.7" in a numeric field is a client bug, not 1 or 0.7.
Temperature = Annotated[StrictFloat, Field(allow_inf_nan=False), AfterValidator(_temperature_in_range)]


class CompletionBody(BaseModel):
    """The /v1/completions request. Unknown OpenAI/vLLM fields are ignored; unsupported ones refused."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: Any
    max_tokens: StrictInt = Field(16, ge=1)
    temperature: Temperature = 1.0
    top_p: StrictFloat = Field(1.0, gt=0.0, le=1.0, allow_inf_nan=False)
    seed: StrictInt | None = None
    logprobs: StrictInt | None = Field(None, ge=0, le=20)
    stop_token_ids: list[StrictInt] = Field(default_factory=list)
    skip_special_tokens: bool = True
    n: StrictInt = Field(1, ge=1, le=1, description="one sample per prompt; send the prompt again for more")
    stream: bool = Field(False, description="streaming is not supported")
    stop: str | list[str] | None = Field(None, description="text stops are not supported; use stop_token_ids")
    echo: bool = Field(False, description="echo is not supported")

    @field_validator("prompt")
    @classmethod
    def _prompt_is_token_ids(cls, value: Any) -> list[list[int]]:
        return _parse_prompt(value)

    @field_validator("seed")
    @classmethod
    def _seed_in_range(cls, value: int | None) -> int | None:
        if value is not None and not 0 <= value <= MAX_SEED:
            raise ValueError(f"must be in [0, 2**63 - 1] (an int64 seed), got {value}")
        return value

    @field_validator("stream", "echo")
    @classmethod
    def _unsupported_flag(cls, value: bool) -> bool:
        if value:
            raise ValueError("not supported by memrl serve; send false")
        return value

    @field_validator("stop")
    @classmethod
    def _no_text_stops(cls, value: str | list[str] | None) -> None:
        if value:
            raise ValueError("text stop strings are not supported; send `stop_token_ids` instead")
        return None


class ScoreBody(BaseModel):
    """The /v1/score request: log-probs of `continuation_ids` after `prompt_ids`, teacher-forced."""

    model_config = ConfigDict(extra="forbid")
    prompt_ids: list[StrictInt] = Field(min_length=1)
    continuation_ids: list[StrictInt] = Field(min_length=1)
    temperature: Temperature = 1.0


class ReloadBody(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str = Field(min_length=1)

    @field_validator("path")
    @classmethod
    def _no_nul(cls, value: str) -> str:
        # The OS refuses such paths with an error; refusing them here keeps every refusal a 4xx.
        if "\x00" in value:
            raise ValueError("a path cannot contain a NUL character")
        return value


def check_token_ids(id_lists: list[list[int]], vocab_size: int | None) -> None:
    """400 for an id outside the vocabulary; with no known vocabulary, outside int64 (what engines take)."""
    limit = vocab_size if vocab_size is not None else MAX_TOKEN_ID + 1
    bad = next((t for t in chain.from_iterable(id_lists) if not 0 <= t < limit), None)
    if bad is not None:
        where = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "[0, 2**63)"
        raise APIError(400, f"token id {bad} is outside {where}")


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(status_code=err.status,
                        content={"error": {"message": err.message, "type": err.kind, "code": err.status}})


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        # pydantic prefixes messages of raised ValueErrors with "Value error, "; the rest is ours.
        parts.append(f"{where}: {str(error.get('msg', '')).removeprefix('Value error, ')}")
    return "invalid request: " + "; ".join(parts)


def add_error_handlers(app: FastAPI) -> None:
    """Every failure answers with the OpenAI-style JSON error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return error_response(APIError(400, _validation_message(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A server bug: its client still gets the JSON error body of every other failure, not plain text
        # (starlette logs the traceback after this answer).
        return error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


class BodySizeLimit:
    """ASGI middleware: 413 when a request body passes `max_bytes`.

    The body is read here (at most `max_bytes` of it) and replayed to the app, so a body without a
    Content-Length header is bounded too.
    """

    def __init__(self, app: Any, max_bytes: int) -> None:
        self.app = app
        self.max_bytes = max_bytes

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.max_bytes:
            await self._reject(scope, receive, send)
            return
        body, more = b"", True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client went away
            body += message.get("body", b"")
            if len(body) > self.max_bytes:
                await self._reject(scope, receive, send)
                return
            more = message.get("more_body", False)
        first = [{"type": "http.request", "body": body, "more_body": False}]

        async def replay() -> dict:
            return first.pop() if first else await receive()  # the whole body once, then the client's messages

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"request body exceeds {self.max_bytes} bytes; send fewer or shorter prompts per request"
        await error_response(APIError(413, message, "request_too_large"))(scope, receive, send)
