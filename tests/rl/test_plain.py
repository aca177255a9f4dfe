"""The plain 1:1 converter for single-turn tasks."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from memrl.config import AlgorithmConfig
from memrl.rl.advantages import grpo_advantages
from memrl.rl.validate import TrajectoryError
from memrl.task import convert_one_row_per_trajectory

sys.path.insert(0, str(Path(__file__).resolve().parent))
from traj_factory import make_group  # noqa: E402


@pytest.mark.parametrize("credit", ["split", "share"])
def test_one_row_per_trajectory_with_the_full_advantage(credit):
    trajs = make_group("q1", [1.0, 0.0, 0.0], num_memory_turns=0) + make_group("q2", [0.0, 1.0], num_memory_turns=0)
    rows = convert_one_row_per_trajectory(trajs, AlgorithmConfig(credit=credit), rollout_id=4)
    expected = grpo_advantages({"q1": [1.0, 0.0, 0.0], "q2": [0.0, 1.0]})
    assert [r.trajectory_id for r in rows] == ["q1/s0", "q1/s1", "q1/s2", "q2/s0", "q2/s1"]
    assert [r.advantage for r in rows] == expected["q1"] + expected["q2"]
    for row, traj in zip(rows, trajs, strict=True):
        turn = traj.turns[0]
        assert row.tokens[-row.response_length:] == turn.response_ids and row.loss_mask == turn.loss_mask
        assert (row.turn_index, row.rollout_id) == (0, 4)


def test_multi_turn_trajectories_are_rejected_before_any_row():
    trajs = make_group("q1", [1.0, 0.0], num_memory_turns=0) + make_group("q2", [1.0, 0.0], num_memory_turns=1)
    with pytest.raises(TrajectoryError) as info:
        convert_one_row_per_trajectory(trajs, AlgorithmConfig(), rollout_id=0)
    assert (info.value.trajectory_id, info.value.turn, info.value.rule) == ("q2/s0", None, "single_turn")


def test_plain_converter_validates_too():
    trajs = make_group("q1", [1.0, 0.0], num_memory_turns=0)
    trajs[1].turns[0].loss_mask = []
    with pytest.raises(TrajectoryError, match="loss_mask_length"):
        convert_one_row_per_trajectory(trajs, AlgorithmConfig(), rollout_id=0)
