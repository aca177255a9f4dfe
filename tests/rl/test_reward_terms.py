"""Reward terms (issue 36): named reward functions with weights, None as "not applicable", TRL's two
`multi_objective_aggregation` modes on hand-computed numbers, each term logged, bad values refused."""

from __future__ import annotations

import json
import math

import pytest

from memrl.config import AlgorithmConfig, Config, ConfigError, load_config, task_instance
from memrl.data.records import QuestionRecord
from memrl.rl.advantages import AdvantageError
from memrl.rl.shaping import advantage_rows
from memrl.rollout import RewardError, RewardTerms, RolloutContext, finish_rollout
from memrl.task import task_reward
from memrl.tasks.single_turn import SingleTurnTask
from memrl.types import Trajectory, Turn

# Three samples of one group; term `a` applies to all, `b` to the first two (None: not applicable).
A = [1.0, 0.0, 1.0]
B = [0.0, 1.0, None]
WEIGHTS = {"a": 1.0, "b": 2.0}
EPS = 1e-6  # AlgorithmConfig's default


def sample(k: int) -> Trajectory:
    return Trajectory(f"g:s{k}", "g", k, [Turn(0, "final", [1, 2], [3], [-0.5], [1], "stop", 4)])


def scored_group(weights=WEIGHTS) -> list[Trajectory]:
    """The group scored through `ctx.reward`, the checked path every task's sampling takes."""
    terms = RewardTerms({"a": lambda t, golds: A[t.sample_index], "b": lambda t, golds: B[t.sample_index]}, weights)
    ctx = RolloutContext(engine=None, tokenizer=None, config=Config(), reward_function=terms)
    group = [sample(k) for k in range(3)]
    for t in group:
        t.reward = ctx.reward(t, ["x"])
    return group


def advantages(group, **algorithm) -> list[float]:
    rows = advantage_rows(group, AlgorithmConfig(credit="share", **algorithm), 0, "share")
    return [r.trajectory_advantage for r in rows]


def test_the_reward_is_the_weighted_sum_of_the_terms_that_apply_each_recorded():
    group = scored_group()
    # 1 x a + 2 x b, a None counted 0 (TRL's nansum)
    assert [t.reward for t in group] == [1.0, 2.0, 1.0]
    assert [t.metadata["reward_terms"] for t in group] == [{"a": 1.0, "b": 0.0}, {"a": 0.0, "b": 1.0},
                                                           {"a": 1.0, "b": None}]
    assert group[2].metadata["reward_weights"] == WEIGHTS


def test_sum_then_normalize_is_grpo_of_the_weighted_sum_by_hand():
    # sums 1, 2, 1: mean 4/3, deviations -1/3, 2/3, -1/3, population std sqrt(2/9)
    std = math.sqrt(2 / 9)
    expected = [-1 / 3 / (std + EPS), 2 / 3 / (std + EPS), -1 / 3 / (std + EPS)]
    assert advantages(scored_group()) == pytest.approx(expected, rel=1e-12)


def test_normalize_then_sum_normalises_each_term_over_the_samples_it_applies_to_by_hand():
    group = scored_group()
    # a: 1, 0, 1 -> mean 2/3, std sqrt(2/9): (1/3, -2/3, 1/3) / (std + eps)
    # b: 0, 1 on samples 0 and 1 only -> mean 1/2, std 1/2: (-1/2, 1/2) / (1/2 + eps); sample 2 gets 0
    std_a, zb = math.sqrt(2 / 9), 0.5 / (0.5 + EPS)
    expected = [1 / 3 / (std_a + EPS) - 2 * zb, -2 / 3 / (std_a + EPS) + 2 * zb, 1 / 3 / (std_a + EPS)]
    got = advantages(group, multi_objective_aggregation="normalize_then_sum")
    assert got == pytest.approx(expected, rel=1e-12)
    assert got != pytest.approx(advantages(group), rel=1e-3)  # the two modes differ here
    assert [t.reward for t in group] == [1.0, 2.0, 1.0]  # logs and filter_groups still read the weighted sum
    # a trajectory that recorded its terms but not their weights (a replay, a task of its own) is one named error
    del group[1].metadata["reward_weights"]
    with pytest.raises(AdvantageError, match="has no reward_terms / reward_weights"):
        advantages(group, multi_objective_aggregation="normalize_then_sum")
    group = scored_group()
    # without std_normalize each term is only centred: 1 x (a - 2/3) + 2 x (b - 1/2)
    assert advantages(group, multi_objective_aggregation="normalize_then_sum", std_normalize=False) == \
        pytest.approx([1 / 3 - 1, -2 / 3 + 1, 1 / 3], rel=1e-12)


def test_each_term_is_logged_as_its_mean_where_it_applied():
    metrics = finish_rollout([scored_group()]).metrics
    assert metrics["reward/mean"] == pytest.approx(4 / 3)
    assert metrics["reward/a"] == pytest.approx(2 / 3) and metrics["reward/b"] == 0.5  # b over its 2 samples


@pytest.mark.parametrize(("value", "words"), [
    ("1.0", r"reward function .*<lambda> \(term b\) returned '1.0' \(str\) for trajectory g:s0; a reward must be"),
    (True, r"\(term b\) returned True \(bool\)"),
    (float("nan"), r"\(term b\) returned nan \(float\)")])
def test_a_term_returning_no_finite_real_number_or_none_is_one_named_error(value, words):
    terms = RewardTerms({"a": lambda t, golds: 1.0, "b": lambda t, golds: value}, WEIGHTS)
    ctx = RolloutContext(engine=None, tokenizer=None, config=Config(), reward_function=terms)
    with pytest.raises(RewardError, match=words):
        ctx.reward(sample(0), ["x"])


@pytest.mark.parametrize(("function", "names"), [(RewardTerms({"a": lambda t, golds: None, "b": lambda t, golds: None},
                                                               WEIGHTS), "a, b"),
                                                   (lambda t, golds: None, "outcome")])  # one plain function
def test_a_trajectory_no_term_applies_to_is_an_error_not_a_zero(function, names):
    # TRL zeroes such a sample's advantage; memrl's reward is always a finite real number, so it says so instead.
    ctx = RolloutContext(engine=None, tokenizer=None, config=Config(), reward_function=function)
    with pytest.raises(RewardError, match=rf"every reward term \({names}\) returned None \(not applicable\) for "
                                          r"trajectory g:s0; at least one must score it"):
        ctx.reward(sample(0), ["x"])


# ------------------------------------------------------------------------------------------ a task's terms

def has_box(traj, golds):
    return float("\\boxed{" in traj.answer)


def is_long(traj, golds):
    return None if not traj.answer else float(len(traj.answer) > 3)


class TwoTermTask(SingleTurnTask):
    reward_weights = {"fmt": 0.25}

    def reward_terms(self, cfg):
        return {**super().reward_terms(cfg), "fmt": has_box}


TASK = f"plugins.task={__name__}:TwoTermTask"


def test_the_tasks_terms_with_its_default_weights_config_overrides_and_the_outcome_replaced():
    task = task_instance(f"{__name__}:TwoTermTask")
    terms = task_reward(load_config(None, [TASK]), task)
    assert terms.functions == {"outcome": task.reward, "fmt": has_box} and terms.weights == {"outcome": 1.0,
                                                                                             "fmt": 0.25}
    cfg = load_config(None, [TASK, "algorithm.reward_weights={fmt: 2, outcome: 0.5}",
                             f"plugins.reward_function={__name__}:is_long"])
    terms = task_reward(cfg, task)
    assert terms.functions == {"outcome": is_long, "fmt": has_box} and terms.weights == {"outcome": 0.5, "fmt": 2.0}
    plain = task_reward(load_config(None, []), task_instance("memrl.memagent.task:MemAgentTask"))
    assert list(plain.functions) == ["outcome"] and plain.weights == {"outcome": 1.0}  # one term, as before


@pytest.mark.parametrize(("overrides", "words"), [
    (["algorithm.reward_weights.fmtt=1"], r"unknown key 'algorithm.reward_weights.fmtt' \(did you mean "
                                          r"'algorithm.reward_weights.fmt'\?\); the run's reward terms: outcome, fmt"),
    (["algorithm.reward_weights.fmt=true"], r"algorithm.reward_weights: .*fmt: True is a bool where a number belongs"),
    (["algorithm.reward_weights.fmt=.nan"], r"algorithm.reward_weights.fmt = nan: .*finite"),
    (["algorithm.multi_objective_aggregation=sum"], r"algorithm.multi_objective_aggregation = 'sum': .*"
                                                    r"'sum_then_normalize' or 'normalize_then_sum'"),
    (["algorithm.multi_objective_aggregation=normalize_then_sum", "algorithm.overlong_buffer_len=4"],
     r"overlong_buffer_len shapes the summed reward"),
    (["algorithm.multi_objective_aggregation=normalize_then_sum", "algorithm.filter_groups=true"],
     r"filter_groups drops groups whose summed rewards are equal")])
def test_bad_reward_settings_are_refused_at_load_in_one_line(overrides, words):
    with pytest.raises(ConfigError, match=words):
        load_config(None, [TASK, *overrides])


def test_terms_train_through_the_loop_each_logged(tmp_path):
    from memrl.tiny import build_tiny_model, build_tiny_tokenizer
    from memrl.train.controller import Trainer, TrainOptions

    tok = build_tiny_tokenizer()
    cfg = load_config(None, [TASK, "task.final_tokens=4", "sampling.n_samples=4", "train.num_rollout=2",
                             "train.rollout_batch_size=2", "train.save_interval=10",
                             "algorithm.multi_objective_aggregation=normalize_then_sum",
                             f"plugins.reward_function={__name__}:is_long"])
    records = [QuestionRecord(f"q{k}", "Which city?", ["Paris"], f"Text {k}: Paris.") for k in range(2)]
    model = build_tiny_model(len(tok), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64,
                             eos_token_id=tok.eos_token_id)
    history = Trainer(cfg, TrainOptions(run_root=tmp_path, progress=False), model=model, tokenizer=tok,
                      records=records).run()
    assert all({"reward/mean", "reward/fmt"} <= set(m) for m in history)
    log = [json.loads(line) for line in (tmp_path / "logs" / "rollouts" / "rollout_0000001.jsonl").open()]
    assert len(log) == 8 and all(set(r["reward_terms"]) == {"outcome", "fmt"} for r in log)
    assert all(r["reward"] == pytest.approx((r["reward_terms"]["outcome"] or 0) + 0.25 * r["reward_terms"]["fmt"])
               for r in log)
