"""Validation rules of memrl.rl.validate: each broken rule is reported with its trajectory, turn and id."""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from memrl.rl.validate import TrajectoryError, validate_groups, validate_train_rows, validate_trajectory
from memrl.types import TrainRow, Trajectory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from traj_factory import FINAL_MAX_TOKENS, make_group, make_trajectory  # noqa: E402


def _set(obj, **values):
    for name, value in values.items():
        setattr(obj, name, value)


def _set_at(values: list, position: int, value) -> None:
    values[position] = value


def _shift_indices(t: Trajectory) -> None:
    for turn in t.turns:
        turn.index += 1


def _swap_final_into_middle(t: Trajectory) -> None:
    t.turns[1].kind, t.turns[2].kind = "final", "memory"
    t.turns[1].max_tokens, t.turns[2].max_tokens = t.turns[2].max_tokens, t.turns[1].max_tokens


def _empty_response(turn) -> None:
    _set(turn, response_ids=[], loss_mask=[], rollout_log_probs=[])


def _final_over_its_own_limit(t: Trajectory) -> None:
    # The final turn is longer than its own limit but within the memory-turn limit: official MemAgent
    # took the final limit from the memory limit; validation must check each kind against its own.
    final = t.turns[-1]
    final.max_tokens = 2
    assert final.response_length == 3 and t.turns[0].max_tokens >= 3


# (mutation of a valid 3-turn trajectory "t", expected turn, expected rule)
BROKEN: list[tuple[str, Callable[[Trajectory], None], int | None, str]] = [
    ("index gap", lambda t: _set(t.turns[1], index=5), 1, "turn_index_sequence"),
    ("indices start at 1", _shift_indices, 0, "turn_index_sequence"),
    ("final turn in the middle", _swap_final_into_middle, 1, "final_turn_last"),
    ("no final turn", lambda t: _set(t.turns[2], kind="memory", max_tokens=16), None, "single_final_turn"),
    ("two final turns", lambda t: _set(t.turns[0], kind="final", max_tokens=FINAL_MAX_TOKENS), 0, "single_final_turn"),
    ("kind of no name", lambda t: _set(t.turns[0], kind=""), 0, "turn_kind"),
    ("kind that is no text", lambda t: _set(t.turns[1], kind=None), 1, "turn_kind"),
    ("empty response", lambda t: _empty_response(t.turns[1]), 1, "response_length_positive"),
    ("memory turn over its limit", lambda t: _set(t.turns[0], max_tokens=2), 0, "response_length_limit"),
    ("final turn over its own limit", _final_over_its_own_limit, 2, "response_length_limit"),
    ("empty prompt", lambda t: _set(t.turns[2], prompt_ids=[]), 2, "response_length_tokens"),
    ("loss mask too long", lambda t: t.turns[1].loss_mask.append(1), 1, "loss_mask_length"),
    ("loss mask too short", lambda t: t.turns[2].loss_mask.pop(), 2, "loss_mask_length"),
    ("log-probs too short", lambda t: t.turns[0].rollout_log_probs.pop(), 0, "log_probs_length"),
    ("log-probs too long", lambda t: t.turns[2].rollout_log_probs.append(-1.0), 2, "log_probs_length"),
    ("failed status", lambda t: _set(t, status="failed"), None, "status_trainable"),
    ("no reward", lambda t: _set(t, reward=None), None, "reward_present"),
    ("nan reward", lambda t: _set(t, reward=math.nan), None, "reward_finite"),
    ("text reward", lambda t: _set(t, reward="1"), None, "reward_finite"),
    ("bool reward", lambda t: _set(t, reward=True), None, "reward_finite"),
    ("inf reward", lambda t: _set(t, reward=-math.inf), None, "reward_finite"),
    ("loss mask value 2", lambda t: _set_at(t.turns[1].loss_mask, 0, 2), 1, "loss_mask_binary"),
    ("loss mask value 0.5", lambda t: _set_at(t.turns[0].loss_mask, 1, 0.5), 0, "loss_mask_binary"),
    ("loss mask value nan", lambda t: _set_at(t.turns[2].loss_mask, 2, math.nan), 2, "loss_mask_binary"),
    ("nan log-prob", lambda t: _set_at(t.turns[1].rollout_log_probs, 2, math.nan), 1, "log_probs_finite"),
    ("+inf log-prob", lambda t: _set_at(t.turns[0].rollout_log_probs, 0, math.inf), 0, "log_probs_finite"),
    ("-inf log-prob", lambda t: _set_at(t.turns[2].rollout_log_probs, 1, -math.inf), 2, "log_probs_finite"),
    ("bool log-prob", lambda t: _set_at(t.turns[2].rollout_log_probs, 1, False), 2, "log_probs_finite"),
    ("positive log-prob", lambda t: _set_at(t.turns[1].rollout_log_probs, 0, 0.25), 1, "log_probs_nonpositive"),
    ("empty group id", lambda t: _set(t, group_id=""), None, "group_id_present"),
]


def test_factory_trajectory_is_valid():
    validate_trajectory(make_trajectory("t"))
    validate_trajectory(make_trajectory("t", num_memory_turns=0))  # empty document: final turn only
    validate_trajectory(make_trajectory("t", status="truncated", reward=0.0))


@pytest.mark.parametrize("mutate, turn, rule", [b[1:] for b in BROKEN], ids=[b[0] for b in BROKEN])
def test_each_rule_is_reported_with_trajectory_turn_and_rule(mutate, turn, rule):
    traj = make_trajectory("q7/s3", num_memory_turns=2)
    mutate(traj)
    with pytest.raises(TrajectoryError) as info:
        validate_trajectory(traj)
    err = info.value
    assert (err.trajectory_id, err.turn, err.rule) == ("q7/s3", turn, rule)
    message = str(err)
    assert "q7/s3" in message and rule in message
    if turn is not None:
        assert f"turn {turn}" in message
    # validate_groups runs the same per-trajectory rules
    with pytest.raises(TrajectoryError) as info:
        validate_groups([make_trajectory("other", group_id="q7"), traj])
    assert info.value.rule == rule


def test_trajectory_error_is_a_value_error_with_what_was_found():
    traj = make_trajectory("t")
    traj.turns[0].loss_mask.append(1)
    with pytest.raises(ValueError, match=r"len\(loss_mask\) = 4 but response_length = 3"):
        validate_trajectory(traj)


def test_zero_turns_is_not_a_trajectory():
    traj = make_trajectory("t")
    traj.turns = []
    with pytest.raises(TrajectoryError) as info:
        validate_trajectory(traj)
    assert (info.value.rule, info.value.turn) == ("single_final_turn", None)


def test_groups_with_equal_turn_counts_pass_and_empty_list_passes():
    validate_groups(make_group("q1", [1, 0, 1], num_memory_turns=3) + make_group("q2", [0, 0], num_memory_turns=1))
    validate_groups([])


def test_a_group_whose_samples_take_different_turn_counts_is_valid():
    # The policy may decide how many turns to take (issue 36); a task whose turns must align checks that itself.
    group = make_group("q1", [1, 0], num_memory_turns=2)
    validate_groups([*group, make_trajectory("q1/odd", group_id="q1", num_memory_turns=4, sample_index=2)])


def test_any_turn_kind_is_valid_only_final_is_reserved():
    traj = make_trajectory("t", group_id="q1", num_memory_turns=2)
    traj.turns[0].kind, traj.turns[1].kind = "search", "read"
    validate_trajectory(traj)


def test_turn_counts_may_differ_between_groups():
    validate_groups(make_group("q1", [1, 0], num_memory_turns=1) + make_group("q2", [1, 0], num_memory_turns=4))


def test_duplicate_trajectory_ids_are_rejected():
    a = make_trajectory("dup", group_id="q1")
    b = make_trajectory("dup", group_id="q1", sample_index=1)
    with pytest.raises(TrajectoryError) as info:
        validate_groups([a, b])
    assert (info.value.trajectory_id, info.value.rule) == ("dup", "trajectory_id_unique")


@settings(max_examples=50, deadline=None)
@given(num_memory=st.integers(0, 6), response_len=st.integers(1, FINAL_MAX_TOKENS),
       status=st.sampled_from(["complete", "truncated"]), reward=st.floats(-5, 5))
def test_any_well_formed_trajectory_passes(num_memory, response_len, status, reward):
    validate_trajectory(make_trajectory("t", num_memory_turns=num_memory, response_len=response_len,
                                        status=status, reward=reward))


VOCAB = 50  # the model's vocabulary size in the row tests


def _row(**overrides) -> TrainRow:
    values = dict(tokens=[1, 2, 3, 4, 5], response_length=2, loss_mask=[1, 0], rollout_log_probs=[-0.5, -1.0],
                  advantage=0.25, group_id="q1", trajectory_id="q1/s0", turn_index=1, rollout_id=3)
    values.update(overrides)
    return TrainRow(**values)


@pytest.mark.parametrize("overrides, rule", [
    (dict(response_length=0, loss_mask=[], rollout_log_probs=[]), "row_response_length"),
    (dict(tokens=[1, 2]), "row_response_length"),
    (dict(loss_mask=[1]), "row_loss_mask_length"),
    (dict(rollout_log_probs=[-0.5, -1.0, -2.0]), "row_log_probs_length"),
    (dict(advantage=math.inf), "row_advantage_finite"),
    (dict(advantage=math.nan), "row_advantage_finite"),
    (dict(advantage=True), "row_advantage_finite"),
    (dict(loss_mask=[1, 3]), "row_loss_mask_binary"),
    (dict(loss_mask=[0.5, 1]), "row_loss_mask_binary"),
    (dict(rollout_log_probs=[-0.5, math.nan]), "row_log_probs_finite"),
    (dict(rollout_log_probs=[math.inf, -1.0]), "row_log_probs_finite"),
    (dict(rollout_log_probs=[-0.5, 0.1]), "row_log_probs_nonpositive"),
    (dict(is_padding=True), "padding_mask_zero"),
    (dict(tokens=[1, 2, -1, 4, 5]), "row_token_id_range"),
    (dict(tokens=[1, 2, 3, 4, VOCAB]), "row_token_id_range"),  # one past the model's last embedding row
    (dict(tokens=[1, 2.5, 3, 4, 5]), "row_token_id_type"),
    (dict(tokens=[1, 2, 3, 4.0, 5]), "row_token_id_type"),
    (dict(tokens=[1, 2, 3, False, 5]), "row_token_id_type"),
    (dict(tokens=[1, "2", 3, 4, 5]), "row_token_id_type"),
])
def test_train_row_rules(overrides, rule):
    validate_train_rows([_row(turn_index=0), _row(trajectory_id="q1/s1")], VOCAB)
    with pytest.raises(TrajectoryError) as info:
        validate_train_rows([_row(turn_index=0), _row(trajectory_id="q1/s1", **overrides)], VOCAB)
    assert (info.value.trajectory_id, info.value.turn, info.value.rule) == ("q1/s1", 1, rule)


def test_token_ids_up_to_the_last_embedding_row_pass():
    validate_train_rows([_row(tokens=[0, 1, 2, 3, VOCAB - 1])], VOCAB)
    validate_train_rows([_row(tokens=[0, 1, 2, 3, 10**9])])  # no vocabulary given: only ids < 0 are refused
    with pytest.raises(TrajectoryError, match=r"tokens\[4\] = 6 is not a token id; the model's vocabulary is \[0, 6\)"):
        validate_train_rows([_row(tokens=[0, 1, 2, 3, 6])], 6)


@pytest.mark.parametrize("where, bad, rule", [("response", -1, "row_token_id_range"),
                                             ("response", 7.5, "row_token_id_type"),
                                             ("prompt", "vocab", "row_token_id_range")])
def test_the_trainer_refuses_bad_token_ids_before_any_update(tiny_tokenizer, where, bad, rule):
    """Converted rows reach the actor, which checks their ids against its embedding's rows before the
    step (before: -1 and the vocabulary size ended it in a bare IndexError, 7.5 trained as token 7)."""
    from memrl.config import Config
    from memrl.memagent.task import convert_trajectories
    from memrl.tiny import build_tiny_model
    from memrl.train.actor import Actor

    cfg = Config.model_validate({"train": {"lr": 1e-3}, "algorithm": {"kl_coef": 0.0}})
    model = build_tiny_model(len(tiny_tokenizer), layers=1, hidden=16, heads=2, kv_heads=1, intermediate=32)
    group = make_group("g", [1.0, 0.0])
    for traj in group:  # the factory's ids start at 1000: bring them into the tiny vocabulary
        for turn in traj.turns:
            turn.prompt_ids, turn.response_ids = ([k % 100 for k in turn.prompt_ids],
                                                  [k % 100 for k in turn.response_ids])
    ids = group[1].turns[1].response_ids if where == "response" else group[1].turns[1].prompt_ids
    ids[1] = len(tiny_tokenizer) if bad == "vocab" else bad
    rows = convert_trajectories(group, cfg.algorithm, rollout_id=0)
    actor = Actor(model, cfg, pad_token_id=tiny_tokenizer.pad_token_id)
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(TrajectoryError) as info:
        actor.train_rollout(rows, rollout_id=0)
    assert (info.value.trajectory_id, info.value.turn, info.value.rule) == ("g/s1", 1, rule)
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))


def test_padding_row_with_zero_mask_passes():
    validate_train_rows([_row(is_padding=True, loss_mask=[0, 0], advantage=0.0)])


def test_usual_value_types_pass():
    # Bool masks are 0/1 flags, numpy scalars are real numbers, and a log-prob of exactly 0 is a sure token.
    traj = make_trajectory("t")
    traj.reward = np.float32(0.5)
    traj.turns[0].loss_mask = [True, False, True]
    traj.turns[1].rollout_log_probs = [0.0, np.float64(-1.5), -1e-30]
    validate_trajectory(traj)
    validate_train_rows([_row(loss_mask=[np.int64(1), 0], rollout_log_probs=[0.0, -2.0], advantage=np.float32(1))])
    validate_train_rows([_row(tokens=[np.int64(1), np.int32(2), 3, 4, 5])], VOCAB)  # numpy integers are ids
