"""`memrl report RUN_ROOT`: PNG plots and a Markdown summary of a run, from RUN_ROOT/logs/metrics.jsonl.

Writes RUN_ROOT/report/*.png (one per metric family logged, one per validation set) and report.md;
points logged as null (non-finite) are left out. Plots use matplotlib's object API (no pyplot), so no
global backend is switched in the caller's process.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from memrl.errors import MemrlError
from memrl.eval.results import METRICS as EVAL_METRICS
from memrl.io import atomic_save_figure, atomic_write_text
from memrl.train.run_log import EVAL_METRICS_FILE, REWARD_KEY, metric_series, read_metrics, reward_summary

# (file stem, title, y label, metric keys drawn as lines on one plot)
PLOTS: list[tuple[str, str, str, list[str]]] = [
    ("kl", "KL to the reference", "KL", ["kl/mean"]),
    ("logprob_gap", "Rollout vs trainer log-prob gap", "mean |gap|", ["logprob_gap/mean_abs"]),
    ("response_length", "Response length", "tokens",
     ["response_length/memory_mean", "response_length/final_mean"]),
    ("loss", "Loss", "loss", ["loss/policy", "loss/total"]),
    ("grad_norm", "Gradient norm", "norm", ["grad_norm"]),
    ("entropy", "Entropy", "nats", ["entropy/mean"]),
    ("lr", "Learning rate", "lr", ["lr"]),
    ("truncation", "Memory truncation rate", "fraction", ["truncation/memory_rate"]),
    ("throughput", "Throughput", "tokens / s", ["perf/tokens_per_s"]),
]
ROW_KEYS = ["rows/saved", "rows/transferred", "rows/consumed"]
MOVING_AVERAGE_WINDOW = 10


class ReportError(RuntimeError, MemrlError):
    """No metrics to report on; the message says where they were looked for."""


def _series(records: list[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    points = metric_series(records, key)
    return [x for x, _ in points], [y for _, y in points]


def moving_average(values: list[float], window: int) -> list[float]:
    """Trailing mean over up to `window` values (shorter at the start, so it has one value per input)."""
    out, total = [], 0.0
    for i, value in enumerate(values):
        total += value
        if i >= window:
            total -= values[i - window]
        out.append(total / min(i + 1, window))
    return out


def _save_plot(path: Path, title: str, ylabel: str, lines: list[tuple[str, list[int], list[float], dict]]) -> Path:
    fig = Figure(figsize=(7, 4), dpi=100)
    ax = fig.add_subplot()
    for label, xs, ys, style in lines:
        ax.plot(xs, ys, label=label, **style)
    ax.set_title(title)
    ax.set_xlabel("rollout id")
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    return atomic_save_figure(path, fig)


def _plot_keys(path: Path, title: str, ylabel: str, records: list[dict[str, Any]], keys: list[str],
               style: dict, prefix: str = "") -> Path | None:
    """One line per key that has points (labelled without `prefix`); no plot when none has."""
    lines = [(key.removeprefix(prefix), *_series(records, key), style) for key in keys]
    lines = [line for line in lines if line[1]]
    return _save_plot(path, title, ylabel, lines) if lines else None


def _plot_reward(records: list[dict[str, Any]], out_dir: Path) -> Path | None:
    xs, ys = _series(records, REWARD_KEY)
    if not xs:
        return None
    window = min(MOVING_AVERAGE_WINDOW, len(ys))
    return _save_plot(out_dir / "reward.png", "Training reward", "mean reward", [
        ("reward/mean", xs, ys, {"marker": ".", "alpha": 0.5}),
        (f"moving average ({window})", xs, moving_average(ys, window), {"linewidth": 2}),
    ])


def _eval_sets(evals: list[dict[str, Any]]) -> list[str]:
    """Validation set names, in order of first appearance (keys `eval/<set>/<metric>`)."""
    return list(dict.fromkeys(k.split("/")[1] for r in evals for k in r if k.startswith("eval/") and k.count("/") == 2))


def _eval_lines(evals: list[dict[str, Any]]) -> list[str]:
    """Per set: the last validation's scores and the best EM (with its rollout id)."""
    lines = []
    for name in _eval_sets(evals):
        points = metric_series(evals, f"eval/{name}/em")
        if not points:
            continue
        last = next(r for r in reversed(evals) if f"eval/{name}/em" in r)
        best_x, best_em = max(points, key=lambda p: p[1])
        scores = ", ".join(f"{m} {_fmt(last.get(f'eval/{name}/{m}'))}" for m in EVAL_METRICS)
        lines.append(f"- Validation `{name}` after rollout {last['rollout_id']}: {scores}; best EM {_fmt(best_em)} "
                     f"(rollout {best_x}; {len(points)} validations)")
    return lines


def _fmt(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.4f}"


def _markdown(run_root: Path, records: list[dict[str, Any]], plots: list[Path],
              evals: list[dict[str, Any]]) -> str:
    summary = reward_summary(records)
    ids = [int(r["rollout_id"]) for r in records]
    lines = [
        f"# Run report: {run_root.resolve().name}",
        "",
        f"- Run root: `{run_root.resolve()}`",
        f"- Rollout steps logged: {len(records)} (rollout ids {min(ids)}..{max(ids)})",
        f"- Reward, mean of first 10 rollouts: {_fmt(summary['first_10_mean'])}",
        f"- Reward, mean of last 10 rollouts: {_fmt(summary['last_10_mean'])}",
    ]
    if summary["best"] is not None:
        best = summary["best"]
        lines.append(f"- Best rollout reward: {_fmt(best['reward_mean'])} (rollout {best['rollout_id']})")
    totals = {key: sum(values) for key in ROW_KEYS if (values := _series(records, key)[1])}
    lines += [f"- Total {key}: {total:g}" for key, total in totals.items()]
    # Every saved row must be trained on exactly once; a difference means rows were lost or duplicated.
    if {"rows/saved", "rows/consumed"} <= totals.keys() and totals["rows/saved"] != totals["rows/consumed"]:
        lines.append(f"- **Warning:** rows saved ({totals['rows/saved']:g}) != rows consumed "
                     f"({totals['rows/consumed']:g})")
    lines += _eval_lines(evals)
    lines += ["", "## Plots", ""]
    lines += [f"### {p.stem}\n\n![{p.stem}]({p.name})\n" for p in plots]
    return "\n".join(lines) + "\n"


def write_report(run_root: str | Path) -> list[Path]:
    """Write RUN_ROOT/report/{*.png, report.md}; returns the files written (PNGs, then report.md)."""
    run_root = Path(run_root)
    metrics_path = run_root / "logs" / "metrics.jsonl"
    if not metrics_path.is_file():
        raise ReportError(f"no metrics at {metrics_path}; pass the run root of a training run (the folder "
                          "holding logs/metrics.jsonl)")
    records = read_metrics(run_root)
    if not records:
        raise ReportError(f"{metrics_path} holds no rollout steps yet; report after the first step is logged")
    out_dir = run_root / "report"
    out_dir.mkdir(parents=True, exist_ok=True)

    evals = read_metrics(run_root, EVAL_METRICS_FILE)
    stage_keys = sorted({k for r in records for k in r if k.startswith("time/")})
    plots = [_plot_reward(records, out_dir),
             *(_plot_keys(out_dir / f"{stem}.png", title, ylabel, records, keys, {"marker": "."})
               for stem, title, ylabel, keys in PLOTS),
             _plot_keys(out_dir / "stage_time.png", "Time per stage", "seconds", records, stage_keys, {}),
             *(_plot_keys(out_dir / f"eval_{name}.png", f"Validation: {name}", "percent", evals,
                          [f"eval/{name}/{metric}" for metric in EVAL_METRICS], {"marker": "o"}, f"eval/{name}/")
               for name in _eval_sets(evals))]
    plots = [p for p in plots if p is not None]
    report_md = out_dir / "report.md"
    atomic_write_text(report_md, _markdown(run_root, records, plots, evals))
    return [*plots, report_md]

