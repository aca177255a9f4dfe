"""The default engine: a local transformers model serving concurrent async requests in dynamic batches.

How it works. `generate` puts its requests on a queue and awaits their futures. One background worker
(an asyncio task) takes whatever is waiting, up to `max_batch_size` requests and `max_batch_tokens`
padded tokens, and runs the batch in a dedicated thread (so the event loop stays responsive): a
left-padded prefill, then a KV-cached decode loop, one token per step for every unfinished row. A row
leaves the batch (its KV cache rows are dropped) as soon as it samples a stop token (`stop`, the stop
token is kept in the output) or reaches its `max_tokens` (`length`). Requests that arrive meanwhile
form the next batch.

Why our own loop and not `model.generate`: one batch mixes requests with different temperature,
top_p, seed, stop tokens and max_tokens, and we need the exact log-prob of every sampled token under
the distribution it was sampled from. It is as fast as batched `generate` (bench/engine.py, 4M-parameter
Qwen3, 16 requests x 64 tokens: H200 bf16 2310 vs 2889 tokens/s, 64 x 128: 10101 vs 9814; 2 CPU threads
2293 vs 2456), and about 10x faster than transformers' continuous batching `generate_batch` there
(222 and 975 tokens/s on the H200), so we do not use the latter.

Sampling (see `sampling_log_probs`). Temperature T > 0: the distribution is softmax(logits / T),
restricted when top_p < 1 to the smallest set of most-likely tokens whose mass reaches top_p, and
renormalized; the token is drawn from it and its log-prob under exactly that distribution is
returned. T == 0 is greedy (argmax); its log-prob is that of the raw T = 1 distribution (top_p
ignored, since argmax is always kept). Each request draws its uniforms from its own CPU
`torch.Generator` seeded with `request.seed` (a random seed when None), so a seeded request's random
draws never depend on its batch mates or the device (its tokens are the same alone or in any batch,
as far as padded fp32 logits agree; tested on CPU).

Failure rules: a request with out-of-vocabulary ids fails alone; a batch that raises fails each of its
waiters with `GenerationResult.failed(...)` and the engine keeps serving; if the worker stops, every
pending request is failed; with `request_timeout_s` set, a request that waits longer is failed.
An engine serves one event loop at a time (a new loop, e.g. a second `asyncio.run`, starts a new worker).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import random
import threading
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm.auto import tqdm
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel

from memrl.engines.base import EngineError, GenerationRequest, GenerationResult


def resolve_device_dtype(device: str | torch.device | None, dtype: str | torch.dtype | None) -> tuple[torch.device, torch.dtype]:
    """`auto`/None: CUDA when available else CPU; bfloat16 on CUDA, float32 on CPU."""
    if device is None or device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    device = torch.device(device)
    if dtype is None or dtype == "auto":
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    elif isinstance(dtype, str):
        if not isinstance(getattr(torch, dtype, None), torch.dtype):
            raise EngineError(f"unknown dtype {dtype!r}; use auto, float32, bfloat16 or float16")
        dtype = getattr(torch, dtype)
    return device, dtype


def sampling_log_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor) -> torch.Tensor:
    """Log-probs (N, V) of the distributions each row samples from; every row is computed independently.

    Row i: log_softmax(logits_i / T_i), and when 0 < T_i and top_p_i < 1, tokens outside the smallest
    most-likely set whose probability reaches top_p_i get -inf and the rest are renormalized. Rows with
    T_i == 0 (greedy) get the raw log_softmax(logits_i). Computed in float32.
    """
    logits = logits.float()
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures).to(logits)
    log_probs = torch.log_softmax(logits / scale[:, None], dim=-1)
    nucleus = (~greedy) & (top_ps < 1.0)
    if bool(nucleus.any()):
        sorted_lp, order = torch.sort(log_probs, dim=-1, descending=True)
        sorted_p = sorted_lp.exp()
        mass_before = sorted_p.cumsum(-1) - sorted_p  # mass of strictly more likely tokens
        drop_sorted = mass_before >= top_ps.to(logits)[:, None]
        drop_sorted[:, 0] = False  # the most likely token always stays
        drop_sorted &= nucleus[:, None]
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        log_probs = torch.log_softmax(log_probs.masked_fill(drop, float("-inf")), dim=-1)
    return log_probs


def sample_tokens(log_probs: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """One token per row: argmax where T == 0, else inverse-CDF sampling with the row's uniform in [0, 1)."""
    cdf = log_probs.exp().cumsum(-1)
    # Scale by the total so float rounding of the cumulative sum can never push u past the end.
    targets = (uniforms.to(cdf) * cdf[:, -1]).unsqueeze(-1)
    sampled = torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp_(max=log_probs.shape[-1] - 1)
    return torch.where(temperatures <= 0, log_probs.argmax(-1), sampled)


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


class HFEngine:
    """Local transformers engine implementing the `Engine` protocol (async generate, close).

    The engine owns `model`: it is moved to `device`/`dtype` (None keeps the model's own; `auto` picks
    CUDA/bfloat16 when available, else CPU/float32) and put in eval mode. To serve a trainer's model,
    give the engine its own copy and sync it with `load_weights` / `update_weights_from_model`; these
    wait for a running batch, so call them between rollouts (they block the caller meanwhile).
    `max_batch_tokens` bounds batch size x (longest prompt + largest max_tokens), i.e. the KV cache.
    """

    def __init__(
        self,
        model: PreTrainedModel,
        tokenizer=None,
        *,
        max_batch_size: int = 32,
        max_batch_tokens: int = 65536,
        device: str | torch.device | None = None,
        dtype: str | torch.dtype | None = None,
        progress: bool = False,
        request_timeout_s: float | None = None,
    ) -> None:
        if max_batch_size <= 0 or max_batch_tokens <= 0:
            raise EngineError(f"max_batch_size ({max_batch_size}) and max_batch_tokens ({max_batch_tokens}) must be > 0")
        if device is None:
            device = next(model.parameters()).device
        if dtype is None:
            dtype = next(model.parameters()).dtype
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        self.tokenizer = tokenizer
        self.max_batch_size = max_batch_size
        self.max_batch_tokens = max_batch_tokens
        self.progress = progress
        self.request_timeout_s = request_timeout_s
        self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
        self._lock = threading.Lock()  # one batch or one weight update at a time
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._seed_rng = random.Random()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._queue: collections.deque[_Pending] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._in_flight: list[_Pending] = []
        self._bar: tqdm | None = None
        self._closed = False

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "auto", dtype: str = "auto",
                        tokenizer_path: str | Path | None = None, revision: str | None = None, **kwargs) -> HFEngine:
        """Load a Hugging Face model folder or hub id (pinned at `revision`, and its tokenizer, if it has
        one); kwargs go to `HFEngine`."""
        device_, dtype_ = resolve_device_dtype(device, dtype)
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype_, revision=revision)
        except OSError as error:
            raise EngineError(f"cannot load a model from {path}: {error}") from error
        try:
            tok_revision = revision if tokenizer_path is None or str(tokenizer_path) == str(path) else None
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or path), revision=tok_revision)
        except (OSError, ValueError):
            tokenizer = None  # engines work on token ids; the tokenizer is a convenience for callers
        return cls(model, tokenizer, device=device_, dtype=dtype_, **kwargs)

    # ----------------------------------------------------------------------------------- async API
    async def generate(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        """Results in request order; concurrent calls share batches. Raises EngineError only if closed."""
        if self._closed:
            raise EngineError("HFEngine is closed; create a new engine")
        if not requests:
            return []
        self._ensure_worker()
        loop = asyncio.get_running_loop()
        vocab = self.model.get_input_embeddings().num_embeddings
        futures: list[asyncio.Future] = []
        queued = 0
        for request in requests:
            future = loop.create_future()
            bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
            if bad:
                future.set_result(GenerationResult.failed(f"prompt ids {bad[:5]} outside the vocabulary [0, {vocab})"))
            else:
                self._queue.append(_Pending(request, future))
                queued += 1
            futures.append(future)
        if self._bar is not None:
            self._bar.total += queued
            self._bar.refresh()
        self._wakeup.set()
        return list(await asyncio.gather(*(self._wait(f) for f in futures)))

    async def _wait(self, future: asyncio.Future) -> GenerationResult:
        if self.request_timeout_s is None:
            return await future
        try:
            return await asyncio.wait_for(asyncio.shield(future), self.request_timeout_s)
        except TimeoutError:
            future.cancel()  # the worker skips cancelled requests that have not started
            return GenerationResult.failed(f"request timed out after {self.request_timeout_s} s")

    async def close(self) -> None:
        """Stop the worker; pending requests are failed. Idempotent."""
        self._closed = True
        if self._worker is not None and not self._worker.done():
            if self._loop is asyncio.get_running_loop():
                self._worker.cancel()
                try:
                    await self._worker
                except asyncio.CancelledError:
                    pass
            elif not self._loop.is_closed():  # a worker of another, still running loop
                self._loop.call_soon_threadsafe(self._worker.cancel)
        if self._loop is asyncio.get_running_loop() or self._loop is None or self._loop.is_closed():
            self._fail_pending("engine closed")
        self._executor.shutdown(wait=False)
        if self._bar is not None:
            self._bar.close()
            self._bar = None

    def _ensure_worker(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # First use or a new event loop: futures and tasks of an old loop cannot be awaited here.
            self._loop, self._queue, self._in_flight = loop, collections.deque(), []
            self._wakeup, self._worker = asyncio.Event(), None
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._serve(), name="hf-engine-worker")
        if self.progress and self._bar is None:
            self._bar = tqdm(total=0, desc="generate", unit="req", dynamic_ncols=True)

    async def _serve(self) -> None:
        loop = asyncio.get_running_loop()
        try:
            while True:
                await self._wakeup.wait()
                self._wakeup.clear()
                while self._queue:
                    batch = self._take_batch()
                    if not batch:
                        continue
                    self._in_flight = batch
                    try:
                        results = await loop.run_in_executor(self._executor, self._run_batch, [p.request for p in batch])
                    except Exception as error:  # the batch failed: its waiters learn why, later batches still run
                        message = f"batch of {len(batch)} failed: {type(error).__name__}: {error}"
                        results = [GenerationResult.failed(message) for _ in batch]
                    for pending, result in zip(batch, results, strict=True):
                        if not pending.future.done():
                            pending.future.set_result(result)
                    self._in_flight = []
                    if self._bar is not None:
                        self._bar.update(len(batch))
        finally:
            self._fail_pending("engine worker stopped")

    def _fail_pending(self, message: str) -> None:
        for pending in [*self._in_flight, *self._queue]:
            if not pending.future.done() and not pending.future.get_loop().is_closed():
                pending.future.set_result(GenerationResult.failed(message))
        self._in_flight, self._queue = [], collections.deque()

    def _take_batch(self) -> list[_Pending]:
        """FIFO, up to max_batch_size and max_batch_tokens padded tokens; the first request always fits."""
        batch: list[_Pending] = []
        longest_prompt = longest_new = 0
        while self._queue and len(batch) < self.max_batch_size:
            pending = self._queue[0]
            if pending.future.done():  # cancelled or timed out while waiting
                self._queue.popleft()
                continue
            prompt = max(longest_prompt, len(pending.request.prompt_ids))
            new = max(longest_new, pending.request.max_tokens)
            if batch and (len(batch) + 1) * (prompt + new) > self.max_batch_tokens:
                break
            batch.append(self._queue.popleft())
            longest_prompt, longest_new = prompt, new
        return batch

    # ------------------------------------------------------------------------ blocking torch work
    def _run_batch(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        with self._lock, torch.inference_mode(), self._attention_backends():
            return self._decode(requests)

    def _attention_backends(self):
        """On CUDA, keep SDPA off cuDNN attention: it builds a graph per (batch, length) shape and caches
        it per thread, so our ever-changing decode shapes cost ~35 ms per step on an H200 (measured:
        5 ms/step without it). Flash / memory-efficient kernels need no per-shape build."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache})
        return out.logits[:, -1, :].float()

    def _decode(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        device, n = self.device, len(requests)
        lengths = [len(r.prompt_ids) for r in requests]
        width = max(lengths)
        input_ids = torch.zeros((n, width), dtype=torch.long)
        attention_mask = torch.zeros((n, width), dtype=torch.long)
        for row, request in enumerate(requests):
            input_ids[row, width - lengths[row]:] = torch.tensor(request.prompt_ids)
            attention_mask[row, width - lengths[row]:] = 1
        input_ids, attention_mask = input_ids.to(device), attention_mask.to(device)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)
        next_position = torch.tensor(lengths, device=device)
        generators = [torch.Generator().manual_seed(r.seed if r.seed is not None else self._seed_rng.getrandbits(63))
                      for r in requests]
        temperatures = torch.tensor([r.temperature for r in requests], dtype=torch.float32, device=device)
        top_ps = torch.tensor([r.top_p for r in requests], dtype=torch.float32, device=device)
        stops = [set(r.stop_token_ids) for r in requests]
        outputs: list[list[int]] = [[] for _ in requests]
        log_probs: list[list[float]] = [[] for _ in requests]
        finish: list[str | None] = [None] * n

        try:
            cache = DynamicCache(config=self.model.config)
        except TypeError:  # older transformers
            cache = DynamicCache()
        logits = self._forward(input_ids, attention_mask, position_ids, cache)
        active = list(range(n))  # request index of each row still in the batch
        while True:
            uniforms = torch.stack([torch.rand((), generator=generators[i]) for i in active])
            row_log_probs = sampling_log_probs(logits, temperatures, top_ps)
            tokens = sample_tokens(row_log_probs, temperatures, uniforms)
            token_log_probs = row_log_probs.gather(1, tokens[:, None]).squeeze(1)
            keep: list[int] = []
            for row, (i, token, lp) in enumerate(zip(active, tokens.tolist(), token_log_probs.tolist(), strict=True)):
                outputs[i].append(token)
                log_probs[i].append(lp)
                if token in stops[i]:
                    finish[i] = "stop"
                elif len(outputs[i]) >= requests[i].max_tokens:
                    finish[i] = "length"
                else:
                    keep.append(row)
            if not keep:
                break
            if len(keep) < len(active):
                # Finished rows leave the batch: later steps compute only for unfinished requests.
                index = torch.tensor(keep, device=device)
                cache.batch_select_indices(index)
                attention_mask, next_position, tokens = attention_mask[index], next_position[index], tokens[index]
                temperatures, top_ps = temperatures[index], top_ps[index]
                active = [active[row] for row in keep]
            attention_mask = torch.cat([attention_mask, attention_mask.new_ones((len(active), 1))], dim=1)
            logits = self._forward(tokens[:, None], attention_mask, next_position[:, None], cache)
            next_position = next_position + 1
        return [GenerationResult(output_ids=o, log_probs=lp, finish_reason=f)  # type: ignore[arg-type]
                for o, lp, f in zip(outputs, log_probs, finish, strict=True)]

    # ------------------------------------------------------------------------------ weight sync
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy weights into the engine's own model (cast to its dtype/device); waits for a running batch."""
        with self._lock:
            try:
                self.model.load_state_dict(dict(state_dict), strict=True)
            except RuntimeError as error:
                raise EngineError(f"weights do not fit the engine's model ({type(self.model).__name__}): {error}") from error

    def update_weights_from_model(self, model: torch.nn.Module) -> None:
        """Copy a (training) model's weights in; the two models never share tensors."""
        self.load_weights(model.state_dict())

    def reload_from_path(self, path: str | Path) -> None:
        """Replace the model with the Hugging Face folder at `path` (same device and dtype)."""
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), dtype=self.dtype)
        except OSError as error:
            raise EngineError(f"cannot load a model from {path}: {error}") from error
        model = model.to(self.device).eval()
        with self._lock:
            self.model = model
            self._cache_kwarg = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
