"""How HFEngine turns logits into tokens: pure, batched, row-independent tensor functions (no state, no
model), so tests and trainers recompute the exact log-probs the engine reported.

T > 0: softmax(logits / T), restricted when top_p < 1 to the smallest most-likely set whose mass reaches
top_p and renormalized; the token is drawn from it, its log-prob is under exactly that distribution.
T == 0 is greedy (argmax), its log-prob that of the raw T = 1 distribution (top_p ignored: argmax is always
kept). The uniforms come from the caller (one seeded CPU generator per request), so a row's token never
depends on its batch mates.
"""

from __future__ import annotations

import torch


def sampling_log_probs(logits: torch.Tensor, temperatures: torch.Tensor, top_ps: torch.Tensor, *,
                       any_nucleus: bool | None = None) -> torch.Tensor:
    """Log-probs (N, V), in float32, of the distributions each row samples from (the module's rules).
    `any_nucleus`: whether some row has T > 0 and top_p < 1, when the caller knows it (asking the device
    would sync with it)."""
    logits = logits.float()
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures).to(logits)
    log_probs = torch.log_softmax(logits / scale[:, None], dim=-1)
    nucleus = (~greedy) & (top_ps < 1.0)
    if any_nucleus if any_nucleus is not None else bool(nucleus.any()):
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
