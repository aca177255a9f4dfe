"""GRPO advantages, credit assignment and grouping of memrl.rl.advantages."""

from __future__ import annotations

import math
import random
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from memrl.rl.advantages import (
    AdvantageError,
    assign_credit,
    expand_rows,
    grpo_advantages,
    trajectory_advantages,
)
from memrl.rl.validate import TrajectoryError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from traj_factory import make_group, make_trajectory  # noqa: E402

EPS = 1e-6
rewards_st = st.lists(st.floats(-10, 10, allow_nan=False), min_size=1, max_size=12)


def test_std_normalized_values_by_hand():
    # mean 0.25, population std sqrt(3)/4 = 0.4330127...
    got = grpo_advantages({"q": [1.0, 0.0, 0.0, 0.0]}, std_normalize=True, eps=EPS)["q"]
    std = math.sqrt(3) / 4
    assert got == pytest.approx([0.75 / (std + EPS)] + [-0.25 / (std + EPS)] * 3, rel=1e-12)
    assert got == pytest.approx([1.7320508, -0.5773503, -0.5773503, -0.5773503], abs=1e-5)


def test_sample_std_matches_verl_on_one_right_of_eight():
    # verl's compute_grpo_outcome_advantage: (r - mean) / (torch.std(r) + eps), torch.std unbiased (ddof=1).
    rewards = [1.0] + [0.0] * 7
    sample = grpo_advantages({"q": rewards}, eps=EPS, std_ddof=1)["q"]
    population = grpo_advantages({"q": rewards}, eps=EPS, std_ddof=0)["q"]
    assert sample[0] == pytest.approx(2.4749, abs=1e-4) and sample[1] == pytest.approx(-0.3536, abs=1e-4)
    assert population[0] == pytest.approx(2.6457, abs=1e-4) and population[1] == pytest.approx(-0.3780, abs=1e-4)
    t = torch.tensor(rewards, dtype=torch.float64)
    assert sample == pytest.approx(((t - t.mean()) / (t.std() + EPS)).tolist(), rel=1e-12)
    # The ratio is sqrt((n-1)/n) up to eps.
    assert sample[0] / population[0] == pytest.approx(math.sqrt(7 / 8), rel=1e-5)


def test_std_ddof_must_be_zero_or_one():
    with pytest.raises(AdvantageError, match="std_ddof"):
        grpo_advantages({"q": [1.0, 0.0]}, std_ddof=2)


def test_mean_centred_only_when_std_normalize_is_off():
    got = grpo_advantages({"q": [1.0, 0.0, 0.0, 0.0]}, std_normalize=False)["q"]
    assert got == pytest.approx([0.75, -0.25, -0.25, -0.25], abs=1e-15)
    got = grpo_advantages({"q": [3.0, 1.0]}, std_normalize=False)["q"]
    assert got == [1.0, -1.0]


def test_population_std_is_used():
    # ddof=0: a group of two gets +-1; the sample std (ddof=1) would give +-0.707.
    got = grpo_advantages({"q": [1.0, 0.0]}, eps=EPS)["q"]
    assert got == pytest.approx([1.0, -1.0], rel=1e-5)


@pytest.mark.parametrize("std_normalize", [True, False])
@pytest.mark.parametrize("rewards", [[0.1, 0.1, 0.1], [1.0] * 8, [0.0] * 8, [0.7]])
def test_equal_rewards_and_single_samples_give_exact_zeros(rewards, std_normalize):
    # [0.1]*3 has mean 0.1 + 1 ulp: without the explicit rule its advantages would be -1.4e-17.
    got = grpo_advantages({"q": rewards}, std_normalize=std_normalize)["q"]
    assert got == [0.0] * len(rewards)
    assert all(type(a) is float for a in got)


def test_empty_group_gives_empty_list():
    assert grpo_advantages({"q": []}) == {"q": []}


def test_groups_are_normalized_separately():
    together = grpo_advantages({"a": [1.0, 0.0], "b": [1.0, 1.0, 1.0, 0.0]})
    assert together["a"] == grpo_advantages({"a": [1.0, 0.0]})["a"]
    assert together["b"] == grpo_advantages({"b": [1.0, 1.0, 1.0, 0.0]})["b"]
    # pooled statistics would give group "a" a different value
    pooled = grpo_advantages({"all": [1.0, 0.0, 1.0, 1.0, 1.0, 0.0]})["all"]
    assert together["a"][0] != pytest.approx(pooled[0])


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_rewards_are_named(bad):
    with pytest.raises(AdvantageError, match="group 'q9'"):
        grpo_advantages({"q1": [1.0, 0.0], "q9": [1.0, bad]})


def test_eps_must_be_positive():
    with pytest.raises(AdvantageError, match="eps"):
        grpo_advantages({"q": [1.0, 0.0]}, eps=0.0)


@settings(max_examples=200, deadline=None)
@given(rewards=rewards_st)
def test_normalized_group_has_zero_mean_and_unit_population_std(rewards):
    assume(max(rewards) - min(rewards) > 1e-3)
    got = np.array(grpo_advantages({"q": rewards}, eps=EPS)["q"])
    assert abs(got.mean()) < 1e-9
    assert got.std(ddof=0) == pytest.approx(1.0, rel=1e-2)


@settings(max_examples=200, deadline=None)
@given(rewards=rewards_st)
def test_centred_group_sums_to_zero_and_keeps_differences(rewards):
    got = grpo_advantages({"q": rewards}, std_normalize=False)["q"]
    assert sum(got) == pytest.approx(0.0, abs=1e-9)
    assert got[0] - got[-1] == pytest.approx(rewards[0] - rewards[-1], abs=1e-9)


def test_assign_credit_by_hand():
    assert assign_credit(0.9, 3, "split") == pytest.approx([0.3, 0.3, 0.3])
    assert assign_credit(0.9, 3, "share") == [0.9, 0.9, 0.9]
    assert assign_credit(-2.0, 1, "split") == [-2.0]


@settings(max_examples=200, deadline=None)
@given(advantage=st.floats(-100, 100), num_turns=st.integers(1, 65))
def test_split_credit_sums_to_the_trajectory_advantage(advantage, num_turns):
    split = assign_credit(advantage, num_turns, "split")
    assert len(split) == num_turns
    assert math.fsum(split) == pytest.approx(advantage, rel=1e-12, abs=1e-12)
    assert assign_credit(advantage, num_turns, "share") == [advantage] * num_turns


@pytest.mark.parametrize("num_turns, mode, match", [(0, "split", "num_turns"), (-1, "share", "num_turns"),
                                                     (2, "mean", "unknown")])
def test_assign_credit_rejects_bad_arguments(num_turns, mode, match):
    with pytest.raises(AdvantageError, match=match):
        assign_credit(1.0, num_turns, mode)


def test_trajectory_advantages_group_by_group_id_not_trajectory_id():
    # Keyed by trajectory_id every group would have size 1 and every advantage would be 0 (rLLM #776).
    trajs = make_group("q1", [1.0, 0.0, 0.0, 1.0]) + make_group("q2", [1.0, 0.0, 0.0, 0.0])
    got = trajectory_advantages(trajs, std_normalize=True, eps=EPS)
    expected = grpo_advantages({"q1": [1.0, 0.0, 0.0, 1.0], "q2": [1.0, 0.0, 0.0, 0.0]}, eps=EPS)
    assert [got[f"q1/s{i}"] for i in range(4)] == expected["q1"]
    assert [got[f"q2/s{i}"] for i in range(4)] == expected["q2"]
    assert all(a != 0.0 for a in got.values())


def test_trajectory_advantages_do_not_depend_on_input_order():
    trajs = make_group("q1", [1.0, 0.0, 0.5]) + make_group("q2", [0.0, 1.0])
    shuffled = trajs[:]
    random.Random(0).shuffle(shuffled)
    assert trajectory_advantages(shuffled) == pytest.approx(trajectory_advantages(trajs), abs=1e-15)


@settings(max_examples=100, deadline=None)
@given(data=st.data())
def test_turn_counts_do_not_change_advantages(data):
    # Each trajectory counts once, whatever its number of turns (no weighting by rows, agent-lightning #444).
    rewards = data.draw(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=8))
    turns = data.draw(st.lists(st.integers(0, 6), min_size=len(rewards), max_size=len(rewards)))
    one_turn = [make_trajectory(f"q/s{i}", "q", 0, reward=r, sample_index=i) for i, r in enumerate(rewards)]
    many_turns = [make_trajectory(f"q/s{i}", "q", n, reward=r, sample_index=i)
                  for i, (r, n) in enumerate(zip(rewards, turns, strict=True))]
    for std_normalize in (True, False):
        assert trajectory_advantages(many_turns, std_normalize) == trajectory_advantages(one_turn, std_normalize)


def test_trajectory_advantages_need_rewards_and_unique_ids():
    missing = make_group("q", [1.0, 0.0])
    missing[1].reward = None
    with pytest.raises(TrajectoryError) as info:
        trajectory_advantages(missing)
    assert (info.value.trajectory_id, info.value.rule) == ("q/s1", "reward_present")
    dup = make_group("q", [1.0, 0.0])
    dup[1].trajectory_id = "q/s0"
    with pytest.raises(TrajectoryError) as info:
        trajectory_advantages(dup)
    assert info.value.rule == "trajectory_id_unique"


def test_expand_rows_needs_an_advantage_for_every_trajectory():
    trajs = make_group("q", [1.0, 0.0])
    with pytest.raises(AdvantageError, match="q/s1"):
        expand_rows(trajs, {"q/s0": 0.5}, "split", rollout_id=0)
    with pytest.raises(AdvantageError, match="nan"):
        expand_rows(trajs, {"q/s0": 0.5, "q/s1": math.nan}, "split", rollout_id=0)
