"""The training loop (docs/design.md, "One rollout step"), one process by default:

    for rollout_id in range(start, num_rollout):
        records = data.batch(rollout_id)                     # same ids after a resume
        out     = generate_function(ctx, records)            # async MemAgent rollout, rewards
        rows    = convert_function(out.trajectories, ...)    # validate -> GRPO -> expand (1:N)
        queue.put(rollout_id, rows, out.train_row_count)     # exact row count announced
        metrics = actor.train_rollout(queue.get_rollout(rollout_id))
        engine  <- actor weights; log; checkpoint

Rows saved (converted), transferred (put in the queue) and consumed (trained on) are counted every step
and must be equal; a mismatch stops the run with both numbers.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from tqdm.auto import tqdm

from memrl.config import Config, ConfigError, import_object, load_pretrained
from memrl.memagent.rollout import RolloutContext
from memrl.train.actor import Actor, NonFiniteUpdateError
from memrl.train.logging import RunLogger, StageTimer, device_stats
from memrl.train.queue import TransferQueue
from memrl.types import RolloutOutput, Trajectory

log = logging.getLogger("memrl.train")


class TrainingError(RuntimeError):
    """The loop cannot go on; the message says which step and why."""


class DataSource:
    """Deterministic batches: rollout id -> the same questions on every run and after every resume.

    Questions are taken in the file's frozen order; each pass over the set (an epoch) after the first is
    shuffled with a seed derived from `seed` and the epoch number, so the cursor is a pure function of
    the rollout id.
    """

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
        start = rollout_id * self.batch_size
        out = []
        for k in range(start, start + self.batch_size):
            epoch, pos = divmod(k, len(self.records))
            out.append(self.records[self._epoch_order(epoch)[pos]])
        return out


@dataclass
class TrainOptions:
    run_root: Path
    load: Path | None = None
    start_rollout_id: int | None = None
    save_rollouts: bool = False
    replay_rollouts: Path | None = None
    progress: bool = True


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)


def trajectory_log_record(traj: Trajectory, tokenizer: Any) -> dict[str, Any]:
    """What a researcher reads per trajectory: the memory texts and answer, lengths, reward, status."""
    return {
        "trajectory_id": traj.trajectory_id, "question_id": traj.metadata.get("question_id"),
        "sample_index": traj.sample_index, "status": traj.status, "reward": traj.reward, "answer": traj.answer,
        "golds": traj.metadata.get("golds"), "error": traj.error,
        "turns": [{"kind": t.kind, "prompt_length": len(t.prompt_ids), "response_length": t.response_length,
                   "finish_reason": t.finish_reason,
                   "text": tokenizer.decode(t.response_ids, skip_special_tokens=True)} for t in traj.turns],
    }


def save_raw_rollout(directory: Path, rollout_id: int, out: RolloutOutput) -> Path:
    """Raw trajectories of one step (debug replay input), written atomically."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"rollout_{rollout_id:07d}.jsonl"
    tmp = path.with_suffix(".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps({"rollout_id": rollout_id, "train_row_count": out.train_row_count,
                            "metrics": out.metrics}) + "\n")
        for traj in out.trajectories:
            f.write(json.dumps(traj.to_dict()) + "\n")
    tmp.replace(path)
    return path


def load_raw_rollout(directory: Path, rollout_id: int) -> RolloutOutput:
    path = Path(directory) / f"rollout_{rollout_id:07d}.jsonl"
    if not path.is_file():
        raise TrainingError(f"replay: {path} does not exist (saved with --save-rollouts?)")
    lines = path.read_text(encoding="utf-8").splitlines()
    header = json.loads(lines[0])
    return RolloutOutput([Trajectory.from_dict(json.loads(line)) for line in lines[1:]],
                         metrics=header.get("metrics", {}), train_row_count=header["train_row_count"])


def build_engine(cfg: Config, model: torch.nn.Module, tokenizer: Any, progress: bool) -> Any:
    """The rollout engine: a private copy of the policy (local), or a client of a server."""
    r = cfg.rollout
    if r.engine == "openai":
        from memrl.engines.openai import OpenAIEngine

        if not r.server_url:
            raise ConfigError("rollout.engine = 'openai' needs rollout.server_url")
        return OpenAIEngine(r.server_url, api_key=r.api_key, max_concurrency=r.max_concurrency,
                            timeout_s=r.request_timeout_s)
    import copy

    from memrl.engines.hf import HFEngine

    dtype = None if cfg.model.dtype == "auto" else cfg.model.dtype
    device = None if cfg.model.device == "auto" else cfg.model.device
    if device is None and torch.cuda.is_available():
        device = "cuda"
    if dtype is None and (device == "cuda"):
        dtype = "bfloat16"
    return HFEngine(copy.deepcopy(model), tokenizer, max_batch_size=r.max_batch_size,
                    max_batch_tokens=r.max_batch_tokens, device=device, dtype=dtype, progress=False,
                    request_timeout_s=r.request_timeout_s)  # a stuck local batch fails its requests, no hang


def sync_weights(engine: Any, actor: Actor, run_root: Path, tokenizer: Any,
                 loop: asyncio.AbstractEventLoop) -> None:
    """After every step the engine generates with the actor's current weights."""
    if hasattr(engine, "update_weights_from_model"):
        engine.update_weights_from_model(actor.model)
        return
    # A served engine reloads from disk (as SGLang's update_weights_from_disk does).
    path = actor.save_pretrained(run_root / "weights_sync", tokenizer)
    loop.run_until_complete(engine.reload_weights(str(path)))


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


def checkpoint_state(cfg: Config, rollout_id: int, global_step: int) -> dict[str, Any]:
    """What a checkpoint records besides tensors: where to resume and with which config."""
    return {"rollout_id": rollout_id, "next_rollout_id": rollout_id + 1, "global_step": global_step,
            "data_cursor": (rollout_id + 1) * cfg.train.rollout_batch_size, "config": cfg.model_dump(mode="json")}


def pad_token_id(tokenizer: Any) -> int:
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


class Trainer:
    def __init__(self, cfg: Config, options: TrainOptions, model: torch.nn.Module | None = None,
                 tokenizer: Any = None, records: Sequence[Any] | None = None) -> None:
        self.cfg, self.opt = cfg, options
        seed_everything(cfg.train.seed)
        self.tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        model = model if model is not None else load_policy(cfg)
        self.data = DataSource(records if records is not None else load_train_records(cfg),
                               cfg.train.rollout_batch_size, cfg.train.seed)
        device = torch.device("cuda" if torch.cuda.is_available() and cfg.model.device != "cpu" else "cpu")
        # The reference model is the starting policy, also on resume: the actor copies it before any load.
        self.actor = Actor(model, cfg, pad_token_id=pad_token_id(self.tokenizer), device=device, load=options.load)
        self.start_rollout_id = 0
        if (state := self.actor.loaded_state) is not None:
            self.start_rollout_id = int(state.get("next_rollout_id", state["rollout_id"] + 1))
        if options.start_rollout_id is not None:
            self.start_rollout_id = options.start_rollout_id
        self._load_plugins()
        self._warn_about_top_p()
        self.queue = TransferQueue.from_config(cfg.queue, cfg.train.rollout_batch_size, cfg.rollout.n_samples)
        self.engine = None if options.replay_rollouts else build_engine(cfg, self.actor.model, self.tokenizer,
                                                                      options.progress)

    def _warn_about_top_p(self) -> None:
        if self.cfg.rollout.top_p < 1.0:
            # Renormalizing over the nucleus in the trainer would make a token at the nucleus edge -inf
            # (bf16 engine vs fp32 trainer can disagree on the edge), and the k3 KL of it infinite.
            log.warning("rollout.top_p = %g < 1: the engine's log-probs are under the nucleus, the trainer's "
                        "under the full softmax (temperature applied); logprob_gap and the PPO ratio include "
                        "that difference. Set rollout.top_p = 1 for matching log-probs.", self.cfg.rollout.top_p)

    def _load_plugins(self) -> None:
        """The extension points by import path (MemAgent's by default); expanded = 1:N rows per trajectory."""
        plugins = self.cfg.plugins
        self.generate_fn = import_object(plugins.generate_function)
        self.convert_fn = import_object(plugins.convert_function)
        self.reward_fn = import_object(plugins.reward_function)
        self.expanded = self.cfg.queue.train_sample_expansion_factor > 1

    def _rollout(self, loop: asyncio.AbstractEventLoop, rollout_id: int) -> RolloutOutput:
        if self.opt.replay_rollouts is not None:
            return load_raw_rollout(self.opt.replay_rollouts, rollout_id)
        ctx = RolloutContext(engine=self.engine, tokenizer=self.tokenizer, config=self.cfg, rollout_id=rollout_id,
                             reward_function=self.reward_fn, progress=self.opt.progress)
        return loop.run_until_complete(self.generate_fn(ctx, self.data.batch(rollout_id)))

    def step(self, loop: asyncio.AbstractEventLoop, rollout_id: int, logger: RunLogger) -> dict[str, float]:
        timer = StageTimer()
        try:
            with timer("rollout"):
                out = self._rollout(loop, rollout_id)
            if self.expanded and out.train_row_count is None:
                raise TrainingError(
                    f"rollout {rollout_id}: generate_function returned no train_row_count while "
                    f"queue.train_sample_expansion_factor = {self.cfg.queue.train_sample_expansion_factor} (1:N "
                    f"expansion); return RolloutOutput(train_row_count=...) or set the factor to 1 for a 1:1 rollout")
            with timer("convert"):
                rows = self.convert_fn(out.trajectories, self.cfg.algorithm, rollout_id)
            expected = out.train_row_count if out.train_row_count is not None else len(out.trajectories)
            if len(rows) != expected:
                raise TrainingError(f"rollout {rollout_id}: the converter produced {len(rows)} rows, the rollout "
                                    f"announced {expected}")
            self.queue.put(rollout_id, rows, train_row_count=out.train_row_count, final=out.train_row_count is None)
        except BaseException as error:
            self.queue.fail(rollout_id, error)  # wakes any waiter on this rollout with the error
            raise
        if self.opt.save_rollouts:
            save_raw_rollout(self.opt.run_root / "rollouts_raw", rollout_id, out)
        with timer("train"):
            consumed = self.queue.get_rollout(rollout_id, timeout_s=self.cfg.queue.timeout_s)
            try:
                metrics = self.actor.train_rollout(consumed, rollout_id)
            except NonFiniteUpdateError as error:  # the step was not applied; stop before any checkpoint
                raise TrainingError(str(error)) from error
        with timer("sync"):
            if self.engine is not None:
                sync_weights(self.engine, self.actor, self.opt.run_root, self.tokenizer, loop)
        stats = self.queue.stats(rollout_id)
        counts = {"rows/saved": float(len(rows)), "rows/transferred": float(stats["rows_put"]),
                  "rows/consumed": metrics["rows/consumed"]}
        if len(set(counts.values())) != 1:
            raise TrainingError(f"rollout {rollout_id}: row counts differ: {counts}")
        metrics.update(out.metrics)
        metrics.update(counts)
        metrics.update(timer.metrics())
        metrics["perf/tokens_per_s"] = out.metrics.get("tokens/generated", 0.0) / max(timer.seconds["rollout"], 1e-9)
        metrics.update(device_stats())
        logger.log_metrics(rollout_id, metrics)
        logger.log_rollout(rollout_id, [trajectory_log_record(t, self.tokenizer) for t in out.trajectories + out.dropped])
        return metrics

    def save(self, rollout_id: int) -> Path:
        state = checkpoint_state(self.cfg, rollout_id, self.actor.global_step)
        return self.actor.save_checkpoint(self.opt.run_root, rollout_id, state, tokenizer=self.tokenizer)

    def run(self) -> list[dict[str, float]]:
        cfg = self.cfg
        self.opt.run_root.mkdir(parents=True, exist_ok=True)
        history: list[dict[str, float]] = []
        loop = asyncio.new_event_loop()
        logger = RunLogger(self.opt.run_root, cfg, start_rollout_id=self.start_rollout_id)
        bar = tqdm(range(self.start_rollout_id, cfg.train.num_rollout), desc="train", unit="step",
                   disable=not self.opt.progress)
        last_saved = None
        try:
            for rollout_id in bar:
                metrics = self.step(loop, rollout_id, logger)
                history.append(metrics)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                rows=int(metrics["rows/consumed"]))
                last = rollout_id == cfg.train.num_rollout - 1
                if (rollout_id + 1) % cfg.train.save_interval == 0 or last:
                    last_saved = self.save(rollout_id)
        except KeyboardInterrupt:
            log.warning("interrupted: logs are complete up to the last finished step; last checkpoint: %s", last_saved)
            raise
        finally:
            bar.close()
            logger.write_reward_summary()
            logger.close()
            if self.engine is not None:
                loop.run_until_complete(self.engine.close())
            loop.close()
            self.queue.close()
        return history


def train(cfg: Config, options: TrainOptions, **kwargs: Any) -> list[dict[str, float]]:
    return Trainer(cfg, options, **kwargs).run()
