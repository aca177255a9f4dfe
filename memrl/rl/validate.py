"""Checks that trajectories (and the rows made from them) are fit for training (the rules: docs/design.md §3).

A converter calls `validate_groups` before it computes anything, so a bad trajectory stops the step with a
`TrajectoryError` and no row. Each rule has a stable id (`TrajectoryError.rule`), checked in this order:
- per trajectory: status_trainable, reward_present, reward_finite (a real number, not a bool),
  group_id_present, single_final_turn, final_turn_last, turn_kind (any non-empty name; `final` is the answer's);
- per turn: turn_index_sequence (0..T-1), response_length_positive, response_length_limit (the kind's
  max_tokens), response_length_tokens (< len(tokens): token j is scored from position j-1, so one prompt
  token is needed), loss_mask_length, log_probs_length, loss_mask_binary (integer 0 or 1),
  log_probs_finite, log_probs_nonpositive;
- across trajectories: trajectory_id_unique (a group's samples may take different numbers of turns: a task
  whose turns must align checks that itself, as MemAgent's converter does);
- per training row (`validate_train_rows`): row_response_length, the turn's mask and log-prob rules
  prefixed `row_`, row_advantage_finite, padding_mask_zero, row_token_id_type, row_token_id_range
  ([0, vocab_size): only the trainer knows the embedding's rows).
Values are checked, not only lengths: a NaN log-prob or a mask of 0.5 trains silently on NaN or a
half-weighted token, `reward=True` would count as 1, a token id of 7.5 trains as 7 and -1 ends the step in
a bare IndexError.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from memrl.errors import MemrlError
from memrl.types import TRAINABLE_STATUSES, TrainRow, Trajectory, Turn


class TrajectoryError(ValueError, MemrlError):
    """A trajectory (or a row made from one) breaks rule `rule`; `turn` is the turn's position (None for
    trajectory-level rules)."""

    def __init__(self, trajectory_id: str, turn: int | None, rule: str, found: str) -> None:
        self.trajectory_id = trajectory_id
        self.turn = turn
        self.rule = rule
        self.found = found
        where = f"trajectory '{trajectory_id}'" + ("" if turn is None else f", turn {turn}")
        super().__init__(f"{where} breaks rule '{rule}': {found}")


def is_finite_real(value: object) -> bool:
    """A finite real number that is not a bool: Python counts True as 1, but a flag is never a score."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool) and math.isfinite(value)


def _response_problem(length: int, loss_mask: Sequence[object],
                      log_probs: Sequence[object]) -> tuple[str, str] | None:
    """(rule, what was found) for the first loss mask or log-probs not one valid value per response token."""
    if len(loss_mask) != length:
        return "loss_mask_length", f"len(loss_mask) = {len(loss_mask)} but response_length = {length}"
    if len(log_probs) != length:
        return "log_probs_length", f"len(rollout_log_probs) = {len(log_probs)} but response_length = {length}"
    for k, value in enumerate(loss_mask):
        if not (isinstance(value, numbers.Integral) and value in (0, 1)):
            return "loss_mask_binary", f"loss_mask[{k}] = {value!r}; every value must be the integer 0 or 1"
    for k, value in enumerate(log_probs):
        if not is_finite_real(value):
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
        fail("turn_index_sequence",
             f"turn at position {position} has index {turn.index}; indices must be 0..T-1 in order")
    length = turn.response_length
    if length <= 0:
        fail("response_length_positive", "response is empty; every turn must have at least one response token")
    if length > turn.max_tokens:
        fail("response_length_limit",
             f"response_length {length} exceeds this {turn.kind} turn's max_tokens {turn.max_tokens}")
    if length >= len(turn.tokens):  # token j is scored from position j-1, so one prompt token is needed
        fail("response_length_tokens",
             f"response_length {length} is not below len(tokens) {len(turn.tokens)}; the prompt must not be empty")
    if (problem := _response_problem(length, turn.loss_mask, turn.rollout_log_probs)) is not None:
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
    if not is_finite_real(traj.reward):
        fail("reward_finite", f"reward is {traj.reward!r}; it must be a finite real number (not a bool or text)")
    if not isinstance(traj.group_id, str) or not traj.group_id:
        fail("group_id_present", f"group_id is {traj.group_id!r}; it must name the trajectory's prompt group")

    kinds = [turn.kind for turn in traj.turns]
    final_positions = [i for i, kind in enumerate(kinds) if kind == "final"]
    if len(final_positions) != 1:
        where = final_positions[0] if final_positions else None
        fail("single_final_turn", f"{len(final_positions)} final turns among {len(kinds)} turns (kinds {kinds}); "
             "expected the task's other turns, then exactly one final turn", where)
    if final_positions[0] != len(kinds) - 1:
        fail("final_turn_last", f"the final turn is at position {final_positions[0]} of {len(kinds)} (kinds {kinds}); "
             "it must be the last", final_positions[0])
    for position, kind in enumerate(kinds):
        if not (isinstance(kind, str) and kind):  # any name the task gives its turns; `final` is reserved
            fail("turn_kind", f"kind is {kind!r}; expected a non-empty name such as 'memory' or 'search'", position)

    for position, turn in enumerate(traj.turns):
        _check_turn(tid, position, turn)


def validate_groups(trajectories: Sequence[Trajectory]) -> None:
    """Validate every trajectory, then the rules across trajectories; an empty list is valid."""
    seen_ids: set[str] = set()
    for traj in trajectories:
        validate_trajectory(traj)
        if traj.trajectory_id in seen_ids:
            raise TrajectoryError(traj.trajectory_id, None, "trajectory_id_unique",
                                  "another trajectory has the same trajectory_id; rows and advantages are keyed by it")
        seen_ids.add(traj.trajectory_id)


def _token_id_problem(ids: Sequence[object], vocab_size: int | None) -> tuple[str, str] | None:
    """(rule, what was found) for the first of `ids` not an integer in [0, vocab_size) (>= 0 when None).
    A step holds millions of ids: the set of types and min/max run at C speed (~50 ns an id), and only a
    row that fails them is walked to name the first bad id."""
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
    """Check rows just before training (the per-row rules of the module docstring); padding rows obey the same
    shape rules and must have an all-zero loss mask, so they never contribute a gradient."""
    for row in rows:
        def fail(rule: str, found: str, row: TrainRow = row) -> None:
            raise TrajectoryError(row.trajectory_id, row.turn_index, rule, found)

        length = row.response_length
        if not 0 < length < len(row.tokens):
            fail("row_response_length", f"response_length {length} must be > 0 and < len(tokens) {len(row.tokens)}")
        if (problem := _response_problem(length, row.loss_mask, row.rollout_log_probs)) is not None:
            fail(f"row_{problem[0]}", problem[1])
        if not is_finite_real(row.advantage):
            fail("row_advantage_finite", f"advantage is {row.advantage!r}; it must be a finite real number")
        if row.is_padding and any(row.loss_mask):
            fail("padding_mask_zero", "a padding row has non-zero loss_mask entries; padding must never train")
        if (problem := _token_id_problem(row.tokens, vocab_size)) is not None:
            fail(*problem)
