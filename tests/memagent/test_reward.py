"""Trajectory reward and scores: final answer only, via the shared scorer; unfinished answers score 0."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from memrl.config import Config
from memrl.scoring import reward_from_text
from memrl.task import load_task, score_trajectory, trajectory_reward

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
from traj_factory import make_trajectory  # noqa: E402


def _traj(answer: str, status: str = "complete", memory_turns: int = 2):
    return make_trajectory("q/s0", "q", memory_turns, reward=None, status=status, answer=answer)


def test_is_the_default_tasks_reward(monkeypatch):
    calls = []
    monkeypatch.setattr("memrl.task.trajectory_reward", lambda traj, golds: calls.append(golds) or 1.0)
    assert load_task(Config()).reward(_traj("x"), ["g"]) == 1.0 and calls == [["g"]]


@pytest.mark.parametrize("answer, golds, expected", [
    ("The answer is \\boxed{Paris}.", ["Paris"], 1.0),
    ("\\boxed{The Beatles.}", ["the beatles"], 1.0),  # HotpotQA normalization, not a math normalizer
    ("\\boxed{London}", ["Paris"], 0.0),
    ("Paris", ["Paris"], 0.0),  # no box, no answer
    ("\\boxed{Paris} then \\boxed{Rome}", ["Paris"], 0.0),  # the last box counts
    ("\\boxed{Rome}", ["Paris", "Rome"], 1.0),  # any gold
])
def test_complete_trajectory_scores_its_boxed_answer(answer, golds, expected):
    assert trajectory_reward(_traj(answer), golds) == expected
    assert score_trajectory(_traj(answer), golds).em == expected


@pytest.mark.parametrize("status", ["failed", "truncated"])
def test_unfinished_answers_score_zero(status):
    traj = _traj("\\boxed{Paris}", status=status)
    assert trajectory_reward(traj, ["Paris"]) == 0.0
    score = score_trajectory(traj, ["Paris"])
    assert (score.em, score.sub_em, score.f1) == (0.0, 0.0, 0.0)


def test_failed_is_a_missing_answer_and_truncated_keeps_what_it_boxed():
    failed = score_trajectory(_traj("\\boxed{Paris}", status="failed"), ["Paris"])
    assert failed.missing_box and failed.boxed is None
    truncated = score_trajectory(_traj("\\boxed{Paris} and then", status="truncated"), ["Paris"])
    assert not truncated.missing_box and truncated.boxed == "Paris"


def test_score_reports_sub_em_and_f1():
    score = score_trajectory(_traj("\\boxed{Paris France}"), ["Paris"])
    assert (score.em, score.sub_em, score.missing_box) == (0.0, 1.0, False)
    assert score.f1 == pytest.approx(2 / 3)


def test_memory_turns_do_not_change_the_reward():
    for memory_turns in (0, 1, 5):
        assert trajectory_reward(_traj("\\boxed{Paris}", memory_turns=memory_turns), ["Paris"]) == 1.0


@settings(max_examples=200, deadline=None)
@given(answer=st.text(max_size=60) | st.builds(lambda s: f"x \\boxed{{{s}}}", st.text(max_size=20)),
       gold=st.text(max_size=20), status=st.sampled_from(["complete", "truncated", "failed"]))
def test_reward_equals_em_and_matches_the_shared_scorer(answer, gold, status):
    traj = _traj(answer, status=status)
    reward = trajectory_reward(traj, [gold])
    assert reward == score_trajectory(traj, [gold]).em
    assert reward == (reward_from_text(answer, [gold]) if status == "complete" else 0.0)


def test_real_hotpotqa_answers_score_one_when_boxed(hotpot_dev_records):
    for record in hotpot_dev_records[:50]:
        gold = record["answer"]
        assert trajectory_reward(_traj(f"So the answer is \\boxed{{{gold}}}"), [gold]) == 1.0
        assert trajectory_reward(_traj(f"So the answer is {gold}"), [gold]) == 0.0


# --- The answer extractor (task.answer_extractor) -------------------------------------------------
def test_the_extractor_recorded_by_the_rollout_is_used():
    traj = _traj("Therefore, the answer is Paris.")
    assert trajectory_reward(traj, ["Paris"]) == 0.0  # no metadata: boxed, as before
    traj.metadata["answer_extractor"] = "therefore"
    assert trajectory_reward(traj, ["Paris"]) == 1.0
    assert score_trajectory(traj, ["Paris"]).boxed == "Paris"
    assert trajectory_reward(traj, ["Paris"], extractor="boxed") == 0.0  # an explicit choice wins
    assert score_trajectory(traj, ["Paris"], extractor="boxed").missing_box


def test_golds_as_a_numpy_array():
    np = pytest.importorskip("numpy")
    assert trajectory_reward(_traj("\\boxed{Paris}"), np.array(["Paris"])) == 1.0
    assert score_trajectory(_traj("\\boxed{Paris}"), np.array(["Paris"])).f1 == 1.0


@pytest.mark.parametrize("extractor, final, expected", [
    ("therefore", "Therefore, the answer is alpha3.", 1.0),
    ("therefore", "\\boxed{alpha3}", 0.0),
    ("boxed", "\\boxed{alpha3}", 1.0),
    ("boxed", "Therefore, the answer is alpha3.", 0.0),
])
def test_rollout_reward_reads_the_configured_extractor(tiny_tokenizer, extractor, final, expected):
    import asyncio
    from types import SimpleNamespace

    from scripted_engine import ScriptedEngine

    from memrl.memagent.rollout import generate_group
    from memrl.rollout import GroupSlot, RolloutContext

    cfg = Config.model_validate({"task": {"chunk_tokens": 16, "memory_tokens": 8, "final_tokens": 32, "max_chunks": 2,
                                          "answer_extractor": extractor},
                                 "sampling": {"n_samples": 2}})
    engine = ScriptedEngine(tiny_tokenizer, lambda prompt: final if "\\boxed{}" in prompt else "fact3 alpha3")
    ctx = RolloutContext(engine=engine, tokenizer=tiny_tokenizer, config=cfg, reward_function=trajectory_reward,
                         progress=False)
    record = SimpleNamespace(id="q", question="What is fact3?", answers=["alpha3"], context="fact3 is alpha3.")
    group = asyncio.run(generate_group(ctx, GroupSlot(0, record, f"0:{record.id}"), cfg.sampling.n_samples))
    assert [t.status for t in group] == ["complete"] * 2
    assert [t.reward for t in group] == [expected] * 2
    assert all(t.metadata["answer_extractor"] == extractor for t in group)


def test_answer_after_think_is_recorded_by_the_rollout_and_read_by_the_scorer(tiny_tokenizer):
    """task.answer_after_think (the official evaluation's rule for thinking models): the rollout records it,
    so the reward, `memrl eval`'s scores and pass@k read the answer after its last </think>."""
    import asyncio
    from types import SimpleNamespace

    from scripted_engine import ScriptedEngine

    from memrl.memagent.rollout import generate_group
    from memrl.rollout import GroupSlot, RolloutContext

    for on in (True, False):
        cfg = Config.model_validate({"task": {"chunk_tokens": 16, "memory_tokens": 8, "final_tokens": 32,
                                              "max_chunks": 1, "answer_after_think": on}, "sampling": {"n_samples": 1}})
        engine = ScriptedEngine(tiny_tokenizer, lambda prompt: "fact3 alpha3")
        ctx = RolloutContext(engine=engine, tokenizer=tiny_tokenizer, config=cfg, reward_function=trajectory_reward,
                             progress=False)
        record = SimpleNamespace(id="q", question="What is fact3?", answers=["alpha3"], context="fact3 is alpha3.")
        (traj,) = asyncio.run(generate_group(ctx, GroupSlot(0, record, "0:q"), 1))
        assert traj.metadata["answer_after_think"] is on
    traj = _traj("<think>\\boxed{Paris}</think>\nI am not sure.")
    assert trajectory_reward(traj, ["Paris"]) == 1.0  # not recorded: the whole answer, as before
    traj.metadata["answer_after_think"] = True
    assert trajectory_reward(traj, ["Paris"]) == 0.0 and score_trajectory(traj, ["Paris"]).missing_box
