"""Padding-free (packed) micro-batches: attention that keeps each packed row to itself, without an L x L mask.

A packed micro-batch is one [1, T] sequence of whole rows, position ids restarting at each row; attention
must be causal *within* each row. Besides FlashAttention (flash-attn installed), transformers does that
for sdpa with a dense [T x T] mask: T^2 work for sum(len^2) useful (16x more at 16 rows of 1,000).
`enable(model)` therefore switches a model not on FlashAttention to `memrl_packed`, registered here: given
the row boundaries (`cu_seq_lens`, FlashAttention's argument names) it runs torch's varlen flash kernel
(CUDA, bf16/fp16), else one causal sdpa call per row; calls without boundaries go to sdpa unchanged. Given
a `shared_layout` instead (`train.share_prefixes`), it attends as memrl.train.shared_prefix lays rows out.
"""

from __future__ import annotations

import functools
import inspect
import logging
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor
from transformers import AttentionInterface, AttentionMaskInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import sdpa_mask

from memrl.errors import MemrlError
from memrl.train import shared_prefix

try:
    from torch.nn.attention.varlen import varlen_attn
except ImportError:  # older torch: per-row sdpa
    varlen_attn = None

log = logging.getLogger(__name__)

PACKED_ATTENTION = "memrl_packed"
_VARLEN_DTYPES = (torch.bfloat16, torch.float16)


class PackingError(ValueError, MemrlError):
    """A model or batch that packed micro-batches cannot serve; the message says what to change."""


def packed_attention(module: torch.nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None,
                     dropout: float = 0.0, scaling: float | None = None, cu_seq_lens_q: Tensor | None = None,
                     max_length_q: int | None = None, shared_layout: shared_prefix.Layout | None = None,
                     **kwargs: Any) -> tuple[Tensor, None]:
    """transformers' attention signature: query [1, H, T, D], key/value [1, H_kv, T, D] -> [1, T, H, D]."""
    if cu_seq_lens_q is None and shared_layout is None:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
                                      **kwargs)
    if _slides(module) or kwargs.get("sliding_window"):  # per layer, or passed by the model (Mistral)
        raise PackingError("train.packing and train.share_prefixes do not support sliding-window attention layers; "
                           "set both to false for this model")
    if query.shape[0] != 1:
        raise PackingError(f"a packed batch is one sequence, got a batch of {query.shape[0]}")
    if shared_layout is not None:
        gqa = key.shape[1] != query.shape[1]
        return shared_prefix.attention(query, key, value, shared_layout, scaling, gqa), None
    # Under autocast the rotary product leaves q and k in float32; sdpa would cast them itself, varlen does not.
    dtype = torch.get_autocast_dtype("cuda") if query.is_cuda and torch.is_autocast_enabled("cuda") else query.dtype
    gqa = key.shape[1] != query.shape[1]
    if varlen_attn is not None and query.is_cuda and dtype in _VARLEN_DTYPES:
        q, k, v = (x[0].transpose(0, 1).to(dtype) for x in (query, key, value))  # [T, heads, D]
        out = causal_varlen(varlen_attn, q, k, v, cu_seq_lens_q, max_length_q, scaling)
        if out is not None:
            return out.unsqueeze(0), None
    # One causal sdpa call per row; the lengths come from the host (`packed_kwargs`), so no device sync.
    bounds = kwargs.get("packed_lengths") or torch.diff(cu_seq_lens_q).tolist()
    rows = zip(*(x.split(bounds, dim=2) for x in (query, key, value)), strict=True)
    outs = [F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scaling, enable_gqa=gqa)
            for q, k, v in rows]
    return torch.cat(outs, dim=2).transpose(1, 2).contiguous(), None


def causal_varlen(kernel, q: Tensor, k: Tensor, v: Tensor, cu_seq_lens: Tensor, max_length: int,
                  scale: float | None) -> Tensor | None:
    """Causal attention within packed rows through torch's `varlen_attn` ([T, heads, D] in and out), with the
    keywords the installed torch has: `scale` and causality as `window_size=(-1, 0)` from torch 2.10 (2.9 has
    `is_causal` and no `scale`: None, the caller's per-row sdpa then runs); `enable_gqa` only from 2.12, so
    2.10 and 2.11 (the GPU machine's) get the kv heads repeated instead."""
    accepted = _keywords(kernel)
    if "scale" not in accepted or "window_size" not in accepted:
        return None
    kwargs: dict[str, Any] = {"scale": scale, "window_size": (-1, 0)}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in accepted:
            kwargs["enable_gqa"] = True
        else:
            k, v = (x.repeat_interleave(q.shape[1] // k.shape[1], dim=1) for x in (k, v))
    return kernel(q, k, v, cu_seq_lens, cu_seq_lens, max_length, max_length, **kwargs)


@functools.cache
def _keywords(kernel) -> frozenset[str]:
    """The parameter names of `kernel`, read once: `causal_varlen` runs at every layer of every forward."""
    return frozenset(inspect.signature(kernel).parameters)


AttentionInterface.register(PACKED_ATTENTION, packed_attention)
AttentionMaskInterface.register(PACKED_ATTENTION, sdpa_mask)  # unpacked calls get sdpa's masks


def enable(model: torch.nn.Module) -> str:
    """Make `model` attend within packed rows without a dense mask; returns the implementation it now uses."""
    config = model.config
    current = config._attn_implementation
    if current is not None and current.startswith("flash_attention"):
        return current  # FlashAttention's varlen path takes the same cu_seq_lens arguments
    config._attn_implementation = PACKED_ATTENTION
    log.info("train.packing: attention %s -> %s (variable-length attention per packed row)", current,
             PACKED_ATTENTION)
    return PACKED_ATTENTION


def check_enabled(model: torch.nn.Module, shared: bool = False) -> None:
    """A packed forward through plain sdpa would attend across rows, a `shared` one through FlashAttention too
    (it knows no shared prefixes): refuse them."""
    current = model.config._attn_implementation
    if current != PACKED_ATTENTION and (shared or not (current or "").startswith("flash_attention")):
        raise PackingError(f"a {'shared-prefix' if shared else 'packed'} micro-batch needs "
                           f"memrl.train.packing.enable(model) first (attention {current!r} would attend across "
                           f"the packed rows)")


def can_share_prefixes(model: torch.nn.Module) -> str | None:
    """Why `model` cannot run shared-prefix micro-batches (train.share_prefixes), None when it can: they
    need this module's attention on every layer."""
    config = model.config
    if (config._attn_implementation or "").startswith("flash_attention"):
        return f"attention {config._attn_implementation} knows no shared prefixes"
    if any(map(_slides, model.modules())) or "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        return "sliding-window attention layers"
    return None


def _slides(module: torch.nn.Module) -> bool:
    """An attention layer with a window (transformers sets `sliding_window` on such layers only: a Qwen3
    config's `sliding_window` with `use_sliding_window` off leaves its layers at None)."""
    return bool(getattr(module, "sliding_window", None))


def _no_mask(model: torch.nn.Module) -> Any:
    """An attention mask transformers takes as prepared and builds nothing from (no dense [T x T] mask): for
    this module's attention a 4-D placeholder, which every model passes through as it is (a model such as
    Llama takes no {layer type: mask} mapping) and `packed_attention` never reads; for FlashAttention the
    mapping of None (a tensor there would be taken for a padding mask)."""
    if model.config._attn_implementation == PACKED_ATTENTION:
        return torch.ones(1, 1, 1, 1, dtype=torch.bool, device=model.device)
    return {"full_attention": None, "sliding_attention": None}


def packed_kwargs(model: torch.nn.Module, row_lengths: list[int], cu_seq_lens: Tensor) -> dict[str, Any]:
    """A packed forward's kwargs: the row boundaries every attention layer gets (FlashAttention's names) and a
    prepared mask (`_no_mask`)."""
    longest = max(row_lengths)
    return {"attention_mask": _no_mask(model), "cu_seq_lens_q": cu_seq_lens, "cu_seq_lens_k": cu_seq_lens,
            "max_length_q": longest, "max_length_k": longest, "packed_lengths": row_lengths}


def shared_kwargs(model: torch.nn.Module, layout: shared_prefix.Layout) -> dict[str, Any]:
    """A shared-prefix forward's kwargs: the layout every attention layer gets and a prepared mask."""
    return {"attention_mask": _no_mask(model), "shared_layout": layout}
