"""`memrl demo-long`: train short, read long, MemAgent's length table on CPU (docs/demo.md, "Train short,
read long"): `memrl demo`'s training, then base and trained on held-out documents of exactly L chunks for
every length, one recipe for all. The memory cap does not change with length, so a loss at length is the
memory failing to carry the fact through more turns, not a memory that grows.
"""

from __future__ import annotations

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
    demo_config,
    evaluate_policy,
    new_run_root,
    quiet_demo,
    run_demo,
)
from memrl.config import Config
from memrl.io import atomic_write_json

MIN_TARGET_LENGTH = 8  # the target: trained > base at every length of 8 chunks and more


@dataclass(frozen=True)
class LongDemoSettings:
    """One `memrl demo-long` run: the short demo's training (`train`), then evaluation at `lengths`."""

    train: DemoSettings = FULL
    lengths: tuple[int, ...] = (1, 2, 3, 8, 16, 32, 64)
    questions_per_length: int = 400
    related: int = 8          # distractors sharing entity or attribute (a 3-chunk training document has 8)
    seed: int = 0


# Training on the short task padded with filler to the seed's 4 chunks: trained on the demo's own task (1-3
# chunks, a fact with the question's attribute in almost every first chunk) the reader learnt to commit at
# its first memory turn, which at length is a guess (docs/demo.md, "Train short, read long"). No validation
# during training: this command reports the length table (validation never changes training; ~1.3 min).
PADDED = {"filler": True, "max_chunks": 4, "eval_interval": 0}
LONG_FULL = LongDemoSettings(train=replace(FULL, **PADDED))
LONG_QUICK = LongDemoSettings(train=replace(QUICK, **PADDED), lengths=(1, 3, 16, 64), questions_per_length=100)


def _position_third(record: Any) -> str:
    m = record.metadata
    return ("first", "middle", "last")[min(2, int(3 * m["answer_index"] / (m["num_chunks"] * m["facts_per_chunk"])))]


def first_match_rates(records: Sequence[Any], lines: dict[str, dict[str, Any]]) -> dict[str, float]:
    """How often the boxed answer is the value of the document's first fact with the question's attribute,
    and how often that fact is the answer: a reader that keeps the first attribute match scores about the
    second figure, as the full run's trained policy does (docs/demo.md)."""
    answered = first_is_answer = 0
    for record in records:
        m = record.metadata
        first = next(f for f in m["facts"] if f[0] == m["attribute"])
        first_is_answer += first[1] == m["entity"]
        answered += (lines[record.id].get("boxed") or "").strip() == first[2]
    return {"answers_first_match_pct": 100 * answered / len(records),
            "first_match_is_answer_pct": 100 * first_is_answer / len(records)}


def length_config(settings: LongDemoSettings) -> Config:
    """One recipe for every length (max_chunks = the longest): documents are never truncated, and every result
    folder shares one format. Bad lengths or overrides fail here, before any work."""
    if not settings.lengths or min(settings.lengths) < 1 or settings.questions_per_length < 1:
        raise DemoError(f"--lengths ({list(settings.lengths)}) must be >= 1 chunk and --questions "
                        f"({settings.questions_per_length}) >= 1")
    return demo_config(replace(settings.train, max_chunks=max(settings.lengths)))


def evaluate_lengths(models: dict[str, tuple[Any, Any]], settings: LongDemoSettings, out_root: Path,
                     exclude: set[tuple[str, str]] | frozenset = frozenset(), progress: bool = True
                     ) -> list[dict[str, Any]]:
    """Evaluate two models (name -> (model, tokenizer)) at every length; one row per length.

    The first model is the baseline of each comparison (`diff` = other - first). Every length's data
    is written to out_root/data/length_L.jsonl (its SHA-256 is the results' data identity)."""
    from memrl.data.manifest import sha256_file
    from memrl.data.records import write_jsonl
    from memrl.data.synthetic import make_length_set

    if len(models) != 2:
        raise DemoError(f"evaluate_lengths compares two models (base, trained), got {len(models)}")
    cfg = length_config(settings)
    rows = []
    for length in sorted(set(settings.lengths)):
        records = make_length_set(settings.questions_per_length, length, settings.seed,
                                  facts_per_chunk=settings.train.facts_per_chunk, related=settings.related,
                                  exclude=exclude)
        data = out_root / "data" / f"length_{length}.jsonl"
        write_jsonl(data, records)
        sha = sha256_file(data)
        summaries, times = {}, {}
        for name, (model, tokenizer) in models.items():
            t = time.perf_counter()
            summaries[name] = evaluate_policy(model, tokenizer, cfg, records, out_root / f"len{length}" / name, name,
                                              sha, data)
            times[name] = time.perf_counter() - t
        rows.append(_length_row(length, records, summaries, times, out_root / f"len{length}"))
    return rows


def _length_row(length: int, records: Sequence[Any], summaries: dict[str, dict[str, Any]],
                times: dict[str, float], folder: Path) -> dict[str, Any]:
    """One length's comparison (written to folder/compare) and its row: EM per model, flips, McNemar p, EM by
    the answering fact's third of the document and the first-match rates."""
    from memrl.eval.compare import compare_results

    a, b = summaries
    report = compare_results([folder / a, folder / b], names=[a, b])
    report.write(folder / "compare")
    pair = report.pairs[0]
    lines = {name: result.lines for name, result in zip(summaries, report.results, strict=True)}  # by question id
    thirds = {t: [r.id for r in records if _position_third(r) == t] for t in ("first", "middle", "last")}
    by_third = {name: {t: 100 * sum(by_id[i]["em"] for i in ids) / len(ids) for t, ids in thirds.items() if ids}
                for name, by_id in lines.items()}
    return {
        "length": length, "questions": len(records), "document_tokens": len(records[0].context.split()),
        **{name: {"em": s["metrics"]["em"]["value"],
                  "em_ci95": [s["metrics"]["em"]["low"], s["metrics"]["em"]["high"]],
                  "failed": s["failed"], "eval_s": round(times[name], 1),
                  "memory_max_tokens": max((max(line["memory_lengths"], default=0)
                                            for line in lines[name].values()), default=0),
                  "memory_truncations": sum(line["memory_truncations"] for line in lines[name].values())}
           for name, s in summaries.items()},
        "diff_pp": pair.diffs["em"], "wrong_to_right": len(pair.wrong_to_right),
        "right_to_wrong": len(pair.right_to_wrong), "mcnemar_p": pair.mcnemar_p,
        "em_by_position_third": by_third,
        "first_match": {name: first_match_rates(records, by_id) for name, by_id in lines.items()},
    }


def plot_lengths(rows: Sequence[dict[str, Any]], names: Sequence[str], path: Path,
                 title: str = "EM against document length") -> Path:
    """EM (95% interval bars) against document length in chunks, one line per model, log-2 length axis."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from memrl.io import atomic_save_figure

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    lengths = [r["length"] for r in rows]
    for name in names:
        em = [r[name]["em"] for r in rows]
        err = [[r[name]["em"] - r[name]["em_ci95"][0] for r in rows],
               [r[name]["em_ci95"][1] - r[name]["em"] for r in rows]]
        ax.errorbar(lengths, em, yerr=err, marker="o", capsize=3, label=name)
    ax.set_xscale("log", base=2)
    ax.set_xticks(lengths, [str(n) for n in lengths])
    ax.set_xlabel("document length (chunks)")
    ax.set_ylabel("held-out boxed EM % (95% CI)")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_save_figure(path, fig, dpi=120)
    plt.close(fig)
    return path


def target_met(rows: Sequence[dict[str, Any]]) -> bool:
    """Trained EM above base EM at every evaluated length of MIN_TARGET_LENGTH chunks or more."""
    long_rows = [r for r in rows if r["length"] >= MIN_TARGET_LENGTH]
    return bool(long_rows) and all(r["diff_pp"] > 0 for r in long_rows)


def run_long_demo(run_root: Path, settings: LongDemoSettings = LONG_FULL, progress: bool = True) -> dict[str, Any]:
    """Train as `memrl demo` does (into run_root/train), evaluate both models at every length; returns the
    summary (also run_root/demo_long_summary.json)."""
    from transformers import AutoModelForCausalLM

    from memrl.data.records import load_questions
    from memrl.data.synthetic import task_tokenizer

    run_root = new_run_root(run_root)
    started = time.perf_counter()
    short = run_demo(run_root / "train", settings.train, progress=progress)
    train_s = time.perf_counter() - started
    # The base is the warm start's last phase, saved by run_sft; the trained policy by run_demo.
    base_dir = run_root / "train" / ("sft/imperfect" if settings.train.sft_demos else "sft/clean") / "model"
    tokenizer = task_tokenizer()
    models = {name: (AutoModelForCausalLM.from_pretrained(str(path)).float().eval(), tokenizer)
              for name, path in (("base", base_dir), ("trained", run_root / "train" / "trained_model"))}
    train_records = load_questions(run_root / "train" / "data" / "synthetic_train.jsonl")
    t = time.perf_counter()
    rows = evaluate_lengths(models, settings, run_root / "lengths",
                            exclude={(r.question, r.context) for r in train_records}, progress=progress)
    plot = plot_lengths(rows, list(models), run_root / "length_em.png",
                        title=f"trained on 1-{settings.train.max_chunks} chunks"
                              f"{' padded with filler' if settings.train.filler else ''}, read long")
    summary = {
        "settings": asdict(settings), "rows": rows,
        "in_distribution": {"base_em": short["base"]["em"], "trained_em": short["trained"]["em"],
                            "heldout_questions": short["heldout_questions"]},
        "target": {"min_length": MIN_TARGET_LENGTH, "met": target_met(rows)},
        "paths": {"train": "train", "lengths": "lengths", "plot": plot.name},
        "times_s": {"train_s": round(train_s, 1), "eval_lengths_s": round(time.perf_counter() - t, 1),
                    "total_s": round(time.perf_counter() - started, 1)},
    }
    atomic_write_json(run_root / "demo_long_summary.json", summary)
    return summary


def format_table(rows: Sequence[dict[str, Any]]) -> str:
    """MemAgent's table: length -> EM base / trained / difference, 95% intervals, flips, McNemar p."""
    lines = ["| chunks | doc tokens | base EM % [95% CI] | trained EM % [95% CI] | diff pp "
             "| flips w->r / r->w | McNemar p |",
             "|---:|---:|---|---|---:|---|---:|"]
    for r in rows:
        b, t = r["base"], r["trained"]
        lines.append(f"| {r['length']} | {r['document_tokens']} | {b['em']:.1f} [{b['em_ci95'][0]:.1f}, "
                     f"{b['em_ci95'][1]:.1f}] | {t['em']:.1f} [{t['em_ci95'][0]:.1f}, {t['em_ci95'][1]:.1f}] | "
                     f"{r['diff_pp']:+.1f} | {r['wrong_to_right']} / {r['right_to_wrong']} | {r['mcnemar_p']:.2g} |")
    return "\n".join(lines)


def format_summary(summary: dict[str, Any], run_root: Path) -> str:
    rows, s = summary["rows"], summary["settings"]
    third = ["", "EM % by where the answering fact sits (first / middle / last third of the document):"]
    for r in rows:
        parts = [f"{n} " + " / ".join(f"{v:.0f}" for v in r["em_by_position_third"][n].values())
                 for n in ("base", "trained")]
        fm = r["first_match"]
        third.append(f"  {r['length']:>2} chunks: {';  '.join(parts)};  answer = first attribute-matching fact: "
                     f"base {fm['base']['answers_first_match_pct']:.0f}%, "
                     f"trained {fm['trained']['answers_first_match_pct']:.0f}% "
                     f"(that fact is the answer in {fm['base']['first_match_is_answer_pct']:.0f}%)")
    met = "yes" if summary["target"]["met"] else "NO"
    return "\n".join([
        "", f"memrl demo-long: trained on 1-{s['train']['max_chunks']} chunks"
        f"{' (padded with filler)' if s['train']['filler'] else ''}, evaluated on "
        f"{s['questions_per_length']} held-out questions per length (temperature 1.0, same seeds for both models)",
        "", format_table(rows), *third, "",
        f"target met: {met}  trained > base at every length >= {summary['target']['min_length']} chunks",
        f"time: {summary['times_s']['total_s'] / 60:.1f} min (training {summary['times_s']['train_s'] / 60:.1f}, "
        f"length evaluations {summary['times_s']['eval_lengths_s'] / 60:.1f}). Results in {run_root}: "
        "length_em.png, lengths/, train/, demo_long_summary.json",
    ])


def long_settings(quick: bool = False, overrides: Sequence[str] = (), questions_per_length: int | None = None,
                  lengths: Sequence[int] | None = None, filler: bool = True) -> LongDemoSettings:
    """The settings `memrl demo-long` runs with; `filler=False` trains on the demo's own task, as `memrl demo`."""
    base = LONG_QUICK if quick else LONG_FULL
    train = base.train if filler else (QUICK if quick else FULL)
    return replace(base, train=replace(train, overrides=tuple(overrides)),
                   questions_per_length=(base.questions_per_length if questions_per_length is None
                                         else questions_per_length),
                   lengths=tuple(lengths) if lengths else base.lengths)


def demo_long_command(run_root: Path, quick: bool = False, overrides: Sequence[str] = (),
                      questions_per_length: int | None = None, lengths: Sequence[int] | None = None,
                      filler: bool = True) -> int:
    """`memrl demo-long`: 0 when the trained policy beats the base at every length >= 8 chunks, else 1;
    a `DemoError` / `ConfigError` is exit 2 in memrl.cli."""
    quiet_demo()
    settings = long_settings(quick, overrides, questions_per_length, lengths, filler)
    length_config(settings)  # bad input fails before training
    summary = run_long_demo(Path(run_root), settings)
    print(format_summary(summary, Path(run_root)))
    return 0 if summary["target"]["met"] else 1

