"""`memrl view`: one self-contained HTML page (inline CSS and JS, no server, no network) of what the agent
remembered, question by question, from an eval folder (results.jsonl; `--compare` a second one), a rollout
log (RUN_ROOT/logs/rollouts/rollout_*.jsonl) or a run root (every rollout log, grouped by step).

What it shows of a trajectory beyond answer, scores and turn texts is a Task's (`Task.view_fields`): the one
the user names (`--task`), else the run's `plugins.task` when memrl ships it (`SHIPPED_TASKS`), else the
base Task's (text only, with a note on the page). A viewed folder names its task as data: it is compared
with memrl's own, never imported, so a folder someone sent cannot run code (`os:abort`, `pdb:set_trace`).
Gold ranges and scores are computed here (`memrl.scoring`), so the page's script
stays small and cannot disagree with memrl. The page builds every element with textContent, never
innerHTML, and the data's `<`, `>`, `&` are escaped, so no model output can run or close the element.
Every record is checked as it is read (a bad one is a one-line `ViewerError` naming file, line and field).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, NamedTuple

from memrl.config import PluginConfig, task_instance
from memrl.errors import MemrlError
from memrl.eval.results import RESULTS_FILE, SUMMARY_FILE
from memrl.io import atomic_write_text, jsonl_lines
from memrl.scoring import ANSWER_EXTRACTORS, gold_spans, score_answer
from memrl.task import Task
from memrl.viewer.fields import KINDS, check_kinds, short_value

TEMPLATE = Path(__file__).with_name("template.html")
DATA_MARKER = "__MEMRL_VIEW_DATA__"
ROLLOUT_GLOB = "rollout_*.jsonl"
VIEW_FILE = "viewer.html"
# The tasks memrl ships: a viewed folder may name one of these, and only these, to have its fields shown.
SHIPPED_TASKS = ("memrl.memagent.task:MemAgentTask", "memrl.tasks.single_turn:SingleTurnTask")
_SCRIPT_ESCAPES = str.maketrans({"<": "\\u003c", ">": "\\u003e", "&": "\\u0026",  # see embed_json
                                 "\u2028": "\\u2028", "\u2029": "\\u2029"})


class ViewerError(ValueError, MemrlError):
    """A path or file the viewer cannot read; the message says what to pass instead."""


class Checked(NamedTuple):
    """One record as the page reads it: the record, its turns and its task's display fields."""

    record: dict[str, Any]
    turns: list[dict[str, Any]]
    view: dict[str, Any]


# ------------------------------------------------------------------------------------------ record checks

_COMMON = {"question": "str", "golds": "strs", "answer": "str", "status": "str", "error": "str", "reward": "number",
           "advantage": "number"}
# An eval line (memrl.eval.results.sample_line): `trace` holds its turns, `turns` counts them.
EVAL_FIELDS = {**_COMMON, "id": "str", "boxed": "str", "em": "number", "f1": "number", "sub_em": "number",
               "trace": "list", "turns": "count"}
# A rollout log record (memrl.train.controller.trajectory_log_record).
ROLLOUT_FIELDS = {**_COMMON, "trajectory_id": "id", "question_id": "id", "group_id": "str", "sample_index": "count",
                  "turns": "list"}
# (fields, the id every record must have, the field holding its turns) of each kind of file.
EVAL_LINE = (EVAL_FIELDS, "id", "trace")
ROLLOUT_RECORD = (ROLLOUT_FIELDS, "trajectory_id", "turns")
TURN_FIELDS = {"kind": "str", "text": "str", "prompt_length": "count", "response_length": "count",
               "finish_reason": "str", "advantage": "number"}


def _check_fields(record: Any, fields: dict[str, str], where: str, required: str | None = None) -> None:
    if not isinstance(record, dict):
        raise ViewerError(f"{where} is {type(record).__name__}, not an object; pass a file memrl wrote")
    if required is not None and record.get(required) is None:
        raise ViewerError(f"{where} has no '{required}'; pass a file memrl wrote")
    try:
        check_kinds(record, fields)
    except ValueError as e:
        raise ViewerError(f"{where}: {e}; pass a file memrl wrote") from e


def _check_record(record: Any, kind: tuple[dict[str, str], str, str], where: str, task: Task) -> Checked:
    """`record` as the page reads it (`kind`: EVAL_LINE or ROLLOUT_RECORD), its turns and the task's
    display fields (`Task.view_fields`), or a ViewerError naming `where` and the field that is wrong."""
    fields, required, turns_field = kind
    _check_fields(record, fields, where, required)
    turns = record.get(turns_field) or []
    for k, turn in enumerate(turns):
        _check_fields(turn, TURN_FIELDS, f"{where}, turn {k}")
    try:
        view = task.view_fields(record, turns)
    except ValueError as e:
        raise ViewerError(f"{where}: {e}; pass a file memrl wrote") from e
    return Checked(record, turns, view)


# ------------------------------------------------------------------------------------------ records

def _turns(turns: list[dict[str, Any]], golds: list[str]) -> list[list[Any]]:
    """[kind, text, prompt tokens, response tokens, finish reason, gold ranges, credit] per turn."""
    return [[t.get("kind"), t.get("text") or "", t.get("prompt_length"), t.get("response_length"),
             t.get("finish_reason"), [list(s) for s in gold_spans(t.get("text") or "", golds)], t.get("advantage")]
            for t in turns]


def _result(checked: Checked, golds: list[str], scoring: dict[str, Any] | None = None) -> dict[str, Any]:
    """One run's answer to one question, from an eval line (`trace`, its own scores) or a rollout log record
    (`turns`, scored with the run's `scoring`: `score_answer`'s extractor and after_think), with the task's
    display fields."""
    line = checked.record
    answer = line.get("answer") or ""
    if "em" in line:  # an eval line: its own scores
        boxed, em, f1, sub_em = line.get("boxed"), line.get("em"), line.get("f1"), line.get("sub_em")
        reward = line.get("reward", em)  # the training reward is the EM (memrl.task.trajectory_reward)
    else:  # a rollout record: scored here as eval scores it; a truncated answer scores 0 (docs/design.md §2)
        score = score_answer(answer, golds, **(scoring or {}))
        done = line.get("status") == "complete"
        boxed, em, f1, sub_em = score.boxed, score.em * done, score.f1 * done, score.sub_em * done
        reward = line.get("reward")
    return {"a": answer, "b": boxed, "em": em, "f1": f1, "sub": sub_em, "rw": reward, "st": line.get("status"),
            "err": line.get("error"), "adv": line.get("advantage"), "at": line.get("status") == "truncated",
            "t": _turns(checked.turns, golds), **checked.view}


def _golds(line: dict[str, Any]) -> list[str]:
    return list(line.get("golds") or [])


def _read_jsonl(path: Path, kind: tuple[dict[str, str], str, str], task: Task) -> list[Checked]:
    """The checked records (`_check_record`) of a JSON-lines file memrl wrote; a torn last line is left out."""

    def bad_line(number: int, e: Exception) -> ViewerError:
        return ViewerError(f"{path} line {number} is not a JSON record memrl wrote ({type(e).__name__}: {e}); "
                           f"pass a file memrl wrote")

    try:
        lines = jsonl_lines(path, bad_line, torn_tail=True, nan_ok=False)
    except OSError as e:
        raise ViewerError(f"{path} cannot be read ({e.strerror}); pass a file memrl wrote") from e
    return [_check_record(record, kind, f"{path} line {number}", task) for number, record in lines]


class TaskChoice:
    """Which Task shows each viewed file's own fields (module docstring): `spec`, the class the user named
    (`--task`, checked as `plugins.task` is), else the file's task if memrl ships it, else the base Task
    with a note (`notes`, shown on the page)."""

    def __init__(self, spec: str | None = None) -> None:
        self.chosen = task_instance(spec, "--task") if spec else None
        self.notes: list[str] = []

    def __call__(self, name: Any, where: Path) -> Task:
        if self.chosen is not None:
            return self.chosen
        name = PluginConfig().task if name is None else name  # files from before tasks were recorded
        dotted = {shipped.replace(":", "."): shipped for shipped in SHIPPED_TASKS}
        if isinstance(name, str) and name.replace(":", ".") in dotted:
            return task_instance(dotted[name.replace(":", ".")])
        self.notes.append(f"{where} names the task {short_value(name)}, which memrl does not ship: shown without "
                          f"its own fields (memrl view imports no code a folder names); pass --task "
                          f"{name if isinstance(name, str) else 'module:Class'} to show them with that class")
        return Task()


# ------------------------------------------------------------------------------------------ sources

def _summary(folder: Path) -> dict[str, Any]:
    """An eval folder's summary.json, or {} while the run has not written it (or it is unreadable: only
    the title and the task's view come from it)."""
    try:
        summary = json.loads((folder / SUMMARY_FILE).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return summary if isinstance(summary, dict) else {}


def _eval_lines(folder: Path, pick: TaskChoice) -> list[Checked]:
    config = _summary(folder).get("config")
    plugins = config.get("plugins") if isinstance(config, dict) else None
    task = pick(plugins.get("task") if isinstance(plugins, dict) else None, folder / SUMMARY_FILE)
    lines = _read_jsonl(folder / RESULTS_FILE, EVAL_LINE, task)
    if not lines:
        raise ViewerError(f"{folder / RESULTS_FILE} holds no results; run `memrl eval --out {folder}` first")
    return lines


def _eval_data(folder: Path, other: Path | None, pick: TaskChoice) -> dict[str, Any]:
    """Questions of one eval folder, or of two (same questions, in the first folder's order)."""
    runs = [folder] if other is None else [folder, other]
    by_run = [{line.record["id"]: line for line in _eval_lines(f, pick)} for f in runs]
    if other is not None and set(by_run[0]) != set(by_run[1]):
        only_a, only_b = sorted(set(by_run[0]) - set(by_run[1])), sorted(set(by_run[1]) - set(by_run[0]))
        raise ViewerError(f"{folder} and {other} hold different questions ({len(only_a)} only in the first, e.g. "
                          f"{only_a[:3]}; {len(only_b)} only in the second, e.g. {only_b[:3]}); compare evaluations "
                          f"of the same data and --limit")
    items = []
    for qid, first in by_run[0].items():
        golds = _golds(first.record)
        items.append({"id": qid, "q": first.record.get("question") or "", "g": golds,
                      "r": [_result(lines[qid], golds) for lines in by_run]})
    return {"kind": "eval", "runs": [_run_name(f) for f in runs], "items": items, "steps": [],
            "warning": _compare_warning(folder, other)}


def _run_name(folder: Path) -> str:
    name = folder.resolve().name
    model = _summary(folder).get("model")
    return f"{name} ({Path(model).name})" if isinstance(model, str) and model else name


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


def _run_config(run_root: Path | None, pick: TaskChoice) -> tuple[dict[str, Any], Task]:
    """How the run's logs are scored (`score_answer`'s extractor and after_think: `task.answer_extractor`,
    default `boxed`, and `task.answer_after_think`) and its Task, from config.yaml."""
    import yaml

    config = run_root / "config.yaml" if run_root is not None else None
    if config is None or not config.is_file():
        return {}, pick(None, Path("config.yaml"))
    try:
        values = yaml.safe_load(config.read_text(encoding="utf-8")) or {}
    except (OSError, ValueError, yaml.YAMLError) as e:
        raise ViewerError(f"{config} is not a YAML config memrl wrote ({e}); pass a run root memrl wrote") from e
    section = {k: values.get(k) if isinstance(values, dict) and isinstance(values.get(k), dict) else {}
               for k in ("task", "plugins")}
    extractor = section["task"].get("answer_extractor") or "boxed"
    if extractor not in ANSWER_EXTRACTORS:
        raise ViewerError(f"{config}: task.answer_extractor is {short_value(extractor)}, expected one of "
                          f"{', '.join(ANSWER_EXTRACTORS)}; pass a run root memrl wrote")
    after_think = section["task"].get("answer_after_think", False)
    if not isinstance(after_think, bool):
        raise ViewerError(f"{config}: task.answer_after_think is {short_value(after_think)}, expected true or false; "
                          f"pass a run root memrl wrote")
    return {"extractor": extractor, "after_think": after_think}, pick(section["plugins"].get("task"), config)


def _step_rewards(run_root: Path | None) -> dict[int, float | None]:
    """`reward/mean` of each logged step (logs/metrics.jsonl); a non-finite one is shown as missing."""
    from memrl.train.run_log import read_metrics

    if run_root is None:
        return {}
    try:
        metrics = {int(m["rollout_id"]): m.get("reward/mean") for m in read_metrics(run_root)}
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ViewerError(f"{run_root / 'logs' / 'metrics.jsonl'} cannot be read ({type(e).__name__}: {e}); pass a "
                          f"run root memrl wrote") from e
    return {k: v if KINDS["number"][0](v) else None for k, v in metrics.items()}


def _rollout_data(path: Path, pick: TaskChoice) -> dict[str, Any]:
    """Every trajectory of the rollout logs, one item each, and per step its GRPO groups."""
    files = _rollout_files(path)
    run_root = path if path.is_dir() and (path / "logs").is_dir() else None
    scoring, task = _run_config(run_root, pick)
    rewards = _step_rewards(run_root)
    items: list[dict[str, Any]] = []
    steps = []
    for file in files:
        rollout_id = int(file.stem.rpartition("_")[2]) if file.stem.rpartition("_")[2].isdigit() else len(steps)
        groups: dict[str, dict[str, Any]] = {}
        for checked in _read_jsonl(file, ROLLOUT_RECORD, task):
            record, golds = checked.record, _golds(checked.record)
            # Logs written before group ids were recorded: the trajectory id is "<group id>:s<sample>".
            group_id = record.get("group_id") or str(record.get("trajectory_id", "")).rpartition(":s")[0]
            group = groups.setdefault(group_id, {"gid": group_id, "qid": record.get("question_id"), "items": []})
            group["items"].append(len(items))
            items.append({"id": str(record.get("trajectory_id")), "qid": record.get("question_id"),
                          "q": record.get("question") or "", "g": golds, "step": rollout_id,
                          "r": [_result(checked, golds, scoring)]})
        steps.append({"id": rollout_id, "reward": rewards.get(rollout_id), "groups": list(groups.values())})
    return {"kind": "train", "runs": [path.resolve().name], "items": items, "steps": steps, "warning": None}


def view_data(path: Path, compare: Path | None = None, task: str | None = None) -> dict[str, Any]:
    """The page's data for `path` (an eval folder, a rollout log or a run root), `compare` a second eval folder;
    `task` the user's `module:Class` whose `view_fields` show each record (`TaskChoice`)."""
    path = Path(path)
    if not path.exists():
        raise ViewerError(f"{path} does not exist; pass an eval folder, a rollout log or a training run root")
    is_eval = path.is_dir() and (path / RESULTS_FILE).is_file()
    compare = Path(compare) if compare is not None else None
    if compare is not None and not (is_eval and (compare / RESULTS_FILE).is_file()):
        raise ViewerError(f"--compare needs two eval folders (each with {RESULTS_FILE}); got {path} and {compare}")
    pick = TaskChoice(task)
    data = _eval_data(path, compare, pick) if is_eval else _rollout_data(path, pick)
    data["warning"] = "; ".join(filter(None, [data["warning"], *pick.notes])) or None
    data["title"] = " vs ".join(data["runs"])
    return data


# ------------------------------------------------------------------------------------------ page

def embed_json(data: Any) -> str:
    """JSON that is safe inside a <script> element: no `<`, `>` or `&` (so no `</script>` or `<!--`) and no
    U+2028/U+2029; JSON.parse reads the escapes back as the same characters."""
    return json.dumps(data, ensure_ascii=False, separators=(",", ":"), allow_nan=False).translate(_SCRIPT_ESCAPES)


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


def write_viewer(path: Path, compare: Path | None = None, out: Path | None = None,
                 task: str | None = None) -> tuple[Path, dict[str, Any]]:
    """Build the page for `path` (and `compare`, `task`: `view_data`) and write it atomically; returns (file, data)."""
    data = view_data(path, compare, task)
    target = Path(out) if out is not None else default_out(path, compare)
    target.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(target, render_html(data))
    return target, data
