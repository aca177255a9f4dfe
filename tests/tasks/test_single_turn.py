"""The second task (memrl.tasks.single_turn) end to end: the plain 1:1 path trains through the same loop with
no row count, and every command runs it, named by `plugins.task` alone."""

import json

import pytest

from memrl.config import Config
from memrl.data.records import QuestionRecord
from memrl.tasks.single_turn import SingleTurnTask
from memrl.tiny import build_tiny_model, build_tiny_tokenizer
from memrl.train.controller import Trainer, TrainOptions

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


def first_token_even(traj, golds):
    return float(traj.turns[0].response_ids[0] % 2 == 0)


def test_single_turn_task_trains_one_row_per_trajectory(tmp_path):
    tok = build_tiny_tokenizer()
    cfg = Config.model_validate({
        "task": {"final_tokens": 4}, "sampling": {"n_samples": 4}, "engine": {"max_batch_size": 8},
        "train": {"num_rollout": 2, "rollout_batch_size": 2, "lr": 1e-3, "save_interval": 10},
        "plugins": {"task": "memrl.tasks.single_turn:SingleTurnTask",
                    "reward_function": f"{__name__}:first_token_even"},
    })
    records = [QuestionRecord(id=f"q{k}", question="Which city?", answers=["Paris"], context=f"Text {k}: Paris.",
                              metadata={}) for k in range(3)]
    model = build_tiny_model(len(tok), layers=1, hidden=32, heads=4, kv_heads=2, intermediate=64,
                             eos_token_id=tok.eos_token_id)
    history = Trainer(cfg, TrainOptions(run_root=tmp_path, progress=False), model=model, tokenizer=tok,
                      records=records).run()
    # 2 questions x 4 samples x 1 turn = 8 rows, no row count announced
    assert [m["rows/consumed"] for m in history] == [8, 8]
    assert all(m["rows/saved"] == m["rows/transferred"] == 8 for m in history)
    lines = (tmp_path / "logs" / "metrics.jsonl").read_text().splitlines()
    assert len(lines) == 2 and json.loads(lines[1])["rollout_id"] == 1


class OneBrokenEngine:
    """Answers every request, but raises for the one whose seed is `broken` (a server that drops a request)."""

    def __init__(self, broken, stop_id):
        self.broken, self.stop_id = broken, stop_id

    async def generate(self, requests):
        from memrl.engines.base import GenerationResult

        (request,) = requests
        if request.seed == self.broken:
            raise ConnectionError("server gone")
        return [GenerationResult([5, self.stop_id], [-0.1, -0.2], "stop")]


def test_an_engine_exception_fails_one_trajectory_and_drops_its_group_not_the_step():
    import asyncio

    from memrl.rollout import RolloutContext, request_seed

    tok = build_tiny_tokenizer()
    cfg = Config.model_validate({"task": {"final_tokens": 4}, "sampling": {"n_samples": 2},
                                 "plugins": {"task": "memrl.tasks.single_turn:SingleTurnTask"}})
    records = [QuestionRecord(f"q{k}", "Which city?", ["Paris"], f"Text {k}: Paris.") for k in range(2)]
    ctx = RolloutContext(engine=None, tokenizer=tok, config=cfg, reward_function=first_token_even, progress=False)
    kept, broken = ctx.groups(records)
    ctx.engine = OneBrokenEngine(request_seed(cfg.sampling.seed, broken.key, 1, 0), tok.eos_token_id)
    out = asyncio.run(SingleTurnTask().generate(ctx, records))
    assert [t.trajectory_id for t in out.trajectories] == [kept.trajectory_id(0), kept.trajectory_id(1)]
    assert [(t.status, t.error) for t in out.dropped] == [("complete", None),
                                                         ("failed", "final turn 0: ConnectionError: server gone")]
    assert out.metrics["groups/dropped"] == 1.0


def test_how_answers_are_read_is_recorded_for_this_task_too():
    """task.answer_extractor / answer_after_think are settings every task shares: the framework's final turn
    records them (memrl.rollout), so the reward and `memrl eval` read a single-turn answer as the run asks."""
    import asyncio

    from memrl.rollout import RolloutContext

    tok = build_tiny_tokenizer()
    for on in (True, False):
        cfg = Config.model_validate({"task": {"final_tokens": 4, "answer_after_think": on, "answer_extractor":
                                              "therefore"}, "sampling": {"n_samples": 1},
                                     "plugins": {"task": "memrl.tasks.single_turn:SingleTurnTask"}})
        ctx = RolloutContext(engine=OneBrokenEngine(-1, tok.eos_token_id), tokenizer=tok, config=cfg,
                             reward_function=first_token_even, progress=False)
        records = [QuestionRecord("q0", "Which city?", ["Paris"], "Text: Paris.")]
        (traj,) = asyncio.run(SingleTurnTask().generate(ctx, records)).trajectories
        assert (traj.metadata["answer_after_think"], traj.metadata["answer_extractor"]) == (on, "therefore")


# ------------------------------------------------------------------------------------------ every command
# The second task through `memrl train` (with validation), `memrl eval`, `memrl pass-at-k` and `memrl view`,
# named only by `plugins.task`: a subclass that records who asked for which group (issue 25).

CALLS: list[tuple[str, str, int]] = []


class RecordingTask(SingleTurnTask):
    async def sample_group(self, ctx, group, n):
        CALLS.append((ctx.phase, group.group_id, n))
        return await super().sample_group(ctx, group, n)


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    from memrl.data.manifest import write_manifest
    from memrl.data.records import write_jsonl
    from memrl.tiny import save_tiny_model

    root = tmp_path_factory.mktemp("single_turn")
    model = save_tiny_model(root / "model", layers=1, hidden=32)
    records = [QuestionRecord(f"q{i}", "Which city?", ["Paris"], f"Text {i}: Paris.") for i in range(3)]
    write_jsonl(root / "data" / "hotpotqa_train.jsonl", records)
    write_jsonl(root / "data" / "hotpotqa_heldout.jsonl", records[:2])
    write_manifest(root / "data", {"hotpotqa_train.jsonl": 3, "hotpotqa_heldout.jsonl": 2}, "test", {})
    return root, model


def invoke(*args):
    from typer.testing import CliRunner

    from memrl.cli import app

    CALLS.clear()
    result = CliRunner().invoke(app, [str(a) for a in args])
    assert result.exit_code == 0, (result.output, result.exception)
    return result.output


TASK = ["--set", f"plugins.task={__name__}:RecordingTask", "--set", "task.final_tokens=4"]


def assert_shown_by_the_base_default(path, n):
    """`memrl view` asks the run's task what to show (`Task.view_fields`): the single-turn task keeps the
    base default, so its one turn's text and no MemAgent field (chunks, truncations, gold hits)."""
    from memrl.viewer.build import view_data

    results = [r for item in view_data(path)["items"] for r in item["r"]]
    assert len(results) == n
    assert all([t[0] for t in r["t"]] == ["final"] and r["t"][0][1] for r in results)
    assert not {"nc", "mt", "dt", "dtok", "cg"} & {key for r in results for key in r}


def test_the_second_task_trains_and_validates_through_memrl_train(folders, tmp_path):
    root, model = folders
    invoke("train", "--run-root", tmp_path / "run", "--no-progress", *TASK, "--set", f"model.path={model}",
           "--set", f"data.dir={root / 'data'}", "--set", "sampling.n_samples=2", "--set", "train.rollout_batch_size=2",
           "--set", "train.num_rollout=1", "--set", "train.eval_interval=1")
    assert CALLS == [("train", "r0:0:q0", 2), ("train", "r0:1:q1", 2), ("eval", "eval:q0", 1), ("eval", "eval:q1", 1)]
    log = [json.loads(line) for line in (tmp_path / "run" / "logs" / "rollouts" / "rollout_0000000.jsonl").open()]
    assert len(log) == 4 and all([t["kind"] for t in r["turns"]] == ["final"] for r in log)
    assert "num_chunks" not in log[0]  # MemAgent's fields are MemAgent's
    lines = [json.loads(line) for line in next((tmp_path / "run" / "eval" / "heldout").glob("*/results.jsonl")).open()]
    assert [(line["id"], line["turns"]) for line in lines] == [("q0", 1), ("q1", 1)]
    assert "trajectories" in invoke("view", tmp_path / "run")
    assert_shown_by_the_base_default(tmp_path / "run", 4)


def test_the_second_task_through_memrl_eval_pass_at_k_and_view(folders, tmp_path):
    root, model = folders
    data = root / "data" / "hotpotqa_heldout.jsonl"
    invoke("eval", "--model", model, "--data", data, "--out", tmp_path / "eval", "--no-progress", *TASK)
    assert sorted(CALLS) == [("eval", "eval:q0", 1), ("eval", "eval:q1", 1)]
    lines = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").open()]
    assert [[t["kind"] for t in line["trace"]] for line in lines] == [["final"], ["final"]]
    assert "2 questions" in invoke("view", tmp_path / "eval")
    assert_shown_by_the_base_default(tmp_path / "eval", 2)
    invoke("pass-at-k", "--model", model, "--data", data, "--out", tmp_path / "counts.json", "--k", 3, *TASK)
    assert sorted(CALLS) == [("train", "r0:0:q0", 3), ("train", "r0:1:q1", 3)]
    assert set(json.loads((tmp_path / "counts.json").read_text())["pass_counts"]) == {"q0", "q1"}
