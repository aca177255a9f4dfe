"""`Config`, the whole configuration: its sections and the checks that span several of them. The `task:`
section is the configured task's own (`Task.Settings`, a `TaskSettings` subclass), validated by that class."""

from __future__ import annotations

import difflib
import importlib.util
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import yaml
from pydantic import Field, SerializeAsAny, ValidationError, ValidationInfo, field_validator, model_validator

from memrl.config.base import ConfigError, Section, task_instance
from memrl.config.sections import (
    OUTCOME,
    DataConfig,
    EngineConfig,
    EvalConfig,
    ModelConfig,
    PluginConfig,
    QueueConfig,
    RayConfig,
    SamplingConfig,
    TaskSettings,
)
from memrl.config.training import AlgorithmConfig, TrainConfig

__all__ = ["Config", "rollout_moved", "task_settings"]

DEFAULT_TASK: str = PluginConfig.model_fields["task"].default


def task_settings(spec: str) -> type[TaskSettings]:
    """The class that validates the `task:` section: `Settings` of the Task `spec` names (`plugins.task`)."""
    settings = getattr(type(task_instance(spec)), "Settings", None)
    if not (isinstance(settings, type) and issubclass(settings, TaskSettings)):
        raise ConfigError(f"plugins.task = '{spec}': its Settings is {settings!r}, not a subclass of "
                          f"memrl.config.TaskSettings (the task's settings class)")
    return settings


def configured_task(raw: Any) -> str | None:
    """The `plugins.task` a raw config (before validation) names: the default when unset, None when it is no
    text (the plugins section's own check then says so)."""
    plugins = raw.get("plugins") if isinstance(raw, Mapping) else None
    spec = (plugins.get("task", DEFAULT_TASK) if isinstance(plugins, Mapping)
            else getattr(plugins, "task", DEFAULT_TASK))
    return spec if isinstance(spec, str) else None


def rollout_moved(settings: type[TaskSettings]) -> dict[str, str]:
    """The `rollout` section of earlier releases was split by what its keys set: old key -> its new place, built
    from the fields so that it cannot drift (the rollout section's old `engine` key is `engine.kind`)."""
    return {("engine" if name == "kind" else name): f"{section}.{name}"
            for section, cls in (("sampling", SamplingConfig), ("engine", EngineConfig), ("task", settings))
            for name in cls.model_fields}


def _moved(key: str, moved: dict[str, str]) -> str:
    if key in moved:
        return f"rollout.{key} moved to {moved[key]}"
    hint = difflib.get_close_matches(key, list(moved), n=1)
    guess = f" (did you mean rollout.{hint[0]}, now {moved[hint[0]]}?)" if hint else ""
    return f"rollout.{key} is no key of sampling, engine or task{guess}"


@dataclass(frozen=True)
class _TaskSection:  # the raw `task:` section and its class, found before plugins (a later field) is checked
    settings: type[TaskSettings]
    raw: Any


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    sampling: SamplingConfig = Field(default_factory=SamplingConfig)
    engine: EngineConfig = Field(default_factory=EngineConfig)
    # The configured task's Settings, dumped whole (SerializeAsAny), validated by its class (`_task_section`).
    task: SerializeAsAny[TaskSettings]
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
            moved = rollout_moved(task_settings(configured_task(raw) or DEFAULT_TASK))
            raise ValueError("; ".join(_moved(str(key), moved) for key in old))
        raise ValueError("the rollout section is split into sampling, engine and task (see memrl config); "
                         "move its keys there")

    @model_validator(mode="before")
    @classmethod
    def _task_section(cls, raw: Any) -> Any:
        # The class is found here, from the raw plugins.task, and validates the section in
        # `_settings_of_the_task`, so that an error keeps its place (task.<key>) among the others.
        if not isinstance(raw, Mapping) or (spec := configured_task(raw)) is None:
            return raw
        try:
            settings = task_settings(spec)
        except ConfigError as error:
            raise ValueError(str(error)) from error
        return {**raw, "task": _TaskSection(settings, raw.get("task") or {})}

    @field_validator("task", mode="before")
    @classmethod
    def _settings_of_the_task(cls, value: Any, info: ValidationInfo) -> Any:
        if isinstance(value, _TaskSection):
            return value.raw if isinstance(value.raw, value.settings) else value.settings.model_validate(value.raw)
        if "plugins" in info.data:  # an assignment: the other sections are there
            return task_settings(info.data["plugins"].task).model_validate(value)
        raise ValueError("checked once plugins.task names a Task class")

    def task_with(self, overrides: Mapping[str, Any]) -> TaskSettings:
        """The task's settings with `overrides` (an eval set's `task:`), validated by the same class."""
        return type(self.task).model_validate({**self.task.model_dump(), **overrides}) if overrides else self.task

    @model_validator(mode="after")
    def _task_accepts_the_config(self) -> Config:
        # The task checks its own settings (`Task.validate_config`; MemAgent: its bound on the queue factor).
        try:
            task = task_instance(self.plugins.task)
        except ConfigError as error:
            raise ValueError(str(error)) from error
        task.validate_config(self)
        return self

    @model_validator(mode="after")
    def _reward_weights_name_terms(self) -> Config:
        # A weight names a term of the run (a misspelt one would weigh nothing); a term is logged as reward/<name>.
        terms = list(task_instance(self.plugins.task).reward_terms(self))
        terms += [OUTCOME] if self.plugins.reward_function and OUTCOME not in terms else []
        if "mean" in terms:
            raise ValueError(f"plugins.task = '{self.plugins.task}' names a reward term 'mean', the name of the "
                             f"reward's own mean (reward/mean); rename the term")
        for name in self.algorithm.reward_weights:
            if name not in terms:
                hint = difflib.get_close_matches(name, terms, n=1)
                guess = f" (did you mean 'algorithm.reward_weights.{hint[0]}'?)" if hint else ""
                raise ValueError(f"unknown key 'algorithm.reward_weights.{name}'{guess}; the run's reward terms: "
                                 f"{', '.join(terms)}")
        return self

    @model_validator(mode="after")
    def _eval_sets_task_settings(self) -> Config:
        for i, spec in enumerate(self.eval.sets):
            try:
                self.task_with(spec.task)
            except ValidationError as e:
                raise ValueError("; ".join(f"eval.sets.{i}.task.{'.'.join(map(str, err['loc']))}: {err['msg']}"
                                           for err in e.errors())) from None
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
