"""The training loop, the only one (docs/design.md, "One rollout step"): generate, put the rows, train,
sync the engine, check the sync (memrl/train/sync_check.py), log, validate, checkpoint. It talks to
`TrainingParts`, built by `local_parts` in one process or `memrl.distributed.runtime.ray_parts` on Ray,
and asks only what a part declares, never its kind. Rows saved, transferred and consumed must be equal
every step. With `train.max_staleness = k >= 1` generation runs ahead in a producer thread
(memrl/train/pipeline.py) and the loop publishes a frozen copy of the weights after each step instead of
syncing the engine itself.
"""

from __future__ import annotations

import logging
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import torch
from tqdm.auto import tqdm

from memrl.config import Config
from memrl.engines.base import SyncProbe, WeightsInMemory, WeightsOnDisk, WeightSource
from memrl.engines.factory import training_engine
from memrl.rl.dynamic_sampling import GroupFilter, sample_informative_groups
from memrl.rollout import turn_log_records
from memrl.task import Task
from memrl.train.actor import Actor, NonFiniteUpdateError
from memrl.train.checkpoint import prune_checkpoints, read_best, write_best
from memrl.train.pipeline import Producer, WeightBoard, sampling_version
from memrl.train.queue import QueueError, TransferQueue
from memrl.train.run_log import EVAL_METRICS_FILE, RunLogger, StageTimer, device_stats, read_metrics
from memrl.train.setup import (
    DataSource,
    TrainingError,
    checkpoint_state,
    load_policy,
    pad_token_id,
    run_start,
)
from memrl.train.sources import LocalRollout, ReplayRollout, RolloutSource, save_raw_rollout
from memrl.train.sync_check import check_sync, probe_ids
from memrl.train.validation import BestTracker, Validator
from memrl.types import RolloutOutput, TrainRow, Trajectory

log = logging.getLogger("memrl.train")

# How long a stopping run waits for the rollout producer to finish the generation it is in.
PRODUCER_JOIN_S = 30.0
# Under the run root: the overlapped pipeline's weight versions for a served engine, one folder each.
VERSIONS_DIR = "weights_versions"


__all__ = ["Trainer", "TrainingError", "TrainingParts", "TrainOptions", "local_parts", "train"]


def _remove_version_folder(source: WeightSource) -> None:
    if isinstance(source, WeightsOnDisk):
        shutil.rmtree(source.folder, ignore_errors=True)


@dataclass
class TrainOptions:
    run_root: Path
    load: Path | None = None
    start_rollout_id: int | None = None
    save_rollouts: bool = False
    replay_rollouts: Path | None = None
    progress: bool = True


class PolicyTrainer(Protocol):
    """What trains the policy: the `Actor` in this process, or a group of trainer workers. `shares_cpu`:
    it trains on this process's CPU, so an overlapped rollout shares torch's intra-op threads with it."""

    global_step: int
    shares_cpu: bool

    def train_rollout(self, rows: list[TrainRow], rollout_id: int) -> dict[str, float]: ...

    def save_checkpoint(self, run_root: Path, rollout_id: int, state: dict[str, Any],
                        tokenizer: Any = None) -> Path | None: ...

    def weight_source(self, folder: Path, tokenizer: Any = None) -> WeightSource: ...

    def weight_snapshot(self) -> Mapping[str, torch.Tensor]:
        """The whole weights frozen as they are now (the overlapped pipeline samples with them later)."""
        ...

    def sync_probe(self, prompt_ids: list[int], continuation_ids: list[int], version: int) -> SyncProbe: ...


@dataclass
class TrainingParts:
    """Everything the loop talks to. `rows` is the row transport (a TransferQueue of rows, or of references);
    `release` frees what the parts hold beyond their own `close` (Ray actors, placement groups)."""

    tokenizer: Any
    data: DataSource
    rollout: RolloutSource
    rows: TransferQueue
    policy: PolicyTrainer
    task: Task
    start_rollout_id: int
    release: Callable[[], None] = field(default=lambda: None)


def trajectory_log_record(traj: Trajectory, tokenizer: Any, task: Task, out: RolloutOutput) -> dict[str, Any]:
    """What the logs (and `memrl view`) keep per trajectory: turns, answer, reward (and its terms), its GRPO advantage,
    each turn's credit (its row's advantage; None when not trained on) and the task's `log_fields`."""
    turns = turn_log_records(traj, tokenizer)
    for turn, record in zip(traj.turns, turns, strict=True):
        record["advantage"] = out.turn_advantages.get((traj.trajectory_id, turn.index))
    return {
        "trajectory_id": traj.trajectory_id, "question_id": traj.metadata.get("question_id"),
        "question": traj.metadata.get("question"), "group_id": traj.group_id, "sample_index": traj.sample_index,
        "weight_version": traj.metadata.get("weight_version"), "status": traj.status, "reward": traj.reward,
        "reward_terms": traj.metadata.get("reward_terms"),
        "advantage": out.advantages.get(traj.trajectory_id), "answer": traj.answer,
        "golds": traj.metadata.get("golds"), "error": traj.error,
        **task.log_fields(traj, "train"), "turns": turns,
    }


def check_trainable(rollout_id: int, out: RolloutOutput, max_errors: int = 2) -> None:
    """A step with no trajectory to train on (every generation failed: a wrong URL) is a TrainingError with
    the counts and first distinct errors, not the queue's QueueError for a rollout of 0 rows."""
    if out.trajectories:
        return
    failed = [t for t in out.dropped if t.status == "failed"]
    if not failed:
        raise TrainingError(f"rollout {rollout_id}: the generate function returned no trajectory to train on")
    errors = list(dict.fromkeys(t.error or "no error message" for t in failed))[:max_errors]
    raise TrainingError(f"rollout {rollout_id}: no trajectory to train on: {len(failed)} of {len(out.dropped)} "
                        f"trajectories failed (a group with a failure is dropped); first error"
                        f"{'s' if len(errors) > 1 else ''}: {'; '.join(errors)}")


def local_parts(cfg: Config, options: TrainOptions, model: torch.nn.Module | None = None,
                tokenizer: Any = None, records: Sequence[Any] | None = None) -> TrainingParts:
    """The parts of a one-process run; `model`, `tokenizer`, `records` replace what the config names."""
    from memrl.engines.hf import resolve_device_dtype

    start = run_start(cfg, options.load, options.start_rollout_id, tokenizer, records)
    tokenizer = start.tokenizer
    model = model if model is not None else load_policy(cfg)
    device, _ = resolve_device_dtype(cfg.model.device, None)  # `auto` resolved as the engines resolve it
    # The reference model is the starting policy, also on resume: the actor copies it before any load.
    actor = Actor(model, cfg, pad_token_id=pad_token_id(tokenizer), device=device, load=options.load)
    # An in-process engine copies the actor's weights (after any load), so it starts in sync; a served
    # engine serves whatever its server loaded, so a resumed run syncs it to the checkpoint first.
    rollout: RolloutSource = (ReplayRollout(options.replay_rollouts, cfg, tokenizer, start.task)
                              if options.replay_rollouts else
                              LocalRollout(cfg, training_engine(cfg, actor.merged_model(), tokenizer), tokenizer,
                                           start.task, options.progress))
    if options.load is not None and rollout.takes_folders:
        rollout.sync_from(actor.weight_source(options.run_root / "weights_sync", tokenizer))
    return TrainingParts(tokenizer=tokenizer, data=start.data, rollout=rollout, rows=start.queue, policy=actor,
                         task=start.task, start_rollout_id=start.first_rollout_id)


class Trainer:
    """The loop over `parts` (one process by default: `local_parts(cfg, options, **local)`)."""

    def __init__(self, cfg: Config, options: TrainOptions, parts: TrainingParts | None = None, **local: Any) -> None:
        self.cfg, self.opt = cfg, options
        self.parts = parts if parts is not None else local_parts(cfg, options, **local)
        self._producer: Producer | None = None
        self._torch_threads = torch.get_num_threads()
        self.clock: Callable[[], float] = time.monotonic  # what train.time_budget_s is measured on
        self._last_rollout_id = cfg.train.num_rollout - 1  # earlier when the time budget ends the run
        try:  # a missing eval file fails here, before the first step, with nothing left running
            self.validator = self._validator()
            # The weight-sync canary's fixed probe; a replay has no engine to check.
            checks = cfg.train.sync_check and self.parts.rollout.generates
            self._probe_ids = probe_ids(self.parts.tokenizer) if checks else None
        except BaseException:
            self._close_parts()
            raise
        self.best = self._best_so_far()

    def _validator(self) -> Validator | None:
        t = self.cfg.train
        if t.eval_interval == 0 and not t.eval_before_train:
            return None
        if not self.parts.rollout.in_process:
            raise TrainingError("validation during training (train.eval_interval, train.eval_before_train) runs "
                                "on the in-process rollout engine of the local runtime; a replay has no engine. "
                                "Set train.eval_interval = 0 and evaluate checkpoints with memrl eval")
        return Validator(self.cfg, self.opt.run_root, self.parts.tokenizer, self.parts.task, progress=self.opt.progress)

    def _best_so_far(self) -> BestTracker | None:
        """The keep_best tracker, going on from best.json's steps before a resume point."""
        t = self.cfg.train
        if t.keep_best is None:
            return None
        best = read_best(self.opt.run_root)
        carried = best is not None and (best["metric"], best["mode"]) == (t.keep_best, t.keep_best_mode) \
            and best["rollout_id"] < self.parts.start_rollout_id
        return BestTracker(t.keep_best, t.keep_best_mode, float(best["value"]) if carried else None)

    def step(self, rollout_id: int, logger: RunLogger) -> dict[str, float]:
        """One synchronous step: generate, deliver, train, sync the engine, log."""
        out, seconds = self._produce(rollout_id)
        saved = len(out.rows)
        self._deliver(rollout_id, out)
        timer = StageTimer()
        metrics = self._train(rollout_id, timer)
        with timer("sync"):
            # Served engines reload this folder (as SGLang's update_weights_from_disk does); in-process
            # engines copy the weights and never touch it.
            self.parts.rollout.sync_from(self.parts.policy.weight_source(self.opt.run_root / "weights_sync",
                                                                         self.parts.tokenizer))
        if self._probe_ids is not None:
            with timer("sync_check"):  # the trainer still holds the weights the engine just synced to
                metrics["sync_check/max_abs_diff"] = self._check_engine(self._probe(rollout_id + 1))
        return self._finish(rollout_id, out, saved, metrics, {**seconds, **timer.seconds}, logger)

    def _produce(self, rollout_id: int) -> tuple[RolloutOutput, dict[str, float]]:
        """The step's trajectories and rows, and the seconds its stages took (failures wake the queue)."""
        parts, timer = self.parts, StageTimer()
        try:
            with timer("rollout"):
                version = self._version_of(rollout_id)
                out = parts.rollout.generate(rollout_id, parts.data.batch(rollout_id), weight_version=version)
                # A replay reads the step's saved rollout, which was filtered when it was generated.
                if self.cfg.algorithm.filter_groups and parts.rollout.generates:
                    out = self._sample_informative_groups(rollout_id, out, version)
            check_trainable(rollout_id, out)
        except BaseException as error:
            parts.rows.fail(rollout_id, error)  # wakes any waiter on this rollout with the error
            raise
        return out, dict(timer.seconds)

    def _sample_informative_groups(self, rollout_id: int, first: RolloutOutput, version: int) -> RolloutOutput:
        """Dynamic sampling: chunk k takes the slots after the step's batch and the chunks before it, so its
        group ids and request seeds are its own."""
        a, t = self.cfg.algorithm, self.cfg.train
        size = a.over_sampling_batch_size or t.rollout_batch_size

        def generate_more(chunk: int) -> RolloutOutput:
            records = self.parts.data.extra_batch(rollout_id, chunk, size)
            return self.parts.rollout.generate(rollout_id, records, weight_version=version,
                                               slot_offset=t.rollout_batch_size + (chunk - 1) * size)

        return sample_informative_groups(first, generate_more, GroupFilter(
            t.rollout_batch_size, a.max_num_gen_batches, t.num_optimizer_steps,
            turn_rewards_teach=a.turn_reward_alpha < 1))

    def _deliver(self, rollout_id: int, out: RolloutOutput) -> None:
        # The raw file first: once the rows are put (and maybe trained on), a failure could no longer fail
        # this rollout in the queue, and would reach no one.
        if self.opt.save_rollouts:
            save_raw_rollout(self.opt.run_root / "rollouts_raw", rollout_id, out)
        self.parts.rows.put(rollout_id, out.rows, train_row_count=out.train_row_count,
                            final=out.train_row_count is None)

    def _train(self, rollout_id: int, timer: StageTimer, wait_stage: str = "train") -> dict[str, float]:
        with timer(wait_stage):
            consumed = self.parts.rows.get_rollout(rollout_id)
        with timer("train"):
            try:
                return self.parts.policy.train_rollout(consumed, rollout_id)
            except NonFiniteUpdateError as error:  # the step was not applied; stop before any checkpoint
                raise TrainingError(str(error)) from error

    def _finish(self, rollout_id: int, out: RolloutOutput, saved: int, metrics: dict[str, float],
                seconds: dict[str, float], logger: RunLogger) -> dict[str, float]:
        """Check the row ledger (`saved` rows converted), then log the step's metrics and trajectories."""
        parts = self.parts
        stats = parts.rows.stats(rollout_id)
        counts = {"rows/saved": float(saved), "rows/transferred": float(stats["rows_put"]),
                  "rows/consumed": metrics["rows/consumed"]}
        if len(set(counts.values())) != 1:
            raise TrainingError(f"rollout {rollout_id}: row counts differ: {counts}")
        metrics.update(out.metrics)
        metrics.update(counts)
        metrics.update({f"time/{stage}_s": value for stage, value in seconds.items()})
        metrics["perf/tokens_per_s"] = out.metrics.get("tokens/generated", 0.0) / max(seconds["rollout"], 1e-9)
        metrics.update(device_stats())
        logger.log_metrics(rollout_id, metrics)
        logger.log_rollout(rollout_id, [trajectory_log_record(t, parts.tokenizer, parts.task, out)
                                        for t in out.trajectories + out.dropped])
        return metrics

    def _probe(self, version: int) -> SyncProbe:
        """The trainer's side of the weight-sync canary, taken while it holds weight version `version`."""
        assert self._probe_ids is not None  # callers check train.sync_check
        return self.parts.policy.sync_probe(*self._probe_ids, version)

    def _check_engine(self, probe: SyncProbe) -> float:
        """The engine's side, synced to the probe's version: the largest difference (TrainingError beyond)."""
        return check_sync(probe, self.parts.rollout.score_probe(probe), self.cfg.train.sync_check_atol)

    def _sync_checked(self, source: WeightsInMemory | WeightsOnDisk) -> None:
        """The producer's sync to a published version, then the canary the version carries."""
        self.parts.rollout.sync_from(source)
        if source.probe is not None:
            self._check_engine(source.probe)

    def _version_of(self, rollout_id: int) -> int:
        return sampling_version(rollout_id, self.parts.start_rollout_id, self.cfg.train.max_staleness,
                                self._saves_after)

    def _ends_interval(self, rollout_id: int, interval: int) -> bool:
        """Step `rollout_id` is the last of an `interval` (0: never) or of the run."""
        return interval > 0 and ((rollout_id + 1) % interval == 0 or rollout_id == self._last_rollout_id)

    def _budget_ends_after(self, elapsed_s: float, longest_step_s: float) -> bool:
        """train.time_budget_s: whether the run ends now, another step as long as the longest so far not
        fitting in the budget; the rest of the run (validation, checkpoint) then treats this step as its last."""
        budget = self.cfg.train.time_budget_s
        if budget is None or elapsed_s + longest_step_s <= budget:
            return False
        log.warning("train.time_budget_s = %g: stopping after %.0f s, as another step (the longest took %.0f s) "
                    "would not fit", budget, elapsed_s, longest_step_s)
        return True

    def _saves_after(self, rollout_id: int) -> bool:
        return self._ends_interval(rollout_id, self.cfg.train.save_interval)

    def _overlapped_steps(self) -> Callable[[int, RunLogger], dict[str, float]]:
        """Start the producer thread (memrl/train/pipeline.py); return the trainer's side of each step."""
        cfg, parts = self.cfg, self.parts
        start, k, end = parts.start_rollout_id, cfg.train.max_staleness, cfg.train.num_rollout
        board = WeightBoard(start, cfg.queue.timeout_s, discard=_remove_version_folder)

        self._producer = Producer(range(start, end), self._produce, self._deliver, self._sync_checked,
                                  self._version_of, board, parts.rows.fail)
        self._torch_threads = torch.get_num_threads()  # restored when the run ends
        if parts.policy.shares_cpu and self._torch_threads > 1:
            # torch's intra-op pool is shared: half the threads each, so the two stages use different cores.
            torch.set_num_threads(max(1, self._torch_threads // 2))
        self._producer.start()

        def trained_step(rollout_id: int, logger: RunLogger) -> dict[str, float]:
            timer = StageTimer()
            try:  # the trainer idles in "wait_rows" while the producer is behind
                metrics = self._train(rollout_id, timer, wait_stage="wait_rows")
            except QueueError as error:  # the producer failed this rollout: its error, named
                raise TrainingError(f"pipeline: {error}") from error
            version = rollout_id + 1
            if any(self._version_of(r) == version for r in range(version, min(version + k, end - 1) + 1)):
                probe = None
                if self._probe_ids is not None:
                    with timer("sync_check"):  # the trainer's side; the engine's runs in the producer
                        probe = self._probe(version)
                with timer("publish"):
                    board.publish(version, self._frozen_weights(version, probe))
            produced = self._producer.take(rollout_id)
            metrics["pipeline/staleness"] = float(rollout_id - produced.version)
            metrics["pipeline/producer_wait_s"] = produced.waited_s
            return self._finish(rollout_id, produced.out, produced.saved, metrics,
                                {**produced.seconds, **timer.seconds}, logger)

        return trained_step

    def _frozen_weights(self, version: int, probe: SyncProbe | None) -> WeightSource:
        """The policy's weights now, frozen while training goes on: a folder of this version's own for a
        served engine, else a snapshot in memory; either carries the canary `probe` of these weights."""
        if self.parts.rollout.takes_folders:
            folder = self.opt.run_root / VERSIONS_DIR / f"v{version:07d}"
            return WeightsOnDisk(self.parts.policy.weight_source(folder, self.parts.tokenizer).saved_folder(), probe)
        return WeightsInMemory(self.parts.policy.weight_snapshot(), probe)

    def validate(self, rollout_id: int, logger: RunLogger) -> dict[str, float]:
        """Evaluate the eval sets with the engine's weights (those after step `rollout_id`) and log them."""
        assert self.validator is not None and self.parts.rollout.in_process
        timer = StageTimer()
        with timer("eval"):
            metrics = self.validator.validate(rollout_id, self.parts.rollout.engine,
                                              self.parts.rollout.loop.run_until_complete)
        metrics.update(timer.metrics())
        logger.log_eval(rollout_id, metrics)
        return metrics

    def save(self, rollout_id: int) -> Path | None:
        path = self.parts.policy.save_checkpoint(self.opt.run_root, rollout_id, checkpoint_state(self.cfg, rollout_id),
                                                 tokenizer=self.parts.tokenizer)
        if self.cfg.train.keep_last_n is not None:
            prune_checkpoints(self.opt.run_root, self.cfg.train.keep_last_n)
        return path

    def _keep_best(self, rollout_id: int, evaluation: dict[str, float], saved: Path | None) -> Path | None:
        """A new best validation: save the step (if not saved) and point best.json at it; that checkpoint."""
        if self.best is None or not evaluation or not self.best.improves(evaluation):
            return None
        path = saved if saved is not None else self.save(rollout_id)
        value = evaluation[self.best.metric]
        write_best(self.opt.run_root, rollout_id, self.best.metric, value, self.best.mode)
        self.best.best = value
        return path

    def run(self) -> list[dict[str, float]]:
        cfg, parts, t = self.cfg, self.parts, self.cfg.train
        history: list[dict[str, float]] = []
        logger = RunLogger(self.opt.run_root, cfg, start_rollout_id=parts.start_rollout_id, loggers=t.loggers,
                           project_name=t.project_name, experiment_name=t.experiment_name)
        bar = tqdm(range(parts.start_rollout_id, t.num_rollout), desc="train", unit="step",
                   disable=not self.opt.progress)
        last_saved = None
        started, longest = self.clock(), 0.0
        try:
            if self._probe_ids is not None:  # the engine starts with the starting weights (local_parts, ray_parts)
                self._check_engine(self._probe(parts.start_rollout_id))
            steps = self.step if t.max_staleness == 0 else self._overlapped_steps()
            before = parts.start_rollout_id - 1
            if t.eval_before_train and not any(
                    r["rollout_id"] == before for r in read_metrics(self.opt.run_root, EVAL_METRICS_FILE)):
                self.validate(before, logger)  # a resumed run validated its starting weights already
            for rollout_id in bar:
                step_started = self.clock()
                metrics = steps(rollout_id, logger)
                history.append(metrics)
                bar.set_postfix(reward=f"{metrics.get('reward/mean', float('nan')):.3f}",
                                rows=int(metrics["rows/consumed"]))
                longest = max(longest, self.clock() - step_started)
                if rollout_id < t.num_rollout - 1 and self._budget_ends_after(self.clock() - started, longest):
                    self._last_rollout_id = rollout_id
                validates = self._ends_interval(rollout_id, t.eval_interval)
                evaluation = self.validate(rollout_id, logger) if validates else {}
                metrics.update(evaluation)
                saved = self.save(rollout_id) if self._saves_after(rollout_id) else None
                last_saved = self._keep_best(rollout_id, evaluation, saved) or saved or last_saved
                if rollout_id == self._last_rollout_id:
                    break
        except KeyboardInterrupt:
            log.warning("interrupted: logs are complete up to the last finished step; last checkpoint: %s", last_saved)
            raise
        finally:
            bar.close()
            logger.write_reward_summary()
            logger.close()
            self._close_parts()
        return history

    def _close_parts(self) -> None:
        producer_gone = True
        if self._producer is not None:
            # A producer waiting for weights stops at once; one in the middle of a generation gets a short
            # while to finish it (the run is over either way: its rows would not be trained on).
            producer_gone = self._producer.close(timeout_s=PRODUCER_JOIN_S)
            torch.set_num_threads(self._torch_threads)
        try:
            if producer_gone:
                self.parts.rollout.close()
            else:  # its event loop is still running a generation: closing it would raise over the real error
                log.warning("the rollout producer is still generating; its engine is left to the process exit")
        finally:
            self.parts.rows.close()
            self.parts.release()


def train(cfg: Config, options: TrainOptions, **kwargs: Any) -> list[dict[str, float]]:
    return Trainer(cfg, options, **kwargs).run()
