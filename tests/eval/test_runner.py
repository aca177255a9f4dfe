"""`memrl eval` (memrl.eval.runner, memrl.eval.results) and its intervals (memrl.eval.stats).

Most tests use `AnswerEngine`, a scripted engine that reads the question back from the final prompt and
answers `\\boxed{alphaN}` (right) or `\\boxed{wrong}`, so scores are known in advance. The CLI tests run
a tiny random Qwen3 model through the local engine and through `python -m memrl.cli serve`.
Also home of `make_records` / `AnswerEngine` / `run_eval`, which tests/eval/test_compare.py imports.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import httpx
import pytest
import typer
from fake_engine import FakeEngine
from typer.testing import CliRunner

from memrl.config import Config
from memrl.data.records import QuestionRecord, write_jsonl
from memrl.engines.base import GenerationResult
from memrl.eval.results import RESULTS_FILE, SUMMARY_FILE, EvalError, read_results, sample_line
from memrl.eval.runner import evaluate, evaluate_records, load_eval_data, refuse_all_failed
from memrl.eval.stats import bootstrap_interval, mcnemar_p, metric_summary, wilson_interval
from memrl.rollout import request_seed

N_QUESTIONS = 16
SMALL = ["task.chunk_tokens=64", "task.memory_tokens=16", "task.final_tokens=8", "task.max_chunks=2"]
_QUESTION = re.compile(r"What is item (\d+)\?")


def make_records(n: int = N_QUESTIONS, prefix: str = "q") -> list[QuestionRecord]:
    return [QuestionRecord(f"{prefix}{i}", f"What is item {i}?", [f"alpha{i}"],
                           " ".join(f"item{k} is alpha{k}." for k in range(8 + i))) for i in range(n)]


def small_config(sampling: dict | None = None, engine: dict | None = None, **task) -> Config:
    return Config.model_validate({"task": {"chunk_tokens": 32, "memory_tokens": 8, "final_tokens": 32, "max_chunks": 3,
                                           **task},
                                  "sampling": {"temperature": 0.0, **(sampling or {})}, "engine": engine or {},
                                  "eval": {"concurrency": 4}})


class AnswerEngine(FakeEngine):
    """Memory turns answer "ok"; the final turn boxes `alpha{i}` when question i is in `correct`,
    else `wrong`. Questions in `fail` get an error result; after `interrupt_after` final answers the
    engine raises KeyboardInterrupt (a Ctrl-C in the middle of a run). Concurrency is counted by
    FakeEngine.generate."""

    def __init__(self, tokenizer, correct=(), fail=(), unboxed=(), interrupt_after=None, delay_s=0.0):
        super().__init__([], tokenizer.eos_token_id, delay_s=delay_s)
        self.tok, self.correct, self.fail, self.unboxed = tokenizer, set(correct), set(fail), set(unboxed)
        self.interrupt_after, self.finals = interrupt_after, 0
        self.interrupt = None  # set by `interrupted_eval`: cancels the run's main task

    def _one(self, request):
        self.requests.append(request)
        text = self.tok.decode(request.prompt_ids)
        i = int(_QUESTION.search(text).group(1))
        if i in self.fail:
            return GenerationResult.failed("injected failure")
        if "final answer" not in text:
            reply = "ok"
        else:
            if self.interrupt_after is not None and self.finals >= self.interrupt_after and self.interrupt:
                self.interrupt()
                self.interrupt = None
            self.finals += 1
            reply = ("no idea" if i in self.unboxed
                     else f"\\boxed{{{'alpha' + str(i) if i in self.correct else 'wrong'}}}")
        ids = self.tok.encode(reply, add_special_tokens=False)[: request.max_tokens - 1] + [self.tok.eos_token_id]
        return GenerationResult(ids, [-0.5] * len(ids), "stop")

def run_eval(tokenizer, engine, out: Path, records=None, cfg=None, sha="sha-a", **kwargs):
    return evaluate(engine, tokenizer, cfg or small_config(),
                    make_records() if records is None else records, out,
                    model_name="fake-model", data_sha256=sha, progress=False, **kwargs)


def interrupted_eval(tokenizer, engine, out: Path, **kwargs) -> None:
    """Ctrl-C as `asyncio.run` delivers it: the main task is cancelled in the middle of the run.

    (Raising KeyboardInterrupt inside a task instead corrupts CPython 3.11's recursion counter, after
    which pytest cannot render tracebacks; the SIGKILL test below covers a hard kill.)
    """
    async def main():
        engine.interrupt = asyncio.current_task().cancel
        await evaluate_records(engine, tokenizer, small_config(), make_records(), out, model_name="fake-model",
                               data_sha256="sha-a", progress=False, **kwargs)

    with pytest.raises(asyncio.CancelledError):
        asyncio.run(main())


def ids_of(path: Path) -> list[str]:
    return [line["id"] for line in read_results(path / RESULTS_FILE)]


# ------------------------------------------------------------------------------------------ runner

def test_one_line_per_question_and_counts_add_up(tiny_tokenizer, tmp_path):
    engine = AnswerEngine(tiny_tokenizer, correct={0, 1, 2, 3, 5}, fail={5, 9}, unboxed={7})
    summary = run_eval(tiny_tokenizer, engine, tmp_path)
    lines = {line["id"]: line for line in read_results(tmp_path / RESULTS_FILE)}
    assert sorted(lines) == sorted(r.id for r in make_records())
    assert summary["total"] == 16 and summary["succeeded"] == 14 and summary["failed"] == 2
    assert summary["succeeded"] + summary["failed"] == summary["total"]
    assert sorted(summary["failed_ids"]) == ["q5", "q9"] and summary["missing_boxes"] == 1
    # Failed questions stay in the denominator: 4 right out of 16 (q5 would be right but failed).
    assert summary["metrics"]["em"]["value"] == pytest.approx(100 * 4 / 16)
    assert summary["metrics"]["em"]["low"] < 25 < summary["metrics"]["em"]["high"]
    assert lines["q5"]["status"] == "failed" and "injected failure" in lines["q5"]["error"] and lines["q5"]["em"] == 0
    assert lines["q0"]["boxed"] == "alpha0" and lines["q0"]["em"] == 1 and lines["q4"]["boxed"] == "wrong"
    assert lines["q7"]["missing_box"] and lines["q7"]["boxed"] is None
    assert lines["q3"]["num_chunks"] >= 1 and len(lines["q3"]["memory_lengths"]) == lines["q3"]["num_chunks"]
    on_disk = json.loads((tmp_path / SUMMARY_FILE).read_text())
    assert on_disk["metrics"] == summary["metrics"] and on_disk["data"]["sha256"] == "sha-a"
    assert on_disk["format"]["chunk_tokens"] == 32 and "api_key" not in on_disk["config"]["engine"]


def test_a_run_without_one_success_is_refused_with_its_first_error(tiny_tokenizer, tmp_path):
    # `memrl eval` against a dead server exited 0 with "0 succeeded": a run that measured nothing.
    records = make_records(4)
    summary = run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer, fail=range(4)), tmp_path / "all", records)
    with pytest.raises(EvalError, match="all 4 questions failed, so nothing was measured; the first error: "
                                        "memory turn 0: injected failure; fix it and rerun with --retry-failed"):
        refuse_all_failed(summary, tmp_path / "all")
    one = run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer, fail=range(1, 4)), tmp_path / "one", records)
    refuse_all_failed(one, tmp_path / "one")  # one success is a measurement; its failures are in the summary


def test_seeds_are_the_model_independent_eval_seeds_and_concurrency_is_bounded(tiny_tokenizer, tmp_path):
    engine = AnswerEngine(tiny_tokenizer, delay_s=0.01)
    cfg = small_config(sampling={"seed": 77})
    run_eval(tiny_tokenizer, engine, tmp_path, cfg=cfg)
    expected = set()
    for r in make_records():
        traj_requests = [q for q in engine.requests
                         if f"What is item {r.id[1:]}?" in tiny_tokenizer.decode(q.prompt_ids)]
        expected |= {request_seed(77, f"0:{r.id}", 0, t) for t in range(len(traj_requests))}
    assert {q.seed for q in engine.requests} == expected
    assert 1 < engine.max_in_flight <= cfg.eval.concurrency


def test_interrupted_run_resumes_without_duplicates_or_losses(tiny_tokenizer, tmp_path):
    interrupted_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer, correct={1}, interrupt_after=6), tmp_path)
    before = (tmp_path / RESULTS_FILE).read_bytes()
    first = ids_of(tmp_path)
    assert 0 < len(first) < N_QUESTIONS and not (tmp_path / SUMMARY_FILE).exists()
    engine = AnswerEngine(tiny_tokenizer, correct={1, 2})
    summary = run_eval(tiny_tokenizer, engine, tmp_path)
    all_ids = ids_of(tmp_path)
    assert sorted(all_ids) == sorted(r.id for r in make_records()) and len(all_ids) == len(set(all_ids))
    assert (tmp_path / RESULTS_FILE).read_bytes().startswith(before)  # earlier lines untouched
    asked = {int(_QUESTION.search(tiny_tokenizer.decode(r.prompt_ids)).group(1)) for r in engine.requests}
    assert {f"q{i}" for i in asked} == set(all_ids) - set(first)  # only the rest was generated
    assert summary["resumed_from"] == len(first) and summary["total"] == N_QUESTIONS


def test_torn_last_line_is_dropped_and_redone(tiny_tokenizer, tmp_path):
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path, records=make_records(5))
    path = tmp_path / RESULTS_FILE
    lines = path.read_text().splitlines(keepends=True)
    torn_id = json.loads(lines[-1])["id"]
    path.write_text("".join(lines[:-1]) + lines[-1][:25])  # a kill in the middle of the last write
    assert torn_id not in ids_of(tmp_path)
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path, records=make_records(5))
    assert sorted(ids_of(tmp_path)) == sorted(f"q{i}" for i in range(5))


@pytest.mark.slow
def test_sigkilled_process_resumes_exactly_once(tiny_tokenizer, tmp_path):
    """A real kill -9 while lines are being written, then a rerun in this process."""
    tiny_tokenizer.save_pretrained(str(tmp_path / "tok"))  # loading is much faster than building
    out = tmp_path / "out"
    script = textwrap.dedent(f"""
        import sys; sys.path[:0] = [{str(Path(__file__).parent)!r}, {str(Path(__file__).parents[1])!r}]
        from pathlib import Path
        from transformers import AutoTokenizer
        from test_runner import AnswerEngine, run_eval, make_records
        tok = AutoTokenizer.from_pretrained({str(tmp_path / "tok")!r})
        run_eval(tok, AnswerEngine(tok, delay_s=0.05), Path({str(out)!r}), records=make_records(40))
    """)
    proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 60
        while len(ids_of(out)) < 5:
            assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, "the evaluation subprocess wrote no lines in 60 s"
            time.sleep(0.02)
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=10)
    finally:
        if proc.poll() is None:
            proc.kill()
    first = ids_of(out)
    assert len(first) < 40
    summary = run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), out, records=make_records(40))
    all_ids = ids_of(out)
    assert sorted(all_ids) == sorted(f"q{i}" for i in range(40)) and summary["total"] == 40


def test_retry_failed_replaces_failed_lines_only(tiny_tokenizer, tmp_path):
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer, correct={3}, fail={3, 4}), tmp_path)
    kept = {line["id"]: line for line in read_results(tmp_path / RESULTS_FILE) if line["status"] != "failed"}
    again = run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer, fail={4}), tmp_path)  # no retry: nothing to do
    assert again["failed"] == 2 and again["resumed_from"] == N_QUESTIONS
    summary = run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer, correct={3}), tmp_path, retry_failed=True)
    lines = {line["id"]: line for line in read_results(tmp_path / RESULTS_FILE)}
    assert len(read_results(tmp_path / RESULTS_FILE)) == N_QUESTIONS and summary["failed"] == 0
    assert lines["q3"]["em"] == 1 and all(lines[k] == v for k, v in kept.items())


@pytest.mark.parametrize("change, words", [
    ({"sha": "sha-b"}, "data_sha256"),
    ({"cfg": small_config(chunk_tokens=48)}, "format.chunk_tokens: 32 -> 48"),
    ({"records": make_records(3, prefix="x")}, "'q0', which is not among"),
])
def test_resume_refuses_a_folder_of_another_run(tiny_tokenizer, tmp_path, change, words):
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path, records=make_records(3))
    records = change.get("records", make_records(3))
    with pytest.raises(EvalError, match=re.escape(words)):
        run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path, records=records,
                 cfg=change.get("cfg"), sha=change.get("sha", "sha-a"))


def test_corrupt_middle_line_is_an_error_not_a_silent_skip(tiny_tokenizer, tmp_path):
    run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path, records=make_records(3))
    path = tmp_path / RESULTS_FILE
    lines = path.read_text().splitlines(keepends=True)
    path.write_text(lines[0] + "{broken\n" + "".join(lines[1:]))
    with pytest.raises(EvalError, match="line 2 is not valid JSON"):
        run_eval(tiny_tokenizer, AnswerEngine(tiny_tokenizer), tmp_path, records=make_records(3))


def test_load_eval_data_reads_prepared_jsonl_and_ruler_lists(tmp_path):
    write_jsonl(tmp_path / "q.jsonl", make_records(2))
    assert [r.id for r in load_eval_data(tmp_path / "q.jsonl")] == ["q0", "q1"]
    ruler = [{"context": "Document 1:\nT\ntext", "input": "Who?", "answers": ["X"], "num_docs": 1, "index": i}
             for i in range(3)]
    (tmp_path / "eval_1.json").write_text(json.dumps(ruler))
    records = load_eval_data(tmp_path / "eval_1.json")
    assert [r.id for r in records] == ["0", "1", "2"] and records[0].question == "Who?"
    (tmp_path / "bad.txt").write_text("hello")
    with pytest.raises(EvalError, match="neither"):
        load_eval_data(tmp_path / "bad.txt")


# ------------------------------------------------------------------------------------------ stats

@pytest.mark.parametrize("text", ["", "\n\n", "[]"])
def test_a_data_file_without_questions_is_refused_not_scored(tmp_path, text):
    # A "0 questions" summary with exit 0 reads as a finished evaluation; `memrl compare` refuses it later.
    data = tmp_path / ("empty.json" if text == "[]" else "empty.jsonl")
    data.write_text(text)
    with pytest.raises(EvalError, match=f"data file {re.escape(str(data))} holds no questions"):
        load_eval_data(data)
    result = CliRunner().invoke(_app(), ["eval", "--model", str(tmp_path), "--data", str(data),
                                         "--out", str(tmp_path / "out"), "--no-progress"])
    assert result.exit_code == 2 and "holds no questions" in result.output
    assert not (tmp_path / "out" / SUMMARY_FILE).exists()


def test_wilson_interval_known_values():
    low, high = wilson_interval(0, 16)
    assert low == 0 and high == pytest.approx(1.959964**2 / (16 + 1.959964**2), rel=1e-6)
    low, high = wilson_interval(8, 16)
    assert low == pytest.approx(1 - high) and 0.25 < low < 0.5
    assert wilson_interval(16, 16)[1] == 1.0 and wilson_interval(16, 16)[0] < 1
    with pytest.raises(ValueError):
        wilson_interval(17, 16)


def test_bootstrap_interval_contains_the_mean_and_is_deterministic():
    values = [0.0, 0.2, 0.5, 1.0, 1.0, 0.0, 0.3, 0.9] * 4
    low, high = bootstrap_interval(values)
    mean = sum(values) / len(values)
    assert low < mean < high and (low, high) == bootstrap_interval(values)
    assert bootstrap_interval([0.4] * 5) == (0.4, 0.4)
    summary = metric_summary(values, binary=False)
    assert summary["value"] == pytest.approx(100 * mean) and summary["n"] == 32


def test_mcnemar_exact_p():
    assert mcnemar_p(0, 5) == pytest.approx(2 / 32)
    assert mcnemar_p(3, 3) == 1.0 and mcnemar_p(0, 0) == 1.0
    assert mcnemar_p(25, 148) < 1e-10


# ------------------------------------------------------------------------------------------ CLI, tiny model

def _app() -> typer.Typer:
    from memrl.cli import app  # the real app: its handler makes expected errors one line, exit 2

    return app


def _cli_eval(args: list[str]):
    sets = [x for s in [*SMALL, "sampling.temperature=0"] for x in ("--set", s)]
    result = CliRunner().invoke(_app(), ["eval", *args, *sets, "--no-progress"])
    assert result.exit_code == 0, (result.output, result.exception)
    return result


@pytest.fixture(scope="module")
def tiny_setup(tmp_path_factory):
    from memrl.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("tiny_eval")
    model = save_tiny_model(root / "model")
    write_jsonl(root / "heldout.jsonl", make_records())
    local = root / "local"
    _cli_eval(["--model", str(model), "--data", str(root / "heldout.jsonl"), "--out", str(local)])
    return root, model, local


def test_cli_eval_of_a_tiny_model_writes_16_lines_and_a_consistent_summary(tiny_setup):
    root, model, local = tiny_setup
    lines = read_results(local / RESULTS_FILE)
    summary = json.loads((local / SUMMARY_FILE).read_text())
    assert len(lines) == 16 and len({line["id"] for line in lines}) == 16
    assert summary["total"] == 16 == summary["succeeded"] + summary["failed"]
    assert summary["missing_boxes"] == sum(line["missing_box"] for line in lines)
    assert summary["format"]["chunk_tokens"] == 64 and summary["format"]["temperature"] == 0
    assert summary["engine"]["kind"] == "hf" and summary["model"] == str(model)


def test_cli_eval_refusals_exit_2(tiny_setup, tmp_path):
    root, model, _ = tiny_setup
    result = CliRunner().invoke(_app(), ["eval", "--data", str(root / "heldout.jsonl"), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "exactly one of --model" in result.output
    result = CliRunner().invoke(_app(), ["eval", "--server-url", "http://127.0.0.1:1", "--data",
                                         str(root / "heldout.jsonl"), "--out", str(tmp_path)])
    assert result.exit_code == 2 and "--tokenizer" in result.output


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_served_model_gives_the_same_greedy_results_as_the_local_engine(tiny_setup):
    root, model, local = tiny_setup
    port = _free_port()
    server = subprocess.Popen([sys.executable, "-m", "memrl.cli", "serve", "--model", str(model),
                               "--port", str(port), "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env={**os.environ})
    try:
        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None, server.stderr.read().decode()[-2000:]
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "memrl serve did not start in 120 s"
            time.sleep(0.2)
        served = root / "served"
        _cli_eval(["--server-url", f"http://127.0.0.1:{port}", "--tokenizer", str(model),
                   "--data", str(root / "heldout.jsonl"), "--out", str(served)])
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=15)
        except subprocess.TimeoutExpired:
            server.kill()

    def by_id(folder):
        return {line["id"]: {k: v for k, v in line.items() if k != "latency_s"}
                for line in read_results(folder / RESULTS_FILE)}

    assert by_id(served) == by_id(local)
    a, b = (json.loads((f / SUMMARY_FILE).read_text()) for f in (local, served))
    assert a["format"] == b["format"] and a["metrics"] == b["metrics"] and b["engine"]["kind"] == "openai"
    from memrl.eval.compare import compare_results

    assert compare_results([local, served], max_abs_diff={"sub_em": 0.0}).passed


@pytest.mark.parametrize("status", ["complete", "truncated", "failed"])
@pytest.mark.parametrize("answer", ["\\boxed{Paris}", "\\boxed{Paris} and then", "Paris", "\\boxed{Lyon}"])
def test_a_results_line_scores_as_the_training_reward(status, answer):
    # One scorer for training and evaluation (docs/design.md, pitfall "Different scorer in evaluation"): a truncated
    # answer that boxed the right thing is worth 0 as a reward, so it is worth 0 in evaluation too.
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "rl"))
    from traj_factory import make_trajectory

    from memrl.memagent.task import MemAgentTask
    from memrl.task import score_trajectory, trajectory_reward

    traj = make_trajectory("q/s0", "q", 2, reward=None, status=status, answer=answer)
    record = QuestionRecord(id="q", question="Capital of France?", answers=["Paris"], context="", metadata={})
    line = sample_line(record, traj, latency_s=0.1, task=MemAgentTask())
    score = score_trajectory(traj, ["Paris"])
    assert (line["em"], line["sub_em"], line["f1"]) == (score.em, score.sub_em, score.f1)
    assert line["em"] == trajectory_reward(traj, ["Paris"])
    assert line["status"] == status
    if status != "complete":
        assert line["em"] == line["f1"] == 0.0


def test_the_local_engine_times_requests_out_as_the_recipe_says(tmp_path):
    import asyncio

    from memrl.eval.runner import open_engine
    from memrl.tiny import save_tiny_model

    model_dir = save_tiny_model(tmp_path / "tiny", layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64)
    cfg = small_config(engine={"request_timeout_s": 4.0})
    _, engine, info = open_engine(cfg, str(model_dir), None, model_dir)
    try:
        assert info["kind"] == "hf" and engine.request_timeout_s == 4.0
    finally:
        asyncio.run(engine.close())
