"""Settings of the Ray runtime, read from the config's `ray` section when it has one.

Until `memrl.config` has a `ray` section, every field falls back to its default here (and the number of
trainer workers is always `train.dp_size`). Tests and callers may pass a `RaySettings` directly.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Literal

from memrl.config import Config, ConfigError


@dataclass(frozen=True)
class RaySettings:
    """Workers, resources and timeouts of a Ray run. Every remote wait is bounded by one of the timeouts."""

    num_rollout_workers: int = 1            # rollout workers, each with its own engine
    placement: Literal["separate", "colocated"] = "separate"  # trainer i and rollout worker i share a bundle
    trainer_num_cpus: float = 1.0           # Ray CPUs per trainer worker
    trainer_num_gpus: float | None = None   # None: 1 when the cluster has GPUs (0.5 when colocated), else 0
    rollout_num_cpus: float = 1.0           # Ray CPUs per rollout worker
    rollout_num_gpus: float | None = None   # None: as trainer_num_gpus
    backend: Literal["auto", "gloo", "nccl"] = "auto"  # auto: nccl when trainers have GPUs, else gloo
    rollout_server_urls: tuple[str, ...] = ()  # engine=openai: one server per rollout worker (else rollout.server_url)
    startup_timeout_s: float = 600.0        # worker start, model load, process-group setup
    rollout_timeout_s: float = 3600.0       # one rollout step on the rollout workers
    train_timeout_s: float = 3600.0         # one rollout step's optimizer steps on the trainer workers
    sync_timeout_s: float = 600.0           # weight sync and checkpoint save

    def __post_init__(self) -> None:
        if self.num_rollout_workers < 1:
            raise ConfigError(f"ray.num_rollout_workers = {self.num_rollout_workers}; use at least 1")
        if self.placement not in ("separate", "colocated"):
            raise ConfigError(f"ray.placement = {self.placement!r}; use 'separate' or 'colocated'")
        for name in ("startup_timeout_s", "rollout_timeout_s", "train_timeout_s", "sync_timeout_s"):
            if getattr(self, name) <= 0:
                raise ConfigError(f"ray.{name} must be > 0, got {getattr(self, name)}")
        if self.rollout_server_urls and len(self.rollout_server_urls) != self.num_rollout_workers:
            raise ConfigError(f"ray.rollout_server_urls has {len(self.rollout_server_urls)} URLs for "
                              f"{self.num_rollout_workers} rollout workers; give one per worker")

    @classmethod
    def from_config(cls, cfg: Config) -> RaySettings:
        """The config's `ray` section (any object or dict with these field names), else the defaults."""
        section: Any = getattr(cfg, "ray", None)
        if section is None:
            return cls()
        get = section.get if isinstance(section, dict) else lambda k, d: getattr(section, k, d)
        values = {f.name: get(f.name, f.default) for f in fields(cls)}
        values["rollout_server_urls"] = tuple(values["rollout_server_urls"] or ())
        return cls(**values)

    def gpus(self, cluster_gpus: float) -> tuple[float, float]:
        """(trainer, rollout) GPUs per worker, resolving None by the cluster and the placement."""
        auto = 0.0 if cluster_gpus <= 0 else (0.5 if self.placement == "colocated" else 1.0)
        trainer = auto if self.trainer_num_gpus is None else self.trainer_num_gpus
        rollout = auto if self.rollout_num_gpus is None else self.rollout_num_gpus
        return trainer, rollout
