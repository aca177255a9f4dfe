"""The policy optimizer: consumes exactly one rollout step's rows, PPO-clip + KL, AdamW, grad clipping.

One optimizer step = whole prompt groups (`split_optimizer_steps`); its rows are dealt to data-parallel
ranks (`split_ranks`) and cut into token-budget micro-batches (`plan_rollout` does all of it, purely).
The loss of a step is `sum_r w_r * sum_t mask * loss` with per-row weights computed once for the whole
step (`compute_token_weights`), so any micro-batching or rank split gives the same gradient as one full
batch.

Two ways to run the ranks of a plan:
- one process (`world_size == 1`, the default): every rank's share runs sequentially, gradients add up;
- real data parallelism (`world_size > 1`, torch.distributed initialised, e.g. one Ray trainer worker
  per rank): each process runs only its own share; DDP all-reduces the gradients once per optimizer step
  (no_sync on every micro-batch but the last; every rank has the same number of micro-batches, see
  `equalize_micro_batch_counts`). DDP *averages*, so each rank's loss is multiplied by the world size:
  the summed gradient then equals the one-process gradient. Metrics are summed across ranks.
  `train.strategy = "fsdp"` shards the model instead of replicating it (FSDP2, `memrl.train.fsdp`): the
  same plan, the same loss scale (FSDP's reduce-scatter also averages), gradients reduced on every
  micro-batch (accumulating unsharded gradients would cost the memory sharding saves).

Only response positions go through the LM head: prompt tokens carry no loss, and MemAgent prompts are
most of every row (docs/design.md, pitfall "Prompt-heavy actor update"); and they go through it a chunk
at a time (`train.logprob_chunk_tokens`, `memrl.train.logprobs`), never as one [tokens x vocab] float32
tensor. `train.packing` concatenates a micro-batch's rows instead of padding them (`memrl.train.packing`).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import itertools
import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
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
from memrl.rl.loss import (
    compute_token_weights,
    kl_penalty,
    policy_loss,
)
from memrl.rl.validate import validate_train_rows
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
from memrl.train.logprobs import TokenStats, response_token_stats
from memrl.train.lr_schedule import build_scheduler
from memrl.train.partition import (
    equalize_micro_batch_counts,
    micro_batches,
    split_optimizer_steps,
    split_ranks,
)
from memrl.types import TrainRow


class ActorError(RuntimeError, MemrlError):
    """An actor set up or driven inconsistently; the message says what to change."""


class NonFiniteUpdateError(ActorError):
    """An optimizer step's loss or gradient norm is NaN or infinite: the step was not applied.

    Message only (no extra fields), so it pickles across Ray workers like the queue's errors.
    """


@dataclass
class RankShare:
    """One rank's work in one optimizer step: its micro-batches and every row's weight in the whole step.

    Invariant: `weights[k][i]` belongs to `micro_batches[k][i]`; padding rows have weight 0.
    """

    micro_batches: list[list[TrainRow]]
    weights: list[list[float]]


def loss_scale_factor(config: Config) -> float:
    """L of loss_agg = seq_mean_token_sum_norm: `algorithm.loss_scale_factor`, else the longest response-token
    limit (a constant of the run, as Dr. GRPO's normaliser must be)."""
    a, r = config.algorithm, config.task
    return float(a.loss_scale_factor if a.loss_scale_factor is not None else max(r.memory_tokens, r.final_tokens))


def plan_optimizer_step(rows: Sequence[TrainRow], config: Config, pad_token_id: int, rollout_id: int) -> list[RankShare]:
    """Deal one optimizer step's rows to `train.dp_size` ranks, weigh them over the whole step, cut each
    rank's rows into micro-batches, and give every rank the same number of micro-batches."""
    t, a = config.train, config.algorithm
    ranks = split_ranks(rows, t.dp_size, t.pad_to_dp, pad_token_id, rollout_id)
    all_rows = [r for rank in ranks for r in rank]
    weights = dict(zip(map(id, all_rows), compute_token_weights(
        [sum(r.loss_mask) for r in all_rows], [r.trajectory_id for r in all_rows], a.loss_agg,
        loss_scale_factor(config)), strict=True))
    batches = equalize_micro_batch_counts([micro_batches(rank, t.micro_batch_tokens, t.packing) for rank in ranks],
                                          pad_token_id, rollout_id)
    return [RankShare(rank, [[weights.get(id(r), 0.0) for r in mb] for mb in rank]) for rank in batches]


def plan_rollout(rows: Sequence[TrainRow], config: Config, pad_token_id: int, rollout_id: int,
                 vocab_size: int | None = None) -> list[list[RankShare]]:
    """`[optimizer step][rank] -> RankShare` for one rollout step's rows (prompt groups kept in one step),
    after the rows are validated (`validate_train_rows`, token ids against the model's `vocab_size`):
    whoever trains them plans them through here.

    Rows are taken in `group_id` order (a stable sort, so a group's rows keep theirs): the plan depends on
    the step's rows, not on how the batch was cut across rollout workers. The converters already emit
    rows in that order, so for one process the sort changes nothing.
    """
    validate_train_rows(rows, vocab_size)
    rows = sorted(rows, key=lambda r: r.group_id)
    return [plan_optimizer_step(step, config, pad_token_id, rollout_id)
            for step in split_optimizer_steps(rows, config.train.num_optimizer_steps)]


@dataclass
class MicroBatch:
    """The tensors of a micro-batch; response values live in [rows, max_response] tensors.

    Padded (`packed=False`): rows right-padded to the longest, [B, L] with a 2-D attention mask.
    Packed: rows concatenated into one [1, T] sequence, T = their total length, no padding; each row's
    position ids restart at 0 and the attention gets the row boundaries (`memrl.train.packing`: a
    variable-length kernel, no mask), so every token sees exactly the tokens it sees in the padded layout.
    """

    input_ids: Tensor              # [B, L] padded, [1, T] packed
    attention_mask: Tensor | None  # [B, L] padded; None packed
    position_ids: Tensor | None    # [1, T] packed; None padded (the model counts 0..L-1)
    row_lengths: list[int] | None  # packed: each row's length, in order (the attention's row boundaries)
    cu_seq_lens: Tensor | None     # packed: [B + 1] int32 cumulative lengths (FlashAttention's argument)
    positions: Tensor              # [N, 2]: (row, position) of the hidden state predicting each response token
    targets: Tensor                # [N]
    resp_index: Tensor             # [N, 2]: (row, k) of each response token in the [B, R] tensors
    loss_mask: Tensor              # [B, R]
    rollout_log_probs: Tensor      # [B, R]
    advantages: Tensor             # [B]
    row_weights: Tensor            # [B]

    @classmethod
    def build(cls, rows: list[TrainRow], weights: list[float], pad_id: int, device: torch.device,
              packed: bool = False) -> MicroBatch:
        resp_width = max(r.response_length for r in rows)
        mask = torch.zeros((len(rows), resp_width))
        old = torch.zeros((len(rows), resp_width))
        pos, tgt, ridx = [], [], []
        offset = 0  # where row b starts: in its own row (padded) or in the one packed sequence
        for b, r in enumerate(rows):
            p = r.prompt_length
            mask[b, : r.response_length] = torch.tensor(r.loss_mask, dtype=torch.float)
            old[b, : r.response_length] = torch.tensor(r.rollout_log_probs, dtype=torch.float)
            for k in range(r.response_length):
                # the hidden state at position t predicts token t + 1
                pos.append((0, offset + p + k - 1) if packed else (b, p + k - 1))
                tgt.append(r.tokens[p + k])
                ridx.append((b, k))
            offset += len(r.tokens)
        lengths = [len(r.tokens) for r in rows]
        if packed:
            ids = torch.tensor([[t for r in rows for t in r.tokens]], dtype=torch.long)
            position_ids = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
            cu_seq_lens = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
            attn = None
        else:
            ids = torch.full((len(rows), max(lengths)), pad_id, dtype=torch.long)
            attn = torch.zeros((len(rows), max(lengths)), dtype=torch.long)
            for b, r in enumerate(rows):
                ids[b, : len(r.tokens)] = torch.tensor(r.tokens)
                attn[b, : len(r.tokens)] = 1
            position_ids = cu_seq_lens = None

        def put(t: Tensor | None) -> Tensor | None:
            # From pinned memory without blocking: a pageable host-to-GPU copy waits for every kernel queued
            # before it, a host sync per tensor per micro-batch.
            if t is None or device.type != "cuda":
                return None if t is None else t.to(device)
            return t.pin_memory().to(device, non_blocking=True)

        return cls(put(ids), put(attn), put(position_ids), lengths if packed else None, put(cu_seq_lens),
                   put(torch.tensor(pos, dtype=torch.long).reshape(-1, 2)), put(torch.tensor(tgt, dtype=torch.long)),
                   put(torch.tensor(ridx, dtype=torch.long).reshape(-1, 2)), put(mask), put(old),
                   put(torch.tensor([r.advantage for r in rows])), put(torch.tensor(weights, dtype=torch.float)))

    def scatter(self, flat: Tensor) -> Tensor:
        out = flat.new_zeros(self.loss_mask.shape)
        out[self.resp_index[:, 0], self.resp_index[:, 1]] = flat
        return out


def _response_stats(model: torch.nn.Module, input_ids: Tensor, attention_mask: Tensor | None,
                    position_ids: Tensor | None, row_lengths: list[int] | None, cu_seq_lens: Tensor | None,
                    positions: Tensor, targets: Tensor, temperature: float, chunk_tokens: int | None,
                    with_entropy: bool = True) -> TokenStats:
    if row_lengths is None:
        hidden = model.base_model(input_ids=input_ids, attention_mask=attention_mask,
                                  position_ids=position_ids).last_hidden_state
    else:  # packed: the attention gets the row boundaries and no mask (memrl.train.packing)
        packing.check_enabled(model)
        hidden = model.base_model(input_ids=input_ids, attention_mask=packing.no_masks(), position_ids=position_ids,
                                  **packing.packed_kwargs(row_lengths, cu_seq_lens)).last_hidden_state
    selected = hidden[positions[:, 0], positions[:, 1]]
    return response_token_stats(selected, targets, model.get_output_embeddings(), temperature, chunk_tokens,
                                with_entropy)


def response_log_probs(model: torch.nn.Module, mb: MicroBatch, temperature: float, chunk_tokens: int | None) -> Tensor:
    """Log-probs [N] of the micro-batch's response tokens under `model` at the sampling temperature."""
    return _response_stats(model, mb.input_ids, mb.attention_mask, mb.position_ids, mb.row_lengths, mb.cu_seq_lens,
                           mb.positions, mb.targets, temperature, chunk_tokens).log_probs


class ResponseStats(torch.nn.Module):
    """Response tokens' log-probs and entropy (`memrl.train.logprobs`) as a module's forward, so DDP (whose
    gradient hooks are armed by its own forward) and FSDP (which gathers the root's parameters, the LM head
    among them, in a hook on it) can wrap it; `self.model` is the plain Hugging Face model, shared, never
    copied."""

    def __init__(self, model: torch.nn.Module, temperature: float, chunk_tokens: int | None,
                 with_entropy: bool = True) -> None:
        super().__init__()
        self.model, self.temperature, self.chunk_tokens = model, temperature, chunk_tokens
        self.with_entropy = with_entropy  # the reference model needs log-probs only

    def forward(self, input_ids: Tensor, attention_mask: Tensor | None, position_ids: Tensor | None,
                row_lengths: list[int] | None, cu_seq_lens: Tensor | None, positions: Tensor,
                targets: Tensor) -> TokenStats:
        return _response_stats(self.model, input_ids, attention_mask, position_ids, row_lengths, cu_seq_lens,
                               positions, targets, self.temperature, self.chunk_tokens, self.with_entropy)


def _fused_adamw(device: torch.device, strategy: str) -> dict[str, bool]:
    """One fused kernel per step for the whole AdamW update on CUDA (torch's default there is `foreach`). Not
    under FSDP, whose sharded DTensor parameters this has not been run with yet; on the CPU torch's default."""
    return {"fused": True} if device.type == "cuda" and strategy != "fsdp" else {}


def _metrics_to_host(sums: dict[str, Any]) -> None:
    """Turn the device-tensor metrics of a step into Python floats, in one transfer."""
    keys = [k for k, v in sums.items() if isinstance(v, Tensor)]
    if keys:
        sums.update(zip(keys, torch.stack([sums[k] for k in keys]).tolist(), strict=True))


def _add_metric(sums: dict[str, Any], key: str, value: Tensor | float, w: Tensor | float = 1.0) -> None:
    # Tensors stay on the device (float64, as the Python floats they become): one host sync per optimizer
    # step (`_metrics_to_host`), not one per metric per micro-batch.
    value = value.detach().double() if isinstance(value, Tensor) else value
    sums[key] = sums.get(key, 0.0) + value * w


def _max_metric(sums: dict[str, Any], key: str, value: Tensor) -> None:
    # torch.maximum keeps NaN (Python's max(0.0, nan) is 0.0, which reported a max gap of 0 next to a NaN mean)
    sums[key] = torch.maximum(sums[key], value) if key in sums else value


def _non_finite_message(rollout_id: int, step: int, loss: float, grad_norm: float) -> str:
    # The rows were validated (finite 0/1 masks, log-probs, advantages) before planning, so the cause is
    # the policy's own numbers; "lower the learning rate" is only right when training was diverging.
    return (f"rollout {rollout_id}, optimizer step {step}: non-finite loss ({loss}) or gradient norm ({grad_norm}); "
            f"the update was not applied and training stops before any checkpoint of it. The rows passed "
            f"validation, so the model's own outputs overflowed: if grad_norm or logprob_gap grew over the "
            f"last steps, lower train.lr; otherwise check the starting weights "
            f"(model.path / --load) and model.dtype")


def _check_process_group(config: Config, world_size: int) -> None:
    """`world_size > 1` needs torch.distributed initialised with that many processes, as train.dp_size says."""
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
        """`world_size > 1`: this is rank `rank` of a torch.distributed group of `train.dp_size` processes
        (initialised by the caller); the model is wrapped in DDP (which also broadcasts rank 0's weights) or,
        with `train.strategy = "fsdp"`, sharded. `load`: a checkpoint to resume (weights, optimizer,
        scheduler, RNG; its state.json is then `self.loaded_state`); the reference model stays `model`."""
        _check_process_group(config, world_size)
        self.rank, self.world_size = rank, world_size
        self.strategy = config.train.strategy if world_size > 1 else "single"
        self.cfg = config
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
        """`self.model`: `model` on the device, in train mode, with LoRA adapters, gradient checkpointing and
        packed attention as the config asks."""
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
        if config.train.packing:  # before the reference copy, which then attends the same way
            packing.enable(self.model)

    def _build_forwards(self) -> None:
        """What the optimizer step calls: (input_ids, attention_mask, position_ids, positions, targets) ->
        the response tokens' log-probs and entropy, for the policy and (with a KL term) the reference."""
        temperature, chunk = self.cfg.sampling.temperature, self.cfg.train.logprob_chunk_tokens
        self.policy: torch.nn.Module = ResponseStats(self.model, temperature, chunk)
        self.reference = ResponseStats(self.ref_model, temperature, chunk, with_entropy=False) \
            if self.ref_model is not None else None
        if self.peft is not None and self.cfg.algorithm.kl_coef > 0:  # the base model: the same weights, adapters off
            self.reference = lora.WithoutAdapters(ResponseStats(self.model, temperature, chunk, with_entropy=False),
                                                  self.peft)

    def _wrap_for_strategy(self) -> None:
        """DDP around the policy's forward, or FSDP sharding of policy and reference (nothing on one process)."""
        if self.strategy == "ddp":
            from torch.nn.parallel import DistributedDataParallel

            ids = [self.device.index if self.device.index is not None else torch.cuda.current_device()] \
                if self.device.type == "cuda" else None
            # Buffers (rotary tables) are identical on every rank: no per-forward sync. torch >= 2.13 renamed it.
            params = inspect.signature(DistributedDataParallel).parameters
            no_sync_buffers = {"forward_sync_buffers" if "forward_sync_buffers" in params else "broadcast_buffers": False}
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
        trained = self.model.parameters() if self.peft is None else [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(trained, lr=t.lr, betas=t.adam_betas, weight_decay=t.weight_decay,
                                           **_fused_adamw(self.device, self.strategy))
        self.scheduler = build_scheduler(self.optimizer, t)

    def _restore_training_state(self, checkpoint: Path) -> None:
        """A resumed run's optimizer, scheduler, RNG and step count (the weights were loaded before wrapping)."""
        if self.strategy == "fsdp":  # rank 0 reads the whole state and broadcasts it
            fsdp.load_full_optimizer_state(self.model, self.optimizer, read_checkpoint_file(
                checkpoint, OPTIMIZER_FILE) if self.rank == 0 else None)
        else:
            self.optimizer.load_state_dict(read_checkpoint_file(checkpoint, OPTIMIZER_FILE))
        self.scheduler.load_state_dict(read_checkpoint_file(checkpoint, SCHEDULER_FILE))
        restore_rng(checkpoint)
        self.global_step = int(self.loaded_state.get("global_step") or 0)

    def _forward(self, module: torch.nn.Module, mb: MicroBatch) -> TokenStats:
        """`module` is `self.policy` or `self.reference` (whatever wraps them: DDP, FSDP, nothing)."""
        with self.autocast if self.autocast is not None else contextlib.nullcontext():
            return module(mb.input_ids, mb.attention_mask, mb.position_ids, mb.row_lengths, mb.cu_seq_lens,
                          mb.positions, mb.targets)

    def _build(self, rows: list[TrainRow], weights: list[float]) -> MicroBatch:
        return MicroBatch.build(rows, weights, self.pad_token_id, self.device, packed=self.cfg.train.packing)

    # ------------------------------------------------------------------ whole weights out, checkpoints
    # Under FSDP these are collectives: every rank calls them; only rank 0 gets (or writes) anything.

    @property
    def shares_cpu(self) -> bool:
        """It trains on this process's CPU (the loop halves torch's threads for an overlapped rollout)."""
        return self.device.type == "cpu"

    @property
    def _saved_model(self) -> torch.nn.Module:
        """What a checkpoint's model/ holds: the model, or with LoRA peft's (its save_pretrained writes the
        adapters only, not a copy of the base weights)."""
        return self.peft if self.peft is not None else self.model

    def policy_weights(self) -> dict[str, Tensor]:
        """The policy's tensors under their Hugging Face names, on the actor's device (one process): the
        model's own, or with LoRA new merged ones (base + adapters)."""
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
        """This (one-process) actor's current weights as an engine's `WeightSource`."""
        return ActorWeights(self, Path(folder), tokenizer)

    def weight_snapshot(self) -> dict[str, Tensor]:
        """The whole weights as they are now, copied (training goes on changing its own tensors in place):
        what the overlapped pipeline hands a rollout that samples with this version later."""
        weights = self.full_state_dict()
        if weights is None:
            raise ActorError("weight_snapshot is for the one-process actor (rank 0 of 1)")
        return weights

    def save_checkpoint(self, run_root: str | Path, rollout_id: int, state: dict[str, Any],
                        tokenizer: Any = None) -> Path | None:
        """The checkpoint of `rollout_id` (same files under every strategy); rank 0 writes, None elsewhere."""
        state = {**state, "global_step": self.global_step}
        if self.strategy == "fsdp":
            weights = fsdp.full_weights(self.model, self.rank)
            optimizer_state = fsdp.full_optimizer_state(self.model, self.optimizer, self.rank)
            if self.rank != 0:
                return None
            return save_checkpoint(run_root, rollout_id, self.model, optimizer_state, self.scheduler, state,
                                   tokenizer=tokenizer, weights=weights)
        if self.rank != 0:  # DDP replicas and their optimizer states are identical
            return None
        return save_checkpoint(run_root, rollout_id, self._saved_model, self.optimizer, self.scheduler, state,
                               tokenizer=tokenizer)

    def train_rollout(self, rows: list[TrainRow], rollout_id: int) -> dict[str, float]:
        """Run `train.num_optimizer_steps` optimizer steps over exactly these rows; return step metrics.
        With `world_size > 1` every rank is given all the rows and runs its own share of the plan."""
        plan = plan_rollout(rows, self.cfg, self.pad_token_id, rollout_id, self.vocab_size)
        own = plan if self.world_size == 1 else [[shares[self.rank]] for shares in plan]
        return self.train_planned(own, rollout_id, len(rows), sum(len(r.tokens) for r in rows))

    def train_planned(self, steps: list[list[RankShare]], rollout_id: int, num_rows: int,
                      num_tokens: int) -> dict[str, float]:
        """Run one optimizer step per entry of `steps`, each over the shares this process runs (all ranks'
        in one process; its own rank's only when distributed). `num_rows` / `num_tokens` count the whole
        rollout step's rows (for metrics). Returns metrics averaged over the optimizer steps."""
        start = time.perf_counter()
        totals: dict[str, float] = {}
        # With several optimizer steps per rollout, later steps' groups are off-policy by then: their PPO
        # ratio must be taken against the policy before this rollout's first update, computed up front.
        # A trajectory-level rollout correction needs them up front too: a trajectory's rows may be in
        # several micro-batches, and its total log-ratio must be known before the first of them.
        correction = RolloutCorrection.from_config(self.cfg.algorithm)
        up_front = len(steps) > 1 or (correction is not None and correction.needs_trajectory_totals)
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
        """The current policy's log-probs of every micro-batch of one optimizer step, in work order."""
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
        """Per micro-batch, the per-row trajectory totals its loss needs (memrl/rl/correction.py): GSPO's
        mean log-ratio (`gspo`) and the rollout correction's summed log rho and token count (`rc_sum`,
        `rc_tokens`); empty dicts when no option needs them. A no-grad pass over the whole step gives them
        before any micro-batch's backward (the stop-gradient form in `gspo_log_ratio` does the rest)."""
        a = self.cfg.algorithm
        correction = RolloutCorrection.from_config(a)
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
        """Per-trajectory (sum, count) over every rank's rows: the planner deals rows to ranks by tokens, so
        one trajectory's rows may be trained on different ranks. One small object gather per optimizer step
        (a float pair per trajectory), only when an option needs trajectory totals."""
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
        _metrics_to_host(sums)
        if self.world_size > 1:
            self._all_reduce_metrics(sums)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), t.grad_clip)
        if isinstance(grad_norm, DTensor):  # FSDP: the global norm, replicated on every rank
            grad_norm = grad_norm.full_tensor()
        # Every rank sees the same all-reduced loss and norm, so all of them stop here together; applying
        # the step would write NaN into the weights (and into the next checkpoint).
        if not (math.isfinite(float(grad_norm)) and math.isfinite(sums["loss/total"])):
            self.optimizer.zero_grad(set_to_none=True)
            raise NonFiniteUpdateError(_non_finite_message(rollout_id, self.global_step, sums["loss/total"],
                                                           float(grad_norm)))
        self.optimizer.step()
        self.scheduler.step()
        self.global_step += 1
        n_tok = max(sums.pop("tokens/loss"), 1.0)
        padded = sums["tokens/padded"]
        return {
            "loss/policy": sums["loss/policy"], "loss/total": sums["loss/total"],
            "kl/mean": sums.get("kl/mean", 0.0), "entropy/mean": sums["entropy/mean"],
            "logprob_gap/mean_abs": sums.pop("logprob_gap/sum_abs") / n_tok,
            "logprob_gap/max_abs": sums["logprob_gap/max_abs"],
            "clip_fraction": sums["clip_fraction_tokens"] / n_tok, "grad_norm": float(grad_norm),
            "lr": self.scheduler.get_last_lr()[0],
            "padding_fraction": 1.0 - sums["tokens/real"] / padded if padded else 0.0,
            "micro_batches": sums["micro_batches"], "tokens/loss": n_tok,
            **{key: sums[key] / n_tok for key in sums if key.startswith("rollout_corr/") and not key.endswith("_max")},
            **{key: sums[key] for key in sums if key.startswith("rollout_corr/") and key.endswith("_max")},
        }

    def _micro_batch(self, mb_rows: list[TrainRow], mb_weights: list[float], sums: dict[str, Any],
                     loss_scale: float, old: Tensor | None = None,
                     trajectory_terms: dict[str, Tensor] | None = None) -> None:
        """Forward + backward of one micro-batch (its exact weighted share of the step loss); metrics into sums.
        `trajectory_terms`: per-row trajectory totals from `_trajectory_terms`."""
        a = self.cfg.algorithm
        terms = trajectory_terms or {}

        def add(key: str, value: Tensor | float, w: Tensor | float = 1.0) -> None:
            _add_metric(sums, key, value, w)

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
            add("kl/mean", kl_term.detach())
        if a.entropy_coef > 0:
            with_grad_entropy = mb.scatter(stats.entropy)
            loss = loss - a.entropy_coef * (with_grad_entropy * w_tokens).sum()
        (loss * loss_scale).backward()
        n_tok = mb.loss_mask.sum().double()
        # where(), not a product: a masked-out token's gap must not count, not even as inf * 0 = NaN.
        gap = torch.where(mb.loss_mask > 0, (old - mb.rollout_log_probs).abs(), 0.0)
        add("loss/policy", pg.detach())
        add("loss/total", loss.detach())
        add("entropy/mean", (entropy * w_tokens).sum())
        add("logprob_gap/sum_abs", gap.sum())
        top = gap.max().double() if gap.numel() else torch.zeros((), dtype=torch.float64, device=gap.device)
        _max_metric(sums, "logprob_gap/max_abs", top)
        add("tokens/loss", n_tok)
        add("clip_fraction_tokens", m["clip_fraction"], n_tok)
        add("micro_batches", 1.0)
        add("tokens/real", sum(len(r.tokens) for r in mb_rows if not r.is_padding))
        add("tokens/padded", mb.input_ids.numel())  # processed positions: rows x longest, or all rows packed

    def _rollout_correction(self, mb: MicroBatch, old: Tensor, terms: dict[str, Tensor],
                            sums: dict[str, Any]) -> tuple[Tensor | None, Tensor]:
        """The rollout correction's importance weights (None when off) and the loss mask less the tokens it
        drops; its metrics into sums. A dropped token (rollout_rs) leaves every term, its weight stays in the
        step's sum."""
        correction = RolloutCorrection.from_config(self.cfg.algorithm)
        if correction is None:
            return None, mb.loss_mask
        iw, keep, rc_metrics = correction.apply(old, mb.rollout_log_probs, mb.loss_mask,
                                                terms.get("rc_sum"), terms.get("rc_tokens"))
        n_mb = mb.loss_mask.sum().double()
        for key, value in rc_metrics.items():
            if key.endswith("_max"):  # kept on the device, as every metric of the loop (`_metrics_to_host`)
                _max_metric(sums, key, torch.as_tensor(value, dtype=torch.float64, device=n_mb.device))
            else:
                _add_metric(sums, key, value, n_mb)
        return iw, mb.loss_mask * keep

    def _all_reduce_metrics(self, sums: dict[str, float]) -> None:
        """Sum every metric over the ranks (max for the maxima); all ranks have the same keys."""
        maxima = sorted(k for k in sums if k == "logprob_gap/max_abs" or k.endswith("_max"))
        keys = sorted(k for k in sums if k not in maxima)
        device = self.device if dist.get_backend() == "nccl" else torch.device("cpu")
        summed = torch.tensor([sums[k] for k in keys], dtype=torch.float64, device=device)
        dist.all_reduce(summed, op=dist.ReduceOp.SUM)
        top = torch.tensor([sums[k] for k in maxima], dtype=torch.float64, device=device)
        dist.all_reduce(top, op=dist.ReduceOp.MAX)
        sums.update(zip(keys, summed.tolist(), strict=True))
        sums.update(zip(maxima, top.tolist(), strict=True))

    @torch.no_grad()
    def log_probs(self, rows: list[TrainRow]) -> list[list[float]]:
        """The trainer's log-probs of each row's response tokens (for gap checks and tests; a collective
        under FSDP)."""
        out = []
        for r in rows:
            mb = self._build([r], [0.0])
            out.append(self._forward(self.policy, mb).log_probs.tolist())
        self._reshard_after_inference(self.policy)
        return out


    def sync_probe(self, prompt_ids: list[int], continuation_ids: list[int], version: int) -> SyncProbe:
        """The weight-sync canary's reference (memrl/train/sync_check.py): the policy's log-probs of the
        continuation, computed as old log-probs are, while it holds weight version `version` (a collective
        under FSDP)."""
        tokens = [*prompt_ids, *continuation_ids]
        n = len(continuation_ids)
        row = TrainRow(tokens=tokens, response_length=n, loss_mask=[1] * n, rollout_log_probs=[0.0] * n,
                       advantage=0.0, group_id="sync-probe", trajectory_id="sync-probe", turn_index=0,
                       rollout_id=version)
        (log_probs,) = self.log_probs([row])
        config = self.model.config
        dtype = "bfloat16" if self.autocast is not None else str(next(self.model.parameters()).dtype)
        return SyncProbe(prompt_ids=list(prompt_ids), continuation_ids=list(continuation_ids),
                         temperature=self.cfg.sampling.temperature, log_probs=log_probs, version=version,
                         dtype=dtype.removeprefix("torch."), layers=config.num_hidden_layers,
                         width=max(config.hidden_size, getattr(config, "intermediate_size", config.hidden_size)))


class ActorWeights:
    """A one-process actor's current weights as a `WeightSource` (memrl/engines/base.py): the policy's
    own tensors for an in-process engine (which copies them), or a Hugging Face folder written on demand
    for a served one (which reloads it)."""

    def __init__(self, actor: Actor, folder: Path, tokenizer: Any = None) -> None:
        self.actor, self.folder, self.tokenizer = actor, folder, tokenizer

    def whole_weights(self) -> dict[str, Tensor]:
        return self.actor.policy_weights()

    def saved_folder(self) -> str:
        return str(self.actor.save_pretrained(self.folder, self.tokenizer))
