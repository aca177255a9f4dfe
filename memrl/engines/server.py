"""`memrl serve`: an OpenAI-compatible completions server over a local engine, token ids in and out.

Endpoints, refusals and reload rules: docs/servers.md; request bodies: server_requests.py; reload
folders: reload_policy.py. Invariants: a generation whose client disconnected is cancelled; a reload
waits for in-flight generations and holds new ones back, so no response mixes two weight versions (each
wait at that gate bounded by `gate_timeout_s`, then a 503); an engine failure is a 500 with its message.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import math
import os
import secrets
import shutil
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fastapi import APIRouter, Depends, FastAPI, Request

from memrl.config import ConfigError, import_object
from memrl.engines.base import Engine, GenerationRequest, GenerationResult
from memrl.engines.reload_policy import ReloadPolicy, check_reload_roots, read_model_config
from memrl.engines.server_requests import (
    MAX_SEED,
    APIError,
    BodySizeLimit,
    CompletionBody,
    ReloadBody,
    ScoreBody,
    add_error_handlers,
    check_token_ids,
)

logger = logging.getLogger(__name__)

DEFAULT_MAX_PROMPT_TOKENS = 32768
DEFAULT_MAX_TOKENS_LIMIT = 8192
DEFAULT_MAX_BATCH_PROMPTS = 256
DEFAULT_MAX_REQUEST_BYTES = 16 * 1024 * 1024
DEFAULT_GATE_TIMEOUT_S = 600.0  # as engine.request_timeout_s and ray.sync_timeout_s
DEFAULT_SHUTDOWN_TIMEOUT_S = 10.0
API_KEY_ENV = "MEMRL_API_KEY"
# How often a running generation asks whether its client is still connected: a gone client's work
# stops within this (uvicorn never cancels a handler whose client left).
DISCONNECT_POLL_S = 0.5


class _ReloadGate:
    """Generations share the engine; a reload needs it alone (a small readers-writer lock). Waiting reloads
    go before new generations, so a busy server still reloads; each wait lasts at most `timeout_s` (then a
    503), and the condition's lock is held only to change the counters, never across a generation."""

    def __init__(self, timeout_s: float) -> None:
        self._cond = asyncio.Condition()
        self._active = 0  # generations inside
        self._reloading = False
        self._reloads_waiting = 0
        self.timeout_s = timeout_s

    async def _wait(self, predicate: Callable[[], bool], what: str) -> None:
        try:
            async with asyncio.timeout(self.timeout_s):
                await self._cond.wait_for(predicate)
        except TimeoutError:
            logger.warning("gave up after %g s waiting for %s; answered 503", self.timeout_s, what)
            raise APIError(503, f"waited {self.timeout_s:g} s for {what}; retry later, or start the server with a "
                           "larger gate_timeout_s (--gate-timeout-s) if reloads or generations here take that long",
                           "server_busy") from None

    @asynccontextmanager
    async def generation(self):
        async with self._cond:
            await self._wait(lambda: not self._reloading and self._reloads_waiting == 0,
                             "a weight reload to finish before generating")
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
                await self._wait(lambda: not self._reloading and self._active == 0,
                                 "in-flight generations (or another reload) to finish before reloading")
            finally:
                # If this reload gave up, generations held back only for it may go ahead now.
                self._reloads_waiting -= 1
                self._cond.notify_all()
            self._reloading = True
        try:
            yield
        finally:
            async with self._cond:
                self._reloading = False
                self._cond.notify_all()


def _token_strings(tokenizer: Any, ids: list[int]) -> list[str]:
    if hasattr(tokenizer, "convert_ids_to_tokens"):
        return [str(t) for t in tokenizer.convert_ids_to_tokens(ids)]
    return [f"token_id:{t}" for t in ids]  # vLLM's --return-tokens-as-token-ids format


class _ClientGone(Exception):
    """The client of a running generation disconnected; its work was cancelled."""


async def _while_connected(request: Request, work: Awaitable[Any]) -> Any:
    """`work`'s result, or `_ClientGone` once the client has disconnected. `work` is cancelled then, and when
    this handler is (a shutdown past its grace period): the engine drops those rows."""
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


@asynccontextmanager
async def _engine_failures(call: str, what: str = "engine error"):
    """An engine failure becomes a 500 with its message: it must reach the client, not hang it."""
    try:
        yield
    except Exception as exc:
        logger.exception("%s failed", call)
        raise APIError(500, f"{what}: {type(exc).__name__}: {exc}", "server_error") from exc


@dataclass
class _Service:
    """The routes of one app over its engine (`_add_routes` wires them), with `create_app`'s settings."""

    engine: Engine
    model_name: str
    api_key: str | None
    max_prompt_tokens: int
    max_tokens_limit: int
    max_batch_prompts: int
    tokenizer: Any
    vocab_size: int | None
    gate: _ReloadGate
    policy: ReloadPolicy
    created: int = field(default_factory=lambda: int(time.time()))

    def check_key(self, request: Request) -> None:
        if self.api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not secrets.compare_digest(given.encode(), f"Bearer {self.api_key}".encode()):
            raise APIError(401, "missing or wrong API key: send `Authorization: Bearer <key>`", "authentication_error")

    async def models(self) -> dict:
        card = {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "memrl"}
        return {"object": "list", "data": [card]}

    def completion_requests(self, body: CompletionBody) -> list[GenerationRequest]:
        prompts: list[list[int]] = body.prompt
        if body.model is not None and body.model != self.model_name:
            raise APIError(404, f"model {body.model!r} is not served here; this server serves {self.model_name!r}")
        if len(prompts) > self.max_batch_prompts:
            raise APIError(400, f"{len(prompts)} prompts in one request; the limit is {self.max_batch_prompts}")
        if body.max_tokens > self.max_tokens_limit:
            raise APIError(400, f"max_tokens={body.max_tokens} exceeds this server's limit of {self.max_tokens_limit}")
        for i, ids in enumerate(prompts):
            if len(ids) > self.max_prompt_tokens:
                raise APIError(400, f"prompt {i} has {len(ids)} tokens; this server accepts at most "
                                    f"{self.max_prompt_tokens}")
        check_token_ids([*prompts, body.stop_token_ids], self.vocab_size)
        if body.seed is not None and body.seed + len(prompts) - 1 > MAX_SEED:
            # Prompt i samples with seed + i (below): the last of them must still be an int64.
            raise APIError(400, f"seed {body.seed} + {len(prompts) - 1} (one per prompt) passes 2**63 - 1; "
                                "send a smaller seed")
        # One seed for a batch would give identical prompts identical samples; offset it per prompt.
        return [GenerationRequest(prompt_ids=ids, max_tokens=body.max_tokens, temperature=body.temperature,
                                  top_p=body.top_p, stop_token_ids=list(body.stop_token_ids),
                                  seed=None if body.seed is None else body.seed + i)
                for i, ids in enumerate(prompts)]

    async def completions(self, body: CompletionBody, request: Request) -> dict:
        requests = self.completion_requests(body)

        async def generate() -> list[GenerationResult]:
            async with self.gate.generation(), _engine_failures("engine.generate"):
                return await self.engine.generate(requests)

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
            logprobs = {"tokens": _token_strings(self.tokenizer, result.output_ids),
                        "token_logprobs": list(result.log_probs), "top_logprobs": None, "text_offset": None}
        return {"index": i, "text": text, "token_ids": list(result.output_ids), "prompt_token_ids": body.prompt[i],
                "logprobs": logprobs, "finish_reason": result.finish_reason, "stop_reason": None}

    def completion_response(self, body: CompletionBody, results: list[GenerationResult]) -> dict:
        choices = [self.completion_choice(body, i, result) for i, result in enumerate(results)]
        prompt_tokens = sum(len(p) for p in body.prompt)
        completion_tokens = sum(len(c["token_ids"]) for c in choices)
        usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                 "total_tokens": prompt_tokens + completion_tokens}
        return {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                "model": self.model_name, "choices": choices, "usage": usage}

    async def score(self, body: ScoreBody) -> dict:
        scorer = getattr(self.engine, "score", None)
        if scorer is None:
            raise APIError(501, f"{type(self.engine).__name__} cannot score a continuation (no score method)")
        length = len(body.prompt_ids) + len(body.continuation_ids)
        if length > self.max_prompt_tokens:
            raise APIError(400, f"{length} tokens to score; this server accepts at most {self.max_prompt_tokens}")
        check_token_ids([body.prompt_ids, body.continuation_ids], self.vocab_size)
        async with self.gate.generation(), _engine_failures("engine.score"):  # never with half-reloaded weights
            result = await scorer(body.prompt_ids, body.continuation_ids, body.temperature)
        # JSON has no NaN or infinity: such a log-prob goes out as null (the client reads it back as NaN).
        return {"log_probs": [lp if math.isfinite(lp) else None for lp in result.log_probs], "dtype": result.dtype}

    async def reload_weights(self, body: ReloadBody) -> dict:
        reload = getattr(self.engine, "reload_from_path", None)
        if reload is None:
            raise APIError(501, f"{type(self.engine).__name__} cannot reload weights (no reload_from_path)")
        # Checked before the gate, so a refusal neither waits for generations nor holds them back, then
        # again under it: the folder may change while this reload waits. In a thread: loading a tokenizer
        # to compare vocabularies must not stall /health.
        await asyncio.to_thread(self.policy.check, body.path)
        start = time.perf_counter()
        async with self.gate.reload():
            private = tempfile.mkdtemp(prefix="memrl-reload-")
            try:
                # The engine loads the private copy that was checked, never the folder by name again: a file
                # swapped for a link after the checks would be read by the load (reload_policy.py).
                folder = await asyncio.to_thread(self.policy.copy_checked, body.path, Path(private))
                async with _engine_failures("reload_from_path", f"reload from {body.path!r} failed"):
                    await _run_reload(reload, str(folder))
            finally:
                await asyncio.to_thread(shutil.rmtree, private, ignore_errors=True)
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


def _add_routes(app: FastAPI, service: _Service) -> None:
    """The endpoints of docs/servers.md; every /v1 route checks the API key first."""

    @app.get("/health")
    async def health() -> dict:
        return {"status": "ok"}

    v1 = APIRouter(prefix="/v1", dependencies=[Depends(service.check_key)])
    v1.add_api_route("/models", service.models, methods=["GET"])
    v1.add_api_route("/completions", service.completions, methods=["POST"])
    v1.add_api_route("/score", service.score, methods=["POST"])
    v1.add_api_route("/reload_weights", service.reload_weights, methods=["POST"])
    app.include_router(v1)


def create_app(engine: Engine, model_name: str, api_key: str | None = None,
               max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
               max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT,
               max_batch_prompts: int = DEFAULT_MAX_BATCH_PROMPTS,
               max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES, tokenizer: Any = None,
               vocab_size: int | None = None, close_engine_on_shutdown: bool = True,
               gate_timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
               reload_roots: Sequence[str | os.PathLike] | None = None,
               model_config: Mapping[str, Any] | None = None) -> FastAPI:
    """The FastAPI app serving `engine` as `model_name`.

    `tokenizer` (optional) only decodes `text` and per-token strings for humans; `vocab_size` (optional)
    makes out-of-range token ids a 400 instead of an engine error. `gate_timeout_s` bounds each wait at the
    reload gate (a 503 past it); it does not cut a running reload short (a weight load in a thread cannot
    stop halfway without serving half-loaded weights). `reload_roots`: where reloads may load from (none:
    403). `model_config` (default: the engine's `model.config`): what a reload folder must match (409).
    """
    if not gate_timeout_s > 0:
        raise ValueError(f"gate_timeout_s must be > 0, got {gate_timeout_s}")
    if model_config is None:
        model_config = _engine_config(engine)
    policy = ReloadPolicy(reload_roots, model_config, tokenizer)
    service = _Service(engine, model_name, api_key, max_prompt_tokens, max_tokens_limit, max_batch_prompts,
                       tokenizer, vocab_size, _ReloadGate(gate_timeout_s), policy)

    @asynccontextmanager
    async def lifespan(_: FastAPI):
        yield
        if close_engine_on_shutdown:
            await engine.close()

    app = FastAPI(title="memrl serve", lifespan=lifespan)
    app.add_middleware(BodySizeLimit, max_bytes=max_request_bytes)
    add_error_handlers(app)
    _add_routes(app, service)
    return app


def _load_engine(model_path: str, engine_factory: str | None, device: str, dtype: str) -> Engine:
    if engine_factory:
        return import_object(engine_factory)(model_path)
    from memrl.engines.hf import HFEngine

    return HFEngine.from_pretrained(model_path, device=device, dtype=dtype)


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
            logger.warning("cannot read %s/config.json (%s): reloads are not checked against it", model_path, exc)
    return config


LOG_LEVELS = ("debug", "info", "warning", "error", "critical")  # those both logging and uvicorn know


def check_serve_options(port: int, reload_roots: Sequence[str | os.PathLike] | None,
                        shutdown_timeout_s: float, log_level: str) -> None:
    """ConfigError for options uvicorn or the reload policy would refuse only with a traceback, and only
    after the model has loaded."""
    if log_level not in LOG_LEVELS:
        raise ConfigError(f"--log-level {log_level!r} is not one of {', '.join(LOG_LEVELS)}")
    if not 0 <= port <= 65535:
        raise ConfigError(f"--port {port} is not a TCP port; pick one in 1-65535 (0: any free port)")
    if not shutdown_timeout_s >= 0:
        raise ConfigError(f"--shutdown-timeout-s must be >= 0 seconds, got {shutdown_timeout_s}")
    check_reload_roots(reload_roots)


def _log_exposure(host: str, api_key: str | None, reload_roots: Sequence[str | os.PathLike] | None) -> None:
    """Tell the operator who may reach the server and where it may reload from."""
    if host not in ("127.0.0.1", "localhost", "::1") and api_key is None:
        logger.warning("serving on %s without an API key: anyone who reaches this port can generate and reload", host)
    if reload_roots:
        logger.info("weight reloads allowed from: %s", ", ".join(str(r) for r in reload_roots))
    else:
        logger.info("weight reloads disabled (no --reload-root)")


def serve(model_path: str, host: str = "127.0.0.1", port: int = 8000, api_key: str | None = None,
          served_model_name: str | None = None, device: str = "auto", dtype: str = "auto",
          max_prompt_tokens: int = DEFAULT_MAX_PROMPT_TOKENS,
          max_tokens_limit: int = DEFAULT_MAX_TOKENS_LIMIT, engine_factory: str | None = None,
          log_level: str = "info", gate_timeout_s: float = DEFAULT_GATE_TIMEOUT_S,
          reload_roots: Sequence[str | os.PathLike] | None = None,
          shutdown_timeout_s: float = DEFAULT_SHUTDOWN_TIMEOUT_S) -> None:
    """Load the model (HFEngine, or `engine_factory` 'module:function(model_path) -> Engine') and serve it
    as `served_model_name` (default: the folder's name) until interrupted. `reload_roots` default to none:
    reloads disabled (docs/servers.md says why). The other options: `memrl serve --help`, `create_app`."""
    import uvicorn

    check_serve_options(port, reload_roots, shutdown_timeout_s, log_level)
    # As uvicorn.run does for its own loggers: this call is the process's entry point.
    logging.basicConfig(level=log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    api_key = api_key or os.environ.get(API_KEY_ENV) or None
    _log_exposure(host, api_key, reload_roots)
    engine = _load_engine(model_path, engine_factory, device, dtype)
    vocab_size = getattr(getattr(getattr(engine, "model", None), "config", None), "vocab_size", None)
    app = create_app(engine, served_model_name or Path(model_path).name or model_path, api_key=api_key,
                     max_prompt_tokens=max_prompt_tokens, max_tokens_limit=max_tokens_limit,
                     tokenizer=getattr(engine, "tokenizer", None),  # HFEngine loads the folder's tokenizer
                     vocab_size=vocab_size if isinstance(vocab_size, int) else None, gate_timeout_s=gate_timeout_s,
                     reload_roots=reload_roots, model_config=_served_config(engine, model_path))
    uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=shutdown_timeout_s)
