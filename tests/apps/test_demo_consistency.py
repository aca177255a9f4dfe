"""`memrl demo-consistency`: one warm-started base trained locally, on Ray (2 rollout workers, 2 DDP ranks,
overlapped) and with a second seed, evaluated alike and compared (the 3 pp test).

The end-to-end test runs at tiny sizes (a 1-layer model, 3 GRPO steps of 4 questions x 4 samples): it checks
the wiring (the runs really trained, on the paths they claim, and every pair is compared), not the figures.
"""

from __future__ import annotations

import json
from dataclasses import replace

import pytest
import torch
from typer.testing import CliRunner

from memrl.apps.demo import FULL
from memrl.apps.demo_consistency import RUNS, ConsistencySettings, format_summary, run_consistency, verdict
from memrl.cli import app

# 600 clean demonstrations x 4 epochs: a base right ~10% of the time, so GRPO groups have mixed rewards
TINY = ConsistencySettings(demo=replace(
    FULL, num_train=650, num_heldout=24, layers=1, hidden=64, intermediate=128, sft_clean_demos=600, sft_demos=0,
    sft_epochs=4, sft_lr=5e-3, num_rollout=3, rollout_batch_size=4, n_samples=4, eval_interval=0))


@pytest.mark.slow
@pytest.mark.timeout(600)  # ~35 s on a loaded 2-core machine (Ray start included)
def test_three_paths_train_from_one_base_and_every_pair_is_compared(tmp_path, monkeypatch):
    pytest.importorskip("ray")
    from memrl.distributed import runtime

    # What the Ray run really ran on: workers per generate call and ranks per training step.
    seen = {"rollout_workers": [], "ranks": []}
    generate, train_rollout = runtime.RolloutPool.generate, runtime.TrainerGroup.train_rollout

    def spy_generate(self, *args, **kwargs):
        seen["rollout_workers"].append(len(self.workers))
        return generate(self, *args, **kwargs)

    def spy_train(self, *args, **kwargs):
        seen["ranks"].append(len(self.workers))
        return train_rollout(self, *args, **kwargs)

    monkeypatch.setattr(runtime.RolloutPool, "generate", spy_generate)
    monkeypatch.setattr(runtime.TrainerGroup, "train_rollout", spy_train)
    torch.set_num_threads(1)  # as the command runs it
    root = tmp_path / "cons"
    summary = run_consistency(root, TINY, progress=False)
    print(format_summary(summary, root))

    assert seen == {"rollout_workers": [2, 2, 2], "ranks": [2, 2, 2]}
    runs = summary["runs"]
    assert list(runs) == list(RUNS)
    assert runs["ray"]["staleness_per_step"] == [0.0, 1.0, 1.0]  # rollout n+1 generated while step n trained
    assert runs["local"]["staleness_per_step"] == runs["local-seed2"]["staleness_per_step"] == [0.0, 0.0, 0.0]
    assert (runs["ray"]["rollout_workers"], runs["ray"]["trainer_ranks"]) == (2, 2)
    for key in ("train_seed", "rollout_seed"):
        assert runs["local-seed2"][key] == runs["local"][key] + 1 == runs["ray"][key] + 1
    for name, run in runs.items():
        assert run["steps"] == 3 and run["weights_moved_from_base"] > 0, name  # each run really trained
        assert set(run["em"]) == set(run["sub_em"]) == {"value", "ci95"}
    # every pair compared, and the runs ended apart (the paths' numerics differ; the seed differs)
    assert {frozenset((p["a"], p["b"])) for p in summary["pairs"]} == {
        frozenset(("local", "ray")), frozenset(("local", "local-seed2")), frozenset(("ray", "local-seed2"))}
    assert all(p["weights_distance"] > 0 for p in summary["pairs"])
    report = (root / "compare" / "report.md").read_text()
    for heading in ("## local vs ray", "## local vs local-seed2", "## ray vs local-seed2"):
        assert heading in report
    (check,) = summary["thresholds"]
    assert (check["pair"], check["metric"], check["limit_pp"]) == (["local", "ray"], "sub_em", 3.0)
    assert check["abs_diff_pp"] == pytest.approx(abs(runs["ray"]["sub_em"]["value"] - runs["local"]["sub_em"]["value"]))
    assert (summary["passed"] == check["passed"]
            == json.loads((root / "compare" / "comparison.json").read_text())["passed"])
    assert json.loads((root / "consistency_summary.json").read_text()) == json.loads(json.dumps(summary))
    # one base, shared: the data and warm start exist once
    assert (root / "data" / "synthetic_heldout.jsonl").is_file() and (root / "sft" / "clean" / "model").is_dir()
    assert {"data+sft_s", "train_local_s", "train_ray_s", "train_local-seed2_s", "eval_ray_s", "total_s"} <= set(
        summary["times_s"])


def _summary(diff: float) -> dict:
    metric = {"value": 50.0, "ci95": [40.0, 60.0]}
    run = {"path": "p", "em": metric, "sub_em": metric, "weights_moved_from_base": 0.1}
    pair = {"a": "local", "b": "ray", "em_diff_pp": diff, "sub_em_diff_pp": diff, "wrong_to_right": 1,
            "right_to_wrong": 0, "mcnemar_p": 1.0, "weights_distance": 0.01}
    return {"heldout_questions": 100, "base": {"em": metric, "sub_em": metric}, "runs": {n: run for n in RUNS},
            "pairs": [pair], "thresholds": [{"pair": ["local", "ray"], "metric": "sub_em", "abs_diff_pp": abs(diff),
                                             "limit_pp": 3.0, "passed": abs(diff) <= 3.0}],
            "passed": abs(diff) <= 3.0, "times_s": {"total_s": 60.0}}


@pytest.mark.parametrize(("diff", "code"), [(2.5, 0), (-3.0, 0), (3.5, 1), (-4.0, 1)])
def test_the_exit_code_follows_the_local_vs_ray_threshold(tmp_path, monkeypatch, diff, code):
    import memrl.apps.demo_consistency as module

    assert verdict(_summary(diff)["thresholds"]) == code
    monkeypatch.setattr(module, "run_consistency", lambda root, settings, progress=True: _summary(diff))
    result = CliRunner().invoke(app, ["demo-consistency", "--quick", "--run-root", str(tmp_path / "r")])
    assert result.exit_code == code, result.output
    assert ("threshold FAILED" in result.output) == bool(code)


def test_bad_input_is_one_line_before_any_work(tmp_path):
    runner = CliRunner()
    (tmp_path / "old.txt").write_text("x")
    result = runner.invoke(app, ["demo-consistency", "--quick", "--run-root", str(tmp_path)])
    assert result.exit_code == 2 and "not empty" in result.output and "Traceback" not in result.output
    new = tmp_path / "new"
    for args, named in ((["--set", "train.max_staleness=2"], "train.max_staleness"),
                        (["--set", "train.lr=-1"], "train.lr"),
                        (["--seed-offset", "0"], "--seed-offset"),
                        (["--max-abs-diff", "sub_em"], "METRIC=POINTS"),
                        (["--max-abs-diff", "bleu=3"], "bleu")):
        result = runner.invoke(app, ["demo-consistency", "--quick", "--run-root", str(new), *args])
        assert (result.exit_code == 2 and named in result.output
                and "Traceback" not in result.output), (args, result.output)
        assert not new.exists()
