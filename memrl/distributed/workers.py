"""Ray worker classes (plain classes; the runtime wraps them with `ray.remote`) and the bounded wait.

`TrainerWorker` is one data-parallel rank running the one-process `Actor`; `RolloutWorker` runs the
one-process rollout source (`LocalRollout`) over its slice of a step and leaves the rows in the object
store. Every remote wait goes through `wait_named`: a timeout, an error naming the worker, and a return at
the first failure, so one rank that raises never leaves the driver waiting on peers stuck in a collective.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Iterator, Mapping
from datetime import timedelta
from functools import cached_property
from typing import Any

import torch

from memrl.config import Config
from memrl.errors import MemrlError
from memrl.task import load_task
from memrl.train.setup import load_policy, load_tokenizer, seed_everything
from memrl.train.sources import LocalRollout
from memrl.types import RolloutOutput


class WorkerError(RuntimeError, MemrlError):
    """A Ray worker failed a step; the message names the worker and what happened."""


class WorkerDiedError(WorkerError):
    """A worker process died (killed, out of memory, node lost) while the driver waited for it."""


class WorkerTimeoutError(WorkerError, TimeoutError):
    """A worker did not answer within its timeout (raise the matching `ray.*_timeout_s` if it is just slow)."""


def wait_named(refs: dict[str, Any], timeout_s: float, what: str) -> dict[str, Any]:
    """`ray.get` of named object refs, bounded by `timeout_s` in total; fails at the first failure."""
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError, RayError, RayTaskError

    by_ref = {ref: name for name, ref in refs.items()}
    results: dict[str, Any] = {}
    deadline = time.monotonic() + timeout_s
    pending = list(by_ref)
    while pending:
        left = deadline - time.monotonic()
        ready, pending = ray.wait(pending, num_returns=1, timeout=left) if left > 0 else ([], pending)
        if not ready:
            names = ", ".join(sorted(by_ref[r] for r in pending))
            raise WorkerTimeoutError(f"{what}: {names} did not answer within {timeout_s:g}s")
        name = by_ref[ready[0]]
        try:
            results[name] = ray.get(ready[0], timeout=max(deadline - time.monotonic(), 1.0))
        except RayActorError as error:
            raise WorkerDiedError(f"{what}: {name} died ({type(error).__name__}: {error})") from error
        except GetTimeoutError as error:
            raise WorkerTimeoutError(f"{what}: {name} did not answer within {timeout_s:g}s") from error
        except RayTaskError as error:
            cause = error.cause if getattr(error, "cause", None) is not None else error
            raise WorkerError(f"{what}: {name} raised {type(cause).__name__}: {cause}") from error
        except RayError as error:  # e.g. an argument lost with the worker that owned it
            raise WorkerError(f"{what}: {name} failed ({type(error).__name__}: {error})") from error
    return results


def merge_rollout_outputs(outputs: list[RolloutOutput]) -> RolloutOutput:
    """One rollout step's output from its workers' slices, in slice order. Metrics: `time/*` take the
    slowest worker; counts (`*/total`, `*/failed`, `groups/*`, `tokens/*`) add up; the rest are averaged
    weighted by each worker's trajectories (kept + dropped), exact for per-trajectory means."""
    if len(outputs) == 1:
        return outputs[0]
    counts = [float(len(o.trajectories) + len(o.dropped)) for o in outputs]
    total = sum(counts) or 1.0
    metrics: dict[str, float] = {}
    for key in sorted({k for o in outputs for k in o.metrics}):
        values = [(o.metrics[key], n) for o, n in zip(outputs, counts, strict=True) if key in o.metrics]
        if key.startswith("time/"):
            metrics[key] = max(v for v, _ in values)
        elif key.endswith(("/total", "/failed")) or key.startswith(("groups/", "tokens/")):
            metrics[key] = sum(v for v, _ in values)
        else:
            metrics[key] = sum(v * n for v, n in values) / (sum(n for _, n in values) or total)
    row_counts = [o.train_row_count for o in outputs]
    return RolloutOutput(trajectories=[t for o in outputs for t in o.trajectories], metrics=metrics,
                         train_row_count=None if any(c is None for c in row_counts) else sum(row_counts),
                         dropped=[t for o in outputs for t in o.dropped], rows=[r for o in outputs for r in o.rows],
                         advantages={k: v for o in outputs for k, v in o.advantages.items()},
                         turn_advantages={k: v for o in outputs for k, v in o.turn_advantages.items()})


class ObjectStoreWeights(Mapping):
    """Whole weights held in Ray's object store, fetched where they are read: pickling one sends only the
    reference, so rank 0's weights reach each rollout worker without passing through the driver."""

    def __init__(self, ref: Any, timeout_s: float) -> None:
        self.ref, self.timeout_s = ref, timeout_s

    @cached_property
    def _weights(self) -> dict[str, torch.Tensor]:
        import ray

        return ray.get(self.ref, timeout=self.timeout_s)

    def __getitem__(self, key: str) -> torch.Tensor:
        return self._weights[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self._weights)

    def __len__(self) -> int:
        return len(self._weights)

    def __getstate__(self) -> dict[str, Any]:
        return {"ref": self.ref, "timeout_s": self.timeout_s}  # never the fetched weights


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def _quiet_transformers() -> None:
    """No per-file progress bars from Hugging Face loads and saves in workers: Ray prefixes and repeats
    every worker's output in the driver's log, where a bar per checkpoint is noise."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


class TrainerWorker:
    """Data-parallel rank `rank` of `world_size`: `address` on rank 0, then `setup` on every rank at once
    (init_process_group waits for all of them), then `train_streamed` on every rank for each step."""

    def __init__(self, cfg: Config, rank: int, world_size: int) -> None:
        _quiet_transformers()
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        self.actor = None

    def address(self) -> tuple[str, int]:
        import ray

        return ray.util.get_node_ip_address(), _free_port()

    def setup(self, master: tuple[str, int], backend: str, timeout_s: float, pad_token_id: int,
              model: torch.nn.Module | None = None, load: str | None = None) -> dict[str, Any]:
        import torch.distributed as dist

        from memrl.train.actor import Actor

        use_cuda = backend == "nccl"
        if use_cuda:
            torch.cuda.set_device(0)  # Ray makes this worker's GPU(s) the only visible ones
        dist.init_process_group(backend, init_method=f"tcp://{master[0]}:{master[1]}", rank=self.rank,
                                world_size=self.world_size, timeout=timedelta(seconds=timeout_s))
        seed_everything(self.cfg.train.seed)
        device = torch.device("cuda" if use_cuda else "cpu")
        # Every rank loads the same files (`load`), so replicas, shards and optimizer states agree.
        policy = model if model is not None else load_policy(self.cfg)
        self.actor = Actor(policy, self.cfg, pad_token_id=pad_token_id, device=device, rank=self.rank,
                           world_size=self.world_size, load=load)
        return {"rank": self.rank, "pid": os.getpid(), "global_step": self.actor.global_step}

    def train_streamed(self, refs: list[Any], rollout_id: int, timeout_s: float) -> dict[str, float]:
        """One rollout step from `RowRef`s: this rank fetches the rows, plans the step (a pure function of the
        rows, so every rank plans alike) and trains its share of every optimizer step."""
        from memrl.distributed.rows import fetch_rows

        rows = fetch_rows(refs, timeout_s)
        metrics = self.actor.train_rollout(rows, rollout_id)
        metrics["global_step"] = float(self.actor.global_step)
        metrics["rows/fetched"] = float(len(rows))
        return metrics

    # The methods below are called on every rank at once (under FSDP they gather the shards); only rank 0
    # returns or writes anything.

    def state_dict(self) -> dict[str, torch.Tensor] | None:
        return self.actor.full_state_dict()

    def publish_weights(self) -> Any:
        """Rank 0's whole weights put into the object store; its ref (None elsewhere), for the rollout workers."""
        import ray

        weights = self.actor.full_state_dict()
        return None if weights is None else ray.put(weights)

    def sync_probe(self, prompt_ids: list[int], continuation_ids: list[int], version: int) -> Any:
        return self.actor.sync_probe(prompt_ids, continuation_ids, version)

    def save_pretrained(self, path: str, tokenizer: Any = None) -> str | None:
        saved = self.actor.save_pretrained(path, tokenizer)
        return None if saved is None else str(saved)

    def save(self, run_root: str, rollout_id: int, state: dict[str, Any], tokenizer: Any = None) -> str | None:
        saved = self.actor.save_checkpoint(run_root, rollout_id, state, tokenizer=tokenizer)
        return None if saved is None else str(saved)

    def log_probs(self, rows: list[Any]) -> list[list[float]]:
        return self.actor.log_probs(rows)


class RolloutWorker:
    """The one-process rollout source (`LocalRollout`) over a slice of each step's batch."""

    def __init__(self, cfg: Config, index: int, tokenizer: Any = None, model: torch.nn.Module | None = None,
                 server_url: str | None = None) -> None:
        from memrl.engines.factory import served_engine, training_engine

        _quiet_transformers()
        if server_url is not None:
            cfg = cfg.model_copy(update={"engine": cfg.engine.model_copy(update={"server_url": server_url})})
        self.cfg, self.index = cfg, index
        tokenizer = tokenizer if tokenizer is not None else load_tokenizer(cfg)
        if model is None and not served_engine(cfg):  # a served engine's server holds the weights
            model = load_policy(cfg)
        engine = training_engine(cfg, model, tokenizer)
        self.source = LocalRollout(cfg, engine, tokenizer, load_task(cfg), progress=False)

    def ping(self) -> int:
        return os.getpid()

    def generate(self, rollout_id: int, records: list[Any], slot_offset: int = 0,
                 weight_version: int | None = None) -> RolloutOutput:
        """`records`, the slice of the step's batch starting at `slot_offset` (slots name groups and seed
        requests: a slice keeps its batch positions), generated and converted as in one process; the rows
        stay in the object store (`RolloutOutput.rows` are `RowRef`s). A prompt group never spans slices,
        so these are the rows converting the whole batch would give (docs/multinode.md)."""
        from memrl.distributed.rows import put_rows

        out = self.source.generate(rollout_id, records, weight_version, slot_offset)
        out.rows = put_rows(out.rows)
        return out

    def sync_from(self, source: Any) -> None:
        self.source.sync_from(source)

    def score(self, prompt_ids: list[int], continuation_ids: list[int], temperature: float) -> Any:
        return self.source.loop.run_until_complete(self.source.engine.score(prompt_ids, continuation_ids,
                                                                            temperature))
