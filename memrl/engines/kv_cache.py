"""A KV-cache layer with spare capacity, for HFEngine's running batch (memrl/engines/hf_batch.py).

`SpareLayer` appends in place into free columns of preallocated buffers, where `DynamicLayer.update`
copies the whole cache by `torch.cat` (~30% of a CPU decode step, profiled). Attention sees the same
values, so no logit changes. How, and why code that assigns `layer.keys` itself stays correct: docs/engines.md.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import DynamicLayer


class SpareLayer(DynamicLayer):
    """A `DynamicLayer` whose keys/values are views into buffers with free columns on the right."""

    def __init__(self, **kwargs) -> None:
        super().__init__(**kwargs)
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None
        self._start = 0  # first filled column of the buffers
        self._views: tuple[torch.Tensor, torch.Tensor] | None = None  # what `keys`/`values` were set to here

    @classmethod
    def from_tensors(cls, keys: torch.Tensor, values: torch.Tensor, spare: int) -> SpareLayer:
        """A layer holding `keys`/`values` [B, H, L, D] (copied) with room for `spare` more columns."""
        return cls.merged([(keys, values)], keys.shape[2], spare)

    @classmethod
    def merged(cls, parts: list[tuple[torch.Tensor, torch.Tensor]], width: int, spare: int) -> SpareLayer:
        """One layer stacking the rows of `parts` ((keys, values) pairs, each [B_i, H, L_i <= width, D])
        along the batch, each right-aligned in `width` columns with zeros before it, plus `spare` columns."""
        keys, values = parts[0]
        rows = sum(k.shape[0] for k, _ in parts)
        layer = cls()
        layer.device, layer.is_initialized = keys.device, True
        layer._key_buffer = keys.new_empty(rows, keys.shape[1], width + spare, keys.shape[3])
        layer._value_buffer = values.new_empty(rows, values.shape[1], width + spare, values.shape[3])
        first = 0
        for part_keys, part_values in parts:
            last, pad = first + part_keys.shape[0], width - part_keys.shape[2]
            for buffer, tensor in ((layer._key_buffer, part_keys), (layer._value_buffer, part_values)):
                # Zeros, not garbage: masked columns still enter attention with weight 0, and 0 * NaN is NaN.
                buffer[first:last, :, :pad] = 0
                buffer[first:last, :, pad:width] = tensor
            first = last
        layer._set_views(0, width)
        return layer

    @property
    def capacity(self) -> int:
        """Columns the buffers hold, filled or not (0 before the first update)."""
        return self._key_buffer.shape[2] if self._owns_views() else 0

    def _set_views(self, start: int, width: int) -> None:
        self._start = start
        self.keys = self._key_buffer[:, :, start : start + width]
        self.values = self._value_buffer[:, :, start : start + width]
        self._views = (self.keys, self.values)

    def _owns_views(self) -> bool:
        return self._views is not None and self.keys is self._views[0] and self.values is self._views[1]

    def _reallocate(self, like: torch.Tensor, like_values: torch.Tensor, free: int) -> None:
        """New buffers holding the current keys/values at column 0 and at least `free` more columns."""
        current = self.keys is not None and self.keys.dim() == 4 and self.keys.numel() > 0
        keys = self.keys if current else like[:, :, :0]
        values = self.values if current else like_values[:, :, :0]
        width = keys.shape[2]
        fresh = SpareLayer.from_tensors(keys, values, max(free, width))
        self._key_buffer, self._value_buffer = fresh._key_buffer, fresh._value_buffer
        self._set_views(0, width)

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """Append `key_states`/`value_states` [B, H, n, D] in place; returns views of all filled columns."""
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        n = key_states.shape[2]
        if not self._owns_views() or self._start + self.keys.shape[2] + n > self._key_buffer.shape[2]:
            self._reallocate(key_states, value_states, n)
        end = self._start + self.keys.shape[2]
        self._key_buffer[:, :, end : end + n] = key_states
        self._value_buffer[:, :, end : end + n] = value_states
        self._set_views(self._start, end + n - self._start)
        return self.keys, self.values

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        """Keep only the rows `indices` (the spare columns stay available)."""
        if not self._owns_views():
            return super().batch_select_indices(indices)
        width = self.keys.shape[2]
        # From `_start` on: the trimmed columns before it are dead, and copying them would only waste.
        self._key_buffer = self._key_buffer[:, :, self._start:].index_select(0, indices.to(self._key_buffer.device))
        self._value_buffer = self._value_buffer[:, :, self._start:].index_select(
            0, indices.to(self._value_buffer.device))
        self._set_views(0, width)

    def trim_left(self, columns: int) -> None:
        """Drop the first `columns` filled columns (no copy: the views start later in the buffers)."""
        if columns <= 0:
            return
        if not self._owns_views():
            self.keys, self.values = self.keys[:, :, columns:], self.values[:, :, columns:]
            return
        self._set_views(self._start + columns, self.keys.shape[2] - columns)

    def reset(self) -> None:
        super().reset()
        self._key_buffer = self._value_buffer = self._views = None
        self._start = 0
