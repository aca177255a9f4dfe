"""memrl.rollout: what every task's rollout shares (slots, group keys, dropping failed groups, hooks)."""

import asyncio
import re
import sys
import threading
import types
from fractions import Fraction

import numpy as np
import pytest

from memrl.config import AlgorithmConfig, Config, ConfigError, load_config
from memrl.engines.base import GenerationResult
from memrl.memagent.task import MemAgentTask
from memrl.rl.validate import validate_trajectory
from memrl.rollout import UNTRAINED_LOG_PROB, RewardError, RolloutContext, finish_rollout, request_seed
from memrl.task import Task, convert_one_row_per_trajectory, rows_per_trajectory
from memrl.types import Trajectory, Turn


class Rec:
    def __init__(self, id_):
        self.id, self.question, self.answers, self.context = id_, "q?", ["a"], "text"


def traj(group, k, status="complete", turns=2):
    t = Trajectory(trajectory_id=f"{group}:s{k}", group_id=group, sample_index=k, status=status, reward=1.0,
                   turns=[Turn(i, "memory" if i < turns - 1 else "final", [1, 2], [3], [-0.5], [1], "stop", 4)
                          for i in range(turns)])
    return t


def test_slots_keep_the_whole_batchs_positions_on_a_slice():
    ctx = RolloutContext(engine=None, tokenizer=None, config=Config(), rollout_id=7, slot_offset=2)
    groups = ctx.groups([Rec("q5"), Rec("q5")])  # a wrapped batch may hold one question twice
    assert [(g.slot, g.key, g.group_id) for g in groups] == [(2, "7:2:q5", "r7:2:q5"), (3, "7:3:q5", "r7:3:q5")]
    assert groups[0].trajectory_id(1) == "r7:2:q5:s1"
    whole = RolloutContext(engine=None, tokenizer=None, config=Config(), rollout_id=7).groups(
        [Rec("a"), Rec("b"), Rec("q5"), Rec("q5")])
    assert [g.key for g in whole[2:]] == [g.key for g in groups]


def test_finish_rollout_drops_whole_groups_and_counts_rows():
    good = [traj("g1", 0), traj("g1", 1, turns=3)]
    bad = [traj("g2", 0), traj("g2", 1, status="failed")]
    out = finish_rollout([good, bad], {"time/generate_s": 1.5})
    assert out.trajectories == good and out.dropped == bad and out.train_row_count == 5
    assert out.metrics["groups/dropped"] == 1.0 and out.metrics["trajectories/failed"] == 1.0
    assert out.metrics["time/generate_s"] == 1.5
    assert finish_rollout([good], one_row_per_turn=False).train_row_count is None  # 1:1: no count announced


def test_rows_per_trajectory_from_the_factor_or_the_task():
    assert rows_per_trajectory(load_config(None, ["task.max_chunks=6"])) == 7  # MemAgent's
    assert rows_per_trajectory(load_config(None, ["queue.train_sample_expansion_factor=9"])) == 9
    assert rows_per_trajectory(load_config(None, ["plugins.task=memrl.tasks.single_turn:SingleTurnTask"])) == 1


def test_a_task_module_that_fails_to_import_is_a_config_error_naming_the_dependency(monkeypatch, tmp_path):
    (tmp_path / "broken_task_for_test.py").write_text("import not_installed_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="plugins.task = 'broken_task_for_test:T'.*not_installed_dependency_xyz"):
        load_config(None, ["plugins.task=broken_task_for_test:T"])


@pytest.mark.parametrize("key", ["generate_function", "convert_function"])
def test_the_replaced_per_function_plugin_keys_are_refused_naming_plugins_task(key):
    with pytest.raises(ConfigError, match=rf"plugins.{key} is replaced by plugins.task"):
        load_config(None, [f"plugins.{key}=memrl.tasks.single_turn:generate_single_turn"])


def test_a_tasks_validate_config_runs_at_load(monkeypatch):
    module = types.ModuleType("my_task_for_test")

    class MyTask(Task):
        def validate_config(self, cfg):
            if cfg.sampling.n_samples < 2:
                raise ValueError("my task needs sampling.n_samples >= 2")

    module.MyTask = MyTask
    monkeypatch.setitem(sys.modules, "my_task_for_test", module)
    with pytest.raises(ConfigError, match="my task needs sampling.n_samples >= 2"):
        load_config(None, ["plugins.task=my_task_for_test:MyTask", "sampling.n_samples=1"])
    assert load_config(None, ["plugins.task=my_task_for_test:MyTask"]).sampling.n_samples == 8


def test_evaluation_recipes_need_no_queue_keys():
    from pathlib import Path

    root = Path(__file__).resolve().parents[1] / "recipes"
    for name in ("ruler-hqa-eval.yaml", "memagent-official-eval.yaml"):
        assert "queue" not in (root / name).read_text()
        cfg = load_config(root / name)
        assert rows_per_trajectory(cfg) == cfg.task.max_chunks + 1


def test_turn_logs_reuse_the_texts_training_decoded_once():
    from memrl.rl.turn_rewards import score_turns
    from memrl.rollout import turn_log_records

    class CountingTokenizer:
        calls = 0

        def decode(self, ids, skip_special_tokens=True):
            self.calls += 1
            return " ".join(map(str, ids))

    tok, t = CountingTokenizer(), traj("g", 0)
    assert [r["text"] for r in turn_log_records(t, tok)] == ["3", "3"] and tok.calls == 2  # no scores yet: decodes
    score_turns([t], tok, Config().algorithm, MemAgentTask())
    tok.calls = 0
    assert [r["text"] for r in turn_log_records(t, tok)] == ["3", "3"] and tok.calls == 0


# ------------------------------------------------------------------------------------------ ctx.reward

def reward_ctx(fn, timeout_s=60.0):
    return RolloutContext(engine=None, tokenizer=None,
                          config=Config.model_validate({"task": {"reward_timeout_s": timeout_s}}), reward_function=fn)


@pytest.mark.parametrize("value", [True, np.bool_(False), "1.0", float("nan"), float("-inf"), [1.0]])
def test_a_reward_that_is_no_finite_real_number_is_a_named_error(value):
    # float() took True and "1.0" as 1.0: a reward function with a bug trained silently.
    ctx = reward_ctx(lambda t, golds: value)
    with pytest.raises(RewardError, match=rf"returned {re.escape(repr(value))} \({type(value).__name__}\) for "
                                          r"trajectory g:s0; a reward must be a finite real number"):
        ctx.reward(traj("g", 0), ["a"])


@pytest.mark.parametrize(("value", "expected"), [(1, 1.0), (0.25, 0.25), (np.float32(0.5), 0.5),
                                                 (Fraction(3, 4), 0.75)])
def test_real_rewards_are_taken_as_floats(value, expected):
    reward = reward_ctx(lambda t, golds: value).reward(traj("g", 0), ["a"])
    assert type(reward) is float and reward == expected


def test_a_failed_trajectory_scores_0_without_a_call_and_a_raising_function_keeps_its_error():
    def broken(t, golds):
        raise KeyError("bug in the reward function")

    assert reward_ctx(broken).reward(traj("g", 0, status="failed"), ["a"]) == 0.0
    with pytest.raises(KeyError, match="bug in the reward function"):  # a bug keeps its own traceback
        reward_ctx(broken).reward(traj("g", 0), ["a"])


def test_a_reward_call_past_its_timeout_fails_the_rollout_once_for_all_its_trajectories():
    release, calls = threading.Event(), []

    def hanging(t, golds):
        calls.append(t.trajectory_id)
        release.wait(60)  # "hangs" until the test releases it
        return 1.0

    ctx = reward_ctx(hanging, timeout_s=0.2)
    try:
        with pytest.raises(RewardError, match=r"reward function .*hanging did not return within 0.2 s "
                                              r"\(task.reward_timeout_s\)"):
            ctx.reward(traj("g", 0), ["a"])
        # Trajectories still in flight get the same error without calling the hung function again.
        with pytest.raises(RewardError, match="did not return within 0.2 s"):
            ctx.reward(traj("g", 1), ["a"])
        assert calls == ["g:s0"]
    finally:
        release.set()  # lets the abandoned call end


# ------------------------------------------------------------------------------------------ ctx.sample_turn
# The framework owns one turn (issue 36): its seed, the task's stop ids, an engine error as a failed
# trajectory, the Turn exactly as sampled, and tokens a turn carries untrained.

class ScriptedEngine:
    """Answers each request with the next scripted result; an exception in the script is raised instead."""

    def __init__(self, *results):
        self.results, self.requests = list(results), []

    async def generate(self, requests):
        self.requests += requests
        result = self.results.pop(0)
        if isinstance(result, Exception):
            raise result
        return [result]


class StopNineTask(Task):
    def stop_token_ids(self, tokenizer, cfg):
        return [9]


class WordTokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"w{i}" for i in ids)


def turn_context(*results):
    cfg = load_config(None, [f"plugins.task={__name__}:StopNineTask", "sampling.seed=5", "sampling.temperature=0.7"])
    ctx = RolloutContext(engine=ScriptedEngine(*results), tokenizer=WordTokenizer(), config=cfg, rollout_id=2)
    group = ctx.groups([Rec("q")])[0]
    return ctx, group, Trajectory(group.trajectory_id(1), group.group_id, 1, [])


def run(coro):
    return asyncio.run(coro)


def test_sample_turn_builds_the_turn_exactly_with_the_tasks_stop_ids_and_its_own_seed():
    ctx, group, t = turn_context(GenerationResult([4, 5], [-0.1, -0.2], "length"),
                                 GenerationResult([6, 9], [-0.3, -0.4], "stop"))
    search = run(ctx.sample_turn(group, t, "search", (1, 2), 3))
    assert search == Turn(0, "search", [1, 2], [4, 5], [-0.1, -0.2], [1, 1], "length", 3) and t.turns == [search]
    assert t.answer == ""  # only the final turn answers
    final = run(ctx.sample_turn(group, t, "final", [1, 2, 4, 5, 7], 2))
    assert final == Turn(1, "final", [1, 2, 4, 5, 7], [6, 9], [-0.3, -0.4], [1, 1], "stop", 2)
    assert (t.answer, t.status) == ("w6", "complete")  # the stop id left out
    requests = ctx.engine.requests
    assert [r.seed for r in requests] == [request_seed(5, group.key, 1, 0), request_seed(5, group.key, 1, 1)]
    assert all((r.stop_token_ids, r.temperature, r.top_p) == ([9], 0.7, 1.0) for r in requests)
    assert [(r.prompt_ids, r.max_tokens) for r in requests] == [([1, 2], 3), ([1, 2, 4, 5, 7], 2)]


@pytest.mark.parametrize(("failure", "error"), [
    (ConnectionError("server gone"), "ConnectionError: server gone"),  # raised: it failed the whole step before
    ("failed", "overloaded"),
    ("empty", "engine returned no tokens"),
])
def test_an_engine_error_fails_the_trajectory_naming_the_turn(failure, error):
    failure = {"failed": GenerationResult.failed("overloaded"),
               "empty": GenerationResult([], [], "stop")}.get(failure, failure)
    ctx, group, t = turn_context(GenerationResult([4], [-0.1], "stop"), failure)
    assert run(ctx.sample_turn(group, t, "memory", [1], 3)) is not None
    assert run(ctx.sample_turn(group, t, "final", [1, 4], 3)) is None
    assert (t.status, t.error, len(t.turns)) == ("failed", f"final turn 1: {error}", 1)


def test_a_turn_carries_tokens_the_policy_did_not_sample_untrained():
    ctx, group, t = turn_context(GenerationResult([4, 5], [-0.1, -0.2], "stop"),
                                 GenerationResult([6, 9], [-0.3, -0.4], "stop"))
    run(ctx.sample_turn(group, t, "final", [1, 2], 2))
    turn = run(ctx.extend_turn(group, t, [7, 7, 7], 4))  # e.g. a search's results, then the answer
    u = UNTRAINED_LOG_PROB
    assert turn == Turn(0, "final", [1, 2], [4, 5, 7, 7, 7, 6, 9], [-0.1, -0.2, u, u, u, -0.3, -0.4],
                        [1, 1, 0, 0, 0, 1, 1], "stop", 2 + 3 + 4) and t.turns == [turn]
    request = ctx.engine.requests[1]
    assert (request.prompt_ids, request.max_tokens, request.seed) == ([1, 2, 4, 5, 7, 7, 7], 4,
                                                                     request_seed(5, group.key, 1, 0, 2))
    assert t.answer == "w4 w5 w6"  # what the policy wrote, not what was inserted
    t.reward = 1.0
    validate_trajectory(t)
    (row,) = convert_one_row_per_trajectory([t], AlgorithmConfig(), 0)
    assert row.loss_mask == [1, 1, 0, 0, 0, 1, 1] and row.tokens == [1, 2, 4, 5, 7, 7, 7, 6, 9]
