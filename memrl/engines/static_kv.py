"""Preallocated, slotted KV storage for HFEngine's static-shape decode (memrl/engines/static_decode.py).

Every layer's keys and values live in one allocation, viewed per bucket as [S, kv_heads, C, head_dim];
a request owns one slot, its token at position p in column p. The views' data pointers never move while
the allocation lives (what lets a step be captured as a CUDA graph). Why not `StaticCache`: docs/engines.md.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn.functional as F
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin

DECODE_ATTENTION = "memrl_slot_decode"


def slot_decode_attention(module, query, key, value, attention_mask, dropout: float = 0.0,
                          scaling: float | None = None, **kwargs) -> tuple[torch.Tensor, None]:
    """Attention of one new token per slot: query [S, H, 1, D], key/value [S, H_kv, C, D], mask [S, 1, 1, C].
    The G query heads sharing a kv head are G query rows of one SDPA call (`repeat_kv` would copy the cache)."""
    slots, heads, q_len, dim = query.shape
    kv_heads = key.shape[1]
    if q_len != 1:
        raise ValueError(f"{DECODE_ATTENTION} attends one new token per slot, got {q_len}")
    grouped = query.reshape(slots, kv_heads, heads // kv_heads, dim)  # query head h uses kv head h // G
    out = F.scaled_dot_product_attention(grouped, key, value, attn_mask=attention_mask, scale=scaling)
    return out.reshape(slots, heads, 1, dim).transpose(1, 2).contiguous(), None


AttentionInterface.register(DECODE_ATTENTION, slot_decode_attention)


@contextlib.contextmanager
def decode_attention(model: torch.nn.Module):
    """Within: the model's attention layers call `slot_decode_attention` (they look the function up by
    `config._attn_implementation` at every forward); prefill keeps the model's own implementation."""
    config = model.config
    previous = config._attn_implementation
    config._attn_implementation = DECODE_ATTENTION
    try:
        yield
    finally:
        config._attn_implementation = previous


def supports_static_decode(model: torch.nn.Module) -> str | None:
    """None when the model can decode on slots, else why not (sliding-window or other non-full layers)."""
    layer_types = getattr(model.config, "layer_types", None) or ["full_attention"]
    other = sorted({t for t in layer_types if t != "full_attention"})
    if other:
        return f"layers of type {', '.join(other)} (only full-attention layers decode on static slots)"
    return None


class SlotLayer(CacheLayerMixin):
    """One layer's [S, H_kv, C, D] key/value views; `update` writes token s at column `positions[s]`."""

    is_compileable = True

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, positions: torch.Tensor) -> None:
        super().__init__()
        self.keys, self.values, self.positions = keys, values, positions
        self.device, self.is_initialized = keys.device, True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Nothing to do: the views exist before the first update."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        index = self.positions.view(-1, 1, 1, 1).expand(-1, key_states.shape[1], 1, key_states.shape[3])
        self.keys.scatter_(2, index, key_states)
        self.values.scatter_(2, index, value_states)
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.keys.shape[2], 0

    def get_seq_length(self) -> int:
        return 0  # lengths differ per slot; the decode step passes position ids and a 4D mask itself

    def get_max_length(self) -> int:
        return self.keys.shape[2]


class SlotCache(Cache):
    """The cache a static decode step hands the model: one `SlotLayer` per decoder layer."""

    def __init__(self, views: list[tuple[torch.Tensor, torch.Tensor]], positions: torch.Tensor) -> None:
        super().__init__(layers=[SlotLayer(k, v, positions) for k, v in views])


class SlotStorage:
    """Keys/values of every layer, for up to `tokens` slot-columns, in one allocation; views per bucket."""

    def __init__(self, layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        self.layers, self.kv_heads, self.head_dim = layers, kv_heads, head_dim
        self.dtype, self.device = dtype, device
        self.tokens = 0  # slot-columns the allocation holds
        self._flat: torch.Tensor | None = None  # [layers, 2, tokens * kv_heads * head_dim]

    def fits(self, other_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> bool:
        return (other_layers, kv_heads, head_dim, dtype) == (self.layers, self.kv_heads, self.head_dim, self.dtype)

    def ensure(self, slots: int, capacity: int) -> bool:
        """Make room for a (slots, capacity) bucket; True when that needed a new allocation (old views and
        anything captured over them are then stale). Zeros: masked columns still enter attention with
        weight 0, and 0 * NaN would be NaN."""
        if slots * capacity <= self.tokens:
            return False
        self._flat = None  # the caller has copied out what it keeps; free before allocating
        self._flat = torch.zeros((self.layers, 2, slots * capacity * self.kv_heads * self.head_dim),
                                 dtype=self.dtype, device=self.device)
        self.tokens = slots * capacity
        return True

    def views(self, slots: int, capacity: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """[slots, kv_heads, capacity, head_dim] keys and values of each layer (same data pointers for
        every call with the same allocation)."""
        n = slots * capacity * self.kv_heads * self.head_dim
        shape = (slots, self.kv_heads, capacity, self.head_dim)
        return [(self._flat[i, 0, :n].view(shape), self._flat[i, 1, :n].view(shape)) for i in range(self.layers)]

