"""`memrl eval` (docs/design.md §7): the task's sampling (`Task.sample_group`, phase "eval"), once per
question, scored (`Task.score`), resumable; the folder's files are memrl.eval.results'.

Invariants: every question has exactly one line once the run ends (a failed generation is a `failed`
line that scores 0 and stays in every denominator); a rerun skips ids already written, and a torn last
line is redone, while any other unreadable line, a foreign id or another data SHA-256 / model / format in
`eval_run.json` is an `EvalError`, so two runs never mix; question `q` is group "eval:q" with seed key
"0:q" (`memrl.task.eval_group`), whatever the model.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TextIO

from tqdm.auto import tqdm

from memrl.config import Config, check_model_path, load_pretrained
from memrl.data.manifest import sha256_file
from memrl.data.records import QuestionRecord, check_unique_ids, write_jsonl
from memrl.engines.base import Engine
from memrl.eval.results import (
    METRICS,
    RESULTS_FILE,
    RUN_FILE,
    SUMMARY_FILE,
    EvalError,
    eval_format,
    read_results,
    sample_line,
    summarize_lines,
)
from memrl.eval.stats import format_interval
from memrl.io import atomic_write_json
from memrl.rollout import RolloutContext
from memrl.task import Task, eval_group, load_task

# ------------------------------------------------------------------------------------------ resume

def _resume_state(out_dir: Path, identity: dict[str, Any], ids: set[str], retry_failed: bool) -> dict[str, dict]:
    """Check that `out_dir` belongs to this run and return its finished lines by id."""
    run_path, results_path = out_dir / RUN_FILE, out_dir / RESULTS_FILE
    if run_path.is_file():
        try:
            previous = json.loads(run_path.read_text(encoding="utf-8"))
        except json.JSONDecodeError as e:
            raise EvalError(f"{run_path} is not valid JSON ({e}); use a new --out folder") from e
        fmt_prev, fmt_now = previous.get("format", {}), identity["format"]
        differ = [f"{k}: {previous.get(k)!r} -> {identity[k]!r}" for k in identity
                  if k != "format" and previous.get(k) != identity[k]]
        differ += [f"format.{k}: {fmt_prev.get(k)!r} -> {fmt_now.get(k)!r}"
                   for k in sorted(set(fmt_prev) | set(fmt_now))
                   if fmt_prev.get(k) != fmt_now.get(k)]
        if differ:
            raise EvalError(f"{out_dir} holds results of another evaluation ({'; '.join(differ)}); "
                            f"use a new --out folder, or delete {out_dir} to start over")
    elif results_path.exists():
        raise EvalError(f"{results_path} exists without {RUN_FILE}, so it cannot be checked against this run; "
                        f"use a new --out folder")
    else:
        atomic_write_json(run_path, identity)
    done: dict[str, dict] = {}
    for line in read_results(results_path, repair=True):
        if line["id"] not in ids:
            raise EvalError(f"{results_path} holds id {line['id']!r}, which is not among this run's questions "
                            f"(different --limit or data?); use a new --out folder")
        done[line["id"]] = line
    if retry_failed and any(line.get("status") == "failed" for line in done.values()):
        done = {k: v for k, v in done.items() if v.get("status") != "failed"}
        write_jsonl(results_path, list(done.values()))  # without the failed lines: retries never duplicate an id
    return done


# ------------------------------------------------------------------------------------------ summary, progress

def _config_record(cfg: Config) -> dict[str, Any]:
    engine = cfg.engine.model_dump(mode="json")
    engine.pop("api_key", None)  # never write a credential into results
    # `plugins.task` tells `memrl view` what to show of each line (`Task.view_fields`).
    return {"sampling": cfg.sampling.model_dump(mode="json"),
            "engine": engine, "task": cfg.task.model_dump(mode="json"),
            "eval": cfg.eval.model_dump(mode="json"), "plugins": {"task": cfg.plugins.task}}


class _RunningScore:
    def __init__(self, lines: Sequence[dict[str, Any]]) -> None:
        self.n, self.failed = 0, 0
        self.sums = dict.fromkeys(METRICS, 0.0)
        for line in lines:
            self.add(line)

    def add(self, line: dict[str, Any]) -> None:
        self.n += 1
        self.failed += line.get("status") == "failed"
        for m in METRICS:
            self.sums[m] += float(line.get(m) or 0.0)

    def postfix(self) -> dict[str, str]:
        out = {m: f"{100 * s / self.n:.1f}" for m, s in self.sums.items()} if self.n else {}
        return {**out, "failed": str(self.failed)}


# ------------------------------------------------------------------------------------------ evaluation

async def evaluate_records(engine: Engine, tokenizer: Any, cfg: Config, records: Sequence[QuestionRecord],
                           out_dir: Path, *, model_name: str, data_sha256: str, data_path: str | None = None,
                           tokenizer_name: str | None = None, engine_info: dict[str, Any] | None = None,
                           retry_failed: bool = False, progress: bool = True,
                           task: Task | None = None) -> dict[str, Any]:
    """Evaluate `records` (`task` or the configured one) into `out_dir`, at most `cfg.eval.concurrency`
    questions in flight; returns the summary (also written). The engine is not closed here."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    records = list(records)
    check_unique_ids(records, data_path or "records")
    task = task if task is not None else load_task(cfg)
    fmt = eval_format(cfg, tokenizer, task.stop_token_ids(tokenizer, cfg))
    identity = {"model": model_name, "data_sha256": data_sha256, "format": fmt}
    done = _resume_state(out_dir, identity, {r.id for r in records}, retry_failed)
    todo = [r for r in records if r.id not in done]
    start = time.perf_counter()
    running = _RunningScore(list(done.values()))
    bar = tqdm(total=len(records), initial=len(done), desc=f"eval {Path(model_name).name or model_name}",
               unit="q", disable=not progress, dynamic_ncols=True)
    semaphore = asyncio.Semaphore(cfg.eval.concurrency)
    ctx = RolloutContext(engine=engine, tokenizer=tokenizer, config=cfg, progress=False, phase="eval")

    with open(out_dir / RESULTS_FILE, "a", encoding="utf-8") as results:

        async def one(record: QuestionRecord) -> None:
            async with semaphore:
                line = await _question_line(task, ctx, record)
                _append_line(results, line)
                done[record.id] = line
                running.add(line)
                bar.update()
                bar.set_postfix(running.postfix(), refresh=False)

        try:
            await asyncio.gather(*(one(r) for r in todo))
        finally:
            bar.close()

    summary = {
        "model": model_name, "tokenizer": tokenizer_name or model_name,
        "engine": engine_info or {"kind": type(engine).__name__},
        "data": {"path": data_path, "sha256": data_sha256},
        **summarize_lines([done[r.id] for r in records]),
        "format": fmt, "config": _config_record(cfg),
        "results_file": RESULTS_FILE, "complete": True,
        "resumed_from": len(records) - len(todo), "elapsed_s": round(time.perf_counter() - start, 3),
    }
    atomic_write_json(out_dir / SUMMARY_FILE, summary)
    return summary


async def _question_line(task: Task, ctx: RolloutContext, record: QuestionRecord) -> dict[str, Any]:
    """One question's results line; an exception is a failed line, as one odd record must not end the run."""
    t0 = time.perf_counter()
    try:
        (traj,) = await task.sample_group(ctx, eval_group(record), 1)
        return sample_line(record, traj, time.perf_counter() - t0, task=task, tokenizer=ctx.tokenizer)
    except Exception as e:
        return sample_line(record, None, time.perf_counter() - t0, error=f"{type(e).__name__}: {e}", task=task)


def _append_line(results: TextIO, line: dict[str, Any]) -> None:
    # One write of a whole line, then flush + fsync: a kill leaves at most a torn last line.
    results.write(json.dumps(line, ensure_ascii=False) + "\n")
    results.flush()
    os.fsync(results.fileno())


def evaluate(engine: Engine, tokenizer: Any, cfg: Config, records: Sequence[QuestionRecord], out_dir: Path,
             *, model_name: str, data_sha256: str, **kwargs: Any) -> dict[str, Any]:
    """Synchronous `evaluate_records` in its own event loop (the engine is not closed)."""
    return asyncio.run(evaluate_records(engine, tokenizer, cfg, records, out_dir, model_name=model_name,
                                        data_sha256=data_sha256, **kwargs))


# ------------------------------------------------------------------------------------------ command

def load_eval_data(path: Path, verify: bool = True) -> list[QuestionRecord]:
    """Questions of a prepared JSONL file or a RULER-HQA `eval_N.json` list; none is an `EvalError` (its
    "0 questions" summary would read as a finished run)."""
    from memrl.data.records import load_questions
    from memrl.data.ruler_hqa import load_ruler_file

    path = Path(path)
    if not path.is_file():
        raise EvalError(f"data file {path} does not exist; prepare it with `memrl prepare-data`")
    if path.suffix == ".jsonl":
        records = load_questions(path, verify=verify)
    else:
        with open(path, encoding="utf-8") as f:
            head = f.read(4096).lstrip()
        # A RULER file is one JSON list; our prepared format is one object per line.
        if head.startswith("["):
            records = load_ruler_file(path, verify=verify)
        elif head.startswith("{"):
            records = load_questions(path, verify=verify)
        else:
            raise EvalError(f"{path} is neither prepared JSONL (one object per line) nor a RULER-HQA JSON list")
    if not records:
        raise EvalError(f"data file {path} holds no questions; pass a prepared file (`memrl prepare-data`)")
    return records


def resolve_model_source(cfg: Config, model: str | None, server_url: str | None,
                         tokenizer: str | None) -> tuple[str | None, str | None, str]:
    """(model, server_url, tokenizer path) from the command line, falling back to the recipe."""
    model = model or (cfg.model.path if server_url is None and cfg.engine.kind == "hf" else None)
    server_url = server_url or (cfg.engine.server_url if model is None else None)
    if (model is None) == (server_url is None):
        raise EvalError("give exactly one of --model DIR (local engine) or --server-url URL (a served model)")
    tokenizer_path = tokenizer or cfg.model.tokenizer or model
    if tokenizer_path is None:
        raise EvalError("a served model needs --tokenizer (a folder or hub id): prompts are built as token ids here")
    return model, server_url, tokenizer_path


def open_engine(cfg: Config, model: str | None, server_url: str | None,
                tokenizer_path: str | Path) -> tuple[Any, Any, dict[str, Any]]:
    """(tokenizer, engine, engine info) for a model folder / hub id (local engine) or a server URL."""
    from transformers import AutoTokenizer

    if model is not None:  # first: the tokenizer path is often the model's, and the model is what is missing
        check_model_path(model)
    # The recipe's pinned revision applies to the recipe's own hub ids, not to folders given on the CLI.
    tok_revision = cfg.model.revision if str(tokenizer_path) in (cfg.model.path, cfg.model.tokenizer) else None
    tok = load_pretrained(AutoTokenizer, tokenizer_path, "model" if str(tokenizer_path) == str(model) else "tokenizer",
                          revision=tok_revision)

    from memrl.engines.factory import build_engine

    if server_url is not None:
        engine: Any = build_engine(cfg, server_url=server_url)
        info: dict[str, Any] = {"kind": "openai", "url": server_url}
    else:
        engine = build_engine(cfg, model_path=model, tokenizer_path=tokenizer_path)
        info = {"kind": "hf", "device": str(engine.device), "dtype": str(engine.dtype).removeprefix("torch.")}

    return tok, engine, info


def eval_command(model: str | None, server_url: str | None, recipe: Path | None, data: Path, out: Path,
                 sets: list[str] | None = None, limit: int | None = None, concurrency: int | None = None,
                 tokenizer: str | None = None, progress: bool = True, *, retry_failed: bool = False) -> dict[str, Any]:
    """`memrl eval` of a model folder (local engine) or a served model on one data file; overrides in order:
    the recipe, `--set`, `--limit` / `--concurrency`."""
    from memrl.config import load_config

    overrides = list(sets or [])
    overrides += [f"eval.limit={limit}"] if limit is not None else []
    overrides += [f"eval.concurrency={concurrency}"] if concurrency is not None else []
    cfg = load_config(recipe, overrides)
    model, server_url, tokenizer_path = resolve_model_source(cfg, model, server_url, tokenizer)

    records = load_eval_data(data, verify=cfg.data.verify_manifest)[:cfg.eval.limit]
    data_sha = sha256_file(data)
    tok, engine, info = open_engine(cfg, model, server_url, tokenizer_path)

    # A local folder is named by its absolute path, so a rerun from another directory still resumes.
    model_name = str(Path(model).resolve()) if model is not None and Path(model).is_dir() else str(model or server_url)

    async def run() -> dict[str, Any]:
        try:
            summary = await evaluate_records(engine, tok, cfg, records, Path(out), model_name=model_name,
                                             data_sha256=data_sha, data_path=str(data),
                                             tokenizer_name=str(tokenizer_path),
                                             engine_info=info, retry_failed=retry_failed, progress=progress)
            if server_url is not None:
                summary["engine"]["served_model"] = getattr(engine, "model", None)
                atomic_write_json(Path(out) / SUMMARY_FILE, summary)
            return summary
        finally:
            await engine.close()

    summary = asyncio.run(run())
    refuse_all_failed(summary, Path(out))
    return summary


def refuse_all_failed(summary: dict[str, Any], out_dir: Path) -> None:
    """A run in which no question succeeded measured nothing (a dead server, a wrong URL): an EvalError with
    the first error. Its results and summary stay written, so `--retry-failed` redoes them once it is fixed."""
    if summary["succeeded"] or not summary["total"]:
        return
    first = next(line.get("error") for line in read_results(out_dir / RESULTS_FILE) if line.get("status") == "failed")
    raise EvalError(f"all {summary['total']} questions failed, so nothing was measured; the first error: {first}; "
                    f"fix it and rerun with --retry-failed (results in {out_dir / RESULTS_FILE})")


def format_summary(summary: dict[str, Any]) -> str:
    """A few lines for the terminal: counts, then each metric with its interval."""
    head = (f"{summary['model']}: {summary['total']} questions, {summary['succeeded']} succeeded, "
            f"{summary['failed']} failed, {summary['missing_boxes']} missing boxes")
    metrics = "  ".join(f"{m} {format_interval(v)}" for m, v in summary["metrics"].items())
    return f"{head}\n{metrics}"

