"""The running batch behind HFEngine: rows decoded together in one right-aligned, mergeable KV cache.

Owns a batch's per-step bookkeeping (`_RunningBatch`), per-request state (`_Row`, `_Pending`) and counters
(`EngineStats`); it reaches the engine's model calls only through a `ModelRunner`, so it never imports
hf.py. Invariant: merging, trimming and copying prompt prefixes between rows change no logit (zero
keys/values under mask 0, per-row position ids): docs/engines.md.
"""

from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass, field
from typing import Protocol

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from memrl.engines.base import GenerationRequest, GenerationResult
from memrl.engines.kv_cache import SpareLayer
from memrl.engines.prefix import HeldPrompts, KeyValues, held_block
from memrl.engines.sampling import sample_tokens, sampling_log_probs


@dataclass
class _Pending:
    request: GenerationRequest
    future: asyncio.Future


@dataclass
class EngineStats:
    """What the engine computed since it was created or `reset_stats()`; written by the worker thread only.
    One prefill per batch or per group admitted together; `prefill_tokens / prompt_tokens` is what prefix
    sharing saves (a plain prefill computes rows x its widest prompt)."""

    prefills: int = 0
    prefill_requests: int = 0
    prompt_tokens: int = 0  # requested: the admitted prompts' own tokens
    prefill_tokens: int = 0  # computed: token positions run through the model at admission, padding included
    decode_steps: int = 0
    decode_rows: int = 0
    compute_s: float = 0.0  # wall time the worker thread spent in batches or sessions

    @property
    def mean_decode_batch(self) -> float:
        return self.decode_rows / self.decode_steps if self.decode_steps else float("nan")


@dataclass
class _Row:
    """One request in the running batch and what it has generated so far."""

    request: GenerationRequest
    pending: _Pending | None  # None in whole-request batching, where results are returned, not posted
    generator: torch.Generator
    stops: frozenset[int]
    output_ids: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    finish: str | None = None

    def result(self) -> GenerationResult:
        return GenerationResult(output_ids=self.output_ids, log_probs=self.log_probs,
                                finish_reason=self.finish)  # type: ignore[arg-type]

    @functools.cached_property
    def prompt(self) -> tuple[int, ...]:
        """The prompt ids as a tuple, as prefix sharing compares them (once per row, not per admission)."""
        return tuple(self.request.prompt_ids)

    def abandoned(self) -> bool:
        """The waiter is gone (timed out, or failed by close): computing further is wasted."""
        return self.pending is not None and self.pending.future.done()


class ModelRunner(Protocol):
    """All a `_RunningBatch` needs of the engine: its model calls and its decode-step counters (the batch
    puts its tensors on the device of the prefill's attention mask and samples with sampling.py)."""

    def prefill(self, requests: list[GenerationRequest],
                held: HeldPrompts | None = None) -> tuple[DynamicCache, torch.Tensor, torch.Tensor, torch.Tensor]:
        """Left-padded prefill of `requests` into a fresh cache: (cache, attention_mask, next_position, logits),
        counted in the engine's stats. `held`: the running batch, whose prompts' keys/values it may copy."""
        ...

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor, position_ids: torch.Tensor,
                cache: DynamicCache) -> torch.Tensor:
        """One model call appending to `cache`; the fp32 logits of each row's last position, (rows, vocab)."""
        ...

    def count_decode_step(self, rows: int) -> None:
        ...


class _RunningBatch:
    """The rows being decoded, right-aligned in one KV cache.

    Invariants: row i's tokens fill the last `attention_mask[i].sum()` columns of `attention_mask` and of
    every cache layer (before them: zero keys/values, mask 0); `next_position[i]` is the position id of
    row i's next input token; between `admit`/`advance` and `sample`, `logits[i]` are the logits of row
    i's next token; after `sample`, `tokens[i]` is the token it just sampled.
    """

    def __init__(self, runner: ModelRunner) -> None:
        self.runner = runner
        self.rows: list[_Row] = []
        self.cache: DynamicCache | None = None
        self.mergeable = False

    @property
    def width(self) -> int:
        return self.attention_mask.shape[1] if self.rows else 0

    def remaining(self) -> int:
        return max((r.request.max_tokens - len(r.output_ids) for r in self.rows), default=0)

    def admit(self, rows: list[_Row]) -> None:
        """Prefill `rows` and add them; their logits join the running rows' pending logits."""
        cache, mask, next_position, logits = self.runner.prefill([r.request for r in rows],
                                                                 self if self.rows and self.mergeable else None)
        device = mask.device
        temperatures = torch.tensor([r.request.temperature for r in rows], dtype=torch.float32, device=device)
        top_ps = torch.tensor([r.request.top_p for r in rows], dtype=torch.float32, device=device)
        if not self.rows:
            self.rows, self.cache, self.attention_mask, self.next_position = list(rows), cache, mask, next_position
            self.temperatures, self.top_ps, self.logits = temperatures, top_ps, logits
            self.mergeable = _mergeable(cache)
            if self.mergeable:
                spare = self.remaining()
                # Layer by layer, so each old layer is freed before the next new one exists (peak: one layer).
                for i, layer in enumerate(cache.layers):
                    cache.layers[i] = SpareLayer.from_tensors(layer.keys, layer.values, spare)
            return
        width = max(self.width, mask.shape[1])
        spare = max(self.remaining(), max(r.request.max_tokens for r in rows))
        for i, (mine, theirs) in enumerate(zip(self.cache.layers, cache.layers, strict=True)):
            # in place, layer by layer: the merged cache never coexists with the whole old one
            self.cache.layers[i] = SpareLayer.merged([(mine.keys, mine.values), (theirs.keys, theirs.values)],
                                                     width, spare)
        # Right-aligned rows: the narrower side gets zero (masked) columns on the left.
        self.attention_mask = torch.cat([F.pad(self.attention_mask, (width - self.width, 0)),
                                         F.pad(mask, (width - mask.shape[1], 0))])
        self.next_position = torch.cat([self.next_position, next_position])
        self.temperatures = torch.cat([self.temperatures, temperatures])
        self.top_ps = torch.cat([self.top_ps, top_ps])
        self.logits = torch.cat([self.logits, logits])
        self.rows.extend(rows)

    def held_prompts(self) -> list[tuple[int, ...]]:
        return [row.prompt for row in self.rows]

    def prefix_block(self, sources, width: int) -> tuple[KeyValues, torch.Tensor]:
        """`HeldPrompts.prefix_block`: row i's tokens start where its mask does (rows are right-aligned)."""
        starts = (self.attention_mask.shape[1] - self.attention_mask.sum(1)).tolist()
        layers = [(layer.keys, layer.values) for layer in self.cache.layers]
        return held_block(layers, sources, width, range(len(self.rows)), starts)

    def sample(self) -> list[_Row]:
        """One token for every row from its pending logits; returns the rows that finished with it."""
        uniforms = torch.stack([torch.rand((), generator=row.generator) for row in self.rows])
        row_log_probs = sampling_log_probs(self.logits, self.temperatures, self.top_ps)
        self.tokens = sample_tokens(row_log_probs, self.temperatures, uniforms)
        token_log_probs = row_log_probs.gather(1, self.tokens[:, None]).squeeze(1)
        return record_samples(self.rows, self.tokens.tolist(), token_log_probs.tolist())

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at positions `keep` (after `sample`); trims padding no kept row needs."""
        if len(keep) == len(self.rows):
            return
        self.rows = [self.rows[i] for i in keep]
        if not self.rows:
            self.cache = None  # the next admission starts a fresh cache
            return
        index = torch.tensor(keep, device=self.tokens.device)
        self.cache.batch_select_indices(index)
        self.attention_mask, self.next_position = self.attention_mask[index], self.next_position[index]
        self.temperatures, self.top_ps, self.tokens = self.temperatures[index], self.top_ps[index], self.tokens[index]
        # Rows are right-aligned, so the columns every row masks are a prefix; dropping them keeps the
        # cache no wider than its longest row (without it, staggered admissions would widen it forever).
        unused = int((self.attention_mask.shape[1] - self.attention_mask.sum(1)).min())
        if unused > 0 and self.mergeable:
            self.attention_mask = self.attention_mask[:, unused:]
            for layer in self.cache.layers:
                layer.trim_left(unused)

    def advance(self) -> None:
        """Feed every row its sampled token (one forward pass); no-op when no row is left."""
        if not self.rows:
            return
        self.attention_mask = torch.cat([self.attention_mask, self.attention_mask.new_ones((len(self.rows), 1))], 1)
        self.logits = self.runner.forward(self.tokens[:, None], self.attention_mask, self.next_position[:, None],
                                          self.cache)
        self.next_position = self.next_position + 1
        self.runner.count_decode_step(len(self.rows))


def record_samples(rows: list[_Row], tokens: list[int], log_probs: list[float]) -> list[_Row]:
    """Append each row's sampled token and log-prob and decide its finish (the one rule, for both the
    dynamic and the static batch): `stop` on a stop token (kept), `length` at max_tokens."""
    finished = []
    for row, token, lp in zip(rows, tokens, log_probs, strict=True):
        row.output_ids.append(token)
        row.log_probs.append(lp)
        if token in row.stops:
            row.finish = "stop"
        elif len(row.output_ids) >= row.request.max_tokens:
            row.finish = "length"
        if row.finish is not None:
            finished.append(row)
    return finished


def _plain_layers(cache) -> bool:
    """Every layer a plain full-attention `DynamicLayer`: sliding-window, quantized or shared-KV layers store
    keys/values that padding, copying between rows or merging would corrupt."""
    layers = getattr(cache, "layers", None)
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def _mergeable(cache) -> bool:
    """A filled cache of plain layers only: other models admit new requests only into an empty batch."""
    return _plain_layers(cache) and all(isinstance(layer.keys, torch.Tensor) and layer.keys.dim() == 4
                                        for layer in cache.layers)
