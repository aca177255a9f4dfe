"""Typed, validated configuration: one pydantic model per section, YAML recipes, `--set a.b=v` overrides.

Every field has a description (`memrl config` lists them all, with types and defaults; `memrl config
--recipe FILE` validates a recipe and shows its values). Unknown keys and bad values raise
`ConfigError` naming the key, the value and what is allowed, so a typo never silently becomes a default.
"""

from __future__ import annotations

import difflib
import importlib
import numbers
import re
import types
from pathlib import Path
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from memrl.errors import MemrlError

DEFAULT_MEMORY_TEMPLATE = (
    "You are reading a long document one part at a time to answer a question. "
    "You keep a short memory of what matters.\n\n"
    "Question: {question}\n\n"
    "Your memory so far:\n{memory}\n\n"
    "Next part of the document:\n{chunk}\n\n"
    "Rewrite your memory: keep what helps answer the question, add what this part contributes, "
    "drop the rest. Reply with the updated memory only."
)
DEFAULT_FINAL_TEMPLATE = (
    "You have read a long document and kept a memory of it. Answer the question from your memory.\n\n"
    "Question: {question}\n\n"
    "Your memory:\n{memory}\n\n"
    "Put your final answer in \\boxed{}, for example \\boxed{Paris}."
)
DEFAULT_NO_MEMORY_TEXT = "No memory yet."


class ConfigError(ValueError, MemrlError):
    """A recipe or override that cannot be used; the message names the key and what to change."""


_SCALARS = {bool, int, float, str}


def _accepted_scalars(annotation: Any) -> set[type]:
    """The scalar types a field, or the items of a list/tuple field, accepts: `int | None` -> {int},
    `tuple[float, float]` -> {float}, `Literal[0, 1]` -> {int}; empty for sections and dicts."""
    origin = get_origin(annotation)
    if origin is Annotated:
        return _accepted_scalars(get_args(annotation)[0])
    if origin is Literal:
        return {type(arg) for arg in get_args(annotation)} & _SCALARS
    if origin in (Union, types.UnionType, list, tuple):
        return set().union(*(_accepted_scalars(arg) for arg in get_args(annotation) if arg is not Ellipsis))
    return {annotation} & _SCALARS


def _lax_coercion(value: Any, accepted: set[type]) -> str | None:
    """Why pydantic's lax mode would silently change `value` (None if it would not): `true` would become
    1, `1.5` an int 1 or an error far from the cause, `"yes"` a bool. Floats still take ints (`lr: 1`) and
    numeric text (YAML 1.1 reads `1e-6` as a string); NaN and infinities are refused by allow_inf_nan."""
    if isinstance(value, (list, tuple)):
        return next(filter(None, (_lax_coercion(item, accepted) for item in value)), None)
    numeric = accepted & {int, float}
    if isinstance(value, bool):
        return None if bool in accepted or not numeric else f"{value!r} is a bool where a number belongs; write the number"
    if type(value) in accepted or value is None:
        return None
    if bool in accepted and not numeric:
        return f"{value!r} is not a bool; write true or false"
    if numeric == {int} and not isinstance(value, numbers.Integral):
        return f"{value!r} is not a whole number; write an integer such as 4 (not 4.0, 1.5 or '4')"
    return None


class Section(BaseModel):
    # allow_inf_nan=False: `train.lr=.inf` turned every weight into NaN, `queue.timeout_s=.inf` overflowed
    # a later wait. Strict ints and bools (see `_lax_coercion`) for every field, also of plugin sections.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)
    # Keys an earlier release had, each with the message that names what replaces it (or says it is gone):
    # refused even when set to null, so an old recipe stops with what to write instead of a bare "unknown key".
    retired_keys: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _refuse_retired_keys(cls, raw: Any) -> Any:
        if isinstance(raw, dict):
            old = [key for key in cls.retired_keys if key in raw]
            if old:
                raise ValueError("; ".join(cls.retired_keys[key] for key in old))
        return raw

    @field_validator("*", mode="before")
    @classmethod
    def _no_lax_coercion(cls, value: Any, info: ValidationInfo) -> Any:
        problem = _lax_coercion(value, _accepted_scalars(cls.model_fields[info.field_name].annotation))
        if problem is not None:
            raise ValueError(problem)
        return value


class LoraConfig(Section):
    """LoRA adapters (peft) trained instead of the whole model (`model.lora`); see memrl/train/lora.py."""

    rank: int = Field(16, gt=0, description="Rank r of each adapter (peft LoraConfig.r; verl lora_rank).")
    alpha: float | None = Field(None, gt=0, description="Scaling alpha (update = alpha / r * B A); unset: 2 x rank.")
    dropout: float = Field(0.0, ge=0.0, lt=1.0, description="Dropout on the adapters' input.")
    target_modules: str | list[str] = Field("all-linear", description="Modules given adapters: peft's `all-linear` "
                                            "(every linear layer but the LM head) or a list of module names.")

    @field_validator("target_modules")
    @classmethod
    def _some_targets(cls, targets: str | list[str]) -> str | list[str]:
        # An empty list (or name) adapts nothing: peft refuses it only when the model is built. Whether the
        # names exist in the model is checked there too (memrl.train.lora), before peft.
        if not targets or (isinstance(targets, list) and not all(targets)):
            raise ValueError("an empty list or name adapts no layer; list layer names such as [q_proj, v_proj], or all-linear")
        return targets


class ModelConfig(Section):
    path: str | None = Field(None, description="Hugging Face model folder or hub id of the policy.")
    tokenizer: str | None = Field(None, description="Tokenizer folder or hub id; defaults to `path`.")
    revision: str | None = Field(None, description="Hub revision (commit) to pin when `path` is a hub id.")
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description="Weights dtype; `auto` = bfloat16 on CUDA, float32 on CPU."
    )
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="Where the local model runs.")
    lora: LoraConfig | None = Field(None, description="Train LoRA adapters instead of every weight, e.g. --set "
                                    "model.lora.rank=16; fields rank, alpha, dropout, target_modules. Unset: full "
                                    "fine-tuning. Needs peft (pip install 'memrl[lora]').")

    @property
    def tokenizer_path(self) -> str | None:
        return self.tokenizer or self.path


class DataConfig(Section):
    dir: str | None = Field(None, description="Prepared data folder (from `memrl prepare-data`).")
    train_file: str = Field("hotpotqa_train.jsonl", description="Training questions, relative to `dir`.")
    heldout_file: str = Field("hotpotqa_heldout.jsonl", description="Held-out questions, relative to `dir`: the "
                              "`heldout` validation set when eval.sets is empty.")
    eval_files: list[str] = Field(default_factory=list, description="More validation files, relative to `dir` (one "
                                  "set each, named by file stem) when eval.sets is empty.")
    verify_manifest: bool = Field(True, description="Check SHA-256 of every file against its manifest.")


class RolloutConfig(Section):
    chunk_tokens: int = Field(512, gt=0, description="Tokens per document chunk.")
    memory_tokens: int = Field(128, gt=0, description="Token limit of a memory turn (and of the memory passed on).")
    final_tokens: int = Field(64, gt=0, description="Token limit of the final answer turn.")
    max_chunks: int = Field(4, gt=0, description="At most this many chunks are read; longer documents are truncated.")
    truncation: Literal["head", "tail", "center", "center_chunks"] = Field(
        "center", description="What a document longer than max_chunks x chunk_tokens keeps: `head` the first "
        "max_chunks chunks, `tail` the last, `center` the first and last half of the token budget (MemAgent's), "
        "`center_chunks` the first and last whole chunks (memrl's first center policy)."
    )
    n_samples: int = Field(8, gt=0, description="Trajectories per question (the GRPO group size).")
    temperature: float = Field(1.0, ge=0.0, description="Sampling temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0.0, le=1.0, description="Nucleus sampling mass.")
    seed: int = Field(4242, description="Base sampling seed; each request derives its own from it.")
    enable_thinking: bool = Field(False, description="Passed to the chat template (Qwen3: keep False).")
    memory_template: str = Field(DEFAULT_MEMORY_TEMPLATE, description="Memory-turn user message; {question} {memory} {chunk}.")
    final_template: str = Field(DEFAULT_FINAL_TEMPLATE, description="Final-turn user message; {question} {memory}.")
    no_memory_text: str = Field(DEFAULT_NO_MEMORY_TEXT, description="Memory shown before the first chunk.")
    share_prefixes: bool = Field(
        False, description="Local engine: compute what the prompts of one prefill share once (a GRPO group's "
        "identical turn-0 prompts, a common chat-template prefix) and continue each from a copy; results equal "
        "the unshared path within float32 tolerance (memrl/engines/prefix.py). Off until the demo is measured with it.")
    prompt_layout: Literal["memagent", "chunk_first"] = Field(
        "memagent", description="Order of a memory turn's prompt: `memagent` memory_template as written (MemAgent's "
        "question, memory, chunk); `chunk_first` its memory block moved after its chunk block, so a group's prompts "
        "share all but the memory and the engine computes that prefix once (memrl/memagent/prompts.py).")
    strip_inputs: bool = Field(
        False, description="Strip whitespace around each question and document before prompting (str.strip(), as "
        "the official MemAgent evaluation does; some HotpotQA questions end in a space)."
    )
    memory_after_think: bool = Field(
        False, description="Pass on as memory only what a memory turn wrote after its last </think>, whitespace "
        "stripped (the official MemAgent evaluation's rule; a response without </think> is kept whole). The turn "
        "still trains on every sampled token. Set by recipes/memagent-official-eval.yaml."
    )
    answer_extractor: Literal["boxed", "therefore"] = Field(
        "boxed", description="How the final answer is read for reward and evaluation: `boxed` the last \\boxed{}; "
        "`therefore` the line after the last \"the answer is\" (the official MemAgent non-boxed final prompt)."
    )
    engine: Literal["hf", "openai"] = Field("hf", description="`hf`: local transformers model; `openai`: a server.")
    server_url: str | None = Field(None, description="Base URL of an OpenAI-compatible server (engine=openai).")
    api_key: str | None = Field(None, description="API key for the server, if it needs one.")
    max_concurrency: int = Field(64, gt=0, description="Requests in flight at once (client engine).")
    request_timeout_s: float = Field(600.0, gt=0, description="Timeout of one generation request, queueing "
                                     "included (server client and local engine); a request past it fails.")
    reward_timeout_s: float = Field(
        60.0, gt=0, description="Longest one call of the reward function may take; past it the rollout step "
        "fails with RewardError. The call runs in a daemon thread, which is left running (a thread cannot be killed).")
    max_batch_size: int = Field(32, gt=0, description="Local engine: most requests decoded together.")
    max_batch_tokens: int = Field(65536, gt=0, description="Local engine: most prompt+response tokens in one batch.")
    # Both default off: the static path has passed its CPU tests but has never run on a GPU (bench/README.md,
    # "GPU figures owed"), so a first GPU run takes the measured dynamic path; `auto` opts in, and the GPU
    # measurements decide whether it becomes the default.
    static_kv: Literal["auto", "on", "off"] = Field(
        "off", description="Local engine: decode in preallocated KV slots bucketed by batch size and length "
        "(static shapes); `off` (the default, until a GPU run measures it) the dynamic cache, `auto` on with CUDA "
        "and off on CPU, `on` also on CPU.")
    cuda_graphs: Literal["auto", "on", "off"] = Field(
        "off", description="Local engine: capture each bucket's static decode step as a CUDA graph; `off` (the "
        "default, until a GPU run measures it), `auto` on whenever the static path runs on CUDA (eager fallback, "
        "with a warning, if a capture fails), `on` needs CUDA and static_kv auto/on.")

    @model_validator(mode="after")
    def _templates_have_placeholders(self) -> RolloutConfig:
        for name, needed in (("memory_template", ("{question}", "{memory}", "{chunk}")),
                             ("final_template", ("{question}", "{memory}"))):
            text = getattr(self, name)
            missing = [p for p in needed if p not in text]
            if missing:
                raise ValueError(f"rollout.{name} must contain {', '.join(needed)}; missing {', '.join(missing)}")
        if self.cuda_graphs == "on" and self.static_kv == "off":
            raise ValueError("rollout.cuda_graphs = 'on' captures the static-shape decode step; set rollout.static_kv "
                             "to auto or on, or cuda_graphs to auto/off")
        if "{chunk}" in self.final_template:
            raise ValueError("rollout.final_template must not contain {chunk}: the final turn sees only question + memory")
        return self


class AlgorithmConfig(Section):
    retired_keys = {"tis_cap": "algorithm.tis_cap is replaced by algorithm.rollout_is=token + rollout_is_threshold=C "
                                "(the same truncated importance weights, verl's names)"}

    credit: Literal["split", "share"] = Field(
        "split", description="`split`: each of T turns gets advantage/T; `share`: each gets the full advantage."
    )
    std_normalize: bool = Field(True, description="Divide group-centred rewards by the group std (+eps).")
    std_ddof: Literal[0, 1] = Field(
        0, description="The group std's delta degrees of freedom: 0 = population std, 1 = sample std (verl's and "
        "slime's GRPO; advantages smaller by sqrt((n-1)/n) for groups of n)."
    )
    eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1.")
    clip_high: float = Field(0.2, ge=0, description="PPO ratio clip above 1 (clip-higher when > clip_low).")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip bound c > 1 for negative advantages; off if unset.")
    kl_coef: float = Field(0.001, ge=0, description="Coefficient of the KL penalty to the frozen reference.")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator (Schulman's k1 or k3).")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "trajectory_mean", "seq_mean_token_sum",
                      "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="How token losses are averaged (verl loss_agg_mode; formulas in memrl/rl/loss.py "
        "and docs/algorithms.md). `seq_mean_token_sum`: mean over rows of each row's token sum; "
        "`seq_mean_token_sum_norm`: Dr. GRPO, the token sums over rows x loss_scale_factor (verl >= 0.7.1 "
        "seq-mean-token-sum-norm, TRL loss_type=dr_grpo)."
    )
    loss_scale_factor: int | None = Field(
        None, gt=0, description="The fixed normaliser L of loss_agg=seq_mean_token_sum_norm (verl "
        "actor.loss_scale_factor); unset: the longest response-token limit, max(rollout.memory_tokens, "
        "rollout.final_tokens)."
    )
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (0 = logged only).")
    loss_mode: Literal["vanilla", "gspo"] = Field(
        "vanilla", description="`vanilla`: PPO's per-token ratio; `gspo`: GSPO's sequence ratio (verl "
        "policy_loss.loss_mode=gspo) taken over a whole trajectory, all its turns' tokens (memrl/rl/loss.py "
        "gspo_log_ratio); needs credit share (every turn carries the trajectory's advantage); GSPO's recipe: "
        "clip_low 3e-4, clip_high 4e-4, loss_agg trajectory_mean."
    )
    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="Importance weights for the engine/trainer gap (verl algorithm.rollout_correction."
        "rollout_is): `token` min(rho_t, threshold) (truncated IS, slime --use-tis), `sequence` one weight per trajectory, "
        "min(prod rho_t, threshold); off if unset (memrl/rl/correction.py)."
    )
    rollout_is_threshold: float = Field(2.0, gt=0, description="Upper bound of the rollout_is weights.")
    rollout_rs: Literal["token", "sequence", "geometric"] | None = Field(
        None, description="Masked importance sampling (verl rollout_rs): drop tokens (`token`) or whole trajectories "
        "(`sequence`: prod rho_t; `geometric`: its per-token geometric mean) whose engine/trainer ratio leaves "
        "[rollout_rs_threshold_lower, rollout_rs_threshold]; off if unset."
    )
    rollout_rs_threshold: float | None = Field(None, gt=0, description="Upper bound of rollout_rs; unset: rollout_is_threshold.")
    rollout_rs_threshold_lower: float | None = Field(None, gt=0, description="Lower bound of rollout_rs; unset: 1 / upper.")
    mask_truncated_completions: bool = Field(
        False, description="Zero the loss of every row of a trajectory whose final turn hit its token limit (TRL "
        "mask_truncated_completions); it still counts in its group's advantage."
    )
    overlong_buffer_len: int | None = Field(
        None, gt=0, description="DAPO's soft overlong penalty (verl reward_model.overlong_buffer.len): a final answer "
        "longer than its limit minus this many tokens loses up to overlong_penalty_factor, linearly, in the reward "
        "the advantage uses (the raw reward is kept for logs and filter_groups); off if unset."
    )
    overlong_penalty_factor: float = Field(1.0, ge=0, description="The overlong penalty at the limit itself.")
    turn_reward_function: str | None = Field(
        None, description="`module:function` (turn, trajectory, golds) -> float, a reward per turn mixed into that "
        "turn's advantage: alpha x trajectory credit + (1 - alpha) x the turn reward normalised in its group and turn "
        "index (memrl/rl/shaping.py). Built-in: memrl.memagent.reward:memory_recall. Off if unset."
    )
    turn_reward_alpha: float = Field(0.5, ge=0, le=1, description="alpha of turn_reward_function (1 = trajectory credit only).")
    filter_groups: bool = Field(
        False, description="Dynamic sampling (DAPO; verl algorithm.filter_groups.enable): drop prompt groups whose "
        "raw rewards are all equal and generate more, over_sampling_batch_size questions at a time, until the step "
        "has train.rollout_batch_size groups or max_num_gen_batches is reached (memrl/rl/dynamic_sampling.py)."
    )
    over_sampling_batch_size: int | None = Field(
        None, gt=0, description="Questions per further generation batch of filter_groups (slime "
        "--over-sampling-batch-size); unset: train.rollout_batch_size."
    )
    max_num_gen_batches: int = Field(
        10, gt=0, description="Most generation batches of one step under filter_groups, the first included (verl "
        "algorithm.filter_groups.max_num_gen_batches); reached, the step trains on the groups it has. At least 1: "
        "verl's 0 (unlimited) is not offered."
    )

    @field_validator("max_num_gen_batches", mode="before")
    @classmethod
    def _a_bounded_number_of_batches(cls, value: Any) -> Any:
        # verl's 0 means "until the batch is full": a step whose questions all give equal rewards (all
        # solved, or none) would then generate forever; every wait here has a bound. Before the `gt`
        # check, so that a 0 gets this message instead of pydantic's bare "greater than 0".
        if isinstance(value, int) and not isinstance(value, bool) and value < 1:
            raise ValueError(f"must be at least 1 (got {value}); 0 would be verl's 'unlimited', which memrl does not "
                             f"offer because a step whose groups all have equal rewards would never end: set a cap "
                             f"such as 10 (reached, the step trains on the informative groups it has)")
        return value

    @model_validator(mode="after")
    def _gspo_gives_every_turn_the_trajectory_advantage(self) -> AlgorithmConfig:
        # GSPO's ratio is one per trajectory, so its sequence-level objective weighs every token by the
        # trajectory's advantage A (verl's GSPO on one sequence); split credit would give each of T turns A/T.
        if self.loss_mode == "gspo" and self.credit != "share":
            raise ValueError("algorithm.loss_mode = 'gspo' takes one ratio per trajectory and gives every token the "
                             "trajectory's advantage; set algorithm.credit = 'share' (split gives each of T turns A/T)")
        return self

    @model_validator(mode="after")
    def _a_nonempty_rejection_range(self) -> AlgorithmConfig:
        high = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        low = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / high
        if self.rollout_rs is not None and not low < high:
            raise ValueError(f"algorithm.rollout_rs keeps ratios in [{low:g}, {high:g}], an empty range; set "
                             f"rollout_rs_threshold_lower below rollout_rs_threshold")
        return self

class TrainConfig(Section):
    retired_keys = {"lr_warmup_steps_ratio": "train.lr_warmup_steps_ratio is replaced by train.warmup_steps, a count "
                                              "of optimizer steps (a ratio r was floor(r x num_rollout x num_optimizer_steps) steps)"}

    num_rollout: int = Field(100, gt=0, description="Rollout steps to run.")
    rollout_batch_size: int = Field(16, gt=0, description="Questions per rollout step.")
    num_optimizer_steps: int = Field(1, gt=0, description="Optimizer steps per rollout step (counted in prompt groups).")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps (the first update at lr / "
                              "warmup_steps).")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warmup: `constant` (HF constant_with_warmup), `linear` or `cosine` decay "
        "(HF get_scheduler names; verl warmup_style) over the rest of num_rollout x num_optimizer_steps, down to "
        "min_lr_ratio x lr.")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Floor of the linear / cosine decay, as a "
                                "fraction of lr (verl's min_lr_ratio).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    micro_batch_tokens: int = Field(16384, gt=0, description="Token budget of one micro-batch (padded tokens).")
    dp_size: int = Field(1, gt=0, description="Data-parallel size the rows of a step are split across.")
    pad_to_dp: bool = Field(False, description="Pad a step's rows to a multiple of dp_size with all-zero-mask rows.")
    save_interval: int = Field(50, gt=0, description="Save a checkpoint every this many rollout steps (and at the end).")
    # Bounded because torch.manual_seed takes at most 64 bits: 2**64 was an overflow traceback at the
    # first step. 2**63 - 1 is also the largest seed `memrl serve` accepts, so one range holds for both.
    seed: int = Field(1234, ge=0, le=2**63 - 1, description="Seed of data order and trainer RNG, "
                      "in [0, 2**63 - 1].")
    runtime: Literal["local", "ray"] = Field("local", description="One process (`local`) or Ray workers.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the actor.")
    logprob_chunk_tokens: int | None = Field(
        512, gt=0, description="Response tokens whose log-probs and entropy go through the LM head at once, "
        "recomputed in the backward (verl's entropy checkpointing): bounds the float32 [tokens x vocab] logits "
        "to this many rows. Unset: all of a micro-batch's response tokens at once, kept for the backward."
    )
    packing: bool = Field(
        False, description="Padding-free micro-batches: rows concatenated into one sequence with per-row "
        "position ids instead of [rows x longest], attention kept within each row by a variable-length kernel "
        "(torch's varlen flash attention on CUDA under bf16, FlashAttention if the model uses it, one causal sdpa "
        "call per row otherwise), never a dense mask; the token budget then counts real tokens."
    )
    max_staleness: int = Field(
        0, ge=0, description="Overlap rollout and training: rollout n+k may generate while step n trains, with "
        "weights at most k steps old (PPO ratios against the rollout's own log-probs; algorithm.rollout_is "
        "corrects the gap). 0 = the synchronous loop. Drains at checkpoints, so resume stays exact. queue.timeout_s then also "
        "bounds the trainer's wait for a rollout still generating. Any runtime and engine (a served engine reloads "
        "one folder per weight version, RUN_ROOT/weights_versions)."
    )
    sync_check: bool = Field(
        True, description="The weight-sync canary: before the first rollout and after every weight sync (any "
        "runtime, engine and max_staleness), the rollout engine scores a fixed 12-token probe that the trainer "
        "scored with the same weights; a difference beyond sync_check_atol stops the run with both numbers and the "
        "weight version (a served engine that did not reload, a wrong dtype). Needs an engine that scores a given "
        "continuation (the local engine, memrl serve); set false for vLLM or SGLang."
    )
    sync_check_atol: float | None = Field(
        None, gt=0, description="Largest |engine - trainer| log-prob difference on the canary's probe. Unset: the "
        "float error of two forwards of the same weights, from the dtypes and model size (memrl/train/sync_check.py; "
        "Qwen3-0.6B: 1.2e-2 float32, 1.3 bfloat16); logs/metrics.jsonl sync_check/max_abs_diff shows the measured one."
    )
    strategy: Literal["ddp", "fsdp"] = Field(
        "ddp", description="How data-parallel trainer workers (runtime ray) hold the model: `ddp` keeps a full "
        "replica per rank; `fsdp` shards weights, gradients and optimizer state (FSDP2) for models that do not "
        "fit one device."
    )
    eval_interval: int = Field(0, ge=0, description="Validate on the eval sets (eval.sets) every this many rollout "
                               "steps and after the last, with the training engine's current weights; 0 = off "
                               "(verl trainer.test_freq). Results: RUN_ROOT/eval/, logs/eval_metrics.jsonl, "
                               "TensorBoard eval/<set>/{em,sub_em,f1}.")
    eval_before_train: bool = Field(False, description="Also validate the starting weights, before the first step "
                                    "(verl val_before_train); logged as rollout id start - 1.")
    keep_best: str | None = Field(None, description="Validation metric that picks the best checkpoint, e.g. "
                                  "eval/heldout/em: a checkpoint is saved at every new best and checkpoints/best.json "
                                  "names it (OpenRLHF ckpt.best_metric_key). Needs eval_interval > 0.")
    keep_best_mode: Literal["max", "min"] = Field("max", description="Whether a larger (max) or smaller (min) "
                                                  "keep_best metric is better.")
    keep_last_n: int | None = Field(None, gt=0, description="Keep only the newest N checkpoints (never deleting the "
                                    "latest or the best); unset: keep all.")
    loggers: list[Literal["tensorboard", "jsonl", "wandb"]] = Field(
        ["tensorboard", "jsonl"], description="Where metrics go: `tensorboard` (RUN_ROOT/tensorboard), `jsonl` "
        "(logs/metrics.jsonl, which memrl report and reward_summary.json read), `wandb` (Weights & Biases: pip install "
        "'memrl[wandb]'; WANDB_MODE=offline works without an account).")
    project_name: str = Field("memrl", description="W&B project (verl trainer.project_name).")
    experiment_name: str | None = Field(None, description="W&B run name (verl trainer.experiment_name); unset: the "
                                        "run root's folder name.")

    @model_validator(mode="after")
    def _a_decay_for_the_floor(self) -> TrainConfig:
        if self.min_lr_ratio > 0 and self.lr_scheduler == "constant":
            raise ValueError("train.min_lr_ratio is the floor of a decay; set train.lr_scheduler to linear or cosine")
        return self

    @field_validator("loggers")
    @classmethod
    def _loggers_installed(cls, loggers: list[str]) -> list[str]:
        import importlib.util

        if len(set(loggers)) != len(loggers):
            raise ValueError(f"train.loggers lists a logger twice: {loggers}")
        if "wandb" in loggers and importlib.util.find_spec("wandb") is None:
            raise ValueError("train.loggers includes wandb but the wandb package is not installed: "
                             "pip install 'memrl[wandb]', or drop wandb from train.loggers")
        return loggers


class QueueConfig(Section):
    retired_keys = {"train_data_group_size": "queue.train_data_group_size is removed: the trainer takes each "
                    "rollout's rows all at once, so there are no groups to size; delete the key"}

    train_sample_expansion_factor: int | None = Field(
        None, gt=0, description="Most rows one trajectory may expand to; sizes the queue's reserved capacity. "
        "Unset: the task's own bound (MemAgent: rollout.max_chunks + 1; a 1:1 task: 1)."
    )
    timeout_s: float = Field(1800.0, gt=0, description="Longest any wait on the queue may take.")


class EvalSetConfig(Section):
    """One validation set of `eval.sets`; unset settings are the run's (`rollout.*`, `eval.limit`)."""

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]+$", description="Set name: TensorBoard eval/<name>/em, RUN_ROOT/eval/<name>/.")
    file: str = Field(description="Prepared JSONL or RULER-HQA eval_N.json, relative to data.dir (or absolute).")
    limit: int | None = Field(None, gt=0, description="Only the first N questions.")
    samples: int = Field(1, gt=0, description="Samples per question (sample s uses rollout.seed + s); metrics are the "
                         "mean over samples.")
    temperature: float | None = Field(None, ge=0.0, description="Sampling temperature (0 = greedy).")
    max_chunks: int | None = Field(None, gt=0, description="Chunks read (long RULER documents need more).")
    memory_tokens: int | None = Field(None, gt=0, description="Token limit of a memory turn.")
    final_tokens: int | None = Field(None, gt=0, description="Token limit of the final answer turn.")


class EvalConfig(Section):
    limit: int | None = Field(None, gt=0, description="Evaluate only the first N questions.")
    concurrency: int = Field(64, gt=0, description="Questions evaluated at once.")
    sets: list[EvalSetConfig] = Field(
        default_factory=list, description="Validation sets of training (train.eval_interval), each {name, file, "
        "limit, samples, temperature, max_chunks, memory_tokens, final_tokens}. Empty: `heldout` = data.heldout_file "
        "and one set per data.eval_files entry, named by its file stem."
    )

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
    placement: Literal["separate", "colocated"] = Field(
        "separate", description="`colocated`: trainer i and rollout worker i share a resource bundle."
    )
    trainer_num_cpus: float = Field(1.0, gt=0, description="Ray CPUs per trainer worker.")
    trainer_num_gpus: float | None = Field(None, ge=0, description="GPUs per trainer worker; unset: 1 if the cluster has GPUs (0.5 colocated), else 0.")
    rollout_num_cpus: float = Field(1.0, gt=0, description="Ray CPUs per rollout worker.")
    rollout_num_gpus: float | None = Field(None, ge=0, description="GPUs per rollout worker; unset: as trainer_num_gpus.")
    backend: Literal["auto", "gloo", "nccl"] = Field("auto", description="torch.distributed backend; auto: nccl with GPUs, else gloo.")
    rollout_server_urls: list[str] = Field(default_factory=list, description="engine=openai: one server URL per rollout worker.")
    startup_timeout_s: float = Field(600.0, gt=0, description="Worker start, model load, process-group setup.")
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


# Per-function task plugins that one `plugins.task` object replaced (memrl/task.py): refused with its name,
# so that a config written for them never half-works.
REPLACED_PLUGIN_KEYS = ("generate_function", "convert_function")


class PluginConfig(Section):
    task: str = Field("memrl.memagent.task:MemAgentTask",
                      description="`module:Class`, the Task (memrl/task.py) that samples, scores and converts: "
                                  "training, validation, memrl eval and memrl pass-at-k all use it.")
    reward_function: str | None = Field(
        None, description="`module:function` `(trajectory, golds) -> float` replacing the task's own reward "
                          "(training and pass@k); unset: the task's.")
    config_class: str | None = Field(None, description="`module:Class`, a Config subclass with extra sections.")

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data: Any) -> Any:
        old = [k for k in REPLACED_PLUGIN_KEYS if isinstance(data, dict) and k in data]
        if old:
            raise ValueError(f"plugins.{old[0]} is replaced by plugins.task, one Task class that samples, scores "
                             f"and converts (docs/custom-tasks.md); e.g. plugins.task = "
                             f"memrl.tasks.single_turn:SingleTurnTask")
        return data


class Config(Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    rollout: RolloutConfig = Field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = Field(default_factory=AlgorithmConfig)
    train: TrainConfig = Field(default_factory=TrainConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    eval: EvalConfig = Field(default_factory=EvalConfig)
    ray: RayConfig = Field(default_factory=RayConfig)
    plugins: PluginConfig = Field(default_factory=PluginConfig)

    @model_validator(mode="after")
    def _task_accepts_the_config(self) -> Config:
        # The task validates its own settings (e.g. MemAgent: the queue holds max_chunks + 1 rows per
        # trajectory): `Task.validate_config` (memrl/task.py).
        try:
            task = import_object(self.plugins.task)()
        except ConfigError as error:
            raise ValueError(f"plugins.task = '{self.plugins.task}': {error}; install what it needs or fix the path") \
                from error
        task.validate_config(self)
        return self

    @model_validator(mode="after")
    def _validation_where_it_is_built(self) -> Config:
        t = self.train
        if (t.eval_interval > 0 or t.eval_before_train) and (t.runtime != "local" or t.max_staleness > 0):
            raise ValueError("validation during training (train.eval_interval, train.eval_before_train) uses the "
                             "in-process rollout engine: it needs train.runtime = 'local' and train.max_staleness = 0 "
                             "(the pipeline's producer holds the engine); otherwise evaluate checkpoints with memrl eval")
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
    def _lora_where_it_is_built(self) -> Config:
        if self.model.lora is not None:
            import importlib.util

            if importlib.util.find_spec("peft") is None:
                raise ValueError("model.lora needs the peft package: pip install 'memrl[lora]', or unset model.lora")
            if self.train.strategy == "fsdp" and self.train.runtime == "ray":
                raise ValueError("model.lora with train.strategy = 'fsdp' is not supported yet; use ddp (adapters "
                                 "are small: the base weights are the only large replica)")
        return self

    @model_validator(mode="after")
    def _overlong_buffer_within_the_answer_limit(self) -> Config:
        # DAPO's penalty ramps over the last B tokens of the answer's limit; a longer buffer has no meaning
        # (verl refuses it too), and clamping it would shape rewards other than the ones configured.
        buffer_len, limit = self.algorithm.overlong_buffer_len, self.rollout.final_tokens
        if buffer_len is not None and buffer_len > limit:
            raise ValueError(f"algorithm.overlong_buffer_len = {buffer_len} is longer than the final answer's limit "
                             f"rollout.final_tokens = {limit}; set overlong_buffer_len <= {limit} or raise final_tokens")
        return self

    @model_validator(mode="after")
    def _fsdp_needs_workers(self) -> Config:
        if self.train.strategy == "fsdp" and self.train.runtime != "ray":
            raise ValueError("train.strategy = 'fsdp' shards the model across Ray trainer workers; set "
                             "train.runtime = 'ray' (or pass --runtime ray), or use train.strategy = 'ddp'")
        return self

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _split_import_path(spec: str) -> tuple[str, str]:
    """`module:attr` (also `module.attr`) -> (module, attr)."""
    module_name, sep, attr = spec.partition(":")
    if not sep:
        module_name, _, attr = spec.rpartition(".")
    return module_name, attr


def import_object(spec: str) -> Any:
    """Load `module:attr` (also `module.attr`); a clear error when either part is missing."""
    module_name, attr = _split_import_path(spec)
    if not module_name or not attr:
        raise ConfigError(f"'{spec}' is not an import path; write it as 'package.module:name'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as e:
        raise ConfigError(f"cannot import module '{module_name}' of '{spec}': {e}") from e
    try:
        return getattr(module, attr)
    except AttributeError as e:
        raise ConfigError(f"module '{module_name}' has no '{attr}' (from '{spec}')") from e


class _UniqueKeyLoader(yaml.SafeLoader):
    """yaml.SafeLoader that refuses a key given twice in one mapping: plain YAML keeps the last one, so a
    second `train:` block silently dropped the first. Merge keys (`<<: *base`) may still be overridden."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:  # the mapping's own keys, before merges are flattened into it
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = self.construct_object(key_node, deep=True)
            line = key_node.start_mark.line + 1
            try:
                if key in first_line:
                    where = f"line {line}" if first_line[key] == line else f"lines {first_line[key]} and {line}"
                    raise yaml.constructor.ConstructorError(
                        problem=f"duplicate key {key!r} on {where}: the second would silently replace the first; "
                        f"merge them into one")
                first_line[key] = line
            except TypeError:  # an unhashable key: SafeLoader's own error names it
                pass
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str) -> Any:
    """Parse YAML config text (a recipe, an override's value) as yaml.safe_load does, refusing duplicate
    keys; raises yaml.YAMLError."""
    return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader subclass)


def parse_override(text: str) -> tuple[list[str], Any]:
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"override '{text}' must look like section.key=value")
    try:
        value = load_yaml(raw) if raw.strip() else ""
    except yaml.YAMLError as e:
        raise ConfigError(f"override '{text}': value is not valid YAML: {e}") from e
    return key.strip().split("."), value


def apply_overrides(raw: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for part in path[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override '{text}': '{part}' is a value, not a section")
            node = child
        node[path[-1]] = value
    return raw


def _describe_error(cls: type[BaseModel], err: dict[str, Any]) -> str:
    loc = [str(p) for p in err["loc"]]
    key = ".".join(loc) or "<root>"
    if err["type"] == "extra_forbidden":
        allowed = _allowed_keys(cls, loc[:-1])
        hint = difflib.get_close_matches(loc[-1], allowed, n=1)
        msg = f"unknown key '{key}'"
        if hint:
            msg += f" (did you mean '{'.'.join(loc[:-1] + [hint[0]])}'?)"
        return msg + f"; allowed here: {', '.join(allowed)}"
    value = err.get("input")
    shown = "" if isinstance(value, dict) else f" = {value!r}"
    return f"{key}{shown}: {err['msg']}"


def _allowed_keys(cls: type[BaseModel], loc: list[str]) -> list[str]:
    model: Any = cls
    for part in loc:
        field = model.model_fields.get(part) if hasattr(model, "model_fields") else None
        if field is None:
            return []
        model = field.annotation
    return sorted(model.model_fields) if hasattr(model, "model_fields") else []


def config_from_dict(raw: dict[str, Any], config_class: type[Config] | None = None) -> Config:
    if config_class is None:
        spec = (raw.get("plugins") or {}).get("config_class") if isinstance(raw.get("plugins"), dict) else None
        config_class = import_object(spec) if spec else Config
        if not (isinstance(config_class, type) and issubclass(config_class, Config)):
            raise ConfigError(f"plugins.config_class '{spec}' must be a subclass of memrl.config.Config")
    try:
        return config_class.model_validate(raw)
    except ValidationError as e:
        lines = [_describe_error(config_class, err) for err in e.errors()]
        raise ConfigError("invalid configuration:\n  " + "\n  ".join(lines)) from None


def load_config(path: str | Path | None = None, overrides: list[str] | None = None,
                config_class: type[Config] | None = None) -> Config:
    """Read a YAML recipe (or start from defaults), apply `a.b=value` overrides, validate."""
    raw: dict[str, Any] = {}
    if path is not None:
        p = Path(path)
        if not p.is_file():
            raise ConfigError(f"recipe '{p}' does not exist" if not p.exists() else f"recipe '{p}' is not a file")
        try:
            raw = load_yaml(p.read_text(encoding="utf-8")) or {}
        except UnicodeDecodeError as e:
            raise ConfigError(f"recipe '{p}' is not UTF-8 text (byte {e.start}: {e.reason}); "
                              f"save it as UTF-8") from None
        except yaml.YAMLError as e:
            raise ConfigError(f"recipe '{p}' is not valid YAML: {e}") from e
        if not isinstance(raw, dict):
            raise ConfigError(f"recipe '{p}' must be a mapping of sections, got {type(raw).__name__}")
    raw = apply_overrides(raw, overrides or [])
    return config_from_dict(raw, config_class)


# A hub id is `name` or `namespace/name` of word characters, '-' and '.'; anything else (a leading
# / . ~, a second slash, a space) can only be a local path.
_HUB_ID = re.compile(r"^[\w-][\w.-]*(/[\w.-]+)?$")


def check_model_path(path: str | Path, what: str = "model path") -> None:
    """Refuse a local-looking path that does not exist, before Hugging Face reads it as a hub id and
    answers "Repo id must be in the form ...", which hides that the folder is missing."""
    text = str(path)
    if not _HUB_ID.match(text) and not Path(text).exists():
        raise ConfigError(f"{what} {text} does not exist; pass an existing folder "
                          f"(or a hub id such as Qwen/Qwen3-0.6B)")


def load_pretrained(loader: Any, path: str | Path, what: str = "model", **kwargs: Any) -> Any:
    """`loader.from_pretrained(path, **kwargs)` (a transformers Auto class) whose failures are a
    `ConfigError` naming the path: a missing local folder says so, an unreadable folder or hub id
    gives the loader's reason."""
    check_model_path(path, f"{what} path")
    try:
        return loader.from_pretrained(str(path), **kwargs)
    except (OSError, ValueError) as e:
        raise ConfigError(f"cannot load the {what} from {path}: {e}") from e
