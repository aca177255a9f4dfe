"""What a training run starts from, the same in one process and on Ray (`local_parts` and `ray_parts`
both begin with `run_start`, so the runtimes cannot drift apart): seeds, tokenizer, policy, the training
questions in their deterministic order, the task, where a resumed run starts, and the one records-to-rows
path every rollout source runs (`convert_rollout`).
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from memrl.config import Config, ConfigError, load_pretrained
from memrl.errors import MemrlError
from memrl.task import Task, load_task, rows_per_trajectory
from memrl.train.checkpoint import read_state_file, resolve_checkpoint
from memrl.train.queue import TransferQueue
from memrl.types import RolloutOutput

log = logging.getLogger("memrl.train")


class TrainingError(RuntimeError, MemrlError):
    """The loop cannot go on; the message says which step and why."""


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def load_tokenizer(cfg: Config) -> Any:
    from transformers import AutoTokenizer

    if not cfg.model.tokenizer_path:
        raise ConfigError("model.path (or model.tokenizer) is not set; pass --set model.path=DIR")
    what = "tokenizer" if cfg.model.tokenizer else "model"
    return load_pretrained(AutoTokenizer, cfg.model.tokenizer_path, what, revision=cfg.model.revision)


def load_policy(cfg: Config) -> torch.nn.Module:
    """The starting policy in fp32 (the actor trains fp32 master weights; autocast does bf16 on GPU)."""
    from transformers import AutoModelForCausalLM

    if not cfg.model.path:
        raise ConfigError("model.path is not set; pass --set model.path=DIR")
    return load_pretrained(AutoModelForCausalLM, cfg.model.path, revision=cfg.model.revision, dtype=torch.float32)


def load_train_records(cfg: Config) -> list[Any]:
    from memrl.data.records import load_questions

    if not cfg.data.dir:
        raise ConfigError("data.dir is not set; pass --set data.dir=DIR (see `memrl prepare-data`)")
    return load_questions(Path(cfg.data.dir) / cfg.data.train_file, verify=cfg.data.verify_manifest)


def pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class DataSource:
    """Deterministic batches: rollout id -> the same questions on every run and after every resume. The
    file's order first, then each epoch shuffled by (seed, epoch): the cursor is a pure function of the
    rollout id, and it never runs out (`train.num_rollout` alone ends a run)."""

    def __init__(self, records: Sequence[Any], batch_size: int, seed: int) -> None:
        if not records:
            raise TrainingError("the training set is empty; check data.dir and data.train_file")
        self.records, self.batch_size, self.seed = list(records), batch_size, seed

    def _epoch_order(self, epoch: int) -> list[int]:
        order = list(range(len(self.records)))
        if epoch > 0:
            random.Random(f"{self.seed}:{epoch}").shuffle(order)
        return order

    def batch(self, rollout_id: int) -> list[Any]:
        n, start = len(self.records), rollout_id * self.batch_size
        return [self.records[self._epoch_order(k // n)[k % n]] for k in range(start, start + self.batch_size)]

    def extra_batch(self, rollout_id: int, chunk: int, size: int) -> list[Any]:
        """Chunk `chunk` (1, 2, ...) of `size` further questions (dynamic sampling): a shuffle seeded by
        (seed, rollout id, chunk), beside the main cursor, which it never moves (a resume draws the same)."""
        order = list(range(len(self.records)))
        random.Random(f"{self.seed}:oversample:{rollout_id}:{chunk}").shuffle(order)
        return [self.records[order[k % len(order)]] for k in range(size)]


def convert_rollout(out: RolloutOutput, tokenizer: Any, algorithm: Any, task: Task, rollout_id: int) -> RolloutOutput:
    """The one records-to-rows path of every rollout source, run where the batch was generated: per-turn
    scores (`memrl.rl.turn_rewards`), then the task's converter; the rows and the advantages the logs show
    (read off the rows) go into `out`."""
    from memrl.rl.turn_rewards import score_turns

    out.metrics.update(score_turns(out.trajectories, tokenizer, algorithm, task))
    start = time.perf_counter()
    rows = task.convert(out.trajectories, algorithm, rollout_id)
    out.metrics["time/convert_s"] = time.perf_counter() - start
    # The rollout says how many rows it expands to (1:N); one that says nothing is 1:1.
    expected = out.train_row_count if out.train_row_count is not None else len(out.trajectories)
    if len(rows) != expected:
        announced = "announced" if out.train_row_count is not None else "announced no train_row_count, so 1:1:"
        raise TrainingError(f"rollout {rollout_id}: the converter produced {len(rows)} rows, the rollout "
                            f"{announced} {expected}; a 1:N generate function returns "
                            "RolloutOutput(train_row_count=...)")
    out.rows = rows
    out.advantages = {r.trajectory_id: r.trajectory_advantage for r in rows if r.trajectory_advantage is not None}
    out.turn_advantages = {(r.trajectory_id, r.turn_index): r.advantage for r in rows}
    return out


def start_rollout_id(cfg: Config, load: Path | None, requested: int | None) -> int:
    """The first rollout step: `--start-rollout-id`, else the one after the checkpoint `load`, else 0; read
    before any model loads. A start outside [0, train.num_rollout) is a TrainingError naming what to set
    (a run of 0 steps would end "done" with nothing trained)."""
    checkpoint = resolve_checkpoint(load) if load is not None else None
    if requested is not None:
        start, origin = requested, f"--start-rollout-id is {requested}"
    elif checkpoint is not None:
        state = read_state_file(checkpoint)
        start = int(state.get("next_rollout_id", state["rollout_id"] + 1))
        origin = f"checkpoint {checkpoint} is at rollout {start}"
    else:
        start, origin = 0, "a new run starts at rollout 0"
    if start < 0:
        raise TrainingError(f"{origin}: rollout ids start at 0; pass --start-rollout-id 0 or more")
    if start >= cfg.train.num_rollout:
        lower = " or a lower --start-rollout-id" if requested is not None else ""
        raise TrainingError(f"{origin} and train.num_rollout is {cfg.train.num_rollout}: nothing to train; raise "
                            f"train.num_rollout above {start} (--set train.num_rollout=N){lower}")
    return start


def checkpoint_state(cfg: Config, rollout_id: int) -> dict[str, Any]:
    """What a checkpoint records besides tensors (the actor adds its optimizer step count)."""
    return {"rollout_id": rollout_id, "next_rollout_id": rollout_id + 1,
            "data_cursor": (rollout_id + 1) * cfg.train.rollout_batch_size, "config": cfg.model_dump(mode="json")}


def warn_about_top_p(cfg: Config) -> None:
    if cfg.sampling.top_p < 1.0:
        # Renormalizing over the nucleus in the trainer would make a token at the nucleus edge -inf
        # (bf16 engine vs fp32 trainer can disagree on the edge), and the k3 KL of it infinite.
        log.warning("sampling.top_p = %g < 1: the engine's log-probs are under the nucleus, the trainer's "
                    "under the full softmax (temperature applied); logprob_gap and the PPO ratio include "
                    "that difference. Set sampling.top_p = 1 for matching log-probs.", cfg.sampling.top_p)


@dataclass(frozen=True)
class RunStart:
    first_rollout_id: int
    tokenizer: Any
    data: DataSource
    task: Task
    queue: TransferQueue


def run_start(cfg: Config, load: Path | None, requested_start: int | None, tokenizer: Any = None,
              records: Sequence[Any] | None = None) -> RunStart:
    """The first rollout step (read before any model loads), then every generator seeded, the tokenizer, the
    data order, the task and the transfer queue (`tokenizer` and `records` replace what the config names)."""
    first = start_rollout_id(cfg, load, requested_start)
    seed_everything(cfg.train.seed)
    tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
    records = records if records is not None else load_train_records(cfg)
    # Room for the rollouts in flight at once: this step's and the k the pipeline may generate ahead.
    in_flight = cfg.train.rollout_batch_size * (cfg.train.max_staleness + 1)
    queue = TransferQueue.from_config(cfg.queue, in_flight, cfg.sampling.n_samples, rows_per_trajectory(cfg))
    start = RunStart(first, tokenizer, DataSource(records, cfg.train.rollout_batch_size, cfg.train.seed),
                     load_task(cfg), queue)
    warn_about_top_p(cfg)
    return start
