"""`memrl train --runtime ray`: the one training loop (`memrl.train.controller.Trainer`) given parts that
live on Ray actors (`ray_parts`; docs/multinode.md): a `RolloutPool` of rollout workers, the driver's
`TransferQueue` holding one `RowRef` per row (never the rows), and a `TrainerGroup` of trainer ranks that
fetch the rows themselves. Every remote wait has a timeout (`ray.*_timeout_s`) and a worker that dies,
raises or does not answer fails the step with a `WorkerError` naming it.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from memrl.config import Config, ConfigError, RayConfig
from memrl.distributed.rows import RowRef, put_rows
from memrl.distributed.workers import (
    ObjectStoreWeights,
    RolloutWorker,
    TrainerWorker,
    WorkerError,
    merge_rollout_outputs,
    wait_named,
)
from memrl.engines.base import ScoreResult, SyncProbe, WeightsInMemory, WeightsOnDisk, WeightSource
from memrl.engines.factory import served_engine
from memrl.train.checkpoint import resolve_checkpoint
from memrl.train.controller import Trainer, TrainingParts, TrainOptions
from memrl.train.setup import pad_token_id, run_start
from memrl.train.sources import ReplayRollout
from memrl.types import RolloutOutput

log = logging.getLogger("memrl.distributed")


def _import_ray() -> Any:
    try:
        import ray
    except ImportError as error:
        raise ConfigError('train.runtime = "ray" needs Ray: pip install "memrl[ray]" (or "ray[default]")') from error
    return ray


def _scheduling(ray: Any, settings: RayConfig, n_trainers: int, handles: list[Any]) -> tuple[list[dict], list[dict]]:
    """Ray options for each trainer and rollout worker: own resources (`separate`), or trainer i and
    rollout worker i in bundle i of one placement group (`colocated`, e.g. half a GPU each)."""
    tg, rg = settings.gpus(ray.cluster_resources().get("GPU", 0.0))
    tc, rc = settings.trainer_num_cpus, settings.rollout_num_cpus
    n_rollout = settings.num_rollout_workers
    if settings.placement == "separate":
        return ([{"num_cpus": tc, "num_gpus": tg}] * n_trainers, [{"num_cpus": rc, "num_gpus": rg}] * n_rollout)
    from ray.util.placement_group import placement_group
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    if tc + rc <= 0:
        raise ConfigError("ray.placement = 'colocated' needs ray.trainer_num_cpus + ray.rollout_num_cpus > 0")
    bundle = {"CPU": tc + rc, **({"GPU": tg + rg} if tg + rg > 0 else {})}
    group = placement_group([dict(bundle) for _ in range(max(n_trainers, n_rollout))], strategy="PACK")
    handles.append(group)
    try:
        ray.get(group.ready(), timeout=settings.startup_timeout_s)
    except Exception as error:
        raise WorkerError(f"the placement group ({max(n_trainers, n_rollout)} bundles of {bundle}) was not "
                          f"ready within {settings.startup_timeout_s:g}s: the cluster lacks the resources; "
                          f"lower ray.*_num_cpus / *_num_gpus or add nodes") from error

    def opts(i: int, cpus: float, gpus: float) -> dict:
        return {"num_cpus": cpus, "num_gpus": gpus,
                "scheduling_strategy": PlacementGroupSchedulingStrategy(group, placement_group_bundle_index=i)}

    return [opts(i, tc, tg) for i in range(n_trainers)], [opts(i, rc, rg) for i in range(n_rollout)]


class TrainerGroup:
    """The policy trainer the loop sees (`train_rollout`, `save_checkpoint`, `weight_source`), over the
    trainer workers: one torch.distributed group."""

    shares_cpu = False  # it trains in its workers' processes (memrl.train.controller.PolicyTrainer)

    def __init__(self, ray: Any, cfg: Config, options: list[dict], pad_token_id: int, model_ref: Any,
                 load: Path | None, handles: list[Any]) -> None:
        self.settings = settings = cfg.ray
        world = len(options)
        self.workers = [ray.remote(TrainerWorker).options(**opt).remote(cfg, rank, world)
                        for rank, opt in enumerate(options)]
        handles.extend(self.workers)
        self.names = [f"trainer rank {rank}" for rank in range(world)]
        backend = settings.backend
        if backend == "auto":
            backend = "nccl" if options[0].get("num_gpus", 0) > 0 else "gloo"
        timeout = settings.startup_timeout_s
        master = wait_named({self.names[0]: self.workers[0].address.remote()}, timeout, "trainer start")[self.names[0]]
        setups = wait_named({name: w.setup.remote(master, backend, timeout, pad_token_id, model_ref,
                                                  str(load) if load else None)
                             for name, w in zip(self.names, self.workers, strict=True)}, timeout, "trainer setup")
        self.global_step = int(setups[self.names[0]]["global_step"])
        self.names = [f"trainer rank {r} (pid {setups[n]['pid']})" for r, n in enumerate(self.names)]

    def train_rollout(self, rows: list[RowRef], rollout_id: int) -> dict[str, float]:
        """Train one rollout step: every rank gets the row references, fetches the rows and plans the step
        itself (the one process's plan with train.dp_size ranks), so no row passes through the driver."""
        what = f"rollout {rollout_id}: train"
        refs = {name: w.train_streamed.remote(list(rows), rollout_id, self.settings.sync_timeout_s)
                for name, w in zip(self.names, self.workers, strict=True)}
        results = wait_named(refs, self.settings.train_timeout_s, what)
        fetched = {name: int(result.pop("rows/fetched")) for name, result in results.items()}
        if set(fetched.values()) != {len(rows)}:  # the ledger, checked where the rows are consumed
            raise WorkerError(f"{what}: {len(rows)} row references, but the ranks fetched {fetched}")
        metrics = dict(results[self.names[0]])  # metrics are all-reduced: every rank reports the same
        self.global_step = int(metrics.pop("global_step"))
        return metrics

    def _on_every_rank(self, call: Callable[[Any], Any], what: str) -> Any:
        """`call(worker)` (a remote method call) on every rank at once, a collective under FSDP; rank 0's result."""
        refs = {name: call(w) for name, w in zip(self.names, self.workers, strict=True)}
        return wait_named(refs, self.settings.sync_timeout_s, what)[self.names[0]]

    def state_dict(self) -> dict[str, torch.Tensor]:
        """The whole weights, fetched to the caller (for tests; the loop never fetches them)."""
        return self._on_every_rank(lambda w: w.state_dict.remote(), "fetch weights")

    def weight_snapshot(self) -> ObjectStoreWeights:
        """The whole weights as of now: rank 0's immutable copy in the object store, for the pipeline."""
        ref = self._on_every_rank(lambda w: w.publish_weights.remote(), "weight sync (gather)")
        return ObjectStoreWeights(ref, self.settings.sync_timeout_s)

    def sync_probe(self, prompt_ids: list[int], continuation_ids: list[int], version: int) -> SyncProbe:
        """The weight-sync canary's reference, rank 0's (every rank runs the forward: a collective under FSDP)."""
        return self._on_every_rank(lambda w: w.sync_probe.remote(prompt_ids, continuation_ids, version),
                                   "weight sync check")

    def save_pretrained(self, folder: Path, tokenizer: Any = None) -> str:
        return self._on_every_rank(lambda w: w.save_pretrained.remote(str(folder), tokenizer), "weight sync (save)")

    def save_checkpoint(self, run_root: Path, rollout_id: int, state: dict[str, Any], tokenizer: Any = None) -> Path:
        """Rank 0 writes the checkpoint (the one-process run's files); it fills in the optimizer step count."""
        return Path(self._on_every_rank(lambda w: w.save.remote(str(run_root), rollout_id, state, tokenizer),
                                        f"checkpoint {rollout_id}"))

    def weight_source(self, folder: Path, tokenizer: Any = None) -> GroupWeights:
        return GroupWeights(self, folder, tokenizer)


class GroupWeights:
    """The trainer group's current weights as an engine's `WeightSource`: an object-store reference
    (fetched by whoever loads it, never by the driver), or a folder rank 0 writes on demand."""

    def __init__(self, group: TrainerGroup, folder: Path, tokenizer: Any) -> None:
        self.group, self.folder, self.tokenizer = group, folder, tokenizer

    def whole_weights(self) -> ObjectStoreWeights:
        return self.group.weight_snapshot()

    def saved_folder(self) -> str:
        return self.group.save_pretrained(self.folder, self.tokenizer)


class ObjectStoreReplay(ReplayRollout):
    """A replay on Ray: its rows go into the object store as a rollout worker's do, so the trainer ranks
    take every step's rows one way (`TrainerGroup.train_rollout`)."""

    def generate(self, *args: Any, **kwargs: Any) -> RolloutOutput:
        out = super().generate(*args, **kwargs)
        out.rows = put_rows(out.rows)
        return out


class RolloutPool:
    """The rollout source the loop sees: rollout workers generating slices of each step's batch."""

    generates, in_process = True, False  # capabilities the loop reads (memrl.train.sources.RolloutSource)

    def __init__(self, ray: Any, cfg: Config, options: list[dict], tokenizer: Any, model_ref: Any,
                 handles: list[Any]) -> None:
        self.ray, self.settings = ray, cfg.ray
        self.takes_folders = served_engine(cfg)
        urls = self.settings.rollout_server_urls or (None,) * len(options)
        self.workers = [ray.remote(RolloutWorker).options(**opt).remote(cfg, i, tokenizer, model_ref, url)
                        for i, (opt, url) in enumerate(zip(options, urls, strict=True))]
        handles.extend(self.workers)
        names = [f"rollout worker {i}" for i in range(len(self.workers))]
        pids = wait_named({n: w.ping.remote() for n, w in zip(names, self.workers, strict=True)},
                          self.settings.startup_timeout_s, "rollout worker start")
        self.names = [f"{n} (pid {pids[n]})" for n in names]

    def generate(self, rollout_id: int, records: Sequence[Any], weight_version: int | None = None,
                 slot_offset: int = 0) -> RolloutOutput:
        """The batch cut into contiguous slices, one per worker, merged back in batch order; `slot_offset`
        is the batch's first slot in the step (dynamic sampling's further batches start after the first)."""
        n = min(len(self.workers), len(records))
        bounds = [k * len(records) // n for k in range(n + 1)]
        refs = {self.names[k]: self.workers[k].generate.remote(rollout_id, list(records[bounds[k]:bounds[k + 1]]),
                                                                slot_offset + bounds[k], weight_version)
                for k in range(n)}
        results = wait_named(refs, self.settings.rollout_timeout_s, f"rollout {rollout_id}: generate")
        return merge_rollout_outputs([results[self.names[k]] for k in range(n)])

    def sync_from(self, source: WeightSource) -> None:
        """Every rollout engine to `source`'s weights, in the one form its engines take (the pool built them
        from `engine.kind`): a folder for served engines (shared storage), whole weights otherwise."""
        if self.takes_folders:
            payload: WeightSource = WeightsOnDisk(source.saved_folder())
        else:
            payload = WeightsInMemory(source.whole_weights())
        refs = {n: w.sync_from.remote(payload) for n, w in zip(self.names, self.workers, strict=True)}
        wait_named(refs, self.settings.sync_timeout_s, "weight sync")

    def score_probe(self, probe: SyncProbe) -> dict[str, ScoreResult]:
        """Every rollout worker's engine scores the weight-sync probe (each has its own engine or server)."""
        refs = {n: w.score.remote(probe.prompt_ids, probe.continuation_ids, probe.temperature)
                for n, w in zip(self.names, self.workers, strict=True)}
        return wait_named(refs, self.settings.sync_timeout_s, "weight sync check")

    def close(self) -> None:
        # Killed, not asked: a worker stuck in a generation would make a polite close wait for it.
        for worker in self.workers:
            self.ray.kill(worker)


def ray_parts(ray: Any, cfg: Config, options: TrainOptions, handles: list[Any],
              model: torch.nn.Module | None = None, tokenizer: Any = None,
              records: Sequence[Any] | None = None) -> TrainingParts:
    """The parts of a Ray run (every actor it starts is appended to `handles`). The driver holds no
    policy weights (unless `model` is given, to be shipped to the workers): workers load `model.path`."""
    if model is None and not cfg.model.path:
        raise ConfigError("model.path is not set; pass --set model.path=DIR")
    start = run_start(cfg, options.load, options.start_rollout_id, tokenizer, records)  # before any worker starts
    tokenizer = start.tokenizer
    load = resolve_checkpoint(options.load) if options.load is not None else None
    model_ref = ray.put(model) if model is not None else None
    trainer_opts, rollout_opts = _scheduling(ray, cfg.ray, cfg.train.dp_size, handles)
    group = TrainerGroup(ray, cfg, trainer_opts, pad_token_id(tokenizer), model_ref, load, handles)
    if options.replay_rollouts:
        rollout: Any = ObjectStoreReplay(options.replay_rollouts, cfg, tokenizer, start.task)
    else:
        rollout = RolloutPool(ray, cfg, rollout_opts, tokenizer, model_ref, handles)
        # Start from the trainer's weights (a loaded checkpoint's), as the one-process engine does.
        rollout.sync_from(group.weight_source(options.run_root / "weights_sync", tokenizer))
    # The driver's queue holds row references (memrl/distributed/rows.py), the rows stay in the object store.
    return TrainingParts(tokenizer=tokenizer, data=start.data, rollout=rollout, rows=start.queue, policy=group,
                         task=start.task, start_rollout_id=start.first_rollout_id)


def start_ray(ray_address: str | None, settings: RayConfig, dp_size: int) -> bool:
    """Join the cluster at `ray_address`, or start a local one sized for the workers (logical CPUs may
    exceed the machine's: Ray only counts them). Returns True when this call started Ray."""
    ray = _import_ray()
    if ray.is_initialized():
        return False
    path = os.pathsep.join([os.getcwd(), *filter(None, [os.environ.get("PYTHONPATH")])])
    runtime_env = {"env_vars": {"PYTHONPATH": path}}  # plugins importable as from the driver
    if ray_address:
        ray.init(address=ray_address, runtime_env=runtime_env, log_to_driver=True)
    else:
        needed = dp_size * settings.trainer_num_cpus + settings.num_rollout_workers * settings.rollout_num_cpus
        ray.init(num_cpus=max(int(needed + 0.999), os.cpu_count() or 1), include_dashboard=False,
                 runtime_env=runtime_env)
    return True


def run_ray_training(cfg: Config, options: TrainOptions, ray_address: str | None = None,
                     **kwargs: Any) -> list[dict[str, float]]:
    """`memrl train --runtime ray`: the training loop on Ray (`kwargs`: model, tokenizer, records, as for
    `Trainer`); returns the per-step metrics. A Ray this call started is shut down at the end, and every
    actor the run created is killed, also on failure."""
    started = start_ray(ray_address, cfg.ray, cfg.train.dp_size)
    ray = _import_ray()
    handles: list[Any] = []
    try:
        return Trainer(cfg, options, ray_parts(ray, cfg, options, handles, **kwargs)).run()
    finally:
        for handle in reversed(handles):
            try:
                if hasattr(handle, "bundle_specs"):
                    from ray.util.placement_group import remove_placement_group

                    remove_placement_group(handle)
                else:
                    ray.kill(handle)
            except Exception:  # noqa: BLE001 - cleanup must not hide the run's own error
                log.debug("could not release %r", handle, exc_info=True)
        if started:
            ray.shutdown()
