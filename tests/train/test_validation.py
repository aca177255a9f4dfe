"""Validation during training (memrl.train.validation), the best checkpoint and keep_last_n."""

import json
import sys
from pathlib import Path

import pytest
import torch

from memrl.config import Config, ConfigError, load_config
from memrl.data.records import write_jsonl
from memrl.train.checkpoint import find_best_checkpoint, list_checkpoints, load_checkpoint, read_best
from memrl.train.controller import TrainingError
from memrl.train.validation import Validator

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_controller import config, make_trainer, read_metrics, records  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(scope="module")
def tokenizer():
    from memrl.tiny import build_tiny_tokenizer

    return build_tiny_tokenizer()


def with_eval(tmp_path, sets=None, eval_limit=None, **train):
    """test_controller's config with a data folder holding the held-out file, and validation settings."""
    data = tmp_path / "data"
    if not data.is_dir():
        write_jsonl(data / "heldout.jsonl", records(4))
    raw = config(**train).model_dump(mode="json")
    raw["data"].update(dir=str(data), heldout_file="heldout.jsonl")
    raw["eval"].update(limit=eval_limit, sets=sets or [])
    return Config.model_validate(raw)


def eval_lines(run_root):
    path = run_root / "logs" / "eval_metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def test_validation_runs_every_n_steps_through_the_eval_runner(tokenizer, tmp_path):
    from memrl.engines.factory import build_engine
    from memrl.eval.runner import evaluate
    from memrl.tiny import build_tiny_model

    run_root = tmp_path / "run"
    cfg = with_eval(tmp_path, eval_limit=2, num_rollout=3, save_interval=1, eval_interval=2, eval_before_train=True)
    history = make_trainer(tokenizer, run_root, cfg).run()
    lines = eval_lines(run_root)
    assert [line["rollout_id"] for line in lines] == [-1, 1, 2]  # before, every 2 steps, after the last
    for line in lines:
        assert {"eval/heldout/em", "eval/heldout/sub_em", "eval/heldout/f1", "eval/heldout/failed",
                "time/eval_s"} <= line.keys()
    assert history[1]["eval/heldout/f1"] == lines[1]["eval/heldout/f1"]
    assert (run_root / "eval" / "heldout" / "initial" / "summary.json").is_file()
    step_1 = run_root / "eval" / "heldout" / "iter_0000001"
    # The same runner and scorer as `memrl eval`: the checkpoint of step 1 evaluated afresh gives the same lines.
    model = build_tiny_model(len(tokenizer), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=0,
                             eos_token_id=tokenizer.eos_token_id)
    load_checkpoint(run_root / "checkpoints" / "iter_0000001", model, restore_rng=False)
    engine = build_engine(cfg, model=model, tokenizer=tokenizer)
    summary = evaluate(engine, tokenizer, cfg, records(4)[:2], tmp_path / "afresh", model_name="x", data_sha256="y")
    assert summary["total"] == 2
    fresh = [json.loads(x) for x in (tmp_path / "afresh" / "results.jsonl").read_text().splitlines()]
    during = [json.loads(x) for x in (step_1 / "results.jsonl").read_text().splitlines()]
    key = (lambda line: (line["id"], line["answer"], line["em"], line["f1"], line["turns"]))  # noqa: E731
    assert sorted(map(key, fresh)) == sorted(map(key, during))
    assert summary["metrics"]["f1"]["value"] == pytest.approx(lines[1]["eval/heldout/f1"], abs=1e-9)
    tags = set()
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for events in (run_root / "tensorboard").iterdir():
        acc = EventAccumulator(str(events))
        acc.Reload()
        tags |= set(acc.Tags()["scalars"])
    assert {"eval/heldout/em", "eval/heldout/sub_em", "eval/heldout/f1"} <= tags


def test_validation_leaves_the_training_run_unchanged(tokenizer, tmp_path):
    plain = make_trainer(tokenizer, tmp_path / "a", config(num_rollout=2))
    plain.run()
    validated = make_trainer(tokenizer, tmp_path / "b", with_eval(tmp_path, eval_limit=1, num_rollout=2,
                                                                   eval_interval=1, eval_before_train=True))
    validated.run()
    assert [m["reward/mean"] for m in read_metrics(tmp_path / "a")] == \
        [m["reward/mean"] for m in read_metrics(tmp_path / "b")]
    for pa, pb in zip(plain.parts.policy.model.parameters(), validated.parts.policy.model.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, atol=0, rtol=0)


def scripted_validation(monkeypatch, values, metric="em"):
    """Replace the evaluation by scripted held-out values of `metric` per rollout id (the trainer's logic
    under test)."""
    def validate(self, rollout_id, engine, run):
        return {"eval/heldout/em": 0.0, "eval/heldout/sub_em": 0.0, "eval/heldout/f1": 0.0,
                f"eval/heldout/{metric}": values[rollout_id]}

    monkeypatch.setattr(Validator, "validate", validate)


def test_best_pointer_names_the_best_step_and_keep_last_n_spares_it(tokenizer, tmp_path, monkeypatch):
    scripted_validation(monkeypatch, {0: 10.0, 1: 40.0, 2: 20.0, 3: 40.0, 4: 30.0})
    run_root = tmp_path / "run"
    cfg = with_eval(tmp_path, num_rollout=5, save_interval=100, eval_interval=1, keep_best="eval/heldout/em",
                    keep_last_n=1)
    trainer = make_trainer(tokenizer, run_root, cfg)
    trainer.run()
    best = read_best(run_root)
    assert best == {"checkpoint": "iter_0000001", "rollout_id": 1, "metric": "eval/heldout/em", "value": 40.0,
                    "mode": "max"}  # a tie (step 3) is no new best
    # Saved at each new best (0, 1) and at the end (4); keep_last_n=1 pruned 0 but kept the best and the latest.
    assert [p.name for p in list_checkpoints(run_root)] == ["iter_0000001", "iter_0000004"]
    assert json.loads((find_best_checkpoint(run_root) / "state.json").read_text())["rollout_id"] == 1


def test_min_mode_and_a_resume_keeps_the_best_so_far(tokenizer, tmp_path, monkeypatch):
    scripted_validation(monkeypatch, {0: 5.0, 1: 2.0, 2: 3.0, 3: 1.0}, metric="f1")
    run_root = tmp_path / "run"
    common = {"save_interval": 2, "eval_interval": 1, "keep_best": "eval/heldout/f1", "keep_best_mode": "min"}
    make_trainer(tokenizer, run_root, with_eval(tmp_path, num_rollout=2, **common)).run()
    assert read_best(run_root)["rollout_id"] == 1
    resumed = make_trainer(tokenizer, run_root, with_eval(tmp_path, num_rollout=4, **common),
                           load=run_root / "checkpoints" / "iter_0000001")
    assert resumed.best.best == 2.0
    resumed.run()
    assert read_best(run_root)["rollout_id"] == 3  # 3.0 at step 2 did not beat 2.0; 1.0 at step 3 did


def test_a_missing_eval_file_fails_before_the_first_step(tokenizer, tmp_path):
    cfg = with_eval(tmp_path, sets=[{"name": "ruler", "file": "ruler/eval_50.json"}], eval_interval=1)
    with pytest.raises(TrainingError, match="validation set 'ruler'.*does not exist"):
        make_trainer(tokenizer, tmp_path / "run", cfg)


def test_per_set_settings_reach_the_runner(tokenizer, tmp_path):
    cfg = with_eval(tmp_path, sets=[{"name": "short", "file": "heldout.jsonl", "limit": 1, "samples": 2,
                                     "temperature": 0.0, "task": {"final_tokens": 3, "max_chunks": 2}}],
                    num_rollout=1, eval_interval=1)
    run_root = tmp_path / "run"
    make_trainer(tokenizer, run_root, cfg).run()
    folder = run_root / "eval" / "short" / "iter_0000000"
    summaries = [json.loads((folder / f"sample_{s}" / "summary.json").read_text()) for s in (0, 1)]
    assert [s["total"] for s in summaries] == [1, 1]
    assert [s["format"]["seed"] for s in summaries] == [cfg.sampling.seed, cfg.sampling.seed + 1]
    assert {s["format"]["temperature"] for s in summaries} == {0.0}
    assert {s["format"]["final_tokens"] for s in summaries} == {3}
    assert {s["format"]["max_chunks"] for s in summaries} == {2}  # a setting of the task's own class
    assert set(eval_lines(run_root)[0]) >= {"eval/short/em", "eval/short/f1"}


@pytest.mark.parametrize("sets, match", [
    (["train.keep_best=eval/heldout/em"], "needs validation"),
    (["train.eval_interval=1", "train.keep_best=eval/heldout/acc"], "eval/<set>/<em"),
    (["train.eval_interval=1", "eval.sets=[{name: a, file: a.jsonl}]", "train.keep_best=eval/b/em"], "eval/<set>"),
    (["train.eval_interval=1", "train.max_staleness=1"], "max_staleness = 0"),
    (["train.eval_interval=1", "train.runtime=ray"], "runtime = 'local'"),
    (["eval.sets=[{name: a, file: a.jsonl}, {name: a, file: b.jsonl}]"], "unique"),
    (["eval.sets=[{name: 'a b', file: a.jsonl}]"], "pattern"),
    # An eval set's task settings are the task's keys, checked by its Settings class (issue 36).
    (["eval.sets=[{name: a, file: a.jsonl, task: {max_chunks: 0}}]"],
     r"eval\.sets\.0\.task\.max_chunks: .*greater than 0"),
    (["eval.sets=[{name: a, file: a.jsonl, task: {chunk_tokns: 8}}]"], r"eval\.sets\.0\.task\.chunk_tokns: Extra"),
    (["plugins.task=memrl.tasks.single_turn:SingleTurnTask",
      "eval.sets=[{name: a, file: a.jsonl, task: {max_chunks: 8}}]"], r"eval\.sets\.0\.task\.max_chunks: Extra"),
    (["eval.sets=[{name: a, file: a.jsonl, max_chunks: 8}]"], r"max_chunks: no key of an eval set.*task: \{max_chunks"),
])
def test_validation_settings_are_checked(sets, match):
    with pytest.raises(ConfigError, match=match):
        load_config(None, sets)


def test_a_replay_cannot_validate(tokenizer, tmp_path):
    cfg = with_eval(tmp_path, eval_interval=1)
    with pytest.raises(TrainingError, match="a replay has no engine"):
        make_trainer(tokenizer, tmp_path / "run", cfg, replay_rollouts=tmp_path / "raw")


class WrappedSource:
    """A rollout source of no built-in kind: it forwards to a LocalRollout and declares what that can do."""

    def __init__(self, inner):
        self.inner, self.engine, self.loop = inner, inner.engine, inner.loop
        self.generates, self.in_process, self.takes_folders = True, True, False

    def __getattr__(self, name):
        return getattr(self.inner, name)


def test_the_loop_reads_what_a_source_declares_not_its_kind(tokenizer, tmp_path):
    """Issue 25: validation needs an in-process engine, which any source may declare (no isinstance of the
    built-in sources in the loop); the run validates through the wrapper's engine."""
    from memrl.tiny import build_tiny_model
    from memrl.train.controller import Trainer, TrainOptions, local_parts

    cfg = with_eval(tmp_path, eval_limit=1, num_rollout=1, eval_interval=1)
    options = TrainOptions(run_root=tmp_path / "run", progress=False)
    model = build_tiny_model(len(tokenizer), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64, seed=0,
                             eos_token_id=tokenizer.eos_token_id)
    parts = local_parts(cfg, options, model=model, tokenizer=tokenizer, records=records())
    parts.rollout = WrappedSource(parts.rollout)
    Trainer(cfg, options, parts=parts).run()
    assert [line["rollout_id"] for line in eval_lines(tmp_path / "run")] == [0]
