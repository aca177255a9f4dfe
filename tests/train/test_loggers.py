"""train.loggers: TensorBoard and JSONL by default, W&B optional (offline here), a missing package named."""

import importlib.util
import json
import time

import pytest

from memrl.config import ConfigError, load_config
from memrl.train.run_log import RunLogger


def test_default_loggers_are_tensorboard_and_jsonl():
    assert load_config(None, []).train.loggers == ["tensorboard", "jsonl"]


def test_jsonl_only_writes_no_tensorboard(tmp_path):
    with RunLogger(tmp_path, loggers=["jsonl"]) as run:
        run.log_metrics(0, {"reward/mean": 0.5})
    assert not (tmp_path / "tensorboard").exists()
    assert json.loads((tmp_path / "logs" / "metrics.jsonl").read_text())["reward/mean"] == 0.5


def test_tensorboard_only_writes_no_metrics_file(tmp_path):
    with RunLogger(tmp_path, loggers=["tensorboard"]) as run:
        run.log_metrics(0, {"reward/mean": 0.5})
        run.log_eval(0, {"eval/heldout/em": 50.0})
        assert run.write_reward_summary() is None
    assert not (tmp_path / "logs" / "metrics.jsonl").exists()
    assert any((tmp_path / "tensorboard").iterdir())


@pytest.mark.skipif(importlib.util.find_spec("wandb") is None,
                    reason="wandb not installed (pip install 'memrl[wandb]')")
def test_wandb_offline_run_gets_metrics_and_resumes_the_same_run(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path))  # W&B files under the test folder, whatever the machine has
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = load_config(None, ["train.loggers=[tensorboard, jsonl, wandb]", "train.experiment_name=smoke"])
    run_root = tmp_path / "run"
    with RunLogger(run_root, cfg, loggers=cfg.train.loggers, project_name="memrl-test",
                   experiment_name=cfg.train.experiment_name) as run:
        run.log_eval(-1, {"eval/heldout/em": 10.0})
        run.log_metrics(0, {"reward/mean": 0.25, "kl/mean": 0.01})
        run.log_eval(0, {"eval/heldout/em": 30.0})
        wb = run._wandb.run
        run_id = wb.id
        assert wb.name == "smoke" and wb.project == "memrl-test"
        assert wb.config["train"]["loggers"] == ["tensorboard", "jsonl", "wandb"]
    # Offline, W&B keeps the run in one binary record file, which its Go core may still be flushing after
    # finish() returns (no Python reader of it ships): wait a bounded while for our keys to land.
    files = list(run_root.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb"))
    assert len(files) == 1, list(run_root.rglob("*"))
    keys = (b"reward/mean", b"kl/mean", b"eval/heldout/em")
    deadline = time.monotonic() + 60
    while not all(k in files[0].read_bytes() for k in keys) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert all(k in files[0].read_bytes() for k in keys), files[0].read_bytes()[:200]
    assert (run_root / "logs" / "wandb_run_id").read_text().strip() == run_id
    with RunLogger(run_root, cfg, start_rollout_id=1, loggers=cfg.train.loggers) as resumed:
        assert resumed._wandb.run.id == run_id  # the resumed run continues the same W&B run


def test_missing_wandb_is_a_one_line_config_error(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb package is not installed: pip install 'memrl\[wandb\]'"):
        load_config(None, ["train.loggers=[tensorboard, wandb]"])
    with pytest.raises(ConfigError, match="twice"):
        load_config(None, ["train.loggers=[jsonl, jsonl]"])
