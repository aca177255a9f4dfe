"""The policy optimizer: consumes exactly one rollout step's rows, PPO-clip + KL, AdamW, grad clipping.

One optimizer step = whole prompt groups (`split_optimizer_steps`); its rows are dealt to data-parallel
ranks (`split_ranks`, simulated sequentially in one process, or one share per Ray worker) and cut into
token-budget micro-batches. The loss of a step is `sum_r w_r * sum_t mask * loss` with per-row weights
computed once for the whole step (`compute_token_weights`), so any micro-batching or rank split gives
the same gradient as one full batch.

Only response positions go through the LM head: prompt tokens carry no loss, and MemAgent prompts are
most of every row (PITFALLS: the actor update dominated by prompt tokens).
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
from torch import Tensor

from memrl.config import Config
from memrl.rl.loss import (
    compute_token_weights,
    entropy_from_logits,
    kl_penalty,
    policy_loss,
    truncated_importance_weights,
)
from memrl.rl.validate import validate_train_rows
from memrl.train.partition import (
    equalize_micro_batch_counts,
    micro_batches,
    padding_fraction,
    split_optimizer_steps,
    split_ranks,
)
from memrl.types import TrainRow


@dataclass
class MicroBatch:
    """Right-padded tensors of a micro-batch; response values live in [rows, max_response] tensors."""

    input_ids: Tensor          # [B, L]
    attention_mask: Tensor     # [B, L]
    positions: Tensor          # [N, 2]: (row, position) of the logits predicting each response token
    targets: Tensor            # [N]
    resp_index: Tensor         # [N, 2]: (row, k) of each response token in the [B, R] tensors
    loss_mask: Tensor          # [B, R]
    rollout_log_probs: Tensor  # [B, R]
    advantages: Tensor         # [B]
    row_weights: Tensor        # [B]

    @classmethod
    def build(cls, rows: list[TrainRow], weights: list[float], pad_id: int, device: torch.device) -> MicroBatch:
        width = max(len(r.tokens) for r in rows)
        resp_width = max(r.response_length for r in rows)
        ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
        attn = torch.zeros((len(rows), width), dtype=torch.long)
        mask = torch.zeros((len(rows), resp_width))
        old = torch.zeros((len(rows), resp_width))
        pos, tgt, ridx = [], [], []
        for b, r in enumerate(rows):
            n, p = len(r.tokens), r.prompt_length
            ids[b, :n] = torch.tensor(r.tokens)
            attn[b, :n] = 1
            mask[b, : r.response_length] = torch.tensor(r.loss_mask, dtype=torch.float)
            old[b, : r.response_length] = torch.tensor(r.rollout_log_probs, dtype=torch.float)
            for k in range(r.response_length):
                pos.append((b, p + k - 1))  # the logits at position t predict token t + 1
                tgt.append(r.tokens[p + k])
                ridx.append((b, k))
        return cls(ids.to(device), attn.to(device), torch.tensor(pos, dtype=torch.long, device=device).reshape(-1, 2),
                   torch.tensor(tgt, dtype=torch.long, device=device),
                   torch.tensor(ridx, dtype=torch.long, device=device).reshape(-1, 2), mask.to(device),
                   old.to(device), torch.tensor([r.advantage for r in rows], device=device),
                   torch.tensor(weights, dtype=torch.float, device=device))

    def scatter(self, flat: Tensor) -> Tensor:
        out = flat.new_zeros(self.loss_mask.shape)
        out[self.resp_index[:, 0], self.resp_index[:, 1]] = flat
        return out


def response_logits(model: torch.nn.Module, mb: MicroBatch, temperature: float) -> Tensor:
    """Logits (divided by the sampling temperature) at the positions that predict response tokens: [N, V]."""
    hidden = model.base_model(input_ids=mb.input_ids, attention_mask=mb.attention_mask).last_hidden_state
    selected = hidden[mb.positions[:, 0], mb.positions[:, 1]]
    logits = model.get_output_embeddings()(selected).float()
    return logits / temperature if temperature > 0 else logits


def token_log_probs(logits: Tensor, targets: Tensor) -> Tensor:
    return torch.log_softmax(logits, dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)


class Actor:
    """A causal LM policy with a frozen reference copy (for the KL term), AdamW and a warmup schedule."""

    def __init__(self, model: torch.nn.Module, config: Config, pad_token_id: int, device: torch.device | None = None):
        self.cfg = config
        self.device = device or next(model.parameters()).device
        self.model = model.to(self.device)
        self.model.train()
        if config.train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
        self.ref_model = None
        if config.algorithm.kl_coef > 0:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        self.pad_token_id = pad_token_id
        t = config.train
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=t.lr, betas=t.adam_betas,
                                           weight_decay=t.weight_decay)
        warmup = t.warmup_steps
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup > 0 else 1.0)
        self.global_step = 0
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else None

    def _forward(self, model: torch.nn.Module, mb: MicroBatch) -> Tensor:
        if self.autocast is None:
            return response_logits(model, mb, self.cfg.rollout.temperature)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            return response_logits(model, mb, self.cfg.rollout.temperature)

    def train_rollout(self, rows: list[TrainRow], rollout_id: int) -> dict[str, float]:
        """Run `train.num_optimizer_steps` optimizer steps over exactly these rows; return step metrics."""
        validate_train_rows(rows)
        start = time.perf_counter()
        totals: dict[str, float] = {}
        steps = split_optimizer_steps(rows, self.cfg.train.num_optimizer_steps)
        for step_rows in steps:
            for key, value in self._optimizer_step(step_rows, rollout_id).items():
                totals[key] = totals.get(key, 0.0) + value / len(steps)
        totals["rows/consumed"] = float(len(rows))
        elapsed = time.perf_counter() - start
        totals["time/train_s"] = elapsed
        totals["perf/train_tokens_per_s"] = sum(len(r.tokens) for r in rows) / elapsed if elapsed > 0 else 0.0
        return totals

    def _optimizer_step(self, rows: list[TrainRow], rollout_id: int) -> dict[str, float]:
        t, a = self.cfg.train, self.cfg.algorithm
        ranks = split_ranks(rows, t.dp_size, t.pad_to_dp, self.pad_token_id, rollout_id)
        all_rows = [r for rank in ranks for r in rank]
        weights = dict(zip(map(id, all_rows), compute_token_weights(
            [sum(r.loss_mask) for r in all_rows], [r.trajectory_id for r in all_rows], a.loss_agg), strict=True))
        batches = equalize_micro_batch_counts([micro_batches(rank, t.micro_batch_tokens) for rank in ranks],
                                              self.pad_token_id, rollout_id)
        flat = [mb for rank in batches for mb in rank]
        sums: dict[str, float] = {}

        def add(key: str, value: Tensor | float, w: float = 1.0) -> None:
            sums[key] = sums.get(key, 0.0) + float(value) * w

        self.optimizer.zero_grad(set_to_none=True)
        for mb_rows in flat:
            mb = MicroBatch.build(mb_rows, [weights.get(id(r), 0.0) for r in mb_rows], self.pad_token_id, self.device)
            logits = self._forward(self.model, mb)
            logp = mb.scatter(token_log_probs(logits, mb.targets))
            entropy = mb.scatter(entropy_from_logits(logits.detach()))
            # One optimizer step per group set: the pre-update policy is this forward's (detached) output.
            old = logp.detach()
            iw = truncated_importance_weights(old, mb.rollout_log_probs, a.tis_cap) if a.tis_cap else None
            pg, m = policy_loss(logp, old, mb.advantages, mb.loss_mask, a.clip_low, a.clip_high, a.dual_clip,
                                row_weights=mb.row_weights, importance_weights=iw)
            loss = pg
            w_tokens = (mb.loss_mask * mb.row_weights.unsqueeze(-1))
            if self.ref_model is not None:
                with torch.no_grad():
                    ref = mb.scatter(token_log_probs(self._forward(self.ref_model, mb), mb.targets))
                kl = kl_penalty(logp, ref, a.kl_estimator)
                kl_term = (kl * w_tokens).sum()
                loss = loss + a.kl_coef * kl_term
                add("kl/mean", kl_term.detach())
            if a.entropy_coef > 0:
                with_grad_entropy = mb.scatter(entropy_from_logits(logits))
                loss = loss - a.entropy_coef * (with_grad_entropy * w_tokens).sum()
            loss.backward()
            n_tok = float(mb.loss_mask.sum())
            gap = ((old - mb.rollout_log_probs).abs() * mb.loss_mask)
            add("loss/policy", pg.detach())
            add("loss/total", loss.detach())
            add("entropy/mean", (entropy * w_tokens).sum())
            add("logprob_gap/sum_abs", gap.sum())
            add("logprob_gap/max_abs", 0.0)
            sums["logprob_gap/max_abs"] = max(sums["logprob_gap/max_abs"], float(gap.max()) if gap.numel() else 0.0)
            add("tokens/loss", n_tok)
            add("clip_fraction_tokens", m["clip_fraction"], n_tok)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        if not math.isfinite(float(grad_norm)):
            self.optimizer.zero_grad(set_to_none=True)
            raise FloatingPointError(f"non-finite gradient norm {float(grad_norm)} at step {self.global_step}; "
                                     f"lower train.lr or check the rows of rollout {rollout_id}")
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        n_tok = max(sums.pop("tokens/loss"), 1.0)
        return {
            "loss/policy": sums["loss/policy"], "loss/total": sums["loss/total"],
            "kl/mean": sums.get("kl/mean", 0.0), "entropy/mean": sums["entropy/mean"],
            "logprob_gap/mean_abs": sums.pop("logprob_gap/sum_abs") / n_tok,
            "logprob_gap/max_abs": sums["logprob_gap/max_abs"],
            "clip_fraction": sums["clip_fraction_tokens"] / n_tok, "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0], "padding_fraction": padding_fraction(flat),
            "micro_batches": float(len(flat)), "tokens/loss": n_tok,
        }

    @torch.no_grad()
    def log_probs(self, rows: list[TrainRow]) -> list[list[float]]:
        """The trainer's log-probs of each row's response tokens (for gap checks and tests)."""
        out = []
        for r in rows:
            mb = MicroBatch.build([r], [0.0], self.pad_token_id, self.device)
            out.append(token_log_probs(self._forward(self.model, mb), mb.targets).tolist())
        return out
