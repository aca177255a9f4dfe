"""The default engine: a local transformers model serving concurrent async requests in dynamic batches.

`HFEngine` owns the async queue, the worker and its thread, admission limits, the model calls and weight
sync; the running batch is hf_batch.py (static-shape decode: static_decode.py), sampling sampling.py,
prefix sharing prefix.py. How they fit, the failure rules and why the engine runs its own decode loop
instead of `model.generate`: docs/engines.md. Key invariant: a seeded request's tokens never depend on its
batch mates, its admission time or the device (its uniforms come from its own CPU generator).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import inspect
import random
import threading
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import AutoModelForCausalLM, AutoTokenizer, DynamicCache, PreTrainedModel
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

from memrl.engines.base import EngineError, GenerationRequest, GenerationResult, ScoreResult, WeightSource
from memrl.engines.hf_batch import EngineStats, _Pending, _plain_layers, _Row, _RunningBatch
from memrl.engines.prefix import MIN_SHARED_PREFIX, HeldPrompts, left_padded_mask, plan_prefill, run_plan
from memrl.engines.sampling import sampling_log_probs
from memrl.engines.static_decode import StaticBatch, StaticDecoder
from memrl.engines.static_kv import supports_static_decode


def resolve_device_dtype(device: str | torch.device | None,
                         dtype: str | torch.dtype | None) -> tuple[torch.device, torch.dtype]:
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


def _attend_with_a_registered_function(model: torch.nn.Module) -> None:
    """A trainer's copy may attend through a function registered in the trainer's process only (memrl's packed
    and shared-prefix training rows, `memrl_packed`, which wraps sdpa for anything else): a copy sent to
    another process (a Ray rollout worker) would fail its first forward there. Generation needs none of it."""
    config = model.config
    if config._attn_implementation not in (None, "eager", *ALL_ATTENTION_FUNCTIONS.valid_keys()):
        config._attn_implementation = "sdpa"


def _weight_shapes(model: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    return {name: tuple(tensor.shape) for name, tensor in model.state_dict().items()}


def _cache_kwarg(model: PreTrainedModel) -> str:
    """The name under which this model's forward takes its KV cache (newer transformers: `cache`)."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def _load_model(path: str | Path, dtype: torch.dtype, revision: str | None = None) -> PreTrainedModel:
    try:
        return AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, revision=revision)
    except (OSError, ValueError) as error:  # ValueError: transformers' word for a folder of no model it knows
        raise EngineError(f"cannot load a model from {path}: {error}") from error


class _EngineRunner:
    """An engine's model calls as its running batches see them (`hf_batch.ModelRunner`), looked up at every
    call, so a method patched on the engine (tests do) or `reset_stats()` takes effect mid-batch."""

    def __init__(self, engine: HFEngine) -> None:
        self._engine = engine

    def prefill(self, requests: list[GenerationRequest],
                held: HeldPrompts | None = None) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        return self._engine._prefill(requests, held)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
        return self._engine._forward(input_ids, attention_mask, position_ids, cache)

    def count_decode_step(self, rows: int) -> None:
        self._engine.stats.decode_steps += 1
        self._engine.stats.decode_rows += rows


class HFEngine:
    """Local transformers engine implementing the `Engine` protocol.

    The engine owns `model` (moved to `device`/`dtype`, None keeping the model's own, and put in eval mode):
    give it its own copy of a trainer's model and sync it with `sync_from`, which waits for a running batch
    (in continuous mode: until no request is left). `max_batch_tokens` bounds batch size x (longest cache
    row + most tokens any row may still generate), i.e. the KV cache.
    """

    def __init__(self, model: PreTrainedModel, tokenizer=None, *, max_batch_size: int = 32,
                 max_batch_tokens: int = 65536, device: str | torch.device | None = None,
                 dtype: str | torch.dtype | None = None, request_timeout_s: float | None = None,
                 continuous_batching: bool = True, static_kv: str = "auto", cuda_graphs: str = "auto",
                 share_prefixes: bool = False, min_shared_prefix: int = MIN_SHARED_PREFIX) -> None:
        if max_batch_size <= 0 or max_batch_tokens <= 0:
            raise EngineError(f"max_batch_size ({max_batch_size}) and max_batch_tokens ({max_batch_tokens}) "
                              "must be > 0")
        for name, value in (("static_kv", static_kv), ("cuda_graphs", cuda_graphs)):
            if value not in ("auto", "on", "off"):
                raise EngineError(f"{name} must be auto, on or off, got {value!r}")
        if device is None:
            device = next(model.parameters()).device
        if dtype is None:
            dtype = next(model.parameters()).dtype
        self.device, self.dtype = resolve_device_dtype(device, dtype)
        self.model = model.to(device=self.device, dtype=self.dtype).eval()
        _attend_with_a_registered_function(self.model)
        self.tokenizer, self.request_timeout_s = tokenizer, request_timeout_s
        self.max_batch_size, self.max_batch_tokens = max_batch_size, max_batch_tokens
        self.continuous_batching = continuous_batching
        self.share_prefixes, self.min_shared_prefix = share_prefixes, min_shared_prefix
        self.stats = EngineStats()
        self._cache_kwarg = _cache_kwarg(model)
        # The static-shape decoder (None on the dynamic path); benches and tests read its `captures`.
        self.static_decoder = self._build_static_decoder(static_kv, cuda_graphs)
        self._lock = threading.Lock()  # one batch (or session) or one weight update at a time
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="hf-engine")
        self._seed_rng = random.Random()
        self._loop: asyncio.AbstractEventLoop | None = None
        # The worker thread pops from the queue between decode steps while the event loop appends to it.
        self._queue_lock = threading.Lock()
        self._queue: collections.deque[_Pending] = collections.deque()
        self._wakeup: asyncio.Event | None = None
        self._worker: asyncio.Task | None = None
        self._in_flight: list[_Pending] = []  # replaced (never mutated) by the worker thread
        self._closed = False

    def _build_static_decoder(self, static_kv: str, cuda_graphs: str) -> StaticDecoder | None:
        on_cuda = self.device.type == "cuda"
        if cuda_graphs == "on" and not on_cuda:
            raise EngineError(f"cuda_graphs = 'on' needs a CUDA device, but the engine runs on {self.device}; "
                              "set engine.cuda_graphs to auto or off")
        if cuda_graphs == "on" and static_kv == "off":
            raise EngineError("cuda_graphs = 'on' captures the static-shape decode step; it needs static_kv auto or on")
        unsupported = supports_static_decode(self.model)
        if static_kv == "on" and unsupported:
            raise EngineError(f"static_kv = 'on' cannot serve this model: {unsupported}; "
                              "set engine.static_kv to auto or off")
        if static_kv == "off" or unsupported or (static_kv == "auto" and not on_cuda):
            return None
        graphs = on_cuda and cuda_graphs != "off"
        return StaticDecoder(self.model, self._cache_kwarg, self.max_batch_size, graphs=graphs,
                             strict=cuda_graphs == "on")

    def _new_batch(self):
        runner = _EngineRunner(self)
        return StaticBatch(runner, self.static_decoder) if self.static_decoder is not None else _RunningBatch(runner)

    @classmethod
    def from_pretrained(cls, path: str | Path, device: str = "auto", dtype: str = "auto",
                        tokenizer_path: str | Path | None = None, revision: str | None = None, **kwargs) -> HFEngine:
        """Load a Hugging Face model folder or hub id (pinned at `revision`) and its tokenizer, if it has one."""
        device_, dtype_ = resolve_device_dtype(device, dtype)
        model = _load_model(path, dtype_, revision)
        try:
            tok_revision = revision if tokenizer_path is None or str(tokenizer_path) == str(path) else None
            tokenizer = AutoTokenizer.from_pretrained(str(tokenizer_path or path), revision=tok_revision)
        except (OSError, ValueError):
            tokenizer = None  # engines work on token ids; the tokenizer is a convenience for callers
        return cls(model, tokenizer, device=device_, dtype=dtype_, **kwargs)

    def reset_stats(self) -> None:
        self.stats = EngineStats()

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
        for request in requests:
            future = loop.create_future()
            bad = [t for t in request.prompt_ids if not 0 <= t < vocab]
            if bad:
                future.set_result(GenerationResult.failed(f"prompt ids {bad[:5]} outside the vocabulary [0, {vocab})"))
            else:
                with self._queue_lock:
                    self._queue.append(_Pending(request, future))
            futures.append(future)
        self._wakeup.set()
        return list(await asyncio.gather(*(self._wait(f) for f in futures)))

    async def _wait(self, future: asyncio.Future) -> GenerationResult:
        try:
            if self.request_timeout_s is None:
                return await future
            return await asyncio.wait_for(asyncio.shield(future), self.request_timeout_s)
        except TimeoutError:
            future.cancel()  # the worker skips cancelled requests (and drops their rows between steps)
            # Wall clock, queueing included (a request's own compute is shared with its batch mates): a
            # slow or busy machine fails every request the same way, so the message names the knob.
            return GenerationResult.failed(
                f"request timed out after {self.request_timeout_s:g} s in the local engine, queueing included; on a "
                f"slow or busy machine raise engine.request_timeout_s or run fewer requests at once")
        except asyncio.CancelledError:
            future.cancel()  # the caller gave up (e.g. a server's client left): its row leaves the batch too
            raise

    async def close(self) -> None:
        """Stop the worker; pending requests are failed, a running batch stops at its next step. Idempotent."""
        self._closed = True
        if self._worker is not None and not self._worker.done():
            if self._loop is asyncio.get_running_loop():
                self._worker.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await self._worker
            elif not self._loop.is_closed():  # a worker of another, still running loop
                self._loop.call_soon_threadsafe(self._worker.cancel)
        if self._loop is asyncio.get_running_loop() or self._loop is None or self._loop.is_closed():
            self._fail_pending("engine closed")
        self._executor.shutdown(wait=False)
        # The static path's KV storage and graphs can hold much of a GPU: free them now, unless a batch
        # still runs on them (it frees them as it ends: `_batch_thread`).
        if self.static_decoder is not None and self._lock.acquire(blocking=False):
            try:
                self.static_decoder.release()
            finally:
                self._lock.release()

    def _ensure_worker(self) -> None:
        loop = asyncio.get_running_loop()
        if self._loop is not loop:
            # First use or a new event loop: futures and tasks of an old loop cannot be awaited here.
            with self._queue_lock:
                self._loop, self._queue, self._in_flight = loop, collections.deque(), []
            self._wakeup, self._worker = asyncio.Event(), None
        if self._worker is None or self._worker.done():
            self._worker = loop.create_task(self._serve(), name="hf-engine-worker")

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
                    run = self._run_session if self.continuous_batching else self._run_batch
                    try:
                        await loop.run_in_executor(self._executor, run, batch)
                    except Exception as error:  # the batch failed: its waiters learn why, later batches still run
                        message = f"batch of {len(self._in_flight)} failed: {type(error).__name__}: {error}"
                        for pending in self._in_flight:
                            self._resolve(pending, GenerationResult.failed(message))
                    self._in_flight = []
        finally:
            self._fail_pending("engine worker stopped")

    def _resolve(self, pending: _Pending, result: GenerationResult) -> None:
        """On the event loop: hand one result to its waiter (unless it timed out or was failed)."""
        if not pending.future.done():
            pending.future.set_result(result)

    def _post(self, pending: _Pending, result: GenerationResult) -> None:
        """From the worker thread: resolve on the waiter's own loop, now rather than at the batch's end."""
        with contextlib.suppress(RuntimeError):  # that loop is closed: nobody waits any more
            pending.future.get_loop().call_soon_threadsafe(self._resolve, pending, result)

    def _fail_pending(self, message: str) -> None:
        with self._queue_lock:
            pending_now = [*self._in_flight, *self._queue]
            self._in_flight, self._queue = [], collections.deque()
        for pending in pending_now:
            if not pending.future.done() and not pending.future.get_loop().is_closed():
                pending.future.set_result(GenerationResult.failed(message))

    def _take_batch(self, running: _RunningBatch | None = None) -> list[_Pending]:
        """FIFO, up to max_batch_size rows and max_batch_tokens padded tokens together with the `running`
        batch; the first request into an empty batch always fits. Safe from the worker thread."""
        rows = len(running.rows) if running else 0
        widest = running.width if running else 0  # the longest cache row, prompt or prompt + output
        longest_new = running.remaining() if running else 0
        batch: list[_Pending] = []
        with self._queue_lock:
            while self._queue and rows + len(batch) < self.max_batch_size:
                pending = self._queue[0]
                if pending.future.done():  # cancelled or timed out while waiting
                    self._queue.popleft()
                    continue
                prompt = max(widest, len(pending.request.prompt_ids))
                new = max(longest_new, pending.request.max_tokens)
                if (rows or batch) and (rows + len(batch) + 1) * (prompt + new) > self.max_batch_tokens:
                    break
                batch.append(self._queue.popleft())
                widest, longest_new = prompt, new
        return batch

    # ------------------------------------------------------------------------ blocking torch work
    def _run_batch(self, batch: list[_Pending]) -> None:
        """Whole-request batching: decode `batch` together until every one has finished, then post the results."""
        with self._batch_thread():
            start = time.perf_counter()
            try:
                results = self._decode([p.request for p in batch])
            finally:
                if self.device.type == "cuda":
                    torch.cuda.synchronize(self.device)
                self.stats.compute_s += time.perf_counter() - start
        for pending, result in zip(batch, results, strict=True):
            self._post(pending, result)

    def _run_session(self, first: list[_Pending]) -> None:
        """Continuous batching: decode `first` and admit newcomers between steps until none is left."""
        with self._batch_thread():
            self._decode_continuously(first)

    @contextlib.contextmanager
    def _batch_thread(self):
        """The batch thread's hold on the model; at the end, a closed engine frees the static path's
        storage and graphs (close() could not while this batch held them)."""
        with self._lock, torch.inference_mode(), self._attention_backends():
            try:
                yield
            finally:
                if self._closed and self.static_decoder is not None:
                    self.static_decoder.release()

    def _attention_backends(self):
        """On CUDA, keep SDPA off cuDNN attention: it builds a graph per (batch, length) shape, so our
        ever-changing decode shapes cost ~35 ms per step on an H200 (5 ms/step without it, measured)."""
        if self.device.type != "cuda":
            return contextlib.nullcontext()
        return sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.MATH])

    def _forward(self, input_ids, attention_mask, position_ids, cache) -> torch.Tensor:
        out = self.model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                         use_cache=True, logits_to_keep=1, **{self._cache_kwarg: cache})
        return out.logits[:, -1, :].float()

    def _prefill(self, requests: list[GenerationRequest], held: HeldPrompts | None = None):
        """`ModelRunner.prefill`. With `share_prefixes`, what the prompts share (among them and with `held`,
        the running rows) is computed once (prefix.py); the result has the same layout either way."""
        prompts = [r.prompt_ids for r in requests]
        cache = DynamicCache(config=self.model.config)
        plan = None
        if self.share_prefixes and _plain_layers(cache):
            plan = plan_prefill(prompts, self.min_shared_prefix, held.held_prompts() if held is not None else ())
        if plan is None:
            attention_mask, logits = self._padded_forward(prompts, cache)
            computed = attention_mask.numel()
        else:
            attention_mask, logits = run_plan(plan, cache, held, self._padded_forward)
            computed = plan.computed_tokens
        self.stats.prefills += 1
        self.stats.prefill_requests += len(requests)
        self.stats.prefill_tokens += computed
        self.stats.prompt_tokens += sum(len(p) for p in prompts)
        return cache, attention_mask, attention_mask.sum(-1), logits

    def _padded_forward(self, prompts: list, cache: DynamicCache,
                        past: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run `prompts` left-padded into `cache`, after the columns its rows already hold (`past`: their
        attention mask, None for a fresh cache): (attention mask over past + prompts, each row's last logits)."""
        width = max(len(p) for p in prompts)
        attention_mask = left_padded_mask([len(p) for p in prompts], width, self.device)
        input_ids = torch.zeros_like(attention_mask)
        input_ids[attention_mask.bool()] = torch.tensor([t for p in prompts for t in p], device=self.device)
        if past is not None:
            attention_mask = torch.cat([past, attention_mask], 1)
        position_ids = (attention_mask.cumsum(-1) - 1).clamp(min=0)[:, -width:]
        return attention_mask, self._forward(input_ids, attention_mask, position_ids, cache)

    def _new_row(self, request: GenerationRequest, pending: _Pending | None = None) -> _Row:
        seed = request.seed if request.seed is not None else self._seed_rng.getrandbits(63)
        return _Row(request, pending, torch.Generator().manual_seed(seed), frozenset(request.stop_token_ids))

    def _decode(self, requests: list[GenerationRequest]) -> list[GenerationResult]:
        rows = [self._new_row(r) for r in requests]
        batch = self._new_batch()
        batch.admit(rows)
        while batch.rows:
            if self._closed:
                raise EngineError("engine closed during generation")
            batch.sample()
            batch.keep([i for i, row in enumerate(batch.rows) if row.finish is None])
            batch.advance()
        return [row.result() for row in rows]

    def _decode_continuously(self, first: list[_Pending]) -> None:
        batch, newcomers, owner = self._new_batch(), first, self._loop
        # Stops when nothing is running or waiting (the worker then takes the queue again), or on close(),
        # whose waiters are already failed. Compute time is counted per step: a session can span a rollout.
        while not self._closed and (newcomers or batch.rows):
            start = time.perf_counter()
            if newcomers:
                self._in_flight = [*(row.pending for row in batch.rows), *newcomers]
                batch.admit([self._new_row(p.request, p) for p in newcomers])
            for row in batch.sample():
                self._post(row.pending, row.result())
            batch.keep([i for i, row in enumerate(batch.rows) if row.finish is None and not row.abandoned()])
            self._in_flight = [row.pending for row in batch.rows]
            batch.advance()
            # The queue belongs to the engine's current loop: after a switch (a new asyncio.run) its own
            # worker serves it, so this session only finishes its rows.
            can_take = (batch.mergeable or not batch.rows) and self._loop is owner
            newcomers = self._take_batch(batch) if can_take else []
            self.stats.compute_s += time.perf_counter() - start

    # ------------------------------------------------------------------------------ weight sync
    def load_weights(self, state_dict: Mapping[str, torch.Tensor]) -> None:
        """Copy weights into the engine's own model in place (cast to its dtype/device; captured CUDA graphs
        stay valid); waits for a running batch."""
        with self._lock:
            try:
                self.model.load_state_dict(dict(state_dict), strict=True)
            except RuntimeError as error:
                raise EngineError(f"weights do not fit the engine's model ({type(self.model).__name__}): "
                                  f"{error}") from error

    async def sync_from(self, source: WeightSource) -> None:
        self.load_weights(source.whole_weights())

    async def score(self, prompt_ids: list[int], continuation_ids: list[int], temperature: float) -> ScoreResult:
        """The engine contract's teacher-forced log-probs (the weight-sync canary): one forward of the
        engine's model, on its batch thread, so it waits for a running batch as a weight sync does."""
        if self._closed:
            raise EngineError("HFEngine is closed; create a new engine")
        vocab = self.model.get_input_embeddings().num_embeddings
        if not prompt_ids or not continuation_ids or any(not 0 <= t < vocab for t in [*prompt_ids, *continuation_ids]):
            raise EngineError(f"score needs a prompt and a continuation, both of ids in the vocabulary [0, {vocab})")
        scored = asyncio.get_running_loop().run_in_executor(self._executor, self._score, list(prompt_ids),
                                                            list(continuation_ids), temperature)
        try:  # bounded as a request is: behind a stuck batch it fails instead of waiting for ever
            log_probs = await asyncio.wait_for(scored, self.request_timeout_s)
        except TimeoutError:
            raise EngineError(f"score timed out after {self.request_timeout_s} s behind a running batch "
                              f"(engine.request_timeout_s)") from None
        return ScoreResult(log_probs, str(self.dtype).removeprefix("torch."))

    def _score(self, prompt_ids: list[int], continuation_ids: list[int], temperature: float) -> list[float]:
        n = len(continuation_ids)
        ids = torch.tensor([prompt_ids + continuation_ids], device=self.device)
        with self._batch_thread():
            # The positions predicting the continuation: the last n + 1 but the very last.
            logits = self.model(input_ids=ids, use_cache=False, logits_to_keep=n + 1).logits[0, :-1]
        # The sampling rule's distribution (top_p 1): what a rollout's log-probs are taken from.
        log_probs = sampling_log_probs(logits, torch.full((n,), float(temperature), device=self.device),
                                       torch.ones(n, device=self.device), any_nucleus=False)
        return log_probs.gather(-1, torch.tensor(continuation_ids, device=self.device)[:, None]).squeeze(-1).tolist()

    def reload_from_path(self, path: str | Path) -> None:
        """Replace the model with the Hugging Face folder at `path` (same device and dtype)."""
        model = _load_model(path, self.dtype).to(self.device).eval()
        # Whatever a caller checked before, this is what was read: a folder swapped meanwhile for another
        # architecture must not replace the served model (nor the static decoder's buffers sized for it).
        if _weight_shapes(model) != _weight_shapes(self.model):
            raise EngineError(f"the model in {path} has other weight names or shapes than the served one; "
                              "reload only checkpoints of the served architecture")
        with self._lock:
            self.model = model
            self._cache_kwarg = _cache_kwarg(model)
            if self.static_decoder is not None:  # new parameters: graphs captured over the old ones are stale
                self.static_decoder.reset(model, self._cache_kwarg)
