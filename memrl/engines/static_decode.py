"""HFEngine's static-shape decode: rows in slots of preallocated KV buffers, one CUDA graph per bucket.

A step's shapes depend only on its bucket (S slots x C columns, powers of two): on CUDA its forward is
captured once per bucket and replayed (`StaticDecoder`), on CPU it runs eagerly. Invariants: the dynamic
path's sampling rules and random draws, its prefill and first log-prob bitwise, later log-probs within
tests/engines/numerics.py's float32 bound; one device->host transfer per step. Why and how: docs/engines.md.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch.nn.utils.rnn import pad_sequence

from memrl.engines.base import EngineError
from memrl.engines.hf_batch import ModelRunner, _Row, record_samples
from memrl.engines.prefix import KeyValues, copy_columns, held_block
from memrl.engines.sampling import sample_tokens, sampling_log_probs
from memrl.engines.static_kv import SlotCache, SlotStorage, decode_attention

log = logging.getLogger(__name__)

MIN_CAPACITY = 32  # the smallest length bucket: below it, graphs per length would outnumber their use
SHRINK_FACTOR = 4  # a bucket shrinks once what it holds fits a quarter of it


def slot_bucket(rows: int, max_slots: int) -> int:
    """Slots for `rows` rows: the next power of two, capped at `max_slots` (itself the last bucket)."""
    return min(1 << max(rows - 1, 0).bit_length(), max(max_slots, rows))


def length_bucket(tokens: int) -> int:
    """Columns for rows needing up to `tokens` columns: the next power of two, at least MIN_CAPACITY."""
    return max(MIN_CAPACITY, 1 << max(tokens - 1, 0).bit_length())


class StaticDecoder:
    """The engine-lifetime part of static decode: KV storage, slot-ordered step inputs, graphs per bucket.

    `graphs`: capture the decode forward per (slots, columns) bucket as a CUDA graph. `strict`
    (`cuda_graphs = on`): a capture that fails or whose replay disagrees with the eager step raises;
    otherwise (`auto`) the engine warns once and decodes eagerly on the same static buffers.
    """

    def __init__(self, model: torch.nn.Module, cache_kwarg: str, max_slots: int, *, graphs: bool,
                 strict: bool) -> None:
        self.max_slots, self.strict, self.graphs = max_slots, strict, graphs
        self.captures = 0  # CUDA graphs captured since the last reset (tests and benches read it)
        self.reset(model, cache_kwarg)

    def reset(self, model: torch.nn.Module, cache_kwarg: str) -> None:
        """Forget storage and graphs (a new model: captured pointers would be stale)."""
        self.model, self.cache_kwarg = model, cache_kwarg
        self.storage: SlotStorage | None = None
        self.tokens_in = self.positions_in = self._columns = None
        self._graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self._pool = None

    def release(self) -> None:
        """Free the storage and the graphs (the engine is closing); the next batch would start afresh."""
        self.reset(self.model, self.cache_kwarg)

    def bind(self, keys: torch.Tensor, layers: int) -> None:
        """Size the storage from a prefill's keys [B, H_kv, L, D] (once, or again for another shape)."""
        _, kv_heads, _, head_dim = keys.shape
        if self.storage is not None and self.storage.fits(layers, kv_heads, head_dim, keys.dtype):
            return
        self._graphs.clear()
        self.storage = SlotStorage(layers, kv_heads, head_dim, keys.dtype, keys.device)
        self.tokens_in = torch.zeros(self.max_slots, dtype=torch.long, device=keys.device)
        self.positions_in = torch.zeros(self.max_slots, dtype=torch.long, device=keys.device)

    def ensure_inputs(self, slots: int) -> None:
        """Step-input buffers for `slots` slots (more than `max_slots` if the engine's limit was raised)."""
        if self.tokens_in.numel() < slots:
            self._graphs.clear()
            self.tokens_in = torch.zeros(slots, dtype=torch.long, device=self.tokens_in.device)
            self.positions_in = torch.zeros(slots, dtype=torch.long, device=self.tokens_in.device)

    def storage_moved(self) -> None:
        """The storage was reallocated: graphs captured over the old views are stale."""
        self._graphs.clear()

    def forward(self, slots: int, capacity: int) -> torch.Tensor:
        """The fp32 next-token logits [slots, vocab] of feeding `tokens_in[:slots]` at `positions_in[:slots]`."""
        if not self.graphs:
            return self._eager(slots, capacity)
        captured = self._graphs.get((slots, capacity))
        if captured is None:
            captured = self._capture(slots, capacity)
            if captured is None:  # capture failed in auto mode: eager from now on
                return self._eager(slots, capacity)
        graph, logits = captured
        graph.replay()
        return logits

    def _eager(self, slots: int, capacity: int) -> torch.Tensor:
        positions = self.positions_in[:slots]
        if self._columns is None or self._columns.numel() < capacity:
            # Graphs captured over the old tensor would replay with its freed (reused) memory as their mask.
            self._graphs.clear()
            self._columns = torch.arange(max(capacity, MIN_CAPACITY), device=positions.device)
        # A slot attends to its columns up to and including the one its new token is written to.
        mask = (self._columns[None, :capacity] <= positions[:, None])[:, None, None, :]
        cache = SlotCache(self.storage.views(slots, capacity), positions)
        with decode_attention(self.model):
            out = self.model(input_ids=self.tokens_in[:slots, None], attention_mask=mask,
                             position_ids=positions[:, None], use_cache=True, logits_to_keep=1,
                             **{self.cache_kwarg: cache})
        return out.logits[:, -1, :].float()

    def _capture(self, slots: int, capacity: int):
        """Capture the step for this bucket; returns (graph, its output logits) or None (auto mode, failed)."""
        device = self.tokens_in.device
        try:
            # Warm-up on a side stream (as torch.cuda.graphs asks) with the real inputs of the coming step:
            # its key/value writes are the ones the replay makes, so nothing it writes is wrong.
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                for _ in range(2):
                    reference = self._eager(slots, capacity)
            torch.cuda.current_stream(device).wait_stream(side)
            if self._pool is None:
                self._pool = torch.cuda.graph_pool_handle()  # one pool: graphs never run concurrently
            graph = torch.cuda.CUDAGraph()
            # thread_local: a trainer thread may use the same GPU meanwhile (the overlapped pipeline).
            with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
                logits = self._eager(slots, capacity)
            graph.replay()
            # A gross-error guard, once per bucket: a replay over stale pointers gives garbage, not a
            # rounding difference (the replay runs the warm-up's kernels on the same inputs).
            gap = float((logits - reference).abs().max())
            scale = float(reference.abs().max())
            if not gap <= 1e-2 * scale + 1e-3:
                raise EngineError(f"the captured decode step disagrees with the eager one by {gap:.3g} "
                                  f"(logits up to {scale:.3g})")
        except Exception as error:  # noqa: BLE001 - auto mode degrades to eager decoding, loudly
            if self.strict:
                raise EngineError(f"capturing the decode step as a CUDA graph failed ({type(error).__name__}: "
                                  f"{error}); set engine.cuda_graphs to off (or auto, which falls back)") from error
            log.warning("CUDA graph capture failed (%s: %s); decoding eagerly on static buffers", type(error).__name__,
                        error)
            self.graphs = False
            self._graphs.clear()
            return None
        self.captures += 1
        self._graphs[(slots, capacity)] = (graph, logits)
        return graph, logits


class StaticBatch:
    """The running batch of the static path, with `_RunningBatch`'s interface (admit, sample, keep, advance).

    Row-ordered state (`rows`, sampling parameters, pending logits, sampled tokens) is as in the dynamic
    batch; `slots[i]` is row i's slot in the bucket and `lengths[i]` the tokens in its cache.
    """

    mergeable = True  # any newcomer fits a (possibly larger) bucket

    def __init__(self, runner: ModelRunner, decoder: StaticDecoder) -> None:
        self.runner, self.decoder = runner, decoder
        self.rows: list[_Row] = []
        self.slots: list[int] = []
        self.lengths: list[int] = []
        self.bucket = (0, 0)  # (slots, columns) of the current views; (0, 0) before the first admission
        self._free: list[int] = []
        self._slot_index: torch.Tensor | None = None
        self._ahead = False  # the next step's forward was launched by `sample`

    @property
    def width(self) -> int:
        return max(self.lengths, default=0)

    def remaining(self) -> int:
        return max((r.request.max_tokens - len(r.output_ids) for r in self.rows), default=0)

    def _columns_needed(self) -> int:
        return max((n + r.request.max_tokens - len(r.output_ids) for n, r in zip(self.lengths, self.rows, strict=True)),
                   default=0)

    # ------------------------------------------------------------------------------ admission
    def admit(self, rows: list[_Row]) -> None:
        """Prefill `rows`, copy their keys/values into free slots; their logits join the pending ones."""
        cache, mask, _, logits = self.runner.prefill([r.request for r in rows], self if self.rows else None)
        layers = getattr(cache, "layers", None) or []
        if not layers or any(getattr(layer, "keys", None) is None or layer.keys.dim() != 4 for layer in layers):
            raise EngineError("static decode needs a prefill cache of plain [batch, heads, length, dim] layers; "
                              "set engine.static_kv to off for this model")
        self.decoder.bind(layers[0].keys, len(layers))
        device = mask.device
        prompt_lengths = [len(r.request.prompt_ids) for r in rows]
        need = max(self._columns_needed(),
                   *(p + r.request.max_tokens for p, r in zip(prompt_lengths, rows, strict=True)))
        self._fit(len(self.rows) + len(rows), need, shrink=False)
        slots = [self._free.pop(0) for _ in rows]
        self._copy_prefill(layers, prompt_lengths, mask.shape[1], slots)
        self.decoder.positions_in[torch.tensor(slots, device=device)] = torch.tensor(prompt_lengths, device=device)

        temperatures = torch.tensor([r.request.temperature for r in rows], dtype=torch.float32)
        top_ps = torch.tensor([r.request.top_p for r in rows], dtype=torch.float32)
        # Each request's uniforms for all its steps, drawn up front from its own generator: the same
        # numbers, in the same order, as one draw per step (torch's CPU generator fills serially).
        draws = [torch.rand(r.request.max_tokens, generator=r.generator) for r in rows]
        # One width for old and new rows, padded on the host and joined in one copy (this runs per admission).
        width = max([d.numel() for d in draws] + ([self.uniforms.shape[1]] if self.rows else []))
        uniforms = F.pad(pad_sequence(draws, batch_first=True), (0, width - max(d.numel() for d in draws)))
        uniforms = uniforms.to(device)
        steps = torch.zeros(len(rows), dtype=torch.long, device=device)
        if self.rows:
            uniforms = torch.cat([F.pad(self.uniforms, (0, width - self.uniforms.shape[1])), uniforms])
            steps = torch.cat([self.steps, steps])
            temperatures, top_ps = (torch.cat([self.host_temperatures, temperatures]),
                                    torch.cat([self.host_top_ps, top_ps]))
            logits = torch.cat([self.logits, logits])
        self.uniforms, self.steps, self.logits = uniforms, steps, logits
        self._set_sampling(temperatures, top_ps, device)
        self.rows, self.slots = [*self.rows, *rows], [*self.slots, *slots]
        self.lengths = [*self.lengths, *prompt_lengths]
        self._slot_index = None

    def held_prompts(self) -> list[tuple[int, ...]]:
        return [row.prompt for row in self.rows]

    def prefix_block(self, sources, width: int) -> tuple[KeyValues, torch.Tensor]:
        """`HeldPrompts.prefix_block`: row i's prompt token j sits in column j of its slot."""
        views = self.decoder.storage.views(*self.bucket)
        return held_block(views, sources, width, self.slots, [0] * len(self.rows))

    def _set_sampling(self, temperatures: torch.Tensor, top_ps: torch.Tensor, device: torch.device) -> None:
        self.host_temperatures, self.host_top_ps = temperatures, top_ps
        self.temperatures, self.top_ps = temperatures.to(device), top_ps.to(device)
        # Known on the host, so sampling need not ask the device (sampling_log_probs would sync for it).
        self.any_nucleus = bool(((temperatures > 0) & (top_ps < 1.0)).any())

    def _copy_prefill(self, layers, lengths: Sequence[int], width: int, slots: Sequence[int]) -> None:
        """Row r of the left-padded prefill holds its tokens in the last lengths[r] columns; they go to
        columns [0, lengths[r]) of slots[r]."""
        columns = [torch.arange(width - n, width) for n in lengths]
        picks = [(slot, r, cols) for r, (slot, cols) in enumerate(zip(slots, columns, strict=True))]
        copy_columns([(layer.keys, layer.values) for layer in layers], picks, len(slots), width,
                     self.decoder.storage.views(*self.bucket), at_start=True)

    # ------------------------------------------------------------------------------ buckets
    def _fit(self, rows: int, columns: int, *, shrink: bool) -> None:
        """Move to the bucket `rows` rows needing `columns` columns want, if it outgrew the current one
        (or, with `shrink`, fits a quarter of it)."""
        slots, capacity = self.bucket
        want_slots, want_columns = slot_bucket(rows, self.decoder.max_slots), length_bucket(columns)
        if want_slots > slots or (shrink and want_slots * SHRINK_FACTOR <= slots):
            slots = want_slots
        if want_columns > capacity or (shrink and want_columns * SHRINK_FACTOR <= capacity):
            capacity = want_columns
        if (slots, capacity) != self.bucket:
            self._relayout(slots, capacity)

    def _relayout(self, slots: int, capacity: int) -> None:
        """Copy the live rows into the first slots of a (slots, capacity) bucket."""
        storage, n = self.decoder.storage, len(self.rows)
        live = self.width
        moved: list[tuple[torch.Tensor, torch.Tensor]] = []
        in_place = storage.tokens >= slots * capacity
        old_views = storage.views(*self.bucket) if n else []
        index = torch.tensor(self.slots, device=storage.device) if n else None
        if n and not in_place:  # the allocation is replaced: copy everything out first
            moved = [(k[index, :, :live], v[index, :, :live]) for k, v in old_views]
            old_views = []  # let the old allocation go before the new one exists
        if storage.ensure(slots, capacity):
            self.decoder.storage_moved()
        self.decoder.ensure_inputs(slots)
        for i, (keys, values) in enumerate(storage.views(slots, capacity)):
            if not n:
                break
            # In place, the old and new views share memory: the indexed read is a copy, taken first.
            k_old, v_old = moved[i] if moved else (old_views[i][0][index, :, :live], old_views[i][1][index, :, :live])
            keys[:n, :, :live] = k_old
            values[:n, :, :live] = v_old
        positions = self.decoder.positions_in
        positions[:slots] = 0
        if n:
            positions[:n] = torch.tensor(self.lengths, device=positions.device)
        self.bucket, self.slots, self._free = (slots, capacity), list(range(n)), list(range(n, slots))
        self._slot_index = None

    def _slots_tensor(self) -> torch.Tensor:
        if self._slot_index is None:
            self._slot_index = torch.tensor(self.slots, device=self.decoder.positions_in.device)
            self._ones = torch.ones(len(self.slots), dtype=torch.long, device=self._slot_index.device)
        return self._slot_index

    # ------------------------------------------------------------------------------ steps
    def sample(self) -> list[_Row]:
        """One token for every row from its pending logits; returns the rows that finished with it. Launches
        the next step's forward first unless every row finishes by length (a finished row wastes one row-step)."""
        uniforms = self.uniforms.gather(1, self.steps[:, None]).squeeze(1)
        row_log_probs = sampling_log_probs(self.logits, self.temperatures, self.top_ps, any_nucleus=self.any_nucleus)
        self.tokens = sample_tokens(row_log_probs, self.temperatures, uniforms)
        token_log_probs = row_log_probs.gather(1, self.tokens[:, None]).squeeze(1)
        self.steps = self.steps + 1
        # The step's one device->host transfer: what the finished-row check (stop, length) needs, queued
        # before the next forward so that waiting for it does not wait for that forward.
        on_cuda = self.tokens.device.type == "cuda"
        tokens = torch.empty(self.tokens.shape, dtype=self.tokens.dtype, pin_memory=on_cuda)
        log_probs = torch.empty(token_log_probs.shape, dtype=token_log_probs.dtype, pin_memory=on_cuda)
        tokens.copy_(self.tokens, non_blocking=True)
        log_probs.copy_(token_log_probs, non_blocking=True)
        copied = torch.cuda.Event() if on_cuda else None
        if copied is not None:
            copied.record()
        self._ahead = not all(len(r.output_ids) + 1 >= r.request.max_tokens for r in self.rows)
        if self._ahead:
            self._forward()
        if copied is not None:
            copied.synchronize()
        return record_samples(self.rows, tokens.tolist(), log_probs.tolist())

    def keep(self, keep: list[int]) -> None:
        """Keep only the rows at positions `keep` (after `sample`); the others' slots become free."""
        if len(keep) == len(self.rows):
            return
        kept = set(keep)
        self._free = sorted(self._free + [s for i, s in enumerate(self.slots) if i not in kept])
        self.rows = [self.rows[i] for i in keep]
        self.slots, self.lengths = [self.slots[i] for i in keep], [self.lengths[i] for i in keep]
        self._slot_index = None
        if not self.rows:
            self.bucket, self._free = (0, 0), []  # the next admission picks a fresh bucket
            return
        index = torch.tensor(keep, device=self.tokens.device)
        self.uniforms, self.steps, self.tokens = self.uniforms[index], self.steps[index], self.tokens[index]
        if self._ahead:
            self.logits = self.logits[index]
        self._set_sampling(self.host_temperatures[keep], self.host_top_ps[keep], self.tokens.device)
        self._fit(len(self.rows), self._columns_needed(), shrink=True)

    def advance(self) -> None:
        """Feed every row its sampled token (one static-shape step, normally launched by `sample`
        already); no-op when no row is left."""
        if not self.rows:
            return
        if not self._ahead:
            self._forward()
        self._ahead = False
        self.runner.count_decode_step(len(self.rows))

    def _forward(self) -> None:
        index = self._slots_tensor()
        decoder = self.decoder
        decoder.tokens_in.index_copy_(0, index, self.tokens)
        logits = decoder.forward(*self.bucket)
        self.logits = logits.index_select(0, index)  # a copy: the next replay overwrites the graph's output
        decoder.positions_in.index_add_(0, index, self._ones)
        self.lengths = [n + 1 for n in self.lengths]
