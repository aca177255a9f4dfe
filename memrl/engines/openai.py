"""An Engine over a served model: `memrl serve`, vLLM's OpenAI server, or SGLang's native API.

Protocols, retries and `server_kind='auto'`: docs/servers.md. Invariants: `generate` never raises and
never hangs (each attempt bounded by `timeout_s`; every failure, once its retries are spent, is a
`GenerationResult.failed` saying what to change); a result has one log-prob per output token, and a
response without token ids or log-probs is a failure (never re-tokenized from text).
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any, Literal

import httpx

from memrl.engines.base import EngineError, GenerationRequest, GenerationResult, ScoreResult, WeightSource

ServerKind = Literal["auto", "vllm", "sglang", "memrl"]
_RETRY_STATUSES = (502, 503, 504)  # a server starting up or a proxy in front of one
_TOKEN_ID_PREFIX = "token_id:"

MISSING_IDS_HINT = (
    "the server returned no output token ids: memrl needs them (it never re-tokenizes text). "
    "vLLM: use vLLM >= 0.10, which honours the request field `return_token_ids: true` (memrl sends it), "
    "or start it with `--return-tokens-as-token-ids`; SGLang: use server_kind='sglang' (native /generate)"
)


class RequestFailed(Exception):
    """One request failed for good; `message` goes into GenerationResult.failed."""


class _Retryable(Exception):
    """A failure worth another attempt (the server was not reachable or not ready)."""


@dataclass
class _LoopState:
    """Objects bound to one event loop; rebuilt when the engine is used from another loop."""

    loop: asyncio.AbstractEventLoop
    client: httpx.AsyncClient
    semaphore: asyncio.Semaphore
    discovery: asyncio.Future | None = None  # the running or last GET /v1/models (`_ensure_ready`)


def _short(text: str, limit: int = 500) -> str:
    return text if len(text) <= limit else text[:limit] + "..."


class OpenAIEngine:
    """The Engine protocol over HTTP. Use one instance per server; `close()` when done."""

    def __init__(self, base_url: str, model: str | None = None, api_key: str | None = None,
                 max_concurrency: int = 64, timeout_s: float = 600.0, max_retries: int = 3,
                 backoff_s: float = 0.5, server_kind: ServerKind = "auto") -> None:
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        if max_retries < 0 or backoff_s < 0:
            raise ValueError(f"max_retries and backoff_s must be >= 0, got {max_retries}, {backoff_s}")
        if server_kind not in ("auto", "vllm", "sglang", "memrl"):
            raise ValueError(f"server_kind must be auto, vllm, sglang or memrl, got {server_kind!r}")
        self.root_url = base_url.rstrip("/").removesuffix("/v1")
        self.model, self.api_key, self.server_kind = model, api_key, server_kind
        self.max_concurrency, self.timeout_s = max_concurrency, timeout_s
        self.max_retries, self.backoff_s = max_retries, backoff_s
        self._state: _LoopState | None = None

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        if self._state is None or self._state.loop is not loop:
            headers = {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}
            limits = httpx.Limits(max_connections=self.max_concurrency, max_keepalive_connections=self.max_concurrency)
            client = httpx.AsyncClient(headers=headers, timeout=httpx.Timeout(self.timeout_s), limits=limits)
            self._state = _LoopState(loop, client, asyncio.Semaphore(self.max_concurrency))
        return self._state

    async def _request(self, method: str, path: str, payload: dict | None = None) -> Any:
        """One JSON call with retries; returns the parsed body or raises RequestFailed."""
        state = self._loop_state()
        url = self.root_url + path
        last = ""
        for attempt in range(self.max_retries + 1):
            if attempt:
                await asyncio.sleep(self.backoff_s * 2 ** (attempt - 1))
            try:
                async with state.semaphore:
                    # wait_for bounds the whole attempt; httpx's own timeouts are per read/write.
                    return await asyncio.wait_for(self._attempt(state.client, method, url, payload), self.timeout_s)
            except _Retryable as err:
                last = str(err)
            except TimeoutError as err:
                raise RequestFailed(f"{method} {url} timed out after {self.timeout_s:g} s; raise timeout_s or check "
                                    "the server") from err
        raise RequestFailed(f"{method} {url} failed after {self.max_retries + 1} attempts: {last}")

    async def _attempt(self, client: httpx.AsyncClient, method: str, url: str, payload: dict | None) -> Any:
        try:
            response = await client.request(method, url, json=payload)
        except (httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError) as err:
            raise _Retryable(f"cannot reach the server ({_connect_reason(err)})") from err
        except httpx.TimeoutException as err:
            raise TimeoutError from err
        except httpx.HTTPError as err:
            raise RequestFailed(f"{method} {url}: {type(err).__name__}: {err}") from err
        if response.status_code in _RETRY_STATUSES:
            raise _Retryable(f"HTTP {response.status_code}: {_short(response.text)}")
        if response.status_code >= 400:
            raise RequestFailed(f"{method} {url} -> HTTP {response.status_code}: {_error_text(response)}")
        try:
            return response.json()
        except json.JSONDecodeError as err:
            raise RequestFailed(f"{method} {url} returned non-JSON: {_short(response.text)}") from err

    def _is_ready(self) -> bool:
        return self.server_kind != "auto" and (self.model is not None or self.server_kind == "sglang")

    async def _ensure_ready(self) -> None:
        """Resolve the server kind and model name once (GET /v1/models). Callers that arrive while it runs
        share it and its error, so N requests to a dead server fail in one retry cycle, not N; the next
        caller after a failure tries again."""
        if self._is_ready():
            return
        state = self._loop_state()
        if state.discovery is None or state.discovery.done():
            state.discovery = asyncio.ensure_future(self._discover())
        await asyncio.shield(state.discovery)  # a cancelled caller leaves it running for the others

    async def _discover(self) -> None:
        try:
            listing = await self._request("GET", "/v1/models")
            cards = (listing.get("data") or []) if isinstance(listing, dict) else []
        except RequestFailed as err:
            if "HTTP 404" not in str(err):
                raise
            cards = []  # a server without /v1/models: assume vLLM-style completions
        owner = str(cards[0].get("owned_by", "")).lower() if cards else ""
        if self.server_kind == "auto":
            self.server_kind = owner if owner in ("memrl", "vllm", "sglang") else "vllm"  # type: ignore[assignment]
        if self.model is None and self.server_kind != "sglang":
            if not cards:
                raise RequestFailed(f"{self.root_url}/v1/models lists no model; pass model= explicitly")
            self.model = str(cards[0]["id"])

    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        return list(await asyncio.gather(*(self._generate_one(r) for r in requests)))

    async def _generate_one(self, request: GenerationRequest) -> GenerationResult:
        try:
            await self._ensure_ready()
            if self.server_kind == "sglang":
                body = await self._request("POST", "/generate", self._sglang_payload(request))
                return parse_sglang_response(body)
            body = await self._request("POST", "/v1/completions", self._completions_payload(request))
            return parse_completions_response(body)
        except RequestFailed as err:
            return GenerationResult.failed(str(err))
        except Exception as err:  # a malformed response must not kill the batch
            return GenerationResult.failed(f"unexpected {type(err).__name__} talking to {self.root_url}: {err}")

    def _completions_payload(self, request: GenerationRequest) -> dict[str, Any]:
        # logprobs 1: token_logprobs holds the sampled token's log-prob whatever the top-k.
        payload: dict[str, Any] = {
            "model": self.model, "prompt": list(request.prompt_ids), "max_tokens": request.max_tokens,
            "temperature": request.temperature, "top_p": request.top_p, "n": 1, "stream": False, "logprobs": 1,
            "return_token_ids": True, "skip_special_tokens": False, "stop_token_ids": list(request.stop_token_ids),
        }
        if request.seed is not None:
            payload["seed"] = request.seed
        return payload

    def _sglang_payload(self, request: GenerationRequest) -> dict[str, Any]:
        sampling: dict[str, Any] = {
            "max_new_tokens": request.max_tokens, "temperature": request.temperature, "top_p": request.top_p,
            "stop_token_ids": list(request.stop_token_ids), "skip_special_tokens": False, "no_stop_trim": True,
        }
        if request.seed is not None:
            sampling["sampling_seed"] = request.seed  # honoured under --enable-deterministic-inference
        return {"input_ids": list(request.prompt_ids), "sampling_params": sampling, "return_logprob": True}

    async def sync_from(self, source: WeightSource) -> None:
        await self.reload_weights(source.saved_folder())

    async def reload_weights(self, path: str) -> None:
        """Make the server load weights from the folder `path` (on the server's machine): memrl serve's
        POST /v1/reload_weights, SGLang's POST /update_weights_from_disk; vLLM has none (EngineError)."""
        try:
            await self._ensure_ready()
            if self.server_kind == "memrl":
                await self._request("POST", "/v1/reload_weights", {"path": str(path)})
                return
            if self.server_kind == "sglang":
                body = await self._request("POST", "/update_weights_from_disk", {"model_path": str(path)})
                if isinstance(body, dict) and body.get("success") is False:
                    raise RequestFailed(f"SGLang refused the reload from {path}: {body.get('message')}")
                return
        except RequestFailed as err:
            raise EngineError(f"reloading weights from {path} failed: {err}") from err
        raise EngineError(
            f"server kind {self.server_kind!r} at {self.root_url} has no reload endpoint; serve the model with "
            "`memrl serve` or SGLang to sync weights from disk, or restart the server on the new folder"
        )

    async def score(self, prompt_ids: list[int], continuation_ids: list[int],
                    temperature: float) -> ScoreResult:
        """The engine contract's teacher-forced log-probs (the weight-sync canary): memrl serve's POST /v1/score.
        vLLM and SGLang have no such endpoint here (docs/servers.md says how they could): EngineError."""
        try:
            await self._ensure_ready()
            if self.server_kind == "memrl":
                body = await self._request("POST", "/v1/score", {"prompt_ids": list(prompt_ids),
                                                                 "continuation_ids": list(continuation_ids),
                                                                 "temperature": float(temperature)})
                return parse_score_response(body, len(continuation_ids))
        except RequestFailed as err:
            raise EngineError(f"scoring the weight-sync probe failed: {err} (train.sync_check=false trains "
                              f"without the check)") from err
        raise EngineError(
            f"server kind {self.server_kind!r} at {self.root_url} cannot score a given continuation, which the "
            "weight-sync canary needs after every weight sync (memrl serve can: POST /v1/score); set "
            "train.sync_check=false to train against this server without it"
        )

    async def close(self) -> None:
        state, self._state = self._state, None
        if state is not None and not state.loop.is_closed():
            await state.client.aclose()


def _connect_reason(err: BaseException) -> str:
    """An httpx connection error with what it came down to: httpx says "All connection attempts failed" and
    keeps the OS error (connection refused, name not known) at the end of the error's cause chain."""
    root, seen = err, {id(err)}
    while (nxt := root.__cause__ or root.__context__) is not None and id(nxt) not in seen:
        root = nxt
        seen.add(id(root))
    text = f"{type(err).__name__}: {err}"
    if isinstance(root, ConnectionRefusedError):
        return f"{text}: connection refused"
    return text if root is err else f"{text}: {type(root).__name__}: {root}"


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except json.JSONDecodeError:
        return _short(response.text)
    if isinstance(body, dict):
        error = body.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])
        if body.get("message") or body.get("detail"):
            return _short(str(body.get("message") or body.get("detail")))
    return _short(json.dumps(body))


def _finish(reason: Any) -> Literal["stop", "length"]:
    if reason in ("stop", "length"):
        return reason
    raise RequestFailed(f"the server ended generation with finish_reason={reason!r} (expected stop or length)")


def parse_completions_response(body: Any) -> GenerationResult:
    """A /v1/completions body (memrl or vLLM) -> GenerationResult; RequestFailed when unusable."""
    try:
        choice = body["choices"][0]
    except (KeyError, IndexError, TypeError) as err:
        raise RequestFailed(f"no choices in the completions response: {_short(json.dumps(body))}") from err
    logprobs = choice.get("logprobs") or {}
    ids = choice.get("token_ids")
    if ids is None:
        tokens = logprobs.get("tokens") or []
        if not (tokens and all(isinstance(t, str) and t.startswith(_TOKEN_ID_PREFIX) for t in tokens)):
            raise RequestFailed(MISSING_IDS_HINT)
        ids = [int(t.removeprefix(_TOKEN_ID_PREFIX)) for t in tokens]
    token_logprobs = logprobs.get("token_logprobs")
    if token_logprobs is None:
        raise RequestFailed("the server returned no logprobs.token_logprobs; send `logprobs` >= 0 (memrl sends 1)")
    if len(token_logprobs) != len(ids) or any(lp is None for lp in token_logprobs):
        raise RequestFailed(f"{len(ids)} token ids but log-probs {_short(str(token_logprobs), 200)}: not one per token")
    return GenerationResult(output_ids=[int(t) for t in ids], log_probs=[float(lp) for lp in token_logprobs],
                            finish_reason=_finish(choice.get("finish_reason")))


def parse_score_response(body: Any, expected: int) -> ScoreResult:
    """A memrl serve /v1/score body -> ScoreResult; RequestFailed unless it has `expected` log-probs and a dtype."""
    log_probs = body.get("log_probs") if isinstance(body, dict) else None
    # null: a log-prob that was not finite (JSON has no NaN), which the canary then reports.
    numbers = isinstance(log_probs, list) and all(v is None or (isinstance(v, int | float) and not isinstance(v, bool))
                                                  for v in log_probs)
    if not numbers or len(log_probs) != expected or not isinstance(body.get("dtype"), str):
        raise RequestFailed(f"expected {{log_probs: {expected} numbers, dtype}} from /v1/score, got "
                            f"{_short(json.dumps(body))}")
    return ScoreResult([float("nan") if lp is None else float(lp) for lp in log_probs], body["dtype"])


def parse_sglang_response(body: Any) -> GenerationResult:
    """An SGLang /generate body -> GenerationResult; RequestFailed when unusable."""
    if isinstance(body, list):  # a batch answer to one prompt: take its only element
        body = body[0] if len(body) == 1 else body
    meta = body.get("meta_info") if isinstance(body, dict) else None
    if not isinstance(meta, dict):
        raise RequestFailed(f"SGLang response has no meta_info: {_short(json.dumps(body))}")
    entries = meta.get("output_token_logprobs")
    if entries is None:
        raise RequestFailed("SGLang response has no meta_info.output_token_logprobs (token ids and log-probs); the "
                            "request sends return_logprob=true: check the server is SGLang's native /generate")
    finish = meta.get("finish_reason")
    reason = finish.get("type") if isinstance(finish, dict) else finish
    return GenerationResult(output_ids=[int(e[1]) for e in entries], log_probs=[float(e[0]) for e in entries],
                            finish_reason=_finish(reason))
