"""Validation during training (`train.eval_interval`, `train.eval_before_train`) and the best checkpoint.

Each eval set (`eval.sets`, or `data.heldout_file` + `data.eval_files`) runs through `memrl eval`'s runner
and the run's task on the training engine, which holds the weights of the step just trained. Sample 0 is
exactly what `memrl eval` of that step's checkpoint computes (same per-question seeds); sample s uses
`sampling.seed + s`. Per-request generators: validating never changes the training run's randomness.

    RUN_ROOT/eval/<set>/<iter_XXXXXXX | initial>/[sample_S/]   results.jsonl, summary.json, eval_run.json
    RUN_ROOT/logs/eval_metrics.jsonl                          one line per validation: eval/<set>/<metric>

A validation is named by the last step trained (`initial` before step 0); an earlier attempt's folder at
the same step (a run resumed from an older checkpoint) is removed first, never mixed in.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from memrl.config import Config, EvalSetConfig
from memrl.data.manifest import sha256_file
from memrl.data.records import QuestionRecord
from memrl.engines.base import Engine
from memrl.eval.results import METRICS
from memrl.eval.runner import evaluate_records, load_eval_data
from memrl.task import Task
from memrl.train.checkpoint import checkpoint_name
from memrl.train.setup import TrainingError

EVAL_DIR = "eval"
HELDOUT_SET = "heldout"


def eval_set_configs(cfg: Config) -> list[EvalSetConfig]:
    if cfg.eval.sets:
        return list(cfg.eval.sets)
    sets = [EvalSetConfig(name=HELDOUT_SET, file=cfg.data.heldout_file)]
    sets += [EvalSetConfig(name=Path(f).stem, file=f) for f in cfg.data.eval_files]
    names = [s.name for s in sets]
    if len(set(names)) != len(names):
        raise TrainingError(f"the validation sets of data.heldout_file and data.eval_files share a name ({names}); "
                            f"name them in eval.sets")
    return sets


def set_config(cfg: Config, spec: EvalSetConfig, sample: int) -> Config:
    """The run's config with a set's own settings: what the runner reads (sampling.*, task.*, eval.limit)."""
    sampling = {"seed": cfg.sampling.seed + sample}
    if spec.temperature is not None:
        sampling["temperature"] = spec.temperature
    return cfg.model_copy(update={"sampling": cfg.sampling.model_copy(update=sampling),
                                  "task": cfg.task_with(spec.task)})


@dataclass
class EvalSet:
    spec: EvalSetConfig
    path: Path
    records: list[QuestionRecord]
    sha256: str


def validation_name(rollout_id: int) -> str:
    return "initial" if rollout_id < 0 else checkpoint_name(rollout_id)


class Validator:
    """Loads the eval sets once (a missing file fails the run before its first step) and validates."""

    def __init__(self, cfg: Config, run_root: Path, tokenizer: Any, task: Task, progress: bool = False) -> None:
        self.cfg, self.run_root, self.tokenizer = cfg, Path(run_root), tokenizer
        self.task, self.progress = task, progress
        self.sets = [self._load(spec) for spec in eval_set_configs(cfg)]

    def _load(self, spec: EvalSetConfig) -> EvalSet:
        path = Path(spec.file)
        if not path.is_absolute():
            if not self.cfg.data.dir:
                raise TrainingError(f"validation set {spec.name!r}: its file {spec.file} is relative to data.dir, "
                                    f"which is not set; set data.dir or give an absolute path")
            path = Path(self.cfg.data.dir) / path
        if not path.is_file():
            raise TrainingError(f"validation set {spec.name!r}: {path} does not exist; prepare it (memrl prepare-data) "
                                f"or fix eval.sets / data.heldout_file")
        records = load_eval_data(path, verify=self.cfg.data.verify_manifest)
        limit = spec.limit if spec.limit is not None else self.cfg.eval.limit
        return EvalSet(spec, path, records[:limit] if limit is not None else records, sha256_file(path))

    def validate(self, rollout_id: int, engine: Engine,
                 run: Callable[[Coroutine[Any, Any, dict[str, Any]]], dict[str, Any]]) -> dict[str, float]:
        """Every set on `engine` (`run` drives a coroutine on its event loop): `eval/<set>/<metric>` (percent,
        mean over samples) and `eval/<set>/failed` (questions)."""
        metrics: dict[str, float] = {}
        for eval_set in self.sets:
            name, step = eval_set.spec.name, validation_name(rollout_id)
            folder = self.run_root / EVAL_DIR / name / step
            if folder.exists():  # an earlier attempt at this step: start over, never mix two runs' lines
                shutil.rmtree(folder)
            summaries = []
            for sample in range(eval_set.spec.samples):
                out = folder / f"sample_{sample}" if eval_set.spec.samples > 1 else folder
                summaries.append(run(evaluate_records(
                    engine, self.tokenizer, set_config(self.cfg, eval_set.spec, sample), eval_set.records, out,
                    model_name=f"{self.run_root.resolve()}:{step}",
                    data_sha256=eval_set.sha256, data_path=str(eval_set.path), progress=self.progress, task=self.task)))
            for metric in METRICS:
                values = [s["metrics"][metric]["value"] for s in summaries]
                metrics[f"{EVAL_DIR}/{name}/{metric}"] = sum(values) / len(values)
            metrics[f"{EVAL_DIR}/{name}/failed"] = float(sum(s["failed"] for s in summaries))
        return metrics


class BestTracker:
    """The best `train.keep_best` value so far and whether a new one beats it (ties do not)."""

    def __init__(self, metric: str, mode: str, best: float | None = None) -> None:
        self.metric, self.mode, self.best = metric, mode, best

    def improves(self, metrics: dict[str, float]) -> bool:
        value = metrics.get(self.metric)
        if value is None:
            raise TrainingError(f"train.keep_best = {self.metric!r} is not among the validation metrics "
                                f"({', '.join(sorted(metrics))})")
        if self.best is None:
            return True
        return value > self.best if self.mode == "max" else value < self.best
