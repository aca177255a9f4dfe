"""`memrl train --runtime ray`: the controller's loop, with its pieces on Ray actors.

`RayTrainer` *is* the one-process `Trainer` (same `step`, `run`, logs, row-count checks); only what the
loop talks to changes:

    trainer.engine  -> RolloutPool    rollout workers; the step's questions are split across them
    trainer.queue   -> RemoteQueue    the TransferQueue in a Ray actor
    trainer.actor   -> TrainerGroup   trainer workers (one torch.distributed group, DDP or FSDP2); the
                                      driver plans each optimizer step (`plan_rollout`) and sends every
                                      rank its share
    trainer.save    -> every rank gathers, rank 0 writes the checkpoint (same files as the one-process run)

After every step the loop's `sync_weights` calls `RolloutPool.update_weights_from_model(TrainerGroup)`:
the whole weights (gathered from the shards under FSDP) go from rank 0 to every rollout worker through the
object store, never through the driver (or, for served engines, through a Hugging Face folder that each
server reloads).

Faults: every remote wait has a timeout (`ray.*_timeout_s`); a worker that dies, raises or does
not answer fails the step with an error naming it (`WorkerError`). Checkpoints are written atomically
by rank 0, so the last complete one stays loadable; resume with `--load` as in the one-process run.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from memrl.config import Config, ConfigError, RayConfig
from memrl.distributed.queue_actor import RemoteQueue
from memrl.distributed.workers import (
    RolloutWorker,
    TrainerWorker,
    WorkerError,
    merge_rollout_outputs,
    wait_named,
)
from memrl.rl.validate import validate_train_rows
from memrl.train.actor import plan_rollout
from memrl.train.checkpoint import STATE_FILE, resolve_checkpoint
from memrl.train.controller import (
    DataSource,
    Trainer,
    TrainOptions,
    checkpoint_state,
    load_raw_rollout,
    load_tokenizer,
    load_train_records,
    pad_token_id,
    seed_everything,
)
from memrl.types import RolloutOutput, TrainRow

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
    """The `Actor` interface the loop uses (`train_rollout`, `global_step`, `model`) over the trainer workers."""

    def __init__(self, ray: Any, cfg: Config, options: list[dict], pad_token_id: int, model_ref: Any,
                 load: Path | None, handles: list[Any]) -> None:
        self.ray, self.cfg, self.settings, self.pad_token_id = ray, cfg, cfg.ray, pad_token_id
        settings = cfg.ray
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

    @property
    def model(self) -> TrainerGroup:
        """What the loop's `sync_weights` hands to the engine: the group itself (weights live on rank 0)."""
        return self

    def train_rollout(self, rows: list[TrainRow], rollout_id: int) -> dict[str, float]:
        """Plan the step once (same plan as one process with train.dp_size ranks); each rank trains its share."""
        validate_train_rows(rows)
        plan = plan_rollout(rows, self.cfg, self.pad_token_id, rollout_id)
        tokens = sum(len(r.tokens) for r in rows)
        refs = {name: w.train.remote([shares[rank] for shares in plan], rollout_id, len(rows), tokens)
                for rank, (name, w) in enumerate(zip(self.names, self.workers, strict=True))}
        results = wait_named(refs, self.settings.train_timeout_s, f"rollout {rollout_id}: train")
        metrics = dict(results[self.names[0]])  # metrics are all-reduced: every rank reports the same
        self.global_step = int(metrics.pop("global_step"))
        return metrics

    def call_all(self, method: str, *args: Any, what: str) -> Any:
        """`method` on every rank at once (a collective under FSDP); rank 0's result."""
        refs = {name: getattr(w, method).remote(*args) for name, w in zip(self.names, self.workers, strict=True)}
        return wait_named(refs, self.settings.sync_timeout_s, what)[self.names[0]]


class RolloutPool:
    """The engine the loop sees: rollout workers generating slices of each step's batch."""

    def __init__(self, ray: Any, cfg: Config, options: list[dict], tokenizer: Any, model_ref: Any,
                 run_root: Path, handles: list[Any]) -> None:
        self.ray, self.cfg, self.settings, self.run_root = ray, cfg, cfg.ray, run_root
        settings = cfg.ray
        urls = settings.rollout_server_urls or (None,) * len(options)
        self.workers = [ray.remote(RolloutWorker).options(**opt).remote(cfg, i, tokenizer, model_ref, url)
                        for i, (opt, url) in enumerate(zip(options, urls, strict=True))]
        handles.extend(self.workers)
        names = [f"rollout worker {i}" for i in range(len(self.workers))]
        pids = wait_named({n: w.ping.remote() for n, w in zip(names, self.workers, strict=True)},
                          settings.startup_timeout_s, "rollout worker start")
        self.names = [f"{n} (pid {pids[n]})" for n in names]

    def generate(self, rollout_id: int, records: Sequence[Any]) -> RolloutOutput:
        """The step's batch cut into contiguous slices, one per worker, merged back in batch order."""
        n = min(len(self.workers), len(records))
        bounds = [k * len(records) // n for k in range(n + 1)]
        refs = {self.names[k]: self.workers[k].generate.remote(rollout_id, list(records[bounds[k]:bounds[k + 1]]),
                                                                bounds[k]) for k in range(n)}
        results = wait_named(refs, self.settings.rollout_timeout_s, f"rollout {rollout_id}: generate")
        out = merge_rollout_outputs([results[self.names[k]] for k in range(n)])
        return out

    def update_weights_from_model(self, group: TrainerGroup) -> None:
        """Rank 0's weights into every rollout engine (the loop's `sync_weights` calls this every step)."""
        timeout = self.settings.sync_timeout_s
        if self.cfg.rollout.engine == "openai":
            # A served engine reloads from disk (as SGLang's update_weights_from_disk does): shared storage.
            path = str(self.run_root / "weights_sync")
            group.call_all("save_pretrained", path, what="weight sync (save)")
            refs = {n: w.reload_weights.remote(path) for n, w in zip(self.names, self.workers, strict=True)}
        else:
            state = group.call_all("publish_weights", what="weight sync (gather)")  # an object ref
            refs = {n: w.load_weights.remote(state) for n, w in zip(self.names, self.workers, strict=True)}
        wait_named(refs, timeout, "weight sync")

    async def close(self) -> None:
        # Killed, not asked: a worker stuck in a generation would make a polite close wait for it.
        for worker in self.workers:
            self.ray.kill(worker)


class RayTrainer(Trainer):
    """The controller's `Trainer` with its engine, queue, actor and checkpoint save on Ray actors.

    The driver holds no policy weights (unless `model` is given, to be shipped to the workers): trainer
    and rollout workers load `model.path` themselves.
    """

    def __init__(self, cfg: Config, options: TrainOptions, handles: list[Any],
                 model: torch.nn.Module | None = None, tokenizer: Any = None,
                 records: Sequence[Any] | None = None) -> None:
        ray = _import_ray()
        self.cfg, self.opt = cfg, options
        seed_everything(cfg.train.seed)
        if model is None and not cfg.model.path:
            raise ConfigError("model.path is not set; pass --set model.path=DIR")
        self.tokenizer = tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        self.data = DataSource(records if records is not None else load_train_records(cfg),
                               cfg.train.rollout_batch_size, cfg.train.seed)
        pad_id = pad_token_id(tokenizer)
        self.start_rollout_id = 0
        load = resolve_checkpoint(options.load) if options.load is not None else None
        if load is not None:
            state = json.loads((load / STATE_FILE).read_text())
            self.start_rollout_id = int(state.get("next_rollout_id", state["rollout_id"] + 1))
        if options.start_rollout_id is not None:
            self.start_rollout_id = options.start_rollout_id
        self._load_plugins()
        self._warn_about_top_p()
        self.queue = RemoteQueue(cfg.queue, cfg.train.rollout_batch_size, cfg.rollout.n_samples,
                                 cfg.ray.sync_timeout_s)
        handles.append(self.queue.actor)
        model_ref = ray.put(model) if model is not None else None
        trainer_opts, rollout_opts = _scheduling(ray, cfg.ray, cfg.train.dp_size, handles)
        self.actor = TrainerGroup(ray, cfg, trainer_opts, pad_id, model_ref, load, handles)
        self.engine = None
        if not options.replay_rollouts:
            self.engine = RolloutPool(ray, cfg, rollout_opts, tokenizer, model_ref, options.run_root, handles)
            # Start from the trainer's weights (a loaded checkpoint's), as the one-process engine does.
            self.engine.update_weights_from_model(self.actor)

    def _rollout(self, loop: Any, rollout_id: int) -> RolloutOutput:
        if self.opt.replay_rollouts is not None:
            return load_raw_rollout(self.opt.replay_rollouts, rollout_id)
        return self.engine.generate(rollout_id, self.data.batch(rollout_id))

    def save(self, rollout_id: int) -> Path:
        # global_step is filled in by rank 0, whose actor counts the optimizer steps
        state = checkpoint_state(self.cfg, rollout_id, global_step=0)
        return Path(self.actor.call_all("save", str(self.opt.run_root), rollout_id, state, self.tokenizer,
                                        what=f"checkpoint {rollout_id}"))


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
    """`memrl train --runtime ray [--ray-address ADDR]`: the training loop on Ray.

    Joins the cluster at `ray_address` (or uses a Ray already initialised in this process), else starts a
    local one and shuts it down at the end. Every actor this run created is killed at the end, also on
    failure. Workers, resources and timeouts come from the config's `ray` section; `kwargs` (model,
    tokenizer, records) are as for `Trainer`. Returns the per-step metrics, as `memrl.train.controller.train`
    does.
    """
    started = start_ray(ray_address, cfg.ray, cfg.train.dp_size)
    ray = _import_ray()
    handles: list[Any] = []
    try:
        return RayTrainer(cfg, options, handles, **kwargs).run()
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
