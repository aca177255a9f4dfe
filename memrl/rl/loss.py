"""Policy-gradient loss pieces over padded response tokens: PPO clip, GSPO, KL penalty, entropy, aggregation.

Per-token functions take 2-D `[batch, seq]` tensors aligned with a loss `mask` (bool or float weights,
0 = ignored). Padding rows (all-zero mask) add nothing; an all-zero batch gives exactly 0 with a graph.
The `AGG_MODES` and their formulas (verl, Dr. GRPO, TRL) are in docs/algorithms.md.

Micro-batching: a step's loss must not depend on how its rows are cut. `compute_token_weights` gives each
row a weight w_r once for the whole optimizer step, and `weighted_token_sum` (sum_r w_r sum_t m l) summed
over any partition of the rows equals `aggregate` of the full step. With data parallelism gradients are
then SUMMED across ranks (DDP averages: scale the local loss by the world size).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal, get_args

import torch
from torch import Tensor

from memrl.errors import MemrlError

AggMode = Literal["token_mean", "seq_mean_token_mean", "trajectory_mean", "seq_mean_token_sum",
                  "seq_mean_token_sum_norm"]
AGG_MODES: tuple[str, ...] = get_args(AggMode)

# exp() of an unbounded log-ratio lets one bad token reach inf and turn the whole step into NaN; verl
# clamps the token log-ratio at the same bound. Gradients are zero past it, which only touches tokens
# whose ratio is e^20 -- tokens the PPO clip has already cut off anyway.
LOG_RATIO_BOUND = 20.0
# GSPO's trajectory log-ratio is clamped above only, at verl's bound (compute_policy_loss_gspo): past it
# the ratio stays e^10 and the token gets no gradient, so one runaway trajectory cannot outweigh the step.
_GSPO_LOG_RATIO_MAX = 10.0


class LossError(ValueError, MemrlError):
    """A loss argument that cannot be used; the message says which and what to change."""


def _check_mode(mode: str, loss_scale_factor: float | None = None) -> float:
    """Validate `mode`; return the constant each row's token sum is divided by (1 except for the norm mode)."""
    if mode not in AGG_MODES:
        raise LossError(f"unknown aggregation mode '{mode}'; use one of {', '.join(AGG_MODES)} (algorithm.loss_agg)")
    if mode != "seq_mean_token_sum_norm":
        return 1.0
    if loss_scale_factor is None or not float(loss_scale_factor) > 0:
        raise LossError(f"seq_mean_token_sum_norm needs loss_scale_factor > 0 (the fixed normaliser L, e.g. the "
                        f"response-token limit; algorithm.loss_scale_factor), got {loss_scale_factor!r}")
    return float(loss_scale_factor)


def _check_shapes(mask: Tensor, **tensors: Tensor) -> None:
    if mask.dim() != 2:
        raise LossError(f"mask must be 2-D [batch, seq], got shape {tuple(mask.shape)}")
    for name, t in tensors.items():
        if t.shape != mask.shape:
            raise LossError(f"{name} has shape {tuple(t.shape)} but mask has {tuple(mask.shape)}; they must match")


def _masked(values: Tensor, mask: Tensor) -> Tensor:
    """values * mask, masked-out positions exactly 0: `where`, since padding may hold inf or NaN (log-probs
    of pad tokens) and NaN * 0 is NaN."""
    m = mask.to(values.dtype)
    return torch.where(m != 0, values * m, torch.zeros_like(values))


def aggregate(values: Tensor, mask: Tensor, mode: AggMode = "token_mean", group_index: Tensor | None = None,
              loss_scale_factor: float | None = None) -> Tensor:
    """Reduce per-token `values` to a scalar under `mask` in `mode`, the batch taken as a whole step: the
    weights of `compute_token_weights` applied by `weighted_token_sum`, so one rule serves both.
    `group_index` ([batch] ids) names each row's trajectory (trajectory_mean)."""
    _check_shapes(mask, values=values)
    if mode == "trajectory_mean" and group_index is None:
        raise LossError("trajectory_mean needs group_index: a [batch] tensor of trajectory indices")
    if group_index is not None and group_index.shape != (mask.shape[0],):
        raise LossError(f"group_index must have shape ({mask.shape[0]},), got {tuple(group_index.shape)}")
    ids = None if group_index is None else group_index.tolist()
    weights = compute_token_weights(mask.to(torch.float64).sum(-1).tolist(), ids, mode, loss_scale_factor)
    return weighted_token_sum(values, mask, torch.tensor(weights, dtype=torch.float64, device=values.device))


def compute_token_weights(response_lengths_masked: Sequence[float], trajectory_ids: Sequence[Hashable] | None,
                          mode: AggMode = "token_mean", loss_scale_factor: float | None = None,
                          counted: Sequence[bool] | None = None) -> list[float]:
    """Per-row weights w_r of a whole optimizer step, from each row's masked token count n_r (0 for padding
    rows: w_r = 0), so that `sum_r w_r * sum_t mask * loss` is `aggregate` of the full step in `mode`:
    1/N (token_mean), 1/(n_r R) (seq_mean_token_mean), 1/(T_traj n_traj) (trajectory_mean), 1/R and
    1/(R L) (the token-sum modes), N, R, T over the whole step; never over a micro-batch. R and n_traj
    count the rows `counted` marks and those with tokens: the trainer marks every real row, so a fully
    masked one (mask_truncated_completions) still counts, as in verl's training path (its global batch
    size); unset, only rows with tokens count (verl's `agg_loss` called alone; `aggregate`)."""
    scale = _check_mode(mode, loss_scale_factor)
    n = [float(x) for x in response_lengths_masked]
    if any(x < 0 for x in n):
        raise LossError("masked response lengths must be >= 0")
    if counted is not None and len(counted) != len(n):
        raise LossError(f"counted must have one entry per row ({len(n)}), got {len(counted)}")
    counts = [x > 0 or (counted is not None and bool(counted[i])) for i, x in enumerate(n)]
    if mode == "token_mean":
        total = sum(n)
        return [1.0 / total if x > 0 else 0.0 for x in n]
    rows = sum(counts)
    if mode == "seq_mean_token_mean":
        return [1.0 / (x * rows) if x > 0 else 0.0 for x in n]
    if mode in ("seq_mean_token_sum", "seq_mean_token_sum_norm"):
        return [1.0 / (rows * scale) if x > 0 else 0.0 for x in n]
    if trajectory_ids is None or len(trajectory_ids) != len(n):
        raise LossError("trajectory_mean needs one trajectory id per row (trajectory_ids)")
    traj_tokens: dict[Hashable, float] = {}
    for x, t in zip(n, trajectory_ids, strict=True):
        traj_tokens[t] = traj_tokens.get(t, 0.0) + x
    n_traj = len({t for t, c in zip(trajectory_ids, counts, strict=True) if c})
    return [1.0 / (traj_tokens[t] * n_traj) if x > 0 else 0.0 for x, t in zip(n, trajectory_ids, strict=True)]


def weighted_token_sum(values: Tensor, mask: Tensor, row_weights: Tensor) -> Tensor:
    """sum_r row_weights[r] * sum_t mask[r, t] * values[r, t]: a micro-batch's exact share of the step loss."""
    _check_shapes(mask, values=values)
    if row_weights.shape != (mask.shape[0],):
        raise LossError(f"row_weights must have shape ({mask.shape[0]},), got {tuple(row_weights.shape)}")
    masked = _masked(values, mask)
    return (masked.sum(-1) * row_weights.to(masked)).sum()


def policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg: AggMode = "token_mean", group_index: Tensor | None = None, *,
                row_weights: Tensor | None = None, importance_weights: Tensor | None = None,
                sequence_log_ratio: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip policy-gradient loss (to minimize) and detached metrics.

    Per token max(-A r, -A clip(r, 1 - clip_low, 1 + clip_high)), r = exp(logp - old); with `dual_clip`
    c > 1 tokens with A < 0 are capped at -A c. `advantages` is [batch, seq] or [batch] (broadcast);
    `importance_weights` (detached) multiply the per-token loss; `sequence_log_ratio` ([batch]) switches
    to GSPO's trajectory-level ratio (`gspo_log_ratio`). Reduced by `row_weights` (exact micro-batching)
    if given, else `aggregate(agg, group_index)` (every mode but seq_mean_token_sum_norm, whose L comes in
    with the row weights: `compute_token_weights`).
    """
    if advantages.dim() == 1:
        advantages = advantages.unsqueeze(-1).expand_as(mask)
    _check_shapes(mask, log_probs=log_probs, old_log_probs=old_log_probs, advantages=advantages)
    if clip_low < 0 or clip_high < 0:
        raise LossError(f"clip_low and clip_high must be >= 0, got {clip_low}, {clip_high}")
    if dual_clip is not None and dual_clip <= 1.0:
        raise LossError(f"dual_clip must be > 1 (algorithm.dual_clip), got {dual_clip}")

    advantages = advantages.to(log_probs.dtype)
    if sequence_log_ratio is not None:
        log_ratio = gspo_log_ratio(log_probs, sequence_log_ratio)
    else:
        log_ratio = (log_probs - old_log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
    ratio = torch.exp(log_ratio)
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    loss = torch.maximum(unclipped, clipped)
    dual_active = torch.zeros_like(loss, dtype=torch.bool)
    if dual_clip is not None:
        cap = -advantages * dual_clip
        dual_active = (advantages < 0) & (loss > cap)
        loss = torch.where(dual_active, cap, loss)
    if importance_weights is not None:
        _check_shapes(mask, importance_weights=importance_weights)
        loss = loss * importance_weights.detach().to(loss.dtype)

    if row_weights is not None:
        reduced = weighted_token_sum(loss, mask, row_weights)
    else:
        reduced = aggregate(loss, mask, agg, group_index)
    return reduced, _ppo_metrics(mask, log_ratio, ratio, clipped > unclipped, dual_active)


@torch.no_grad()
def _ppo_metrics(mask: Tensor, log_ratio: Tensor, ratio: Tensor, clip_active: Tensor,
                 dual_active: Tensor) -> dict[str, Tensor]:
    """Token means over the mask (0-dim tensors, so no device sync is forced): clip_fraction,
    dual_clip_fraction, approx_kl (k3 estimate of KL(old || current)), ratio_mean, ratio_max, and tokens
    (the mask sum, to weight metrics across micro-batches)."""
    tokens = mask.to(ratio.dtype).sum()

    def token_mean(x: Tensor) -> Tensor:
        # 0 / 1 for an all-zero mask (its masked sum is 0); a float mask may weigh less than 1 in all
        return _masked(x.to(ratio.dtype), mask).sum() / torch.where(tokens > 0, tokens, torch.ones_like(tokens))

    valid = mask != 0
    top = torch.where(valid, ratio, torch.zeros_like(ratio)).max() if ratio.numel() else ratio.new_zeros(())
    return {
        "clip_fraction": token_mean(clip_active),
        "dual_clip_fraction": token_mean(dual_active),
        "approx_kl": token_mean(torch.expm1(log_ratio) - log_ratio),
        "ratio_mean": token_mean(ratio),
        "ratio_max": top,
        "tokens": tokens,
    }


def gspo_log_ratio(log_probs: Tensor, sequence_log_ratio: Tensor) -> Tensor:
    """GSPO's per-token log-ratio over the whole trajectory: sg[log s_i] + logp_t - sg[logp_t], the value of
    log s_i (`sequence_log_ratio`, [batch] or [batch, seq], from a no-grad pass over the step) with the gradient
    of logp_t, so exact whatever the micro-batching (docs/algorithms.md). Clamped above only, as verl."""
    seq = sequence_log_ratio.detach().to(log_probs.dtype)
    if seq.dim() == 1:
        seq = seq.unsqueeze(-1).expand_as(log_probs)
    return (seq + log_probs - log_probs.detach()).clamp(max=_GSPO_LOG_RATIO_MAX)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: Literal["k1", "k3"] = "k3") -> Tensor:
    """Per-token estimate of KL(current || reference) (Schulman): k1 = logp - ref (can be negative), k3 =
    exp(ref - logp) - (ref - logp) - 1 (always >= 0)."""
    if log_probs.shape != ref_log_probs.shape:
        raise LossError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} must match")
    if estimator == "k1":
        return log_probs - ref_log_probs
    if estimator == "k3":
        diff = (ref_log_probs - log_probs).clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND)
        return torch.expm1(diff) - diff  # expm1: exact near 0, where exp(d) - 1 loses digits
    raise LossError(f"unknown KL estimator '{estimator}'; use 'k1' or 'k3' (algorithm.kl_estimator)")


def entropy_from_log_probs(log_p: Tensor, inplace: bool = False) -> Tensor:
    """Entropy -sum(p * log p) over the last dim of log_softmax output. `inplace` (no autograd; `log_p`
    is overwritten) holds two [positions, vocab] tensors instead of four."""
    # The clamp keeps -inf logits (masked vocabulary) from making 0 * -inf = NaN, forward and backward.
    low = torch.finfo(log_p.dtype).min
    log_p = log_p.clamp_(min=low) if inplace else log_p.clamp(min=low)
    p = log_p.exp()
    return -(p.mul_(log_p) if inplace else p * log_p).sum(-1)
