"""What every task's rollout shares, owned by the framework so that no task can get it wrong: the group
slots (`ctx.groups`: a question's position in the step's whole batch, also on a Ray worker's slice, from
which group ids and seeds derive; a batch wrapping the data set holds a question twice), one turn
(`ctx.sample_turn`: the request's seed from group, sample and turn, the task's stop ids, an engine error as
a failed trajectory, the Turn exactly as sampled, the answer of a `final` one; `ctx.extend_turn`: tokens the
policy did not sample, untrained, then more of the same turn), the checked reward (`ctx.reward`: named,
weighted terms, each a finite real number or None, "not applicable", within `task.reward_timeout_s`, else a
`RewardError` that fails the step), `finish_rollout`
(groups with a failure dropped, common metrics, the row count to announce) and `ctx.scratch`, a per-context
cache for the task.
"""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from memrl.config import OUTCOME, task_instance
from memrl.engines.base import Engine, GenerationRequest, GenerationResult
from memrl.errors import MemrlError
from memrl.rl.validate import is_finite_real
from memrl.types import RolloutOutput, Trajectory, Turn

# The log-prob stored for a response token the policy did not sample (a tool's output, `extend_turn`): its loss
# mask is 0, so no loss, ratio or metric ever reads it.
UNTRAINED_LOG_PROB = 0.0


def request_seed(base_seed: int, *parts: Any) -> int:
    """A stable per-request seed: the same (question, sample, turn) samples the same way on every run."""
    digest = hashlib.sha256(":".join(str(p) for p in (base_seed, *parts)).encode()).digest()
    return int.from_bytes(digest[:4], "little") & 0x7FFFFFFF


class RewardError(ValueError, MemrlError):
    """A reward function returned no finite real number, or not within `task.reward_timeout_s`: the
    rollout step fails; the message names the function and what to fix."""


def reward_name(fn: Callable[..., Any]) -> str:
    """`module:function`, as `plugins.reward_function` names it."""
    return f"{getattr(fn, '__module__', None)}:{getattr(fn, '__qualname__', repr(fn))}"


@dataclass(frozen=True)
class RewardTerms:
    """Named reward functions `(trajectory, golds) -> float | None` and their weights (TRL's `reward_funcs`,
    `reward_weights`): the reward is the weighted sum of the terms that apply, None meaning "not applicable"
    (TRL's nansum); `memrl.task.task_reward` builds the configured ones."""

    functions: Mapping[str, Callable[[Trajectory, list[str]], Any]]
    weights: Mapping[str, float]


def checked_reward(value: Any, name: str, trajectory_id: str) -> float:
    """`value` as a float when it is a finite real number. `float()` alone would take a bool or a string
    (True -> 1.0, "1.0" -> 1.0) and train on it silently: a reward function returning one has a bug."""
    if not is_finite_real(value):
        raise RewardError(f"reward function {name} returned {value!r} ({type(value).__name__}) for trajectory "
                          f"{trajectory_id}; a reward must be a finite real number (an int or a float, not a bool "
                          f"or a string): fix the function")
    return float(value)


def call_with_timeout(fn: Callable[..., Any], args: tuple[Any, ...], timeout_s: float, name: str) -> Any:
    """`fn(*args)`, waited for at most `timeout_s` (its own exceptions re-raised). It runs in a daemon thread
    because a call that hangs cannot be stopped (Python cannot kill a thread): past the timeout it is left
    running, its result is dropped, and the process exits without waiting for it."""
    outcome: dict[str, Any] = {}

    def call() -> None:
        try:
            outcome["value"] = fn(*args)
        except BaseException as error:  # noqa: BLE001 - handed to the caller's thread
            outcome["error"] = error

    thread = threading.Thread(target=call, name=f"memrl-reward {name}", daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        raise RewardError(f"reward function {name} did not return within {timeout_s:g} s (task.reward_timeout_s); "
                          f"the call is left running in a background thread; fix the function or raise "
                          f"task.reward_timeout_s")
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


@dataclass(frozen=True)
class GroupSlot:
    """One question of a rollout step: its slot in the step's batch and the key its group is named by."""

    slot: int
    record: Any
    key: str
    name: str | None = None  # the group id, when not `r{key}` (an evaluated question's: memrl.task.eval_group)

    @property
    def group_id(self) -> str:
        return self.name or f"r{self.key}"

    def trajectory_id(self, sample_index: int) -> str:
        return f"{self.group_id}:s{sample_index}"


@dataclass
class RolloutContext:
    """Everything a task's sampling needs besides the questions."""

    engine: Engine
    tokenizer: Any
    config: Any  # memrl.config.Config (or a plugin's subclass)
    rollout_id: int = 0
    # The configured terms (`memrl.task.task_reward`), or one function, the `outcome` term of weight 1.
    reward_function: RewardTerms | Callable[[Trajectory, list[str]], float] | None = None
    progress: bool = True
    # Position of this batch's first question in the step's whole batch: a rollout worker that serves a
    # slice keeps the group ids and seeds the whole batch would have in one process.
    slot_offset: int = 0
    phase: str = "train"  # or "eval" (memrl/task.py): who asks for the samples
    scratch: dict[str, Any] = field(default_factory=dict, repr=False)
    # The first failed reward call of this rollout: the step is lost, so trajectories still in flight get
    # the same error at once instead of calling a hung function again (one timeout per step, not per call).
    _reward_failure: RewardError | None = field(default=None, init=False, repr=False)
    _stop_ids: list[int] | None = field(default=None, init=False, repr=False)

    def groups(self, records: Sequence[Any]) -> list[GroupSlot]:
        """Each record with its slot (offset applied) and group key `{rollout_id}:{slot}:{id}`."""
        return [GroupSlot(self.slot_offset + k, record, f"{self.rollout_id}:{self.slot_offset + k}:{record.id}")
                for k, record in enumerate(records)]

    @property
    def stop_ids(self) -> list[int]:
        """The configured task's ids that end a turn (`Task.stop_token_ids`), asked once per context."""
        if self._stop_ids is None:
            self._stop_ids = list(task_instance(self.config.plugins.task).stop_token_ids(self.tokenizer, self.config))
        return self._stop_ids

    async def sample_turn(self, group: GroupSlot, traj: Trajectory, kind: str, prompt_ids: Sequence[int],
                          max_tokens: int) -> Turn | None:
        """Sample turn `len(traj.turns)` of `traj` (seeded by group, sample and turn: a rerun samples the same)
        and append it, exactly as sampled; a `final` turn also sets the answer and the status (`complete` when
        it ended on a stop id, else `truncated`). An engine error, reported or raised, marks `traj` failed,
        naming the turn, and returns None: it fails one trajectory, never the batch (its group is dropped)."""
        index = len(traj.turns)
        seed = request_seed(self.config.sampling.seed, group.key, traj.sample_index, index)
        if (result := await self._sample(traj, f"{kind} turn {index}", prompt_ids, max_tokens, seed)) is None:
            return None
        traj.turns.append(Turn(index, kind, list(prompt_ids), list(result.output_ids), list(result.log_probs),
                               [1] * len(result.output_ids), result.finish_reason, max_tokens))
        return self._answered(traj)

    async def extend_turn(self, group: GroupSlot, traj: Trajectory, inserted_ids: Sequence[int],
                          max_tokens: int) -> Turn | None:
        """Go on with `traj`'s last turn: `inserted_ids`, tokens the policy did not sample (a tool's output),
        join its response untrained (loss mask 0, `UNTRAINED_LOG_PROB`), then up to `max_tokens` more are
        sampled after them (seeded by the turn and its length so far); the turn's limit grows by both, its
        finish reason is the last sample's. One row then trains on what the policy wrote around a tool call.
        An engine error fails `traj` as in `sample_turn`."""
        turn = traj.turns[-1]
        seed = request_seed(self.config.sampling.seed, group.key, traj.sample_index, turn.index, turn.response_length)
        if (result := await self._sample(traj, f"{turn.kind} turn {turn.index} (extended)",
                                         turn.tokens + list(inserted_ids), max_tokens, seed)) is None:
            return None
        n = len(inserted_ids)
        turn.response_ids += [*inserted_ids, *result.output_ids]
        turn.rollout_log_probs += [UNTRAINED_LOG_PROB] * n + list(result.log_probs)
        turn.loss_mask += [0] * n + [1] * len(result.output_ids)
        turn.finish_reason, turn.max_tokens = result.finish_reason, turn.max_tokens + n + max_tokens
        return self._answered(traj)

    async def _sample(self, traj: Trajectory, where: str, prompt_ids: Sequence[int], max_tokens: int,
                      seed: int) -> GenerationResult | None:
        """One request's result; None when it failed, `traj` then marked failed with the message."""
        sampling = self.config.sampling
        request = GenerationRequest(list(prompt_ids), max_tokens, sampling.temperature, sampling.top_p,
                                    self.stop_ids, seed=seed)
        try:
            (result,) = await self.engine.generate([request])
        except Exception as e:  # an engine should report errors as results; one that raises fails one trajectory
            result = GenerationResult.failed(f"{type(e).__name__}: {e}")
        if result.finish_reason != "error" and result.output_ids:
            return result
        traj.status, traj.error = "failed", f"{where}: {result.error or 'engine returned no tokens'}"
        return None

    def _answered(self, traj: Trajectory) -> Turn:
        """The last turn; when it is the `final` one, the answer is the text it sampled (stop ids left out),
        recorded with how the run reads answers (`task.answer_extractor`, `task.answer_after_think`: settings
        every task shares), so reward, eval, pass@k and `memrl view` score it alike whatever the task."""
        turn = traj.turns[-1]
        if turn.kind == "final":
            task = self.config.task
            traj.metadata = traj.metadata or {}
            traj.metadata.update(answer_extractor=task.answer_extractor, answer_after_think=task.answer_after_think)
            stops = set(self.stop_ids)
            traj.answer = self.tokenizer.decode([t for t, m in zip(turn.response_ids, turn.loss_mask, strict=True)
                                                 if m and t not in stops], skip_special_tokens=True)
            traj.status = "complete" if turn.finish_reason == "stop" else "truncated"
        return turn

    def reward(self, traj: Trajectory, golds: Sequence[str]) -> float | None:
        """The configured reward of a finished trajectory: the weighted sum of its terms that apply, each term's
        value (None: not applicable) and weight recorded in `metadata["reward_terms"]`, `["reward_weights"]`;
        a failed one scores 0 (it is dropped anyway). A value that is no finite real number or None, a call past
        `task.reward_timeout_s`, or no term applying is a RewardError."""
        if self.reward_function is None:
            return None
        if traj.status == "failed":
            return 0.0
        if self._reward_failure is not None:
            raise self._reward_failure
        terms = self.reward_function
        if not isinstance(terms, RewardTerms):
            terms = RewardTerms({OUTCOME: terms}, {OUTCOME: 1.0})
        try:
            several = len(terms.functions) > 1  # a single one's errors read as they did before terms
            values = {term: self._term(fn, reward_name(fn) + f" (term {term})" * several, traj, golds)
                      for term, fn in terms.functions.items()}
            if all(v is None for v in values.values()):
                raise RewardError(f"every reward term ({', '.join(values)}) returned None (not applicable) for "
                                  f"trajectory {traj.trajectory_id}; at least one must score it")
        except RewardError as error:
            self._reward_failure = error
            raise
        traj.metadata.update(reward_terms=values, reward_weights=dict(terms.weights))
        return sum(terms.weights[term] * v for term, v in values.items() if v is not None)

    def _term(self, fn: Callable[..., Any], name: str, traj: Trajectory, golds: Sequence[str]) -> float | None:
        value = call_with_timeout(fn, (traj, list(golds)), self.config.task.reward_timeout_s, name)
        return None if value is None else checked_reward(value, name, traj.trajectory_id)


def common_metrics(trajectories: Sequence[Trajectory]) -> dict[str, float]:
    """Counts, reward, turns and generated tokens of a rollout step (failed trajectories counted apart)."""
    ok = [t for t in trajectories if t.status != "failed"]
    metrics: dict[str, float] = {"trajectories/total": float(len(trajectories)),
                                 "trajectories/failed": float(len(trajectories) - len(ok))}
    if not ok:
        return metrics
    rewards = [t.reward for t in ok if t.reward is not None]
    if rewards:
        metrics["reward/mean"] = sum(rewards) / len(rewards)
    terms = [t.metadata.get("reward_terms") or {} for t in ok]
    for name in dict.fromkeys(name for values in terms for name in values):  # each term where it applied
        if applied := [values[name] for values in terms if values.get(name) is not None]:
            metrics[f"reward/{name}"] = sum(applied) / len(applied)
    metrics["turns/mean"] = sum(len(t.turns) for t in ok) / len(ok)
    metrics["tokens/generated"] = float(sum(t.response_length for tr in ok for t in tr.turns))
    return metrics


def finish_rollout(groups: Sequence[Sequence[Trajectory]], metrics: dict[str, float] | None = None,
                   one_row_per_turn: bool = True) -> RolloutOutput:
    """The step's output: whole groups kept, groups with a failure dropped (and counted), the common
    metrics plus the task's `metrics`, and the exact row count of the kept trajectories, one row per turn
    (`one_row_per_turn=False`: a 1:1 task, no count announced)."""
    failed = [any(t.status == "failed" for t in g) for g in groups]
    kept = [t for g, bad in zip(groups, failed, strict=True) if not bad for t in g]
    dropped = [t for g, bad in zip(groups, failed, strict=True) if bad for t in g]
    out = common_metrics([t for g in groups for t in g])
    out["groups/dropped"] = float(sum(failed))
    out.update(metrics or {})
    row_count = sum(len(t.turns) for t in kept) if one_row_per_turn else None
    return RolloutOutput(trajectories=kept, metrics=out, train_row_count=row_count, dropped=dropped)


def record_weight_version(out: RolloutOutput, version: int | None) -> RolloutOutput:
    """Stamp every trajectory with the weight version its engine sampled with (the converter copies it onto
    every row); the framework does it, so no task has to."""
    if version is not None:
        for traj in out.trajectories + out.dropped:
            traj.metadata["weight_version"] = version
    return out


def turn_log_records(traj: Trajectory, tokenizer: Any) -> list[dict[str, Any]]:
    """Each turn as the logs keep it (rollout logs, eval results, `memrl view`): kind, token lengths, finish
    reason and the decoded response (`metadata["turn_texts"]` when training decoded it already)."""
    texts = traj.metadata.get("turn_texts") or [decode_response(t, tokenizer) for t in traj.turns]
    return [{"kind": t.kind, "prompt_length": len(t.prompt_ids), "response_length": t.response_length,
             "finish_reason": t.finish_reason, "text": text} for t, text in zip(traj.turns, texts, strict=True)]


def decode_response(turn: Any, tokenizer: Any) -> str:
    """A turn's response as text: what the logs show and what per-turn rewards read."""
    return tokenizer.decode(turn.response_ids, skip_special_tokens=True)

