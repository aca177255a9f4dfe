"""The format of `memrl eval` results (docs/design.md §7), written by memrl.eval.runner, read by compare:

    eval_run.json   RUN_FILE: identity of the run (model, data SHA-256, `eval_format`); written first
    results.jsonl   RESULTS_FILE: one `sample_line` per finished question (`read_results` reads it back)
    summary.json    SUMMARY_FILE: `summarize_lines` over all lines, plus the run's identity and config
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from memrl.config import IDENTITY_WHEN_CHANGED, TaskSettings
from memrl.errors import MemrlError
from memrl.eval.stats import metric_summary
from memrl.io import cut_torn_tail, jsonl_lines
from memrl.rollout import turn_log_records
from memrl.scoring import score_answer

if TYPE_CHECKING:
    from memrl.config import Config
    from memrl.data.records import QuestionRecord
    from memrl.task import Task

RESULTS_FILE = "results.jsonl"
SUMMARY_FILE = "summary.json"
RUN_FILE = "eval_run.json"
METRICS = ("em", "sub_em", "f1")
# The scorer named per `task.answer_extractor`; `boxed` keeps the name earlier runs recorded, so they resume.
SCORERS = {"boxed": "memrl.scoring.score_answer (HotpotQA normalization, last \\boxed{})",
           "therefore": "memrl.scoring.score_answer (HotpotQA normalization, line after the last 'the answer is')"}


class EvalError(ValueError, MemrlError):
    """An evaluation that cannot run or resume as asked; the message says what to change."""


# ------------------------------------------------------------------------------------------ format identity

def _sha256_text(text: Any) -> str:
    return hashlib.sha256(json.dumps(text, ensure_ascii=False, sort_keys=True).encode()).hexdigest()


def tokenizer_fingerprint(tokenizer: Any) -> str:
    """SHA-256 of the tokenizer's vocabulary (token -> id): equal for the same tokenizer wherever it is loaded."""
    return _sha256_text(sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1]))


def eval_format(cfg: Config, tokenizer: Any, stop_token_ids: Sequence[int]) -> dict[str, Any]:
    """The controlled variables two evaluations must share to be comparable (checked by `memrl compare`)."""
    sampling, task = cfg.sampling, cfg.task
    fmt = {
        "final_tokens": task.final_tokens, "n_samples": 1,
        "temperature": sampling.temperature, "top_p": sampling.top_p, "seed": sampling.seed,
        "enable_thinking": task.enable_thinking,
        "chat_template_sha256": _sha256_text(getattr(tokenizer, "chat_template", None)),
        "tokenizer_sha256": tokenizer_fingerprint(tokenizer),
        "stop_token_ids": sorted(int(t) for t in stop_token_ids),
        "scorer": SCORERS[task.answer_extractor],
    }
    if task.answer_after_think:  # the scorer reads less of each answer (only when on: older runs resume)
        fmt["answer_after_think"] = True
    return {**task_identity(task), **fmt}


def task_identity(task: TaskSettings) -> dict[str, Any]:
    """The task's own settings (those its Settings adds to `TaskSettings`), read off its fields whatever their
    names: text (a template) as its SHA-256 under `<name>_sha256`, a switch only when on and a field marked
    `IDENTITY_WHEN_CHANGED` only when not at its default (so runs recorded before either existed resume),
    any other value as it is."""
    identity: dict[str, Any] = {}
    for name, field in type(task).model_fields.items():
        value = getattr(task, name)
        at_default = value == field.default and (field.json_schema_extra or {}).get(IDENTITY_WHEN_CHANGED)
        if name in TaskSettings.model_fields or (field.annotation is bool and not value) or at_default:
            continue
        if field.annotation is str:
            identity[f"{name}_sha256"] = _sha256_text(value)
        else:
            identity[name] = value
    return identity


# ------------------------------------------------------------------------------------------ results file

def sample_line(record: QuestionRecord, traj: Any | None, latency_s: float, error: str | None = None, *,
                task: Task, tokenizer: Any = None) -> dict[str, Any]:
    """One results.jsonl line, scored by `task.score`, with the task's `log_fields`; `traj` None (with
    `error`): the sample failed before generating. With `tokenizer`, every turn too (`trace`, for `memrl view`)."""
    failed = traj is None or traj.status == "failed"
    answer = "" if traj is None else traj.answer
    # The training reward's scorer: a truncated answer (hit final_tokens) scores 0 here too (docs/design.md §2).
    score = task.score(traj, record.answers) if traj is not None else score_answer("", record.answers)
    return {
        "id": record.id, "question": record.question, "golds": list(record.answers),
        "answer": answer, "boxed": None if failed else score.boxed,
        "em": 0.0 if failed else score.em, "sub_em": 0.0 if failed else score.sub_em,
        "f1": 0.0 if failed else score.f1, "missing_box": (not failed) and score.missing_box,
        "status": "failed" if traj is None else traj.status, "error": error if traj is None else traj.error,
        **task.log_fields(traj, "eval"),
        "final_tokens": (traj.turns[-1].response_length if traj is not None and traj.turns
                         and traj.turns[-1].kind == "final" else None),
        "turns": 0 if traj is None else traj.num_turns, "latency_s": round(latency_s, 4),
        **({"trace": turn_log_records(traj, tokenizer)} if traj is not None and tokenizer is not None else {}),
    }


def read_results(path: Path, *, repair: bool = False) -> list[dict[str, Any]]:
    """Lines of a results.jsonl; a torn last line (no newline: a kill mid-write) is ignored, and with
    `repair` cut off the file. Any other bad line, or an id seen twice, is an `EvalError`."""
    if not path.is_file():
        return []
    if repair:
        cut_torn_tail(path)

    def bad_line(number: int, e: Exception) -> EvalError:
        return EvalError(f"{path} line {number} is not valid JSON ({e}); it was not written by memrl eval "
                         f"or was edited; move the file away to start over")

    lines: dict[str, dict[str, Any]] = {}
    for number, line in jsonl_lines(path, bad_line, torn_tail=True):
        if not isinstance(line, dict) or not isinstance(line.get("id"), str):
            raise EvalError(f"{path} line {number} has no string 'id'; move the file away to start over")
        if line["id"] in lines:  # two runs mixed in one file, or a line written twice
            raise EvalError(f"{path} line {number}: id {line['id']!r} appears twice; move the file away to "
                            f"start over")
        lines[line["id"]] = line
    return list(lines.values())


# ------------------------------------------------------------------------------------------ summary

def summarize_lines(lines: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """Counts and metrics (percent, 95% intervals) over all lines; failed lines count as 0."""
    failed = [line["id"] for line in lines if line.get("status") == "failed"]
    return {
        "total": len(lines), "succeeded": len(lines) - len(failed), "failed": len(failed),
        "missing_boxes": sum(bool(line.get("missing_box")) for line in lines),
        "truncated_answers": sum(line.get("status") == "truncated" for line in lines),
        "metrics": {m: metric_summary([float(line.get(m) or 0.0) for line in lines], binary=m != "f1")
                    for m in METRICS},
        "failed_ids": failed,
    }
