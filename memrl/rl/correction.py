"""Rollout correction (verl's `algorithm.rollout_correction`; levels and formulas in docs/algorithms.md):
rho = exp(old_logp - rollout_logp), the trainer's over the engine's log-prob of each sampled token.
`rollout_is` weights multiply the policy-gradient term only; `rollout_rs` drops tokens from every term but
keeps their place in the normaliser. A "sequence" is the whole trajectory, whose rows may sit in different
micro-batches: the trainer sums log rho per trajectory first (`trajectory_totals`), then hands each row its
total (`per_row`).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch import Tensor

from memrl.rl.loss import LOG_RATIO_BOUND


@dataclass(frozen=True)
class RolloutCorrection:
    is_level: str | None      # "token" | "sequence" | None
    is_threshold: float
    rs_level: str | None      # "token" | "sequence" | "geometric" | None
    rs_low: float
    rs_high: float

    @classmethod
    def from_config(cls, a: Any) -> RolloutCorrection | None:
        """The correction `a` (memrl.config.AlgorithmConfig) asks for; None when none is on."""
        if a.rollout_is is None and a.rollout_rs is None:
            return None
        return cls(a.rollout_is, a.rollout_is_threshold, a.rollout_rs, *a.rollout_rs_range)

    @property
    def needs_trajectory_totals(self) -> bool:
        return self.is_level == "sequence" or self.rs_level in ("sequence", "geometric")

    def apply(self, old_log_probs: Tensor, rollout_log_probs: Tensor, mask: Tensor,
              trajectory_log_ratio: Tensor | None = None,
              trajectory_tokens: Tensor | None = None) -> tuple[Tensor | None, Tensor, dict[str, Tensor]]:
        """(importance weights [B, T] or None, keep mask [B, T] (1 = kept), metrics: token means over the
        mask) for one micro-batch. `trajectory_log_ratio[r]` / `trajectory_tokens[r]`: row r's whole
        trajectory's sum of log rho and masked token count (sequence and geometric levels)."""
        log_rho = (old_log_probs - rollout_log_probs).detach()
        valid = mask != 0
        if self.needs_trajectory_totals and (trajectory_log_ratio is None or trajectory_tokens is None):
            raise ValueError("sequence-level rollout correction needs each row's trajectory totals")

        def seq(values: Tensor) -> Tensor:
            return values.detach().to(log_rho.dtype).unsqueeze(-1).expand_as(log_rho)

        weights, clipped = None, torch.zeros_like(valid)
        if self.is_level is not None:
            log_w = log_rho if self.is_level == "token" else seq(trajectory_log_ratio)
            log_w = log_w.clamp(max=LOG_RATIO_BOUND)
            clipped = log_w > math.log(self.is_threshold)
            weights = torch.exp(log_w).clamp(max=self.is_threshold)
        keep = torch.ones_like(log_rho)
        if self.rs_level is not None:
            if self.rs_level == "token":
                level = log_rho
            elif self.rs_level == "sequence":
                level = seq(trajectory_log_ratio)
            else:
                level = seq(trajectory_log_ratio / trajectory_tokens.clamp(min=1))
            inside = (level >= math.log(self.rs_low)) & (level <= math.log(self.rs_high))
            keep = inside.to(log_rho.dtype)

        with torch.no_grad():
            m = mask.to(log_rho.dtype)
            n = m.sum().clamp(min=1)
            rho = torch.exp(log_rho.clamp(max=LOG_RATIO_BOUND))
            metrics = {
                "rollout_corr/ratio_mean": (rho * m).where(valid, 0.0).sum() / n,
                "rollout_corr/ratio_max": rho.where(valid, 0.0).max() if rho.numel() else rho.new_zeros(()),
                "rollout_corr/is_clipped_fraction": (clipped & valid).to(m.dtype).sum() / n,
                "rollout_corr/rs_masked_fraction": ((keep == 0) & valid).to(m.dtype).sum() / n,
            }
        return weights, keep, metrics


def trajectory_totals(values: Sequence[Tensor], masks: Sequence[Tensor],
                      trajectory_ids: Sequence[Sequence[str]]) -> dict[str, tuple[float, float]]:
    """Per trajectory, (sum of `values` over its masked tokens, its masked token count), over micro-batches:
    `values[k]` and `masks[k]` are micro-batch k's [B, T] tensors, `trajectory_ids[k]` its rows' ids."""
    totals: dict[str, tuple[float, float]] = {}
    for v, m, ids in zip(values, masks, trajectory_ids, strict=True):
        valid = m != 0
        sums = torch.where(valid, v.detach().double(), 0.0).sum(-1).tolist()
        counts = valid.sum(-1).tolist()
        for tid, s, c in zip(ids, sums, counts, strict=True):
            old = totals.get(tid, (0.0, 0.0))
            totals[tid] = (old[0] + s, old[1] + c)
    return totals


def per_row(totals: dict[str, tuple[float, float]], trajectory_ids: Sequence[str],
            device: torch.device) -> tuple[Tensor, Tensor]:
    """Each row's trajectory (sum, count) from `trajectory_totals`, as two [B] float tensors."""
    sums = [totals.get(t, (0.0, 0.0))[0] for t in trajectory_ids]
    counts = [totals.get(t, (0.0, 0.0))[1] for t in trajectory_ids]
    return (torch.tensor(sums, dtype=torch.float32, device=device),
            torch.tensor(counts, dtype=torch.float32, device=device))
