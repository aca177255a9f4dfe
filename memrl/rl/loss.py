"""Policy-gradient loss pieces over padded response tokens: PPO clip, KL penalty, entropy, aggregation.

Every per-token function works on 2-D tensors `[batch, seq]` aligned with a loss `mask` of the same
shape (bool or float; a float mask acts as per-token weights, 0 = ignored). Padding rows have an
all-zero mask and contribute nothing to any numerator or denominator; an all-zero batch gives a loss of
exactly 0 that still has a graph (no NaN, `backward()` works).

Aggregation modes (`mode`):
- `token_mean`: sum over all masked tokens / number of masked tokens.
- `seq_mean_token_mean`: each row's token mean, then the mean over rows with at least one masked token.
- `trajectory_mean`: the token mean within each trajectory (all rows with the same `group_index`),
  then the mean over trajectories. Every trajectory counts once whatever its number of turns.
- `seq_mean_token_sum`: each row's token *sum*, then the mean over rows with at least one masked token
  (verl `loss_agg_mode=seq-mean-token-sum`): (1/R) sum_r sum_t m[r,t] l[r,t].
- `seq_mean_token_sum_norm`: Dr. GRPO's fixed normaliser: (1/(R L)) sum_r sum_t m[r,t] l[r,t] with
  L = `loss_scale_factor`, a constant (the response-token limit), so neither a row's length nor the
  batch's longest row changes a token's weight. This is verl's `seq-mean-token-sum-norm` since v0.7.1
  (agg_loss: the token sums over the step's non-empty sequences, then / loss_scale_factor) and TRL's
  `loss_type=dr_grpo`; verl up to v0.7.0 divided one micro-batch's token sum by L only (docs/algorithms.md).

Micro-batching. A step's loss must not depend on how its rows are cut into micro-batches. The exact
way is a per-row weight computed once for the whole optimizer step:

    step_loss = sum_r w_r * sum_t mask[r, t] * loss[r, t]          (`weighted_token_sum`)

with `compute_token_weights` giving, for masked token counts n_r:
- token_mean:          w_r = 1 / N                     (N = masked tokens of the whole step)
- seq_mean_token_mean: w_r = 1 / (n_r * R)             (R = rows with n_r > 0 in the step)
- trajectory_mean:     w_r = 1 / (T(traj_r) * n_traj)  (T = masked tokens of the row's trajectory in
                                                        the whole step, n_traj = trajectories with T > 0)
- seq_mean_token_sum:  w_r = 1 / R
- seq_mean_token_sum_norm: w_r = 1 / (R * L)           (L = loss_scale_factor)
- padding rows (n_r = 0): w_r = 0.
Summing `weighted_token_sum` over any partition of the rows gives exactly `aggregate` of the full batch.
With data parallelism each rank sums its own rows; gradients must then be SUMMED across ranks (DDP
averages, so multiply the local loss by the world size).

`aggregate(..., normalizer=g)` is the simpler alternative: the local denominator is replaced by the
step-wide one from `global_normalizer`, so micro-batch losses add up to the step loss exactly for
token_mean and seq_mean_token_mean, and for trajectory_mean only when no trajectory's rows are split
across micro-batches (its inner token mean is local).
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from typing import Literal

import torch
from torch import Tensor

from memrl.errors import MemrlError

AggMode = Literal["token_mean", "seq_mean_token_mean", "trajectory_mean", "seq_mean_token_sum",
                  "seq_mean_token_sum_norm"]
AGG_MODES: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "trajectory_mean", "seq_mean_token_sum",
                              "seq_mean_token_sum_norm")

# exp() of an unbounded log-ratio lets one bad token reach inf and turn the whole step into NaN; verl
# clamps the token log-ratio at the same bound. Gradients are zero past it, which only touches tokens
# whose ratio is e^20 -- tokens the PPO clip has already cut off anyway.
_LOG_RATIO_BOUND = 20.0
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


def _masked(values: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """(values * mask with masked-out positions forced to exactly 0, mask as a float tensor).

    `where` rather than a product alone: padding positions may hold inf or NaN (e.g. log-probs of pad
    tokens), and NaN * 0 is NaN.
    """
    m = mask.to(values.dtype)
    return torch.where(m != 0, values * m, torch.zeros_like(values)), m


def _safe_div(num: Tensor, den: Tensor) -> Tensor:
    """num / den where den > 0, else 0 (num is 0 there by construction); keeps the graph."""
    ok = den > 0
    return torch.where(ok, num / torch.where(ok, den, torch.ones_like(den)), torch.zeros_like(num))


def aggregate(values: Tensor, mask: Tensor, mode: AggMode = "token_mean", group_index: Tensor | None = None,
              normalizer: float | Tensor | None = None, loss_scale_factor: float | None = None) -> Tensor:
    """Reduce per-token `values` [batch, seq] to a scalar under `mask` (see module docstring for modes).

    `group_index` ([batch] integers, any values) names each row's trajectory; needed for trajectory_mean.
    `normalizer`, if given, replaces the final local denominator (masked tokens, non-empty rows (times L
    for seq_mean_token_sum_norm), or trajectories) with a step-wide one from `global_normalizer`; 0 is
    allowed and yields 0. `loss_scale_factor` is L of seq_mean_token_sum_norm.
    """
    scale = _check_mode(mode, loss_scale_factor)
    _check_shapes(mask, values=values)
    masked, m = _masked(values, mask)
    if normalizer is not None and float(normalizer) < 0:
        raise LossError(f"normalizer must be >= 0, got {float(normalizer)}")

    if mode == "token_mean":
        total, count = masked.sum(), m.sum()
    else:
        row_sum, row_tokens = masked.sum(-1), m.sum(-1)
        if mode == "seq_mean_token_mean":
            total, count = _safe_div(row_sum, row_tokens).sum(), (row_tokens > 0).sum()
        elif mode in ("seq_mean_token_sum", "seq_mean_token_sum_norm"):
            total, count = row_sum.sum(), (row_tokens > 0).sum() * scale
        else:
            if group_index is None:
                raise LossError("trajectory_mean needs group_index: a [batch] tensor of trajectory indices")
            if group_index.shape != (mask.shape[0],):
                raise LossError(f"group_index must have shape ({mask.shape[0]},), got {tuple(group_index.shape)}")
            # Compact arbitrary ids (e.g. global trajectory numbers) to 0..G-1 before summing per trajectory.
            _, inverse = torch.unique(group_index.to(row_sum.device), return_inverse=True)
            n_groups = int(inverse.max()) + 1 if inverse.numel() else 0
            traj_sum = row_sum.new_zeros(n_groups).index_add(0, inverse, row_sum)
            traj_tokens = row_tokens.new_zeros(n_groups).index_add(0, inverse, row_tokens)
            total, count = _safe_div(traj_sum, traj_tokens).sum(), (traj_tokens > 0).sum()

    den = torch.as_tensor(count if normalizer is None else normalizer, dtype=total.dtype, device=total.device)
    return _safe_div(total, den)


def global_normalizer(masks: Sequence[Tensor], mode: AggMode = "token_mean",
                      group_indices: Sequence[Tensor] | None = None, loss_scale_factor: float | None = None) -> float:
    """The step-wide denominator for `aggregate(..., normalizer=)` over micro-batch `masks`.

    token_mean: total masked tokens (sum of mask weights); seq_mean_token_mean and seq_mean_token_sum:
    rows with any masked token (times L = `loss_scale_factor` for seq_mean_token_sum_norm);
    trajectory_mean: distinct trajectories with any masked token, where `group_indices` must use ids
    that are unique across the whole step (not per micro-batch).
    """
    scale = _check_mode(mode, loss_scale_factor)
    if mode == "token_mean":
        return float(sum(float(m.to(torch.float64).sum()) for m in masks))
    if mode != "trajectory_mean":
        return float(sum(int((m.to(torch.float64).sum(-1) > 0).sum()) for m in masks)) * scale
    if group_indices is None or len(group_indices) != len(masks):
        raise LossError("trajectory_mean needs one group_indices tensor per mask (step-wide trajectory ids)")
    seen: set[int] = set()
    for m, g in zip(masks, group_indices, strict=True):
        nonempty = m.to(torch.float64).sum(-1) > 0
        seen.update(int(i) for i in g[nonempty].tolist())
    return float(len(seen))


def compute_token_weights(response_lengths_masked: Sequence[float], trajectory_ids: Sequence[Hashable] | None,
                          mode: AggMode = "token_mean", loss_scale_factor: float | None = None) -> list[float]:
    """Per-row weights w_r, computed once for a whole optimizer step, such that
    `sum_r w_r * sum_t mask * loss` equals `aggregate` of the full step in `mode`.

    `response_lengths_masked[r]` is the number of masked tokens of row r (its loss-mask sum; 0 for
    padding rows, which get w_r = 0). `trajectory_ids[r]` is row r's trajectory (trajectory_mean only).
    `loss_scale_factor` is L of seq_mean_token_sum_norm. Weights depend only on the step's rows, never
    on how they are cut into micro-batches.
    """
    scale = _check_mode(mode, loss_scale_factor)
    n = [float(x) for x in response_lengths_masked]
    if any(x < 0 for x in n):
        raise LossError("masked response lengths must be >= 0")
    if mode == "token_mean":
        total = sum(n)
        return [1.0 / total if x > 0 else 0.0 for x in n]
    if mode == "seq_mean_token_mean":
        rows = sum(1 for x in n if x > 0)
        return [1.0 / (x * rows) if x > 0 else 0.0 for x in n]
    if mode in ("seq_mean_token_sum", "seq_mean_token_sum_norm"):
        rows = sum(1 for x in n if x > 0)
        return [1.0 / (rows * scale) if x > 0 else 0.0 for x in n]
    if trajectory_ids is None or len(trajectory_ids) != len(n):
        raise LossError("trajectory_mean needs one trajectory id per row (trajectory_ids)")
    traj_tokens: dict[Hashable, float] = {}
    for x, t in zip(n, trajectory_ids, strict=True):
        traj_tokens[t] = traj_tokens.get(t, 0.0) + x
    n_traj = sum(1 for v in traj_tokens.values() if v > 0)
    return [1.0 / (traj_tokens[t] * n_traj) if x > 0 else 0.0 for x, t in zip(n, trajectory_ids, strict=True)]


def weighted_token_sum(values: Tensor, mask: Tensor, row_weights: Tensor) -> Tensor:
    """sum_r row_weights[r] * sum_t mask[r, t] * values[r, t]: a micro-batch's exact share of the step loss."""
    _check_shapes(mask, values=values)
    if row_weights.shape != (mask.shape[0],):
        raise LossError(f"row_weights must have shape ({mask.shape[0]},), got {tuple(row_weights.shape)}")
    masked, _ = _masked(values, mask)
    return (masked.sum(-1) * row_weights.to(masked)).sum()


def _reduce(values: Tensor, mask: Tensor, agg: AggMode, group_index: Tensor | None,
            row_weights: Tensor | None, normalizer: float | Tensor | None, loss_scale_factor: float | None) -> Tensor:
    if row_weights is not None:
        return weighted_token_sum(values, mask, row_weights)
    return aggregate(values, mask, agg, group_index, normalizer, loss_scale_factor)


def policy_loss(log_probs: Tensor, old_log_probs: Tensor, advantages: Tensor, mask: Tensor,
                clip_low: float = 0.2, clip_high: float = 0.2, dual_clip: float | None = None,
                agg: AggMode = "token_mean", group_index: Tensor | None = None, *,
                row_weights: Tensor | None = None, normalizer: float | Tensor | None = None,
                importance_weights: Tensor | None = None,
                loss_scale_factor: float | None = None,
                sequence_log_ratio: Tensor | None = None) -> tuple[Tensor, dict[str, Tensor]]:
    """PPO-clip policy-gradient loss (to minimize) and detached metrics.

    ratio = exp(logp - old_logp); per token: max(-A * ratio, -A * clip(ratio, 1 - clip_low, 1 + clip_high));
    with `dual_clip` c > 1, tokens with A < 0 are further capped at -A * c (bounds the loss of a huge
    ratio on a bad action). `advantages` is [batch, seq] or [batch] (one value per row, broadcast).
    `importance_weights` ([batch, seq], detached, e.g. `truncated_importance_weights`) multiply the
    per-token loss. `sequence_log_ratio` ([batch], detached) switches to GSPO's sequence-level ratio:
    row r belongs to a trajectory whose mean log-ratio over all its response tokens is
    `sequence_log_ratio[r]` (see `gspo_log_ratio`), and every token's ratio takes that value. Reduction: `row_weights` (exact micro-batching, see module docstring) if given,
    else `aggregate(agg, group_index, normalizer, loss_scale_factor)`.

    Metrics (detached 0-dim tensors, token means over the mask so no device sync is forced):
    clip_fraction (tokens where the clip is active), dual_clip_fraction, approx_kl (k3 estimate of
    KL(old || current)), ratio_mean, ratio_max, tokens (mask sum, to weight metrics across micro-batches).
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
        log_ratio = (log_probs - old_log_probs).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
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

    reduced = _reduce(loss, mask, agg, group_index, row_weights, normalizer, loss_scale_factor)

    with torch.no_grad():
        def token_mean(x: Tensor) -> Tensor:
            return aggregate(x.to(loss.dtype), mask, "token_mean")

        valid = mask != 0
        metrics = {
            "clip_fraction": token_mean(clipped > unclipped),
            "dual_clip_fraction": token_mean(dual_active),
            "approx_kl": token_mean(torch.expm1(log_ratio) - log_ratio),
            "ratio_mean": token_mean(ratio),
            "ratio_max": torch.where(valid, ratio, torch.zeros_like(ratio)).max() if ratio.numel() else ratio.new_zeros(()),
            "tokens": mask.to(loss.dtype).sum(),
        }
    return reduced, {k: v.detach() for k, v in metrics.items()}


def gspo_log_ratio(log_probs: Tensor, sequence_log_ratio: Tensor) -> Tensor:
    """GSPO's per-token log-ratio, at the trajectory level: log s_i + logp_t - sg[logp_t].

    GSPO (Zheng et al. 2025; verl `policy_loss.loss_mode=gspo`) uses one importance ratio per sequence,
    the geometric mean s_i = exp((1/|y_i|) sum_t (logp_t - old_t)), clipped with a narrow range (their
    recipe: clip_low 3e-4, clip_high 4e-4). Here the "sequence" is the whole trajectory: all response
    tokens of all its turns, i.e. of its 1:N rows together (a per-row ratio would be per turn).

    The rows of a trajectory may sit in different micro-batches, so s_i cannot come from one forward.
    verl's stop-gradient form makes it decomposable: with log s_i known as a number (`sequence_log_ratio`,
    from a no-grad pass over the whole optimizer step), the per-token term sg[log s_i] + logp_t - sg[logp_t]
    has the value log s_i at every token and the gradient of logp_t, so exp() of it has value s_i and
    gradient s_i * grad logp_t: summed with the trajectory's token weights (loss_agg trajectory_mean gives
    1/|y_i|) that is GSPO's gradient s_i A_i (1/|y_i|) sum_t grad logp_t, whatever the micro-batching.
    `sequence_log_ratio` is [batch] (one value per row, its trajectory's) or [batch, seq].

    As verl, the sum is clamped above at 10 (s_i at most e^10, no gradient past it) and not below
    (exp() of a very negative value is 0, harmless).
    """
    seq = sequence_log_ratio.detach().to(log_probs.dtype)
    if seq.dim() == 1:
        seq = seq.unsqueeze(-1).expand_as(log_probs)
    return (seq + log_probs - log_probs.detach()).clamp(max=_GSPO_LOG_RATIO_MAX)


def kl_penalty(log_probs: Tensor, ref_log_probs: Tensor, estimator: Literal["k1", "k3"] = "k3") -> Tensor:
    """Per-token estimate of KL(current || reference) from samples of the current policy (Schulman).

    k1 = logp - ref_logp (unbiased, can be negative); k3 = exp(ref - logp) - (ref - logp) - 1 (unbiased,
    always >= 0, 0 where equal). Aggregate with the mask (`aggregate` / `weighted_token_sum`).
    """
    if log_probs.shape != ref_log_probs.shape:
        raise LossError(f"log_probs {tuple(log_probs.shape)} and ref_log_probs {tuple(ref_log_probs.shape)} must match")
    if estimator == "k1":
        return log_probs - ref_log_probs
    if estimator == "k3":
        diff = (ref_log_probs - log_probs).clamp(-_LOG_RATIO_BOUND, _LOG_RATIO_BOUND)
        return torch.expm1(diff) - diff  # expm1: exact near 0, where exp(d) - 1 loses digits
    raise LossError(f"unknown KL estimator '{estimator}'; use 'k1' or 'k3' (algorithm.kl_estimator)")


def truncated_importance_weights(old_log_probs: Tensor, rollout_log_probs: Tensor, cap: float) -> Tensor:
    """min(exp(old_logp - rollout_logp), cap), detached: corrects the trainer/engine log-prob gap (TIS)."""
    if cap <= 0:
        raise LossError(f"the importance weight cap must be > 0 (algorithm.rollout_is_threshold), got {cap}")
    log_w = (old_log_probs - rollout_log_probs).detach().clamp(max=_LOG_RATIO_BOUND)
    return torch.exp(log_w).clamp(max=cap)


def entropy_from_log_probs(log_p: Tensor, inplace: bool = False) -> Tensor:
    """Entropy -sum(p * log p) over the last dim from log-probabilities (a log_softmax output).

    `inplace` (no autograd; `log_p` is overwritten) holds two [positions, vocab] tensors instead of four.
    """
    # The clamp keeps -inf logits (masked vocabulary) from making 0 * -inf = NaN, forward and backward.
    low = torch.finfo(log_p.dtype).min
    log_p = log_p.clamp_(min=low) if inplace else log_p.clamp(min=low)
    p = log_p.exp()
    return -(p.mul_(log_p) if inplace else p * log_p).sum(-1)


def entropy_from_logits(logits: Tensor, chunk_size: int | None = None) -> Tensor:
    """Entropy of softmax(logits) over the last dim, per position: -sum(p * log p), from log_softmax.

    Computed in float32 (bf16 logits lose the small probabilities). `chunk_size` positions at a time
    bounds the float32 copies of a [positions, vocab] tensor; it saves memory mainly under no_grad
    (entropy logged only), since with grad each chunk's intermediates are kept for backward.
    """
    if chunk_size is not None and chunk_size <= 0:
        raise LossError(f"chunk_size must be > 0, got {chunk_size}")

    def _entropy(x: Tensor) -> Tensor:
        return entropy_from_log_probs(torch.log_softmax(x.float(), dim=-1))

    if chunk_size is None:
        return _entropy(logits)
    flat = logits.reshape(-1, logits.shape[-1])
    parts = [_entropy(c) for c in flat.split(chunk_size, dim=0)]
    out = torch.cat(parts) if parts else flat.new_zeros(0, dtype=torch.float32)
    return out.reshape(logits.shape[:-1])
