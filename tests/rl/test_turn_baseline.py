"""Per-turn rewards when the policy decides how many turns to take (issue 36): the turn advantage's baseline keeps
the policy gradient unbiased, checked against the exact expectation over every outcome of a small policy.

The toy policy takes up to 3 turns. At turn j it draws an action from softmax(THETA[j]) over (more0, more1, stop):
`more0` / `more1` earn a turn reward of 0 / 1 and go on, `stop` earns 0.3 and ends the trajectory (turn 2 is the
last whatever it draws). The true gradient of J = E[sum of turn rewards] is sum_tau p(tau) R(tau) grad log p(tau);
the estimator is (1/n) sum_i sum_j A[i, j] grad log pi(a[i, j]), A from memrl.rl.shaping.turn_advantages (alpha 0:
the turn rewards alone, no std scale), and its expectation is summed over every group of n trajectories.
"""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest

from memrl.config import AlgorithmConfig
from memrl.rl.shaping import turn_advantages
from memrl.types import Trajectory, Turn

THETA = np.array([[0.2, -0.4, 0.1], [0.5, 0.0, -0.3], [-0.2, 0.3, 0.0]])
REWARD = {0: 0.0, 1: 1.0, 2: 0.3}  # more0, more1, stop
MORE, STOP, MAX_TURNS = (0, 1), 2, 3


def policy(j: int) -> np.ndarray:
    z = np.exp(THETA[j] - THETA[j].max())
    return z / z.sum()


def outcomes() -> list[tuple[int, ...]]:
    """Every trajectory (its actions): go on with more0 / more1, end on stop or at the last turn."""
    out = [(STOP,)]
    for first in MORE:
        out.append((first, STOP))
        out += [(first, second, last) for second in MORE for last in (*MORE, STOP)]
    return out


def probability(actions: tuple[int, ...]) -> float:
    return math.prod(policy(j)[a] for j, a in enumerate(actions))


def score(j: int, a: int) -> np.ndarray:
    """grad of log pi(a | turn j) with respect to THETA."""
    g = np.zeros_like(THETA)
    g[j] = -policy(j)
    g[j, a] += 1.0
    return g


def trajectory(k: int, actions: tuple[int, ...]) -> Trajectory:
    turns = [Turn(j, "final" if j == len(actions) - 1 else "step", [1], [2], [-0.5], [1], "stop", 4)
             for j in range(len(actions))]
    return Trajectory(f"g:s{k}", "g", k, turns, reward=0.0,
                      metadata={"turn_rewards": [REWARD[a] for a in actions]})


def true_gradient() -> np.ndarray:
    return sum(probability(t) * sum(REWARD[a] for a in t) * sum(score(j, a) for j, a in enumerate(t))
               for t in outcomes())


def expected_estimate(advantages, n: int) -> np.ndarray:
    """E[(1/n) sum_i sum_j A[i][j] grad log pi(a[i][j])] over every group of n trajectories."""
    total = np.zeros_like(THETA)
    for group in itertools.product(outcomes(), repeat=n):
        per_turn = advantages(group)
        estimate = sum(per_turn[i][j] * score(j, a) for i, t in enumerate(group) for j, a in enumerate(t))
        total += math.prod(map(probability, group)) * estimate / n
    return total


def memrl_advantages(group):
    trajs = [trajectory(k, t) for k, t in enumerate(group)]
    cfg = AlgorithmConfig(turn_reward_function="memrl.memagent.reward:memory_recall", turn_reward_alpha=0.0,
                          std_normalize=False)
    out = turn_advantages(trajs, {t.trajectory_id: 0.0 for t in trajs}, cfg)
    return [out[t.trajectory_id] for t in trajs]


def per_index_normalised_then_summed(group):
    """verl #7244's construction: each turn reward less the mean at its turn index, then summed over the
    sample's own remaining turns, whose number the sample's own actions chose."""
    width = max(map(len, group))
    mean = [np.mean([REWARD[t[j]] for t in group if len(t) > j]) for j in range(width)]
    return [[sum(REWARD[t[m]] - mean[m] for m in range(j, len(t))) for j in range(len(t))] for t in group]


def per_index_immediate(group):
    """memrl's estimator before issue 36 (turn j's own reward less the mean at index j; equal turn counts were
    required): it leaves out the rewards of the turns that turn j chose to take."""
    width = max(map(len, group))
    mean = [np.mean([REWARD[t[j]] for t in group if len(t) > j]) for j in range(width)]
    return [[REWARD[t[j]] - mean[j] for j in range(len(t))] for t in group]


def test_the_outcomes_are_every_trajectory_of_the_toy_policy():
    assert len(outcomes()) == 15 and sum(map(probability, outcomes())) == pytest.approx(1.0, abs=1e-15)
    assert {len(t) for t in outcomes()} == {1, 2, 3}  # the policy chooses its turn count


@pytest.mark.parametrize("n", [2, 3])
def test_the_turn_reward_baseline_is_unbiased_whatever_turn_counts_the_policy_takes(n):
    truth = true_gradient()
    # Sums of ~15^n products of numbers below 10: float64 rounding is far below 1e-12.
    np.testing.assert_allclose(expected_estimate(memrl_advantages, n), truth, rtol=0, atol=1e-12)
    # The test tells them apart: both per-index constructions are biased here (by about 0.18, the true
    # gradient's largest entry being 0.21).
    assert np.abs(expected_estimate(per_index_normalised_then_summed, n) - truth).max() > 1e-2
    assert np.abs(expected_estimate(per_index_immediate, n) - truth).max() > 1e-2


def test_samples_that_agree_get_no_turn_signal_and_a_group_of_one_none():
    same = memrl_advantages([(0, 1, STOP)] * 3)
    assert same == [[0.0, 0.0, 0.0]] * 3
    assert memrl_advantages([(1, STOP)]) == [[0.0, 0.0]]
