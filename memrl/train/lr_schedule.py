"""Learning-rate schedules of the actor: a linear warmup, then constant, linear or cosine decay to a floor.

    factor(step) = (step + 1) / warmup                                       step < warmup
                 = 1                                                          constant
                 = min_ratio + (1 - min_ratio) * (1 - p)                      linear
                 = min_ratio + (1 - min_ratio) * (1 + cos(pi * p)) / 2        cosine
    p = (step + 1 - warmup) / (total - warmup), clipped to [0, 1]

`step` counts optimizer steps already taken, so the first update runs at lr / warmup, not at 0: the
reason these are not `transformers.get_scheduler`'s, whose warmups start at 0 and waste the first update
of a run of a hundred. The decay shapes are HF's (with verl's `min_lr_ratio` floor), in torch's `LambdaLR`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from memrl.config import TrainConfig


@dataclass(frozen=True)
class LRSchedule:
    """The factor applied to `train.lr` after `step` optimizer steps (a picklable callable)."""

    style: str
    warmup: int
    total: int
    min_ratio: float

    def __call__(self, step: int) -> float:
        done = step + 1  # the factor of the update about to be taken
        if self.warmup > 0 and done <= self.warmup:
            return done / self.warmup
        if self.style == "constant":
            return 1.0
        progress = min(1.0, max(0.0, (done - self.warmup) / max(1, self.total - self.warmup)))
        shape = 1.0 - progress if self.style == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
        return self.min_ratio + (1.0 - self.min_ratio) * shape


def lr_schedule(t: TrainConfig) -> LRSchedule:
    """The decay spans the whole run's optimizer steps."""
    return LRSchedule(t.lr_scheduler, t.warmup_steps, t.num_rollout * t.num_optimizer_steps, t.min_lr_ratio)


def build_scheduler(optimizer: torch.optim.Optimizer, t: TrainConfig) -> torch.optim.lr_scheduler.LambdaLR:
    schedule = lr_schedule(t)
    # A plain function, not the dataclass itself: LambdaLR saves a callable object's fields in its state
    # dict and a resume would bring back the old run's schedule; the config is what a resumed run follows
    # (only the step count comes from the checkpoint).
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: schedule(step))
