"""Log-probs and entropy of response tokens from the final hidden states, a chunk of tokens at a time.

The LM head of a 151,936-token vocabulary turns N response positions into an [N, V] float32 tensor, and
log_softmax, its gradient and the entropy each make another one: ~0.6 GB per copy per 1,000 tokens. Here
each chunk of `chunk_tokens` positions goes through lm_head -> temperature -> log_softmax -> gather and
entropy on its own, under `torch.utils.checkpoint`, so the forward keeps only the chunk's hidden states
and its [chunk] results, and the backward recomputes one chunk's logits at a time (verl calls this
entropy checkpointing; Liger's fused linear cross-entropy is the kernel version of the same idea). The
arithmetic per token is the same as one big [N, V] pass, so log-probs, entropy, loss and gradients agree
with it to float32 rounding (the matrix products may be blocked differently). `chunk_tokens=None` is that
one big pass, kept for the before/after benchmark (bench/train.py) and as an escape hatch.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from memrl.rl.loss import entropy_from_log_probs


class TokenStats(NamedTuple):
    """Per response token, float32, with the graph back to the hidden states and the LM head: [N] each."""

    log_probs: Tensor
    entropy: Tensor


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _chunk_stats(hidden: Tensor, targets: Tensor, head: torch.nn.Module, temperature: float) -> tuple[Tensor, Tensor]:
    logits = head(hidden).float()
    if temperature > 0:
        logits = logits / temperature
    log_p = torch.log_softmax(logits, dim=-1)
    return log_p.gather(-1, targets.unsqueeze(-1)).squeeze(-1), entropy_from_log_probs(log_p)


def response_token_stats(hidden: Tensor, targets: Tensor, head: torch.nn.Module, temperature: float,
                         chunk_tokens: int | None) -> TokenStats:
    """Log-prob of each target and the entropy of each position's distribution, from `hidden` [N, H] (the
    final hidden states at the positions that predict `targets` [N]) through `head` (the LM head) at the
    sampling `temperature` (<= 0: greedy, logits used as they are)."""
    if chunk_tokens is not None and chunk_tokens <= 0:
        raise ValueError(f"chunk_tokens must be > 0 or None, got {chunk_tokens} (train.logprob_chunk_tokens)")
    if chunk_tokens is None:
        return TokenStats(*_chunk_stats(hidden, targets, head, temperature))
    # Under no_grad (old log-probs, the reference) there is nothing to recompute: plain chunks.
    run = (lambda h, t: checkpoint(_chunk_stats, h, t, head, temperature, use_reentrant=False)) \
        if torch.is_grad_enabled() else (lambda h, t: _chunk_stats(h, t, head, temperature))
    parts = [run(h, t) for h, t in zip(hidden.split(chunk_tokens), targets.split(chunk_tokens), strict=True)]
    return TokenStats(torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts]))
