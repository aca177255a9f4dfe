"""The training sections: the RL algorithm (`algorithm`: advantages, loss, corrections, reward shaping,
dynamic sampling) and the trainer (`train`: optimizer, schedule, checkpoints, validation, logging)."""

from __future__ import annotations

import importlib.util
from typing import Any, Literal

from pydantic import Field, field_validator, model_validator

from memrl.config.base import Section

__all__ = ["AlgorithmConfig", "TrainConfig"]


class AlgorithmConfig(Section):
    retired_keys = {"tis_cap": "algorithm.tis_cap is replaced by algorithm.rollout_is=token + rollout_is_threshold=C "
                                "(the same truncated importance weights, verl's names)"}

    credit: Literal["split", "share"] = Field("split", description="`split`: each of T turns gets "
                                              "advantage/T; `share`: each gets the full advantage.")
    std_normalize: bool = Field(True, description="Divide group-centred rewards by the group std (+eps).")
    std_ddof: Literal[0, 1] = Field(0, description="Group std's degrees of freedom: 0 population, 1 sample "
                                    "(verl's and slime's GRPO).")
    eps: float = Field(1e-6, gt=0, description="Added to the std before dividing.")
    clip_low: float = Field(0.2, ge=0, description="PPO ratio clip below 1.")
    clip_high: float = Field(0.2, ge=0, description="PPO ratio clip above 1 (clip-higher when > clip_low).")
    dual_clip: float | None = Field(None, gt=1.0, description="Dual-clip bound for negative advantages; off "
                                    "if unset.")
    kl_coef: float = Field(0.001, ge=0, description="Coefficient of the KL penalty to the frozen reference.")
    kl_estimator: Literal["k1", "k3"] = Field("k3", description="KL estimator (Schulman's k1 or k3).")
    loss_agg: Literal["token_mean", "seq_mean_token_mean", "trajectory_mean", "seq_mean_token_sum",
                      "seq_mean_token_sum_norm"] = Field(
        "token_mean", description="How token losses are averaged (verl loss_agg_mode; docs/algorithms.md); "
        "`seq_mean_token_sum_norm` is Dr. GRPO.")
    loss_scale_factor: int | None = Field(None, gt=0, description="Normaliser L of seq_mean_token_sum_norm "
                                          "(verl actor.loss_scale_factor); unset: the task's longest response "
                                          "limit (Task.max_response_tokens).")
    entropy_coef: float = Field(0.0, ge=0, description="Entropy bonus coefficient (0 = logged only).")
    loss_mode: Literal["vanilla", "gspo"] = Field("vanilla", description="`vanilla`: PPO's per-token ratio; "
                                                  "`gspo`: GSPO's sequence ratio over a whole trajectory "
                                                  "(verl policy_loss.loss_mode=gspo), needs credit share.")
    rollout_is: Literal["token", "sequence"] | None = Field(
        None, description="Importance weights for the engine/trainer gap (verl "
        "algorithm.rollout_correction.rollout_is): `token` min(rho_t, threshold) (slime --use-tis), "
        "`sequence` per trajectory; off if unset.")
    rollout_is_threshold: float = Field(2.0, gt=0, description="Upper bound of the rollout_is weights.")
    rollout_rs: Literal["token", "sequence", "geometric"] | None = Field(
        None, description="Masked importance sampling (verl rollout_rs): drop tokens or trajectories "
        "(`sequence`: prod rho_t, `geometric`: its geometric mean) whose ratio leaves [lower, upper]; "
        "unset: off.")
    rollout_rs_threshold: float | None = Field(None, gt=0, description="Upper bound of rollout_rs; unset: "
                                               "rollout_is_threshold.")
    rollout_rs_threshold_lower: float | None = Field(None, gt=0, description="Lower bound of rollout_rs; "
                                                     "unset: 1 / upper.")
    mask_truncated_completions: bool = Field(False, description="Zero the loss of a trajectory whose final "
                                             "turn hit its token limit (TRL mask_truncated_completions); it "
                                             "still counts in its group's advantage.")
    overlong_buffer_len: int | None = Field(
        None, gt=0, description="DAPO's overlong penalty (verl reward_model.overlong_buffer.len): up to "
        "overlong_penalty_factor, linear over the answer limit's last N tokens; logs and filter_groups see "
        "the raw reward; off if unset.")
    overlong_penalty_factor: float = Field(1.0, ge=0, description="The overlong penalty at the limit itself.")
    turn_reward_function: str | None = Field(None, description="`module:function` (turn, trajectory, golds) "
                                             "-> float, a per-turn reward mixed into that turn's advantage "
                                             "(built-in: memrl.memagent.reward:memory_recall); off if unset.")
    turn_reward_alpha: float = Field(0.5, ge=0, le=1, description="alpha of turn_reward_function: alpha x "
                                     "trajectory credit + (1 - alpha) x the normalised turn reward (1 = "
                                     "trajectory credit only).")
    reward_weights: dict[str, float] = Field(
        default_factory=dict, description="Weight of each reward term by name (TRL reward_weights; the terms are "
        "the task's, Task.reward_terms: `outcome` the answer's); an unset one keeps the task's default (1).")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = Field(
        "sum_then_normalize", description="How reward terms make the advantage (TRL's): GRPO of their weighted "
        "sum, or the weighted sum of each term's GRPO advantage in its group (GDPO).")
    filter_groups: bool = Field(False, description="Dynamic sampling (DAPO; verl algorithm.filter_groups.enable): "
                                "drop groups whose raw rewards are all equal, generate more until "
                                "train.rollout_batch_size groups or max_num_gen_batches.")
    over_sampling_batch_size: int | None = Field(None, gt=0, description="Questions per further batch of "
                                                 "filter_groups (slime --over-sampling-batch-size); unset: "
                                                 "train.rollout_batch_size.")
    max_num_gen_batches: int = Field(
        10, gt=0, description="Most generation batches of a filter_groups step, the first included (verl "
        "algorithm.filter_groups.max_num_gen_batches); reached, the step trains on what it has.")

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
        # verl's GSPO has no dual clip: with one, a runaway trajectory's loss would be capped at -A c (3.0 where
        # verl's is 7.389 per token in one case), a loss no anchor defines.
        if self.loss_mode == "gspo" and self.dual_clip is not None:
            raise ValueError(f"algorithm.dual_clip = {self.dual_clip} with algorithm.loss_mode = 'gspo': GSPO (verl's "
                             f"policy_loss.loss_mode=gspo) has no dual clip; unset algorithm.dual_clip")
        return self

    @model_validator(mode="after")
    def _dynamic_sampling_reads_the_summed_reward(self) -> AlgorithmConfig:
        # filter_groups drops groups of equal summed rewards; normalised term by term such a group can still teach.
        if self.multi_objective_aggregation == "normalize_then_sum" and self.filter_groups:
            raise ValueError("algorithm.filter_groups drops groups whose summed rewards are equal, which under "
                             "multi_objective_aggregation = 'normalize_then_sum' may still differ term by term; "
                             "use sum_then_normalize or unset filter_groups")
        return self

    @model_validator(mode="after")
    def _overlong_penalty_is_no_term(self) -> AlgorithmConfig:
        # The penalty shapes the summed reward; normalised term by term it would need a weight of its own.
        if self.multi_objective_aggregation == "normalize_then_sum" and self.overlong_buffer_len is not None:
            raise ValueError("algorithm.overlong_buffer_len shapes the summed reward, which "
                             "multi_objective_aggregation = 'normalize_then_sum' does not normalise; use "
                             "sum_then_normalize or unset overlong_buffer_len")
        return self

    @property
    def rollout_rs_range(self) -> tuple[float, float]:
        """(low, high) of rollout rejection sampling, the unset bounds filled in (the one place of that rule)."""
        high = self.rollout_rs_threshold if self.rollout_rs_threshold is not None else self.rollout_is_threshold
        low = self.rollout_rs_threshold_lower if self.rollout_rs_threshold_lower is not None else 1.0 / high
        return low, high

    @model_validator(mode="after")
    def _a_nonempty_rejection_range(self) -> AlgorithmConfig:
        low, high = self.rollout_rs_range
        if self.rollout_rs is not None and not low < high:
            raise ValueError(f"algorithm.rollout_rs keeps ratios in [{low:g}, {high:g}], an empty range; set "
                             f"rollout_rs_threshold_lower below rollout_rs_threshold")
        return self


class TrainConfig(Section):
    retired_keys = {"lr_warmup_steps_ratio": "train.lr_warmup_steps_ratio is replaced by train.warmup_steps, a count "
                                              "of optimizer steps (a ratio r was floor(r x num_rollout x "
                                              "num_optimizer_steps) steps)"}

    num_rollout: int = Field(100, gt=0, description="Rollout steps to run.")
    time_budget_s: float | None = Field(
        None, gt=0, description="Wall-clock seconds the loop may take: a step starts only while the seconds "
        "spent plus the longest step so far fit, then the run ends as after its last step (validated, "
        "checkpointed; the last validation and checkpoint come after it); unset: all num_rollout steps. A linear "
        "or cosine lr decays over num_rollout, so it stops part way; a resumed run has the budget anew.")
    rollout_batch_size: int = Field(16, gt=0, description="Questions per rollout step.")
    num_optimizer_steps: int = Field(1, gt=0, description="Optimizer steps per rollout step (counted in "
                                     "prompt groups).")
    lr: float = Field(1e-6, gt=0, description="AdamW learning rate.")
    warmup_steps: int = Field(0, ge=0, description="Linear warmup, in optimizer steps.")
    lr_scheduler: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="LR after warmup: `constant`, or `linear` / `cosine` decay to min_lr_ratio "
        "x lr over the run (HF get_scheduler names; verl warmup_style).")
    min_lr_ratio: float = Field(0.0, ge=0.0, le=1.0, description="Floor of the decay, as a fraction of lr.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    adam_betas: tuple[float, float] = Field((0.9, 0.999), description="AdamW betas.")
    grad_clip: float = Field(1.0, gt=0, description="Max global gradient norm.")
    micro_batch_tokens: int = Field(16384, gt=0, description="Micro-batch token budget, padding included.")
    dp_size: int = Field(1, gt=0, description="Data-parallel size the rows of a step are split across.")
    pad_to_dp: bool = Field(False, description="Pad rows to a multiple of dp_size with all-zero-mask rows.")
    save_interval: int = Field(50, gt=0, description="Checkpoint every N rollout steps and at the end.")
    # Bounded because torch.manual_seed takes at most 64 bits: 2**64 was an overflow traceback at the
    # first step. 2**63 - 1 is also the largest seed `memrl serve` accepts, so one range holds for both.
    seed: int = Field(1234, ge=0, le=2**63 - 1, description="Seed of data order and trainer RNG.")
    runtime: Literal["local", "ray"] = Field("local", description="One process (`local`) or Ray workers.")
    gradient_checkpointing: bool = Field(False, description="Trade compute for memory in the actor.")
    logprob_chunk_tokens: int | None = Field(
        512, gt=0, description="Response tokens through the LM head at once, recomputed in the backward "
        "(verl entropy checkpointing): bounds the float32 [tokens x vocab] logits; unset: all at once.")
    packing: bool = Field(False, description="Padding-free micro-batches: rows concatenated with per-row "
                          "position ids and a variable-length attention kernel; the token budget then "
                          "counts real tokens.")
    share_prefixes: bool = Field(True, description="Forward and back-propagate what rows of a micro-batch "
                                 "share (a group's prompt prefix) once: its suffixes attend to its keys and "
                                 "values; equal to the unshared step within float32 rounding; the token budget "
                                 "then counts computed tokens (docs/algorithms.md, Prefix sharing).")
    share_prefix_min_tokens: int = Field(32, gt=0, description="Fewest leading tokens rows must share to be "
                                         "computed once (train.share_prefixes).")
    max_staleness: int = Field(0, ge=0, description="Rollout n+k may generate while step n trains, on "
                               "weights at most k steps old (correct the gap with algorithm.rollout_is); 0 "
                               "= the synchronous loop (docs/multinode.md).")
    sync_check: bool = Field(True, description="Weight-sync canary: after every sync the engine scores a "
                             "probe the trainer scored; a gap over sync_check_atol stops the run. Needs an "
                             "engine that scores text (local, memrl serve): false for vLLM, SGLang.")
    sync_check_atol: float | None = Field(
        None, gt=0, description="Largest |engine - trainer| log-prob gap on the probe; unset: from dtype "
        "and model size (memrl/train/sync_check.py). Metric sync_check/max_abs_diff: the measured one.")
    strategy: Literal["ddp", "fsdp"] = Field("ddp", description="How Ray trainer workers hold the model: "
                                             "`ddp` a full replica per rank; `fsdp` sharded (FSDP2).")
    eval_interval: int = Field(0, ge=0, description="Validate on the eval sets every this many rollout "
                               "steps and after the last; 0 = off (verl trainer.test_freq). Results: "
                               "RUN_ROOT/eval/, logs/eval_metrics.jsonl.")
    eval_before_train: bool = Field(False, description="Also validate the starting weights (verl "
                                    "val_before_train); logged as rollout id start - 1.")
    keep_best: str | None = Field(None, description="Metric that picks the best checkpoint, e.g. "
                                  "eval/heldout/em: saved at every new best, named in checkpoints/best.json "
                                  "(OpenRLHF ckpt.best_metric_key).")
    keep_best_mode: Literal["max", "min"] = Field("max", description="Whether a larger (max) or smaller "
                                                  "(min) keep_best metric is better.")
    keep_last_n: int | None = Field(None, gt=0, description="Keep only the newest N checkpoints (never the "
                                    "latest or the best); unset: keep all.")
    loggers: list[Literal["tensorboard", "jsonl", "wandb"]] = Field(
        ["tensorboard", "jsonl"], description="Where metrics go: `tensorboard`, `jsonl` "
        "(logs/metrics.jsonl, read by memrl report), `wandb` (pip install 'memrl[wandb]').")
    project_name: str = Field("memrl", description="W&B project (verl trainer.project_name).")
    experiment_name: str | None = Field(None, description="W&B run name (verl trainer.experiment_name); "
                                        "unset: the run root's folder name.")

    @model_validator(mode="after")
    def _a_budget_stops_a_synchronous_loop(self) -> TrainConfig:
        # With overlap the next rollout is already generating when the budget ends the run: it would be left running.
        if self.time_budget_s is not None and self.max_staleness > 0:
            raise ValueError("train.time_budget_s ends the run at a step boundary, but with train.max_staleness > 0 "
                             "the next rollout is already generating there; set max_staleness to 0 or unset the budget")
        return self

    @model_validator(mode="after")
    def _a_decay_for_the_floor(self) -> TrainConfig:
        if self.min_lr_ratio > 0 and self.lr_scheduler == "constant":
            raise ValueError("train.min_lr_ratio is the floor of a decay; set train.lr_scheduler to linear or cosine")
        return self

    @field_validator("loggers")
    @classmethod
    def _loggers_installed(cls, loggers: list[str]) -> list[str]:
        if len(set(loggers)) != len(loggers):
            raise ValueError(f"train.loggers lists a logger twice: {loggers}")
        if "wandb" in loggers and importlib.util.find_spec("wandb") is None:
            raise ValueError("train.loggers includes wandb but the wandb package is not installed: "
                             "pip install 'memrl[wandb]', or drop wandb from train.loggers")
        return loggers
