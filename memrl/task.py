"""The Task: one object, named by `plugins.task` (`module:Class`), that owns everything task-specific
(docs/custom-tasks.md lists its methods and defaults). Training (one process and Ray), validation,
`memrl eval` and `memrl pass-at-k` all sample through `sample_group`, `memrl view` shows its
`view_fields`, so a new task plugs into every command at once. `ctx.phase` says who asks: "train"
(training, pass@k: n samples per group) or "eval" (validation, `memrl eval`: one sample, `eval_group`).

The answer scorers here are every task's default: an unfinished trajectory scores 0 (docs/design.md §2),
and `trajectory_reward(t, g) == score_trajectory(t, g).em`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, ClassVar, Literal

from memrl.config import OUTCOME, AlgorithmConfig, TaskSettings, import_object, task_instance
from memrl.rl.shaping import advantage_rows
from memrl.rl.validate import TrajectoryError
from memrl.rollout import GroupSlot, RewardTerms, RolloutContext, finish_rollout
from memrl.scoring import AnswerScore, score_answer
from memrl.types import RolloutOutput, TrainRow, Trajectory

Phase = Literal["train", "eval"]
DEFAULT_EXTRACTOR = "boxed"
# Ids that end a turn besides eos / pad, where the tokenizer has them as one vocabulary entry.
EXTRA_STOP_TOKENS = ("<|im_end|>", "<|endoftext|>")


def trajectory_reward(traj: Trajectory, golds: Iterable[str], extractor: str | None = None) -> float:
    """1.0 if the finished final answer matches a gold (HotpotQA EM); an unfinished one scores 0."""
    return score_trajectory(traj, golds, extractor).em


def score_trajectory(traj: Trajectory, golds: Iterable[str], extractor: str | None = None) -> AnswerScore:
    """EM, sub_EM, F1 and missing-box of the final answer; a truncated one keeps what it boxed but scores 0,
    matching its reward. `extractor` unset: the one the rollout recorded (its final prompt asked for that
    format), else `boxed`; read after the answer's last </think> when the rollout recorded
    `answer_after_think` (`task.answer_after_think`)."""
    meta = traj.metadata or {}
    if extractor is None:
        extractor = str(meta.get("answer_extractor", DEFAULT_EXTRACTOR))
    text = traj.answer if traj.status != "failed" else ""
    score = score_answer(text, golds, extractor, after_think=bool(meta.get("answer_after_think")))
    if traj.status == "complete":
        return score
    return AnswerScore(boxed=score.boxed, em=0.0, sub_em=0.0, f1=0.0, missing_box=score.missing_box)


def convert_one_row_per_trajectory(trajectories: Sequence[Trajectory], algorithm_cfg: AlgorithmConfig,
                                   rollout_id: int) -> list[TrainRow]:
    """The plain 1:1 converter (`Task.convert`'s default): one row per single-turn trajectory, with the full
    advantage; raises `TrajectoryError` before producing anything on a bad input."""
    trajectories = list(trajectories)
    for traj in trajectories:
        if traj.num_turns != 1:
            raise TrajectoryError(traj.trajectory_id, None, "single_turn",
                                  f"{traj.num_turns} turns; the plain converter takes single-turn trajectories "
                                  "(a multi-turn task converts its own rows, as MemAgentTask does)")
    return advantage_rows(trajectories, algorithm_cfg, rollout_id, "share")


def chat_stop_token_ids(tokenizer: Any) -> list[int]:
    """The tokenizer's eos (and pad), plus <|im_end|> / <|endoftext|> where they are real entries."""
    ids = [getattr(tokenizer, "eos_token_id", None), getattr(tokenizer, "pad_token_id", None)]
    ids += [vocab_id(tokenizer, name) for name in EXTRA_STOP_TOKENS]
    return list(dict.fromkeys(i for i in ids if isinstance(i, int)))  # in order, each once


def vocab_id(tokenizer: Any, token: str) -> int | None:
    """The id of `token` when the tokenizer has it as one vocabulary entry, else None: unknown names map
    to None or to the unk id, so only a real, exact entry counts."""
    token_id = tokenizer.convert_tokens_to_ids(token)
    return token_id if isinstance(token_id, int) and tokenizer.convert_ids_to_tokens(token_id) == token else None


class Task:
    """The base every task derives from: defaults for a 1:1 task (one row per trajectory, the framework's
    answer scorer and converter). A task overrides `sample_group` and whatever else differs."""

    # The class of the `task:` section (`cfg.task`), which validates it: a subclass of TaskSettings.
    Settings: ClassVar[type[TaskSettings]] = TaskSettings
    # The default weight of a reward term (`reward_terms`) by name, 1 where unnamed; `algorithm.reward_weights`
    # overrides it.
    reward_weights: ClassVar[Mapping[str, float]] = {}

    def validate_config(self, cfg: Any) -> None:
        """Raise ValueError for settings the task cannot run with (called when a config loads)."""

    def max_rows_per_trajectory(self, cfg: Any) -> int:
        return 1

    def max_response_tokens(self, cfg: Any) -> int:
        """The most tokens one turn's response may hold (Dr. GRPO's constant normaliser, memrl.train.partition)."""
        return cfg.task.final_tokens

    def stop_token_ids(self, tokenizer: Any, cfg: Any) -> list[int]:
        return chat_stop_token_ids(tokenizer)

    async def sample_group(self, ctx: RolloutContext, group: GroupSlot, n: int) -> list[Trajectory]:
        raise NotImplementedError(f"{type(self).__name__} must define sample_group")

    async def generate(self, ctx: RolloutContext, records: Sequence[Any]) -> RolloutOutput:
        """Every group of the step at once; groups with a failure are left out of training. A 1:1 task
        announces no row count (the loop expects one row per trajectory), any other one row per turn."""
        n = ctx.config.sampling.n_samples
        groups = await asyncio.gather(*(self.sample_group(ctx, g, n) for g in ctx.groups(records)))
        return finish_rollout(groups, one_row_per_turn=self.max_rows_per_trajectory(ctx.config) > 1)

    def reward(self, traj: Trajectory, golds: Sequence[str]) -> float:
        return trajectory_reward(traj, golds)

    def reward_terms(self, cfg: Any) -> dict[str, Callable[[Trajectory, list[str]], float | None]]:
        """The named reward functions a trajectory's reward sums (weighted, `reward_weights`); a term returns
        None where it does not apply. `outcome`, the answer's reward, is the one `plugins.reward_function`
        replaces. Default: `outcome` alone, `reward`."""
        return {OUTCOME: self.reward}

    def score(self, traj: Trajectory, golds: Sequence[str]) -> AnswerScore:
        return score_trajectory(traj, golds)

    def convert(self, trajectories: Sequence[Trajectory], algorithm: Any, rollout_id: int) -> list[TrainRow]:
        """`TrainRow`s, each carrying its trajectory's advantage for the logs; never writes to `trajectories`."""
        return convert_one_row_per_trajectory(trajectories, algorithm, rollout_id)

    def turn_metrics(self, trajectories: Sequence[Trajectory]) -> dict[str, float]:
        return {}

    def log_fields(self, traj: Trajectory | None, phase: Phase) -> dict[str, Any]:
        return {}

    def view_fields(self, record: dict[str, Any], turns: list[dict[str, Any]]) -> dict[str, Any]:
        """What `memrl view` shows of one logged trajectory (an eval line or a rollout log record, with its
        `log_fields`) beyond the answer, scores and turn texts, under the page's keys; a ValueError names a
        field that is not what the task writes. The default adds nothing: prompt / response text only."""
        return {}


def load_task(cfg: Any) -> Task:
    """The configured task (`plugins.task`): the process's one instance of its class (`task_instance`)."""
    return task_instance(cfg.plugins.task)


def task_reward(cfg: Any, task: Task) -> RewardTerms:
    """The task's reward terms, `plugins.reward_function` as the `outcome` term when set (another answer reward for
    the same task), each weighted by `algorithm.reward_weights`, else the task's default weight, else 1."""
    functions = dict(task.reward_terms(cfg))
    if cfg.plugins.reward_function:
        functions[OUTCOME] = import_object(cfg.plugins.reward_function)
    weights = {**dict.fromkeys(functions, 1.0), **task.reward_weights, **cfg.algorithm.reward_weights}
    return RewardTerms(functions, {name: float(weights[name]) for name in functions})


def eval_group(record: Any) -> GroupSlot:
    """An evaluated question's one group: id "eval:<id>", seed key "0:<id>" whatever its position, so
    `memrl eval` and validation sample it the same way."""
    return GroupSlot(0, record, f"0:{record.id}", name=f"eval:{record.id}")


def rows_per_trajectory(cfg: Any) -> int:
    """The most rows one trajectory may expand to (sizes the transfer queue)."""
    if cfg.queue.train_sample_expansion_factor is not None:
        return cfg.queue.train_sample_expansion_factor
    return int(load_task(cfg).max_rows_per_trajectory(cfg))
