"""`Config`, the whole configuration: its sections and the checks that span several of them."""

from __future__ import annotations

import difflib
import importlib.util
from typing import Any

import yaml
from pydantic import Field, model_validator

from memrl.config.base import ConfigError, Section, task_instance
from memrl.config.sections import (
    DataConfig,
    EngineConfig,
    EvalConfig,
    ModelConfig,
    PluginConfig,
    QueueConfig,
    RayConfig,
    SamplingConfig,
    TaskConfig,
)
from memrl.config.training import AlgorithmConfig, TrainConfig

__all__ = ["ROLLOUT_MOVED", "Config"]

# The `rollout` section of earlier releases was split by what its keys set: old key -> its new place,
# built from the fields so that it cannot drift (the rollout section's old `engine` key is `engine.kind`).
ROLLOUT_MOVED: dict[str, str] = {
    ("engine" if name == "kind" else name): f"{section}.{name}"
    for section, cls in (("sampling", SamplingConfig), ("engine", EngineConfig), ("task", TaskConfig))
    for name in cls.model_fields
}


def _moved(key: str) -> str:
    if key in ROLLOUT_MOVED:
        return f"rollout.{key} moved to {ROLLOUT_MOVED[key]}"
    hint = difflib.get_close_matches(key, list(ROLLOUT_MOVED), n=1)
    guess = f" (did you mean rollout.{hint[0]}, now {ROLLOUT_MOVED[hint[0]]}?)" if hint else ""
    return f"rollout.{key} is no key of sampling, engine or task{guess}"


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    task: TaskConfig = Field(default_factory=TaskConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    plugins: PluginConfig = Field(default_factory=PluginConfig)

    @model_validator(mode="before")
    @classmethod
    def _refuse_the_rollout_section(cls, raw: Any) -> Any:
        # Refused whole, one clause per old key, so an old recipe never half-loads with some keys at defaults.
        if not isinstance(raw, dict) or "rollout" not in raw:
            return raw
        if isinstance(old := raw["rollout"], dict) and old:
            raise ValueError("; ".join(_moved(str(key)) for key in old))
        raise ValueError("the rollout section is split into sampling, engine and task (see memrl config); "
                         "move its keys there")

    @model_validator(mode="after")
    def _task_accepts_the_config(self) -> Config:
        # The task checks its own settings (`Task.validate_config`; MemAgent: max_chunks + 1 queue rows).
        try:
            task = task_instance(self.plugins.task)
        except ConfigError as error:
            raise ValueError(str(error)) from error
        task.validate_config(self)
        return self

    @model_validator(mode="after")
    def _validation_where_it_is_built(self) -> Config:
        t = self.train
        if (t.eval_interval > 0 or t.eval_before_train) and (t.runtime != "local" or t.max_staleness > 0):
            raise ValueError("validation during training (train.eval_interval, train.eval_before_train) uses the "
                             "in-process rollout engine: it needs train.runtime = 'local' and train.max_staleness = 0 "
                             "(the pipeline's producer holds the engine); otherwise evaluate checkpoints with "
                             "memrl eval")
        if t.keep_best is not None:
            names = [s.name for s in self.eval.sets] if self.eval.sets else None
            kind, _, rest = t.keep_best.partition("/")
            name, _, metric = rest.rpartition("/")
            if kind != "eval" or metric not in ("em", "sub_em", "f1") or (names is not None and name not in names):
                raise ValueError(f"train.keep_best = {t.keep_best!r} must be eval/<set>/<em|sub_em|f1> of a validation "
                                 f"set ({', '.join(names) if names else 'heldout, or a data.eval_files stem'})")
            if t.eval_interval == 0:
                raise ValueError("train.keep_best needs validation: set train.eval_interval > 0")
        return self

    @model_validator(mode="after")
    def _fsdp_needs_workers(self) -> Config:
        if self.train.strategy == "fsdp" and self.train.runtime != "ray":
            raise ValueError("train.strategy = 'fsdp' shards the model across Ray trainer workers; set "
                             "train.runtime = 'ray' (or pass --runtime ray), or use train.strategy = 'ddp'")
        return self

    @model_validator(mode="after")
    def _lora_where_it_is_built(self) -> Config:
        if self.model.lora is not None:
            if importlib.util.find_spec("peft") is None:
                raise ValueError("model.lora needs the peft package: pip install 'memrl[lora]', or unset model.lora")
            if self.train.strategy == "fsdp":  # on Ray, which _fsdp_needs_workers checked before
                raise ValueError("model.lora with train.strategy = 'fsdp' is not supported yet; use ddp (adapters "
                                 "are small: the base weights are the only large replica)")
        return self

    @model_validator(mode="after")
    def _overlong_buffer_within_the_answer_limit(self) -> Config:
        # DAPO's penalty ramps over the last B tokens of the answer's limit; a longer buffer has no meaning
        # (verl refuses it too), and clamping it would shape rewards other than the ones configured.
        buffer_len, limit = self.algorithm.overlong_buffer_len, self.task.final_tokens
        if buffer_len is not None and buffer_len > limit:
            raise ValueError(f"algorithm.overlong_buffer_len = {buffer_len} is longer than the final answer's limit "
                             f"task.final_tokens = {limit}; set overlong_buffer_len <= {limit} or raise final_tokens")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)
