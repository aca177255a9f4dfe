"""`memrl serve`: an OpenAI-compatible completions server over a local engine, token ids in and out.

Endpoints (shapes follow vLLM's OpenAI server, so one client speaks to both):
    GET  /health                 200 {"status": "ok"}; never needs the API key, never waits on a reload
    GET  /v1/models              the one served model
    POST /v1/completions         `prompt` = list of ints, or list of lists of ints (a batch); returns per
                                 choice `text` (decoded, for humans), `token_ids`, `logprobs`
                                 {tokens, token_logprobs} when `logprobs` is set, `finish_reason`, usage
    POST /v1/reload_weights      {"path": DIR}: the engine reloads its weights from DIR (trainer sync);
                                 DIR must lie under a --reload-root and hold the served model's
                                 architecture and vocabulary
    POST /v1/score               {"prompt_ids", "continuation_ids", "temperature"}: the engine's
                                 teacher-forced log-probs of the continuation, {"log_probs", "dtype"}
                                 (the trainer's weight-sync canary checks a reload with it)

Invariants:
- Text prompts are refused (400): memrl serves token ids only, so nothing is re-tokenized.
- Every malformed request gets a 4xx with an OpenAI-style body {"error": {"message", "type", "code"}};
  an engine failure gets a 500 with the engine's message. The server never drops a request silently.
- A generation whose client has disconnected is cancelled (the engine drops its rows), so a client
  that timed out costs no further compute. A shutdown (SIGTERM, Ctrl-C) waits at most
  `shutdown_timeout_s` for running requests, then cancels them.
- A reload waits for in-flight generations to finish and holds new ones back until it is done, so no
  response mixes two weight versions. Every wait at that gate is bounded by `gate_timeout_s`: past it,
  the waiting request gets a 503 (which clients retry) naming the setting, never a hang. The gate is
  released when a reload ends, failed or not, and a failed reload answers 500 with the engine's error.
- Numeric request fields are finite and in range (400 otherwise), so no request reaches the engine with
  a value it would overflow on (a seed past int64) or sample nonsense from (an infinite temperature).
- Reloads are disabled unless the operator names folders (`reload_roots`, `--reload-root`). A path
  outside them gets one 403 whether or not it exists (`..` and symlinks are resolved first), as does a
  folder holding a link out of them; a folder whose config or tokenizer differs from the served model's
  gets a 409, never a silent swap. The folder is checked again once the reload holds the gate, right
  before the engine reads it, so files changed while it waited are not loaded unchecked.
- Bound to 127.0.0.1 unless told otherwise; with an API key, every /v1 route needs
  `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, StrictInt, field_validator

from memrl.config import ConfigError, import_object
from memrl.engines.base import Engine, EngineError, GenerationRequest, GenerationResult
from memrl.engines.reload_policy import (
    ReloadPolicy,
    ReloadRefused,
    check_reload_roots,
    read_model_config,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_MAX_TOKENS_LIMIT = 8192
DEFAULT_MAX_BATCH_PROMPTS = 256
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_GATE_TIMEOUT_S = 600.0  # as engine.request_timeout_s and ray.sync_timeout_s
API_KEY_ENV = "MEMRL_API_KEY"
# Seeds and token ids travel as int64 (torch tensors, SGLang, vLLM); torch.Generator takes < 2**64, but
# int64 is what every engine behind this API accepts. HFEngine draws its own random seeds below 2**63.
MAX_SEED = 2**63 - 1
MAX_TOKEN_ID = 2**63 - 1
# A positive temperature below this makes logits / T overflow float32 (NaN log-probs); 0 means greedy.
# Above the maximum the distribution is uniform to float precision: no sampling setting needs more.
MIN_TEMPERATURE = 1e-6
MAX_TEMPERATURE = 100.0
# How often a running generation asks whether its client is still connected: a gone client's work
# stops within this (uvicorn never cancels a handler whose client left).
DISCONNECT_POLL_S = 0.5
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0

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
    if isinstance(value, str) or (
        isinstance(value, list) and value and all(isinstance(v, str) for v in value)
    ):
        raise ValueError(TEXT_PROMPT_MESSAGE)
    if not isinstance(value, list) or not value:
        raise ValueError(
            "`prompt` must be a non-empty list of token ids (ints) or a non-empty list of such lists"
        )
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


class CompletionBody(BaseModel):
    """The /v1/completions request. Unknown OpenAI/vLLM fields are ignored; unsupported ones refused."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: Any
    # Strict types: a JSON `true` or "0.7" in a numeric field is a client bug, not 1 or 0.7.
    max_tokens: StrictInt = Field(16, ge=1)
    temperature: StrictFloat = Field(1.0, allow_inf_nan=False)
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

    @field_validator("temperature")
    @classmethod
    def _temperature_in_range(cls, value: float) -> float:
        return _temperature_in_range(value)

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
    temperature: StrictFloat = Field(1.0, allow_inf_nan=False)

    @field_validator("temperature")
    @classmethod
    def _temperature_in_range(cls, value: float) -> float:
        return _temperature_in_range(value)


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


class _ReloadGate:
    """Generations share the engine; a reload needs it alone (a small readers-writer lock).

    Waiting reloads take precedence over new generations, so a busy server still reloads. Each wait
    to enter lasts at most `timeout_s`, then raises a 503 APIError; the condition's lock is only held
    to read and change the counters, never across a generation or a reload.
    """

    def __init__(self, timeout_s: float) -> None:
        self._cond = asyncio.Condition()
        self._active = 0
        self._reloading = False
        self._reloads_waiting = 0
        self.timeout_s = timeout_s

    async def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        """Wait (holding `_cond`) until `predicate()`; a 503 past `timeout_s`."""
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._cond.wait_for(predicate)
        except TimeoutError:
            logger.warning("gave up after %g s waiting for %s; answered 503", self.timeout_s, what)
            raise APIError(
                503,
                f"waited {self.timeout_s:g} s for {what}; retry later, or start the server with a larger "
                "gate_timeout_s (--gate-timeout-s) if reloads or generations here take that long",
                "server_busy",
            ) from None

    @asynccontextmanager
    async def generation(self):
        async with self._cond:
            await self._wait(
                lambda: not self._reloading and self._reloads_waiting == 0,
                "a weight reload to finish before generating",
            )
            self._active += 1
        try:
            yield
        finally:
            async with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @asynccontextmanager
    async def reload(self):
        async with self._cond:
            self._reloads_waiting += 1
            try:
                await self._wait(
                    lambda: not self._reloading and self._active == 0,
                    "in-flight generations (or another reload) to finish before reloading",
                )
            except BaseException:
                # This reload gives up: generations held back only for it may go ahead now.
                self._reloads_waiting -= 1
                self._cond.notify_all()
                raise
            self._reloads_waiting -= 1
            self._reloading = True
        try:
            yield
        finally:
            async with self._cond:
                self._reloading = False
                self._cond.notify_all()


class _BodySizeLimit:
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
        replayed = False

        async def replay() -> dict:
            nonlocal replayed
            if replayed:
                return await receive()
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)

    async def _reject(self, scope: dict, receive: Callable, send: Callable) -> None:
        message = f"request body exceeds {self.max_bytes} bytes; send fewer or shorter prompts per request"
        await _error_response(APIError(413, message, "request_too_large"))(scope, receive, send)


def _error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        status_code=err.status,
        content={"error": {"message": err.message, "type": err.kind, "code": err.status}},
    )


def _validation_message(exc: RequestValidationError) -> str:
    parts = []
    for error in exc.errors():
        where = ".".join(str(p) for p in error.get("loc", ()) if p != "body") or "body"
        # pydantic prefixes messages of raised ValueErrors with "Value error, "; the rest is ours.
        parts.append(f"{where}: {str(error.get('msg', '')).removeprefix('Value error, ')}")
    return "invalid request: " + "; ".join(parts)


def _check_token_ids(id_lists: list[list[int]], vocab_size: int | None) -> None:
    """400 for an id outside the vocabulary; with no known vocabulary, outside int64 (what engines take)."""
    limit = vocab_size if vocab_size is not None else MAX_TOKEN_ID + 1
    for ids in id_lists:
        bad = next((t for t in ids if not 0 <= t < limit), None)
        if bad is not None:
            where = f"the vocabulary [0, {vocab_size})" if vocab_size is not None else "[0, 2**63)"
            raise APIError(400, f"token id {bad} is outside {where}")


def _token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    if tokenizer is not None and hasattr(tokenizer, "convert_ids_to_tokens"):
        return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    return [f"token_id:{t}" for t in ids]  # vLLM's --return-tokens-as-token-ids format


class _ClientGone(Exception):
    """The client of a running generation disconnected; its work was cancelled."""


async def _while_connected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or `_ClientGone` once the client has disconnected (`work` is then cancelled).

    If this handler is itself cancelled (a shutdown past its grace period), `work` is cancelled too:
    the engine drops the cancelled requests' rows instead of generating for nobody.
    """
    task = asyncio.ensure_future(work)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=DISCONNECT_POLL_S)
            if done:
                return task.result()
            if await request.is_disconnected():
                raise _ClientGone
    finally:
        task.cancel()  # a no-op once it is done


@dataclass(frozen=True)
class _Limits:
    """Per-request bounds of one app (create_app's arguments of the same names)."""

    max_prompt_tokens: int
    max_tokens_limit: int
    max_batch_prompts: int


class _Service:
    """What the routes of one app do over its engine; `create_app` wires them to FastAPI (`_add_routes`).

    A class rather than closures inside create_app, so each route's checks, engine call and answer are
    functions of their own that read the app's settings from one place."""

    def __init__(self, engine: Engine, model_name: str, api_key: str | None, limits: _Limits, tokenizer: Any,
                 vocab_size: int | None, gate: _ReloadGate, policy: ReloadPolicy) -> None:
        self.engine, self.model_name, self.api_key, self.limits = engine, model_name, api_key, limits
        self.tokenizer, self.vocab_size, self.gate, self.policy = tokenizer, vocab_size, gate, policy
        self.created = int(time.time())

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(
                401, "missing or wrong API key: send `Authorization: Bearer <key>`", "authentication_error"
            )

    def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "memrl"}
        return {"object": "list", "data": [card]}

    # ---- /v1/completions

    def completion_requests(self, body: CompletionBody) -> list[GenerationRequest]:
        """The engine requests of a completion body, after the checks against this server's limits."""
        prompts: list[list[int]] = body.prompt
        limits = self.limits
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {self.model_name!r}")
        if len(prompts) > limits.max_batch_prompts:
            raise APIError(400, f"{len(prompts)} prompts in one request; the limit is {limits.max_batch_prompts}")
        if body.max_tokens > limits.max_tokens_limit:
            raise APIError(
                400, f"max_tokens={body.max_tokens} exceeds this server's limit of {limits.max_tokens_limit}"
            )
        for i, ids in enumerate(prompts):
            if len(ids) > limits.max_prompt_tokens:
                raise APIError(
                    400, f"prompt {i} has {len(ids)} tokens; this server accepts at most {limits.max_prompt_tokens}"
                )
        _check_token_ids([*prompts, body.stop_token_ids], self.vocab_size)
        if body.seed is not None and body.seed + len(prompts) - 1 > MAX_SEED:
            # Prompt i samples with seed + i (below): the last of them must still be an int64.
            raise APIError(
                400,
                f"seed {body.seed} + {len(prompts) - 1} (one per prompt) passes 2**63 - 1; send a smaller seed",
            )
        return [
            GenerationRequest(
                prompt_ids=ids,
                max_tokens=body.max_tokens,
                temperature=body.temperature,
                top_p=body.top_p,
                stop_token_ids=list(body.stop_token_ids),
                # One seed for a batch would give identical prompts identical samples; offset it per prompt.
                seed=None if body.seed is None else body.seed + i,
            )
            for i, ids in enumerate(prompts)
        ]

    async def completions(self, body: CompletionBody, request: Request) -> dict:
        requests = self.completion_requests(body)

        async def generate() -> list[GenerationResult]:
            async with self.gate.generation():
                try:
                    return await self.engine.generate(requests)
                except Exception as exc:  # an engine bug must reach the client, not hang it
                    logger.exception("engine.generate failed")
                    raise APIError(500, f"engine error: {type(exc).__name__}: {exc}", "server_error") from exc

        try:
            results = await _while_connected(request, generate())
        except _ClientGone:
            logger.info("client disconnected: cancelled its %d prompt(s)", len(requests))
            # Nobody reads this answer; 499 is what nginx logs for a client that closed the request.
            raise APIError(499, "client disconnected before the completion was ready", "client_closed") from None
        return self.completion_response(body, results)

    def completion_choice(self, body: CompletionBody, i: int, result: GenerationResult) -> dict:
        if result.finish_reason == "error":
            raise APIError(500, f"engine error on prompt {i}: {result.error}", "server_error")
        text = ""
        if self.tokenizer is not None:
            text = self.tokenizer.decode(result.output_ids, skip_special_tokens=body.skip_special_tokens)
        logprobs = None
        if body.logprobs is not None:
            logprobs = {
                "tokens": _token_strings(self.tokenizer, result.output_ids),
                "token_logprobs": list(result.log_probs),
                "top_logprobs": None,
                "text_offset": None,
            }
        return {
            "index": i,
            "text": text,
            "token_ids": list(result.output_ids),
            "prompt_token_ids": body.prompt[i],
            "logprobs": logprobs,
            "finish_reason": result.finish_reason,
            "stop_reason": None,
        }

    def completion_response(self, body: CompletionBody, results: list[GenerationResult]) -> dict:
        choices = [self.completion_choice(body, i, result) for i, result in enumerate(results)]
        prompt_tokens = sum(len(p) for p in body.prompt)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        return {
            "id": f"cmpl-{uuid.uuid4().hex}",
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": {
                "prompt_tokens": prompt_tokens,
                "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
            },
        }

    # ---- /v1/score

    async def score(self, body: ScoreBody) -> dict:
        scorer = getattr(self.engine, "score", None)
        if scorer is None:
            raise APIError(501, f"{type(self.engine).__name__} cannot score a continuation (no score method)")
        length = len(body.prompt_ids) + len(body.continuation_ids)
        if length > self.limits.max_prompt_tokens:
            raise APIError(400, f"{length} tokens to score; this server accepts at most {self.limits.max_prompt_tokens}")
        _check_token_ids([body.prompt_ids, body.continuation_ids], self.vocab_size)
        async with self.gate.generation():  # never with half-reloaded weights
            try:
                result = await scorer(body.prompt_ids, body.continuation_ids, body.temperature)
            except Exception as exc:  # an engine failure must reach the client, not hang it
                logger.exception("engine.score failed")
                raise APIError(500, f"engine error: {type(exc).__name__}: {exc}", "server_error") from exc
        # JSON has no NaN or infinity: such a log-prob goes out as null (the client reads it back as NaN).
        return {"log_probs": [lp if math.isfinite(lp) else None for lp in result.log_probs], "dtype": result.dtype}

    # ---- /v1/reload_weights

    async def checked_folder(self, path: str) -> Path:
        try:
            # In a thread: loading a tokenizer to compare vocabularies must not stall /health.
            return await asyncio.to_thread(self.policy.check, path)
        except ReloadRefused as refused:
            raise APIError(refused.status, refused.message, refused.kind) from None

    async def reload_weights(self, body: ReloadBody) -> dict:
        reload = getattr(self.engine, "reload_from_path", None)
        if reload is None:
            raise APIError(501, f"{type(self.engine).__name__} cannot reload weights (no reload_from_path)")
        # Checked before the gate, so a refusal neither waits for generations nor holds them back (and a
        # new tokenizer is loaded for comparison outside it), then again under the gate: the folder may
        # change while this reload waits for in-flight generations.
        await self.checked_folder(body.path)
        start = time.perf_counter()
        async with self.gate.reload():
            folder = await self.checked_folder(body.path)
            try:
                # The resolved folder that was checked, not the path as sent: its symlinks are not followed
                # a second time, so the load reads what the root and architecture checks saw.
                await _run_reload(reload, str(folder))
            except Exception as exc:
                logger.exception("reload_from_path failed")
                raise APIError(
                    500, f"reload from {body.path!r} failed: {type(exc).__name__}: {exc}", "server_error"
                ) from exc
        return {"success": True, "path": body.path, "seconds": round(time.perf_counter() - start, 3)}


async def _run_reload(reload: Callable[[str], Any], folder: str) -> None:
    """Run the engine's `reload_from_path(folder)`: awaited if it is a coroutine function, else in a thread,
    so /health keeps answering during a long reload."""
    if inspect.iscoroutinefunction(reload):
        await reload(folder)
        return
    thread = asyncio.ensure_future(asyncio.to_thread(reload, folder))
    cancelled = False
    while not thread.done():
        try:
            await asyncio.shield(thread)  # raises the thread's own error, if any
        except asyncio.CancelledError:
            # Cancelled (shutdown, client gone), maybe again and again: the thread still writes weights,
            # so the gate stays closed until it is done; no generation may see half the weights.
            cancelled = True
    if cancelled:
        thread.result()  # its error (logged as a failed reload), else the cancel
        raise asyncio.CancelledError


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure answers with the OpenAI-style JSON error body."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, err: APIError) -> JSONResponse:
        return _error_response(err)

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(APIError(400, _validation_message(exc)))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # A server bug: its client still gets the JSON error body of every other failure, not plain text
        # (starlette logs the traceback after this answer).
        return _error_response(APIError(500, f"internal error: {type(exc).__name__}: {exc}", "server_error"))


def _add_routes(app: FastAPI, service: _Service) -> None:
    """The endpoints of the module docstring; every /v1 route checks the API key first."""

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        service.check_key(request)
        return service.models()

    @app.post("/v1/completions")
    async def completions(body: CompletionBody, request: Request) -> dict:
        service.check_key(request)
        return await service.completions(body, request)

    @app.post("/v1/score")
    async def score(body: ScoreBody, request: Request) -> dict:
        service.check_key(request)
        return await service.score(body)

    @app.post("/v1/reload_weights")
    async def reload_weights(body: ReloadBody, request: Request) -> dict:
        service.check_key(request)
        return await service.reload_weights(body)


def create_app(
    engine: Engine,
    model_name: str,
    api_key: str | None = None,
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    tokenizer: Any = None,
    vocab_size: int | None = None,
    close_engine_on_shutdown: bool = True,
    gate_timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
    reload_roots: Sequence[str | os.PathLike] | None = None,
    model_config: Mapping[str, Any] | None = None,
) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`.

    `tokenizer` (optional) only decodes `text` and per-token strings for humans; `vocab_size`
    (optional) makes out-of-range token ids a 400 instead of an engine error. `gate_timeout_s` bounds
    how long a generation waits for a reload to finish, and a reload for in-flight generations; past
    it the request gets a 503. It does not cut a running reload short (a weight load in a thread cannot
    be stopped halfway without serving half-loaded weights).

    `reload_roots`: the folders /v1/reload_weights may load from (none: reloads are disabled, 403).
    `model_config` (default: the engine's `model.config`) is the served model's config as a dict; a
    reload folder's config.json must match its architecture fields, and, when the folder carries a
    tokenizer and `tokenizer` has `get_vocab`, its vocabulary must be the served one (409 otherwise).
    """
    if not gate_timeout_s > 0:
        raise ValueError(f"gate_timeout_s must be > 0, got {gate_timeout_s}")
    policy = ReloadPolicy(
        reload_roots, model_config if model_config is not None else _engine_config(engine), tokenizer
    )
    limits = _Limits(max_prompt_tokens, max_tokens_limit, max_batch_prompts)
    service = _Service(engine, model_name, api_key, limits, tokenizer, vocab_size, _ReloadGate(gate_timeout_s), policy)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if close_engine_on_shutdown:
            await engine.close()

    app = FastAPI(title="memrl serve", lifespan=lifespan)
    app.add_middleware(_BodySizeLimit, max_bytes=max_request_bytes)
    _add_error_handlers(app)
    _add_routes(app, service)
    return app


def _load_engine(model_path: str, engine_factory: str | None, device: str, dtype: str) -> Engine:
    if engine_factory:
        return import_object(engine_factory)(model_path)
    from memrl.engines.hf import HFEngine

    try:
        return HFEngine.from_pretrained(model_path, device=device, dtype=dtype)
    except ValueError as exc:  # transformers' word for a folder that holds no model it knows
        raise EngineError(f"cannot load a model from {model_path}: {exc}") from exc


def _vocab_size(engine: Any) -> int | None:
    config = getattr(getattr(engine, "model", None), "config", None)
    size = getattr(config, "vocab_size", None)
    return size if isinstance(size, int) else None


def _engine_config(engine: Any) -> dict[str, Any] | None:
    """The engine's transformers config as a dict (HFEngine has one; other engines may not)."""
    to_dict = getattr(getattr(getattr(engine, "model", None), "config", None), "to_dict", None)
    return to_dict() if callable(to_dict) else None


def _served_config(engine: Any, model_path: str) -> dict[str, Any] | None:
    """The served model's config: the engine's, else (an --engine without one) the model folder's."""
    config = _engine_config(engine)
    if config is None and (Path(model_path) / "config.json").is_file():
        try:
            config = read_model_config(Path(model_path))
        except Exception as exc:  # noqa: BLE001 - then reloads go unchecked, which the log says
            logger.warning(
                "cannot read %s/config.json (%s): reloads are not checked against it", model_path, exc
            )
    return config


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # those both logging and uvicorn know


def check_serve_options(
    port: int, reload_roots: Sequence[str | os.PathLike] | None, shutdown_timeout_s: float, log_level: str
) -> None:
    """ConfigError for options uvicorn or the reload policy would refuse only with a traceback, and only
    after the model has loaded."""
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"--log-level {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port; pick one in 1-65535 (0: any free port)")
    if not shutdown_timeout_s >= 0:
        raise ConfigError(f"--shutdown-timeout-s must be >= 0 seconds, got {shutdown_timeout_s}")
    check_reload_roots(reload_roots)


def serve(
    model_path: str,
    host: str = "127.0.0.1",
    port: int = 8000,
    api_key: str | None = None,
    served_model_name: str | None = None,
    device: str = "auto",
    dtype: str = "auto",
    max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
    max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
    max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS,
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES,
    engine_factory: str | None = None,
    log_level: str = "info",
    gate_timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
    reload_roots: Sequence[str | os.PathLike] | None = None,
    shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S,
) -> None:
    """Load the model (HFEngine, or `engine_factory` 'module:function(model_path) -> Engine') and serve it
    until interrupted. The model is served under `served_model_name` (default: the folder's name).
    `gate_timeout_s`: see `create_app` (longest wait of a generation for a reload, and of a reload for
    in-flight generations, before a 503). `reload_roots`: the folders weights may be reloaded from;
    none (the default) disables reloads, since a served model has no business loading arbitrary folders
    unless the operator says where training writes them. `shutdown_timeout_s`: on SIGTERM or Ctrl-C,
    the longest wait for running requests before they are cancelled (a running weight load is not cut
    short: see `create_app`)."""
    import uvicorn

    check_serve_options(port, reload_roots, shutdown_timeout_s, log_level)
    # As uvicorn.run does for its own loggers: this call is the process's entry point.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning(
            "serving on %s without an API key: anyone who reaches this port can generate and reload", host
        )
    if reload_roots:
        logger.info("weight reloads allowed from: %s", ", ".join(str(r) for r in reload_roots))
    else:
        logger.info("weight reloads disabled (no --reload-root)")
    engine = _load_engine(model_path, engine_factory, device, dtype)
    app = create_app(
        engine,
        model_name=served_model_name or Path(model_path).name or model_path,
        api_key=api_key,
        max_prompt_tokens=max_prompt_tokens,
        max_tokens_limit=max_tokens_limit,
        max_batch_prompts=max_batch_prompts,
        max_request_bytes=max_request_bytes,
        tokenizer=getattr(engine, "tokenizer", None),  # HFEngine loads the folder's tokenizer
        vocab_size=_vocab_size(engine),
        gate_timeout_s=gate_timeout_s,
        reload_roots=reload_roots,
        model_config=_served_config(engine, model_path),
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s)

