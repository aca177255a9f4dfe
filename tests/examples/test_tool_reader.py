"""examples/tasks/tool_reader.py: the search reader's one masked row (its queries and answer trained, the
passages BM25 found spliced in untrained), and the task through train, eval, pass@k and view, named only by
`plugins.task`."""

import asyncio
import json

import pytest
from example_runs import invoke, model_and_data
from scripted_engine import ScriptedEngine

from examples.tasks.tool_reader import ToolReaderTask
from memrl.config import Config
from memrl.data.records import QuestionRecord
from memrl.rollout import UNTRAINED_LOG_PROB, RolloutContext
from memrl.task import convert_one_row_per_trajectory
from memrl.tiny import build_tiny_tokenizer

pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")

TASK_PATH = "examples.tasks.tool_reader:ToolReaderTask"
DOCUMENT = ("The river runs north through the valley and the farms along it grow wheat. " * 3
            + "The Eiffel Tower stands in Paris and was built in 1889. "
            + "The mountain to the east is covered in snow for most of the year. " * 3)
RECORD = QuestionRecord("q0", "Which city has the Eiffel Tower?", ["Paris"], DOCUMENT)


def sample(reply, **task):
    tok = build_tiny_tokenizer()
    cfg = Config.model_validate({"task": {"final_tokens": 16, "passage_tokens": 24, "top_k": 1, **task},
                                 "sampling": {"n_samples": 1}, "plugins": {"task": TASK_PATH}})
    engine = ScriptedEngine(tok, reply)
    ctx = RolloutContext(engine=engine, tokenizer=tok, config=cfg, progress=False,
                         reward_function=ToolReaderTask().reward)
    out = asyncio.run(ToolReaderTask().generate(ctx, [RECORD]))
    return tok, engine, out.trajectories[0]


def test_a_search_splices_the_passage_it_found_untrained_and_the_answer_is_read_from_the_model_alone():
    tok, engine, traj = sample(lambda prompt: "\\boxed{Paris}" if "Passages found" in prompt else "Eiffel Tower")
    (turn,) = traj.turns
    assert turn.kind == "final" and traj.status == "complete" and traj.reward == 1.0
    (search,) = traj.metadata["searches"]
    assert search["query"] == "Eiffel Tower"
    inserted = [t for t, m in zip(turn.response_ids, turn.loss_mask, strict=True) if not m]
    assert "Eiffel Tower stands in Paris" in tok.decode(inserted)  # BM25's best passage
    assert all(lp == UNTRAINED_LOG_PROB for lp, m in zip(turn.rollout_log_probs, turn.loss_mask, strict=True) if not m)
    # the second request continues the first one's tokens exactly: the query, its <|im_end|>, the results
    first, second = engine.requests
    assert second.prompt_ids[:len(first.prompt_ids)] == first.prompt_ids
    assert tok.decode(second.prompt_ids[len(first.prompt_ids):]).startswith("Eiffel Tower<|im_end|>\n<|im_start|>user")
    assert traj.answer.startswith("Eiffel Tower") and traj.answer.endswith("\\boxed{Paris}")
    (row,) = convert_one_row_per_trajectory([traj], Config().algorithm, 0)
    assert row.tokens == turn.prompt_ids + turn.response_ids and row.loss_mask == turn.loss_mask  # passages: 0


def test_an_answer_without_a_search_ends_the_turn_and_searches_stop_at_max_searches():
    _, engine, traj = sample(lambda prompt: "\\boxed{Paris}")
    assert (len(engine.requests), traj.metadata["searches"], traj.reward) == (1, [], 1.0)
    _, engine, traj = sample(lambda prompt: "tower", max_searches=2)
    assert len(engine.requests) == 3 and len(traj.metadata["searches"]) == 2 and traj.reward == 0.0


def test_a_query_bm25_cannot_use_gets_the_first_passages():
    _, _, traj = sample(lambda prompt: "\\boxed{x}" if "Passages found" in prompt else "the of and")
    assert traj.metadata["searches"][0]["passages"] == [0]


# ------------------------------------------------------------------------------------------ every command

@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    records = [QuestionRecord(f"q{i}", RECORD.question, ["Paris"], DOCUMENT) for i in range(3)]
    return model_and_data(tmp_path_factory.mktemp("tool_reader"), records)


TASK = ["--set", f"plugins.task={TASK_PATH}", "--set", "task.final_tokens=6", "--set", "task.passage_tokens=32"]


def test_the_tool_reader_trains_evaluates_counts_pass_at_k_and_is_viewed(folders, tmp_path):
    root, model = folders
    invoke("train", "--run-root", tmp_path / "run", "--no-progress", *TASK, "--set", f"model.path={model}",
           "--set", f"data.dir={root / 'data'}", "--set", "sampling.n_samples=2", "--set", "train.rollout_batch_size=2",
           "--set", "train.num_rollout=2")
    metrics = [json.loads(line) for line in (tmp_path / "run" / "logs" / "metrics.jsonl").open()]
    assert [m["rows/consumed"] for m in metrics] == [4, 4]  # 2 questions x 2 samples, one row each
    log = [json.loads(line) for line in (tmp_path / "run" / "logs" / "rollouts" / "rollout_0000000.jsonl").open()]
    assert all([t["kind"] for t in r["turns"]] == ["final"] and len(r["searches"]) == 1 for r in log)

    data = root / "data" / "hotpotqa_heldout.jsonl"
    invoke("eval", "--model", model, "--data", data, "--out", tmp_path / "eval", "--no-progress", *TASK)
    lines = [json.loads(line) for line in (tmp_path / "eval" / "results.jsonl").open()]
    assert [line["id"] for line in lines] == ["q0", "q1"] and all(len(line["searches"]) == 1 for line in lines)
    invoke("pass-at-k", "--model", model, "--data", data, "--out", tmp_path / "counts.json", "--k", 2, *TASK)
    assert set(json.loads((tmp_path / "counts.json").read_text())["pass_counts"]) == {"q0", "q1"}
    for folder in (tmp_path / "run", tmp_path / "eval"):
        page = tmp_path / f"{folder.name}.html"
        invoke("view", folder, "--out", page, "--task", TASK_PATH)
        assert "Which city has the Eiffel Tower?" in page.read_text()
