"""Run logs under one run root: training log, JSONL metrics, per-rollout records, TensorBoard, reward summary.

    RUN_ROOT/config.yaml                      config snapshot (when one is given)
    RUN_ROOT/logs/train.log                   records of the `memrl` logger (the caller adds a console)
    RUN_ROOT/logs/metrics.jsonl               one line per rollout step: {"rollout_id": N, metric: value}
    RUN_ROOT/logs/eval_metrics.jsonl          one line per validation (memrl.train.validation): same form
    RUN_ROOT/logs/rollouts/rollout_XXXXXXX.jsonl   one line per trajectory record of that step
    RUN_ROOT/tensorboard/                     event files: one scalar per numeric metric, step = rollout id
    RUN_ROOT/wandb/                           Weights & Biases (`train.loggers`; logs/wandb_run_id resumes it)
    RUN_ROOT/reward_summary.json              per-rollout mean reward, first/last-10 means, best

Invariants: metrics lines are strict JSON (non-finite numbers as null), appended whole and fsynced; a resumed
run first drops the lines (and TensorBoard steps) of rollout ids >= its start, so a step is logged once
even if it ran twice; rollout files are written whole (temporary file, then rename).
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from memrl.errors import MemrlError
from memrl.io import atomic_write_json, atomic_write_text, jsonl_lines

LOGGER_NAME = "memrl"
REWARD_KEY = "reward/mean"
_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"

log = logging.getLogger(__name__)


def _json_safe(value: Any) -> Any:
    """A caller-built record as strict JSON: numbers (numpy, tensors too) as float/int, non-finite as None,
    anything else that is no number as its text."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(v) for v in value]
    if hasattr(value, "tolist") and getattr(value, "ndim", 0) > 0:  # numpy array / tensor
        return _json_safe(value.tolist())
    if value is None or isinstance(value, bool | str | int):
        return value
    try:
        number = float(value)  # float, numpy scalar, 0-d torch tensor
    except (TypeError, ValueError):
        return str(value)  # a Path, an enum
    return number if math.isfinite(number) else None


METRICS_FILE, EVAL_METRICS_FILE = "metrics.jsonl", "eval_metrics.jsonl"


class RunLogError(ValueError, MemrlError):
    """A run's metrics file that cannot be read back; the message names the file and the line."""


def read_metrics(run_root: str | Path, filename: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The records of RUN_ROOT/logs/`filename`, one per rollout id (its last line), sorted by id; a torn
    last line (a crash mid-write) is skipped, any other unreadable line is a RunLogError."""
    path = Path(run_root) / "logs" / filename
    if not path.is_file():
        return []

    def bad_line(number: int, err: Exception) -> RunLogError:
        return RunLogError(f"{path}:{number} is not valid JSON ({err}); fix or delete that line")

    by_rollout = {int(record["rollout_id"]): record for _, record in jsonl_lines(path, bad_line, torn_tail=True)}
    return [by_rollout[k] for k in sorted(by_rollout)]


def _is_number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


def metric_series(records: list[dict[str, Any]], key: str) -> list[tuple[int, float]]:
    """(rollout id, value) of each record whose `key` is a finite number."""
    return [(int(r["rollout_id"]), float(r[key])) for r in records
            if _is_number(r.get(key)) and math.isfinite(r[key])]


def reward_summary(records: list[dict[str, Any]], key: str = REWARD_KEY, window: int = 10) -> dict[str, Any]:
    """Per-rollout mean reward, the mean of the first / last `window` rollouts (over all of them when
    fewer), and the best rollout; rollouts without a finite `key` are left out."""
    rewards = metric_series(records, key)
    if not rewards:
        return {"num_rollouts": 0, "per_rollout": [], "first_10_mean": None, "last_10_mean": None, "best": None}
    values = [v for _, v in rewards]
    best_id, best_value = max(rewards, key=lambda item: item[1])
    return {
        "num_rollouts": len(rewards),
        "per_rollout": [{"rollout_id": i, "reward_mean": v} for i, v in rewards],
        "first_10_mean": sum(values[:window]) / len(values[:window]),
        "last_10_mean": sum(values[-window:]) / len(values[-window:]),
        "best": {"rollout_id": best_id, "reward_mean": best_value},
    }


class WandbLogger:
    """Metrics to Weights & Biases (`train.loggers` with wandb), one run per run root."""

    def __init__(self, run_root: Path, config: dict[str, Any] | None, project: str, name: str | None) -> None:
        from memrl.config import ConfigError

        try:
            import wandb
        except ImportError as error:  # the config checks this too; a broken install still ends here
            raise ConfigError(f"train.loggers includes wandb but it does not import ({error}); "
                              f"pip install 'memrl[wandb]', or drop wandb from train.loggers") from error
        id_file = run_root / "logs" / "wandb_run_id"
        run_id = id_file.read_text().strip() if id_file.is_file() else uuid.uuid4().hex[:12]
        atomic_write_text(id_file, run_id + "\n")
        self.run = wandb.init(project=project, name=name or run_root.resolve().name, id=run_id, resume="allow",
                              dir=str(run_root), config=config)

    def log(self, rollout_id: int, values: dict[str, float]) -> None:
        # W&B steps must not decrease and start at 0: step = rollout id + 1 (steps done), the same for a
        # step's metrics and the validation after it; a validation before training is step 0.
        self.run.log({**values, "rollout_id": rollout_id}, step=rollout_id + 1)

    def close(self) -> None:
        self.run.finish()


class RunLogger:
    """Writes every log of one run; use as a context manager or call `close()`. `config_dict` (dict or
    pydantic model) is saved as RUN_ROOT/config.yaml; `start_rollout_id`: a resume's first step."""

    def __init__(self, run_root: str | Path, config_dict: Any = None, use_tensorboard: bool = True,
                 start_rollout_id: int | None = None, loggers: Sequence[str] = ("tensorboard", "jsonl"),
                 project_name: str = "memrl", experiment_name: str | None = None) -> None:
        self.run_root = Path(run_root)
        self.logs_dir = self.run_root / "logs"
        self.rollouts_dir = self.logs_dir / "rollouts"
        self.metrics_path = self.logs_dir / METRICS_FILE
        self.rollouts_dir.mkdir(parents=True, exist_ok=True)
        config = config_dict.model_dump(mode="json") if hasattr(config_dict, "model_dump") else config_dict
        config = _json_safe(config)
        if config is not None:
            atomic_write_text(self.run_root / "config.yaml", yaml.safe_dump(config, sort_keys=False))
        self.jsonl = "jsonl" in loggers
        # File handler on the package logger, so every memrl module's records reach train.log.
        self._handler = logging.FileHandler(self.logs_dir / "train.log", encoding="utf-8")
        self._handler.setFormatter(logging.Formatter(_LOG_FORMAT))
        package_logger = logging.getLogger(LOGGER_NAME)
        package_logger.addHandler(self._handler)
        if package_logger.level == logging.NOTSET or package_logger.level > logging.INFO:
            package_logger.setLevel(logging.INFO)
        if start_rollout_id is not None:
            self._drop_metrics_from(start_rollout_id, METRICS_FILE)
            self._drop_metrics_from(start_rollout_id, EVAL_METRICS_FILE)
        if self.jsonl:
            self.metrics_path.touch()
        self._writer = None
        if use_tensorboard and "tensorboard" in loggers:
            from torch.utils.tensorboard import SummaryWriter

            # purge_step hides events of steps >= start_rollout_id written by the interrupted run.
            self._writer = SummaryWriter(log_dir=str(self.run_root / "tensorboard"), purge_step=start_rollout_id)
        self._wandb = None
        if "wandb" in loggers:
            try:
                self._wandb = WandbLogger(self.run_root, config, project_name, experiment_name)
            except BaseException:
                self.close()
                raise

    def _drop_metrics_from(self, start_rollout_id: int, filename: str) -> None:
        path = self.logs_dir / filename
        if not path.is_file():
            return
        kept = [r for r in read_metrics(self.run_root, filename) if int(r["rollout_id"]) < start_rollout_id]
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in kept))

    def log_metrics(self, rollout_id: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """One step's metrics: a line of metrics.jsonl and the numbers as scalars; returns the line."""
        return self._log(METRICS_FILE, rollout_id, metrics, f"rollout {rollout_id}")

    def log_eval(self, rollout_id: int, metrics: dict[str, Any]) -> dict[str, Any]:
        """One validation's metrics (`eval/<set>/<metric>`), as `log_metrics` does in eval_metrics.jsonl."""
        return self._log(EVAL_METRICS_FILE, rollout_id, metrics, f"validation after rollout {rollout_id}")

    def _log(self, filename: str, rollout_id: int, metrics: dict[str, Any], label: str) -> dict[str, Any]:
        """A line appended whole (flushed and fsynced), then the scalars at step `rollout_id`."""
        record = {"rollout_id": int(rollout_id), **{str(k): _json_safe(v) for k, v in metrics.items()}}
        if self.jsonl:
            with open(self.logs_dir / filename, "a", encoding="utf-8") as f:
                f.write(json.dumps(record) + "\n")
                f.flush()
                os.fsync(f.fileno())
        self._scalars(rollout_id, record, label)
        return record

    def _scalars(self, rollout_id: int, record: dict[str, Any], label: str) -> None:
        """The finite numbers of a record to TensorBoard (at step `rollout_id`), W&B and train.log."""
        numeric = {k: v for k, v in record.items() if k != "rollout_id" and _is_number(v)}
        if self._writer is not None:
            for key, value in numeric.items():
                self._writer.add_scalar(key, value, global_step=int(rollout_id))
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log(int(rollout_id), numeric)
        logging.getLogger(LOGGER_NAME).info("%s: %s", label, " ".join(f"{k}={v:.4g}" for k, v in numeric.items()))

    def log_rollout(self, rollout_id: int, records: list[dict[str, Any]]) -> Path:
        """Write the trajectory records of one rollout step to rollouts/rollout_XXXXXXX.jsonl (whole)."""
        path = self.rollouts_dir / f"rollout_{int(rollout_id):07d}.jsonl"
        atomic_write_text(path, "".join(json.dumps(_json_safe(r), ensure_ascii=False) + "\n" for r in records))
        return path

    def write_reward_summary(self) -> Path | None:
        """RUN_ROOT/reward_summary.json from metrics.jsonl (None without the jsonl logger)."""
        if not self.jsonl:
            return None
        return atomic_write_json(self.run_root / "reward_summary.json", reward_summary(read_metrics(self.run_root)))

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.close()
            self._wandb = None
        logging.getLogger(LOGGER_NAME).removeHandler(self._handler)
        self._handler.close()

    def __enter__(self) -> RunLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


_PROCESS = None  # one psutil.Process, so cpu_percent measures the time since the previous call


def device_stats() -> dict[str, float]:
    """GPU memory (GB) and utilization (%) when CUDA is present; process CPU % and resident memory (GB)."""
    import psutil
    import torch

    global _PROCESS
    stats: dict[str, float] = {}
    if torch.cuda.is_available():
        gb = 1024**3
        stats["device/gpu_memory_allocated_gb"] = torch.cuda.memory_allocated() / gb
        stats["device/gpu_memory_max_allocated_gb"] = torch.cuda.max_memory_allocated() / gb
        stats["device/gpu_memory_reserved_gb"] = torch.cuda.memory_reserved() / gb
        try:  # needs pynvml / amdsmi; absent on some installs
            stats["device/gpu_utilization"] = float(torch.cuda.utilization())
        except Exception:  # any failure just means "not available"
            pass
    if _PROCESS is None:
        _PROCESS = psutil.Process()
    stats["device/cpu_percent"] = float(_PROCESS.cpu_percent(interval=None))
    stats["device/rss_gb"] = _PROCESS.memory_info().rss / 1024**3
    return stats


class StageTimer:
    """Wall-clock seconds per named stage (`with timer("rollout"): ...`); repeated stages add up."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = {}

    @contextmanager
    def __call__(self, stage: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:  # a failed stage still reports how long it ran
            self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        return {f"time/{stage}_s": seconds for stage, seconds in self.seconds.items()}
