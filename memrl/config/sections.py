"""The config sections: what each section holds, its defaults and its own checks (checks across sections
live on `Config`, memrl/config/root.py)."""

from __future__ import annotations

import difflib
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from memrl.config.base import Section

__all__ = ["IDENTITY_WHEN_CHANGED", "OUTCOME", "DataConfig", "EngineConfig", "EvalConfig", "EvalSetConfig",
           "LoraConfig", "ModelConfig", "PluginConfig", "QueueConfig", "RayConfig", "SamplingConfig", "TaskSettings"]

class LoraConfig(Section):
    """LoRA adapters (peft) trained instead of the whole model (`model.lora`); see memrl/train/lora.py."""

    rank: int = Field(16, gt=0, description="Rank r of each adapter (peft LoraConfig.r; verl lora_rank).")
    alpha: float | None = Field(None, gt=0, description="Adapter scale (alpha / r x B A); unset: 2 x rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input.")
    target_modules: str | list[str] = Field("all-linear", description="peft's `all-linear` (every linear "
                                            "layer but the LM head) or a list of module names.")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, targets: str | list[str]) -> str | list[str]:
        # An empty list (or name) adapts nothing: peft refuses it only when the model is built. Whether the
        # names exist in the model is checked there too (memrl.train.lora), before peft.
        if not targets or (isinstance(targets, list) and not all(targets)):
            raise ValueError("an empty list or name adapts no layer; list layer names such as [q_proj, v_proj], "
                             "or all-linear")
        return targets


class ModelConfig(Section):
    path: str | None = Field(None, description="Hugging Face model folder or hub id of the policy.")
    tokenizer: str | None = Field(None, description="Tokenizer folder or hub id; defaults to `path`.")
    revision: str | None = Field(None, description="Hub revision (commit) to pin when `path` is a hub id.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; `auto` = bfloat16 on CUDA, float32 on CPU.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the local model runs.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of every weight (e.g. "
                                    "--set model.lora.rank=16; needs pip install 'memrl[lora]'); unset: "
                                    "full fine-tuning.")

    @property
    def tokenizer_path(self) -> str | None:
        return self.tokenizer or self.path


class DataConfig(Section):
    dir: str | None = Field(None, description="Prepared data folder (from `memrl prepare-data`).")
    train_file: str = Field("hotpotqa_train.jsonl", description="Training questions, relative to `dir`.")
    heldout_file: str = Field("hotpotqa_heldout.jsonl", description="Held-out questions (relative to "
                              "`dir`): the `heldout` validation set when eval.sets is empty.")
    eval_files: list[str] = Field(default_factory=list, description="More validation sets (relative to "
                                  "`dir`, named by file stem) when eval.sets is empty.")
    verify_manifest: bool = Field(True, description="Check SHA-256 of every file against its manifest.")


class SamplingConfig(Section):
    """How responses are sampled: the GRPO group size, temperature, nucleus mass, seeds."""

    n_samples: int = Field(8, gt=0, description="Trajectories per question (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int = Field(4242, description="Base sampling seed; each request derives its own from it.")


class EngineConfig(Section):
    """The rollout engine: a local transformers model (`hf`) or an OpenAI-compatible server, and its limits."""

    kind: Literal["hf", "openai"] = Field("hf", description="`hf` (local transformers) or `openai` (server).")
    server_url: str | None = Field(None, description="URL of the OpenAI-compatible server (kind openai).")
    api_key: str | None = Field(None, description="API key for the server, if it needs one.")
    max_concurrency: int = Field(64, gt=0, description="Requests in flight at once (client engine).")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one request, queueing included.")
    max_batch_size: int = Field(32, gt=0, description="Local engine: most requests decoded together.")
    max_batch_tokens: int = Field(65536, gt=0, description="Local engine: most prompt+response tokens in a batch.")
    # Both off by default until a GPU run measures them (bench/README.md, "GPU figures owed"): the static path
    # has passed its CPU tests only, so a first GPU run takes the measured dynamic path.
    static_kv: Literal["auto", "on", "off"] = Field(
        "off", description="Local engine: decode in preallocated KV slots bucketed by batch size and "
        "length; `auto` on with CUDA, `on` also on CPU, `off` the dynamic cache.")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "off", description="Local engine: capture each bucket's static decode step as a CUDA graph; `auto` "
        "whenever the static path runs on CUDA (eager if a capture fails), `on` needs CUDA and static_kv "
        "auto/on.")
    share_prefixes: bool = Field(True, description="Local engine: prefill what a batch's prompts share "
                                 "once (a GRPO group's turn-0 prompts, a chat-template prefix); results "
                                 "match the unshared path within float32 tolerance (on: bench/README.md).")

    @model_validator(mode="after")
    def _graphs_need_static_shapes(self) -> EngineConfig:
        if self.cuda_graphs == "on" and self.static_kv == "off":
            raise ValueError("engine.cuda_graphs = 'on' captures the static-shape decode step; set engine.static_kv "
                             "to auto or on, or cuda_graphs to auto/off")
        return self


# A task setting's `json_schema_extra` key: the comparability identity of evaluations records it only when not
# at its default (a setting added after evaluations were recorded without it: they still resume and compare).
IDENTITY_WHEN_CHANGED = "identity_when_changed"


class TaskSettings(Section):
    """What every task shares (`Task.Settings` derives from it): the answer's token limit and scorer, the chat
    template's thinking switch, the reward's time. The `task:` section is the configured task's class."""

    final_tokens: int = Field(64, gt=0, description="Token limit of the final answer turn.")
    enable_thinking: bool = Field(False, description="Passed to the chat template (Qwen3: keep False).")
    answer_extractor: Literal["boxed", "therefore"] = Field(
        "boxed", description="How the final answer is read: `boxed` the last \\boxed{}; `therefore` the "
        "line after the last \"the answer is\" (official MemAgent non-boxed prompt).")
    answer_after_think: bool = Field(False, description="Read the final answer only after its last </think> "
                                     "(the whole answer when nothing follows it), as the official MemAgent "
                                     "evaluation does; for thinking models. Off: the whole answer is read.")
    reward_timeout_s: float = Field(60.0, gt=0, description="Longest one reward-function call (each reward term's) "
                                    "may take; "
                                    "past it the step fails with RewardError (the call's thread is left running).")


class QueueConfig(Section):
    retired_keys = {"train_data_group_size": "queue.train_data_group_size is removed: the trainer takes each "
                    "rollout's rows all at once, so there are no groups to size; delete the key"}

    train_sample_expansion_factor: int | None = Field(None, gt=0, description="Most rows one trajectory may "
                                                      "expand to (sizes the queue); unset: the task's bound "
                                                      "(Task.max_rows_per_trajectory).")
    timeout_s: float = Field(1800.0, gt=0, description="Longest any wait on the queue may take.")


class EvalSetConfig(Section):
    """One validation set of `eval.sets`; unset settings are the run's (`sampling.*`, `task.*`, `eval.limit`)."""

    @model_validator(mode="before")
    @classmethod
    def _task_settings_go_under_task(cls, raw: Any) -> Any:
        # An eval set's own task settings (e.g. more chunks for long documents) are the task's keys, checked by
        # the task's Settings (Config.task_with): they go under `task:`, which an older release did not have.
        other = [str(k) for k in raw if k not in cls.model_fields] if isinstance(raw, dict) else []
        # A near miss of an eval-set key (`sampels`) gets Section's "did you mean" instead.
        if other and not any(difflib.get_close_matches(k, cls.model_fields, n=1) for k in other):
            raise ValueError(f"{', '.join(other)}: no key of an eval set (allowed: {', '.join(cls.model_fields)}); "
                             f"a task setting of the set goes under its task mapping, e.g. task: {{{other[0]}: ...}}")
        return raw

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Set name: TensorBoard eval/<name>/em, "
                      "RUN_ROOT/eval/<name>/.")
    file: str = Field(description="Prepared JSONL or RULER-HQA eval_N.json, under data.dir or absolute.")
    limit: int | None = Field(None, gt=0, description="Only the first N questions.")
    samples: int = Field(1, gt=0, description="Samples per question (sample s: seed sampling.seed + s); "
                         "metrics average them.")
    temperature: float | None = Field(None, ge=0.0, description="Sampling temperature (0 = greedy).")
    task: dict[str, Any] = Field(default_factory=dict, description="The set's own task settings over the run's "
                                 "`task:` (e.g. more chunks for long documents), validated by the task's Settings.")


class EvalConfig(Section):
    limit: int | None = Field(None, gt=0, description="Evaluate only the first N questions.")
    concurrency: int = Field(64, gt=0, description="Questions evaluated at once.")
    sets: list[EvalSetConfig] = Field(default_factory=list, description="Validation sets of training, each "
                                      "{name, file, limit, samples, temperature, task}; empty: `heldout` and "
                                      "data.eval_files.")

    @field_validator("sets")
    @classmethod
    def _unique_set_names(cls, sets: list[EvalSetConfig]) -> list[EvalSetConfig]:
        names = [s.name for s in sets]
        if len(set(names)) != len(names):
            raise ValueError(f"eval.sets names must be unique, got {names}")
        return sets


class RayConfig(Section):
    """The Ray runtime (`train.runtime: ray`); trainer workers = `train.dp_size`. See docs/multinode.md."""

    num_rollout_workers: int = Field(1, gt=0, description="Rollout workers, each with its own engine.")
    placement: Literal["separate", "colocated"] = Field("separate", description="`colocated`: trainer i and "
                                                        "rollout worker i share a resource bundle.")
    trainer_num_cpus: float = Field(1.0, gt=0, description="Ray CPUs per trainer worker.")
    trainer_num_gpus: float | None = Field(None, ge=0, description="GPUs per trainer worker; unset: 1 with "
                                           "GPUs (0.5 colocated), else 0.")
    rollout_num_cpus: float = Field(1.0, gt=0, description="Ray CPUs per rollout worker.")
    rollout_num_gpus: float | None = Field(None, ge=0, description="GPUs per rollout worker; unset: as "
                                           "trainer_num_gpus.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend; auto: "
                                                     "nccl with GPUs, else gloo.")
    rollout_server_urls: list[str] = Field(default_factory=list, description="engine.kind=openai: one "
                                           "server URL per rollout worker.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Worker start, model load, process groups.")
    rollout_timeout_s: float = Field(3600.0, gt=0, description="One rollout step on the rollout workers.")
    train_timeout_s: float = Field(3600.0, gt=0, description="One step's training on the trainer workers.")
    sync_timeout_s: float = Field(600.0, gt=0, description="Weight sync and checkpoint save.")

    @model_validator(mode="after")
    def _one_url_per_worker(self) -> RayConfig:
        if self.rollout_server_urls and len(self.rollout_server_urls) != self.num_rollout_workers:
            raise ValueError(f"ray.rollout_server_urls has {len(self.rollout_server_urls)} URLs for "
                             f"{self.num_rollout_workers} rollout workers; give one per worker")
        return self

    def gpus(self, cluster_gpus: float) -> tuple[float, float]:
        """(trainer, rollout) GPUs per worker, resolving unset values by the cluster and the placement."""
        auto = 0.0 if cluster_gpus <= 0 else (0.5 if self.placement == "colocated" else 1.0)
        trainer = auto if self.trainer_num_gpus is None else self.trainer_num_gpus
        rollout = auto if self.rollout_num_gpus is None else self.rollout_num_gpus
        return trainer, rollout


# The reward term `plugins.reward_function` replaces (or adds): every task's answer reward (`Task.reward_terms`).
OUTCOME = "outcome"


class PluginConfig(Section):
    # The per-function task plugins that one `plugins.task` object replaced (memrl/task.py), so that a
    # config written for them never half-works.
    retired_keys = {key: f"plugins.{key} is replaced by plugins.task, one Task class that samples, scores and "
                         f"converts (docs/custom-tasks.md); e.g. plugins.task = memrl.tasks.single_turn:SingleTurnTask"
                    for key in ("generate_function", "convert_function")}

    task: str = Field("memrl.memagent.task:MemAgentTask", description="`module:Class`, the Task "
                      "(memrl/task.py) that samples, scores and converts in training, validation, eval and "
                      "pass-at-k.")
    reward_function: str | None = Field(None, description="`module:function` (trajectory, golds) -> float "
                                        "replacing the task's `outcome` reward term (its answer's reward) in "
                                        "training and pass@k; unset: the task's.")
    config_class: str | None = Field(None, description="A Config subclass (`module:Class`) adding sections.")
