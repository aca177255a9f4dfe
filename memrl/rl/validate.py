"""Checks that trajectories (and the rows made from them) are fit for training (docs/design.md §3).

A converter calls `validate_groups` on everything *before* it computes anything, so a bad trajectory
stops the step with a `TrajectoryError` and no row is produced. Each rule has a short, stable id
(`TrajectoryError.rule`) that tests and logs can rely on:

Per trajectory (`validate_trajectory`), checked in this order:
    status_trainable          status is one of `memrl.types.TRAINABLE_STATUSES` (`failed` is not)
    reward_present            reward is set (the reward function ran)
    reward_finite             reward is a finite real number (not a bool, not text)
    group_id_present          group_id is a non-empty string (the GRPO group key)
    single_final_turn         exactly one `final` turn (none, or several, is an error)
    final_turn_last           the `final` turn is the last turn
    turn_kind                 every turn is `memory` or `final`
    turn_index_sequence       turn indices are 0, 1, ..., T-1 in list order
    response_length_positive  0 < response_length
    response_length_limit     response_length <= turn.max_tokens (the turn kind's own limit)
    response_length_tokens    response_length < len(tokens), i.e. at least one prompt token
    loss_mask_length          len(loss_mask) == response_length
    log_probs_length          len(rollout_log_probs) == response_length
    loss_mask_binary          every loss_mask value is the integer 0 or 1
    log_probs_finite          every rollout log-prob is a finite real number
    log_probs_nonpositive     every rollout log-prob is <= 0 (the log of a probability)
Across trajectories (`validate_groups`):
    trajectory_id_unique      no two trajectories share a trajectory_id
    group_turn_count          all trajectories of one group_id have the same number of turns
Per training row (`validate_train_rows`): row_response_length, row_loss_mask_length,
row_log_probs_length, row_loss_mask_binary, row_log_probs_finite, row_log_probs_nonpositive,
row_advantage_finite, padding_mask_zero, row_token_id_type, row_token_id_range: every token id (prompt
and response) an integer in [0, vocab_size).

Token ids are checked on the rows, the one place every converter's output passes (`memrl.train.partition.
plan_rollout`) and where the model's vocabulary size is known (its embedding's rows, past the tokenizer's
own for padded vocabularies such as Qwen3's); a converter cannot know it.

Values are checked, not only lengths: a NaN log-prob or a mask value of 0.5 trains silently on NaN or on
a half-weighted token, `reward=True` is a bool where a score belongs (it would count as 1), a token id of
7.5 would train as token 7 and one of -1 or past the vocabulary ends the step in a bare IndexError.

`response_length_tokens` is stricter than `<=`: the trainer scores response token j from the logits
at position j-1, so the first response token needs at least one token before it.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from memrl.errors import MemrlError
from memrl.types import TRAINABLE_STATUSES, TrainRow, Trajectory, Turn


class TrajectoryError(ValueError, MemrlError):
    """A trajectory (or a row made from one) breaks a training rule.

    `trajectory_id` names the trajectory, `turn` its turn (position in `turns`, equal to the turn
    index when indices are valid; None for trajectory-level rules), `rule` the stable rule id.
    """

    def __init__(self, trajectory_id: str, turn: int | None, rule: str, found: str) -> None:
        self.trajectory_id = trajectory_id
        self.turn = turn
        self.rule = rule
        self.found = found
        where = f"trajectory '{trajectory_id}'" + ("" if turn is None else f", turn {turn}")
        super().__init__(f"{where} breaks rule '{rule}': {found}")


def _is_real(value: object) -> bool:
    """A real number that is not a bool: Python counts True as 1, but a flag is never a score."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def _value_problem(loss_mask: Sequence[object], log_probs: Sequence[object]) -> tuple[str, str] | None:
    """(rule, what was found) for the first bad loss-mask or log-prob value, else None.

    Lengths are checked before this; values matter as much: the trainer multiplies by the mask and
    takes exp of log-prob differences, so one NaN, inf or 0.5 silently changes the whole step.
    """
    for k, value in enumerate(loss_mask):
        if not (isinstance(value, numbers.Integral) and value in (0, 1)):
            return "loss_mask_binary", f"loss_mask[{k}] = {value!r}; every value must be the integer 0 or 1"
    for k, value in enumerate(log_probs):
        if not (_is_real(value) and math.isfinite(value)):
            return "log_probs_finite", (f"rollout_log_probs[{k}] = {value!r}; every value must be a finite number "
                                        "(the engine returned no usable log-prob for this token)")
        if value > 0:
            return "log_probs_nonpositive", (f"rollout_log_probs[{k}] = {value!r} > 0; a log-probability is at most "
                                             "0 (the engine returned something else, e.g. a probability or a logit)")
    return None


def _check_turn(trajectory_id: str, position: int, turn: Turn) -> None:
    def fail(rule: str, found: str) -> None:
        raise TrajectoryError(trajectory_id, position, rule, found)

    if turn.index != position:
        fail("turn_index_sequence", f"turn at position {position} has index {turn.index}; indices must be 0..T-1 in order")
    length = turn.response_length
    if length <= 0:
        fail("response_length_positive", "response is empty; every turn must have at least one response token")
    if length > turn.max_tokens:
        fail("response_length_limit", f"response_length {length} exceeds this {turn.kind} turn's max_tokens {turn.max_tokens}")
    if length >= len(turn.tokens):
        fail("response_length_tokens",
             f"response_length {length} is not below len(tokens) {len(turn.tokens)}; the prompt must not be empty")
    if len(turn.loss_mask) != length:
        fail("loss_mask_length", f"len(loss_mask) = {len(turn.loss_mask)} but response_length = {length}")
    if len(turn.rollout_log_probs) != length:
        fail("log_probs_length", f"len(rollout_log_probs) = {len(turn.rollout_log_probs)} but response_length = {length}")
    if (problem := _value_problem(turn.loss_mask, turn.rollout_log_probs)) is not None:
        fail(*problem)


def validate_trajectory(traj: Trajectory) -> None:
    """Raise `TrajectoryError` at the first rule `traj` breaks (rules in the module docstring)."""
    tid = traj.trajectory_id

    def fail(rule: str, found: str, turn: int | None = None) -> None:
        raise TrajectoryError(tid, turn, rule, found)

    # Status first: a failed trajectory carries no usable tokens, so its turn errors would mislead.
    if traj.status not in TRAINABLE_STATUSES:
        fail("status_trainable", f"status is '{traj.status}'; only {', '.join(TRAINABLE_STATUSES)} can be trained on "
             "(drop failed trajectories before converting)")
    if traj.reward is None:
        fail("reward_present", "reward is None; run the reward function before converting")
    if not _is_real(traj.reward) or not math.isfinite(traj.reward):
        fail("reward_finite", f"reward is {traj.reward!r}; it must be a finite real number (not a bool or text)")
    if not isinstance(traj.group_id, str) or not traj.group_id:
        fail("group_id_present", f"group_id is {traj.group_id!r}; it must name the trajectory's prompt group")

    kinds = [turn.kind for turn in traj.turns]
    final_positions = [i for i, kind in enumerate(kinds) if kind == "final"]
    if len(final_positions) != 1:
        where = final_positions[0] if final_positions else None
        fail("single_final_turn", f"{len(final_positions)} final turns among {len(kinds)} turns (kinds {kinds}); "
             "expected memory turns then exactly one final turn", where)
    if final_positions[0] != len(kinds) - 1:
        fail("final_turn_last", f"the final turn is at position {final_positions[0]} of {len(kinds)} (kinds {kinds}); "
             "it must be the last", final_positions[0])
    for position, kind in enumerate(kinds):
        if kind not in ("memory", "final"):
            fail("turn_kind", f"kind is {kind!r}; expected 'memory' or 'final'", position)

    for position, turn in enumerate(traj.turns):
        _check_turn(tid, position, turn)


def validate_groups(trajectories: Sequence[Trajectory]) -> None:
    """Validate every trajectory, then the rules that span trajectories (unique ids, equal turn counts).

    An empty list is valid (it converts to zero rows).
    """
    seen_ids: set[str] = set()
    turns_by_group: dict[str, tuple[str, int]] = {}
    for traj in trajectories:
        validate_trajectory(traj)
        if traj.trajectory_id in seen_ids:
            raise TrajectoryError(traj.trajectory_id, None, "trajectory_id_unique",
                                  "another trajectory has the same trajectory_id; rows and advantages are keyed by it")
        seen_ids.add(traj.trajectory_id)
        first = turns_by_group.setdefault(traj.group_id, (traj.trajectory_id, traj.num_turns))
        if first[1] != traj.num_turns:
            raise TrajectoryError(
                traj.trajectory_id, None, "group_turn_count",
                f"{traj.num_turns} turns, but trajectory '{first[0]}' of the same group '{traj.group_id}' has "
                f"{first[1]}; samples of one question read the same chunks and must have equal turn counts",
            )


def _token_id_problem(ids: Sequence[object], vocab_size: int | None) -> tuple[str, str] | None:
    """(rule, what was found) for the first of `ids` that is not an integer in [0, vocab_size) (>= 0 when
    `vocab_size` is None), else None.

    Fast path first: a step's rows hold millions of ids; the set of types and min/max run at C speed (~50
    ns an id), and only rows that fail them are walked to name the first bad id.
    """
    if not ids:
        return None
    if not set(map(type, ids)) <= {int}:
        for k, value in enumerate(ids):
            if isinstance(value, bool) or not isinstance(value, numbers.Integral):
                return "row_token_id_type", f"tokens[{k}] = {value!r}; every token id must be an integer"
    if min(ids) >= 0 and (vocab_size is None or max(ids) < vocab_size):
        return None
    k, value = next((k, v) for k, v in enumerate(ids) if v < 0 or (vocab_size is not None and v >= vocab_size))
    bound = "token ids are >= 0" if vocab_size is None else f"the model's vocabulary is [0, {vocab_size})"
    return "row_token_id_range", f"tokens[{k}] = {value!r} is not a token id; {bound}"


def validate_train_rows(rows: Iterable[TrainRow], vocab_size: int | None = None) -> None:
    """Check rows just before training: shapes agree with response_length; mask, log-prob and advantage
    values are usable (the same value rules as for turns); token ids are integers in [0, vocab_size), the
    rows of the trainer's embedding (>= 0 only when `vocab_size` is None).

    Padding rows (`is_padding`) obey the same shape rules and must have an all-zero loss mask, so they
    can never contribute a gradient.
    """
    for row in rows:
        def fail(rule: str, found: str, row: TrainRow = row) -> None:
            raise TrajectoryError(row.trajectory_id, row.turn_index, rule, found)

        length = row.response_length
        if not 0 < length < len(row.tokens):
            fail("row_response_length", f"response_length {length} must be > 0 and < len(tokens) {len(row.tokens)}")
        if len(row.loss_mask) != length:
            fail("row_loss_mask_length", f"len(loss_mask) = {len(row.loss_mask)} but response_length = {length}")
        if len(row.rollout_log_probs) != length:
            fail("row_log_probs_length", f"len(rollout_log_probs) = {len(row.rollout_log_probs)} but response_length = {length}")
        if (problem := _value_problem(row.loss_mask, row.rollout_log_probs)) is not None:
            fail(f"row_{problem[0]}", problem[1])
        if not _is_real(row.advantage) or not math.isfinite(row.advantage):
            fail("row_advantage_finite", f"advantage is {row.advantage!r}; it must be a finite real number")
        if row.is_padding and any(row.loss_mask):
            fail("padding_mask_zero", "a padding row has non-zero loss_mask entries; padding must never train")
        if (problem := _token_id_problem(row.tokens, vocab_size)) is not None:
            fail(*problem)
