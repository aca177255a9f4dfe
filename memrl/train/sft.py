"""Supervised warm start through the RL actor (`memrl sft`): no second trainer.

Every (prompt_ids, response_ids) turn of a demonstration becomes a `TrainRow` with loss on every response
token and advantage 1.0. With one optimizer step per batch the "old" log-probs are the same forward's, so
the PPO ratio is 1 and (no KL, `token_mean`) the gradient is that of the mean NLL: one `run_sft` step
changes the weights exactly as one AdamW step on that NLL would (tested).
"""

from __future__ import annotations

import itertools
import json
import math
import random
from collections.abc import Sequence
from contextlib import nullcontext
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from pydantic import ValidationError
from tqdm.auto import tqdm

from memrl.config import Config, TrainConfig
from memrl.errors import MemrlError
from memrl.io import atomic_folder
from memrl.train import setup
from memrl.train.actor import Actor
from memrl.train.microbatch import MicroBatch, response_log_probs
from memrl.train.partition import micro_batches
from memrl.types import TrainRow

Demonstration = Sequence[tuple[Sequence[int], Sequence[int]]]


class SFTError(ValueError, MemrlError):
    """Demonstrations or options that cannot be trained on; the message says what to change."""


@dataclass
class SFTOptions:
    epochs: int = 2
    batch_size: int = 32       # demonstrations (trajectories) per optimizer step
    lr: float = 2e-3
    warmup_steps: int = 10
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        # Checked when the options are made (`memrl sft` makes them before loading anything), lr and
        # warmup by the training config's own rules: `--lr nan` was a pydantic traceback from sft_config.
        if self.epochs < 1 or self.batch_size < 1:
            raise SFTError(f"epochs ({self.epochs}) and batch_size ({self.batch_size}) must be >= 1")
        try:
            TrainConfig(lr=self.lr, warmup_steps=self.warmup_steps)
        except ValidationError as e:
            err = e.errors()[0]
            raise SFTError(f"SFT option {err['loc'][0]} = {err['input']!r}: {err['msg']}") from None


def demonstration_rows(demonstrations: Sequence[Demonstration]) -> list[TrainRow]:
    """One row per turn; each demonstration is one group and trajectory (`sft:{i}`), never split."""
    rows = []
    for i, demo in enumerate(demonstrations):
        for turn, (prompt, response) in enumerate(demo):
            if not prompt or not response:
                raise SFTError(f"demonstration {i}, turn {turn}: prompt and response must both be non-empty")
            rows.append(TrainRow(tokens=[*map(int, prompt), *map(int, response)], response_length=len(response),
                                 loss_mask=[1] * len(response), rollout_log_probs=[0.0] * len(response),
                                 advantage=1.0, group_id=f"sft:{i}", trajectory_id=f"sft:{i}",
                                 turn_index=turn, rollout_id=0))
    return rows


def sft_config(cfg: Config, options: SFTOptions) -> Config:
    """The RL config turned into plain supervised learning: no KL, no entropy, token-mean loss, T = 1."""
    raw = cfg.model_dump()
    raw["algorithm"].update(kl_coef=0.0, entropy_coef=0.0, loss_agg="token_mean", rollout_is=None,
                            rollout_rs=None, loss_mode="vanilla")  # demonstrations have no rollout log-probs
    raw["sampling"]["temperature"] = 1.0  # the actor divides logits by it: SFT fits the raw distribution
    raw["train"].update(lr=options.lr, warmup_steps=options.warmup_steps, num_optimizer_steps=1, dp_size=1)
    # The warm start trains every weight, in place, and saves a plain model: model.lora is the RL stage's.
    raw["model"]["lora"] = None
    return type(cfg).model_validate(raw)


@torch.no_grad()
def mean_nll(model: torch.nn.Module, rows: Sequence[TrainRow], pad_token_id: int, train: TrainConfig) -> float:
    """Token-mean negative log-likelihood of the rows' response tokens, one `train.micro_batch_tokens`
    micro-batch at a time (32 SmolLM2 demonstrations of a MemAgent reading in one forward took ~12 GB of
    23), the LM head `train.logprob_chunk_tokens` at a time, as the training step computes them."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for batch in micro_batches(rows, train.micro_batch_tokens):
        mb = MicroBatch.build(batch, [0.0] * len(batch), pad_token_id, device)
        log_probs = response_log_probs(model, mb, 1.0, train.logprob_chunk_tokens)
        total -= float(log_probs.sum())
        count += log_probs.numel()
    return total / count


def run_sft(model: torch.nn.Module, tokenizer: Any, cfg: Config, demonstrations: Sequence[Demonstration],
            options: SFTOptions, out_dir: str | Path | None = None) -> list[dict[str, float]]:
    """Train `model` in place; per-step metrics (with `out_dir`: also metrics.jsonl, sft_options.json and
    the trained model + tokenizer in `out_dir/model`)."""
    if not demonstrations:
        raise SFTError("no demonstrations to train on")
    pad = setup.pad_token_id(tokenizer)
    actor = Actor(model, sft_config(cfg, options), pad_token_id=pad)
    # Each demonstration's rows, in order (demonstration_rows emits them consecutively).
    demos = [list(rows) for _, rows in itertools.groupby(demonstration_rows(demonstrations),
                                                         key=lambda r: r.trajectory_id)]
    probe = [r for demo in demos[:32] for r in demo]  # fixed rows to report the NLL on
    rng = random.Random(options.seed)
    steps_per_epoch = math.ceil(len(demos) / options.batch_size)
    out = Path(out_dir) if out_dir is not None else None
    if out is not None:
        out.mkdir(parents=True, exist_ok=True)
        (out / "sft_options.json").write_text(json.dumps(asdict(options), indent=2) + "\n")
    history: list[dict[str, float]] = []
    with (
        open(out / "metrics.jsonl", "w", encoding="utf-8") if out is not None else nullcontext() as metrics_file,
        tqdm(total=options.epochs * steps_per_epoch, desc="sft", unit="step", disable=not options.progress) as bar,
    ):
        for epoch in range(options.epochs):
            order = demos[:]
            rng.shuffle(order)
            for b in range(steps_per_epoch):
                step = epoch * steps_per_epoch + b
                rows = [r for demo in order[b * options.batch_size:(b + 1) * options.batch_size] for r in demo]
                metrics = actor.train_rollout(rows, rollout_id=step)
                record = {"step": step, "epoch": epoch, "rows": float(len(rows)), "lr": metrics["lr"],
                          "grad_norm": metrics["grad_norm"], "time_s": metrics["time/train_s"]}
                if b == steps_per_epoch - 1:
                    record["nll"] = mean_nll(actor.model, probe, pad, actor.cfg.train)
                    bar.set_postfix(nll=f"{record['nll']:.3f}")
                history.append(record)
                if metrics_file is not None:
                    metrics_file.write(json.dumps(record) + "\n")
                    metrics_file.flush()  # a step's line is readable while the next one trains
                bar.update()
    model.eval()
    if out is not None:
        with atomic_folder(out / "model") as tmp:  # a killed save leaves no half-written model folder
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
    return history
