"""Log-probs and entropy of response tokens from the final hidden states, a chunk of tokens at a time.

The LM head of a 151,936-token vocabulary turns N response positions into an [N, V] float32 tensor, and
log_softmax, the entropy and their gradients each make more: ~0.6 GB per copy per 1,000 tokens, about
ten copies kept or alive at once when autograd does it. `response_token_stats` runs each chunk of
`chunk_tokens` positions through lm_head -> temperature -> log_softmax -> gather + entropy with no graph,
keeping only the [N] results; the backward recomputes one chunk's logits at a time and writes their
gradient in place (d log p_t / dz = onehot_t - p, dH / dz = -p (log p + H)), so at most about two
[chunk, V] float32 tensors exist at any moment (verl calls the idea entropy checkpointing; Liger's fused
linear cross-entropy is a Triton version of it). Autograd (or `torch.utils.checkpoint` per chunk) would
hold every intermediate of a chunk for its backward, four to five copies: hence this hand-written backward.
The arithmetic per token is that of one big [N, V] pass, so log-probs, entropy, loss and gradients agree
with it to float32 rounding (the products are blocked differently). `chunk_tokens=None` is that one big
autograd pass, kept for the before/after benchmark (bench/train.py) and as an escape hatch.

Under bf16 autocast the head's product runs in bf16 and everything after it in float32, forward and
backward, as autocast does for `head(hidden).float()`. The gradient is written for a plain Linear head
(`h W^T + b`): a head that is anything else, e.g. one wrapped by an adapter, is refused; hooks on it see
every call (the values follow them), but their effect on the gradient is not modelled.
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
    """log_softmax(head(hidden).float() / temperature) of one chunk, under autocast to `dtype` if one was on
    in the forward (the backward runs outside it, so it is re-entered for the recompute). Through the module,
    so hooks on the head see the same call as without chunks."""
    with torch.autocast(hidden.device.type, dtype=dtype, enabled=dtype is not None):
        logits = head(hidden).float()
    if temperature > 0:
        logits.div_(temperature)
    return torch.log_softmax(logits, dim=-1)


class _ChunkedHeadStats(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, hidden: Tensor, weight: Tensor, bias: Tensor | None, targets: Tensor,
                head: torch.nn.Linear, temperature: float, chunk_tokens: int, with_entropy: bool) -> tuple[Tensor, Tensor]:
        device = hidden.device.type
        dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else None
        log_probs, entropy = [], []
        for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True):
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
        ctx.head, ctx.temperature, ctx.chunk_tokens, ctx.dtype = head, temperature, chunk_tokens, dtype
        ctx.set_materialize_grads(False)
        return lp, ent

    @staticmethod
    def backward(ctx: Any, g_lp: Tensor | None, g_ent: Tensor | None) -> tuple[Tensor | None, ...]:
        hidden, weight, bias, targets, ent = ctx.saved_tensors
        none = (None,) * 8
        if g_lp is None and g_ent is None:
            return none
        c, dtype, temperature = ctx.chunk_tokens, ctx.dtype, ctx.temperature
        w = weight.to(dtype) if dtype is not None else weight
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
            g = grad.to(dtype) if dtype is not None else grad
            del grad
            if grad_h is not None:
                grad_h[start:start + c] = (g @ w).to(hidden.dtype)
            if grad_w is not None:
                grad_w.add_((g.t() @ (h.to(dtype) if dtype is not None else h)).float())
            if grad_b is not None:
                grad_b.add_(g.float().sum(0))
            del g
        return (grad_h, None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)


def response_token_stats(hidden: Tensor, targets: Tensor, head: torch.nn.Module, temperature: float,
                         chunk_tokens: int | None, with_entropy: bool = True) -> TokenStats:
    """Log-prob of each target and the entropy of each position's distribution, from `hidden` [N, H] (the
    final hidden states at the positions that predict `targets` [N]) through `head` (the LM head, a
    Linear) at the sampling `temperature` (<= 0: greedy, logits used as they are). `with_entropy=False`
    (the reference model: log-probs only) skips the entropy of the chunked path; its entropy is then NaN."""
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0 or None, got {chunk_tokens} (train.logprob_chunk_tokens)")
    if chunk_tokens is None:
        logits = head(hidden).float()
        log_p = torch.log_softmax(logits / temperature if temperature > 0 else logits, dim=-1)
        return TokenStats(log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy_from_log_probs(log_p))
    if not isinstance(head, torch.nn.Linear):
        raise TypeError(f"the chunked log-prob path needs a Linear LM head, got {type(head).__name__}; set "
                        f"train.logprob_chunk_tokens to null for this model")
    return TokenStats(*_ChunkedHeadStats.apply(hidden, head.weight, head.bias, targets, head, temperature, chunk_tokens,
                                               with_entropy))
