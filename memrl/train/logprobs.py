"""Log-probs and entropy of response tokens from the final hidden states, a chunk of tokens at a time.

A 151,936-token LM head makes N response positions an [N, V] float32 tensor (~0.6 GB per 1,000 tokens),
and autograd keeps about ten such copies alive. `response_token_stats` runs each chunk of `head_chunk`
positions through lm_head -> temperature -> log_softmax -> gather + entropy with no graph, keeping only
the [N] results; the backward recomputes one chunk's logits at a time and writes their gradient in place
(d log p_t / dz = onehot_t - p, dH / dz = -p (log p + H)): at most about two [chunk, V] tensors at once
(verl's entropy checkpointing; `torch.utils.checkpoint` per chunk would still hold four to five). The
arithmetic per token is that of one [N, V] pass, so results agree with it to float32 rounding;
`head_chunk=None` is that pass (bench/train.py's before). Under bf16 autocast the head's product runs
in bf16, the rest in float32. Only a plain Linear head is accepted (the gradient is written for `h W^T + b`).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
from torch import Tensor

from memrl.rl.loss import entropy_from_log_probs


class TokenStats(NamedTuple):
    """Per response token, float32, with the graph back to the hidden states and the LM head: [N] each."""

    log_probs: Tensor
    entropy: Tensor


def _log_softmax(head: torch.nn.Module, hidden: Tensor, temperature: float, dtype: torch.dtype | None) -> Tensor:
    """log_softmax(head(hidden).float() / temperature) of one chunk, under the forward's autocast `dtype`
    (re-entered for the backward's recompute); through the module, so hooks on the head see each call."""
    with torch.autocast(hidden.device.type, dtype=dtype, enabled=dtype is not None):
        logits = head(hidden).float()
    if temperature > 0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1)


class _ChunkedHeadStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                head: torch.nn.Linear, temperature: float, head_chunk: int,
                with_entropy: bool) -> tuple[Tensor, Tensor]:
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        log_probs, entropy = [], []
        for h, t in zip(hidden.split(head_chunk), targets.split(head_chunk), strict=True):
            log_p = _log_softmax(head, h, temperature, dtype)
            log_probs.append(log_p.gather(-1, t.unsqueeze(-1)).squeeze(-1))
            if with_entropy:
                entropy.append(entropy_from_log_probs(log_p, inplace=True))
            del log_p
        lp = torch.cat(log_probs)
        ent = torch.cat(entropy) if with_entropy else torch.full_like(lp, torch.nan)
        if not with_entropy:
            ctx.mark_non_differentiable(ent)
        ctx.save_for_backward(hidden, weight, bias, targets, ent)
        ctx.head, ctx.temperature, ctx.head_chunk, ctx.dtype = head, temperature, head_chunk, dtype
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, ent = ctx.saved_tensors
        if g_lp is None and g_ent is None:
            return (None,) * 8
        c, dtype, temperature = ctx.head_chunk, ctx.dtype, ctx.temperature
        w = weight.to(dtype)  # dtype None (no autocast): `.to(None)` is the tensor itself
        grad_h = torch.empty_like(hidden) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight, dtype=torch.float32) if ctx.needs_input_grad[1] else None
        grad_b = torch.zeros_like(bias, dtype=torch.float32) if bias is not None and ctx.needs_input_grad[2] else None
        low = torch.finfo(torch.float32).min
        for start in range(0, hidden.shape[0], c):
            h, t = hidden[start:start + c], targets[start:start + c]
            log_p = _log_softmax(ctx.head, h, temperature, dtype)
            p = log_p.exp()
            if g_ent is not None:  # dH/dz = -p (log p + H), log p clamped as in the forward
                grad = log_p.clamp_(min=low).add_(ent[start:start + c, None]).mul_(p).mul_(
                    -g_ent[start:start + c, None])
                del log_p
                if g_lp is not None:
                    grad.addcmul_(p, -g_lp[start:start + c, None])
                del p
            else:
                del log_p
                grad = p.mul_(-g_lp[start:start + c, None])
            if g_lp is not None:  # d log p_t / dz = onehot_t - p
                grad.scatter_add_(1, t.unsqueeze(-1), g_lp[start:start + c, None])
            if temperature > 0:
                grad.div_(temperature)
            g = grad.to(dtype)
            del grad
            if grad_h is not None:
                grad_h[start:start + c] = (g @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w.add_((g.t() @ h.to(dtype)).float())
            if grad_b is not None:
                grad_b.add_(g.float().sum(0))
            del g
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)


def response_token_stats(hidden: Tensor, targets: Tensor, head: torch.nn.Module, temperature: float,
                         head_chunk: int | None, with_entropy: bool = True) -> TokenStats:
    """Log-prob of each target [N] and each position's entropy, from the final hidden states `hidden` [N, H]
    that predict them, at the sampling `temperature` (<= 0: logits as they are). `with_entropy=False` (the
    reference model) skips the chunked path's entropy, which is then NaN."""
    if head_chunk is not None and head_chunk <= 0:
        raise ValueError(f"head_chunk must be > 0 or None, got {head_chunk} (train.logprob_chunk_tokens)")
    if head_chunk is None:
        logits = head(hidden).float()
        log_p = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        return TokenStats(log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy_from_log_probs(log_p))
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the chunked log-prob path needs a Linear LM head, got {type(head).__name__}; set "
                        f"train.logprob_chunk_tokens to null for this model")
    return TokenStats(*_ChunkedHeadStats.apply(hidden, head.weight, head.bias, targets, head, temperature, head_chunk,
                                               with_entropy))
