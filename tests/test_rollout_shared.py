"""memrl.rollout: what every task's rollout shares (slots, group keys, dropping failed groups, hooks)."""

import re
import sys
import threading
import types
from fractions import Fraction

import numpy as np
import pytest

from memrl.config import Config, ConfigError, load_config
from memrl.memagent.task import MemAgentTask
from memrl.rollout import RewardError, RolloutContext, finish_rollout
from memrl.task import Task, rows_per_trajectory
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


@pytest.mark.parametrize("value", [True, np.bool_(False), "1.0", float("nan"), float("-inf"), None, [1.0]])
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
