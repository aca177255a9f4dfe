"""Run logs: JSONL metrics, TensorBoard scalars read back, rollout files, reward summary, resume, timers."""

from __future__ import annotations

import json
import logging
import math
import time

import numpy as np
import pytest
import torch
import yaml

from memrl.train.run_log import RunLogger, StageTimer, device_stats, read_metrics, reward_summary


def tensorboard_scalars(run_root) -> dict[str, list[tuple[int, float]]]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(run_root / "tensorboard"))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_metrics_go_to_jsonl_and_tensorboard(tmp_path):
    with RunLogger(tmp_path, config_dict={"train": {"lr": 1e-6}}) as run:
        run.log_metrics(0, {"reward/mean": 0.25, "loss/policy": np.float32(-0.5), "grad_norm": torch.tensor(2.0),
                            "kl/mean": float("nan"), "perf/tokens_per_s": float("inf"), "note": "warmup",
                            "rows/saved": 32})
        line = json.loads(run.metrics_path.read_text().splitlines()[0])  # flushed before close
        run.log_metrics(1, {"reward/mean": 0.75, "rows/saved": 40})

    assert line == {"rollout_id": 0, "reward/mean": 0.25, "loss/policy": -0.5, "grad_norm": 2.0,
                    "kl/mean": None, "perf/tokens_per_s": None, "note": "warmup", "rows/saved": 32}
    scalars = tensorboard_scalars(tmp_path)
    assert scalars["reward/mean"] == [(0, 0.25), (1, 0.75)]
    assert scalars["loss/policy"] == [(0, -0.5)]
    assert scalars["rows/saved"] == [(0, 32.0), (1, 40.0)]
    assert "kl/mean" not in scalars and "perf/tokens_per_s" not in scalars and "note" not in scalars
    assert yaml.safe_load((tmp_path / "config.yaml").read_text()) == {"train": {"lr": 1e-6}}
    assert "rollout 1: reward/mean=0.75" in (tmp_path / "logs" / "train.log").read_text()


def test_train_log_receives_memrl_records_and_handler_is_removed(tmp_path):
    run = RunLogger(tmp_path, use_tensorboard=False)
    logging.getLogger("memrl.train.controller").info("weights synced in %.1f s", 1.5)
    run.close()
    logging.getLogger("memrl.train.controller").info("after close")
    text = (tmp_path / "logs" / "train.log").read_text()
    assert "weights synced in 1.5 s" in text and "after close" not in text
    assert not (tmp_path / "tensorboard").exists()


def test_rollout_records_are_written_whole_and_json_safe(tmp_path):
    records = [
        {"question_id": "q1", "turns": [{"kind": "memory", "text": "Paris é", "length": 3}], "answer": "Paris",
         "reward": 1.0, "status": "complete"},
        {"question_id": "q2", "turns": [], "answer": None, "reward": float("nan"), "status": "failed",
         "lengths": np.array([1, 2])},
    ]
    with RunLogger(tmp_path, use_tensorboard=False) as run:
        path = run.log_rollout(7, records)
    assert path == tmp_path / "logs" / "rollouts" / "rollout_0000007.jsonl"
    lines = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines()]
    assert lines[0] == records[0]
    assert lines[1]["reward"] is None and lines[1]["lengths"] == [1, 2]
    assert not [p for p in path.parent.iterdir() if ".tmp-" in p.name]


def test_reward_summary_by_hand(tmp_path):
    rewards = [0.1 * i for i in range(12)]  # rollouts 0..11, best is the last
    with RunLogger(tmp_path, use_tensorboard=False) as run:
        for i, reward in enumerate(rewards):
            run.log_metrics(i, {"reward/mean": reward})
        run.log_metrics(12, {"loss/policy": 1.0})  # no reward: left out of the summary
        path = run.write_reward_summary()
    summary = json.loads(path.read_text())
    assert path == tmp_path / "reward_summary.json"
    assert summary["num_rollouts"] == 12
    assert math.isclose(summary["first_10_mean"], 0.45)  # (0 + ... + 0.9) / 10
    assert math.isclose(summary["last_10_mean"], 0.65)  # (0.2 + ... + 1.1) / 10
    assert summary["best"]["rollout_id"] == 11 and math.isclose(summary["best"]["reward_mean"], 1.1)
    assert [r["rollout_id"] for r in summary["per_rollout"]] == list(range(12))

    short = reward_summary([{"rollout_id": 0, "reward/mean": 0.2}, {"rollout_id": 1, "reward/mean": 0.6}])
    assert math.isclose(short["first_10_mean"], 0.4) and math.isclose(short["last_10_mean"], 0.4)
    assert reward_summary([])["best"] is None


def test_resume_drops_steps_after_the_checkpoint(tmp_path):
    with RunLogger(tmp_path) as run:
        for i in range(4):
            run.log_metrics(i, {"reward/mean": float(i)})
    # TensorBoard reads event files in name order: `...tfevents.<second>.<host>.<pid>.<counter>`. Within one
    # second and one process the counter decides, compared as text (".10" < ".9"), so the resumed run's file
    # could be read first. A real resume starts seconds later; here, wait for the next second.
    time.sleep(1.01 - time.time() % 1)
    # Resumed from a checkpoint after rollout 1: rollouts 2 and 3 run again with new values.
    with RunLogger(tmp_path, start_rollout_id=2) as run:
        assert [r["rollout_id"] for r in read_metrics(tmp_path)] == [0, 1]
        run.log_metrics(2, {"reward/mean": 20.0})
    assert [(r["rollout_id"], r["reward/mean"]) for r in read_metrics(tmp_path)] == [(0, 0.0), (1, 1.0), (2, 20.0)]
    assert tensorboard_scalars(tmp_path)["reward/mean"] == [(0, 0.0), (1, 1.0), (2, 20.0)]


def test_read_metrics_skips_torn_last_line_but_not_corruption(tmp_path):
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "metrics.jsonl").write_text('{"rollout_id": 0, "reward/mean": 0.5}\n{"rollout_id": 1, "rew')
    assert read_metrics(tmp_path) == [{"rollout_id": 0, "reward/mean": 0.5}]
    (logs / "metrics.jsonl").write_text('garbage\n{"rollout_id": 0, "reward/mean": 0.5}\n')
    with pytest.raises(ValueError, match="metrics.jsonl:1"):
        read_metrics(tmp_path)


def test_stage_timer_accumulates_and_survives_errors():
    timer = StageTimer()
    with timer("rollout"):
        time.sleep(0.02)
    with timer("rollout"):
        time.sleep(0.02)
    with pytest.raises(RuntimeError), timer("train"):
        raise RuntimeError("boom")
    metrics = timer.metrics()
    assert set(metrics) == {"time/rollout_s", "time/train_s"}
    assert 0.035 < metrics["time/rollout_s"] < 1.0


def test_device_stats_reports_process_memory():
    stats = device_stats()
    assert stats["device/rss_gb"] > 0
    assert stats["device/cpu_percent"] >= 0
    assert all(isinstance(v, float) for v in stats.values())
    if not torch.cuda.is_available():
        assert not any("gpu" in k for k in stats)
