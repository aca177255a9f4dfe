"""`memrl report`: PNG plots per metric family present, report.md numbers, clear errors without metrics."""

from __future__ import annotations

import math

import pytest

from memrl.train.report import ReportError, moving_average, write_report
from memrl.train.run_log import RunLogger

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def log_run(run_root, steps: int = 12, extra: bool = True) -> None:
    with RunLogger(run_root, use_tensorboard=False) as run:
        for i in range(steps):
            metrics = {"reward/mean": 0.05 * i, "rows/saved": 32, "rows/transferred": 32, "rows/consumed": 32}
            if extra:
                metrics |= {"kl/mean": 0.001 * i, "logprob_gap/mean_abs": 0.01, "loss/policy": -0.1 * i,
                            "response_length/memory_mean": 100.0 + i, "response_length/final_mean": 20.0,
                            "grad_norm": float("nan") if i == 3 else 1.0, "time/rollout_s": 2.0,
                            "time/train_s": 1.0}
            run.log_metrics(i, metrics)


def test_report_writes_valid_pngs_and_summary_numbers(tmp_path):
    log_run(tmp_path)
    written = write_report(tmp_path)

    names = {p.name for p in written}
    assert {"reward.png", "kl.png", "logprob_gap.png", "response_length.png", "loss.png", "grad_norm.png",
            "stage_time.png", "report.md"} <= names
    assert "entropy.png" not in names and "throughput.png" not in names  # never logged: skipped
    for png in (p for p in written if p.suffix == ".png"):
        assert png.parent == tmp_path / "report"
        data = png.read_bytes()
        assert data[:8] == PNG_MAGIC and len(data) > 1000, png

    text = (tmp_path / "report" / "report.md").read_text()
    assert "Rollout steps logged: 12" in text
    assert "first 10 rollouts: 0.2250" in text  # 0.05 * (0 + ... + 9) / 10
    assert "last 10 rollouts: 0.3250" in text  # 0.05 * (2 + ... + 11) / 10
    assert "Best rollout reward: 0.5500 (rollout 11)" in text
    assert "Total rows/saved: 384" in text and "Total rows/consumed: 384" in text
    assert "Warning" not in text
    assert "![reward](reward.png)" in text


def test_report_with_only_reward_skips_other_plots_and_flags_lost_rows(tmp_path):
    with RunLogger(tmp_path, use_tensorboard=False) as run:
        run.log_metrics(0, {"reward/mean": 0.5, "rows/saved": 32, "rows/consumed": 24})
    written = write_report(tmp_path)
    assert [p.name for p in written] == ["reward.png", "report.md"]
    assert "rows saved (32) != rows consumed (24)" in written[-1].read_text()


def test_missing_or_empty_metrics_raise_report_error(tmp_path):
    with pytest.raises(ReportError, match="no metrics at"):
        write_report(tmp_path)
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "metrics.jsonl").write_text("")
    with pytest.raises(ReportError, match="no rollout steps"):
        write_report(tmp_path)


def test_moving_average_by_hand():
    assert moving_average([1.0, 2.0, 3.0, 4.0], window=2) == [1.0, 1.5, 2.5, 3.5]
    assert all(math.isclose(a, b) for a, b in zip(moving_average([3.0, 0.0, 3.0], 10), [3.0, 1.5, 2.0],
                                                  strict=True))


def test_validation_curves_are_plotted_per_set(tmp_path):
    log_run(tmp_path, steps=4)
    with RunLogger(tmp_path, use_tensorboard=False) as run:
        for rollout_id, em in ((-1, 10.0), (1, 30.0), (3, 20.0)):
            run.log_eval(rollout_id, {"eval/heldout/em": em, "eval/heldout/sub_em": em + 5, "eval/heldout/f1": em + 8,
                                      "eval/ruler_50/em": em / 2, "time/eval_s": 1.0})
    names = {p.name for p in write_report(tmp_path)}
    assert {"eval_heldout.png", "eval_ruler_50.png"} <= names
    text = (tmp_path / "report" / "report.md").read_text()
    assert "Validation `heldout` after rollout 3: em 20.0000, sub_em 25.0000, f1 28.0000; best EM 30.0000 " \
           "(rollout 1; 3 validations)" in text
    assert "![eval_heldout](eval_heldout.png)" in text
