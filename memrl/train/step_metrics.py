"""One optimizer step's metrics: sums kept on the device while its micro-batches run (one host sync per
step, not one per metric per micro-batch), summed over data-parallel ranks, then reported per token.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor


def add_metric(sums: dict[str, Any], key: str, value: Tensor | float, w: Tensor | float = 1.0) -> None:
    # Tensors stay on the device, float64 as the Python floats they become (`metrics_to_host`).
    value = value.detach().double() if isinstance(value, Tensor) else value
    sums[key] = sums.get(key, 0.0) + value * w


def max_metric(sums: dict[str, Any], key: str, value: Tensor) -> None:
    # torch.maximum keeps NaN (Python's max(0.0, nan) is 0.0, which reported a max gap of 0 next to a NaN mean)
    sums[key] = torch.maximum(sums[key], value) if key in sums else value


def metrics_to_host(sums: dict[str, Any]) -> None:
    keys = [k for k, v in sums.items() if isinstance(v, Tensor)]
    if keys:
        sums.update(zip(keys, torch.stack([sums[k] for k in keys]).tolist(), strict=True))


def all_reduce_metrics(sums: dict[str, float], device: torch.device) -> None:
    """Sum every metric over the ranks (max for the maxima); all ranks have the same keys."""
    maxima = sorted(k for k in sums if k == "logprob_gap/max_abs" or k.endswith("_max"))
    keys = sorted(k for k in sums if k not in maxima)
    device = device if dist.get_backend() == "nccl" else torch.device("cpu")
    summed = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
    dist.all_reduce(summed, op=dist.ReduceOp.SUM)
    top = torch.tensor([sums[k] for k in maxima], dtype=torch.float64, device=device)
    dist.all_reduce(top, op=dist.ReduceOp.MAX)
    sums.update(zip(keys, summed.tolist(), strict=True))
    sums.update(zip(maxima, top.tolist(), strict=True))


def step_report(sums: dict[str, float], grad_norm: float, lr: float) -> dict[str, float]:
    """The step's metrics from its sums: token-weighted sums become means over the loss tokens."""
    n_tok = max(sums.pop("tokens/loss"), 1.0)
    padded = sums["tokens/padded"]
    return {
        "loss/policy": sums["loss/policy"], "loss/total": sums["loss/total"],
        "kl/mean": sums.get("kl/mean", 0.0), "entropy/mean": sums["entropy/mean"],
        "logprob_gap/mean_abs": sums.pop("logprob_gap/sum_abs") / n_tok,
        "logprob_gap/max_abs": sums["logprob_gap/max_abs"],
        "clip_fraction": sums["clip_fraction_tokens"] / n_tok, "grad_norm": grad_norm, "lr": lr,
        "padding_fraction": 1.0 - sums["tokens/computed"] / padded if padded else 0.0,
        # computed / requested token positions: below 1 where prefixes are shared (train.share_prefixes)
        "computed_fraction": sums["tokens/computed"] / sums["tokens/real"] if sums["tokens/real"] else 1.0,
        "micro_batches": sums["micro_batches"], "tokens/loss": n_tok,
        **{key: sums[key] / n_tok for key in sums if key.startswith("rollout_corr/") and not key.endswith("_max")},
        **{key: sums[key] for key in sums if key.startswith("rollout_corr/") and key.endswith("_max")},
    }


def non_finite_message(rollout_id: int, step: int, loss: float, grad_norm: float) -> str:
    # The rows were validated (finite 0/1 masks, log-probs, advantages) before planning, so the cause is
    # the policy's own numbers; "lower the learning rate" is only right when training was diverging.
    return (f"rollout {rollout_id}, optimizer step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
            f"the update was not applied and training stops before any checkpoint of it. The rows passed "
            f"validation, so the model's own outputs overflowed: if grad_norm or logprob_gap grew over the "
            f"last steps, lower train.lr; otherwise check the starting weights "
            f"(model.path / --load) and model.dtype")
