"""examples/tasks/early_exit.py, the early-exit reader of issue 36: its exit decision and reward on a scripted
reader, then 2 training steps, `memrl eval`, `memrl pass-at-k` and `memrl view` on the tiny model, named by
`plugins.task` alone."""

from __future__ import annotations

import asyncio
import json

import pytest
from example_runs import invoke, model_and_data
from scripted_engine import ScriptedEngine

from examples.tasks.early_exit import EarlyExitTask, commits
from memrl.config import Config
from memrl.data.records import QuestionRecord
from memrl.data.synthetic import answer_text, fact_text, question_text, task_tokenizer
from memrl.rl.turn_rewards import score_turns
from memrl.rollout import GroupSlot, RolloutContext, finish_rollout
from memrl.task import task_reward
from memrl.types import Trajectory, Turn

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TASK = "examples.tasks.early_exit:EarlyExitTask"
KEY = ("color", "bram", "teal")
OTHERS = [("city", "cora", "oslo"), ("pet", "dax", "otter"), ("food", "elin", "plum"), ("tool", "finn", "ladle"),
          ("color", "gale", "amber"), ("city", "hugo", "lima"), ("pet", "ida", "falcon"), ("food", "jora", "mango")]


def record(key_chunk: int, chunks: int = 3) -> QuestionRecord:
    """A synthetic document of `chunks` chunks of 3 facts, the answer's fact first in chunk `key_chunk`."""
    facts = OTHERS[: 3 * chunks - 1]
    facts.insert(3 * key_chunk, KEY)
    return QuestionRecord(f"q{key_chunk}of{chunks}", question_text(*KEY[:2]), [KEY[2]],
                          " ".join(fact_text(*f) for f in facts))


def reply(prompt: str) -> str:
    """A reader that keeps the fact once it has read it and, asked for an answer (a probe or the final turn),
    boxes the fact it holds, else "unknown", as the demo's warm start does."""
    if " text : " in prompt:  # a memory turn (the toy template)
        return fact_text(*KEY) if KEY[2] in prompt else fact_text(*KEY[:2], "unknown")
    return answer_text(KEY[2] if KEY[2] in prompt else "unknown")


def config(*sets: str) -> Config:
    """The CPU demo's recipe (its templates and sizes: 3 facts a chunk, at most 3 chunks) with the early-exit reader."""
    from memrl.apps.demo import RECIPE
    from memrl.config import load_config

    return load_config(RECIPE, [f"plugins.task={TASK}", *sets])


def sample(rec: QuestionRecord, n: int = 2) -> list[Trajectory]:
    cfg, task, tok = config("algorithm.reward_weights.unread=0.5"), EarlyExitTask(), task_tokenizer()
    ctx = RolloutContext(engine=ScriptedEngine(tok, reply), tokenizer=tok, config=cfg,
                         reward_function=task_reward(cfg, task), progress=False)
    return asyncio.run(task.sample_group(ctx, GroupSlot(0, rec, f"0:{rec.id}"), n))


def kinds(traj: Trajectory) -> list[str]:
    return [t.kind for t in traj.turns]


def test_a_reader_that_knows_the_answer_stops_there_with_its_probe_as_the_final_turn():
    traj = sample(record(key_chunk=1))[0]
    assert kinds(traj) == ["memory", "probe", "memory", "final"] and traj.metadata["stopped_reading"]
    assert KEY[2] in traj.answer and traj.status == "complete"
    assert traj.metadata["reward_terms"] == {"outcome": 1.0, "unread": pytest.approx(1 / 3)}
    assert traj.reward == pytest.approx(1 + 0.5 / 3)  # EM + 0.5 x the third of the document left unread
    assert EarlyExitTask().log_fields(traj, "eval")["chunks_read"] == 2
    assert traj.metadata["final_memory_length"] > 0  # the memory its answer read, as for a reader that read on


def test_a_reader_that_has_not_found_it_reads_every_chunk():
    traj = sample(record(key_chunk=2))[0]
    assert kinds(traj) == ["memory", "probe", "memory", "probe", "memory", "final"]  # 2 x max_chunks rows
    assert "stopped_reading" not in traj.metadata and traj.metadata["reward_terms"] == {"outcome": 1.0, "unread": 0.0}
    assert len(traj.turns) == EarlyExitTask().max_rows_per_trajectory(config())
    one = sample(record(key_chunk=0, chunks=1))[0]
    assert kinds(one) == ["memory", "final"] and one.metadata["reward_terms"] == {"outcome": 1.0, "unread": None}
    assert one.reward == 1.0  # nothing to skip in a one-chunk document: the term does not apply


def test_only_a_finished_boxed_answer_other_than_the_pass_answer_commits():
    def answered(text, status="complete"):
        return Trajectory("t", "g", 0, [Turn(0, "final", [1], [2], [-1.0], [1], "stop", 4)], status=status,
                          answer=text)

    assert commits(answered("\\boxed{ teal }"), "unknown")
    assert not commits(answered("\\boxed{ unknown }"), "unknown")
    assert not commits(answered("\\boxed{ Unknown. }"), "unknown")  # compared as answers are (normalised)
    assert not commits(answered("teal"), "unknown")  # no box: no answer yet
    assert not commits(answered("\\boxed{ teal }", status="truncated"), "unknown")  # cut off at its limit


def test_a_group_whose_samples_stop_at_different_chunks_trains_one_row_per_turn():
    # Sample 0 finds the answer in the second chunk and stops, sample 1 reads on to the third (the scripted
    # reader is deterministic, so its samples come from two documents, put in one group).
    eager, full = sample(record(key_chunk=1))[0], sample(record(key_chunk=2))[1]
    full.group_id = eager.group_id
    assert [len(t.turns) for t in (eager, full)] == [4, 6]
    assert full.reward == 1.0 and eager.reward > 1.0  # both right, the eager one read less
    out = finish_rollout([[eager, full]])
    rows = EarlyExitTask().convert(out.trajectories, config().algorithm, 0)
    assert len(rows) == out.train_row_count == 10
    advantages = {r.trajectory_id: r.trajectory_advantage for r in rows}
    assert advantages[eager.trajectory_id] > 0 > advantages[full.trajectory_id]
    assert out.metrics["reward/unread"] == pytest.approx(1 / 6)  # (1/3 + 0) / 2
    metrics = score_turns(out.trajectories, task_tokenizer(), config().algorithm, EarlyExitTask())
    # the j-th memory turn's recall, probes between them not counted: the fact is in memory 1 of the eager
    # sample, in memory 2 of the other
    assert {k: v for k, v in metrics.items() if "turn_" in k} == {"memory/gold_recall/turn_0": 0.0,
                                                                 "memory/gold_recall/turn_1": 0.5,
                                                                 "memory/gold_recall/turn_2": 1.0}
    assert metrics["reading/chunk_share"] == 5 / 6 and metrics["reading/stopped_early"] == 0.5


# ------------------------------------------------------------------------------------------ every command

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    records = [QuestionRecord(f"q{i}", "Which city?", ["Paris"], f"Text {i}: the city is Paris, not Rome or Lima.")
               for i in range(3)]
    return model_and_data(tmp_path_factory.mktemp("early_exit"), records)


SETS = [f"plugins.task={TASK}", "task.chunk_tokens=6", "task.max_chunks=2", "task.memory_tokens=4",
        "task.final_tokens=4", "algorithm.reward_weights.unread=0.5"]
FLAGS = [arg for s in SETS for arg in ("--set", s)]


def test_the_early_exit_reader_through_train_eval_pass_at_k_and_view(folders, tmp_path):
    root, model = folders
    run = tmp_path / "run"
    invoke("train", "--run-root", run, "--no-progress", *FLAGS, "--set", f"model.path={model}", "--set",
           f"data.dir={root / 'data'}", "--set", "sampling.n_samples=2", "--set", "train.rollout_batch_size=2",
           "--set", "train.num_rollout=2", "--set", "train.eval_interval=2")
    metrics = [json.loads(line) for line in (run / "logs" / "metrics.jsonl").open()]
    assert len(metrics) == 2 and all({"reward/unread", "reading/chunk_share"} <= set(m) for m in metrics)
    log = [json.loads(line) for line in (run / "logs" / "rollouts" / "rollout_0000001.jsonl").open()]
    assert len(log) == 4 and all(set(r["reward_terms"]) == {"outcome", "unread"} for r in log)
    for r in log:  # a memory turn per chunk read, a probe between two, then the answer
        assert [t["kind"] for t in r["turns"]] == ["memory", "probe"] * (r["chunks_read"] - 1) + ["memory", "final"]
    heldout = [json.loads(line) for line in next((run / "eval" / "heldout").glob("*/results.jsonl")).open()]
    assert [line["id"] for line in heldout] == ["q0", "q1"] and all(line["chunks_read"] >= 1 for line in heldout)
    assert "trajectories" in invoke("view", run, "--task", TASK)

    data = root / "data" / "hotpotqa_heldout.jsonl"
    invoke("eval", "--model", model, "--data", data, "--out", tmp_path / "eval", "--no-progress", *FLAGS[:-2])
    lines = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").open()]
    assert all(line["chunks_read"] >= 1 and line["trace"][-1]["kind"] == "final" for line in lines)
    assert "2 questions" in invoke("view", tmp_path / "eval", "--task", TASK)
    invoke("pass-at-k", "--model", model, "--data", data, "--out", tmp_path / "counts.json", "--k", 2, *FLAGS[:-2])
    assert set(json.loads((tmp_path / "counts.json").read_text())["pass_counts"]) == {"q0", "q1"}
