"""The MemAgent converter: validate everything, GRPO per trajectory, then one row per turn."""

from __future__ import annotations

import copy
import math
import random
import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memrl.config import AlgorithmConfig, Config, load_config
from memrl.memagent.task import convert_trajectories
from memrl.rl.advantages import grpo_advantages, trajectory_advantages
from memrl.rl.validate import TrajectoryError, validate_train_rows
from memrl.task import load_task

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
from traj_factory import make_group, make_trajectory  # noqa: E402

SPLIT = AlgorithmConfig(credit="split", std_normalize=False)
SHARE = AlgorithmConfig(credit="share", std_normalize=False)


def _snapshot(trajs):
    return [t.to_dict() for t in trajs]


def _rows_by_key(rows):
    return {(r.trajectory_id, r.turn_index): r for r in rows}


def test_is_the_default_tasks_converter(monkeypatch):
    monkeypatch.setattr("memrl.memagent.task.convert_trajectories", lambda ts, a, r: ["rows of", ts, r])
    assert load_task(Config()).convert(["t"], AlgorithmConfig(), 3) == ["rows of", ["t"], 3]


def test_split_and_share_values_by_hand():
    trajs = make_group("q1", [1.0, 0.0], num_memory_turns=2)  # 3 turns each, advantages +-0.5
    split = _rows_by_key(convert_trajectories(trajs, SPLIT, rollout_id=7))
    share = _rows_by_key(convert_trajectories(trajs, SHARE, rollout_id=7))
    for turn in range(3):
        assert split[("q1/s0", turn)].advantage == pytest.approx(0.5 / 3)
        assert split[("q1/s1", turn)].advantage == pytest.approx(-0.5 / 3)
        assert share[("q1/s0", turn)].advantage == 0.5
        assert share[("q1/s1", turn)].advantage == -0.5


def test_default_config_std_normalizes_and_splits():
    trajs = make_group("q1", [1.0, 0.0], num_memory_turns=1)
    rows = _rows_by_key(convert_trajectories(trajs, AlgorithmConfig(), rollout_id=0))
    assert rows[("q1/s0", 0)].advantage == pytest.approx(1.0 / 2, rel=1e-5)  # +-1 after std, split over 2 turns
    assert rows[("q1/s1", 1)].advantage == pytest.approx(-1.0 / 2, rel=1e-5)


def test_every_row_is_its_turn_with_the_turns_advantage_on_the_response_tokens():
    # SkyRL PR #1507: the advantage landed on the wrong positions. Here every row's response window
    # tokens[-response_length:] is the turn's sampled response, and mask/log-probs align with it.
    trajs = make_group("q1", [1.0, 0.0, 0.0], num_memory_turns=3) + make_group("q2", [0.0, 1.0], num_memory_turns=0)
    advantages = trajectory_advantages(trajs, std_normalize=True)
    rows = convert_trajectories(trajs, AlgorithmConfig(credit="split"), rollout_id=11)
    turns = {(t.trajectory_id, turn.index): (t, turn) for t in trajs for turn in t.turns}
    assert len(rows) == len(turns)
    for row in rows:
        traj, turn = turns[(row.trajectory_id, row.turn_index)]
        assert row.tokens == turn.prompt_ids + turn.response_ids
        assert row.response_length == turn.response_length
        assert row.tokens[-row.response_length:] == turn.response_ids
        assert row.tokens[: row.prompt_length] == turn.prompt_ids
        assert row.loss_mask == turn.loss_mask and row.rollout_log_probs == turn.rollout_log_probs
        assert (row.group_id, row.rollout_id, row.is_padding) == (traj.group_id, 11, False)
        expected = advantages[traj.trajectory_id] / traj.num_turns
        # the per-token advantage a trainer builds: the row's advantage on every masked response token
        per_token = [0.0] * row.prompt_length + [row.advantage * m for m in row.loss_mask]
        response_positions = range(len(row.tokens) - row.response_length, len(row.tokens))
        for pos in response_positions:
            k = pos - row.prompt_length
            assert row.tokens[pos] == turn.response_ids[k]
            assert per_token[pos] == pytest.approx(expected * turn.loss_mask[k])
        assert expected != 0.0 and sum(1 for a in per_token if a != 0.0) == sum(turn.loss_mask)
    validate_train_rows(rows)


def test_rows_do_not_alias_the_trajectories():
    trajs = make_group("q1", [1.0, 0.0])
    before = _snapshot(trajs)
    rows = convert_trajectories(trajs, SPLIT, rollout_id=0)
    for row in rows:
        row.loss_mask[0] = 9
        row.rollout_log_probs[0] = 9.0
        row.tokens[0] = -1
    assert _snapshot(trajs) == before


def test_row_order_is_group_then_trajectory_then_turn_whatever_the_input_order():
    trajs = make_group("q2", [1.0, 0.0, 1.0]) + make_group("q1", [0.0, 1.0], num_memory_turns=1)
    rows = convert_trajectories(trajs, SPLIT, rollout_id=0)
    keys = [(r.group_id, r.trajectory_id, r.turn_index) for r in rows]
    assert keys == sorted(keys) and keys[0] == ("q1", "q1/s0", 0)
    shuffled = trajs[:]
    random.Random(3).shuffle(shuffled)
    assert convert_trajectories(shuffled, SPLIT, rollout_id=0) == rows


def test_groups_keyed_by_group_id_are_normalized_separately():
    q1 = make_group("q1", [1.0, 0.0, 0.0, 0.0])
    q2 = make_group("q2", [1.0, 1.0, 0.0, 1.0], num_memory_turns=1)
    cfg = AlgorithmConfig(credit="share", std_normalize=True)
    rows = _rows_by_key(convert_trajectories(q1 + q2, cfg, rollout_id=0))
    expected = grpo_advantages({"q1": [1.0, 0.0, 0.0, 0.0], "q2": [1.0, 1.0, 0.0, 1.0]})
    for group, trajs in (("q1", q1), ("q2", q2)):
        assert [rows[(t.trajectory_id, 0)].advantage for t in trajs] == expected[group]
    # every trajectory has its own id: per-trajectory grouping would have made every advantage 0
    assert all(r.advantage != 0.0 for r in rows.values())
    # another question's rewards do not move this group's advantages
    q1_other = make_group("q1", [1.0, 1.0, 1.0, 0.0])
    rows_again = _rows_by_key(convert_trajectories(q1_other + q2, cfg, rollout_id=0))
    assert [rows_again[(t.trajectory_id, 0)].advantage for t in q2] == expected["q2"]


def test_converter_reads_std_ddof_and_the_seed_recipe_uses_the_sample_std():
    group = make_group("q1", [1.0] + [0.0] * 7)
    rows = _rows_by_key(convert_trajectories(group, AlgorithmConfig(credit="share", std_ddof=1), rollout_id=0))
    expected = grpo_advantages({"q1": [1.0] + [0.0] * 7}, std_ddof=1)["q1"]
    assert [rows[(t.trajectory_id, 0)].advantage for t in group] == expected
    assert expected[0] == pytest.approx(2.4749, abs=1e-4)  # verl's figure, not ddof=0's 2.6457
    recipe = Path(__file__).resolve().parents[2] / "recipes" / "qwen3-0.6b-hotpotqa.yaml"
    assert load_config(recipe).algorithm.std_ddof == 1
    assert AlgorithmConfig().std_ddof == 0


def test_equal_rewards_give_zero_advantage_rows():
    rows = convert_trajectories(make_group("q1", [1.0, 1.0, 1.0]), AlgorithmConfig(), rollout_id=0)
    assert [r.advantage for r in rows] == [0.0] * 9


def test_failure_leaves_no_partial_output_and_the_input_untouched():
    good = make_group("q1", [1.0, 0.0]) + make_group("q2", [0.0, 1.0])
    bad = make_trajectory("q3/s0", "q3", reward=1.0)
    bad.turns[-1].rollout_log_probs.pop()
    trajs = [*good, bad]
    before = _snapshot(trajs)
    result = "not called"
    with pytest.raises(TrajectoryError) as info:
        result = convert_trajectories(trajs, SPLIT, rollout_id=1)
    assert result == "not called"  # nothing was returned
    assert (info.value.trajectory_id, info.value.turn, info.value.rule) == ("q3/s0", 2, "log_probs_length")
    assert len(trajs) == 5 and _snapshot(trajs) == before
    assert all(t.reward in (0.0, 1.0) for t in trajs)


@pytest.mark.parametrize("mutate, rule", [
    (lambda t: t.turns[1].rollout_log_probs.__setitem__(0, math.nan), "log_probs_finite"),
    (lambda t: t.turns[1].rollout_log_probs.__setitem__(0, math.inf), "log_probs_finite"),
    (lambda t: t.turns[1].rollout_log_probs.__setitem__(0, 0.5), "log_probs_nonpositive"),
    (lambda t: t.turns[1].loss_mask.__setitem__(0, 2), "loss_mask_binary"),
    (lambda t: setattr(t, "reward", True), "reward_finite"),
])
def test_bad_values_stop_the_converter_before_any_row(mutate, rule):
    # A NaN log-prob or a mask value of 2 used to convert into rows and train the actor on NaN.
    trajs = make_group("q1", [1.0, 0.0])
    mutate(trajs[1])
    with pytest.raises(TrajectoryError) as info:
        convert_trajectories(trajs, SPLIT, rollout_id=0)
    assert (info.value.trajectory_id, info.value.rule) == ("q1/s1", rule)


def test_failed_trajectories_are_rejected():
    group = make_group("q1", [1.0, 0.0, 0.0])
    group[2].status = "failed"
    with pytest.raises(TrajectoryError) as info:
        convert_trajectories(group, SPLIT, rollout_id=0)
    assert (info.value.trajectory_id, info.value.rule) == ("q1/s2", "status_trainable")
    trainable = [t for t in group if t.status != "failed"]
    assert len(convert_trajectories(trainable, SPLIT, rollout_id=0)) == 6  # one row per turn, failed left out


def test_unequal_turn_counts_within_a_group_are_rejected():
    group = make_group("q1", [1.0, 0.0])
    group.append(make_trajectory("q1/s2", "q1", num_memory_turns=5, reward=0.0, sample_index=2))
    with pytest.raises(TrajectoryError, match="group_turn_count"):
        convert_trajectories(group, SPLIT, rollout_id=0)


def test_a_sample_the_task_stopped_reading_may_take_fewer_turns():
    group = make_group("q1", [1.0, 0.0])
    group.append(make_trajectory("q1/s2", "q1", num_memory_turns=0, reward=0.0, sample_index=2))
    group[2].metadata["stopped_reading"] = True  # MemAgentTask.keep_reading said stop
    assert len(convert_trajectories(group, SPLIT, rollout_id=0)) == 7


def test_truncated_trajectories_are_trained_on_and_empty_input_gives_no_rows():
    group = make_group("q1", [1.0, 0.0])
    group[1].status = "truncated"
    assert len(convert_trajectories(group, SPLIT, rollout_id=0)) == 6
    assert convert_trajectories([], SPLIT, rollout_id=0) == []


group_spec_st = st.lists(
    st.tuples(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=6), st.integers(0, 5)),
    min_size=1, max_size=5,
)


def _build(spec):
    return [t for g, (rewards, memory_turns) in enumerate(spec) for t in make_group(f"q{g}", rewards, memory_turns)]


@settings(max_examples=60, deadline=None)
@given(spec=group_spec_st, credit=st.sampled_from(["split", "share"]), std_normalize=st.booleans())
def test_rows_equal_total_turns_and_credit_adds_up(spec, credit, std_normalize):
    trajs = _build(spec)
    cfg = AlgorithmConfig(credit=credit, std_normalize=std_normalize)
    rows = convert_trajectories(trajs, cfg, rollout_id=5)
    assert len(rows) == sum(t.num_turns for t in trajs)
    advantages = trajectory_advantages(trajs, std_normalize=std_normalize)
    for traj in trajs:
        own = [r.advantage for r in rows if r.trajectory_id == traj.trajectory_id]
        assert len(own) == traj.num_turns
        if credit == "split":
            assert math.fsum(own) == pytest.approx(advantages[traj.trajectory_id], abs=1e-12)
        else:
            assert own == [advantages[traj.trajectory_id]] * traj.num_turns
    validate_train_rows(rows)


@settings(max_examples=60, deadline=None)
@given(spec=group_spec_st, extra=st.integers(1, 6), std_normalize=st.booleans())
def test_adding_turns_to_a_group_does_not_change_its_advantages(spec, extra, std_normalize):
    # The group's baseline and spread come from trajectories, not rows: more turns change only how
    # each trajectory's advantage is divided among its rows.
    longer = [(rewards, memory_turns + extra if g == 0 else memory_turns)
              for g, (rewards, memory_turns) in enumerate(spec)]
    cfg = AlgorithmConfig(credit="split", std_normalize=std_normalize)
    short = _advantage_per_trajectory(convert_trajectories(_build(spec), cfg, rollout_id=0))
    long_ = _advantage_per_trajectory(convert_trajectories(_build(longer), cfg, rollout_id=0))
    assert short.keys() == long_.keys()
    for tid in short:
        assert long_[tid] == pytest.approx(short[tid], abs=1e-12)


def _advantage_per_trajectory(rows) -> dict[str, float]:
    """Sum of a trajectory's split row advantages, i.e. the trajectory's own advantage."""
    totals: dict[str, float] = {}
    for row in rows:
        totals[row.trajectory_id] = totals.get(row.trajectory_id, 0.0) + row.advantage
    return totals


def test_input_list_is_not_reordered():
    trajs = make_group("q2", [1.0, 0.0]) + make_group("q1", [0.0, 1.0])
    ids = [t.trajectory_id for t in trajs]
    snapshot = copy.deepcopy(_snapshot(trajs))
    convert_trajectories(trajs, SPLIT, rollout_id=0)
    assert [t.trajectory_id for t in trajs] == ids and _snapshot(trajs) == snapshot
