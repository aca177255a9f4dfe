"""`memrl demo-consistency`: two training paths agree, the 3 pp consistency test (docs/multinode.md).

From `memrl demo`'s warm start, done once, its GRPO three ways: `local`, `ray` and `local-seed2` (local with
other seeds: the yardstick, since two paths agreeing within 3 pp mean little if two seeds of one path
differ by 10). Every policy is evaluated alike and every pair compared.
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from memrl.apps.demo import (
    FULL,
    QUICK,
    DemoError,
    DemoSettings,
    WarmStart,
    demo_config,
    grpo_records,
    new_run_root,
    quiet_demo,
    reward_curve,
    warm_start,
)
from memrl.config import Config
from memrl.io import atomic_write_json

RUNS = ("local", "ray", "local-seed2")
CHECKED_PAIR = ("local", "ray")
# Keys each run's path sets itself: an override of one would silently change what a run is.
PATH_KEYS = ("train.runtime", "train.dp_size", "train.pad_to_dp", "train.max_staleness", "train.eval_interval",
             "train.eval_before_train", "ray.num_rollout_workers", "ray.backend", "ray.trainer_num_gpus",
             "ray.rollout_num_gpus", "model.lora")


@dataclass(frozen=True)
class ConsistencySettings:
    """One `memrl demo-consistency` run: the demo's sizes and GRPO recipe (`demo`), the Ray path's shape,
    the yardstick's seed and the thresholds checked on local vs ray (percentage points)."""

    demo: DemoSettings = replace(FULL, eval_interval=0)  # validation during training is local-only
    rollout_workers: int = 2
    trainer_workers: int = 2
    max_staleness: int = 1
    seed_offset: int = 1  # local-seed2 trains with train.seed and sampling.seed this much above local's
    thresholds: tuple[tuple[str, float], ...] = (("sub_em", 3.0),)


CONSISTENCY_FULL = ConsistencySettings()
CONSISTENCY_QUICK = ConsistencySettings(demo=replace(QUICK, eval_interval=0))


def run_configs(settings: ConsistencySettings) -> dict[str, Config]:
    """The three runs' recipes (each is the demo's recipe plus the keys of its path); bad input is a DemoError
    (or the recipe's ConfigError), raised before any work."""
    bad = sorted({o.partition("=")[0].strip() for o in settings.demo.overrides} & set(PATH_KEYS))
    if bad:
        raise DemoError(f"--set {', '.join(bad)}: demo-consistency sets these for each run itself "
                        f"(local, ray, local-seed2); leave them out")
    if settings.demo.eval_interval:
        raise DemoError("demo-consistency trains on Ray and overlapped, where validation during training is refused; "
                        "use eval_interval = 0")
    if min(settings.rollout_workers, settings.trainer_workers) < 1 or settings.max_staleness < 0:
        raise DemoError(f"the Ray path needs >= 1 rollout and trainer worker and max_staleness >= 0, got "
                        f"{settings.rollout_workers}, {settings.trainer_workers}, {settings.max_staleness}")

    def config(*path: str) -> Config:
        return demo_config(replace(settings.demo, overrides=(*settings.demo.overrides, *path)))

    local = config("train.max_staleness=0")
    if settings.seed_offset == 0:
        raise DemoError("--seed-offset 0 would train local-seed2 exactly as local; pass a non-zero offset")
    # pad_to_dp: a step's row count (1-3 chunks a document) need not divide by the ranks; padding rows carry
    # no loss. No GPUs and gloo: the same CPU numerics as the one-process runs, on any machine.
    ray = config("train.runtime=ray", f"train.dp_size={settings.trainer_workers}", "train.pad_to_dp=true",
                 f"train.max_staleness={settings.max_staleness}", f"ray.num_rollout_workers={settings.rollout_workers}",
                 "ray.backend=gloo", "ray.trainer_num_gpus=0", "ray.rollout_num_gpus=0")
    # Both seeds: with train.seed alone the run is local's, sample for sample (measured), as long as GRPO
    # does not pass over its questions twice; sampling.seed draws every sample. Evaluation is unaffected: every
    # policy is evaluated with local's recipe.
    seed2 = config("train.max_staleness=0", f"train.seed={local.train.seed + settings.seed_offset}",
                   f"sampling.seed={local.sampling.seed + settings.seed_offset}")
    return {"local": local, "ray": ray, "local-seed2": seed2}


def describe(cfg: Config) -> str:
    """A run's training path in words."""
    t = cfg.train
    if t.runtime == "ray":
        return (f"Ray: {cfg.ray.num_rollout_workers} rollout workers, {t.dp_size} DDP ranks ({cfg.ray.backend}), "
                f"max_staleness {t.max_staleness}, seeds {t.seed}/{cfg.sampling.seed}")
    sync = "synchronous" if t.max_staleness == 0 else f"max_staleness {t.max_staleness}"
    return f"1 process, {sync}, seeds {t.seed}/{cfg.sampling.seed}"


def _weights_distance(a: dict[str, Any], b: dict[str, Any]) -> float:
    """||a - b|| / ||b|| over all float tensors: how far a run moved (or how far two runs ended apart)."""
    num = sum(float((a[k].float() - v.float()).pow(2).sum()) for k, v in b.items() if v.is_floating_point())
    den = sum(float(v.float().pow(2).sum()) for v in b.values() if v.is_floating_point())
    return math.sqrt(num / den) if den else 0.0


def _metrics(summary: dict[str, Any]) -> dict[str, dict[str, Any]]:
    m = summary["metrics"]
    return {name: {"value": m[name]["value"], "ci95": [m[name]["low"], m[name]["high"]]}
            for name in ("em", "sub_em", "f1")}


def _train(cfg: Config, run_dir: Path, base: WarmStart, records: Sequence[Any], progress: bool) -> list[dict]:
    from memrl.distributed.runtime import run_ray_training
    from memrl.train.controller import Trainer, TrainOptions

    options = TrainOptions(run_root=run_dir, progress=progress)
    kwargs = {"model": copy.deepcopy(base.model), "tokenizer": base.tokenizer, "records": records}
    if cfg.train.runtime == "ray":
        # Starts a local Ray sized for the workers (4 single-CPU actors; Ray counts logical CPUs, so this
        # schedules on 2 cores) and shuts it down; Ray gives each actor OMP_NUM_THREADS = its CPUs (1) when unset.
        return run_ray_training(cfg, options, **kwargs)
    return Trainer(cfg, options, **kwargs).run()


def run_consistency(run_root: Path, settings: ConsistencySettings = CONSISTENCY_FULL,
                    progress: bool = True) -> dict[str, Any]:
    """Warm start once, train local / ray / local-seed2 from that base, evaluate and compare; returns the
    summary (also RUN_ROOT/consistency_summary.json)."""
    from memrl.eval.compare import compare_results

    configs = run_configs(settings)
    grpo_records(settings.demo, range(settings.demo.num_train))  # too few GRPO questions: refused before the warm start
    run_root = new_run_root(run_root)
    atomic_write_json(run_root / "consistency_settings.json", asdict(settings))
    started = time.perf_counter()
    times: dict[str, float] = {}
    base = warm_start(run_root, settings.demo, demo_config(settings.demo, data_dir=run_root / "data"), progress)
    times["data+sft_s"] = base.seconds
    records = grpo_records(settings.demo, base.train)
    eval_cfg = configs["local"]  # one evaluation recipe for every policy (the format keys compare checks)
    base_eval = _evaluate(base, eval_cfg, base.model, run_root / "eval_base", "base", times)
    base_weights = {k: v.detach().clone() for k, v in base.model.state_dict().items()}
    runs: dict[str, dict[str, Any]] = {}
    weights: dict[str, dict[str, Any]] = {}
    for name in RUNS:
        runs[name], weights[name] = _train_and_evaluate(name, configs[name], eval_cfg, run_root, base, records,
                                                        times, progress)
        runs[name]["weights_moved_from_base"] = _weights_distance(weights[name], base_weights)
    report = compare_results([run_root / name / "eval" for name in RUNS], names=list(RUNS),
                             max_abs_diff=dict(settings.thresholds), pairs=[CHECKED_PAIR])
    report.write(run_root / "compare")
    summary = {
        "settings": asdict(settings),
        "heldout_questions": len(base.heldout),
        "grpo_questions": len(records),
        "base": _metrics(base_eval),
        "runs": runs,
        "pairs": [_pair(p, weights) for p in report.pairs],
        "thresholds": [{"pair": [c.a, c.b], "metric": c.metric, "abs_diff_pp": c.diff, "limit_pp": c.limit,
                        "passed": c.passed} for c in report.checks],
        "passed": report.passed,
        "paths": {"compare": "compare/report.md", "eval_base": "eval_base",
                  **{name: {"train": f"{name}/train", "eval": f"{name}/eval"} for name in RUNS}},
        "times_s": {**{k: round(v, 1) for k, v in times.items()}, "total_s": round(time.perf_counter() - started, 1)},
    }
    atomic_write_json(run_root / "consistency_summary.json", summary)
    return summary


def _evaluate(base: WarmStart, cfg: Config, model: Any, out: Path, name: str,
              times: dict[str, float]) -> dict[str, Any]:
    """Every policy evaluated alike: the base's held-out questions and data identity, one recipe; timed."""
    t = time.perf_counter()
    result = base.evaluate(model, cfg, out, name)
    times[f"eval_{name}_s"] = time.perf_counter() - t
    return result


def _train_and_evaluate(name: str, cfg: Config, eval_cfg: Config, run_root: Path, base: WarmStart,
                        records: Sequence[Any], times: dict[str, float],
                        progress: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    """One run: trained from a copy of the base, its last checkpoint loaded into another copy and evaluated;
    returns its summary entry and its trained weights."""
    from memrl.train.checkpoint import load_checkpoint

    t = time.perf_counter()
    history = _train(cfg, run_root / name / "train", base, records, progress)
    times[f"train_{name}_s"] = time.perf_counter() - t
    model = copy.deepcopy(base.model)
    load_checkpoint(run_root / name / "train", model, restore_rng=False)
    model.eval()
    result = _evaluate(base, eval_cfg, model, run_root / name / "eval", name, times)
    run = {
        "path": describe(cfg), "runtime": cfg.train.runtime,
        "rollout_workers": cfg.ray.num_rollout_workers if cfg.train.runtime == "ray" else 1,
        "trainer_ranks": cfg.train.dp_size, "max_staleness": cfg.train.max_staleness, "train_seed": cfg.train.seed,
        "rollout_seed": cfg.sampling.seed,
        "steps": len(history),
        # the staleness each step trained at, as logged (0 synchronous; 1 from the second step when overlapped)
        "staleness_per_step": [float(m.get("pipeline/staleness", 0.0)) for m in history],
        **_metrics(result),
        "reward": reward_curve(history),
    }
    return run, model.state_dict()


def _pair(p: Any, weights: dict[str, dict[str, Any]]) -> dict[str, Any]:
    return {"a": p.a, "b": p.b, "em_diff_pp": p.diffs["em"], "sub_em_diff_pp": p.diffs["sub_em"],
            "f1_diff_pp": p.diffs["f1"], "wrong_to_right": len(p.wrong_to_right),
            "right_to_wrong": len(p.right_to_wrong), "mcnemar_p": p.mcnemar_p,
            "weights_distance": _weights_distance(weights[p.b], weights[p.a])}


def verdict(checks: Sequence[dict[str, Any]]) -> int:
    """The command's exit code: 0 when every threshold on local vs ray passes, 1 when one fails."""
    return 0 if all(c["passed"] for c in checks) else 1


def format_summary(summary: dict[str, Any], run_root: Path) -> str:
    def cell(m: dict[str, Any]) -> str:
        return f"{m['value']:5.1f} [{m['ci95'][0]:4.1f}, {m['ci95'][1]:4.1f}]"

    b, runs = summary["base"], summary["runs"]
    lines = ["", f"memrl demo-consistency: one warm-started base trained three ways; {summary['heldout_questions']} "
             "held-out questions, temperature 1.0, the same per-question seeds for every policy", "",
             "| run | training path | boxed EM % [95% CI] | sub_EM % [95% CI] | weights moved |",
             "|---|---|---|---|---:|",
             f"| base | warm start (no GRPO) | {cell(b['em'])} | {cell(b['sub_em'])} | |"]
    lines += [f"| {name} | {r['path']} | {cell(r['em'])} | {cell(r['sub_em'])} | {r['weights_moved_from_base']:.4f} |"
              for name, r in runs.items()]
    lines += ["", "| pair | sub_EM diff pp | EM diff pp | EM flips w->r / r->w | McNemar p | weights apart |",
              "|---|---:|---:|---|---:|---:|"]
    lines += [f"| {p['b']} - {p['a']} | {p['sub_em_diff_pp']:+.1f} | {p['em_diff_pp']:+.1f} | "
              f"{p['wrong_to_right']} / {p['right_to_wrong']} | {p['mcnemar_p']:.2g} | {p['weights_distance']:.4f} |"
              for p in summary["pairs"]]
    lines.append("")
    for c in summary["thresholds"]:
        a, bb = c["pair"]
        lines.append(f"threshold {'passed' if c['passed'] else 'FAILED'}: |{c['metric']}({bb}) - {c['metric']}({a})| = "
                     f"{c['abs_diff_pp']:.1f} pp (limit {c['limit_pp']:g} pp)")
    seed_pair = next((p for p in summary["pairs"] if {p["a"], p["b"]} == {"local", "local-seed2"}), None)
    if seed_pair:
        lines.append(f"yardstick: two seeds of the local path differ by "
                     f"{abs(seed_pair['sub_em_diff_pp']):.1f} pp sub_EM, "
                     f"{abs(seed_pair['em_diff_pp']):.1f} pp EM")
    ts = summary["times_s"]
    stages = ", ".join(f"{k.removesuffix('_s')} {v / 60:.1f}" for k, v in ts.items() if k != "total_s")
    lines += ["", f"time: {ts['total_s'] / 60:.1f} min (minutes: {stages}). Results in {run_root}: "
              "compare/report.md, consistency_summary.json, <run>/train, <run>/eval"]
    return "\n".join(lines)


def demo_consistency_command(run_root: Path, quick: bool = False, overrides: Sequence[str] = (),
                             seed_offset: int = 1, max_abs_diff: Sequence[str] = ()) -> int:
    """`memrl demo-consistency`: 0 when local and ray agree within the thresholds (default sub_EM 3 pp),
    else 1; a `DemoError` / `ConfigError` / `CompareError` is exit 2 in memrl.cli."""
    from memrl.eval.compare import parse_thresholds
    from memrl.eval.results import METRICS

    quiet_demo()
    base = CONSISTENCY_QUICK if quick else CONSISTENCY_FULL
    thresholds = parse_thresholds(list(max_abs_diff)) if max_abs_diff else dict(base.thresholds)
    unknown = sorted(set(thresholds) - set(METRICS))
    if unknown:
        raise DemoError(f"--max-abs-diff {', '.join(unknown)}: unknown metric; use {', '.join(METRICS)}")
    settings = replace(base, demo=replace(base.demo, overrides=tuple(overrides)), seed_offset=seed_offset,
                       thresholds=tuple(thresholds.items()))
    summary = run_consistency(Path(run_root), settings)
    print(format_summary(summary, Path(run_root)))
    return verdict(summary["thresholds"])
