"""`memrl compare` (docs/design.md §7): `memrl eval` folders, checked to be comparable (a `CompareError`
names every problem at once; `allow_diff` accepts named format keys), then compared: metrics with 95%
intervals, EM flips with their exact McNemar p, `--max-abs-diff` thresholds on pairs.
"""

from __future__ import annotations

import itertools
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from memrl.errors import MemrlError
from memrl.eval.results import METRICS, RESULTS_FILE, SUMMARY_FILE, EvalError, read_results, summarize_lines
from memrl.eval.stats import format_interval, mcnemar_p
from memrl.io import atomic_save_figure, atomic_write_json, atomic_write_text

METRIC_LABELS = {"em": "EM", "sub_em": "sub_EM", "f1": "F1"}
_TOLERANCE = 1e-9  # percentage points; keeps 3.0000000001 (float noise) from failing a 3 pp threshold
_COUNTS = ("total", "succeeded", "failed", "missing_boxes")


class CompareError(ValueError, MemrlError):
    """Result sets that must not be compared; the message names every difference found."""


@dataclass
class ResultSet:
    name: str
    path: Path
    summary: dict[str, Any]
    lines: dict[str, dict[str, Any]]
    stats: dict[str, Any]  # summarize_lines over `lines`, the numbers every table shows


@dataclass
class PairResult:
    a: str
    b: str
    diffs: dict[str, float]  # b - a, percentage points
    wrong_to_right: list[str]  # EM 0 under a, 1 under b
    right_to_wrong: list[str]
    both_right: int
    both_wrong: int
    mcnemar_p: float


@dataclass
class ThresholdCheck:
    a: str
    b: str
    metric: str
    diff: float  # abs difference, pp
    limit: float

    @property
    def passed(self) -> bool:
        return self.diff <= self.limit + _TOLERANCE


@dataclass
class CompareReport:
    results: list[ResultSet]
    pairs: list[PairResult]
    checks: list[ThresholdCheck]
    allowed_diffs: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(c.passed for c in self.checks)

    def metrics_table(self) -> str:
        head = ["result", "total", "succeeded", "failed", "missing boxes",
                *(f"{METRIC_LABELS[m]} % [95% CI]" for m in METRICS)]
        rows = [[r.name, *(r.stats[k] for k in _COUNTS),
                 *(format_interval(r.stats["metrics"][m]) for m in METRICS)] for r in self.results]
        return _table(head, rows)

    def pair_text(self, p: PairResult, max_ids: int | None) -> str:
        def ids(xs: list[str]) -> str:
            shown = xs if max_ids is None else xs[:max_ids]
            return ", ".join(shown) + (f", ... ({len(xs) - len(shown)} more)" if len(shown) < len(xs) else "")

        by_name = {r.name: r for r in self.results}
        rows = [[METRIC_LABELS[m], *(f"{by_name[n].stats['metrics'][m]['value']:.2f}" for n in (p.a, p.b)),
                 f"{p.diffs[m]:+.2f}"] for m in METRICS]
        flips = (f"EM flips: {len(p.wrong_to_right)} wrong->right, {len(p.right_to_wrong)} right->wrong, "
                 f"{p.both_right} both right, {p.both_wrong} both wrong; exact McNemar p = {p.mcnemar_p:.4g}")
        lines = [_table(["metric", p.a, p.b, f"{p.b} - {p.a} (pp)"], rows), "", flips]
        if p.wrong_to_right:
            lines.append(f"- wrong->right: {ids(p.wrong_to_right)}")
        if p.right_to_wrong:
            lines.append(f"- right->wrong: {ids(p.right_to_wrong)}")
        return "\n".join(lines)

    def checks_table(self) -> str:
        return _table(["pair", "metric", "abs diff (pp)", "limit (pp)", "result"],
                      [[f"{c.a}, {c.b}", METRIC_LABELS[c.metric], f"{c.diff:.2f}", f"{c.limit:g}",
                        "pass" if c.passed else "FAIL"] for c in self.checks])

    def to_text(self, max_ids: int | None = 10) -> str:
        first = self.results[0].summary
        parts = ["# memrl compare", "",
                 f"Data: {first['data'].get('path')} (SHA-256 {first['data']['sha256']}), "
                 f"{self.results[0].stats['total']} questions, identical in every result set.", "",
                 "Results: " + ", ".join(f"{r.name} = {r.path} (model {r.summary.get('model')})" for r in self.results),
                 "", "## Metrics", "", self.metrics_table()]
        if self.allowed_diffs:
            parts += ["", "Format differences accepted with --allow-diff: "
                      + "; ".join(f"{k}: " + ", ".join(f"{n}={v!r}" for n, v in vals.items())
                                  for k, vals in self.allowed_diffs.items())]
        for p in self.pairs:
            parts += ["", f"## {p.a} vs {p.b}", "", self.pair_text(p, max_ids)]
        if self.checks:
            verdict = "all thresholds pass" if self.passed else "a threshold FAILED"
            parts += ["", f"## Thresholds: {verdict}", "", self.checks_table()]
        return "\n".join(parts) + "\n"

    def to_json(self) -> dict[str, Any]:
        return {
            "results": [{"name": r.name, "path": str(r.path), "model": r.summary.get("model"),
                         **{k: r.stats[k] for k in (*_COUNTS, "metrics")}}
                        for r in self.results],
            "data_sha256": self.results[0].summary["data"]["sha256"],
            "format": self.results[0].summary["format"], "allowed_diffs": self.allowed_diffs,
            "pairs": [vars(p) for p in self.pairs],
            "checks": [{**vars(c), "passed": c.passed} for c in self.checks], "passed": self.passed,
        }

    def write(self, out_dir: Path) -> list[Path]:
        """report.md (every flipped id listed), comparison.json and comparison.png in `out_dir`."""
        out_dir = Path(out_dir)
        return [atomic_write_text(out_dir / "report.md", self.to_text(max_ids=None)),
                atomic_write_json(out_dir / "comparison.json", self.to_json()),
                plot_comparison(self.results, out_dir / "comparison.png")]


def _table(head: list[str], rows: list[list[Any]]) -> str:
    """A Markdown table, cells already formatted."""
    def row(cells: list[Any]) -> str:
        return "| " + " | ".join(map(str, cells)) + " |"

    return "\n".join([row(head), "|" + "---|" * len(head), *map(row, rows)])


def plot_comparison(results: list[ResultSet], path: Path) -> Path:
    """Grouped bars: one group per metric, one bar per result set, 95% interval error bars."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(2.2 + 1.2 * len(METRICS) * max(1, len(results)) * 0.6, 4))
    width = 0.8 / max(1, len(results))
    for i, r in enumerate(results):
        ms = [r.stats["metrics"][m] for m in METRICS]
        xs = [k + (i - (len(results) - 1) / 2) * width for k in range(len(METRICS))]
        err = [[m["value"] - m["low"] for m in ms], [m["high"] - m["value"] for m in ms]]
        ax.bar(xs, [m["value"] for m in ms], width, yerr=err, capsize=3, label=r.name)
    ax.set_xticks(range(len(METRICS)), [METRIC_LABELS[m] for m in METRICS])
    ax.set_ylabel("% (95% interval)")
    ax.set_ylim(0, 100)
    ax.legend(fontsize="small")
    ax.set_title(f"{results[0].stats['total']} questions")
    fig.tight_layout()
    atomic_save_figure(path, fig, dpi=120)
    plt.close(fig)
    return path


# ------------------------------------------------------------------------------------------ loading

def load_result_set(path: Path, name: str) -> tuple[ResultSet | None, list[str]]:
    """A result folder and the problems that make it unusable (empty list = usable)."""
    path = Path(path)
    summary_path, results_path = path / SUMMARY_FILE, path / RESULTS_FILE
    if not summary_path.is_file() or not results_path.is_file():
        missing = SUMMARY_FILE if not summary_path.is_file() else RESULTS_FILE
        return None, [f"{name} ({path}): no {missing}; run `memrl eval --out {path}` (again) until it finishes"]
    try:
        summary = json.loads(summary_path.read_text(encoding="utf-8"))
        lines = read_results(results_path)
    except (json.JSONDecodeError, EvalError) as e:
        return None, [f"{name} ({path}): unreadable results: {e}"]
    problems = []
    by_id = {line["id"]: line for line in lines}
    if not lines or not summary.get("total"):
        problems.append(f"{name} ({path}): empty results (0 questions); evaluate on a non-empty data file")
    elif len(by_id) != summary.get("total"):
        problems.append(f"{name} ({path}): {RESULTS_FILE} holds {len(by_id)} questions but summary.json counts "
                        f"{summary.get('total')}; rerun `memrl eval --out {path}` to finish the run")
    stats = summarize_lines(list(by_id.values()))
    failed = stats["failed_ids"] or summary.get("failed_ids") or []
    if failed or summary.get("failed"):
        problems.append(f"{name} ({path}): {max(len(failed), summary.get('failed') or 0)} failed requests "
                        f"(ids {', '.join(failed[:5])}{', ...' if len(failed) > 5 else ''}); rerun "
                        f"`memrl eval --retry-failed --out {path}` before comparing")
    for key in ("data", "format"):
        if not isinstance(summary.get(key), dict):
            problems.append(f"{name} ({path}): summary.json has no '{key}' section; it was not written by memrl eval")
    return ResultSet(name, path, summary, by_id, stats), problems


def _unique_names(dirs: list[Path], names: list[str] | None) -> list[str]:
    if names:
        if len(names) != len(dirs):
            raise CompareError(f"{len(names)} names for {len(dirs)} result folders; give one --name per folder")
        if len(set(names)) != len(names):
            raise CompareError(f"names must be distinct, got {', '.join(names)}")
        return list(names)
    out: list[str] = []
    for d in dirs:
        base = Path(d).resolve().name or str(d)
        name, k = base, 2
        while name in out:  # the same folder twice (a self-comparison) or equal leaf names
            name, k = f"{base}#{k}", k + 1
        out.append(name)
    return out


def _cross_problems(sets: list[ResultSet], allow_diff: set[str]) -> tuple[list[str], dict[str, dict[str, Any]]]:
    ref = sets[0]
    problems: list[str] = []
    for other in sets[1:]:
        sha_a, sha_b = ref.summary["data"].get("sha256"), other.summary["data"].get("sha256")
        if sha_a != sha_b:
            problems.append(f"data SHA-256 differs: {ref.name}={sha_a} ({ref.summary['data'].get('path')}) vs "
                            f"{other.name}={sha_b} ({other.summary['data'].get('path')}); "
                            "evaluate both on the same file")
    allowed: dict[str, dict[str, Any]] = {}
    keys = sorted(set().union(*(s.summary["format"] for s in sets)))
    for key in keys:
        values = {s.name: s.summary["format"].get(key) for s in sets}
        if len({json.dumps(v, sort_keys=True) for v in values.values()}) > 1:
            if key in allow_diff:
                allowed[key] = values
            else:
                shown = ", ".join(f"{n}={v!r}" for n, v in values.items())
                problems.append(f"format.{key} differs: {shown}; evaluate with the same recipe and overrides "
                                f"(or accept it with --allow-diff {key})")
    for other in sets[1:]:
        only_a, only_b = sorted(set(ref.lines) - set(other.lines)), sorted(set(other.lines) - set(ref.lines))
        if only_a or only_b:
            problems.append(f"question ids differ: {len(only_a)} only in {ref.name} (e.g. {only_a[:3]}), "
                            f"{len(only_b)} only in {other.name} (e.g. {only_b[:3]}); use the same data and --limit")
    return problems, allowed


def _pair(a: ResultSet, b: ResultSet) -> PairResult:
    ids = list(a.lines)  # data order of a's file; the id sets are equal by now
    wr = [i for i in ids if not a.lines[i].get("em") and b.lines[i].get("em")]
    rw = [i for i in ids if a.lines[i].get("em") and not b.lines[i].get("em")]
    both = sum(bool(a.lines[i].get("em")) and bool(b.lines[i].get("em")) for i in ids)
    diffs = {m: b.stats["metrics"][m]["value"] - a.stats["metrics"][m]["value"] for m in METRICS}
    return PairResult(a.name, b.name, diffs, wr, rw, both, len(ids) - both - len(wr) - len(rw),
                      mcnemar_p(len(rw), len(wr)))


def compare_results(dirs: list[Path], names: list[str] | None = None, max_abs_diff: dict[str, float] | None = None,
                    pairs: list[tuple[str, str]] | None = None, allow_diff: list[str] | None = None) -> CompareReport:
    """Load, check and compare result folders: flips and differences for every pair, thresholds on `pairs`
    (each as given: diff = b - a), or on every pair in order when none is given."""
    if not dirs:
        raise CompareError("give at least one result folder")
    names = _unique_names(list(dirs), names)
    max_abs_diff = dict(max_abs_diff or {})
    unknown = sorted(set(max_abs_diff) - set(METRICS))
    if unknown:
        raise CompareError(f"unknown metric(s) {', '.join(unknown)} in --max-abs-diff; use {', '.join(METRICS)}")
    for p in pairs or []:
        missing = [n for n in p if n not in names]
        if missing:
            raise CompareError(f"--pair {','.join(p)}: no result named {', '.join(missing)}; "
                               f"names are {', '.join(names)}")
    loaded = [load_result_set(d, n) for d, n in zip(dirs, names, strict=True)]
    problems = [p for _, ps in loaded for p in ps]
    if problems:
        raise CompareError("cannot compare: " + "; ".join(problems))
    sets = [s for s, _ in loaded if s is not None]
    problems, allowed = _cross_problems(sets, set(allow_diff or []))
    if problems:
        raise CompareError("results are not comparable: " + "; ".join(problems))
    by_name = {s.name: s for s in sets}
    checked = list(dict.fromkeys(pairs)) if pairs else list(itertools.combinations(names, 2))
    if max_abs_diff and not checked:
        raise CompareError("--max-abs-diff needs two result folders (or a --pair)")
    # Flips for every pair; a pair named with --pair keeps its orientation (b - a).
    shown = [p for p in itertools.combinations(names, 2) if p not in checked and p[::-1] not in checked]
    pair_results = {p: _pair(by_name[p[0]], by_name[p[1]]) for p in [*checked, *shown]}
    checks = [ThresholdCheck(a, b, m, abs(pair_results[a, b].diffs[m]), limit)
              for a, b in checked for m, limit in max_abs_diff.items()]
    return CompareReport(sets, list(pair_results.values()), checks, allowed)


def default_report_dir(dirs: list[Path]) -> Path:
    """Where `memrl compare` writes its report without `--out`: `comparison/` in the folders' common parent."""
    return Path(os.path.commonpath([str(Path(d).resolve()) for d in dirs])) / "comparison"


# ------------------------------------------------------------------------------------------ command-line values

def parse_thresholds(items: list[str]) -> dict[str, float]:
    """["sub_em=3", "em=2.5"] -> {"sub_em": 3.0, "em": 2.5} (percentage points); a limit is finite and >= 0
    (`nan` failed every check and `inf` passed every one: both would only look like a check)."""
    out: dict[str, float] = {}
    for item in items:
        metric, sep, value = item.partition("=")
        try:
            if not sep:
                raise ValueError
            limit = float(value)
        except ValueError:
            raise CompareError(f"--max-abs-diff {item!r}: write METRIC=POINTS, e.g. sub_em=3") from None
        if not (math.isfinite(limit) and limit >= 0):
            raise CompareError(f"--max-abs-diff {item!r}: the limit must be a finite number >= 0 percentage points")
        out[metric.strip().lower()] = limit
    return out


def parse_pairs(items: list[str]) -> list[tuple[str, str]]:
    out = []
    for item in items:
        parts = [p.strip() for p in item.split(",")]
        if len(parts) != 2 or not all(parts):
            raise CompareError(f"--pair {item!r}: write NAME_A,NAME_B")
        out.append((parts[0], parts[1]))
    return out

