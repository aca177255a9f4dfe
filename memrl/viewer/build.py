"""`memrl view`: one self-contained HTML file (inline CSS and JS, no server, no network) showing what the
agent remembered, question by question, from files runs already write:

    an eval folder          results.jsonl (memrl.eval.results; `--compare` a second one for flips)
    a rollout log           RUN_ROOT/logs/rollouts/rollout_XXXXXXX.jsonl (memrl.train.controller)
    a training run root     every rollout log under it, with logs/metrics.jsonl, grouped by step

Everything that needs the scorer is computed here, in Python, so the page's script stays small and
cannot disagree with memrl: where each gold occurs in each memory (`memrl.scoring.gold_spans`; chunk
occurrences were recorded by the run, as logs keep no chunk text), the extracted answer and its score.

The page (template.html) builds every element with textContent, never innerHTML, so model outputs and
documents containing HTML are shown as text; the data is one JSON script element whose `<`, `>`, `&`
are escaped, so no string in it can close the element.

Compact data: each result is a short-keyed object and each turn an array; a question's detail is only
rendered when it is opened, and the list shows a page of rows at a time.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from memrl.data.manifest import atomic_write_text
from memrl.eval.results import RESULTS_FILE, SUMMARY_FILE, read_results
from memrl.scoring import gold_spans, score_answer

TEMPLATE = Path(__file__).with_name("template.html")
DATA_MARKER = "__MEMRL_VIEW_DATA__"
ROLLOUT_GLOB = "rollout_*.jsonl"
VIEW_FILE = "viewer.html"


class ViewerError(ValueError):
    """A path the viewer cannot read; the message says what to pass instead."""


# ------------------------------------------------------------------------------------------ records

def _turns(turns: list[dict[str, Any]], golds: list[str]) -> list[list[Any]]:
    """[kind, text, prompt tokens, response tokens, finish reason, gold ranges, credit] per turn."""
    return [[t.get("kind"), t.get("text") or "", t.get("prompt_length"), t.get("response_length"),
             t.get("finish_reason"), [list(s) for s in gold_spans(t.get("text") or "", golds)], t.get("advantage")]
            for t in turns]


def _result(line: dict[str, Any], golds: list[str], extractor: str) -> dict[str, Any]:
    """One run's answer to one question, from an eval line (`trace`) or a rollout log record (`turns`)."""
    turns = line.get("trace") if isinstance(line.get("trace"), list) else line.get("turns")
    turns = turns if isinstance(turns, list) else []
    answer = line.get("answer") or ""
    if "em" in line:  # an eval line: its own scores
        boxed, em, f1, sub_em = line.get("boxed"), line.get("em"), line.get("f1"), line.get("sub_em")
        reward = line.get("reward", em)  # the training reward is the EM (memrl.memagent.reward)
    else:  # a rollout record: scored here as eval scores it; a truncated answer scores 0 (docs/design.md §2)
        score = score_answer(answer, golds, extractor)
        done = line.get("status") == "complete"
        boxed, em, f1, sub_em = score.boxed, score.em * done, score.f1 * done, score.sub_em * done
        reward = line.get("reward")
    memory_turns = [t for t in turns if t.get("kind") == "memory"]
    memory_truncations = line.get("memory_truncations")
    if memory_truncations is None:
        memory_truncations = sum(t.get("finish_reason") == "length" for t in memory_turns)
    num_chunks = line.get("num_chunks")
    return {
        "a": answer, "b": boxed, "em": em, "f1": f1, "sub": sub_em, "rw": reward, "st": line.get("status"),
        "err": line.get("error"), "adv": line.get("advantage"),
        "nc": num_chunks if num_chunks is not None else len(memory_turns),
        "mt": int(memory_truncations), "at": line.get("status") == "truncated", "dt": bool(line.get("document_truncated")),
        "dtok": line.get("document_tokens"), "cg": line.get("chunk_golds"), "t": _turns(turns, golds),
    }


def _golds(line: dict[str, Any]) -> list[str]:
    golds = line.get("golds")
    return [g for g in golds if isinstance(g, str)] if isinstance(golds, list) else []


def _read_jsonl(path: Path) -> list[dict[str, Any]]:
    lines = []
    for number, raw in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if raw.strip():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError as e:
                raise ViewerError(f"{path} line {number} is not valid JSON ({e}); pass a file memrl wrote") from e
    return lines


# ------------------------------------------------------------------------------------------ sources

def _eval_lines(folder: Path) -> list[dict[str, Any]]:
    lines = read_results(folder / RESULTS_FILE)
    if not lines:
        raise ViewerError(f"{folder / RESULTS_FILE} holds no results; run `memrl eval --out {folder}` first")
    return lines


def _eval_data(folder: Path, other: Path | None) -> dict[str, Any]:
    """Questions of one eval folder, or of two (same questions, in the first folder's order)."""
    runs = [folder] if other is None else [folder, other]
    by_run = [{line["id"]: line for line in _eval_lines(f)} for f in runs]
    if other is not None and set(by_run[0]) != set(by_run[1]):
        only_a, only_b = sorted(set(by_run[0]) - set(by_run[1])), sorted(set(by_run[1]) - set(by_run[0]))
        raise ViewerError(f"{folder} and {other} hold different questions ({len(only_a)} only in the first, e.g. "
                          f"{only_a[:3]}; {len(only_b)} only in the second, e.g. {only_b[:3]}); compare evaluations "
                          f"of the same data and --limit")
    items = []
    for qid, first in by_run[0].items():
        golds = _golds(first)
        items.append({"id": qid, "q": first.get("question") or "", "g": golds,
                      "r": [_result(lines[qid], golds, "boxed") for lines in by_run]})
    return {"kind": "eval", "runs": [_run_name(f) for f in runs], "items": items, "steps": [],
            "warning": _compare_warning(folder, other)}


def _run_name(folder: Path) -> str:
    summary = folder / SUMMARY_FILE
    name = folder.resolve().name
    try:
        model = json.loads(summary.read_text(encoding="utf-8")).get("model") if summary.is_file() else None
    except json.JSONDecodeError:
        model = None
    return f"{name} ({Path(str(model)).name})" if model else name


def _compare_warning(folder: Path, other: Path | None) -> str | None:
    """What `memrl compare` refuses about the two folders (shown above the list), or None."""
    if other is None:
        return None
    from memrl.eval.compare import CompareError, compare_results

    try:
        compare_results([folder, other], names=["first", "second"])
    except CompareError as e:
        return f"memrl compare refuses these results: {e}"
    return None


def _rollout_files(path: Path) -> list[Path]:
    if path.is_file():
        return [path]
    logs = path / "logs" / "rollouts"
    files = sorted(logs.glob(ROLLOUT_GLOB)) if logs.is_dir() else sorted(path.glob(ROLLOUT_GLOB))
    if not files:
        raise ViewerError(f"{path} is neither an eval folder ({RESULTS_FILE}), a rollout log ({ROLLOUT_GLOB}) nor a "
                          f"training run root (logs/rollouts/{ROLLOUT_GLOB}); pass one of these")
    return files


def _answer_extractor(run_root: Path | None) -> str:
    """The run's `rollout.answer_extractor` from its config.yaml (the logs score with it), else `boxed`."""
    import yaml

    config = run_root / "config.yaml" if run_root is not None else None
    if config is None or not config.is_file():
        return "boxed"
    rollout = (yaml.safe_load(config.read_text(encoding="utf-8")) or {}).get("rollout") or {}
    return str(rollout.get("answer_extractor") or "boxed")


def _rollout_data(path: Path) -> dict[str, Any]:
    """Every trajectory of the rollout logs, one item each, and per step its GRPO groups."""
    from memrl.train.run_log import read_metrics

    files = _rollout_files(path)
    run_root = path if path.is_dir() and (path / "logs").is_dir() else None
    extractor = _answer_extractor(run_root)
    metrics = {int(m["rollout_id"]): m for m in read_metrics(run_root)} if run_root is not None else {}
    items: list[dict[str, Any]] = []
    steps = []
    for file in files:
        rollout_id = int(file.stem.rpartition("_")[2]) if file.stem.rpartition("_")[2].isdigit() else len(steps)
        groups: dict[str, dict[str, Any]] = {}
        for record in _read_jsonl(file):
            golds = _golds(record)
            # Logs written before group ids were recorded: the trajectory id is "<group id>:s<sample>".
            group_id = record.get("group_id") or str(record.get("trajectory_id", "")).rpartition(":s")[0]
            group = groups.setdefault(group_id, {"gid": group_id, "qid": record.get("question_id"), "items": []})
            group["items"].append(len(items))
            items.append({"id": str(record.get("trajectory_id")), "qid": record.get("question_id"),
                          "q": record.get("question") or "", "g": golds, "step": rollout_id,
                          "r": [_result(record, golds, extractor)]})
        reward = metrics.get(rollout_id, {}).get("reward/mean")
        steps.append({"id": rollout_id, "reward": reward, "groups": list(groups.values())})
    return {"kind": "train", "runs": [path.resolve().name], "items": items, "steps": steps, "warning": None}


def view_data(path: Path, compare: Path | None = None) -> dict[str, Any]:
    """The page's data for `path` (an eval folder, a rollout log or a run root), `compare` a second eval folder."""
    path = Path(path)
    if not path.exists():
        raise ViewerError(f"{path} does not exist; pass an eval folder, a rollout log or a training run root")
    is_eval = path.is_dir() and (path / RESULTS_FILE).is_file()
    if compare is not None:
        compare = Path(compare)
        if not is_eval or not (compare / RESULTS_FILE).is_file():
            raise ViewerError(f"--compare needs two eval folders (each with {RESULTS_FILE}); got {path} and {compare}")
        data = _eval_data(path, compare)
    else:
        data = _eval_data(path, None) if is_eval else _rollout_data(path)
    data["title"] = " vs ".join(data["runs"])
    return data


# ------------------------------------------------------------------------------------------ page

def embed_json(data: Any) -> str:
    """JSON that is safe inside a <script> element: no `<`, `>` or `&` (so no `</script>` or `<!--`) and no
    U+2028/U+2029; JSON.parse reads the escapes back as the same characters."""
    text = json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
    for char, escape in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                         ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escape)
    return text


def render_html(data: dict[str, Any]) -> str:
    template = TEMPLATE.read_text(encoding="utf-8")
    head, marker, tail = template.partition(DATA_MARKER)
    if not marker:
        raise ViewerError(f"{TEMPLATE} has no {DATA_MARKER}; reinstall memrl")
    return head + embed_json(data) + tail


def default_out(path: Path, compare: Path | None = None) -> Path:
    """Where `memrl view` writes without `--out`: viewer.html in the eval folder / run root (beside a log file)."""
    path = Path(path)
    if compare is not None:
        return path.resolve().parent / f"viewer_{path.resolve().name}_vs_{Path(compare).resolve().name}.html"
    return (path.parent if path.is_file() else path) / (f"viewer_{path.stem}.html" if path.is_file() else VIEW_FILE)


def write_viewer(path: Path, compare: Path | None = None, out: Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Build the page for `path` (and `compare`) and write it atomically; returns (file, data)."""
    data = view_data(path, compare)
    target = Path(out) if out is not None else default_out(path, compare)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, render_html(data))
    return target, data
