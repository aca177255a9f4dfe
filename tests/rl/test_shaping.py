"""Truncated answers, DAPO's overlong penalty and per-turn rewards in the converter, on hand-computed numbers."""

from __future__ import annotations

import pytest
from traj_factory import make_group, make_trajectory, make_turn

from memrl.config import AlgorithmConfig, ConfigError
from memrl.memagent.reward import gold_in_text, memory_recall
from memrl.memagent.task import MemAgentTask, convert_trajectories
from memrl.rl.advantages import AdvantageError
from memrl.rl.shaping import overlong_penalty
from memrl.rl.turn_rewards import score_turns


def by_key(rows):
    return {(r.trajectory_id, r.turn_index): r for r in rows}


def test_mask_truncated_completions_zeroes_only_the_truncated_trajectory():
    group = make_group("g", [1.0, 0.0, 0.0])
    group[1].turns[-1].finish_reason, group[1].status = "length", "truncated"
    off = by_key(convert_trajectories(group, AlgorithmConfig(std_normalize=False), 0))
    on = convert_trajectories(group, AlgorithmConfig(std_normalize=False, mask_truncated_completions=True), 0)
    assert len(on) == sum(t.num_turns for t in group)
    for row in on:
        before = off[(row.trajectory_id, row.turn_index)]
        assert row.advantage == before.advantage  # it still counts in the group's advantage
        assert row.loss_mask == ([0] * row.response_length if row.trajectory_id == "g/s1" else before.loss_mask)


def test_overlong_penalty_by_hand():
    # limit 8, buffer 4: no penalty up to 4 tokens, then -1/4 per token, -1 at the limit (factor 1)
    assert [overlong_penalty(n, 8, 4, 1.0) for n in (3, 4, 6, 8)] == [0.0, 0.0, -0.5, -1.0]
    assert overlong_penalty(8, 8, 4, 0.5) == -0.5
    short = make_trajectory("g/s0", "g", 1, reward=1.0, sample_index=0, response_len=3)
    long = make_trajectory("g/s1", "g", 1, reward=1.0, sample_index=1, response_len=6)  # final turn: 6 of 8 tokens
    cfg = AlgorithmConfig(std_normalize=False, credit="share", overlong_buffer_len=4)
    rows = by_key(convert_trajectories([short, long], cfg, 0))
    # shaped rewards 1.0 and 0.5: advantages +0.25 / -0.25, where the raw rewards (equal) give 0
    assert rows[("g/s0", 0)].advantage == pytest.approx(0.25)
    assert rows[("g/s1", 1)].advantage == pytest.approx(-0.25)
    assert long.reward == 1.0  # the raw reward is untouched (dynamic sampling and logs read it)
    plain = by_key(convert_trajectories([short, long], AlgorithmConfig(std_normalize=False, credit="share"), 0))
    assert plain[("g/s0", 0)].advantage == 0.0


def test_an_overlong_buffer_longer_than_the_final_turns_limit_is_refused_not_clamped():
    # A task whose final turn has another limit than task.final_tokens (which the config checks): B = 100
    # with a 64-token limit was clamped to 64, so a 32-token answer's reward became 1 - 32/64 = 0.5.
    group = make_group("g", [1.0, 1.0], num_memory_turns=0)
    for traj in group:
        traj.turns[-1] = make_turn(0, "final", response_len=32, max_tokens=64)
    with pytest.raises(ConfigError, match=r"overlong_buffer_len = 100 .*final turn's limit 64"):
        convert_trajectories(group, AlgorithmConfig(overlong_buffer_len=100), 0)
    rows = convert_trajectories(group, AlgorithmConfig(overlong_buffer_len=64), 0)  # B = L: allowed
    assert len(rows) == 2


def test_turn_rewards_reach_every_turn_by_hand():
    group = make_group("g", [1.0, 0.0], num_memory_turns=1)  # a memory turn and the final turn each
    group[0].metadata["turn_rewards"], group[1].metadata["turn_rewards"] = [0.0, 1.0], [1.0, 1.0]
    cfg = AlgorithmConfig(std_normalize=False, credit="split",
                          turn_reward_function="memrl.memagent.reward:memory_recall",
                          turn_reward_alpha=0.5)
    rows = by_key(convert_trajectories(group, cfg, 0))
    # A = +-0.5, split over 2 turns: +-0.25. Turn rewards to go: s0 (1, 1), s1 (2, 1); less the other
    # sample's at the same turn: s0 (1 - 2, 1 - 1) = (-1, 0), s1 (2 - 1, 0) = (1, 0).
    assert rows[("g/s0", 0)].advantage == pytest.approx(0.5 * 0.25 + 0.5 * -1)
    assert rows[("g/s0", 1)].advantage == pytest.approx(0.5 * 0.25)
    assert rows[("g/s1", 0)].advantage == pytest.approx(0.5 * -0.25 + 0.5 * 1)
    assert rows[("g/s1", 1)].advantage == pytest.approx(0.5 * -0.25)
    del group[1].metadata["turn_rewards"]
    with pytest.raises(AdvantageError, match="turn_rewards"):
        convert_trajectories(group, cfg, 0)


class WordTokenizer:
    def __init__(self, words):
        self.words = words

    def decode(self, ids, skip_special_tokens=True):
        return " ".join(self.words.get(i, "x") for i in ids)


def test_memory_recall_and_the_gold_recall_curve():
    assert gold_in_text("The capital is Paris.", ["paris"]) and not gold_in_text("Parisian food", ["Paris"])
    assert not gold_in_text("anything", [""])
    group = make_group("g", [1.0, 0.0], num_memory_turns=2)
    words = {}
    for traj, hit in zip(group, ([True, False], [True, True]), strict=True):
        traj.metadata["golds"] = ["Paris"]
        for turn, h in zip(traj.turns, hit + [False], strict=True):
            words[turn.response_ids[0]] = "Paris" if h else "Rome"
    cfg = AlgorithmConfig(turn_reward_function="memrl.memagent.reward:memory_recall")
    metrics = score_turns(group, WordTokenizer(words), cfg, MemAgentTask())
    assert metrics == {"memory/gold_recall/turn_0": 1.0, "memory/gold_recall/turn_1": 0.5,
                       "memory/gold_recall/mean": 0.75}
    assert group[0].metadata["turn_rewards"] == [1.0, 0.0, 0.0]
    assert memory_recall(group[1].turns[1], group[1], ["paris"]) == 1.0
    # logged also when no turn reward is configured
    plain = make_group("h", [1.0, 0.0], num_memory_turns=2)
    for traj in plain:
        traj.metadata["golds"] = ["Paris"]
    assert "memory/gold_recall/turn_0" in score_turns(plain, WordTokenizer({}), AlgorithmConfig(), MemAgentTask())
    assert "turn_rewards" not in plain[0].metadata
