"""The policy optimizer: consumes exactly one rollout step's rows, PPO-clip + KL, AdamW, grad clipping.

A step follows `memrl.train.partition.plan_rollout` (whose row weights make any micro-batching or rank
split give the full batch's gradient). One process runs every rank's share in turn; with `world_size > 1`
(torch.distributed, e.g. one Ray trainer worker per rank) each runs its own. DDP and FSDP
(`train.strategy = "fsdp"`, `memrl.train.fsdp`) *average*, so each rank's loss is scaled by the world
size; metrics are summed across ranks. DDP all-reduces once per optimizer step (no_sync on every
micro-batch but the last); FSDP on every micro-batch: accumulating unsharded gradients would cost the
memory sharding saves.
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import logging
import math
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import Tensor
from torch.distributed.tensor import DTensor

from memrl.config import Config
from memrl.engines.base import SyncProbe
from memrl.errors import MemrlError
from memrl.rl.correction import RolloutCorrection, per_row, trajectory_totals
from memrl.rl.loss import kl_penalty, policy_loss
from memrl.train import fsdp, lora, packing
from memrl.train.checkpoint import (
    OPTIMIZER_FILE,
    SCHEDULER_FILE,
    load_checkpoint,
    read_checkpoint_file,
    resolve_checkpoint,
    restore_rng,
    save_checkpoint,
)
from memrl.train.logprobs import TokenStats
from memrl.train.lr_schedule import build_scheduler
from memrl.train.microbatch import MicroBatch, ResponseStats
from memrl.train.partition import RankShare, plan_rollout
from memrl.train.step_metrics import (
    add_metric,
    all_reduce_metrics,
    max_metric,
    metrics_to_host,
    non_finite_message,
    step_report,
)
from memrl.types import TrainRow

log = logging.getLogger(__name__)


class ActorError(RuntimeError, MemrlError):
    """An actor set up or driven inconsistently; the message says what to change."""


class NonFiniteUpdateError(ActorError):
    """A NaN or infinite loss or gradient norm: the step was not applied (message only: it pickles)."""


def _check_process_group(config: Config, world_size: int) -> None:
    if world_size <= 1:
        return
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() != world_size:
        raise ActorError(f"Actor(world_size={world_size}) needs torch.distributed initialised with that "
                         f"many processes; call init_process_group first (the Ray runtime does)")
    if config.train.dp_size != world_size:
        raise ActorError(f"train.dp_size = {config.train.dp_size} but {world_size} trainer processes run; "
                         f"set train.dp_size to the number of trainer workers")


class Actor:
    """A causal LM policy with a frozen reference copy (for the KL term), AdamW and an LR schedule
    (`memrl.train.lr_schedule`)."""

    def __init__(self, model: torch.nn.Module, config: Config, pad_token_id: int, device: torch.device | None = None,
                 rank: int = 0, world_size: int = 1, load: str | Path | None = None):
        """`world_size > 1`: rank `rank` of an initialised torch.distributed group (DDP, or FSDP sharding).
        `load`: a checkpoint to resume (its state.json is then `self.loaded_state`); the reference stays `model`."""
        _check_process_group(config, world_size)
        self.rank, self.world_size = rank, world_size
        self.strategy = config.train.strategy if world_size > 1 else "single"
        self.cfg = config
        self.correction = RolloutCorrection.from_config(config.algorithm)  # None when off
        self.device = device or next(model.parameters()).device
        self._prepare_model(model)
        self.ref_model = None
        if config.algorithm.kl_coef > 0 and self.peft is None:
            self.ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        checkpoint = resolve_checkpoint(load) if load is not None else None
        self.loaded_state: dict | None = None
        if checkpoint is not None:  # whole weights into the plain model, before any wrapping or sharding
            self.loaded_state = load_checkpoint(checkpoint, self._saved_model, restore_rng=False)
        self.pad_token_id = pad_token_id
        self.vocab_size = model.get_input_embeddings().num_embeddings  # rows' token ids are checked against it
        self._build_forwards()
        self._wrap_for_strategy()
        self._build_optimizer()
        self.global_step = 0
        self.autocast = torch.autocast("cuda", dtype=torch.bfloat16) if self.device.type == "cuda" else None
        if checkpoint is not None:
            self._restore_training_state(checkpoint)

    def _prepare_model(self, model: torch.nn.Module) -> None:
        config = self.cfg
        # FSDP moves each unit to the device as it shards it: building the reference copy and loading a
        # checkpoint first on the device would put two whole models on every GPU before any sharding.
        self.model = model if self.strategy == "fsdp" else model.to(self.device)
        self.model.train()
        # model.lora: adapters injected into self.model in place (it stays the Hugging Face model the forward
        # runs); self.peft is peft's wrapper, which saves, loads, merges and disables them (memrl/train/lora.py).
        self.peft = lora.add_adapters(self.model, config.model.lora) if config.model.lora is not None else None
        if config.train.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            if self.peft is not None:  # frozen embeddings: checkpointed blocks need inputs that require grad
                self.model.enable_input_require_grads()
        if config.train.share_prefixes and (reason := packing.can_share_prefixes(self.model)) is not None:
            log.warning("train.share_prefixes: off for this model (%s)", reason)
            self.cfg = config = config.model_copy(update={"train": config.train.model_copy(
                update={"share_prefixes": False})})  # the plan then counts tokens as they are computed
        if config.train.packing or config.train.share_prefixes:  # before the reference copy: it attends alike
            packing.enable(self.model)

    def _build_forwards(self) -> None:
        temperature, chunk = self.cfg.sampling.temperature, self.cfg.train.logprob_chunk_tokens
        self.policy: torch.nn.Module = ResponseStats(self.model, temperature, chunk)
        self.reference = ResponseStats(self.ref_model, temperature, chunk, with_entropy=False) \
            if self.ref_model is not None else None
        if self.peft is not None and self.cfg.algorithm.kl_coef > 0:  # the base model: the same weights, adapters off
            self.reference = lora.WithoutAdapters(ResponseStats(self.model, temperature, chunk, with_entropy=False),
                                                  self.peft)

    def _wrap_for_strategy(self) -> None:
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
                if self.device.type == "cuda" else None
            # Buffers (rotary tables) are identical on every rank: no per-forward sync. torch >= 2.13 renamed it.
            params = inspect.signature(DistributedDataParallel).parameters
            no_sync_buffers = {("forward_sync_buffers" if "forward_sync_buffers" in params
                                else "broadcast_buffers"): False}
            self.policy = DistributedDataParallel(self.policy, device_ids=ids, **no_sync_buffers)
        elif self.strategy == "fsdp":
            # Every rank starts from the same weights (the same model path or checkpoint), as DDP would
            # enforce by broadcasting; the reference model is sharded too: it is as large as the policy.
            fsdp.shard(self.policy, self.model, self.device)
            if self.reference is not None:
                fsdp.shard(self.reference, self.ref_model, self.device)

    def _build_optimizer(self) -> None:
        t = self.cfg.train
        # After sharding: FSDP replaces the parameters by sharded ones, which the optimizer must hold.
        trained = (self.model.parameters() if self.peft is None
                   else [p for p in self.model.parameters() if p.requires_grad])
        # One fused AdamW kernel per step on CUDA (torch's default is `foreach`); not yet run under FSDP.
        fused = {"fused": True} if self.device.type == "cuda" and self.strategy != "fsdp" else {}
        self.optimizer = torch.optim.AdamW(trained, lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay,
                                           **fused)
        self.scheduler = build_scheduler(self.optimizer, t)

    def _restore_training_state(self, checkpoint: Path) -> None:
        """A resume's optimizer, scheduler, RNG and step count (the weights were loaded before wrapping)."""
        if self.strategy == "fsdp":  # rank 0 reads the whole state and broadcasts it
            fsdp.load_full_optimizer_state(self.model, self.optimizer, read_checkpoint_file(
                checkpoint, OPTIMIZER_FILE) if self.rank == 0 else None)
        else:
            self.optimizer.load_state_dict(read_checkpoint_file(checkpoint, OPTIMIZER_FILE))
        self.scheduler.load_state_dict(read_checkpoint_file(checkpoint, SCHEDULER_FILE))
        restore_rng(checkpoint)
        self.global_step = int(self.loaded_state.get("global_step") or 0)

    def _forward(self, module: torch.nn.Module, mb: MicroBatch) -> TokenStats:
        with self.autocast if self.autocast is not None else contextlib.nullcontext():
            return module(*mb.inputs())

    def _build(self, rows: list[TrainRow], weights: list[float]) -> MicroBatch:
        t = self.cfg.train
        return MicroBatch.build(rows, weights, self.pad_token_id, self.device, packed=t.packing,
                                share_min=t.share_prefix_min_tokens if t.share_prefixes else None)

    # ------------------------------------------------------------------ whole weights out, checkpoints
    # Under FSDP these are collectives: every rank calls them; only rank 0 gets (or writes) anything.

    @property
    def shares_cpu(self) -> bool:
        """It trains on this process's CPU (an overlapped rollout then gets half of torch's threads)."""
        return self.device.type == "cpu"

    @property
    def _saved_model(self) -> torch.nn.Module:
        """What a checkpoint's model/ holds: the model, or with LoRA peft's (it saves the adapters only)."""
        return self.peft if self.peft is not None else self.model

    def policy_weights(self) -> dict[str, Tensor]:
        """The policy's tensors under Hugging Face names, on its device: the model's own, or LoRA-merged."""
        return self.model.state_dict() if self.peft is None else lora.merged_weights(self.peft)

    def merged_model(self) -> torch.nn.Module:
        """The policy as a plain Hugging Face model: `self.model`, or with LoRA a merged copy."""
        return self.model if self.peft is None else lora.merged_model(self.peft)

    def full_state_dict(self) -> dict[str, Tensor] | None:
        """CPU copies of the policy weights (Hugging Face keys); None on ranks other than 0."""
        if self.strategy == "fsdp":
            return fsdp.full_weights(self.model, self.rank)
        if self.rank != 0:
            return None
        return {k: v.detach().to("cpu", copy=True) for k, v in self.policy_weights().items()}

    def save_pretrained(self, path: str | Path, tokenizer: Any = None) -> Path | None:
        """A Hugging Face folder of the current weights (rank 0 writes it; None elsewhere)."""
        weights = fsdp.full_weights(self.model, self.rank) if self.strategy == "fsdp" else None
        if self.rank != 0:
            return None
        if self.peft is not None:  # a plain folder (merged), which any engine's server loads
            self.merged_model().save_pretrained(path)
        else:
            self.model.save_pretrained(path, **({"state_dict": weights} if weights is not None else {}))
        if tokenizer is not None:
            tokenizer.save_pretrained(path)
        return Path(path)

    def weight_source(self, folder: str | Path, tokenizer: Any = None) -> ActorWeights:
        return ActorWeights(self, Path(folder), tokenizer)

    def weight_snapshot(self) -> dict[str, Tensor]:
        """The whole weights now, copied: training goes on changing its own tensors in place."""
        weights = self.full_state_dict()
        if weights is None:
            raise ActorError("weight_snapshot is for the one-process actor (rank 0 of 1)")
        return weights

    def save_checkpoint(self, run_root: str | Path, rollout_id: int, state: dict[str, Any],
                        tokenizer: Any = None) -> Path | None:
        """The checkpoint of `rollout_id` (same files under every strategy); rank 0 writes, None elsewhere."""
        state = {**state, "global_step": self.global_step}
        model, optimizer, weights = self._saved_model, self.optimizer, None
        if self.strategy == "fsdp":  # gathered whole on rank 0 (collectives: every rank takes part)
            model, weights = self.model, fsdp.full_weights(self.model, self.rank)
            optimizer = fsdp.full_optimizer_state(self.model, self.optimizer, self.rank)
        if self.rank != 0:  # DDP replicas and their optimizer states are identical
            return None
        return save_checkpoint(run_root, rollout_id, model, optimizer, self.scheduler, state, tokenizer=tokenizer,
                               weights=weights)

    def train_rollout(self, rows: list[TrainRow], rollout_id: int) -> dict[str, float]:
        """`train.num_optimizer_steps` optimizer steps over exactly these rows (every rank is given all of
        them and runs its own share of the plan); the step's metrics."""
        plan = plan_rollout(rows, self.cfg, self.pad_token_id, rollout_id, self.vocab_size)
        own = plan if self.world_size == 1 else [[shares[self.rank]] for shares in plan]
        return self.train_planned(own, rollout_id, len(rows), sum(len(r.tokens) for r in rows))

    def train_planned(self, steps: list[list[RankShare]], rollout_id: int, num_rows: int,
                      num_tokens: int) -> dict[str, float]:
        """One optimizer step per entry of `steps` over the shares this process runs; metrics averaged over
        them (`num_rows` / `num_tokens`: the whole rollout step's)."""
        start = time.perf_counter()
        totals: dict[str, float] = {}
        # With several optimizer steps per rollout, later steps' groups are off-policy by then: their PPO
        # ratio must be taken against the policy before this rollout's first update, computed up front.
        # A trajectory-level rollout correction needs them up front too: a trajectory's rows may be in
        # several micro-batches, and its total log-ratio must be known before the first of them.
        up_front = len(steps) > 1 or (self.correction is not None and self.correction.needs_trajectory_totals)
        olds = [self._old_log_probs(shares) for shares in steps] if up_front else [None] * len(steps)
        for index, (shares, old) in enumerate(zip(steps, olds, strict=True)):
            for key, value in self._optimizer_step(shares, rollout_id, old, fresh_old=index == 0).items():
                totals[key] = totals.get(key, 0.0) + value / len(steps)
        totals["rows/consumed"] = float(num_rows)
        elapsed = time.perf_counter() - start
        totals["time/train_s"] = elapsed
        totals["perf/train_tokens_per_s"] = num_tokens / elapsed if elapsed > 0 else 0.0
        return totals

    @torch.no_grad()
    def _old_log_probs(self, shares: list[RankShare]) -> list[Tensor]:
        olds = []
        for share in shares:
            for mb_rows, mb_weights in zip(share.micro_batches, share.weights, strict=True):
                mb = self._build(mb_rows, mb_weights)
                olds.append(mb.scatter(self._forward(self.policy, mb).log_probs))
        self._reshard_after_inference(self.policy)
        return olds

    def _reshard_after_inference(self, module: torch.nn.Module) -> None:
        """FSDP keeps a root unit gathered after its forward, expecting a backward; after forwards with no
        backward (reference, old log-probs) the embeddings and LM head would stay whole on every rank."""
        if self.strategy == "fsdp":
            module.reshard()

    def _trajectory_terms(self, shares: list[RankShare], work: list[tuple[list[TrainRow], list[float]]],
                          old_log_probs: list[Tensor] | None, fresh_old: bool) -> list[dict[str, Tensor]]:
        """Per micro-batch, the per-row trajectory totals its loss needs (memrl/rl/correction.py): GSPO's mean
        log-ratio (`gspo`), the rollout correction's summed log rho and token count (`rc_sum`, `rc_tokens`),
        known before any micro-batch's backward (a trajectory's rows may be in several)."""
        a, correction = self.cfg.algorithm, self.correction
        terms: list[dict[str, Tensor]] = [{} for _ in work]
        if old_log_probs is None:  # one step: old = this very forward, so GSPO's log-ratio is 0
            if a.loss_mode == "gspo":
                for k, (mb_rows, _) in enumerate(work):
                    terms[k]["gspo"] = torch.zeros(len(mb_rows), device=self.device)
            return terms
        built = [self._build(rows, w) for rows, w in work]
        ids = [[r.trajectory_id for r in rows] for rows, _ in work]
        masks = [mb.loss_mask for mb in built]
        if correction is not None and correction.needs_trajectory_totals:
            totals = self._world_totals(trajectory_totals(
                [o - mb.rollout_log_probs for o, mb in zip(old_log_probs, built, strict=True)], masks, ids))
            for k, row_ids in enumerate(ids):
                terms[k]["rc_sum"], terms[k]["rc_tokens"] = per_row(totals, row_ids, self.device)
        if a.loss_mode == "gspo":
            # The first step's old log-probs are the current policy's: its mean log-ratio is 0 (no pass).
            current = old_log_probs if fresh_old else self._old_log_probs(shares)
            totals = self._world_totals(
                trajectory_totals([c - o for c, o in zip(current, old_log_probs, strict=True)], masks, ids))
            for k, row_ids in enumerate(ids):
                total, count = per_row(totals, row_ids, self.device)
                terms[k]["gspo"] = torch.where(count > 0, total / count.clamp(min=1), 0.0)
        return terms

    def _world_totals(self, totals: dict[str, tuple[float, float]]) -> dict[str, tuple[float, float]]:
        """Per-trajectory (sum, count) over every rank's rows (ranks are dealt rows by tokens, so one
        trajectory's rows may be on several): one small object gather per optimizer step."""
        if self.world_size == 1:
            return totals
        gathered: list[Any] = [None] * self.world_size
        dist.all_gather_object(gathered, totals)
        merged: dict[str, tuple[float, float]] = {}
        for part in gathered:
            for tid, (total, count) in part.items():
                old = merged.get(tid, (0.0, 0.0))
                merged[tid] = (old[0] + total, old[1] + count)
        return merged

    def _optimizer_step(self, shares: list[RankShare], rollout_id: int,
                        old_log_probs: list[Tensor] | None = None, fresh_old: bool = False) -> dict[str, float]:
        t = self.cfg.train
        if self.world_size > 1 and len(shares) != 1:
            raise ActorError(f"rank {self.rank} of {self.world_size} was given {len(shares)} shares of an "
                             f"optimizer step; a distributed rank runs exactly its own share")
        work = [(mb, w) for share in shares for mb, w in zip(share.micro_batches, share.weights, strict=True)]
        trajectory_terms = self._trajectory_terms(shares, work, old_log_probs, fresh_old)
        # DDP averages the gradients of the world; our loss is already the exact share of the step's sum.
        loss_scale = float(self.world_size)
        sums: dict[str, Any] = {}  # device tensors until the loop ends, then floats
        self.optimizer.zero_grad(set_to_none=True)
        for k, (mb_rows, mb_weights) in enumerate(work):
            # DDP all-reduces gradients once, on the last micro-batch (every rank has as many).
            defer = self.strategy == "ddp" and k < len(work) - 1
            with self.policy.no_sync() if defer else contextlib.nullcontext():
                self._micro_batch(mb_rows, mb_weights, sums, loss_scale,
                                  None if old_log_probs is None else old_log_probs[k], trajectory_terms[k])
        metrics_to_host(sums)
        if self.world_size > 1:
            all_reduce_metrics(sums, self.device)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        if isinstance(grad_norm, DTensor):  # FSDP: the global norm, replicated on every rank
            grad_norm = grad_norm.full_tensor()
        # Every rank sees the same all-reduced loss and norm, so all of them stop here together; applying
        # the step would write NaN into the weights (and into the next checkpoint).
        if not (math.isfinite(float(grad_norm)) and math.isfinite(sums["loss/total"])):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdateError(non_finite_message(rollout_id, self.global_step, sums["loss/total"],
                                                          float(grad_norm)))
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        return step_report(sums, float(grad_norm), self.scheduler.get_last_lr()[0])

    def _micro_batch(self, mb_rows: list[TrainRow], mb_weights: list[float], sums: dict[str, Any],
                     loss_scale: float, old: Tensor | None, terms: dict[str, Tensor]) -> None:
        """Forward + backward of one micro-batch (its exact weighted share of the step loss); metrics into sums."""
        a = self.cfg.algorithm
        mb = self._build(mb_rows, mb_weights)
        stats = self._forward(self.policy, mb)
        logp = mb.scatter(stats.log_probs)
        entropy = mb.scatter(stats.entropy.detach())
        # `old`: the policy before this rollout's first update; with one optimizer step per rollout that
        # is this very forward (ratio 1), so no extra pass is needed.
        old = logp.detach() if old is None else old
        iw, loss_mask = self._rollout_correction(mb, old, terms, sums)
        pg, m = policy_loss(logp, old, mb.advantages, loss_mask, a.clip_low, a.clip_high, a.dual_clip,
                            row_weights=mb.row_weights, importance_weights=iw, sequence_log_ratio=terms.get("gspo"))
        loss = pg
        w_tokens = (loss_mask * mb.row_weights.unsqueeze(-1))
        if self.reference is not None:
            with torch.no_grad():
                ref = mb.scatter(self._forward(self.reference, mb).log_probs)
            self._reshard_after_inference(self.reference)
            kl = kl_penalty(logp, ref, a.kl_estimator)
            kl_term = (kl * w_tokens).sum()
            loss = loss + a.kl_coef * kl_term
            add_metric(sums, "kl/mean", kl_term.detach())
        if a.entropy_coef > 0:
            loss = loss - a.entropy_coef * (mb.scatter(stats.entropy) * w_tokens).sum()
        (loss * loss_scale).backward()
        n_tok = mb.loss_mask.sum().double()
        # where(), not a product: a masked-out token's gap must not count, not even as inf * 0 = NaN.
        gap = torch.where(mb.loss_mask > 0, (old - mb.rollout_log_probs).abs(), 0.0)
        add_metric(sums, "loss/policy", pg.detach())
        add_metric(sums, "loss/total", loss.detach())
        add_metric(sums, "entropy/mean", (entropy * w_tokens).sum())
        add_metric(sums, "logprob_gap/sum_abs", gap.sum())
        max_metric(sums, "logprob_gap/max_abs", gap.max().double())  # a micro-batch has >= 1 response token
        add_metric(sums, "tokens/loss", n_tok)
        add_metric(sums, "clip_fraction_tokens", m["clip_fraction"], n_tok)
        add_metric(sums, "micro_batches", 1.0)
        real = sum(len(r.tokens) for r in mb_rows if not r.is_padding)
        add_metric(sums, "tokens/real", real)  # requested: the rows' own lengths
        add_metric(sums, "tokens/padded", mb.input_ids.numel())  # positions run: rows x longest, or all packed
        # the real rows' positions run: fewer than requested where prefixes are shared; padding rows never are
        add_metric(sums, "tokens/computed", real if mb.attention_mask is not None else
                   mb.input_ids.numel() - sum(len(r.tokens) for r in mb_rows if r.is_padding))

    def _rollout_correction(self, mb: MicroBatch, old: Tensor, terms: dict[str, Tensor],
                            sums: dict[str, Any]) -> tuple[Tensor | None, Tensor]:
        """The rollout correction's importance weights (None when off) and the loss mask less the tokens it
        drops; its metrics into sums. A dropped token (rollout_rs) leaves every term, its weight stays in the
        step's sum."""
        if self.correction is None:
            return None, mb.loss_mask
        iw, keep, rc_metrics = self.correction.apply(old, mb.rollout_log_probs, mb.loss_mask,
                                                terms.get("rc_sum"), terms.get("rc_tokens"))
        n_mb = mb.loss_mask.sum().double()
        for key, value in rc_metrics.items():
            if key.endswith("_max"):  # kept on the device, as every metric of the loop (`metrics_to_host`)
                max_metric(sums, key, torch.as_tensor(value, dtype=torch.float64, device=n_mb.device))
            else:
                add_metric(sums, key, value, n_mb)
        return iw, mb.loss_mask * keep

    @torch.no_grad()
    def log_probs(self, rows: list[TrainRow]) -> list[list[float]]:
        """The trainer's log-probs of each row's response tokens (a collective under FSDP)."""
        out = [self._forward(self.policy, self._build([r], [0.0])).log_probs.tolist() for r in rows]
        self._reshard_after_inference(self.policy)
        return out

    def sync_probe(self, prompt_ids: list[int], continuation_ids: list[int], version: int) -> SyncProbe:
        """The weight-sync canary's reference (memrl/train/sync_check.py): the policy's log-probs of the
        continuation, computed as old log-probs are, with weight version `version` (a collective under FSDP)."""
        n = len(continuation_ids)
        row = TrainRow(tokens=[*prompt_ids, *continuation_ids], response_length=n, loss_mask=[1] * n,
                       rollout_log_probs=[0.0] * n, advantage=0.0, group_id="sync-probe", trajectory_id="sync-probe",
                       turn_index=0, rollout_id=version)
        (log_probs,) = self.log_probs([row])
        config = self.model.config
        dtype = "bfloat16" if self.autocast is not None else str(next(self.model.parameters()).dtype)
        return SyncProbe(prompt_ids=list(prompt_ids), continuation_ids=list(continuation_ids),
                         temperature=self.cfg.sampling.temperature, log_probs=log_probs, version=version,
                         dtype=dtype.removeprefix("torch."), layers=config.num_hidden_layers,
                         width=max(config.hidden_size, getattr(config, "intermediate_size", config.hidden_size)))


class ActorWeights:
    """A one-process actor's current weights as a `WeightSource`: its own tensors (an in-process engine
    copies them), or a Hugging Face folder written on demand (a served one reloads it)."""

    def __init__(self, actor: Actor, folder: Path, tokenizer: Any = None) -> None:
        self.actor, self.folder, self.tokenizer = actor, folder, tokenizer

    def whole_weights(self) -> dict[str, Tensor]:
        return self.actor.policy_weights()

    def saved_folder(self) -> str:
        return str(self.actor.save_pretrained(self.folder, self.tokenizer))
